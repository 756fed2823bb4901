"""The Ray runtime's two paths on a local Ray: colocated and disaggregated give the same tokens,
thousands of transfers leave no per-request state, a draining worker gets nothing new, and
`pd-runtime serve` runs both paths from YAML. Faults: test_workers_ray.py."""

from __future__ import annotations

import asyncio
import random

import pytest

ray = pytest.importorskip("ray")

# pytest finds the fixtures `cluster` and `reference` by name in this module.
from tests.workers_ray_support.cluster import (NUM_BLOCKS, cluster, collect,  # noqa: E402,F401
                                               params, reference, text_of, tokens_of,
                                               wait_free)

pytestmark = pytest.mark.timeout(240)


@pytest.mark.parametrize("seeded", [False, True])
def test_colocated_and_disaggregated_tokens_identical(cluster, reference, seeded):
    ps, ref = reference
    start = {w: NUM_BLOCKS for w in ("p0", "d0", "d1")}
    for i, prompt in enumerate(ps):
        colo = collect(cluster, f"c{i}-{seeded}", prompt, params(i, seeded),
                       decode_worker="d0")
        dis = collect(cluster, f"d{i}-{seeded}", prompt, params(i, seeded), disaggregate=True,
                      decode_worker="d1")
        assert tokens_of(colo) == ref[seeded][i]
        assert tokens_of(dis) == ref[seeded][i]
        assert text_of(colo) == text_of(dis) == ref["text"][seeded][i]
        assert {c.path for c in colo} == {"colocated"}
        assert {c.path for c in dis} == {"disaggregated"}
        assert dis[-1].kv_transfer_s > 0 and dis[-1].kv_arrived is True
    wait_free(cluster, start)


@pytest.mark.parametrize("seeded", [False, True])
def test_a_decode_worker_fetches_a_prefix_its_peer_holds(cluster, reference, seeded):
    """A fetch from a peer: d1 misses a prompt d0 computed; with d0 named as the request's
    prefill worker, d0 computes only what its prefix cache lacks (the last block's tokens) and
    ships the KV to d1 over the same transfer as a prefill worker's. Same tokens and text."""
    ps, ref = reference
    i = 2  # the 70-token prompts: four full blocks and a tail
    prompt = [5 + (7 * t + 3) % 495 for t in ps[i]]  # one no earlier test left in a cache
    first = collect(cluster, f"peer-a-{seeded}", prompt, params(i, seeded), decode_worker="d0")
    before = {w.worker_id: ray.get(w.handle.load.remote()) for w in cluster.decode}
    fetched = collect(cluster, f"peer-b-{seeded}", prompt, params(i, seeded),
                      disaggregate=True, decode_worker="d1", prefill_worker="d0")
    after = {w.worker_id: ray.get(w.handle.load.remote()) for w in cluster.decode}
    assert tokens_of(fetched) == tokens_of(first)
    assert text_of(fetched) == text_of(first)
    assert {c.path for c in fetched} == {"disaggregated"}
    assert fetched[-1].kv_arrived is True and fetched[-1].kv_transfer_s > 0
    # d0 served the prompt's full blocks from its cache: only the tail was computed there.
    blocks = (len(prompt) - 1) // 16 * 16
    assert after["d0"]["prefix_hit_tokens"] - before["d0"]["prefix_hit_tokens"] == blocks
    assert after["d1"]["kv_transfer"]["bytes_received"] > \
        before["d1"]["kv_transfer"]["bytes_received"]
    # Another tenant's salt: d0's blocks are not its prefix; d0 computes the whole prompt.
    salted = collect(cluster, f"peer-c-{seeded}", prompt, params(i, seeded), disaggregate=True,
                     decode_worker="d1", prefill_worker="d0",
                     cache_salt=f"another-tenant-{seeded}")
    last = {w.worker_id: ray.get(w.handle.load.remote()) for w in cluster.decode}
    assert tokens_of(salted) == tokens_of(first)
    assert last["d0"]["prefix_hit_tokens"] == after["d0"]["prefix_hit_tokens"]
    wait_free(cluster, {w: NUM_BLOCKS for w in ("p0", "d0", "d1")})


def test_the_routers_index_follows_the_workers_and_resyncs_after_a_restart(cluster, llama_dir):
    """The router's prefix index from the workers' KV events: exact per worker, the same at
    once in a router that starts after the requests (a snapshot), and emptied with a worker's
    cache."""
    from pd_runtime.config import ClusterConfig
    from pd_runtime.router.core import PoolBackend

    d0 = next(w for w in cluster.decode if w.worker_id == "d0").handle
    prompt = [5 + (11 * i + 1) % 490 for i in range(70)]
    backend = PoolBackend(cluster, ClusterConfig(), llama_dir)
    collect(cluster, "events-a", prompt, params(0, False), decode_worker="d0")
    asyncio.run(backend.refresh())
    hashes = backend.index.hashes(prompt, None)
    held = ray.get(d0.cached_prefix_tokens.remote(prompt, None))
    assert held == 64 and backend.index.exact("d0") and backend.index.exact("d1")
    assert backend.index.expected_hit_tokens("d0", hashes, len(prompt)) == held
    assert backend.index.expected_hit_tokens("d1", hashes, len(prompt)) == 0
    restarted = PoolBackend(cluster, ClusterConfig(), llama_dir)
    asyncio.run(restarted.refresh())
    assert restarted.index.expected_hit_tokens("d0", hashes, len(prompt)) == held
    ray.get(d0.reset_prefix_cache.remote())
    for b in (backend, restarted):
        asyncio.run(b.refresh())
        assert b.index.expected_hit_tokens("d0", hashes, len(prompt)) == 0


