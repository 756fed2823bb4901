"""The decode side's wait for KV blocks (workers/decode_half.py: ReservationQueue, _reserve)
on a real engine and engine loop: a reservation is made the moment blocks are freed, first
come first served, refused after its deadline, and a caller that goes away leaves nothing."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from pd_runtime import LLM, SamplingParams
from pd_runtime.api import EngineOverloadedError
from pd_runtime.workers.engine_loop import EngineLoop
from pd_runtime.workers.decode_half import ReservationQueue, _reserve

PARAMS = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


def test_reservations_wait_for_blocks_in_order_without_polling(llama_dir):
    engine = LLM(llama_dir, dtype="float32", num_kv_blocks=8).engine

    async def main():
        loop = EngineLoop(engine, asyncio.get_running_loop())
        queue = ReservationQueue()
        loop.add_tick_hook(queue.tick)
        worker = SimpleNamespace(_engine_loop=lambda: loop, reservations=queue,
                                 reservation_timeout_s=10.0, worker_id="decode-0")
        try:
            def reserve(rid, n):
                return asyncio.ensure_future(_reserve(worker, rid, [5 + len(rid)] * n, PARAMS,
                                                      0, None))

            a = await reserve("a", 7 * 16)  # 7 of 8 blocks
            assert a.block_ids and engine.block_manager.num_free_blocks == 1
            b = reserve("b", 3 * 16)  # must wait for a
            c = reserve("cc", 16)  # one block is free, but b came first
            await asyncio.sleep(0.3)
            assert not b.done() and not c.done() and len(queue) == 2
            steps = loop.steps
            await loop.call(lambda e: e.abort("a"))
            got_b, got_c = await asyncio.wait_for(asyncio.gather(b, c), 5.0)
            assert len(got_b.block_ids) == 3 and len(got_c.block_ids) == 1
            assert loop.steps == steps  # made by the loop's tick after the abort, not a step
            assert engine.block_manager.num_free_blocks == 4 and len(queue) == 0

            worker.reservation_timeout_s = 0.3  # 5 blocks never come free while b and c hold
            with pytest.raises(EngineOverloadedError, match="no free KV blocks"):
                await reserve("d", 5 * 16)
            gone = reserve("e", 5 * 16)
            await asyncio.sleep(0.1)
            gone.cancel()
            with pytest.raises(asyncio.CancelledError):
                await gone
            assert len(queue) == 0
            assert set(engine.requests) == {"b", "cc"}  # nothing left of d or e
            for rid in ("b", "cc"):
                await loop.call(lambda e, rid=rid: e.abort(rid))
            assert engine.block_manager.num_free_blocks == 8
        finally:
            loop.stop()

    asyncio.run(main())
