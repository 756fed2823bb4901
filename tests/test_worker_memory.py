"""A worker pair's memory is flat: a few thousand disaggregated requests through one prefill and
one decode worker (the same PDWorker as on Ray, in-process, KV over the local link), finished,
finished by their first token, dropped by their client mid-stream and past their deadline,
leave both transfer agents' per-request tables and both workers' per-request records empty,
and every KV block free. (The agent alone, with faults and timeouts: test_kv_transfer_memory.)
"""

from __future__ import annotations

import asyncio
import random
import time

import pytest

from pd_runtime import SamplingParams
from tests.pool_support import pair_config

pytestmark = pytest.mark.timeout(300)

REQUESTS, CONCURRENCY, BLOCKS = 2000, 16, 256
ENGINE = dict(dtype="float32", num_kv_blocks=BLOCKS, num_threads=1)
KINDS = ("full", "full", "full", "full", "one_token", "dropped", "past_deadline", "colocated")


def _records(worker) -> dict:
    """Every per-request structure a worker and its engine loop keep, by name: its size."""
    sizes = {
        "remote_prefills": len(worker.remote_prefills), "shipments": len(worker.shipments),
        "ship_tasks": len(worker.ship_tasks), "send_waiters": len(worker.send_waiters),
        "cancelled": len(worker.cancelled), "reservations": len(worker.reservations),
        "deadlines": len(worker.deadlines) if worker.deadlines is not None else 0,
        "streams": len(worker.loop._streams) if worker.loop is not None else 0,
        "engine.requests": len(worker.engine.requests),
        "engine.remote.held": len(worker.engine.remote.held),
        "engine.remote.waiting": len(worker.engine.remote.waiting),
        "blocks in use": BLOCKS - worker.engine.block_manager.num_free_blocks,
    }
    sizes.update({f"agent.{name}": size for name, size in worker.agent.table_sizes().items()
                  if name != "recent"})
    return sizes


def _wait_empty(worker, timeout_s: float = 15.0) -> dict:
    end = time.monotonic() + timeout_s
    while True:
        left = {name: size for name, size in _records(worker).items() if size}
        if not left or time.monotonic() > end:
            return left
        time.sleep(0.05)


async def _one(pool, number: int, kind: str, rng: random.Random) -> tuple[str, list[dict]]:
    prompt = [rng.randrange(5, 500) for _ in range(rng.choice([17, 40, 70]))]
    params = SamplingParams(max_tokens=1 if kind == "one_token" else 4, temperature=0.0,
                            ignore_eos=True)
    deadline = time.time() - 1 if kind == "past_deadline" else time.time() + 600
    chunks = []
    stream = pool.generate(f"m{number}", prompt, params, disaggregate=kind != "colocated",
                           deadline=deadline)
    try:
        async for chunk in stream:
            chunks.append(chunk)
            if kind == "dropped":
                break  # the client goes away after its first token
    finally:
        await stream.aclose()
    return kind, chunks


async def _run_all(pool) -> list[tuple[str, list[dict]]]:
    rng = random.Random(11)
    gate = asyncio.Semaphore(CONCURRENCY)

    async def bounded(number):
        async with gate:
            return await _one(pool, number, KINDS[number % len(KINDS)], rng)

    return await asyncio.gather(*(bounded(n) for n in range(REQUESTS)))


def test_thousands_of_requests_leave_no_per_request_state(llama_dir):
    from pd_runtime.workers.local_pool import LocalPool

    pool = LocalPool(pair_config(llama_dir, ENGINE), llama_dir)
    try:
        results = asyncio.run(_run_all(pool))
        by_kind: dict[str, int] = {}
        for kind, chunks in results:
            last = chunks[-1]
            by_kind[kind] = by_kind.get(kind, 0) + 1
            if kind == "past_deadline":
                assert last.error.status == 504, last
                continue
            assert last.error is None, last.error
            tokens = sum(len(c.token_ids) for c in chunks)
            if kind == "dropped":
                assert tokens >= 1 and not last.finished
            else:
                assert last.finished and tokens == (1 if kind == "one_token" else 4)
                assert last.path == ("colocated" if kind == "colocated" else
                                        "disaggregated")
        assert sum(by_kind.values()) == REQUESTS and len(by_kind) == len(set(KINDS))
        prefill, decode = pool.worker("prefill-0"), pool.worker("decode-0")
        for worker in (prefill, decode):
            left = _wait_empty(worker)
            assert not left, f"{worker.worker_id} still holds {left}"
        # The requests went where they were meant to: the KV crossed the link for most.
        assert prefill.transfer_overlap.count >= REQUESTS // 4
    finally:
        pool.close()
