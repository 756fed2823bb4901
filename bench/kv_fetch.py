"""A prefix another worker holds: fetch its KV from that worker, or compute it again? Two decode
workers on a local Ray (a core each), driven directly (no HTTP). Per prompt length, worker A
computes the prompt first; then worker B serves it either by recomputing the whole prompt, or
by fetching: A, named as the request's prefill worker, computes only what its prefix cache lacks
(the last block's tokens) and ships the KV to B over kv_transfer (the same path as a prefill
worker's). Timed: B's time to its second token (the first that needs the KV on B).

    unshare -n sh -c 'ip link set lo up; exec .venv/bin/python bench/kv_fetch.py'
        [--lengths 16 32 64 128 256 512 1024 2048 3072] [--repeats 3] [--backend torch_dist]

Prints a row per length (recompute and fetch medians, the ratio) and the crossover: the
shortest prompt from which fetching is faster at every longer length measured.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.common import bench_model, machine_line  # noqa: E402


async def timed(client, rid: str, prompt: list[int], **route) -> tuple[float, list[int]]:
    """Seconds to the request's second token, and its tokens (2, greedy)."""
    start = time.perf_counter()
    tokens, second = [], None
    async for chunk in client.generate(rid, prompt, dict(max_tokens=2, temperature=0.0,
                                                         ignore_eos=True), **route):
        if chunk.error is not None:
            raise RuntimeError(f"{rid}: {chunk.error.type}: {chunk.error.message}")
        tokens += chunk.token_ids
        if len(tokens) >= 2 and second is None:
            second = time.perf_counter() - start
    return second, tokens


async def measure(client, lengths: list[int], repeats: int, vocab: int, seed: int,
                  quiet: bool = False) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for n in lengths:
        recompute, fetch = [], []
        for r in range(repeats):
            p, q = ([rng.randrange(5, vocab) for _ in range(n)] for _ in range(2))
            for name, prompt in (("p", p), ("q", q)):  # A computes both
                await timed(client, f"warm-{n}-{r}-{name}", prompt, decode_worker="d0")
            s, local = await timed(client, f"recompute-{n}-{r}", p, decode_worker="d1")
            recompute.append(s)
            s, fetched = await timed(client, f"fetch-{n}-{r}", q, disaggregate=True,
                                     decode_worker="d1", prefill_worker="d0")
            fetch.append(s)
            assert len(local) == len(fetched) == 2
        row = {"tokens": n, "recompute_s": statistics.median(recompute),
               "fetch_s": statistics.median(fetch)}
        row["speedup"] = row["recompute_s"] / row["fetch_s"]
        rows.append(row)
        if not quiet:
            print(f"{n:>6} {row['recompute_s'] * 1e3:>10.1f} {row['fetch_s'] * 1e3:>9.1f} "
                  f"{row['speedup']:>7.2f}x", flush=True)
    return rows


def crossover(rows: list[dict]):
    """The shortest length from which fetching wins at every longer one (None: never)."""
    best = None
    for row in reversed(rows):
        if row["fetch_s"] >= row["recompute_s"]:
            break
        best = row["tokens"]
    return best


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--lengths", type=int, nargs="+",
                    default=[16, 32, 64, 128, 256, 512, 1024, 2048, 3072])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--backend", default="torch_dist", choices=["torch_dist", "ucx"])
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    import ray

    from pd_runtime.config import EngineConfig, KVTransferConfig
    from pd_runtime.workers.client import PoolClient
    from pd_runtime.workers.pool import start_worker, wait_ready

    model = bench_model(args.model)
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    engine = EngineConfig(model=model, num_kv_blocks=2048, num_threads=1)
    kv = KVTransferConfig(backend=args.backend)
    workers = [start_worker("decode", wid, engine, kv, num_cpus=1) for wid in ("d0", "d1")]
    wait_ready(workers)
    client = PoolClient([], workers)
    print(f"# {machine_line()}\n# two decode workers, a core each, dtype {engine.dtype} "
          f"(auto: the checkpoint's where the CPU has fast bf16, else float32), kv backend "
          f"{args.backend}; B's time to its 2nd token, median of {args.repeats}")
    print(f"{'tokens':>6} {'recompute':>10} {'fetch':>9} {'speedup':>8}   (ms)")
    asyncio.run(measure(client, [32], 1, vocab, args.seed + 1, quiet=True))  # first-call costs, unreported
    rows = asyncio.run(measure(client, args.lengths, args.repeats, vocab, args.seed))
    cross = crossover(rows)
    print(f"# crossover: fetching is faster from {cross} tokens on" if cross else
          "# crossover: fetching was never faster at every longer length measured")
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": machine_line(), "rows": rows,
                                               "crossover_tokens": cross}, indent=1))
    ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
