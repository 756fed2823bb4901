"""KV events (pd_runtime/engine/kv_cache/kv_events.py): what a worker's prefix cache holds, in
every tier, as events the router's prefix index follows. The index built from them answers
exactly what the engine would serve, after evictions down the tiers and back, after a reset,
and from a snapshot when a reader starts, falls behind or meets a restarted engine."""

from __future__ import annotations

import random

from pd_runtime import LLM, SamplingParams
from pd_runtime.engine.kv_cache.kv_events import KVEventLog
from pd_runtime.engine.kv_cache.tiers import GIB
from pd_runtime.router.prefix_index import PrefixIndex

GREEDY = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)


def _follow(index: PrefixIndex, llm: LLM, worker: str = "w") -> None:
    """What a router's health check does: read from its cursor, a snapshot when told."""
    bm = llm.engine.block_manager
    reply = bm.events.since(*index.cursor(worker))
    if reply is None:
        reply = bm.events.snapshot(bm.held_blocks())
    index.apply(worker, reply)


def _agrees(index: PrefixIndex, llm: LLM, prompts: list, worker: str = "w") -> list[int]:
    bm = llm.engine.block_manager
    got = []
    for p in prompts:
        exact = bm.cached_prefix_tokens(p)
        assert index.expected_hit_tokens(worker, index.hashes(p, None), len(p)) == exact, p[:4]
        got.append(exact)
    return got


def test_the_index_follows_every_tier_exactly(llama_dir, tmp_path):
    probe = LLM(llama_dir, dtype="float32", num_kv_blocks=12, warmup_tokens=0)
    cache = probe.engine.runner.kv_cache
    block = cache[:, :, 0].numel() * cache.element_size()
    llm = LLM(llama_dir, dtype="float32", num_kv_blocks=12, warmup_tokens=0,
              kv_offloading_size=6.5 * block / GIB, kv_offloading_disk_size=10.5 * block / GIB,
              kv_offloading_disk_dir=str(tmp_path))
    rng = random.Random(0)
    prompts = [[rng.randrange(5, 500) for _ in range(50)] for _ in range(8)]
    index = PrefixIndex(llm.engine.model_config.identity, 16)
    _follow(index, llm)  # nothing yet: a snapshot of an empty cache
    assert index.exact("w") and _agrees(index, llm, prompts) == [0] * 8
    for round_ in range(3):
        for p in prompts:
            llm.generate([p], GREEDY)
            _follow(index, llm)  # events only, from here on
            _agrees(index, llm, prompts)
    held = llm.engine.block_manager.held_blocks()
    tiers = {t for ts in held.values() for t in ts}
    assert tiers == {"device", "host", "disk"}  # the prompts went down every tier
    h = index.hashes(prompts[0], None)[0]
    assert index.tiers_of("w", h) == held.get(h, set())
    # Emptied: one event says so.
    llm.reset_prefix_cache()
    _follow(index, llm)
    assert _agrees(index, llm, prompts) == [0] * 8
    llm.engine.close()
    probe.engine.close()


def test_a_reader_behind_the_log_or_of_another_engine_reads_a_snapshot(llama_dir):
    log = KVEventLog(limit=4)
    for h in range(3):
        log.stored(h, "device")
    assert log.since(None, 0) is None  # never read
    assert log.since(log.epoch, 0)["events"] == [("+", 0, "device"), ("+", 1, "device"),
                                                 ("+", 2, "device")]
    for h in range(3, 8):
        log.stored(h, "device")
    assert log.since(log.epoch, 1) is None  # events 2-3 are gone: too far behind
    assert log.since(log.epoch, 8) == {"epoch": log.epoch, "seq": 8, "events": []}
    assert log.since(KVEventLog().epoch, 8) is None  # a restarted engine: another epoch
    # A router that restarts reads a snapshot of a running engine and is exact at once.
    llm = LLM(llama_dir, dtype="float32", num_kv_blocks=32, warmup_tokens=0)
    prompts = [[7 + i % 300 for i in range(40 + k)] for k in range(3)]
    llm.generate(prompts, GREEDY)
    restarted = PrefixIndex(llm.engine.model_config.identity, 16)
    _follow(restarted, llm)
    assert _agrees(restarted, llm, prompts) == [32, 32, 32]
    # A prompt just routed counts as held until its blocks' events arrive.
    fresh = [9 + i % 200 for i in range(70)]
    restarted.record("w", restarted.hashes(fresh, None))
    assert restarted.expected_hit_tokens("w", restarted.hashes(fresh, None), 70) == 64
    # routing.kv_events turned off: back to the estimate, nothing of the events kept.
    restarted.stop_following()
    assert not restarted.exact("w")
    assert restarted.expected_hit_tokens("w", restarted.hashes(prompts[0], None), 40) == 0
    llm.engine.close()
