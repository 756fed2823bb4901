"""Decode steps paced while other threads want the cores (engine.min_step_interval_s,
pd_runtime/workers/engine_loop.py): with every core of the machine busy elsewhere, a stream's
steps start at least the interval apart and the loop counts the time it gave away; with the
interval 0 it never waits. The busy cores are real processes spinning. (That steps run back to
back while the cores are free is not asserted: a shared CI machine's cores are not.)"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import time


from pd_runtime import LLM, SamplingParams
from pd_runtime.workers.engine_loop import EngineLoop, cores_wanted_by_others

CORES = len(os.sched_getaffinity(0))
PARAMS = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@contextlib.contextmanager
def every_core_busy():
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                for _ in range(CORES)]
    try:
        deadline = time.monotonic() + 20.0
        while not cores_wanted_by_others(CORES):  # until the spinners are running
            assert time.monotonic() < deadline, "the spinning processes never showed as running"
            time.sleep(0.01)
        yield
    finally:
        for p in spinners:
            p.kill()
            p.wait()


def stream(engine) -> tuple[list[float], float, list[int]]:
    """One request through an EngineLoop: when each output arrived, the time paced, tokens."""
    async def main():
        loop = EngineLoop(engine, asyncio.get_running_loop())
        try:
            outputs = loop.open_stream("r")
            await loop.call(lambda e: e.add_request("r", list(range(5, 40)), PARAMS))
            times, tokens = [], []
            while True:
                out = await asyncio.wait_for(outputs.get(), 60.0)
                times.append(time.monotonic())
                tokens.extend(out.new_token_ids)
                if out.finished:
                    now = time.monotonic()
                    # The interval it reports as its pace now, and once the cores are free.
                    assert loop.pacing_s(now) == engine.config.min_step_interval_s \
                        or not loop.paced_s
                    assert loop.pacing_s(now + 3.0) == 0.0
                    return times, loop.paced_s, tokens
        finally:
            loop.stop()

    return asyncio.run(main())


def test_steps_wait_out_the_interval_while_every_core_is_wanted(llama_dir):
    paced = LLM(llama_dir, dtype="float32", num_kv_blocks=16, min_step_interval_s=0.05).engine
    free = LLM(llama_dir, dtype="float32", num_kv_blocks=16, min_step_interval_s=0).engine
    with every_core_busy():
        times, paced_s, tokens = stream(paced)
        _, unpaced_s, same = stream(free)
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert len(gaps) >= 8
    # Each step starts >= 50 ms after the one before (a step's outputs come at its end, so the
    # gap between two outputs is at least the interval less scheduling noise).
    assert sorted(gaps)[len(gaps) // 2] >= 0.045, gaps
    assert paced_s > 0.2 and unpaced_s == 0.0
    assert tokens == same  # pacing moves when a step runs, never what it computes

