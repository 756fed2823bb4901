"""After any workload, including aborts and preemption, every block returns to the free list."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pd_runtime import LLM, SamplingParams

NUM_BLOCKS = 24


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(llama_dir, dtype="float32", num_kv_blocks=NUM_BLOCKS, block_size=4,
               max_num_batched_tokens=24, max_num_seqs=6)


request_st = st.tuples(
    st.lists(st.integers(5, 40), min_size=1, max_size=30),   # prompt (small alphabet: hits)
    st.integers(1, 12),                                       # max_tokens
    st.booleans(),                                            # greedy?
    st.one_of(st.none(), st.integers(0, 8)),                  # abort after this many steps
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(requests=st.lists(request_st, min_size=1, max_size=10))
def test_free_blocks_return_to_start(llm, requests):
    engine = llm.engine
    bm = engine.block_manager
    assert bm.num_free_blocks == NUM_BLOCKS
    aborts = {}
    for i, (prompt, max_tokens, greedy, abort_at) in enumerate(requests):
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0 if greedy else 1.0,
                                seed=i, ignore_eos=True)
        engine.add_request(f"r{i}", prompt, params)
        if abort_at is not None:
            aborts[f"r{i}"] = abort_at
    finished = set()
    for step in range(500):
        for rid, at in list(aborts.items()):
            if at == step:
                engine.abort(rid)
                del aborts[rid]
        for out in engine.step():
            if out.finished:
                finished.add(out.request_id)
        held = {b for r in engine.requests.values() for b in r.block_ids}
        assert bm.num_free_blocks + len(held) == NUM_BLOCKS, "a block leaked or was double-freed"
        if not engine.has_unfinished_requests():
            break
    assert not engine.has_unfinished_requests()
    assert bm.num_free_blocks == NUM_BLOCKS
    assert all(b.ref_count == 0 for b in bm.blocks)
