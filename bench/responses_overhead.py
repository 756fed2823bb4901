"""What a streamed token costs the router on the Responses API against chat completions, in the
same run: the time to turn one worker chunk into its SSE bytes
(pd_runtime/entrypoints/openai/completion_bodies.py's builder for chat;
pd_runtime/entrypoints/openai/responses/events.py's over it for /v1/responses), and the bytes sent
per token.

    .venv/bin/python bench/responses_overhead.py [--tokens 4000] [--repeats 5] [--json FILE]

One token per chunk (a decode step's chunk for one request), text from the bench model's
tokenizer over random token ids; the request as the official client sends it (`stream: true`,
default sampling), prepared by the router's own code. Best of --repeats for each.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import bench_model, machine_line  # noqa: E402
from pd_runtime.api import StreamChunk  # noqa: E402
from pd_runtime.entrypoints.openai.request_parsing.protocol import prepare_chat  # noqa: E402
from pd_runtime.entrypoints.openai.completion_bodies import ResponseBuilder  # noqa: E402
from pd_runtime.entrypoints.openai.responses.request import chat_body  # noqa: E402
from pd_runtime.entrypoints.openai.responses.events import ResponsesBuilder  # noqa: E402
from pd_runtime.gateway.live_run import sse  # noqa: E402
from pd_runtime.tokenizer import Tokenizer  # noqa: E402


def builders(tokenizer, kind: str):
    if kind == "chat":
        prepared = prepare_chat({"messages": [{"role": "user", "content": "hi"}],
                                 "stream": True}, tokenizer, "m", 1 << 20)
        return lambda: ResponseBuilder(prepared, "chatcmpl-x", tokenizer)
    chat, request = chat_body({"input": "hi", "stream": True})
    prepared = prepare_chat(chat, tokenizer, "m", 1 << 20)
    return lambda: ResponsesBuilder(prepared, "resp_x", tokenizer, request)


def one_pass(make, chunks: list[StreamChunk]) -> tuple[float, int]:
    builder = make()
    sent = 0
    start = time.perf_counter()
    for chunk in chunks:
        for payload in builder.events(0, chunk):
            sent += len(sse(payload))
    for payload in builder.closing():
        sent += len(sse(payload))
    return time.perf_counter() - start, sent


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="default: the embedded bench model")
    ap.add_argument("--tokens", type=int, default=4000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    tokenizer = Tokenizer(bench_model(args.model))
    rng = random.Random(0)
    ids = [rng.randrange(3, tokenizer.vocab_size) for _ in range(args.tokens)]
    chunks = [StreamChunk(text=tokenizer.decode([t]), token_ids=[t],
                          finished=i == len(ids) - 1,
                          finish_reason="length" if i == len(ids) - 1 else None)
              for i, t in enumerate(ids)]
    results = {}
    for kind in ("chat", "responses"):
        make = builders(tokenizer, kind)
        one_pass(make, chunks[:200])  # warm
        times, sent = [], 0
        for _ in range(args.repeats):
            elapsed, sent = one_pass(make, chunks)
            times.append(elapsed)
        results[kind] = {"us_per_token": min(times) / len(chunks) * 1e6,
                         "bytes_per_token": sent / len(chunks)}
    ratio = results["responses"]["us_per_token"] / results["chat"]["us_per_token"]
    print(machine_line())
    print(f"{args.tokens} one-token chunks, best of {args.repeats}")
    print(f"{'api':<10} {'us/token':>9} {'bytes/token':>12}")
    for kind, row in results.items():
        print(f"{kind:<10} {row['us_per_token']:>9.1f} {row['bytes_per_token']:>12.0f}")
    print(f"responses / chat time per token: {ratio:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps({**results, "ratio": ratio}, indent=2))


if __name__ == "__main__":
    main()
