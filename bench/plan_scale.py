"""The planner at scale: `pd-runtime plan`'s search for 8 to 512 workers and several prompt
mixes, with the recommended prefill:decode split and threshold, the peak goodput, and the
simulator's own run time; plus the simulator's speed on one long run (a simulated hour of a
100-worker cluster).

    .venv/bin/python bench/plan_scale.py --cost-model FILE [--workers 8 32 128 512]
        [--long-fractions 0.1 0.2 0.5] [--num-requests 4000] [--hour-rate 200]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pd_runtime.config import RoutingConfig, SLOTarget  # noqa: E402
from planner.costs import ClusterCosts  # noqa: E402
from planner.plan import default_rates, plan  # noqa: E402
from planner.simulator import Topology, simulate  # noqa: E402
from planner.workload import Workload  # noqa: E402


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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cost-model", required=True)
    ap.add_argument("--workers", type=int, nargs="+", default=[8, 32, 128, 512])
    ap.add_argument("--long-fractions", type=float, nargs="+", default=[0.1, 0.2, 0.5])
    ap.add_argument("--num-requests", type=int, default=4000, help="simulated per rate")
    ap.add_argument("--hour-rate", type=float, default=200.0, help="0: skip the hour run")
    ap.add_argument("--slo-ttft", type=float, default=2.5)
    ap.add_argument("--slo-tpot", type=float, default=0.1)
    args = ap.parse_args()
    costs = ClusterCosts.load(args.cost_model)
    slo = SLOTarget(ttft_s=args.slo_ttft, tpot_s=args.slo_tpot)
    print("| workers | long share | recommended | threshold | peak goodput/s | at rate/s | "
          "runner-up (goodput/s) | configs | search s |")
    print("|---|---|---|---|---|---|---|---|---|", flush=True)
    for workers in args.workers:
        for share in args.long_fractions:
            workload = Workload(long_fraction=share)
            sample = workload.requests(1.0, num_requests=2000)
            # Three rates around the knee: what the workers could serve, and either side.
            rates = default_rates(costs, workload, workers, sample)[3:6]
            ranked, info = plan(costs, workload, slo, workers, rates=rates,
                                num_requests=args.num_requests)
            best, second = ranked[0], ranked[1] if len(ranked) > 1 else None
            r = best.topology.routing
            threshold = r.max_local_prefill_tokens if r.mode == "auto" else r.mode
            runner = f"{second.name} ({second.peak['goodput_rps']:.1f})" if second else "-"
            print(f"| {workers} | {share:g} | {best.topology.num_prefill}P:"
                  f"{best.topology.num_decode}D | {threshold} | "
                  f"{best.peak['goodput_rps']:.1f} | {best.peak['rate']:g} | {runner} | "
                  f"{info['candidates']} | {info['seconds']:.1f} |", flush=True)
    if args.hour_rate:
        print(hour(costs, args.hour_rate, slo))
    return 0


if __name__ == "__main__":
    sys.exit(main())