def test_many_transfers_leave_no_per_request_state(cluster):
    """Two thousand disaggregated requests through one prefill/decode pair, some abandoned
    after their first token: afterwards every worker's per-request records, the transfer
    agents' tables among them, are empty and every block is back (memory stays flat)."""
    rng = random.Random(7)
    total, width = 2016, 24

    async def one(i):
        prompt = [rng.randrange(5, 500) for _ in range(rng.choice([17, 33, 48]))]
        gen = cluster.generate(f"many-{i}", prompt, dict(max_tokens=3, temperature=0.0,
                                                          ignore_eos=True),
                               disaggregate=True, decode_worker="d0")
        chunks = []
        async for chunk in gen:
            chunks.append(chunk)
            if i % 7 == 0:  # the caller leaves after the first token
                break
        await gen.aclose()
        return chunks

    async def run():
        done = []
        for start in range(0, total, width):
            done += await asyncio.gather(*(one(i) for i in range(start, start + width)))
        return done

    p0 = cluster.prefill[0].handle
    sent_before = ray.get(p0.load.remote())["kv_transfer"]["transfers_done"]
    results = asyncio.run(run())
    finished = [c for c in results if c and c[-1].finished]
    assert len(finished) >= total - total // 7 - 1
    assert all(c[-1].error is None for c in finished)
    wait_free(cluster, {w: NUM_BLOCKS for w in ("p0", "d0", "d1")}, timeout_s=30.0)
    # The KV really moved for most of them (not every request fell back to a local prefill).
    sent = ray.get(p0.load.remote())["kv_transfer"]["transfers_done"] - sent_before
    assert sent >= len(finished) // 2, (sent, len(finished))
    for w in cluster.prefill + cluster.decode:
        agent_tables = {k: v for k, v in ray.get(w.handle.load.remote())["records"].items()
                        if k.startswith("agent_")}
        assert agent_tables and not any(agent_tables.values()), (w.worker_id, agent_tables)


def test_serve_from_yaml_runs_both_paths(llama_dir, tmp_path):
    """`pd-runtime serve --config FILE` in its own process: a local Ray, the pools from YAML,
    and the demo through both paths with the same text."""
    import subprocess
    import sys

    import yaml

    cfg = yaml.safe_load(open("cluster_configs/local.yaml"))
    cfg["model"] = llama_dir
    cfg["ray"]["num_cpus"] = 4
    for pool in ("prefill", "decode"):
        cfg[pool]["engine"].update(dtype="float32", num_kv_blocks=64, num_threads=1)
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(cfg))
    run = subprocess.run([sys.executable, "-m", "pd_runtime.cli", "--log-level", "WARNING",
                          "serve", "--config", str(path), "--demo", "--max-tokens", "8"],
                         capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = [ln for ln in run.stdout.splitlines() if ln.startswith("[")]
    assert sum("[colocated]" in ln for ln in lines) == 2
    assert sum("[disaggregated]" in ln for ln in lines) == 2
    texts = [ln for ln in run.stdout.splitlines() if ln.startswith("    ")]
    assert texts[:2] == texts[2:]  # same prompts, same greedy text on both paths


def test_serve_rejects_bad_config_naming_field(tmp_path):
    import subprocess
    import sys

    path = tmp_path / "bad.yaml"
    path.write_text("decode:\n  num_workers: 1\n  engine:\n    block_size: -4\n")
    run = subprocess.run([sys.executable, "-m", "pd_runtime.cli", "serve", "--config", str(path)],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 2
    assert "decode.engine.block_size" in run.stderr and ":4" in run.stderr


def test_draining_worker_gets_nothing_new(cluster, reference):
    ps, ref = reference
    d0 = next(w for w in cluster.decode if w.worker_id == "d0")
    ray.get(d0.handle.set_draining.remote(True))
    try:
        asyncio.run(cluster.refresh())
        assert d0.load["draining"] is True
        chunks = [collect(cluster, f"drain-{i}", ps[0], params(0, False)) for i in range(4)]
        assert {c[-1].worker_id for c in chunks} == {"d1"}
        assert all(tokens_of(c) == ref[False][0] for c in chunks)
    finally:
        ray.get(d0.handle.set_draining.remote(False))
        asyncio.run(cluster.refresh())

