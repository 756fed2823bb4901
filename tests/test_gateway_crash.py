"""A router killed mid-run (SIGKILL to `pd-runtime serve` and its process group) and started
again on the same port: the run it left streaming is marked failed at start-up, with no
ledger row, while a run it finished before the crash stays billed once; a background response
it was producing reads failed when polled; on the SQLite store and on a real PostgreSQL
server.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

from tests.chaos_support import processes
from tests.chaos_support.product import free_port, stop_serve, wait_ready

REPO = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.timeout(300)


def _serve(config: Path, log_path: Path) -> subprocess.Popen:
    exe = Path(sys.executable).with_name("pd-runtime")
    return subprocess.Popen([str(exe), "serve", "--in-process", "--config", str(config)],
                            cwd=REPO, stdout=open(log_path, "ab"), stderr=subprocess.STDOUT,
                            start_new_session=True)




def test_a_router_killed_mid_run_marks_the_run_failed_at_its_next_start(llama_dir, tmp_path,
                                                                       store_url):
    port = free_port()
    engine = {"dtype": "float32", "num_kv_blocks": 256, "num_threads": 1}
    cfg = {"model": llama_dir, "prefill": {"num_workers": 0},
           "decode": {"num_workers": 1, "engine": engine},
           "router": {"port": port, "routing": {"mode": "always_colocated"},
                      "runs": {"store": store_url},
                      "tenants": [{"tenant_id": "acme", "api_key": "sk-acme"}]}}
    config = tmp_path / "cluster.yaml"
    config.write_text(yaml.safe_dump(cfg))
    log_path = tmp_path / "serve.log"
    base = f"http://127.0.0.1:{port}"
    auth = {"Authorization": "Bearer sk-acme"}
    first = _serve(config, log_path)
    try:
        wait_ready(first, base, log_path)
        done = httpx.post(base + "/v1/completions", headers=auth, timeout=60,
                          json={"prompt": "finished before the crash", "max_tokens": 4}).json()
        # A long stream, read a little and then not at all: the run stays in flight.
        stream = httpx.stream("POST", base + "/v1/completions", timeout=60,
                              headers={**auth, "Accept": "text/event-stream"},
                              json={"prompt": "cut by the crash", "max_tokens": 1500,
                                    "ignore_eos": True, "stream": True})
        response = stream.__enter__()
        # And a background response, polled while it runs.
        background = httpx.post(base + "/v1/responses", headers=auth, timeout=60, json={
            "input": "cut by the crash too", "max_output_tokens": 1500, "ignore_eos": True,
            "background": True}).json()
        assert background["status"] == "queued", background
        lines = response.iter_lines()
        event_id = next(line for line in lines if line.startswith("id: "))
        run_id = event_id[len("id: "):].rsplit(":", 1)[0]
        deadline = time.monotonic() + 10
        while httpx.get(f"{base}/v1/runs/{run_id}", headers=auth).json()["state"] != \
                "streaming":
            assert time.monotonic() < deadline
            time.sleep(0.05)
        while httpx.get(f"{base}/v1/responses/{background['id']}", headers=auth
                        ).json()["status"] != "in_progress":
            assert time.monotonic() < deadline
            time.sleep(0.05)
        time.sleep(0.5)  # the record writer's round (50 ms) has written the run as streaming
        os.killpg(first.pid, signal.SIGKILL)
        first.wait(timeout=30)
        stream.__exit__(None, None, None)
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
            first.wait()

    second = _serve(config, log_path)
    try:
        wait_ready(second, base, log_path)
        record = httpx.get(f"{base}/v1/runs/{run_id}", headers=auth).json()
        assert record["state"] == "failed" and "stopped" in record["error"], record
        finished = httpx.get(f"{base}/v1/runs/{done['id']}", headers=auth).json()
        assert finished["state"] == "completed" and finished["output_tokens"] == 4
        usage = httpx.get(base + "/v1/usage", headers=auth).json()
        assert usage["runs"] == 1 and usage["output_tokens"] == 4, usage  # no row for the cut run
        assert "marked failed" in log_path.read_text()
        # The background response reads failed, saying why, not as unknown.
        polled = httpx.get(f"{base}/v1/responses/{background['id']}", headers=auth).json()
        assert polled["status"] == "failed" and "stopped" in polled["error"]["message"], polled
        assert polled["id"] == background["id"] and polled["model"] == background["model"]
        assert polled["background"] is True and polled["output"] == []
        cancel = httpx.post(f"{base}/v1/responses/{background['id']}/cancel", headers=auth)
        assert cancel.status_code == 409, cancel.text  # it has ended
    finally:
        code = stop_serve(second)
    assert code == 0, log_path.read_text()[-3000:]
    time.sleep(0.5)
    left = [p for p in processes.tree(second.pid, session=second.pid) if processes.alive(p)]
    assert not left, left
