"""The Ray runtime on a local Ray: colocated and disaggregated paths give the same tokens, and
faults (a worker killed mid-transfer or mid-stream, a cancel) cost latency, never a request.
"""

from __future__ import annotations

import asyncio
import random
import time

import pytest

from pd_runtime import LLM, SamplingParams
from pd_runtime.api import GenerationRequest
from pd_runtime.config import EngineConfig, KVTransferConfig, RecoveryConfig

ray = pytest.importorskip("ray")

NUM_BLOCKS = 128
pytestmark = pytest.mark.timeout(240)


def params(i: int, seeded: bool) -> dict:
    if seeded:
        return dict(max_tokens=24, temperature=0.8, top_p=0.95, seed=500 + i, ignore_eos=True)
    return dict(max_tokens=24, temperature=0.0, ignore_eos=True)


def prompts(n=4, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(5, 500) for _ in range(rng.choice([20, 40, 70]))] for _ in range(n)]


@pytest.fixture(scope="module")
def cluster(llama_dir):
    from pd_runtime.workers.client import PoolClient
    from pd_runtime.workers.pool import start_worker, wait_ready

    ray.init(address="local", num_cpus=8, include_dashboard=False, namespace="pd-test",
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
    engine = EngineConfig(model=llama_dir, dtype="float32", num_kv_blocks=NUM_BLOCKS,
                          num_threads=1)
    kv = KVTransferConfig(backend="torch_dist", transfer_timeout_s=8.0, lease_timeout_s=8.0,
                          heartbeat_interval_s=0.2, peer_timeout_s=2.0)
    recovery = RecoveryConfig(remote_prefill_timeout_s=10.0, reservation_timeout_s=5.0)
    workers = [start_worker(role, wid, engine, kv, num_cpus=1, max_restarts=5,
                            recovery=recovery)
               for role, wid in (("prefill", "p0"), ("decode", "d0"), ("decode", "d1"))]
    wait_ready(workers)
    client = PoolClient([workers[0]], workers[1:])
    yield client
    ray.shutdown()


def collect(client, rid, prompt, p, **kw):
    async def run():
        chunks = []
        async for chunk in client.generate(rid, prompt, p, **kw):
            chunks.append(chunk)
        return chunks

    return asyncio.run(run())


def tokens_of(chunks):
    assert chunks and chunks[-1]["finished"], chunks[-1:]
    assert "error" not in chunks[-1], chunks[-1]
    return [t for c in chunks for t in c["token_ids"]]


def free_blocks(client):
    return {w.worker_id: ray.get(w.handle.free_blocks.remote())
            for w in client.prefill + client.decode}


def records(client):
    """Per-request state left on any worker (none once every request has ended)."""
    out = {}
    for w in client.prefill + client.decode:
        left = {k: v for k, v in ray.get(w.handle.load.remote())["records"].items() if v}
        if left:
            out[w.worker_id] = left
    return out


def wait_free(client, expected, timeout_s=20.0):
    """Every block back and no per-request record left behind, on every worker."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if free_blocks(client) == expected and not records(client):
            return
        time.sleep(0.2)
    assert free_blocks(client) == expected
    assert records(client) == {}


def wait_alive(client, timeout_s=60.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        asyncio.run(client.refresh())
        if all(w.healthy for w in client.prefill + client.decode):
            return
        time.sleep(0.5)
    raise AssertionError("workers did not come back")


@pytest.fixture(scope="module")
def reference(llama_dir):
    llm = LLM(llama_dir, dtype="float32", num_kv_blocks=NUM_BLOCKS)
    ps = prompts()
    ref = {"text": {}}
    for seeded in (False, True):
        outs = llm.generate(ps, [SamplingParams(**params(i, seeded)) for i in range(len(ps))])
        ref[seeded] = [o.token_ids for o in outs]
        ref["text"][seeded] = [o.text for o in outs]
    return ps, ref


def text_of(chunks):
    return "".join(c["text"] for c in chunks)


@pytest.mark.parametrize("seeded", [False, True])
def test_colocated_and_disaggregated_tokens_identical(cluster, reference, seeded):
    ps, ref = reference
    start = {w: NUM_BLOCKS for w in ("p0", "d0", "d1")}
    for i, prompt in enumerate(ps):
        colo = collect(cluster, f"c{i}-{seeded}", prompt, params(i, seeded),
                       decode_worker="d0")
        dis = collect(cluster, f"d{i}-{seeded}", prompt, params(i, seeded), disaggregate=True,
                      decode_worker="d1")
        assert tokens_of(colo) == ref[seeded][i]
        assert tokens_of(dis) == ref[seeded][i]
        assert text_of(colo) == text_of(dis) == ref["text"][seeded][i]
        assert {c["path"] for c in colo} == {"colocated"}
        assert {c["path"] for c in dis} == {"disaggregated"}
        assert dis[-1]["kv_transfer_s"] > 0 and dis[-1]["kv_arrived"] is True
    wait_free(cluster, start)


def _run_with_fault(client, rid, prompt, p, fault, **kw):
    """Stream a request and inject `fault(chunks_so_far)` once, after the first chunk or before
    anything arrives (fault_at=0)."""
    async def run():
        chunks = []
        fault_at = kw.pop("fault_at", 1)
        if fault_at == 0:
            fault()
        async for chunk in client.generate(rid, prompt, p, **kw):
            chunks.append(chunk)
            if len(chunks) == fault_at:
                fault()
        return chunks

    return asyncio.run(run())


def test_prefill_worker_killed_during_transfer(cluster, reference):
    ps, ref = reference
    p0 = cluster.prefill[0].handle
    # Hold the send so the kill lands after the first token, with the transfer outstanding.
    ray.get(p0.set_fault_injection.remote(delay_kv_send_s=3.0))
    chunks = _run_with_fault(cluster, "kill-p", ps[2], params(2, True),
                             lambda: ray.kill(p0, no_restart=False),
                             disaggregate=True, decode_worker="d0")
    assert tokens_of(chunks) == ref[True][2]
    assert chunks[0]["path"] == "disaggregated" and chunks[-1]["kv_arrived"] is False
    wait_alive(cluster)
    wait_free(cluster, {w: NUM_BLOCKS for w in ("p0", "d0", "d1")})


def test_prefill_worker_killed_before_first_token(cluster, reference):
    ps, ref = reference
    p0 = cluster.prefill[0].handle
    chunks = _run_with_fault(cluster, "kill-p0", ps[1], params(1, False),
                             lambda: ray.kill(p0, no_restart=False), fault_at=0,
                             disaggregate=True, decode_worker="d1")
    assert tokens_of(chunks) == ref[False][1]
    wait_alive(cluster)
    wait_free(cluster, {w: NUM_BLOCKS for w in ("p0", "d0", "d1")})


@pytest.mark.parametrize("fault_at", [0, 3])
def test_decode_worker_killed_migrates_stream(cluster, reference, fault_at):
    ps, ref = reference
    d0 = next(w for w in cluster.decode if w.worker_id == "d0")
    chunks = _run_with_fault(cluster, f"kill-d-{fault_at}", ps[3], params(3, True),
                             lambda: ray.kill(d0.handle, no_restart=False), fault_at=fault_at,
                             decode_worker="d0", disaggregate=fault_at == 3)
    assert tokens_of(chunks) == ref[True][3]  # one stream: nothing lost, nothing repeated
    assert text_of(chunks) == ref["text"][True][3]
    assert chunks[-1]["worker_id"] == "d1" and chunks[-1]["migrations"] == 1
    wait_alive(cluster)
    wait_free(cluster, {w: NUM_BLOCKS for w in ("p0", "d0", "d1")})


def test_cancel_mid_transfer_releases_both_sides(cluster, reference):
    ps, _ = reference
    long_prompt = [5 + i % 400 for i in range(600)]

    async def run():
        gen = cluster.generate("cancel-1", long_prompt, params(0, False), disaggregate=True,
                               decode_worker="d0")
        first = await gen.__anext__()
        held = await cluster.prefill[0].handle.load.remote()
        await gen.aclose()  # the caller goes away after the first token, mid-transfer
        return first, held

    p0 = cluster.prefill[0].handle
    ray.get(p0.set_fault_injection.remote(delay_kv_send_s=1.0))
    try:
        first, load = asyncio.run(run())
    finally:
        ray.get(p0.set_fault_injection.remote(delay_kv_send_s=0.0))
    assert first["token_ids"]
    assert load["held_blocks"] > 0, "the cancel must land while blocks are leased"
    wait_free(cluster, {w: NUM_BLOCKS for w in ("p0", "d0", "d1")})


def test_many_transfers_leave_no_per_request_state(cluster):
    """Two thousand disaggregated requests through one prefill/decode pair, some abandoned
    after their first token: afterwards every worker's per-request records, the transfer
    agents' tables among them, are empty and every block is back (memory stays flat)."""
    rng = random.Random(7)
    total, width = 2016, 24

    async def one(i):
        prompt = [rng.randrange(5, 500) for _ in range(rng.choice([17, 33, 48]))]
        gen = cluster.generate(f"many-{i}", prompt, dict(max_tokens=3, temperature=0.0,
                                                          ignore_eos=True),
                               disaggregate=True, decode_worker="d0")
        chunks = []
        async for chunk in gen:
            chunks.append(chunk)
            if i % 7 == 0:  # the caller leaves after the first token
                break
        await gen.aclose()
        return chunks

    async def run():
        done = []
        for start in range(0, total, width):
            done += await asyncio.gather(*(one(i) for i in range(start, start + width)))
        return done

    p0 = cluster.prefill[0].handle
    sent_before = ray.get(p0.load.remote())["kv_transfer"]["transfers_done"]
    results = asyncio.run(run())
    finished = [c for c in results if c and c[-1].get("finished")]
    assert len(finished) >= total - total // 7 - 1
    assert all("error" not in c[-1] for c in finished)
    wait_free(cluster, {w: NUM_BLOCKS for w in ("p0", "d0", "d1")}, timeout_s=30.0)
    # The KV really moved for most of them (not every request fell back to a local prefill).
    sent = ray.get(p0.load.remote())["kv_transfer"]["transfers_done"] - sent_before
    assert sent >= len(finished) // 2, (sent, len(finished))
    for w in cluster.prefill + cluster.decode:
        agent_tables = {k: v for k, v in ray.get(w.handle.load.remote())["records"].items()
                        if k.startswith("agent_")}
        assert agent_tables and not any(agent_tables.values()), (w.worker_id, agent_tables)


def test_no_decode_worker_left_ends_with_clear_error(cluster, reference):
    from pd_runtime.workers.client import PoolClient, WorkerRef

    ps, _ = reference
    dead = WorkerRef("gone", "decode", cluster.decode[0].handle, healthy=False)
    chunks = collect(PoolClient([], [dead], recovery_wait_s=0), "orphan", ps[0],
                     params(0, False))
    assert chunks[-1]["finished"] and chunks[-1]["error"]["status"] == 503
    assert "no decode worker" in chunks[-1]["error"]["message"]


def test_serve_from_yaml_runs_both_paths(llama_dir, tmp_path):
    """`pd-runtime serve --config FILE` in its own process: a local Ray, the pools from YAML,
    and the demo through both paths with the same text."""
    import subprocess
    import sys

    import yaml

    cfg = yaml.safe_load(open("cluster_configs/local.yaml"))
    cfg["model"] = llama_dir
    cfg["ray"]["num_cpus"] = 4
    for pool in ("prefill", "decode"):
        cfg[pool]["engine"].update(dtype="float32", num_kv_blocks=64, num_threads=1)
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(cfg))
    run = subprocess.run([sys.executable, "-m", "pd_runtime.cli", "--log-level", "WARNING",
                          "serve", "--config", str(path), "--demo", "--max-tokens", "8"],
                         capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = [ln for ln in run.stdout.splitlines() if ln.startswith("[")]
    assert sum("[colocated]" in ln for ln in lines) == 2
    assert sum("[disaggregated]" in ln for ln in lines) == 2
    texts = [ln for ln in run.stdout.splitlines() if ln.startswith("    ")]
    assert texts[:2] == texts[2:]  # same prompts, same greedy text on both paths


def test_serve_rejects_bad_config_naming_field(tmp_path):
    import subprocess
    import sys

    path = tmp_path / "bad.yaml"
    path.write_text("decode:\n  num_workers: 1\n  engine:\n    block_size: -4\n")
    run = subprocess.run([sys.executable, "-m", "pd_runtime.cli", "serve", "--config", str(path)],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 2
    assert "decode.engine.block_size" in run.stderr and ":4" in run.stderr


def test_abort_from_elsewhere_ends_the_stream_and_frees(cluster, reference):
    """A request aborted by a separate call (the router's cancel) must not leave its stream
    waiting forever, and must give its blocks back."""
    ps, _ = reference
    d1 = next(w for w in cluster.decode if w.worker_id == "d1").handle

    async def run():
        gen = d1.generate.remote(GenerationRequest.make(
            "abort-1", ps[0], dict(max_tokens=500, temperature=0.0, ignore_eos=True)))
        chunks = []
        async for ref in gen:
            chunks.append(await ref)
            if len(chunks) == 2:
                assert await d1.abort.remote("abort-1")
        return chunks

    chunks = asyncio.run(asyncio.wait_for(run(), timeout=30))
    assert 2 <= len(chunks) < 500 and not chunks[-1]["finished"]
    wait_free(cluster, {w: NUM_BLOCKS for w in ("p0", "d0", "d1")})


def test_cancel_before_prefill_releases_the_prefill_side(cluster, reference):
    ps, _ = reference
    p0 = cluster.prefill[0].handle
    d0 = next(w for w in cluster.decode if w.worker_id == "d0").handle
    meta = ray.get(d0.kv_metadata.remote())
    ray.get(p0.abort.remote("early-cancel"))  # the decode side gave up before the call
    steps = ray.get(p0.load.remote())["num_steps"]
    first = ray.get(p0.prefill.remote(GenerationRequest.make("early-cancel", ps[1],
                                                             params(1, False)),
                                      meta, [0, 1, 2], 0), timeout=30)
    # Refused before anything is computed: a hedged request is not prefilled twice.
    assert not first["token_ids"] and first["error"]["status"] == 499
    assert ray.get(p0.load.remote())["num_steps"] == steps
    assert ray.get(p0.load.remote())["records"]["ship_tasks"] == 0  # nothing is sent
    wait_free(cluster, {w: NUM_BLOCKS for w in ("p0", "d0", "d1")})


def test_draining_worker_gets_nothing_new(cluster, reference):
    ps, ref = reference
    d0 = next(w for w in cluster.decode if w.worker_id == "d0")
    ray.get(d0.handle.set_draining.remote(True))
    try:
        asyncio.run(cluster.refresh())
        assert d0.load["draining"] is True
        chunks = [collect(cluster, f"drain-{i}", ps[0], params(0, False)) for i in range(4)]
        assert {c[-1]["worker_id"] for c in chunks} == {"d1"}
        assert all(tokens_of(c) == ref[False][0] for c in chunks)
    finally:
        ray.get(d0.handle.set_draining.remote(False))
        asyncio.run(cluster.refresh())


def test_only_decode_worker_killed_continues_on_its_restart(cluster, reference):
    """One decode worker, killed mid-stream: the request waits for Ray to restart it and
    continues there; the caller sees one exact stream and no error."""
    from pd_runtime.workers.client import PoolClient

    ps, ref = reference
    d0 = next(w for w in cluster.decode if w.worker_id == "d0")
    alone = PoolClient(cluster.prefill, [d0], recovery_wait_s=60)
    chunks = _run_with_fault(alone, "kill-only-d", ps[3], params(3, True),
                             lambda: ray.kill(d0.handle, no_restart=False), fault_at=3)
    assert tokens_of(chunks) == ref[True][3]
    assert text_of(chunks) == ref["text"][True][3]
    assert chunks[-1]["worker_id"] == "d0" and chunks[-1]["migrations"] == 1
    wait_alive(cluster)
    wait_free(cluster, {w: NUM_BLOCKS for w in ("p0", "d0", "d1")})


def test_stopped_prefill_worker_is_hedged_on_the_decode_worker(cluster, reference):
    """The prefill worker stops (SIGSTOP) with a request handed to it: the decode worker that
    reserved the blocks prefills it itself after the hedge deadline, and the remote prefill is
    aborted, not computed later."""
    import os
    import signal

    ps, ref = reference
    p0 = cluster.prefill[0].handle
    d1 = next(w for w in cluster.decode if w.worker_id == "d1").handle
    pid = ray.get(p0.load.remote())["pid"]
    steps = ray.get(p0.load.remote())["num_steps"]
    hedged = ray.get(d1.load.remote())["hedged_prefills"]
    os.kill(pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        chunks = collect(cluster, "hedge-1", ps[2], params(2, True), disaggregate=True,
                         decode_worker="d1", prefill_worker="p0")
        waited = time.monotonic() - started
    finally:
        os.kill(pid, signal.SIGCONT)
    assert tokens_of(chunks) == ref[True][2]
    assert text_of(chunks) == ref["text"][True][2]
    assert ray.get(d1.load.remote())["hedged_prefills"] == hedged + 1
    assert waited < 4.0  # its liveness check hedges it; the ceiling is 10 s (remote_prefill_timeout_s)
    time.sleep(1.0)  # the stopped worker wakes up to the abort
    assert ray.get(p0.load.remote())["num_steps"] == steps, "the aborted prefill ran anyway"
    wait_free(cluster, {w: NUM_BLOCKS for w in ("p0", "d0", "d1")})


def test_health_reports_a_worker_gone_for_good(cluster, llama_dir):
    """A decode worker whose restarts are used up is reported dead on /health and /ready,
    and a request fails at once with Retry-After instead of waiting for it."""
    from pd_runtime.config import ClusterConfig
    from pd_runtime.workers.client import PoolClient
    from pd_runtime.workers.pool import start_worker, wait_ready
    from router.core import PoolBackend

    engine = EngineConfig(model=llama_dir, dtype="float32", num_kv_blocks=32, num_threads=1)
    kv = KVTransferConfig(backend="torch_dist")
    mortal = start_worker("decode", "mortal", engine, kv, num_cpus=1, max_restarts=0)
    wait_ready([mortal])
    client = PoolClient([], [mortal], recovery_wait_s=30)
    backend = PoolBackend(client, ClusterConfig(), llama_dir)
    asyncio.run(client.refresh())
    assert backend.health()["workers"]["mortal"]["state"] == "up" and backend.ready()
    ray.kill(mortal.handle, no_restart=True)
    deadline = time.monotonic() + 20
    while not mortal.dead and time.monotonic() < deadline:
        asyncio.run(client.refresh())
        time.sleep(0.2)
    health = backend.health()
    assert health["status"] == "degraded" and health["workers"]["mortal"]["state"] == "dead"
    assert not backend.ready()
    started = time.monotonic()
    chunks = collect(client, "to-the-dead", [5, 6, 7], params(0, False))
    assert chunks[-1]["error"]["status"] == 503 and chunks[-1]["error"]["retry_after_s"] > 0
    assert time.monotonic() - started < 10, "a dead pool must not make requests wait it out"
