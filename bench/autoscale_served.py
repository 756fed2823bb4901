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
from typing import Optional

import yaml

ROOT = Path(__file__).resolve().parent.parent
URL = "http://127.0.0.1:8000"
# (name, requests/s, long-prompt share, seconds of arrivals)
PHASES = [("short, busy", 10.0, 0.0, 90), ("bimodal", 2.0, 0.2, 90),
          ("short, quiet", 0.5, 0.0, 120)]
AUTOSCALE = {"enabled": True, "interval_s": 5.0, "window_s": 20.0, "cooldown_s": 10.0,
             "prefill": {"min_workers": 0, "max_workers": 1},
             "decode": {"min_workers": 1, "max_workers": 2}}
SYSTEMS = {
    "autoscale": {"planner": {"autoscale": AUTOSCALE}},
    # Planned for twice the load seen, at 99%: two workers whenever there is load, the split
    # moved between 1P+1D and 0P+2D by re-roling one.
    "autoscale, headroom 1, 99%": {"planner": {"autoscale": {**AUTOSCALE, "headroom": 1.0,
                                                             "attainment": 0.99}}},
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
    start = {role: (fields.get(role) or {}).get("num_workers", 1) for role in ("prefill", "decode")}
    try:
        _wait_up(proc)
        for i, (label, rate, long_share, seconds) in enumerate(PHASES):
            report = out / f"{config.stem}.phase{i}.json"
            began = time.time()
            subprocess.run([sys.executable, str(ROOT / "bench" / "goodput.py"), "--rates",
                            str(rate), "--duration", str(seconds), "--long-fraction",
                            str(long_share), "--seed", str(seed + i), "--json", str(report)],
                           check=True, stdout=subprocess.DEVNULL, cwd=ROOT)
            point = json.loads(report.read_text())["points"][0]
            t0 = point["summary"]["started_at"]
            spans = [(t0 + r["sent_s"], t0 + (r["end_s"] if r["end_s"] is not None
                                               else r["sent_s"]), _missed(r))
                     for r in point["requests"] if r["sent_s"] is not None]
            phases.append({"phase": label, "began": began, "ended": time.time(),
                           "workers": _workers(), **_summary(point["summary"]),
                           "spans": spans})
        scale = _get("/v1/router/config").get("autoscale") or {}
    finally:
        proc.send_signal(2)
        proc.wait(timeout=60)
        log.close()
    events = scale.get("events") or []
    spans = [span for p in phases for span in p.pop("spans")]
    for event in events:  # the phase each scale event fell in, the requests it overlapped
        event["phase"] = next((p["phase"] for p in phases if p["began"] <= event["at"]
                               <= p["ended"]), "between phases")
        began = event["at"] - event["seconds"]
        touched = [missed for sent, end, missed in spans if sent <= event["at"] and end >= began]
        event["requests_during"], event["missed_during"] = len(touched), sum(touched)
    quiet = [missed for sent, end, missed in spans
             if not any(sent <= e["at"] and end >= e["at"] - e["seconds"] for e in events)]
    return {"system": name, "phases": phases, "events": events, "start": start,
            "missed_outside_events": [sum(quiet), len(quiet)]}


def worker_seconds(result: dict) -> list[float]:
    """Per phase, the workers held (started to stopped) integrated over its time."""
    change = {"start": (0, 1), "drain": (-1, 0), "re_role": (0, 0)}
    steps = sorted((e["at"], change.get(e["kind"], (0, 0))) for e in result["events"])
    held, out = sum(result.get("start", {"prefill": 1, "decode": 1}).values()), []
    for p in result["phases"]:
        t, total = p["began"], 0.0
        for at, (gone, new) in steps:
            if t < at <= p["ended"]:
                total += held * (at - t)
                t, held = at, held + gone + new
        out.append(total + held * (p["ended"] - t))
    return out

def _missed(record: dict) -> bool:
    """Refused, failed, or over either target (bench/goodput.py's defaults: 2.5 s, 100 ms)."""
    return record["outcome"] != "completed" or record["ttft_s"] > 2.5 \
        or (record["tpot_s"] is not None and record["tpot_s"] > 0.1)


def _summary(point: dict) -> dict:
    keys = ("sent", "completed", "refused", "failed", "attainment", "goodput_rps")
    return {k: point.get(k) for k in keys}


def hindsight(results: list[dict]) -> Optional[str]:
    """The static system with the most requests within targets over the whole trace."""
    static = [r for r in results if r["system"].startswith("static")]
    return max(static, key=lambda r: sum(p["attainment"] * p["sent"] for p in r["phases"]),
               default={}).get("system")


def plot(results: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    phases = [p["phase"] for p in results[0]["phases"]]
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.6))
    width = 0.8 / len(results)
    for k, r in enumerate(results):
        xs = [i + (k - (len(results) - 1) / 2) * width for i in range(len(phases))]
        axes[0].bar(xs, [100 * p["attainment"] for p in r["phases"]], width, label=r["system"])
        axes[1].bar(xs, [p["goodput_rps"] or 0 for p in r["phases"]], width, label=r["system"])
        for x, p in zip(xs, r["phases"]):
            axes[0].annotate(p["workers"], (x, 100 * p["attainment"]), ha="center",
                             va="bottom", fontsize=6)
    for ax, title in zip(axes, ("within both targets (%), workers at the phase's end",
                                "goodput (req/s)")):
        ax.set_xticks(range(len(phases)), phases, fontsize=8)
        ax.set_title(title, fontsize=9)
    axes[0].axhline(90, color="gray", linewidth=0.5)
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def table(results: list[dict]) -> str:
    lines = ["| system | phase | within targets | goodput req/s | refused | workers at its end "
             "| worker-seconds |", "|---|---|---|---|---|---|---|"]
    for r in results:
        for p, held in zip(r["phases"], worker_seconds(r)):
            attained = p["attainment"]
            lines.append(f"| {r['system']} | {p['phase']} | "
                         f"{'-' if attained is None else f'{attained:.0%}'} | "
                         f"{p['goodput_rps'] or 0:.2f} | {p['refused']} of {p['sent']} | "
                         f"{p['workers']} | {held:.0f} |")
    for r in results:
        for e in r["events"]:
            lines.append(f"- {r['system']}: {e['kind']} {e['worker_id']} ({e['role']}) in "
                         f"{e['seconds']:.1f} s ({e['phase']}): {e['requests_during']} requests "
                         f"in flight during it, {e['missed_during']} of them missed a target")
        missed, of = r["missed_outside_events"]
        lines.append(f"- {r['system']}: outside every event {missed} of {of} missed a target")
    lines.append(f"- best static split in hindsight: {hindsight(results)}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--systems", nargs="*", default=list(SYSTEMS))
    parser.add_argument("--out", default=tempfile.mkdtemp(prefix="autoscale-served-"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--phases", help="name:rate:long_share:seconds,... (default: "
                        + ",".join(f"{n}:{r}:{f}:{d}" for n, r, f, d in PHASES) + ")")
    parser.add_argument("--json")
    parser.add_argument("--plot", help="a PNG of attainment and goodput per phase")
    parser.add_argument("--report", nargs="+", metavar="JSON",
                        help="print (and --plot) the results of earlier --json runs, run nothing")
    args = parser.parse_args()
    if args.report:
        results = [r for path in args.report for r in json.loads(Path(path).read_text())]
        print(table(results))
        if args.plot:
            plot(results, args.plot)
        return
    if args.phases:
        PHASES[:] = [(n, float(r), float(f), float(d)) for n, r, f, d in
                     (p.split(":") for p in args.phases.split(","))]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = [run_system(name, SYSTEMS[name], out, args.seed) for name in args.systems]
    print(table(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    if args.plot:
        plot(results, args.plot)


if __name__ == "__main__":
    main()
