"""The planner's simulator against the served product on this machine: the cost model is
calibrated by `pd-runtime profile --url` through the first system's router (the default
deployment, `pd-slo`, unless --systems says otherwise), then each routing mode's server
(`pd-runtime serve`, the default 1 prefill + 1 decode workers; bench/goodput_study.py's
systems) takes the bimodal workload (80% x 128, 20% x 2048 tokens in, 64 out) at each rate
(bench/goodput.py), and the simulator replays exactly the requests each point sent (their send
times and lengths) on the same topology and routing. One table: measured next to simulated,
with the error of each.

    .venv/bin/python bench/sim_accuracy.py --out /tmp/simacc [--rates 1 2 3]
        [--num-requests 60] [--systems pd-slo pd-threshold pd-disagg] [--cost-model FILE]
        [--port 8000] [--calibrate-each] [--profile-repeats N] [--reuse]

Run it inside a network namespace with loopback up (as `make test` does) or on a machine
where Ray may bind the host's address. Every server is stopped after its points.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import bench_model  # noqa: E402
from bench.goodput_study import Server, goodput, write_config  # noqa: E402
from pd_runtime.config import ClusterConfig, SLOTarget  # noqa: E402
from pd_runtime.planner.costs import ClusterCosts  # noqa: E402
from pd_runtime.planner.simulator import Topology, simulate  # noqa: E402
from pd_runtime.planner.workload import Workload  # noqa: E402


def simulated(costs: ClusterCosts, config_path: Path, trace: Path, point: int,
              slo: SLOTarget) -> dict:
    cfg = ClusterConfig.model_validate(yaml.safe_load(config_path.read_text()))
    # The load generator runs on this machine, on the workers' cores: its CPU counts.
    topology = Topology(cfg.prefill.num_workers, cfg.decode.num_workers + cfg.colocated.num_workers,
                        cfg.router.routing, cfg.recovery.health_check_interval_s,
                        clients_on_host=True)
    workload = Workload(mix="trace", arrival="trace", trace=str(trace), trace_point=point)
    started = time.monotonic()
    result = simulate(costs, topology, workload.requests(), slo)
    result["sim_s"] = time.monotonic() - started
    return result


def error(sim, real) -> str:
    if sim is None or real is None:
        return "-"
    if real == 0:
        return "0%" if sim == 0 else "inf"
    return f"{(sim - real) / real * 100:+.0f}%"


def rows(system: str, measured: dict, sims: list[dict]) -> list[str]:
    out = []
    for point, sim in zip(measured["points"], sims):
        real = point["summary"]

        def pair(key, q, scale=1.0, digits=2):
            r, s = real[key][q], sim[key][q]
            fr = "-" if r is None else f"{r * scale:.{digits}f}"
            fs = "-" if s is None else f"{s * scale:.{digits}f}"
            return f"{fr} / {fs} ({error(s, r)})"

        out.append(f"| {system} | {real['offered_rate']:g} | {real['sent']} | "
                   f"{real['goodput_rps']:.2f} / {sim['goodput_rps']:.2f} "
                   f"({error(sim['goodput_rps'], real['goodput_rps'])}) | "
                   f"{pair('ttft_s', 'p50')} | {pair('ttft_s', 'p99')} | "
                   f"{pair('tpot_s', 'p50', 1e3, 1)} | {pair('tpot_s', 'p99', 1e3, 1)} |")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--rates", type=float, nargs="+", default=[1.0, 2.0, 3.0])
    ap.add_argument("--num-requests", type=int, default=60)
    ap.add_argument("--systems", nargs="+", default=["pd-slo", "pd-threshold", "pd-disagg"])
    ap.add_argument("--cost-model", help="default: calibrate now with pd-runtime profile")
    ap.add_argument("--slo-ttft", type=float, default=2.5)
    ap.add_argument("--slo-tpot", type=float, default=0.1)
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--profile-repeats", type=int, default=1,
                    help="calibration sweeps (pd-runtime profile --repeats)")
    ap.add_argument("--calibrate-each", action="store_true",
                    help="profile each system through its own router just before its points")
    ap.add_argument("--reuse", action="store_true",
                    help="simulate against the measured points already in --out")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model_dir = bench_model(None)
    cost_path = Path(args.cost_model) if args.cost_model else out / "cost-model.json"
    costs = ClusterCosts.load(cost_path) if args.cost_model or \
        (args.reuse and not args.calibrate_each) else None
    slo = SLOTarget(ttft_s=args.slo_ttft, tpot_s=args.slo_tpot)
    table = ["| mode | rate | sent | goodput/s real / sim | TTFT p50 s | TTFT p99 s | "
             "TPOT p50 ms | TPOT p99 ms |", "|---|---|---|---|---|---|---|---|"]
    for system in args.systems:
        trace = out / f"{system}.json"
        if args.reuse and trace.exists():  # measured already: simulate only
            measured = json.loads(trace.read_text())
            if args.calibrate_each:  # the system's own calibration
                costs = ClusterCosts.load(out / f"{system}.cost-model.json")
            config = write_config(system, out, args.port)
            sims = [simulated(costs, config, trace, i, slo)
                    for i in range(len(measured["points"]))]
            table.extend(rows(system, measured, sims))
            continue
        server = Server(system, out, args.port, model_dir)
        try:
            server.wait_ready()
            if costs is None or args.calibrate_each:  # through this deployment's router
                if args.calibrate_each:
                    cost_path = out / f"{system}.cost-model.json"
                subprocess.run([str(ROOT / ".venv/bin/pd-runtime"), "--log-level", "WARNING",
                                "profile", "--url", server.base_url, "--out", str(cost_path),
                                "--repeats", str(args.profile_repeats)],
                               cwd=ROOT, check=True)
                costs = ClusterCosts.load(cost_path)
            trace = out / f"{system}.json"
            load = goodput(server.base_url, system, trace, "--rates",
                           *[str(r) for r in args.rates], "--num-requests",
                           str(args.num_requests), "--seed", str(args.seed),
                           "--slo-ttft", str(args.slo_ttft), "--slo-tpot", str(args.slo_tpot))
            if load.wait() != 0:
                raise RuntimeError(f"bench/goodput.py failed against {system}")
        finally:
            server.stop()
        measured = json.loads(trace.read_text())
        config = write_config(system, out, args.port)
        sims = [simulated(costs, config, trace, i, slo) for i in range(len(measured["points"]))]
        table.extend(rows(system, measured, sims))
        print("\n".join(table), flush=True)
    (out / "table.md").write_text("\n".join(table) + "\n")
    print(f"cost model: {cost_path}; table: {out / 'table.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
