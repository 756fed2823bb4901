"""The router's chat stream loop per token (pd_runtime/entrypoints/openai/chunk_events.py
`sse_events`: the chat builder and SSE encoding over one-token chunks of the bench model's
tokenizer), for the source tree given: run it on two trees (a `git worktree` of the commit
before a change, and this one), alternately, to see what the change costs the streaming path.

    .venv/bin/python bench/stream_loop_cost.py [--tree DIR] [--tokens 4000] [--repeats 7]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tree", default=str(Path(__file__).resolve().parent.parent))
    ap.add_argument("--tokens", type=int, default=4000)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    sys.path.insert(0, args.tree)
    from bench.common import bench_model
    from pd_runtime.tokenizer import Tokenizer
    try:
        from pd_runtime.entrypoints.openai.chunk_events import sse_events
        from pd_runtime.entrypoints.openai.request_parsing.protocol import prepare_chat
        from pd_runtime.entrypoints.openai.completion_bodies import ResponseBuilder
    except ImportError:  # a tree from before the HTTP layer left pd_runtime/router/
        try:
            from pd_runtime.router.chunk_events import sse_events
        except ImportError:  # a tree from before pd_runtime/router/chunk_events.py
            from pd_runtime.router.generation import _sse_events as sse_events
        from pd_runtime.router.protocol import prepare_chat
        from pd_runtime.router.responses import ResponseBuilder
    try:
        from pd_runtime.api import StreamChunk
    except ImportError:  # a tree from before the typed chunk: its builder reads dicts
        StreamChunk = dict

    tokenizer = Tokenizer(bench_model(None))
    rng = random.Random(0)
    ids = [rng.randrange(3, tokenizer.vocab_size) for _ in range(args.tokens)]
    chunks = [StreamChunk(text=tokenizer.decode([t]), token_ids=[t],
                          finished=i == len(ids) - 1,
                          finish_reason="length" if i == len(ids) - 1 else None)
              for i, t in enumerate(ids)]
    prepared = prepare_chat({"messages": [{"role": "user", "content": "hi"}], "stream": True,
                             "stream_options": {"include_usage": True}}, tokenizer, "m", 1 << 20)

    async def rest():
        for chunk in chunks[1:]:
            yield 0, chunk

    async def one_pass() -> float:
        builder = ResponseBuilder(prepared, "chatcmpl-x", tokenizer)
        start = time.perf_counter()
        async for _ in sse_events(builder, [(0, chunks[0])], rest(), {}):
            pass
        return time.perf_counter() - start

    best = min(asyncio.run(one_pass()) for _ in range(args.repeats))
    print(f"{args.tree}: {best / len(chunks) * 1e6:.2f} us/token")


if __name__ == "__main__":
    main()
