"""A worker changes role in place (PDWorker.set_role, the autoscaler's re-role, issue 48): only
when idle, keeping its engine (weights, KV and prefix cache), with what the role decides
changed: its torch threads, its step pacing and its prefill flag. The whole re-role on Ray, drain
included, is tests/test_autoscale_ray.py's."""

from __future__ import annotations

import asyncio

import pytest

from pd_runtime import LLM, SamplingParams
from pd_runtime.api import GenerationRequest
from pd_runtime.workers.node_signals import BusyFlag, PrefillWatch
from tests.pool_support import pair_config

ENGINE = dict(dtype="float32", num_kv_blocks=64, num_threads=1, warmup_tokens=0)
PARAMS = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


async def _call(handle, method: str, *args):
    return await getattr(handle, method).remote(*args)


async def _generate(handle, rid: str, prompt: list[int]) -> list[int]:
    tokens = []
    async for ref in handle.generate.remote(GenerationRequest.make(rid, prompt, PARAMS)):
        chunk = await ref
        assert chunk.error is None, chunk.error
        tokens += chunk.token_ids
    return tokens


def test_a_prefill_worker_turns_decode_and_back_only_when_idle(llama_dir):
    from pd_runtime.workers.local_pool import LocalPool

    pool = LocalPool(pair_config(llama_dir, ENGINE), llama_dir)
    try:
        ref = pool.prefill[0]
        worker = pool.worker("prefill-0")
        engine = worker.engine
        prompt = list(range(7, 47))
        expected = LLM(llama_dir, **ENGINE).generate([prompt], PARAMS)[0].token_ids
        asyncio.run(_generate(ref.handle, "warm", prompt))  # starts its engine loop
        flag = worker.loop._busy_flag
        assert isinstance(flag, BusyFlag) and flag.path.exists()

        # Busy: refused, nothing changed.
        long = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
        asyncio.run_coroutine_threadsafe(
            worker.loop.call(lambda e: e.add_request("busy", prompt, long)),
            worker.loop.loop).result(timeout=10)
        with pytest.raises(RuntimeError, match="not idle"):
            asyncio.run(_call(ref.handle, "set_role", "decode", 1, 0.05))
        assert worker.role == "prefill" and worker.loop._busy_flag is flag
        asyncio.run(_call(ref.handle, "abort", "busy"))

        # Idle: it turns decode, the same engine, paced, its flag gone; and serves exactly.
        info = asyncio.run(_call(ref.handle, "set_role", "decode", 1, 0.05))
        assert info == {"worker_id": "prefill-0", "role": "decode", "was": "prefill",
                        "num_threads": 1}
        assert worker.engine is engine and worker.role == "decode"
        assert worker.loop._busy_flag is None and not flag.path.exists()
        assert isinstance(worker.loop._watch, PrefillWatch) and worker.loop._min_step_s == 0.05
        load = asyncio.run(_call(ref.handle, "load"))
        assert load["role"] == "decode" and load["min_step_interval_s"] == 0.05
        assert asyncio.run(_generate(ref.handle, "as-decode", prompt)) == expected
        assert engine.block_manager.stats.hit_tokens > 0  # its prefix cache kept

        # And back: a prefill flag again, no pacing.
        asyncio.run(_call(ref.handle, "set_role", "prefill", 1, 0.0))
        assert isinstance(worker.loop._busy_flag, BusyFlag) and worker.loop._watch is None
        assert worker.loop._min_step_s == 0.0 and worker.role == "prefill"
        with pytest.raises(ValueError, match="role must be one of"):
            asyncio.run(_call(ref.handle, "set_role", "router"))
        assert worker.loop._thread.is_alive()
    finally:
        pool.close()


def test_a_flag_closed_by_a_re_role_mid_loop_is_not_written(tmp_path):
    """The engine loop sets its flag after the commands of a turn, one of which may be the
    re-role that closed it (busy when closed): that write must not end the engine thread."""
    flag = BusyFlag(tmp_path)
    flag.set(True)
    flag.close()
    flag.set(False)
    flag.set(True)
    assert not flag.path.exists()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_calls_fail_once_the_engine_thread_is_gone(llama_dir):
    """An engine thread that ends (here a command raising past the loop's handler) fails the
    commands queued behind it and every later call, instead of leaving them waiting forever."""
    import threading

    from pd_runtime.workers.engine_loop import EngineLoop

    aio = asyncio.new_event_loop()
    loop = EngineLoop(LLM(llama_dir, **ENGINE).engine, aio)
    gate = threading.Event()

    class Fatal(BaseException):
        pass

    def fatal(engine):
        raise Fatal()

    try:
        loop.post(lambda e: gate.wait(10))  # holds the thread while the rest queue up
        loop.post(fatal)
        queued = aio.create_task(loop.call(lambda e: 1))
        aio.run_until_complete(asyncio.sleep(0.05))
        gate.set()
        with pytest.raises(RuntimeError, match="engine thread has stopped"):
            aio.run_until_complete(asyncio.wait_for(queued, 10))
        loop._thread.join(10)
        with pytest.raises(RuntimeError, match="engine thread has stopped"):
            aio.run_until_complete(loop.call(lambda e: 1))
    finally:
        aio.close()
