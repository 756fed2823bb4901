"""`ray job submit -- pd-runtime serve --config FILE` against an existing local Ray cluster
(started with `ray start --head`), as a user on a real cluster would run it."""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.chaos_support.product import free_port

pytestmark = pytest.mark.timeout(300)

_STARTED = "will now block forever"  # what `ray start --block` prints once the node is up


def _start_head(ray_cli: str, env: dict, port: str, log: Path) -> subprocess.Popen:
    """`ray start --head --block` in a process group of its own: stopping it stops this node's
    processes and no others (`ray stop` would kill every Ray process of the user on the box,
    other test runs' included)."""
    with open(log, "w") as out:
        # Ports of its own, not Ray's fixed defaults (GCS 6379, the dashboard agent's 52365,
        # ...): another test process may be running a Ray of its own, whose agent would hold
        # them ("No available agent to submit job").
        ports = [f"--{name}={free_port()}" for name in (
            "port", "dashboard-agent-listen-port", "dashboard-agent-grpc-port",
            "runtime-env-agent-port", "metrics-export-port")]
        head = subprocess.Popen([ray_cli, "start", "--head", "--block", "--num-cpus=4", *ports,
                                 "--include-dashboard=true", "--dashboard-host=127.0.0.1",
                                 f"--dashboard-port={port}", "--disable-usage-stats"],
                                env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 120
    while _STARTED not in log.read_text():
        if head.poll() is not None or time.monotonic() > deadline:
            _stop_head(head)
            pytest.fail(f"ray start failed (rc {head.returncode}):\n{log.read_text()[-3000:]}")
        time.sleep(0.2)
    return head


def _stop_head(head: subprocess.Popen) -> None:
    if head.poll() is None:
        head.terminate()  # its SIGTERM handler stops the node's processes
        try:
            head.wait(60)
        except subprocess.TimeoutExpired:
            pass
    try:  # whatever of the group outlived it (workers, agents)
        os.killpg(head.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def test_serve_under_ray_job_submit(llama_dir, tmp_path):
    bin_dir = Path(sys.executable).parent
    ray_cli = shutil.which("ray", path=str(bin_dir)) or str(bin_dir / "ray")
    # Token mode, as Ray 2.60 defaults to, with a token of the test's own: `ray start` (unlike
    # ray.init) never makes one and would need ~/.ray/auth_token left by an earlier run. The
    # CLI, the node's processes and the job's driver all read it from this path.
    token_path = tmp_path / "ray_auth_token"
    token_path.write_text(secrets.token_hex(32))
    token_path.chmod(0o600)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ.get('PATH', '')}",
           "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token_path),
           "RAY_USAGE_STATS_ENABLED": "0", "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0"}
    env.pop("RAY_AUTH_TOKEN", None)  # it would take precedence over the path
    cfg = yaml.safe_load(open("cluster_configs/local.yaml"))
    cfg["model"] = llama_dir
    cfg["ray"].update(address="auto", num_cpus=None)
    for pool in ("prefill", "decode"):
        cfg[pool]["engine"].update(dtype="float32", num_kv_blocks=64, num_threads=1)
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(cfg))
    port = str(free_port())
    head = _start_head(ray_cli, env, port, tmp_path / "ray_start.log")
    try:
        job = subprocess.run([ray_cli, "job", "submit", "--address", f"http://127.0.0.1:{port}",
                              "--", "pd-runtime", "--log-level", "WARNING", "serve", "--config",
                              str(path), "--demo", "--max-tokens", "6"],
                             env=env, capture_output=True, text=True, timeout=240)
        out = job.stdout + job.stderr
        assert job.returncode == 0, out[-3000:]
        assert out.count("[colocated]") == 2 and out.count("[disaggregated]") == 2, out[-3000:]
        assert "succeeded" in out
    finally:
        _stop_head(head)
