"""The tokens of a request do not depend on its company: batch, chunking, preemption, cache;
float32, in the batch-invariant mode (the default) and on the regular paths. bf16 with long
prompts: tests/test_batch_invariance.py."""

from __future__ import annotations

import random

import pytest

from pd_runtime import LLM, SamplingParams


def mixed_prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, 500) for _ in range(rng.choice([1, 3, 7, 16, 17, 33, 50, 90]))]
            for _ in range(n)]


GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def seeded(i: int) -> SamplingParams:
    return SamplingParams(max_tokens=24, temperature=0.9, top_p=0.9, top_k=50, seed=1000 + i,
                          ignore_eos=True)


def run_alone(llm: LLM, prompts, params):
    return [llm.generate([p], [params[i]])[0].token_ids for i, p in enumerate(prompts)]


@pytest.fixture(scope="module")
def references(llama_dir):
    """Each prompt alone, per batch_invariant mode (computed when first asked for)."""
    cache = {}

    def get(batch_invariant: bool):
        if batch_invariant not in cache:
            prompts = mixed_prompts(16)
            llm = LLM(llama_dir, dtype="float32", num_kv_blocks=512,
                      batch_invariant=batch_invariant)
            greedy = run_alone(llm, prompts, [GREEDY] * 16)
            sampled = run_alone(llm, prompts, [seeded(i) for i in range(16)])
            assert llm.engine.block_manager.num_free_blocks == 512
            cache[batch_invariant] = prompts, greedy, sampled
        return cache[batch_invariant]

    return get


ENGINE_SETUPS = {
    "batched": dict(num_kv_blocks=512),
    "chunked-prefill-5": dict(num_kv_blocks=512, max_num_batched_tokens=5),
    "chunked-prefill-16-no-prefix-cache": dict(num_kv_blocks=512, max_num_batched_tokens=16,
                                               enable_prefix_caching=False),
    "block-pressure": dict(num_kv_blocks=14, max_num_batched_tokens=64),
    "block-pressure-swap": dict(num_kv_blocks=14, max_num_batched_tokens=64,
                                preemption_mode="swap", swap_space_bytes=1 << 22),
    # Room for only a few swapped blocks: some victims swap, the rest fall back to recompute.
    "block-pressure-swap-full": dict(num_kv_blocks=14, max_num_batched_tokens=64,
                                     preemption_mode="swap", swap_space_bytes=8192 * 5),
    "block-size-4": dict(num_kv_blocks=400, block_size=4, max_num_batched_tokens=32),
    "max-num-seqs-3": dict(num_kv_blocks=512, max_num_seqs=3),
    # The regular attention paths (decode side buffer, batched causal prefill, chunk over a
    # cached prefix): float32 keeps them invariant on these short prompts, bf16 does not.
    "regular-paths-batched": dict(num_kv_blocks=512, batch_invariant=False),
    "regular-paths-chunked-prefill-5": dict(num_kv_blocks=512, max_num_batched_tokens=5,
                                            batch_invariant=False),
    "regular-paths-block-pressure": dict(num_kv_blocks=14, max_num_batched_tokens=64,
                                         batch_invariant=False),
}


@pytest.mark.parametrize("setup", sorted(ENGINE_SETUPS))
def test_tokens_identical_in_batch(setup, llama_dir, references):
    setup_args = ENGINE_SETUPS[setup]
    prompts, greedy, sampled = references(setup_args.get("batch_invariant", True))
    llm = LLM(llama_dir, dtype="float32", **setup_args)
    start_free = llm.engine.block_manager.num_free_blocks
    outs = llm.generate(prompts, [GREEDY] * len(prompts))
    assert [o.token_ids for o in outs] == greedy
    outs = llm.generate(prompts, [seeded(i) for i in range(len(prompts))])
    assert [o.token_ids for o in outs] == sampled
    sched = llm.engine.scheduler
    if setup.startswith("block-pressure"):
        assert sched.num_preemptions > 0, "setup must actually preempt"
    if setup.startswith("block-pressure-swap"):
        assert sched.num_swapped_out > 0, "setup must actually swap"
        assert sched.swap_space.num_free_blocks == sched.swap_space.num_blocks
    if setup == "block-pressure-swap-full":
        assert sched.num_preemptions > sched.num_swapped_out, "some victims must recompute"
    assert llm.engine.block_manager.num_free_blocks == start_free


@pytest.mark.parametrize("batch_invariant", [True, False])
def test_prefix_cache_hits_and_keeps_tokens(llama_dir, batch_invariant):
    system = list(range(10, 74))  # 64 shared tokens = 4 full blocks
    prompts = [system + [100 + i, 200 + i, 300 + i] for i in range(6)]
    cold = LLM(llama_dir, dtype="float32", num_kv_blocks=256, enable_prefix_caching=False,
               batch_invariant=batch_invariant)
    expected = [o.token_ids for o in cold.generate(prompts, GREEDY)]
    warm = LLM(llama_dir, dtype="float32", num_kv_blocks=256, batch_invariant=batch_invariant)
    first = warm.generate(prompts[:1], GREEDY)
    assert first[0].num_cached_tokens == 0
    outs = warm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == expected
    assert all(o.num_cached_tokens == 64 for o in outs)
    bm = warm.engine.block_manager
    assert bm.cached_prefix_tokens(prompts[0]) == 64
    sampled = [seeded(i) for i in range(len(prompts))]
    cold_sampled = [o.token_ids for o in cold.generate(prompts, sampled)]
    warm_out = warm.generate(prompts, [seeded(i) for i in range(len(prompts))])
    assert [o.token_ids for o in warm_out] == cold_sampled
    assert all(o.num_cached_tokens == 64 for o in warm_out)
    assert bm.cached_prefix_tokens(prompts[0], cache_salt="tenant-b") == 0
    assert bm.num_free_blocks == 256


def test_abort_frees_blocks_at_once(llama_dir):
    llm = LLM(llama_dir, dtype="float32", num_kv_blocks=64)
    engine = llm.engine
    start = engine.block_manager.num_free_blocks
    for i, p in enumerate(mixed_prompts(6, seed=3)):
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=50, ignore_eos=True))
    for _ in range(3):
        engine.step()
    assert engine.block_manager.num_free_blocks < start
    for i in range(6):
        assert engine.abort(f"r{i}")
        assert not engine.abort(f"r{i}")
    assert engine.block_manager.num_free_blocks == start
    assert not engine.has_unfinished_requests()
