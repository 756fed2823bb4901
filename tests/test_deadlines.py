"""A request's deadline (GenerationRequest.deadline, set by the router from request_timeout_s)
is enforced by the worker's engine loop: past it the request is aborted in the engine, every
block comes back, and its stream ends with a 504 error chunk, on the colocated and the
disaggregated path, so a worker never computes on for a client nobody is serving.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from pd_runtime import LLM, SamplingParams
from pd_runtime.api import DeadlineExceededError, GenerationRequest, InvalidRequestError
from pd_runtime.workers.deadlines import DeadlineWatch
from tests.pool_support import pair_config

ENGINE = dict(dtype="float32", num_kv_blocks=128, num_threads=1)
LONG = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)


def test_watch_aborts_a_running_request_mid_stream(llama_dir):
    engine = LLM(llama_dir, **ENGINE).engine
    ended = []
    watch = DeadlineWatch(lambda rid, exc: ended.append((rid, exc)))
    engine.add_request("late", list(range(5, 45)), LONG)
    engine.add_request("in-time", list(range(7, 27)), LONG)
    watch.add("late", time.time() + 3600)
    watch.add("in-time", time.time() + 3600)
    tokens = 0
    for _ in range(5):
        tokens += sum(len(o.new_token_ids) for o in engine.step() if o.request_id == "late")
    assert tokens == 5 and not ended
    watch.tick(engine)  # nothing is due yet
    assert not ended and "late" in engine.requests
    watch.add("late", time.time() - 0.01)  # its deadline moves into the past
    watch.tick(engine)
    assert [rid for rid, _ in ended] == ["late"]
    assert isinstance(ended[0][1], DeadlineExceededError) and watch.expired == 1
    assert "late" not in engine.requests and "in-time" in engine.requests
    while engine.has_unfinished_requests():  # the other request is untouched
        engine.step()
    watch.tick(engine)
    assert watch.expired == 1
    assert engine.block_manager.num_free_blocks == 128


def test_request_waiting_for_remote_kv_is_left_until_it_lands(llama_dir):
    engine = LLM(llama_dir, **ENGINE).engine
    ended = []
    watch = DeadlineWatch(lambda rid, exc: ended.append(rid))
    res = engine.remote.reserve("remote", list(range(5, 40)), LONG)
    assert res is not None
    watch.add("remote", time.time() - 1)
    watch.tick(engine)  # the receive may still be writing its blocks: not now
    assert not ended and "remote" in engine.remote.waiting and len(watch) == 1
    engine.remote.fail("remote")  # no KV comes: it joins the scheduler, prefilled here
    watch.tick(engine)  # the first tick after: before any step of it
    assert ended == ["remote"] and "remote" not in engine.requests
    assert engine.block_manager.num_free_blocks == 128


def test_deadline_must_be_finite():
    with pytest.raises(InvalidRequestError) as info:
        GenerationRequest.make("r", [1, 2], {"max_tokens": 3}, deadline=float("nan"))
    assert info.value.param == "deadline"


@pytest.fixture(scope="module")
def pool(llama_dir):
    from pd_runtime.workers.local_pool import LocalPool

    pool = LocalPool(pair_config(llama_dir, ENGINE), llama_dir)
    yield pool
    pool.close()


async def _collect(pool, rid, prompt, disaggregate, deadline):
    return [c async for c in pool.generate(rid, prompt, LONG, disaggregate=disaggregate,
                                           deadline=deadline)]


def _settled(engine, timeout_s=10.0):
    """Wait until the engine holds nothing (the worker's own threads finish its cleanup)."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if not engine.requests and not engine.remote.held and not engine.remote.waiting \
                and engine.block_manager.num_free_blocks == 128:
            return True
        time.sleep(0.05)
    return False


@pytest.mark.parametrize("disaggregate", [False, True], ids=["colocated", "disaggregated"])
def test_worker_ends_a_request_past_its_deadline(pool, disaggregate):
    prompt = list(range(9, 109))
    chunks = asyncio.run(_collect(pool, f"past-{disaggregate}", prompt, disaggregate,
                                  time.time() - 1))
    last = chunks[-1]
    assert last.finished and last.error.status == 504, last
    assert last.error.type == "timeout"
    # With a deadline far off, the same request on the same workers runs to its end.
    chunks = asyncio.run(_collect(pool, f"future-{disaggregate}", prompt, disaggregate,
                                  time.time() + 600))
    assert chunks[-1].error is None, chunks[-1].error
    assert chunks[-1].finish_reason == "length"
    assert sum(len(c.token_ids) for c in chunks) == LONG.max_tokens
    for role in ("decode-0", "prefill-0"):
        engine = pool.worker(role).engine
        assert _settled(engine), (role, engine.requests, engine.block_manager.num_free_blocks)
    if disaggregate:
        assert chunks[-1].path == "disaggregated"
    assert pool.worker("decode-0").deadlines.expired >= 1
