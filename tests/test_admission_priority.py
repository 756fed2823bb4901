"""Admission control (typed overload errors), priority order, aging, and priority preemption."""

from __future__ import annotations

import pytest

from pd_runtime import LLM, SamplingParams
from pd_runtime.api import EngineOverloadedError

PARAMS = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


def drain(engine, max_steps=2000):
    order = []
    for _ in range(max_steps):
        for out in engine.step():
            if out.finished:
                order.append(out.request_id)
        if not engine.has_unfinished_requests():
            return order
    raise AssertionError("engine did not drain")


def test_waiting_queue_bounds_raise_overload(llama_dir):
    llm = LLM(llama_dir, dtype="float32", num_kv_blocks=64, max_waiting_requests=2,
              max_waiting_tokens=100)
    engine = llm.engine
    engine.add_request("a", [5] * 10, PARAMS)
    engine.add_request("b", [6] * 10, PARAMS)
    with pytest.raises(EngineOverloadedError) as err:
        engine.add_request("c", [7] * 10, PARAMS)
    assert err.value.retry_after_s > 0
    engine.abort("b")
    with pytest.raises(EngineOverloadedError, match="queue"):
        engine.add_request("d", [8] * 95, PARAMS)  # 10 + 95 waiting tokens > 100
    engine.add_request("e", [8] * 20, PARAMS)
    assert sorted(drain(engine)) == ["a", "e"]
    assert engine.block_manager.num_free_blocks == 64


def test_priority_orders_admission(llama_dir):
    llm = LLM(llama_dir, dtype="float32", num_kv_blocks=64, max_num_seqs=1)
    engine = llm.engine
    engine.add_request("late-but-urgent-not", [5] * 8, PARAMS, priority=5)
    engine.add_request("urgent", [6] * 8, PARAMS, priority=0)
    engine.add_request("middle", [7] * 8, PARAMS, priority=2)
    assert drain(engine) == ["urgent", "middle", "late-but-urgent-not"]


def test_aging_prevents_starvation(llama_dir):
    llm = LLM(llama_dir, dtype="float32", num_kv_blocks=64, max_num_seqs=1,
              priority_aging_steps=3)
    engine = llm.engine
    engine.add_request("low", [5] * 8, PARAMS, priority=4)
    finished_low_at = None
    for step in range(400):
        engine.add_request(f"hi{step}", [6] * 8, PARAMS, priority=0)  # an endless urgent stream
        for out in engine.step():
            if out.request_id == "low" and out.finished:
                finished_low_at = step
        if finished_low_at is not None:
            break
    assert finished_low_at is not None, "low-priority request starved"
    drain(engine)


def test_preemption_picks_least_urgent(llama_dir):
    # 6 blocks of 16 tokens: two 40-token prompts growing to 64+ tokens cannot both fit.
    llm = LLM(llama_dir, dtype="float32", num_kv_blocks=6, max_num_batched_tokens=128)
    engine = llm.engine
    long = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    engine.add_request("background", list(range(5, 45)), long, priority=3)
    engine.add_request("interactive", list(range(50, 90)), long, priority=0)
    preempted_first = None
    order = []
    for _ in range(500):
        for out in engine.step():
            if out.finished:
                order.append(out.request_id)
        if preempted_first is None and engine.scheduler.num_preemptions:
            preempted_first = engine.requests["background"].num_preemptions > 0
        if not engine.has_unfinished_requests():
            break
    assert preempted_first is True, "the low-priority request must be the victim"
    assert order == ["interactive", "background"]
    assert engine.block_manager.num_free_blocks == 6
