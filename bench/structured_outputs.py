"""What structured outputs cost the engine: output tokens per second of a batch whose requests
are held to a grammar against the same batch unconstrained, in the same run (`LLM(model)`
defaults on the bench model; the grammar the one thing that differs), and the share of the
constrained run's time spent computing and applying the masks.

Every request runs to exactly --tokens tokens in both runs, so the work is the same: the
unconstrained ones with ignore_eos, the constrained ones under grammars that cannot be complete
by then:
  regex   `[a-z ]{5000}`: one lexeme, but a counted repetition, whose automaton the lexer
          builds a state at a time as each request moves along it (the dear case)
  json    an array of at least 500 objects with a string, an integer and a boolean each (the
          JSON-schema machinery: nested rules, whitespace, escapes)

    .venv/bin/python bench/structured_outputs.py [--batch 1 16 64] [--tokens 64]
        [--repeats 3] [--json FILE]

Each (grammar, batch) runs plain and constrained alternately --repeats times; medians.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import bench_model, machine_line, random_prompts  # noqa: E402
from pd_runtime import LLM, SamplingParams  # noqa: E402

ITEM = {"type": "object", "required": ["name", "count", "ok"], "additionalProperties": False,
        "properties": {"name": {"type": "string"}, "count": {"type": "integer"},
                       "ok": {"type": "boolean"}}}
GRAMMARS = {"regex": {"regex": "[a-z ]{5000}"},
            "json": {"json": {"type": "array", "items": ITEM, "minItems": 500}}}


def timed(llm: LLM, prompts, params) -> tuple[float, int, float]:
    """(seconds, output tokens, seconds inside the grammar masks)."""
    masks = llm.engine.grammars
    spent = [0.0]
    inner = masks.mask

    def mask(logits, rows):
        started = time.perf_counter()
        inner(logits, rows)
        spent[0] += time.perf_counter() - started

    masks.mask = mask
    try:
        started = time.perf_counter()
        outs = llm.generate(prompts, params)
        seconds = time.perf_counter() - started
    finally:
        del masks.mask
    return seconds, sum(len(o.token_ids) for o in outs), spent[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="HF directory (default: the bench model)")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None, help="also write the rows here")
    args = ap.parse_args()
    model = bench_model(args.model)
    llm = LLM(model)
    print(machine_line())
    print(f"model {model}, {args.tokens} output tokens per request, prompts of "
          f"{args.prompt_len} tokens, median of {args.repeats}")
    print(f"{'grammar':8} {'batch':>5} {'plain tok/s':>12} {'held tok/s':>11} {'ratio':>6} "
          f"{'mask share':>10}")
    rows = []
    for name, spec in GRAMMARS.items():
        for batch in args.batch:
            prompts = random_prompts(model, batch, args.prompt_len, seed=batch)
            plain = SamplingParams(max_tokens=args.tokens, temperature=1.0, seed=1,
                                   ignore_eos=True)
            held = SamplingParams(max_tokens=args.tokens, temperature=1.0, seed=1,
                                  structured_outputs=spec)
            free_rates, held_rates, shares = [], [], []
            for _ in range(args.repeats):
                seconds, tokens, _ = timed(llm, prompts, [plain] * batch)
                free_rates.append(tokens / seconds)
                seconds, tokens, in_masks = timed(llm, prompts, [held] * batch)
                assert tokens == batch * args.tokens, "a constrained request ended early"
                held_rates.append(tokens / seconds)
                shares.append(in_masks / seconds)
            row = {"grammar": name, "batch": batch,
                   "plain_tokens_per_s": statistics.median(free_rates),
                   "held_tokens_per_s": statistics.median(held_rates),
                   "mask_share": statistics.median(shares)}
            row["ratio"] = row["held_tokens_per_s"] / row["plain_tokens_per_s"]
            rows.append(row)
            print(f"{name:8} {batch:>5} {row['plain_tokens_per_s']:>12.1f} "
                  f"{row['held_tokens_per_s']:>11.1f} {row['ratio']:>6.2f} "
                  f"{row['mask_share']:>10.1%}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
