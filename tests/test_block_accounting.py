"""After any workload, including aborts and preemption, every block returns to the free list."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pd_runtime import LLM, SamplingParams

NUM_BLOCKS = 16


@pytest.fixture(scope="module", params=["recompute", "swap"])
def llm(request, llama_dir):
    # Swap space of 10 blocks (block bytes: 2 layers x K,V x 2 heads x 4 tokens x 16 dims x 4 B):
    # victims swap while it has room and recompute beyond it.
    return LLM(llama_dir, dtype="float32", num_kv_blocks=NUM_BLOCKS, block_size=4,
               max_num_batched_tokens=24, max_num_seqs=6, preemption_mode=request.param,
               swap_space_bytes=10 * 2 * 2 * 2 * 4 * 16 * 4)


request_st = st.tuples(
    st.lists(st.integers(5, 40), min_size=1, max_size=30),   # prompt (small alphabet: hits)
    st.integers(1, 12),                                       # max_tokens
    st.booleans(),                                            # greedy?
    st.one_of(st.none(), st.integers(0, 8)),                  # abort after this many steps
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(requests=st.lists(request_st, min_size=1, max_size=10))
def test_free_blocks_return_to_start(llm, requests):
    run_workload(llm, requests)


def test_heavy_workload_preempts_and_still_balances(llm):
    """A fixed workload that must preempt (and swap, in swap mode), so the property above is
    known to cover those paths."""
    sched = llm.engine.scheduler
    before = (sched.num_preemptions, sched.num_swapped_out)
    requests = [(list(range(5 + i, 30 + i)), 12, i % 2 == 0, 3 if i == 4 else None)
                for i in range(8)]
    run_workload(llm, requests)
    assert sched.num_preemptions > before[0]
    if sched.swap_space is not None:
        assert sched.num_swapped_out > before[1]


def run_workload(llm, requests):
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
        swap = engine.scheduler.swap_space
        if swap is not None:
            parked = sum(len(r.swap_block_ids) for r in engine.requests.values())
            assert swap.num_free_blocks + parked == swap.num_blocks
        if not engine.has_unfinished_requests():
            break
    assert not engine.has_unfinished_requests()
    assert bm.num_free_blocks == NUM_BLOCKS
    assert all(b.ref_count == 0 for b in bm.blocks)
    swap = engine.scheduler.swap_space
    if swap is not None:
        assert swap.num_free_blocks == swap.num_blocks == 10


def test_full_blocks_are_published_once_each_and_again_after_a_free():
    """cache_full_blocks offers a block to the prefix cache when it fills (skipping the ones
    offered before), and a request whose blocks were freed (preempted) starts over."""
    from pd_runtime.engine.kv_cache.block_manager import BlockManager
    from pd_runtime.engine.sequence import Request

    bm = BlockManager(num_blocks=16, block_size=4, model_identity="m")
    req = Request("r", list(range(100, 110)), SamplingParams(max_tokens=8))
    assert bm.allocate(req, 10)
    for computed, published in [(3, 0), (4, 1), (7, 1), (10, 2)]:
        req.num_computed_tokens = computed
        bm.cache_full_blocks(req)
        assert req.num_published_blocks == published
        assert [bm.blocks[b].block_hash is not None for b in req.block_ids] == \
            [i < published for i in range(len(req.block_ids))]
    other = Request("o", list(range(100, 110)), SamplingParams(max_tokens=8))
    assert bm.match_prefix(other) == req.block_ids[:2]  # both full blocks are found
    bm.free(req)
    assert req.num_published_blocks == 0
    req.num_computed_tokens = 0
    assert bm.allocate(req, 2, bm.match_prefix(req)) and req.num_computed_tokens == 8
    req.num_computed_tokens = 10
    bm.cache_full_blocks(req)
    assert req.num_published_blocks == 2
