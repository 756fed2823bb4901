"""The planner at scale: `pd-runtime plan`'s search (each configuration's SLO capacity) for 8
to 128 workers and several prompt mixes, with the recommended prefill:decode split and
threshold and the search's own run time; 512 workers at four prefill shares of the threshold
mode; and the simulator's speed on one long run (a simulated hour of a 100-worker cluster).

    .venv/bin/python bench/plan_scale.py --cost-model FILE [--workers 8 32 128] [--large 512]
        [--long-fractions 0.1 0.2 0.5] [--duration 10] [--hour-rate 150]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pd_runtime.config import RoutingConfig, SLOTarget  # noqa: E402
from pd_runtime.planner.costs import ClusterCosts  # noqa: E402
from pd_runtime.planner.plan import capacity, default_rates, plan  # noqa: E402
from pd_runtime.planner.simulator import Topology, simulate  # noqa: E402
from pd_runtime.planner.workload import Workload  # noqa: E402


def hour(costs: ClusterCosts, rate: float, slo: SLOTarget) -> str:
    """One simulated hour of 25 prefill + 75 decode workers at `rate` requests/s."""
    requests = Workload().requests(rate, duration_s=3600.0, seed=1)
    topology = Topology(25, 75, RoutingConfig(mode="auto", max_prefill_queue_tokens=8192 * 25))
    started = time.monotonic()
    result = simulate(costs, topology, requests, slo)
    took = time.monotonic() - started
    return (f"simulated hour, {topology.name}, {rate:g} req/s: {len(requests)} requests, "
            f"{result['events']} events in {took:.1f}s of run time "
            f"(goodput {result['goodput_rps']:.1f}/s, TTFT p99 {result['ttft_s']['p99']:.2f}s)")


def large(costs: ClusterCosts, workers: int, slo: SLOTarget, duration_s: float) -> None:
    """A pool too large for the whole search in a bench run: the threshold mode's SLO
    capacity at four prefill shares, by the planner's own capacity search."""
    workload = Workload(long_fraction=0.2)
    sample = workload.requests(1.0, num_requests=2000)
    guess = default_rates(costs, workload, workers, sample)[3]
    for share in (0.25, 0.375, 0.5, 0.625):
        prefill = round(workers * share)
        topology = Topology(prefill, workers - prefill, RoutingConfig(
            mode="auto", max_local_prefill_tokens=2047,
            max_prefill_queue_tokens=8192 * prefill))
        started = time.monotonic()
        cand = capacity(costs, topology, workload, slo, duration_s, 0, guess)
        print(f"| {workers} | 0.2 | {topology.name} | SLO capacity {cand.capacity:.0f}/s | "
              f"{len(cand.points)} runs | {time.monotonic() - started:.1f} s |", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cost-model", required=True)
    ap.add_argument("--workers", type=int, nargs="+", default=[8, 32, 128])
    ap.add_argument("--large", type=int, default=512, help="0: skip; searched apart")
    ap.add_argument("--long-fractions", type=float, nargs="+", default=[0.1, 0.2, 0.5])
    ap.add_argument("--duration", type=float, default=10.0, help="simulated s per run")
    ap.add_argument("--hour-rate", type=float, default=150.0, help="0: skip the hour run")
    ap.add_argument("--slo-ttft", type=float, default=2.5)
    ap.add_argument("--slo-tpot", type=float, default=0.1)
    args = ap.parse_args()
    costs = ClusterCosts.load(args.cost_model)
    slo = SLOTarget(ttft_s=args.slo_ttft, tpot_s=args.slo_tpot)
    print("| workers | long share | recommended | threshold | SLO capacity/s | runner-up "
          "(capacity/s) | configs | runs | search s |")
    print("|---|---|---|---|---|---|---|---|---|", flush=True)
    for workers in args.workers:
        for share in args.long_fractions:
            workload = Workload(long_fraction=share)
            ranked, info = plan(costs, workload, slo, workers, duration_s=args.duration)
            best, second = ranked[0], ranked[1] if len(ranked) > 1 else None
            r = best.topology.routing
            threshold = r.max_local_prefill_tokens if r.mode == "auto" else r.mode
            runner = f"{second.name} ({second.score:.1f})" if second else "-"
            print(f"| {workers} | {share:g} | {best.topology.num_prefill}P:"
                  f"{best.topology.num_decode}D | {threshold} | {best.score:.1f} | {runner} | "
                  f"{info['candidates']} | {info['simulations']} | {info['seconds']:.1f} |",
                  flush=True)
    if args.large:
        large(costs, args.large, slo, args.duration / 2)
    if args.hour_rate:
        print(hour(costs, args.hour_rate, slo))
    return 0


if __name__ == "__main__":
    sys.exit(main())
