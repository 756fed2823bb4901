"""`ray job submit -- pd-runtime serve --config FILE` against an existing local Ray cluster
(started with `ray start --head`), as a user on a real cluster would run it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.timeout(300)


def test_serve_under_ray_job_submit(llama_dir, tmp_path):
    bin_dir = Path(sys.executable).parent
    ray_cli = shutil.which("ray", path=str(bin_dir)) or str(bin_dir / "ray")
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ.get('PATH', '')}",
           "RAY_AUTH_MODE": "token", "RAY_USAGE_STATS_ENABLED": "0"}
    cfg = yaml.safe_load(open("cluster_configs/local.yaml"))
    cfg["model"] = llama_dir
    cfg["ray"].update(address="auto", num_cpus=None)
    for pool in ("prefill", "decode"):
        cfg[pool]["engine"].update(dtype="float32", num_kv_blocks=64, num_threads=1)
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(cfg))
    port = "8365"
    start = subprocess.run([ray_cli, "start", "--head", "--num-cpus=4", "--include-dashboard=true",
                            "--dashboard-host=127.0.0.1", f"--dashboard-port={port}",
                            "--disable-usage-stats"], env=env, capture_output=True, text=True,
                           timeout=120)
    try:
        assert start.returncode == 0, start.stderr[-2000:]
        job = subprocess.run([ray_cli, "job", "submit", "--address", f"http://127.0.0.1:{port}",
                              "--", "pd-runtime", "--log-level", "WARNING", "serve", "--config",
                              str(path), "--demo", "--max-tokens", "6"],
                             env=env, capture_output=True, text=True, timeout=240)
        out = job.stdout + job.stderr
        assert job.returncode == 0, out[-3000:]
        assert out.count("[colocated]") == 2 and out.count("[disaggregated]") == 2, out[-3000:]
        assert "succeeded" in out
    finally:
        subprocess.run([ray_cli, "stop", "--force"], env=env, capture_output=True, timeout=60)
