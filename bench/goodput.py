"""Goodput under open-loop load: seeded Poisson or gamma arrivals (or closed-loop clients, or one
burst) of token-id prompts streamed from any OpenAI-compatible /v1/completions endpoint.

    .venv/bin/python bench/goodput.py --rates 1 2 4 8 | --sweep 1 8 1 | --concurrency 4 16 |
        --burst 192 | --search 0.5 16  [--base-url http://127.0.0.1:8000]
        [--workload bimodal|fixed|multiturn|file] [--num-requests 96] [--duration S]
        [--burstiness 1] [--slo-ttft 2.5] [--slo-tpot 0.1] [--attainment 0.9] [--bound]
        [--label NAME] [--json OUT] [--seed 0]

A request is good when it completes with TTFT <= --slo-ttft and TPOT <= --slo-tpot (a refused
or failed one is a miss); a point's attainment is good / sent, per prompt class as well, and
its goodput rate good requests per second from its first scheduled send to its last end.
`--search LOW HIGH` finds goodput as DistServe defines it: the highest offered rate whose
attainment is >= --attainment (rates doubled from LOW until one misses or HIGH passes, then
--search-steps bisections between the last that passed and the first that missed). `--bound`
(implied by --search) measures the box's physical bound for the workload here
(bench/goodput_bound.py) and reports goodput as a fraction of it. Times are
taken from the actual send; the client's own lag (actual - scheduled send) is reported apart.
Prompts are unique per point and seed, so the same seed twice against a running server hits its
prefix cache: restart it or change --seed. Plots: bench/goodput_plot.py.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Optional

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# The parts: goodput_workload (arrivals, prompts), goodput_client (one timed request),
# goodput_load (a point's load, the idle wait), goodput_summary (the arithmetic, the table).
from bench import goodput_bound  # noqa: E402
from bench.goodput_load import PointPlan, run_point, wait_idle  # noqa: E402
from bench.goodput_summary import TABLE_HEADER, summarize, table_row  # noqa: E402
from bench.goodput_workload import arrival_offsets, requests  # noqa: E402

# tests/test_goodput_bench.py reaches these through this module.
from bench.goodput_client import RequestRecord  # noqa: E402,F401
from bench.goodput_load import busy_requests  # noqa: E402,F401
from bench.goodput_workload import read_lengths  # noqa: E402,F401


# ----------------------------------------------------------------------------------------- cli
def plans(args) -> list[PointPlan]:
    if args.burst:
        return [PointPlan(f"burst {args.burst}", None, [0.0] * args.burst)]
    num = args.num_requests if args.num_requests or args.duration else 96
    if args.concurrency:
        return [PointPlan(f"c{n}", None, None, n, num, args.duration) for n in args.concurrency]
    rates = args.rates
    if args.sweep:
        start, stop, step = args.sweep
        rates = [start + i * step for i in range(int((stop - start) / step + 1e-9) + 1)]
    return [open_loop(args, rate, i) for i, rate in enumerate(rates)]


def vocab_size(args) -> int:
    if args.vocab_size:
        return args.vocab_size
    from bench.common import bench_model

    return json.loads((Path(bench_model(args.model_dir)) / "config.json").read_text())[
        "vocab_size"]


def open_loop(args, rate: float, index: int) -> PointPlan:
    num = args.num_requests if args.num_requests or args.duration else 96
    return PointPlan(f"{rate:g}/s", rate, arrival_offsets(
        rate, random.Random(f"{args.seed}:arrivals:{index}"), num, args.duration,
        args.burstiness))


async def search_rates(measure, low: float, high: float, steps: int) -> tuple[float, list]:
    """The highest rate in [low, high] for which `await measure(rate)` is true, assuming it
    holds below some rate and not above: rates double from `low` until one fails (or `high`
    passes), then `steps` bisections between the last pass and the first fail. Returns (that
    rate, or 0.0 when `low` fails; [(rate, passed)] in the order tried)."""
    tried = []
    passed, failed, rate = None, None, low
    while True:
        ok = await measure(rate)
        tried.append((rate, ok))
        if not ok:
            failed = rate
            break
        passed = rate
        if rate >= high:
            break
        rate = min(high, rate * 2)
    if passed is None:
        return 0.0, tried
    for _ in range(steps if failed is not None else 0):
        rate = (passed + failed) / 2
        ok = await measure(rate)
        tried.append((rate, ok))
        passed, failed = (rate, failed) if ok else (passed, rate)
    return passed, tried


async def run(args) -> dict:
    headers = {"content-type": "application/json"}
    if args.api_key:
        headers["authorization"] = f"Bearer {args.api_key}"
    base = args.base_url.rstrip("/")
    timeout = httpx.Timeout(args.request_timeout_s, connect=30.0)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    vocab = vocab_size(args)
    from bench.common import machine_line

    doc = {"label": args.label or base, "machine": machine_line(), "config": vars(args),
           "points": []}
    async with httpx.AsyncClient(headers=headers, timeout=timeout, limits=limits,
                                 trust_env=False) as client:
        model = args.model or (await client.get(f"{base}/v1/models")).json()["data"][0]["id"]
        doc["model"] = model
        print(f"# {doc['label']}: {model} at {base}, {args.workload}, SLO TTFT "
              f"{args.slo_ttft:g}s TPOT {args.slo_tpot * 1e3:g}ms, seed {args.seed}")
        print(TABLE_HEADER, flush=True)
        points = iter(range(10**6))

        async def point(plan: PointPlan) -> dict:
            i = next(points)
            await wait_idle(client, base, args.settle_s, args.idle_timeout_s)
            specs = requests(args, vocab, random.Random(f"{args.seed}:prompts:{i}"))
            cpu_before, started_at = time.process_time(), time.time()
            records = await run_point(client, f"{base}/v1/completions", model, plan, specs,
                                      not args.no_ignore_eos)
            summary = summarize(plan, records, args.slo_ttft, args.slo_tpot)
            # This load generator's own CPU over the point (it may share the server's cores).
            summary["client_cpu_s"] = time.process_time() - cpu_before
            summary["started_at"] = started_at  # wall clock of the records' time 0 (within ms)
            print(table_row(summary), flush=True)
            if "by_kind" in summary:
                print("#   " + "; ".join(
                    f"{k}: {v['attainment']:.0%} good, {v['refused']} of {v['sent']} refused"
                    for k, v in summary["by_kind"].items()), flush=True)
            if summary["first_error"]:
                print(f"#   {summary['failed']} failed, first: {summary['first_error']}",
                      file=sys.stderr)
            doc["points"].append({"summary": summary,
                                  "requests": [asdict(r) for r in records]})
            if args.json:
                Path(args.json).write_text(json.dumps(doc))
            return summary

        if args.search:
            async def passes(rate: float) -> bool:
                summary = await point(open_loop(args, rate, len(doc["points"])))
                return summary["attainment"] >= args.attainment

            best, tried = await search_rates(passes, *args.search, args.search_steps)
            doc["goodput"] = {"rate": best, "attainment": args.attainment, "tried": tried}
        else:
            for plan in plans(args):
                await point(plan)
    if args.bound or args.search:
        doc["bound"] = measure_bound(args, vocab).as_dict()
        print(goodput_bound.line(goodput_bound.Bound(**doc["bound"])))
    if args.search:
        bound = doc.get("bound", {}).get("rps")
        share = f", {best / bound:.0%} of the box's bound" if bound else ""
        print(f"# goodput (DistServe): {best:g} req/s with >= {args.attainment:.0%} of requests "
              f"within both targets{share}; tried " +
              ", ".join(f"{r:g}{'+' if ok else '-'}" for r, ok in tried))
        if args.json:
            Path(args.json).write_text(json.dumps(doc))
    return doc


def measure_bound(args, vocab: int) -> goodput_bound.Bound:
    """The box's bound for this workload's requests (the first point's prompts and outputs)."""
    from bench.common import bench_model

    specs = requests(args, vocab, random.Random(f"{args.seed}:prompts:0"))
    num = args.num_requests or 96
    lengths = [(len(s.prompt), s.output_len) for s, _ in zip(specs, range(num))]
    return goodput_bound.measure(bench_model(args.model_dir), lengths, args.bound_dtype)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    load = ap.add_mutually_exclusive_group(required=True)
    load.add_argument("--rates", type=float, nargs="+", help="open-loop requests per second")
    load.add_argument("--sweep", type=float, nargs=3, metavar=("START", "STOP", "STEP"))
    load.add_argument("--concurrency", type=int, nargs="+", help="closed-loop clients")
    load.add_argument("--burst", type=int, help="this many requests all at once")
    load.add_argument("--search", type=float, nargs=2, metavar=("LOW", "HIGH"),
                      help="goodput: the highest open-loop rate meeting --attainment")
    ap.add_argument("--attainment", type=float, default=0.9,
                    help="--search: the share of requests that must meet both targets")
    ap.add_argument("--search-steps", type=int, default=3, help="--search: bisections")
    ap.add_argument("--bound", action="store_true",
                    help="measure the box's bound for the workload (bench/goodput_bound.py)")
    ap.add_argument("--bound-dtype", default="auto",
                    help="the server's dtype, for the bound (auto: as serve resolves it here)")
    ap.add_argument("--num-requests", type=int, help="per point (default 96 without --duration)")
    ap.add_argument("--duration", type=float, help="per point, seconds of arrivals")
    ap.add_argument("--burstiness", type=float, default=1.0,
                    help="gamma shape of the gaps: CV = 1/sqrt(shape); 1 is Poisson")
    ap.add_argument("--workload", choices=["bimodal", "fixed", "multiturn", "file"],
                    default="bimodal")
    ap.add_argument("--input-len", type=int, default=256, help="fixed; multiturn's first turn")
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--short-len", type=int, default=128, help="bimodal")
    ap.add_argument("--long-len", type=int, default=2048, help="bimodal")
    ap.add_argument("--long-fraction", type=float, default=0.2, help="bimodal")
    ap.add_argument("--conversations", type=int, default=8, help="multiturn: open at a time")
    ap.add_argument("--turns", type=int, default=4, help="multiturn: then a new conversation")
    ap.add_argument("--user-len", type=int, default=64, help="multiturn: new tokens per turn")
    ap.add_argument("--lengths-file", help="file: JSON lines or CSV of input_len,output_len")
    ap.add_argument("--base-url", default="http://127.0.0.1:8000")
    ap.add_argument("--model", help="served model name (default: the first of /v1/models)")
    ap.add_argument("--api-key")
    ap.add_argument("--model-dir", help="for the vocabulary (default: the embedded model)")
    ap.add_argument("--vocab-size", type=int)
    ap.add_argument("--no-ignore-eos", action="store_true")
    ap.add_argument("--slo-ttft", type=float, default=2.5)
    ap.add_argument("--slo-tpot", type=float, default=0.1)
    ap.add_argument("--settle-s", type=float, default=2.0, help="after the server is idle")
    ap.add_argument("--idle-timeout-s", type=float, default=300.0)
    ap.add_argument("--request-timeout-s", type=float, default=600.0)
    ap.add_argument("--label", help="the system's name in the JSON and plots")
    ap.add_argument("--json", help="config, machine, summaries and every request's record")
    ap.add_argument("--seed", type=int, default=0)
    return ap


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    if args.workload == "file" and not args.lengths_file:
        build_parser().error("--workload file needs --lengths-file")
    asyncio.run(run(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
