"""The served product under test: `pd-runtime serve --config <temp YAML>` as a subprocess, its
HTTP health and metrics, its worker actors (for pids and fault settings), and a stop that
leaves no process of ours behind (Ray included).
"""

from __future__ import annotations

import contextlib
import copy
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import httpx
import yaml

from tests.chaos_support import processes

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    """A port free now, for a server a subprocess binds seconds later: drawn below the kernel's
    ephemeral range (32768 up by default), where no bind(0) or outgoing connection of another
    process (Ray's, another test process's) lands in between; bind(0)'s own port was taken so
    once under two test processes."""
    low, high = 20000, 32000
    with contextlib.suppress(OSError, ValueError):
        low_ephemeral = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
        high = min(high, low_ephemeral)
    rng = random.Random()
    for _ in range(200 if high - low >= 100 else 0):
        port = rng.randrange(low, high)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # the range is crowded: the kernel's choice
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(proc: subprocess.Popen, base: str, log_path: Path, timeout_s: float = 180) -> None:
    """Until the server at `base` answers /ready; fails with its log's tail if it exits or
    takes longer than `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        assert proc.poll() is None, log_path.read_text()[-3000:]
        assert time.monotonic() < deadline, f"not ready in {timeout_s:.0f} s"
        try:
            if httpx.get(base + "/ready", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)


def stop_serve(proc: subprocess.Popen, timeout_s: float = 60) -> int:
    """Ctrl-C to a `pd-runtime serve` started in a session of its own; its process group is
    killed if it has not exited within `timeout_s`. Its exit code."""
    proc.send_signal(signal.SIGINT)
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        return proc.wait()


def _merge(base: dict, extra: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def chaos_config(model_dir: str, port: int, dtype: str, num_kv_blocks: int,
                 max_local_prefill_tokens: int, overrides: Optional[dict] = None) -> dict:
    """local.yaml with one prefill and one decode worker, routing by prompt length, link fault
    injection and checksums on; `overrides` (nested dicts) change anything else."""
    cfg = yaml.safe_load((REPO / "cluster_configs" / "local.yaml").read_text())
    cfg["model"] = model_dir
    for pool in ("prefill", "decode"):
        cfg[pool]["num_workers"] = 1
        cfg[pool]["engine"].update(dtype=dtype, num_kv_blocks=num_kv_blocks, num_threads=1)
    cfg["kv_transfer"].update(fault_injection=True, checksums=True)
    cfg["router"]["port"] = port
    cfg["router"]["routing"].update(mode="auto",
                                    max_local_prefill_tokens=max_local_prefill_tokens)
    return _merge(cfg, overrides or {})


def parse_metrics(text: str) -> dict[str, dict[tuple, float]]:
    """Prometheus text -> {name: {((label, value), ...): sample}}."""
    out: dict[str, dict[tuple, float]] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = re.match(r"^([A-Za-z_:][\w:]*)(?:\{(.*)\})? (\S+)$", line)
        if not m:
            continue
        labels = tuple(sorted(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', m.group(2) or "")))
        out.setdefault(m.group(1), {})[labels] = float(m.group(3))
    return out


def _set_auth_mode(mode: Optional[str]) -> None:
    """RAY_AUTH_MODE for this process (None: unset). Ray reads it into its config when first
    imported, so the config is re-read; without that a later change has no effect."""
    if mode is None:
        os.environ.pop("RAY_AUTH_MODE", None)
    else:
        os.environ["RAY_AUTH_MODE"] = mode
    from ray._raylet import Config

    Config.initialize("")


@dataclass
class WorkerView:
    worker_id: str
    role: str
    healthy: bool
    pid: Optional[int]
    state: Optional[str]


class ServedProduct:
    def __init__(self, config: dict, workdir: Path):
        self.config = config
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.config_path = self.workdir / "cluster.yaml"
        self.config_path.write_text(yaml.safe_dump(config))
        self.log_path = self.workdir / "serve.log"
        self.port = config["router"]["port"]
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.namespace = config["ray"]["namespace"]
        self.proc: Optional[subprocess.Popen] = None
        self.seen: dict[tuple[int, int], processes.ProcessId] = {}
        self._ray = None
        self._auth_mode_set = False
        self.model_name: Optional[str] = None

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self, timeout_s: float = 240.0) -> None:
        exe = Path(sys.executable).with_name("pd-runtime")
        cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "pd_runtime.cli"]
        log = open(self.log_path, "wb")
        # Its own session: every process it starts (Ray's included) can be found and stopped.
        self.proc = subprocess.Popen(cmd + ["serve", "--config", str(self.config_path)],
                                     cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        log.close()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"pd-runtime serve exited with {self.proc.returncode}:\n"
                                   + self.log_tail())
            try:
                if httpx.get(self.base_url + "/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        else:
            raise TimeoutError(f"pd-runtime serve not ready in {timeout_s}s:\n" + self.log_tail())
        self.track()
        self.model_name = httpx.get(self.base_url + "/v1/models", timeout=5).json()["data"][0]["id"]

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def track(self) -> list[processes.ProcessId]:
        """Record the live process tree (restarted actors have new pids; call after faults)."""
        if self.proc is None:
            return []
        procs = processes.tree(self.proc.pid, session=self.proc.pid)
        for p in procs:
            self.seen[(p.pid, p.start_ticks)] = p
        return procs

    def stop(self, timeout_s: float = 60.0) -> list[processes.ProcessId]:
        """Stop the serve process the way an operator does (SIGINT) and return what of ours
        was still alive afterwards (then killed), so a caller can assert it is empty."""
        if self._ray is not None:
            self._ray.shutdown()
            self._ray = None
        if self._auth_mode_set:
            _set_auth_mode(None)
            self._auth_mode_set = False
        if self.proc is None:
            return []
        for p in self.track():  # a worker left stopped by a failed phase must be able to exit
            try:
                os.kill(p.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        deadline = time.monotonic() + 15  # Ray's own processes exit a moment after the driver
        session = processes.tree(-1, session=self.proc.pid)  # anything else it started
        for p in session:
            self.seen.setdefault((p.pid, p.start_ticks), p)
        left = [p for p in self.seen.values() if processes.alive(p)]
        while left and time.monotonic() < deadline:
            time.sleep(0.25)
            left = [p for p in left if processes.alive(p)]
        for p in left:  # only pids we saw in our own tree, checked against their start time
            try:
                os.kill(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc = None
        return left

    # -- HTTP views --------------------------------------------------------------------------
    def health(self, timeout_s: float = 5.0) -> dict:
        return httpx.get(self.base_url + "/health", timeout=timeout_s).json()

    def metrics(self, timeout_s: float = 5.0) -> dict[str, dict[tuple, float]]:
        return parse_metrics(httpx.get(self.base_url + "/metrics", timeout=timeout_s).text)

    def workers(self) -> dict[str, WorkerView]:
        out = {}
        for wid, info in self.health()["workers"].items():
            out[wid] = WorkerView(wid, info["role"], bool(info["healthy"]), info.get("pid"),
                                  info.get("state"))
        return out

    def worker_of_role(self, role: str) -> str:
        ids = sorted(w.worker_id for w in self.workers().values() if w.role == role)
        if not ids:
            raise LookupError(f"no {role} worker in /health")
        return ids[0]

    def pid_of(self, worker_id: str, timeout_s: float = 30.0) -> int:
        """The worker's process id: /health's `pid` when the router reports it, otherwise the
        actor's own load report over Ray (the worker must be answering)."""
        deadline = time.monotonic() + timeout_s
        while True:
            view = self.workers().get(worker_id)
            if view is not None and view.healthy and view.pid:
                return int(view.pid)
            if view is not None and view.healthy and view.pid is None:
                try:
                    load = self.ray.get(self.actor(worker_id).load.remote(), timeout=5)
                    return int(load["pid"])
                except Exception:
                    pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"no pid for {worker_id} within {timeout_s}s: {view}")
            time.sleep(0.2)

    # -- Ray access (fault settings live on the actors) ---------------------------------------
    @property
    def ray(self):
        if self._ray is None:
            import ray

            address = processes.flag_value(self.track(), "--gcs-address")
            if address is None:
                raise RuntimeError("could not find the serve process's Ray GCS address")
            # A new local Ray (the serve's) turns token auth on by default, but a driver given
            # an explicit address does not: ask for it unless the environment decided already.
            if "RAY_AUTH_MODE" not in os.environ:
                _set_auth_mode("token")
                self._auth_mode_set = True
            ray.init(address=address, namespace=self.namespace, log_to_driver=False,
                     logging_level="WARNING")
            self._ray = ray
        return self._ray

    def actor(self, worker_id: str) -> Any:
        return self.ray.get_actor(f"pd-{worker_id}", namespace=self.namespace)
