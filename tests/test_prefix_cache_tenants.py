"""Prefix cache isolation: salts separate tenants, the query has no side effects, counters are
per salt, and a forced hash collision never hands back another prompt's KV."""

from __future__ import annotations

import random

import pytest

from pd_runtime import LLM, SamplingParams
from pd_runtime.engine.kv_cache import block_hash

BLOCK = 16
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
GREEDY_LONG = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)


def prompt(length: int, seed: int, low: int = 5, high: int = 500) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(low, high) for _ in range(length)]


def cached_llm(llama_dir: str, **kwargs) -> LLM:
    return LLM(llama_dir, dtype="float32", num_kv_blocks=256, **kwargs)


def run(engine, request_id: str, tokens: list[int], salt=None, params=GREEDY):
    """(generated token ids, cached prompt tokens) of one request run to completion."""
    engine.add_request(request_id, tokens, params, cache_salt=salt)
    out_tokens, cached = [], None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == request_id:
                out_tokens += out.new_token_ids
                cached = out.num_cached_tokens
    return out_tokens, cached


def test_tenants_with_the_same_prompt_never_share_blocks(llama_dir):
    engine = cached_llm(llama_dir).engine
    bm = engine.block_manager
    p = prompt(70, seed=1)  # 4 full blocks + 6 tokens
    # A is still decoding (holding its blocks) while B and A's second request arrive.
    a = engine.add_request("a", p, GREEDY_LONG, cache_salt="tenant-a")
    engine.step()
    assert bm.cached_prefix_tokens(p, "tenant-a") == 4 * BLOCK
    assert bm.cached_prefix_tokens(p, "tenant-b") == 0
    assert bm.cached_prefix_tokens(p) == 0  # no salt is a tenant of its own
    b = engine.add_request("b", p, GREEDY, cache_salt="tenant-b")
    a2 = engine.add_request("a2", p, GREEDY, cache_salt="tenant-a")
    engine.step()
    assert b.num_cached_tokens == 0
    assert set(b.block_ids).isdisjoint(a.block_ids)
    assert set(b.block_ids).isdisjoint(a2.block_ids)
    # Same salt: A's second request shares A's full blocks, never its private last block.
    assert a2.num_cached_tokens == 4 * BLOCK
    assert a2.block_ids[:4] == a.block_ids[:4]
    assert a2.block_ids[4:] != a.block_ids[4:]
    while engine.has_unfinished_requests():
        engine.step()
    assert b.output_token_ids == a2.output_token_ids == a.output_token_ids[:GREEDY.max_tokens]
    assert bm.num_free_blocks == bm.num_blocks


def test_tenant_b_after_a_gets_nothing_and_identical_tokens(llama_dir):
    engine = cached_llm(llama_dir).engine
    p = prompt(100, seed=2)
    a_tokens, a_cached = run(engine, "a", p, "tenant-a")
    b_tokens, b_cached = run(engine, "b", p, "tenant-b")
    a_again, a_again_cached = run(engine, "a-again", p, "tenant-a")
    b_again, b_again_cached = run(engine, "b-again", p, "tenant-b")
    assert (a_cached, b_cached) == (0, 0)
    assert a_again_cached == b_again_cached == 96  # 6 full blocks; 99 // 16 leaves one to compute
    assert a_tokens == b_tokens == a_again == b_again
    reference = LLM(llama_dir, dtype="float32", num_kv_blocks=256, enable_prefix_caching=False)
    assert reference.generate([p], GREEDY)[0].token_ids == a_tokens


def test_cached_prefix_tokens_has_no_side_effects(llama_dir):
    engine = cached_llm(llama_dir).engine
    bm = engine.block_manager
    seen, unseen = prompt(80, seed=3), prompt(80, seed=4)
    run(engine, "a", seen, "tenant-a")
    run(engine, "b", unseen, "tenant-b")

    def state():
        return (bm.stats.queried_tokens, bm.stats.hit_tokens, bm.stats.evictions,
                {k: list(v) for k, v in bm.stats.by_salt.items()}, bm.num_free_blocks,
                list(bm._free), dict(bm._cached),
                [(b.ref_count, b.block_hash, b.token_ids) for b in bm.blocks])

    before = state()
    queries = [(seen, "tenant-a"), (seen, "tenant-b"), (seen, None), (unseen, "tenant-b"),
               (unseen, "tenant-c"), (seen[:40], "tenant-a"), (seen + [7] * 30, "tenant-a")]
    answers = [bm.cached_prefix_tokens(t, s) for t, s in queries]
    assert answers == [64, 0, 0, 64, 0, 32, 80]
    assert state() == before  # counters, free list and its LRU order, cache index, blocks


def test_per_salt_counters(llama_dir):
    engine = cached_llm(llama_dir).engine
    stats = engine.block_manager.stats
    p, q = prompt(70, seed=5), prompt(33, seed=6)
    run(engine, "a1", p, "tenant-a")
    run(engine, "a2", p, "tenant-a")
    run(engine, "b1", p, "tenant-b")
    run(engine, "b2", q, "tenant-b")
    run(engine, "n1", q)
    run(engine, "n2", q)
    assert dict(stats.by_salt) == {"tenant-a": [140, 64], "tenant-b": [103, 0], "": [66, 32]}
    assert (stats.queried_tokens, stats.hit_tokens) == (309, 96)


@pytest.mark.parametrize("shared_blocks", [0, 1])
def test_forced_hash_collision_never_returns_wrong_kv(llama_dir, monkeypatch, shared_blocks):
    # Every block of every prompt gets the same hash; only the token comparison stands between
    # a lookup and another prompt's KV. block_hashes looks hash_block up in its module globals.
    monkeypatch.setattr(block_hash, "hash_block", lambda parent, token_ids: 0xC0111DE)
    first = prompt(80, seed=7, low=5, high=250)
    second = first[:shared_blocks * BLOCK] + prompt(80 - shared_blocks * BLOCK, seed=8,
                                                    low=250, high=500)
    engine = cached_llm(llama_dir).engine
    bm = engine.block_manager
    run(engine, "first", first)
    root = block_hash.root_hash(bm.model_identity)
    assert set(block_hash.block_hashes(second, BLOCK, root)) == {0xC0111DE}  # collision is real
    assert bm.cached_prefix_tokens(second) == shared_blocks * BLOCK
    tokens, cached = run(engine, "second", second)
    assert cached == shared_blocks * BLOCK
    reference = LLM(llama_dir, dtype="float32", num_kv_blocks=256, enable_prefix_caching=False)
    assert tokens == reference.generate([second], GREEDY)[0].token_ids
    assert bm.num_free_blocks == bm.num_blocks
