"""`router.replicas: 2`: two routers on one port (SO_REUSEPORT) over the same Ray pools, as
`pd-runtime serve` starts them. New connections reach both; a tenant's rate limit holds across
them (the admitted count within 10% of what the limit allows); 20 concurrent retries with one
Idempotency-Key, spread over both, are one run; the usage ledger has one row per completed run.
"""

from __future__ import annotations

import asyncio
import sqlite3
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

PER_MINUTE = 60  # the tenant's requests_per_minute: a bucket of 60, refilled at 1 per second
ACME = {"Authorization": "Bearer sk-acme"}


def _fresh(base: str) -> httpx.AsyncClient:
    # No keep-alive: every request opens a connection, which the kernel hands to a replica.
    return httpx.AsyncClient(base_url=base, timeout=60,
                             limits=httpx.Limits(max_keepalive_connections=0))


def test_two_replicas_share_one_port_rate_limits_and_runs(llama_dir, tmp_path):
    port = free_port()
    store = tmp_path / "runs.sqlite3"
    engine = {"dtype": "float32", "num_kv_blocks": 256, "num_threads": 1}
    cfg = {"model": llama_dir, "prefill": {"num_workers": 0},
           "decode": {"num_workers": 1, "engine": engine},
           "ray": {"num_cpus": 4},
           "router": {"port": port, "replicas": 2, "routing": {"mode": "always_colocated"},
                      "runs": {"store": str(store)},
                      "tenants": [{"tenant_id": "acme", "api_key": "sk-acme",
                                   "requests_per_minute": PER_MINUTE},
                                  {"tenant_id": "beta", "api_key": "sk-beta"}]}}
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(cfg))
    exe = Path(sys.executable).with_name("pd-runtime")
    log = open(tmp_path / "serve.log", "wb")
    proc = subprocess.Popen([str(exe), "serve", "--config", str(path)], cwd=REPO, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_ready(proc, base, tmp_path / "serve.log")

        async def scenario():
            async with _fresh(base) as http:
                routers = set()
                for _ in range(40):  # both replicas answer on the one port
                    routers.add((await http.get("/health")).json()["router"])
                    if len(routers) == 2:
                        break
                # Rate limit: 10 requests/s offered for 10 s against a bucket of 60 refilled at
                # 1/s: ~70 may pass (each replica on its own would pass ~all 100).
                body = {"prompt": "hi", "max_tokens": 1}
                start = time.monotonic()
                tasks = []
                while time.monotonic() - start < 10.0:
                    tasks.append(asyncio.create_task(
                        http.post("/v1/completions", json=body, headers=ACME)))
                    await asyncio.sleep(0.1)
                elapsed = time.monotonic() - start
                statuses = [r.status_code for r in await asyncio.gather(*tasks)]
                # One key, 20 concurrent retries landing on both replicas.
                keyed = {**body, "max_tokens": 8}
                retries = await asyncio.gather(*(
                    http.post("/v1/completions", json=keyed,
                              headers={"Authorization": "Bearer sk-beta",
                                       "Idempotency-Key": "both-replicas"})
                    for _ in range(20)))
                return routers, statuses, elapsed, retries

        routers, statuses, elapsed, retries = asyncio.run(scenario())
        assert routers == {f"{_host()}:{port}/0", f"{_host()}:{port}/1"}, routers
        admitted = statuses.count(200)
        allowed = PER_MINUTE + PER_MINUTE / 60.0 * elapsed
        print(f"rate limit across 2 replicas: {admitted} of {len(statuses)} admitted in "
              f"{elapsed:.1f} s, the limit allows {allowed:.1f} ({admitted / allowed - 1:+.1%}); "
              f"routers {sorted(routers)}")
        assert set(statuses) <= {200, 429}, set(statuses)
        assert abs(admitted - allowed) <= 0.1 * allowed, (admitted, allowed)
        assert {r.status_code for r in retries} == {200}
        assert len({r.json()["id"] for r in retries}) == 1, "one run for one key"
        assert len({r.content for r in retries}) == 1
        usage = httpx.get(base + "/v1/usage", headers={"Authorization": "Bearer sk-beta"}).json()
        assert usage["runs"] == 1 and usage["output_tokens"] == 8
    finally:
        code = stop_serve(proc)
        log.close()
    assert code == 0, (tmp_path / "serve.log").read_text()[-3000:]
    db = sqlite3.connect(store)
    completed = db.execute("SELECT COUNT(*) FROM runs WHERE state = 'completed'").fetchone()[0]
    rows = db.execute("SELECT COUNT(*), COUNT(DISTINCT run_id) FROM usage").fetchone()
    db.close()
    assert rows[0] == rows[1] == completed == admitted + 1, (rows, completed, admitted)
    time.sleep(0.5)
    left = [p for p in processes.tree(proc.pid, session=proc.pid) if processes.alive(p)]
    assert not left, left


def _host() -> str:
    import socket

    return socket.gethostname()
