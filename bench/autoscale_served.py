"""A changing workload served with planner.autoscale on, against static splits (issue 48).

Each system is `pd-runtime serve` with a config written here (the defaults plus the system's
fields), loaded through the same phases back to back by bench/goodput.py (open-loop arrivals;
each phase its own rate, long-prompt share and duration), on one server that stays up across
the phases. Per phase: within both targets, goodput, refusals, and the workers routed to at its
end; for the autoscaled system also its scale events (cold start: start to ready; drain: to
stopped) from /v1/router/config and the requests of the phase in which each fell.

    unshare -n sh -c 'ip link set lo up; exec .venv/bin/python bench/autoscale_served.py'
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
URL = "http://127.0.0.1:8000"
# (name, requests/s, long-prompt share, seconds of arrivals)
PHASES = [("short, busy", 3.0, 0.0, 60), ("bimodal", 2.0, 0.2, 60), ("short, quiet", 0.5, 0.0, 40)]
AUTOSCALE = {"enabled": True, "interval_s": 5.0, "window_s": 20.0, "cooldown_s": 10.0,
             "prefill": {"min_workers": 0, "max_workers": 1},
             "decode": {"min_workers": 1, "max_workers": 2}}
SYSTEMS = {
    "autoscale": {"planner": {"autoscale": AUTOSCALE}},
    "static 1P+1D (default)": {},
    "static 0P+2D": {"prefill": {"num_workers": 0}, "decode": {"num_workers": 2}},
}


def _get(path: str) -> dict:
    with urllib.request.urlopen(URL + path, timeout=10) as r:
        return json.loads(r.read())


def _wait_up(proc: subprocess.Popen, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"pd-runtime serve exited with {proc.returncode}")
        try:
            _get("/v1/models")
            return
        except OSError:
            time.sleep(1.0)
    raise RuntimeError("pd-runtime serve did not come up")


def _workers() -> str:
    """The split the router routes to now (its workers that answered their last check)."""
    roles = [w["role"] for w in _get("/health")["workers"].values() if w["healthy"]]
    return f"{roles.count('prefill')}P+{roles.count('decode')}D"


def run_system(name: str, fields: dict, out: Path, seed: int) -> dict:
    config = out / f"{name.split()[0]}-{len(fields)}.yaml"
    config.write_text(yaml.safe_dump(fields))
    log = open(out / f"{config.stem}.serve.log", "w")
    env = {**os.environ, "PD_RUNTIME_DATA_DIR": tempfile.mkdtemp()}
    proc = subprocess.Popen([sys.executable, "-m", "pd_runtime.cli", "serve", "--config",
                             str(config)], stdout=log, stderr=subprocess.STDOUT, env=env,
                            cwd=ROOT)
    phases = []
    try:
        _wait_up(proc)
        for i, (label, rate, long_share, seconds) in enumerate(PHASES):
            report = out / f"{config.stem}.phase{i}.json"
            began = time.time()
            subprocess.run([sys.executable, str(ROOT / "bench" / "goodput.py"), "--rates",
                            str(rate), "--duration", str(seconds), "--long-fraction",
                            str(long_share), "--seed", str(seed + i), "--json", str(report)],
                           check=True, stdout=subprocess.DEVNULL, cwd=ROOT)
            point = json.loads(report.read_text())["points"][0]["summary"]
            phases.append({"phase": label, "began": began, "ended": time.time(),
                           "workers": _workers(), **_summary(point)})
        scale = _get("/v1/router/config").get("autoscale") or {}
    finally:
        proc.send_signal(2)
        proc.wait(timeout=60)
        log.close()
    events = scale.get("events") or []
    for event in events:  # the phase each scale event fell in
        event["phase"] = next((p["phase"] for p in phases if p["began"] <= event["at"]
                               <= p["ended"]), "between phases")
    return {"system": name, "phases": phases, "events": events}


def _summary(point: dict) -> dict:
    keys = ("sent", "completed", "refused", "failed", "attainment", "goodput_rps")
    return {k: point.get(k) for k in keys}


def table(results: list[dict]) -> str:
    lines = ["| system | phase | within targets | goodput req/s | refused | workers at its end |",
             "|---|---|---|---|---|---|"]
    for r in results:
        for p in r["phases"]:
            attained = p["attainment"]
            lines.append(f"| {r['system']} | {p['phase']} | "
                         f"{'-' if attained is None else f'{attained:.0%}'} | "
                         f"{p['goodput_rps'] or 0:.2f} | {p['refused']} of {p['sent']} | "
                         f"{p['workers']} |")
    for r in results:
        for e in r["events"]:
            lines.append(f"- {r['system']}: {e['kind']} {e['worker_id']} in {e['seconds']:.1f} s "
                         f"({e['phase']})")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--systems", nargs="*", default=list(SYSTEMS))
    parser.add_argument("--out", default=tempfile.mkdtemp(prefix="autoscale-served-"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--phases", help="name:rate:long_share:seconds,... (default: "
                        + ",".join(f"{n}:{r}:{f}:{d}" for n, r, f, d in PHASES) + ")")
    parser.add_argument("--json")
    args = parser.parse_args()
    if args.phases:
        PHASES[:] = [(n, float(r), float(f), float(d)) for n, r, f, d in
                     (p.split(":") for p in args.phases.split(","))]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = [run_system(name, SYSTEMS[name], out, args.seed) for name in args.systems]
    print(table(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
