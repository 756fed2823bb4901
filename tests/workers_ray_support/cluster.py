"""The local Ray cluster (one prefill, two decode workers) and the single-process reference the
Ray runtime's tests compare against, with the helpers that read streams and worker state."""

from __future__ import annotations

import asyncio
import random
import time

import pytest
import ray

from pd_runtime import LLM, SamplingParams
from pd_runtime.config import EngineConfig, KVTransferConfig, RecoveryConfig

NUM_BLOCKS = 128


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
    # hedge_min_s 3 s: a first prefill slowed past the default 1.2 s hedge on a loaded box was
    # hedged locally, and a test that needs the transfer saw none (the hedge test's own deadline
    # is 8 s).
    recovery = RecoveryConfig(remote_prefill_timeout_s=10.0, reservation_timeout_s=5.0,
                              hedge_min_s=3.0)
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
    assert chunks and chunks[-1].finished, chunks[-1:]
    assert chunks[-1].error is None, chunks[-1]
    return [t for c in chunks for t in c.token_ids]


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


def wait_free(client, expected, timeout_s=60.0):
    """Every block back and no per-request record left behind, on every worker (a killed
    worker's peers free theirs at their deadlines, which a loaded machine stretches)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if free_blocks(client) == expected and not records(client):
            return
        time.sleep(0.2)
    blocks, left = free_blocks(client), records(client)
    assert blocks == expected, blocks
    assert left == {}, left


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
    return "".join(c.text for c in chunks)

