"""The Ray runtime under faults on a local Ray: a worker killed mid-transfer or mid-stream, a
cancel or an abort, a stopped or dead worker cost latency, never a request, and leave no block
behind. The paths themselves: test_workers_ray_paths.py."""

from __future__ import annotations

import asyncio
import time

import pytest

from pd_runtime.api import GenerationRequest
from pd_runtime.config import EngineConfig, KVTransferConfig

ray = pytest.importorskip("ray")

# pytest finds the fixtures `cluster` and `reference` by name in this module.
from tests.workers_ray_support.cluster import (NUM_BLOCKS, cluster, collect,  # noqa: E402,F401
                                               params, reference, text_of, tokens_of,
                                               wait_alive, wait_free)

pytestmark = pytest.mark.timeout(240)


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
    assert chunks[0].path == "disaggregated" and chunks[-1].kv_arrived is False
    wait_alive(cluster)
    wait_free(cluster, {w: NUM_BLOCKS for w in ("p0", "d0", "d1")})


def test_peer_killed_mid_fetch(cluster, reference):
    """A fetch from a peer (d0 holds the prompt's prefix and ships it to d1) whose source dies
    with the transfer outstanding: d1 computes the prompt itself; the stream is exact."""
    ps, ref = reference
    d0 = next(w for w in cluster.decode if w.worker_id == "d0").handle
    collect(cluster, "peer-warm", ps[2], params(2, True), decode_worker="d0")
    ray.get(d0.set_fault_injection.remote(delay_kv_send_s=3.0))
    chunks = _run_with_fault(cluster, "kill-peer", ps[2], params(2, True),
                             lambda: ray.kill(d0, no_restart=False), disaggregate=True,
                             decode_worker="d1", prefill_worker="d0")
    assert tokens_of(chunks) == ref[True][2]
    assert text_of(chunks) == ref["text"][True][2]
    assert chunks[0].path == "disaggregated" and chunks[-1].kv_arrived is False
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
    import os
    import signal

    ps, ref = reference
    d0 = next(w for w in cluster.decode if w.worker_id == "d0")
    # SIGKILL to the process: immediate, where ray.kill's trip through the control store could
    # land after the last of the remaining tokens (the stream then ends on d0: failed once).
    pid = ray.get(d0.handle.load.remote())["pid"]
    chunks = _run_with_fault(cluster, f"kill-d-{fault_at}", ps[3], params(3, True),
                             lambda: os.kill(pid, signal.SIGKILL), fault_at=fault_at,
                             decode_worker="d0", disaggregate=fault_at == 3)
    assert tokens_of(chunks) == ref[True][3]  # one stream: nothing lost, nothing repeated
    assert text_of(chunks) == ref["text"][True][3]
    assert chunks[-1].worker_id == "d1" and chunks[-1].migrations == 1
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
    assert first.token_ids
    assert load["held_blocks"] > 0, "the cancel must land while blocks are leased"
    wait_free(cluster, {w: NUM_BLOCKS for w in ("p0", "d0", "d1")})


def test_a_prefill_worker_stands_in_while_no_decode_worker_is_up(cluster, reference):
    """Every decode worker down (restarting, say): a prefill worker serves the whole request,
    exactly, instead of the request waiting for a restart."""
    from pd_runtime.workers.client import PoolClient, WorkerRef

    ps, ref = reference
    down = WorkerRef("down", "decode", cluster.decode[0].handle, healthy=False)
    chunks = collect(PoolClient(cluster.prefill, [down], recovery_wait_s=0), "stand-in", ps[1],
                     params(1, True))
    assert tokens_of(chunks) == ref[True][1] and text_of(chunks) == ref["text"][True][1]
    assert chunks[-1].error is None and chunks[-1].worker_id == "p0"
    wait_free(cluster, {w: NUM_BLOCKS for w in ("p0", "d0", "d1")})


def test_a_worker_handed_itself_as_prefill_worker_serves_whole(cluster, reference):
    """A disaggregated request whose prefill worker is the worker itself (a prefill worker
    standing in for decode) is served there whole: a transfer to itself once hung."""
    import asyncio

    from pd_runtime.api import GenerationRequest

    ps, ref = reference
    d0 = next(w for w in cluster.decode if w.worker_id == "d0")

    async def run():
        request = GenerationRequest.make("itself", ps[2], params(2, False))
        return [await item async for item in
                d0.handle.generate_disaggregated.remote(request, d0.handle)]

    chunks = asyncio.run(asyncio.wait_for(run(), 60))
    assert tokens_of(chunks) == ref[False][2] and chunks[-1].path == "colocated"
    wait_free(cluster, {w: NUM_BLOCKS for w in ("p0", "d0", "d1")})


def test_no_decode_worker_left_ends_with_clear_error(cluster, reference):
    from pd_runtime.workers.client import PoolClient, WorkerRef

    ps, _ = reference
    dead = WorkerRef("gone", "decode", cluster.decode[0].handle, healthy=False)
    chunks = collect(PoolClient([], [dead], recovery_wait_s=0), "orphan", ps[0],
                     params(0, False))
    assert chunks[-1].finished and chunks[-1].error.status == 503
    assert "no decode worker" in chunks[-1].error.message


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
    assert 2 <= len(chunks) < 500 and not chunks[-1].finished
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
    assert not first.token_ids and first.error.status == 499
    assert ray.get(p0.load.remote())["num_steps"] == steps
    assert ray.get(p0.load.remote())["records"]["ship_tasks"] == 0  # nothing is sent
    wait_free(cluster, {w: NUM_BLOCKS for w in ("p0", "d0", "d1")})


def test_only_decode_worker_killed_continues_on_its_restart(cluster, reference):
    """One decode worker and no prefill worker to stand in, killed mid-stream: the request
    waits for Ray to restart it and continues there; the caller sees one exact stream and no
    error."""
    from pd_runtime.workers.client import PoolClient

    import os
    import signal

    ps, ref = reference
    d0 = next(w for w in cluster.decode if w.worker_id == "d0")
    alone = PoolClient([], [d0], recovery_wait_s=60)
    # SIGKILL the process itself: immediate, where ray.kill goes through the control store and
    # on two busy cores could land after the last of the 21 remaining tokens (no migration).
    pid = ray.get(d0.handle.load.remote())["pid"]
    chunks = _run_with_fault(alone, "kill-only-d", ps[3], params(3, True),
                             lambda: os.kill(pid, signal.SIGKILL), fault_at=3)
    assert tokens_of(chunks) == ref[True][3]
    assert text_of(chunks) == ref["text"][True][3]
    assert chunks[-1].worker_id == "d0" and chunks[-1].migrations == 1
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
    assert waited < 8.0  # hedged on its liveness check, not at the 10 s remote_prefill_timeout_s
    time.sleep(1.0)  # the stopped worker wakes up to the abort
    assert ray.get(p0.load.remote())["num_steps"] == steps, "the aborted prefill ran anyway"
    wait_free(cluster, {w: NUM_BLOCKS for w in ("p0", "d0", "d1")})


def test_health_reports_a_worker_gone_for_good(cluster, llama_dir):
    """A decode worker whose restarts are used up is reported dead on /health and /ready,
    and a request fails at once with Retry-After instead of waiting for it."""
    from pd_runtime.config import ClusterConfig
    from pd_runtime.workers.client import PoolClient
    from pd_runtime.workers.pool import start_worker, wait_ready
    from pd_runtime.router.core import PoolBackend

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
    assert chunks[-1].error.status == 503 and chunks[-1].error.retry_after_s > 0
    assert time.monotonic() - started < 10, "a dead pool must not make requests wait it out"
