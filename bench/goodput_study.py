"""The goodput study: each system served in turn on this machine, the same open-loop load
(bench/goodput.py) against each, then the plots and a table of peaks and knees.

    .venv/bin/python bench/goodput_study.py --out /tmp/study [--systems pd-slo vllm ...]
        [--rates 1 2 4 6 8 10 12 14] [--num-requests 96] [--burst 200]

Systems (all on the bench model, on the machine's cores):
  pd-slo          `pd-runtime serve` with no flags: 1 prefill + 1 decode worker, SLO routing
  pd-threshold    the same two workers, the length threshold (routing.mode: auto)
  pd-disagg       the same two workers, every request disaggregated
  colocated-1x2   one colocated worker with both cores (2 torch threads)
  colocated-2x1   two colocated workers, a core each
  vllm            vLLM's CPU build serving the same model directory (bench/peers/vllm_serve.py)

`--burst N`: after the sweep, per system, N long prompts at once while short requests keep
arriving at --burst-short-rate; reported apart (short requests' SLO attainment, the long ones'
time to an answer or a refusal). Each system's server is started fresh and stopped after its
runs; nothing is left running.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import httpx
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import bench_model  # noqa: E402

THRESHOLD = {"router": {"routing": {"mode": "auto"}}}  # no SLO admission
TWO_WORKERS_OFF = {"prefill": {"num_workers": 0}, "decode": {"num_workers": 0}}
SYSTEMS = {
    "pd-slo": {},
    "pd-threshold": THRESHOLD,
    "pd-disagg": {"router": {"routing": {"mode": "always_disaggregated"}}},
    "colocated-1x2": {**TWO_WORKERS_OFF, **THRESHOLD, "colocated": {
        "num_workers": 1, "resources": {"num_cpus": 2}, "engine": {"num_threads": 2}}},
    "colocated-2x1": {**TWO_WORKERS_OFF, **THRESHOLD, "colocated": {"num_workers": 2}},
    "vllm": None,
}


def merge(base: dict, over: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in over.items():
        out[key] = merge(out.get(key) or {}, value) if isinstance(value, dict) else value
    return out


def write_config(name: str, out: Path, port: int) -> Path:
    cfg = yaml.safe_load((ROOT / "cluster_configs/local.yaml").read_text())
    cfg = merge(cfg, SYSTEMS[name])
    if cfg["colocated"].get("num_workers"):  # a pool spelled out from the defaults
        pool = merge({k: v for k, v in cfg["decode"].items() if k != "num_workers"},
                     cfg["colocated"])
        cfg["colocated"] = pool
    cfg["router"]["port"] = port
    path = out / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


class Server:
    """One system's server process (a process group: Ray and vLLM start children)."""

    def __init__(self, name: str, out: Path, port: int, model_dir: str,
                 config: Optional[Path] = None, vllm_args: tuple = ()):
        """A name starting with `vllm`: vLLM's server (`vllm_args` added to its wrapper's
        flags); else `pd-runtime serve --config` (`config`, or SYSTEMS[name] written out)."""
        self.name, self.port = name, port
        self.log = open(out / f"{name}.server.log", "w")
        if name.startswith("vllm"):
            cmd = [str(ROOT / ".venv-vllm/bin/python"), str(ROOT / "bench/peers/vllm_serve.py"),
                   "--model", model_dir, "--port", str(port), "--threads", "2", *vllm_args]
        else:
            cmd = [str(ROOT / ".venv/bin/pd-runtime"), "serve", "--config",
                   str(config or write_config(name, out, port))]
        self.started = time.monotonic()
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, cwd=ROOT,
                                     start_new_session=True)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout_s: float = 300.0) -> float:
        deadline = time.monotonic() + timeout_s
        path = "/v1/models" if self.name.startswith("vllm") else "/ready"
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited ({self.proc.returncode}); see {self.log.name}")
            try:
                if httpx.get(self.base_url + path, timeout=2).status_code == 200:
                    return time.monotonic() - self.started
            except httpx.HTTPError:
                pass
            time.sleep(1.0)
        raise RuntimeError(f"{self.name} not ready after {timeout_s:.0f}s; see {self.log.name}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        try:  # children that outlived their parent
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.log.close()


def goodput(base_url: str, label: str, out: Path, *args: str) -> subprocess.Popen:
    cmd = [sys.executable, str(ROOT / "bench/goodput.py"), "--base-url", base_url,
           "--label", label, "--json", str(out), *args]
    return subprocess.Popen(cmd, cwd=ROOT)


def run_system(name: str, args, out: Path, model_dir: str) -> dict:
    server = Server(name, out, args.port, model_dir)
    result = {"system": name}
    loads: list[subprocess.Popen] = []  # the load generators, stopped whatever happens
    try:
        result["startup_s"] = server.wait_ready()
        print(f"## {name}: ready in {result['startup_s']:.0f}s", flush=True)
        common = ["--model-dir", model_dir, "--slo-ttft", str(args.slo_ttft),
                  "--slo-tpot", str(args.slo_tpot), "--seed", str(args.seed)]
        sweep = out / f"{name}.json"
        if args.rates:
            size = ["--duration", str(args.duration)] if args.duration \
                else ["--num-requests", str(args.num_requests)]
            rc = goodput(server.base_url, name, sweep, "--rates", *map(str, args.rates), *size,
                         *common).wait()
            result["sweep"] = str(sweep) if rc == 0 else f"failed rc={rc}"
        if args.burst and name in (args.burst_systems or args.systems):
            # Shorts keep arriving; the burst of long prompts lands a few seconds in.
            shorts = goodput(server.base_url, f"{name} shorts", out / f"{name}.burst-shorts.json",
                             "--rates", str(args.burst_short_rate), "--duration",
                             str(args.burst_window_s), "--workload", "fixed", "--input-len",
                             str(args.short_len), "--output-len", "64", "--settle-s", "0",
                             *common[:-1], str(args.seed + 1))
            loads.append(shorts)
            time.sleep(3.0)
            longs = goodput(server.base_url, f"{name} burst", out / f"{name}.burst-longs.json",
                            "--burst", str(args.burst), "--workload", "fixed", "--input-len",
                            str(args.long_len), "--output-len", "64", "--settle-s", "0",
                            *common[:-1], str(args.seed + 2))
            loads.append(longs)
            result["burst"] = [shorts.wait(), longs.wait()]
    except Exception as exc:  # one system failing must not lose the others' results
        result["error"] = str(exc)
        print(f"## {name}: {exc}", flush=True)
    finally:
        for load in loads:
            if load.poll() is None:
                load.kill()
                load.wait()
        try:  # what the server says about itself (routing reasons, cost model, ...)
            (out / f"{name}.metrics.txt").write_text(
                httpx.get(server.base_url + "/metrics", timeout=5).text)
        except httpx.HTTPError:
            pass
        server.stop()
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="/tmp/goodput-study")
    p.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=list(SYSTEMS))
    p.add_argument("--rates", nargs="*", type=float, default=[1, 2, 4, 6, 8, 10, 12, 14],
                   help="none: only the burst")
    p.add_argument("--num-requests", type=int, default=96)
    p.add_argument("--duration", type=float, default=None,
                   help="seconds of arrivals per point instead of --num-requests (a sustained load)")
    p.add_argument("--slo-ttft", type=float, default=2.5)
    p.add_argument("--slo-tpot", type=float, default=0.1)
    p.add_argument("--burst", type=int, default=200, help="0: no burst run")
    p.add_argument("--burst-systems", nargs="*", choices=list(SYSTEMS),
                   help="the systems that also get the burst (default: all)")
    p.add_argument("--burst-short-rate", type=float, default=2.0)
    p.add_argument("--burst-window-s", type=float, default=20.0)
    p.add_argument("--short-len", type=int, default=128)
    p.add_argument("--long-len", type=int, default=2048)
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--model", default=None, help="default: the embedded bench model")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model_dir = bench_model(args.model)
    results = [run_system(name, args, out, model_dir) for name in args.systems]
    (out / "study.json").write_text(json.dumps(results, indent=1))
    sweeps = [r["sweep"] for r in results if str(r.get("sweep", "")).endswith(".json")]
    if sweeps:
        subprocess.run([sys.executable, str(ROOT / "bench/goodput_plot.py"), *sweeps,
                        "--out", str(out / "goodput.png"), "--cdf-out", str(out / "cdf.png")],
                       cwd=ROOT, check=False)
    print(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
