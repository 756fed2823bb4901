"""What the goodput bench sends and when: seeded arrival times (Poisson or gamma gaps) and the
token-id prompts of each workload (fixed, bimodal, multiturn, lengths from a file)."""

from __future__ import annotations

import itertools
import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

from pd_runtime.planner.workload import arrival_offsets  # noqa: F401  (the bench's send times)


# ------------------------------------------------------------------------------------ workload
@dataclass
class RequestSpec:
    index: int
    kind: str            # fixed | short | long | turn<k> | file
    prompt: list[int]
    output_len: int
    conversation: Optional[int] = None  # multiturn
    turn: int = 0


def read_lengths(path: str) -> list[tuple[int, int]]:
    """(input_len, output_len) rows from JSON lines or CSV (a header line is skipped)."""
    rows = []
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        line = line.strip()
        if not line:
            continue
        if line.startswith("{"):
            item = json.loads(line)
            rows.append((int(item["input_len"]), int(item["output_len"])))
            continue
        cells = [c.strip() for c in line.split(",")]
        if not all(c.isdigit() for c in cells[:2]):
            if rows:
                raise ValueError(f"{path}:{number}: expected input_len,output_len, got {line!r}")
            continue
        rows.append((int(cells[0]), int(cells[1])))
    if not rows:
        raise ValueError(f"{path}: no input_len,output_len rows")
    return rows


def requests(args, vocab: int, rng: random.Random) -> Iterator[RequestSpec]:
    """The point's requests in send order; ids in 5..vocab-1 (0-4 are the special tokens)."""
    ids = range(5, vocab)

    def tokens(n: int) -> list[int]:
        return rng.choices(ids, k=n)

    rows = read_lengths(args.lengths_file) if args.workload == "file" else None
    last_turns: list[Optional[RequestSpec]] = [None] * args.conversations
    next_conversation = 0
    for i in itertools.count():
        if args.workload == "fixed":
            yield RequestSpec(i, "fixed", tokens(args.input_len), args.output_len)
        elif args.workload == "bimodal":
            long = rng.random() < args.long_fraction
            yield RequestSpec(i, "long" if long else "short",
                              tokens(args.long_len if long else args.short_len), args.output_len)
        elif args.workload == "file":
            input_len, output_len = rows[i % len(rows)]
            yield RequestSpec(i, "file", tokens(input_len), output_len)
        else:  # multiturn: turn k = turn k-1's prompt + a stand-in reply + a new user message
            prev = last_turns[i % args.conversations]
            if prev is None or prev.turn + 1 >= args.turns:
                spec = RequestSpec(i, "turn0", tokens(args.input_len), args.output_len,
                                   next_conversation)
                next_conversation += 1
            else:
                spec = RequestSpec(i, f"turn{prev.turn + 1}", prev.prompt +
                                   tokens(args.output_len) + tokens(args.user_len),
                                   args.output_len, prev.conversation, prev.turn + 1)
            last_turns[i % args.conversations] = spec
            yield spec
