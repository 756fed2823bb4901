"""Routing decisions, worker choice, the prefix index, tenants and live reload (no Ray)."""

from __future__ import annotations

import random
import time

import pytest

from pd_runtime.config import RoutingConfig, TenantConfig
from pd_runtime.engine.kv_cache.block_hash import block_hashes, root_hash
from pd_runtime.router.policy import WorkerState, decide
from pd_runtime.router.prefix_index import PrefixIndex
from pd_runtime.router.reload import RoutingReloader
from pd_runtime.router.tenants import AuthError, Tenants

LOAD = dict(num_running=0, num_waiting=0, queued_prefill_tokens=0, free_blocks=100,
            total_blocks=100, max_num_seqs=64)


def workers(role, n, **load):
    return [WorkerState(f"{role}{i}", role, load={**LOAD, **load}) for i in range(n)]


def run(prompt_len, cfg, decode=None, prefill=None, hits=None):
    return decide(prompt_len, decode if decode is not None else workers("d", 2),
                  prefill if prefill is not None else workers("p", 1), hits or {}, cfg,
                  random.Random(0))


def test_length_rule_and_modes():
    cfg = RoutingConfig(max_local_prefill_tokens=100)
    assert (run(50, cfg).path, run(50, cfg).reason) == ("colocated", "short_prompt")
    long = run(500, cfg)
    assert (long.path, long.reason, long.prefill_worker) == ("disaggregated", "long_prompt", "p0")
    # A prefix hit on the chosen decode worker makes the uncached part short: stay local.
    cached = run(500, cfg, hits={"d0": 480, "d1": 480})
    assert (cached.path, cached.reason) == ("colocated", "prefix_cached")
    assert run(50, RoutingConfig(mode="always_disaggregated")).path == "disaggregated"
    assert run(5000, RoutingConfig(mode="always_colocated")).path == "colocated"
    assert run(5000, cfg, prefill=[]).reason == "no_prefill_worker"


def test_saturated_prefill_pool_keeps_long_prompts_local():
    cfg = RoutingConfig(max_local_prefill_tokens=100, max_prefill_queue_tokens=1000)
    busy = workers("p", 1, queued_prefill_tokens=1200)
    assert run(500, cfg, prefill=busy).reason == "prefill_saturated"


def test_worker_choice_by_cost_and_health():
    cfg = RoutingConfig()
    d = workers("d", 3)
    d[0].load.update(num_running=60)            # busy
    d[1].load.update(free_blocks=5)             # nearly full
    assert run(10, cfg, decode=d).decode_worker == "d2"
    d[2].healthy = False
    assert run(10, cfg, decode=d).decode_worker in ("d0", "d1")
    for w in d:
        w.healthy = False
    decision = run(10, cfg, decode=d)
    assert decision.decode_worker is None and decision.reason == "no_decode_worker"
    # Prefix overlap pulls a request to the worker that has its prefix.
    even = workers("d", 2)
    assert run(400, cfg, decode=even, hits={"d1": 384}).decode_worker == "d1"


def test_ties_are_broken_randomly():
    cfg = RoutingConfig()
    picks = {decide(10, workers("d", 4), [], {}, cfg, random.Random(s)).decode_worker
             for s in range(40)}
    assert len(picks) > 1


def test_prefix_index_matches_engine_hashes_and_salts():
    index = PrefixIndex("model-x", 16)
    prompt = list(range(100))
    assert index.hashes(prompt, None) == block_hashes(prompt, 16, root_hash("model-x"))
    index.record("d0", index.hashes(prompt, None))
    assert index.expected_hit_tokens("d0", index.hashes(prompt, None), len(prompt)) == 96
    assert index.expected_hit_tokens("d0", index.hashes(prompt, "tenant-b"), len(prompt)) == 0
    other = prompt[:40] + [999] * 60
    assert index.expected_hit_tokens("d0", index.hashes(other, None), len(other)) == 32
    index.set_capacity("d0", 2)
    index.record("d0", index.hashes([7] * 64, None))
    assert index.expected_hit_tokens("d0", index.hashes(prompt, None), len(prompt)) == 0
    index.forget("d0")
    assert index.expected_hit_tokens("d0", index.hashes([7] * 64, None), 64) == 0


def test_tenants_keys_salts_and_rate_limits():
    tenants = Tenants([TenantConfig(tenant_id="a", api_key="ka", requests_per_minute=2),
                       TenantConfig(tenant_id="b", api_key="kb", share_prefix_cache=True,
                                    tokens_per_minute=100)])
    with pytest.raises(AuthError):
        tenants.authenticate(None)
    with pytest.raises(AuthError):
        tenants.authenticate("nope")
    a, b = tenants.authenticate("ka"), tenants.authenticate("kb")
    assert Tenants.cache_salt(a) == "a" and Tenants.cache_salt(b) is None
    # A request's cache_salt divides a tenant's cache, never joins two: every pair differs,
    # and no tenant id spells a salted request's (tenant "s" beside request salts "s").
    c = TenantConfig(tenant_id="s", api_key="kc")
    salts = [Tenants.cache_salt(t, s) for t in (a, b, c) for s in (None, "s", "a")]
    salts = [s for s in salts if s is not None]
    assert len(salts) == len(set(salts)) == 8
    assert Tenants.cache_salt(b, "s") == Tenants.cache_salt(None, "s")  # b shares its cache
    assert tenants.admit(a, 10) == (None, 0.0)
    assert tenants.admit(a, 10) == (None, 0.0)
    limit, wait = tenants.admit(a, 10)
    assert limit == "requests_per_minute" and 0 < wait <= 30
    assert tenants.admit(b, 80)[0] is None
    limit, wait = tenants.admit(b, 80)
    assert limit == "tokens_per_minute" and wait > 0
    assert Tenants([]).authenticate(None) is None


def test_reload_applies_good_edits_and_keeps_settings_on_bad_ones(tmp_path):
    path = tmp_path / "cluster.yaml"
    path.write_text("router:\n  routing:\n    max_local_prefill_tokens: 512\n")
    results = []
    reloader = RoutingReloader(str(path), RoutingConfig(), interval_s=0.05,
                               on_result=results.append)
    path.write_text("router:\n  routing:\n    max_local_prefill_tokens: 64\n")
    assert reloader.check(force=True) and reloader.current.max_local_prefill_tokens == 64
    path.write_text("router:\n  routing:\n    max_local_prefill_tokens: -3\n")
    assert not reloader.check(force=True)
    assert reloader.current.max_local_prefill_tokens == 64
    assert "router.routing.max_local_prefill_tokens" in reloader.last_error
    assert ":3" in reloader.last_error
    assert results == ["applied", "rejected"]
    # The background thread notices a changed file by itself.
    reloader.start(install_sighup=False)
    try:
        time.sleep(0.1)
        path.write_text("router:\n  routing:\n    mode: always_colocated\n")
        deadline = time.monotonic() + 5
        while reloader.current.mode != "always_colocated" and time.monotonic() < deadline:
            time.sleep(0.05)
        assert reloader.current.mode == "always_colocated"
    finally:
        reloader.stop()
