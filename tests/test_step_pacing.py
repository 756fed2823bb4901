"""Decode steps paced while a prefill worker on this machine computes (engine.min_step_interval_s,
pd_runtime/workers/engine_loop.py, over the flags of pd_runtime/workers/node_signals.py): with a
prefill worker's flag up, a stream's steps start at least the interval apart and the loop counts
the time it gave away (and the wait per step it reports to the router); with the flag down, the
worker stopped (SIGSTOP) or gone, and with the interval 0, it never waits. The flags are real
files in shared memory; the prefill workers are real processes (this one, or children)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import pytest

from pd_runtime import LLM, SamplingParams
from pd_runtime.workers.engine_loop import EngineLoop
from pd_runtime.workers.node_signals import BusyFlag, PrefillWatch

PARAMS = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def stream(engine, **signals) -> tuple[list[float], EngineLoop, list[int], list[bool]]:
    """One request through an EngineLoop: when each output arrived, the loop, the tokens, and
    (with a watch given as `seen`) whether it saw a prefill worker busy at each output."""
    seen_by = signals.pop("seen", None)

    async def main():
        loop = EngineLoop(engine, asyncio.get_running_loop(), **signals)
        try:
            outputs = loop.open_stream("r")
            await loop.call(lambda e: e.add_request("r", list(range(5, 40)), PARAMS))
            times, tokens, seen = [], [], []
            while True:
                out = await asyncio.wait_for(outputs.get(), 60.0)
                times.append(time.monotonic())
                tokens.extend(out.new_token_ids)
                if seen_by is not None:
                    seen.append(seen_by.busy())
                if out.finished:
                    return times, loop, tokens, seen
        finally:
            loop.stop()

    return asyncio.run(main())


@pytest.fixture
def flags(tmp_path):
    return tmp_path / "flags"


def test_steps_wait_out_the_interval_while_a_prefill_worker_computes(llama_dir, flags):
    paced = LLM(llama_dir, dtype="float32", num_kv_blocks=16, min_step_interval_s=0.05).engine
    free = LLM(llama_dir, dtype="float32", num_kv_blocks=16, min_step_interval_s=0).engine
    prefill = BusyFlag(flags)  # this process, as a prefill worker with work
    try:
        prefill.set(True)
        times, loop, tokens, _ = stream(paced, prefill_watch=PrefillWatch(flags))
        _, unpaced, same, _ = stream(free, prefill_watch=PrefillWatch(flags))
    finally:
        prefill.close()
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert len(gaps) >= 8
    # Each step starts >= 50 ms after the one before (a step's outputs come at its end, so the
    # gap between two outputs is at least the interval less scheduling noise).
    assert sorted(gaps)[len(gaps) // 2] >= 0.045, gaps
    assert loop.paced_s > 0.2 and unpaced.paced_s == 0.0
    assert 0.0 < loop.pace_wait_s < 0.05 and unpaced.pace_wait_s == 0.0
    assert tokens == same  # pacing moves when a step runs, never what it computes


def test_steps_run_back_to_back_while_the_prefill_workers_are_idle(llama_dir, flags):
    paced = LLM(llama_dir, dtype="float32", num_kv_blocks=16, min_step_interval_s=0.05).engine
    prefill = BusyFlag(flags)
    try:
        _, loop, _, _ = stream(paced, prefill_watch=PrefillWatch(flags))  # its flag is down
    finally:
        prefill.close()
    assert loop.paced_s == 0.0 and loop.pace_wait_s == 0.0


def test_a_prefill_workers_flag_is_up_while_its_engine_has_work(llama_dir, flags):
    engine = LLM(llama_dir, dtype="float32", num_kv_blocks=16).engine
    watch = PrefillWatch(flags, rescan_s=0.0)
    _, loop, _, seen = stream(engine, busy_flag=BusyFlag(flags), seen=watch)
    assert any(seen[:-1])  # up while the request ran (seen as outputs come: most, not all)
    assert not watch.busy() and not list(flags.iterdir())  # down, and removed by stop()


def test_a_stopped_or_dead_prefill_worker_is_not_waited_for(flags):
    code = ("import sys, time; from pathlib import Path; "
            "from pd_runtime.workers.node_signals import BusyFlag; "
            "f = BusyFlag(Path(sys.argv[1])); f.set(True); print('up', flush=True); "
            "time.sleep(60)")
    child = subprocess.Popen([sys.executable, "-c", code, str(flags)], stdout=subprocess.PIPE,
                             text=True)
    try:
        assert child.stdout.readline().strip() == "up"
        watch = PrefillWatch(flags, rescan_s=0.0)
        assert watch.busy() and watch.watched() == 1
        os.kill(child.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 10
        while watch.busy():  # until the kernel shows it stopped
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert watch.watched() == 0
        os.kill(child.pid, signal.SIGCONT)
        while not watch.busy():
            assert time.monotonic() < deadline
            time.sleep(0.01)
        child.kill()
        child.wait()
        assert not watch.busy() and not list(flags.iterdir())  # gone: its file removed
    finally:
        child.kill()
        child.wait()
