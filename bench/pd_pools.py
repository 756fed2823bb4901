"""Drives the Ray pools directly (no HTTP) with a mixed short/long workload and compares
all-colocated, all-disaggregated and length-split routing: TTFT, TPOT, throughput, and the
KV transfer time per disaggregated request.

    python bench/pd_pools.py [--model DIR] [--requests 48] [--rate 3] [--split 512]

The same two workers serve every mode: colocated mode uses both as whole-request workers,
the other modes use one as the prefill worker and one as the decode worker.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.common import bench_model  # noqa: E402


def pct(values, q):
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]


def workload(args, vocab: int):
    rng = random.Random(args.seed)
    items = []
    for i in range(args.requests):
        long = rng.random() < args.long_fraction
        n = rng.randint(*(args.long_len if long else args.short_len))
        items.append((f"r{i}", [rng.randrange(5, vocab) for _ in range(n)]))
    return items


async def run_mode(client, mode: str, items, args) -> dict:
    from pd_runtime.workers.client import PoolClient

    params = dict(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    if mode == "colocated":  # both workers serve whole requests
        client = PoolClient([], client.prefill + client.decode)
    records = []

    async def one(rid, prompt, delay):
        await asyncio.sleep(delay)
        disagg = mode == "disaggregated" or (mode == "length-split" and len(prompt) > args.split)
        start = time.perf_counter()
        first = last = None
        n = 0
        kv_s = None
        async for chunk in client.generate(f"{mode}-{rid}", prompt, params, disaggregate=disagg):
            now = time.perf_counter()
            if chunk.error is not None:
                raise RuntimeError(f"{chunk.error.type}: {chunk.error.message}")
            if chunk.token_ids:
                first = first or now
                last = now
                n += len(chunk.token_ids)
            if chunk.kv_transfer_s is not None:
                kv_s = chunk.kv_transfer_s
        records.append(dict(ttft=first - start, tpot=(last - first) / max(1, n - 1), tokens=n,
                            prompt=len(prompt), disagg=disagg, kv_s=kv_s))

    rng = random.Random(args.seed + 1)
    t, delays = 0.0, []
    for _ in items:
        t += rng.expovariate(args.rate)
        delays.append(t)
    start = time.perf_counter()
    await asyncio.gather(*(one(rid, p, d) for (rid, p), d in zip(items, delays)))
    elapsed = time.perf_counter() - start
    ttft = [r["ttft"] for r in records]
    tpot = [r["tpot"] for r in records]
    kv = [r["kv_s"] for r in records if r["kv_s"] is not None]
    slo_ok = sum(1 for r in records if r["ttft"] <= args.slo_ttft and r["tpot"] <= args.slo_tpot)
    return dict(mode=mode, elapsed=elapsed, throughput=sum(r["tokens"] for r in records) / elapsed,
                ttft_p50=pct(ttft, 50), ttft_p99=pct(ttft, 99), tpot_p50=pct(tpot, 50),
                tpot_p99=pct(tpot, 99), kv_p50=pct(kv, 50) if kv else None,
                kv_p99=pct(kv, 99) if kv else None, disagg=sum(r["disagg"] for r in records),
                goodput=slo_ok / elapsed, slo_ok=slo_ok, n=len(records))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--rate", type=float, default=3.0, help="requests per second (Poisson)")
    ap.add_argument("--short-len", type=int, nargs=2, default=[32, 128])
    ap.add_argument("--long-len", type=int, nargs=2, default=[768, 1536])
    ap.add_argument("--long-fraction", type=float, default=0.25)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--split", type=int, default=512, help="length-split threshold (tokens)")
    ap.add_argument("--slo-ttft", type=float, default=2.0, help="seconds")
    ap.add_argument("--slo-tpot", type=float, default=0.1, help="seconds per output token")
    ap.add_argument("--backend", default="torch_dist", choices=["torch_dist", "ucx"])
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    import json

    import ray

    from pd_runtime.config import EngineConfig, KVTransferConfig
    from pd_runtime.workers.client import PoolClient
    from pd_runtime.workers.pool import start_worker, wait_ready

    model = bench_model(args.model)
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    engine = EngineConfig(model=model, dtype="bfloat16", num_kv_blocks=1024, num_threads=1,
                          max_num_batched_tokens=512)
    kv = KVTransferConfig(backend=args.backend)
    p = start_worker("prefill", "p0", engine, kv, num_cpus=1)
    d = start_worker("decode", "d0", engine, kv, num_cpus=1)
    wait_ready([p, d])
    client = PoolClient([p], [d])
    items = workload(args, vocab)
    # Warm-up: both paths once, so no mode pays first-call costs.
    asyncio.run(run_mode(client, "length-split", items[:4], argparse.Namespace(
        **{**vars(args), "rate": 100.0})))
    print(f"# {args.requests} requests at {args.rate}/s, {args.long_fraction:.0%} long "
          f"({args.long_len[0]}-{args.long_len[1]} tokens), short {args.short_len[0]}-"
          f"{args.short_len[1]}, {args.output_len} output tokens, split at {args.split}, "
          f"kv backend {args.backend}; SLO TTFT<={args.slo_ttft}s TPOT<={args.slo_tpot}s")
    header = (f"{'mode':<14} {'tok/s':>7} {'TTFT p50':>9} {'TTFT p99':>9} {'TPOT p50':>9} "
              f"{'TPOT p99':>9} {'KV p50':>8} {'KV p99':>8} {'disagg':>6} {'goodput':>8}")
    print(header)
    for mode in ("colocated", "disaggregated", "length-split"):
        r = asyncio.run(run_mode(client, mode, items, args))
        kv50 = f"{r['kv_p50'] * 1e3:.1f}ms" if r["kv_p50"] is not None else "-"
        kv99 = f"{r['kv_p99'] * 1e3:.1f}ms" if r["kv_p99"] is not None else "-"
        print(f"{r['mode']:<14} {r['throughput']:>7.1f} {r['ttft_p50']:>8.3f}s "
              f"{r['ttft_p99']:>8.3f}s {r['tpot_p50'] * 1e3:>7.1f}ms {r['tpot_p99'] * 1e3:>7.1f}ms "
              f"{kv50:>8} {kv99:>8} {r['disagg']:>6} {r['goodput']:>6.2f}/s")
    ray.shutdown()


if __name__ == "__main__":
    main()
