"""KV tiers below the device pool (pd_runtime/engine/kv_cache/tiers.py): prefix blocks the pool
evicts move to host memory and disk and are loaded back on a later hit. Greedy outputs are the
same with tiers off, host only, and host + disk (float32, a device pool small enough that every
round evicts); a corrupt or truncated disk file is a miss, recomputed and counted; sizes the
machine cannot give are refused naming the field."""

from __future__ import annotations

import socket

import pytest
from pydantic import ValidationError

from pd_runtime import LLM, SamplingParams
from pd_runtime.config import EngineConfig
from pd_runtime.engine.kv_cache.tiers import GIB
from pd_runtime.router.metrics import RouterMetrics

GREEDY = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
# Six documents of four full blocks (16 tokens each) and a question tail: each request takes
# five blocks and a sixth for its output, so a 16-block pool holds two requests' prefixes.
DOCS = [[5 + (d * 37 + 11 * i) % 250 for i in range(64)] for d in range(6)]
PROMPTS = [doc + [300 + d, 301, 302] for d, doc in enumerate(DOCS)]
POOL_BLOCKS = 16


def _block_bytes(llm: LLM) -> int:
    cache = llm.engine.runner.kv_cache
    return cache[:, :, 0].numel() * cache.element_size()


def _rounds(llm: LLM, rounds: int = 2) -> list[list]:
    """Each prompt alone, in order, `rounds` times: (tokens, cached tokens) per request."""
    out = []
    for _ in range(rounds):
        out.append([(o.token_ids, o.num_cached_tokens)
                    for o in (llm.generate([p], GREEDY)[0] for p in PROMPTS)])
    return out


def _llm(llama_dir, host_blocks: int = 0, disk_blocks: int = 0, tmp_path=None) -> LLM:
    probe = LLM(llama_dir, dtype="float32", num_kv_blocks=POOL_BLOCKS, warmup_tokens=0)
    block = _block_bytes(probe)
    probe.engine.close()
    if not host_blocks:
        return probe
    return LLM(llama_dir, dtype="float32", num_kv_blocks=POOL_BLOCKS, warmup_tokens=0,
               kv_offloading_size=(host_blocks + 0.5) * block / GIB,
               kv_offloading_disk_size=(disk_blocks + 0.5) * block / GIB if disk_blocks else None,
               kv_offloading_disk_dir=str(tmp_path) if disk_blocks else None)


def test_greedy_tokens_are_the_same_with_tiers_off_host_and_disk(llama_dir, tmp_path):
    off = _rounds(_llm(llama_dir))
    host_llm = _llm(llama_dir, host_blocks=64)
    host = _rounds(host_llm)
    disk_llm = _llm(llama_dir, host_blocks=6, disk_blocks=64, tmp_path=tmp_path)
    disk = _rounds(disk_llm)
    tokens = [[t for t, _ in r] for r in off]
    assert [[t for t, _ in r] for r in host] == tokens
    assert [[t for t, _ in r] for r in disk] == tokens
    assert tokens[0] == tokens[1]
    # Without tiers the second round finds every document evicted; with them it is served from
    # below: all four full blocks of each document.
    assert [c for _, c in off[1]] == [0] * 6
    assert [c for _, c in host[1]] == [64] * 6
    assert [c for _, c in disk[1]] == [64] * 6
    h = host_llm.engine.kv_tiers.report()
    assert h["host"]["hit_blocks"] == 24 and h["host"]["corrupt"] == 0
    assert h["host"]["bytes_out"] == 24 * h["block_bytes"] and h["disk"]["stored_blocks"] == 0
    d = disk_llm.engine.kv_tiers.report()
    assert d["disk"]["hit_blocks"] > 0 and d["host"]["used_blocks"] <= 6
    # Read ahead on the read threads while the request waited, not on the engine thread.
    assert d["disk"]["read_ahead_blocks"] == d["disk"]["hit_blocks"] and d["disk"]["read_s"] > 0
    assert d["host"]["hit_blocks"] + d["disk"]["hit_blocks"] == 24
    assert len(list(disk_llm.engine.kv_tiers.disk_dir.glob("*.kv"))) == d["disk"]["used_blocks"]
    # Load reports carry it, and the router's /metrics exports it per worker and tier.
    load = disk_llm.engine.load_report()
    assert load["kv_tiers"]["disk"]["hit_blocks"] == d["disk"]["hit_blocks"]
    metrics = RouterMetrics()
    metrics.observe_worker("decode-0", True, load)
    text = metrics.text().decode()
    assert f'pd_worker_kv_tier{{kind="hit_blocks",tier="disk",worker="decode-0"}} ' \
           f'{float(d["disk"]["hit_blocks"])}' in text
    assert 'pd_worker_kv_tier_hit_rate{tier="host",worker="decode-0"}' in text
    disk_dir = disk_llm.engine.kv_tiers.disk_dir
    disk_llm.engine.close()
    assert not disk_dir.exists()
    # A killed engine's files are removed by the next one to start on that directory.
    orphan = tmp_path / f"worker.{socket.gethostname()}.999999999.0badf00d"
    elsewhere = tmp_path / "worker.another-machine.1.0badf00d"  # a shared volume: not ours
    elsewhere.mkdir()
    orphan.mkdir()
    (orphan / "0.kv").write_bytes(b"x")
    _llm(llama_dir, host_blocks=2, disk_blocks=4, tmp_path=tmp_path).engine.close()
    assert not orphan.exists() and elsewhere.exists()


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_a_damaged_disk_block_is_recomputed_and_counted(llama_dir, tmp_path, damage):
    llm = _llm(llama_dir, host_blocks=2, disk_blocks=64, tmp_path=tmp_path)
    first = _rounds(llm, 1)[0]
    tiers = llm.engine.kv_tiers
    files = sorted(tiers.disk_dir.glob("*.kv"))
    assert files
    for path in files:
        data = bytearray(path.read_bytes())
        if damage == "flip":
            data[-7] ^= 0x5A
        else:
            data = data[:len(data) // 2]
        path.write_bytes(bytes(data))
    again = _rounds(llm, 1)[0]
    assert [t for t, _ in again] == [t for t, _ in first]
    report = tiers.report()
    # The first document's blocks were all on disk, damaged: it was computed again (later
    # documents may hit blocks the second round wrote anew).
    assert first[0][1] == 0 and again[0][1] == 0
    assert report["disk"]["corrupt"] >= 1
    assert llm.engine.load_report()["kv_tiers"]["disk"]["corrupt"] == report["disk"]["corrupt"]
    llm.engine.close()


def test_reset_prefix_cache_empties_the_tiers(llama_dir, tmp_path):
    llm = _llm(llama_dir, host_blocks=8, disk_blocks=64, tmp_path=tmp_path)
    _rounds(llm, 1)
    tiers = llm.engine.kv_tiers
    assert sum(tiers.used_blocks().values()) > 0
    assert llm.reset_prefix_cache()
    assert tiers.used_blocks() == {"host": 0, "disk": 0}
    assert not list(tiers.disk_dir.glob("*.kv"))
    assert [c for _, c in _rounds(llm, 1)[0]] == [0] * 6
    llm.engine.close()


def test_settings_the_tiers_cannot_have_are_refused_by_name(llama_dir, tmp_path):
    with pytest.raises(ValidationError, match="kv_offloading_disk_size needs a host tier"):
        EngineConfig(model=llama_dir, kv_offloading_disk_size=1.0)
    with pytest.raises(ValidationError, match="enable_prefix_caching"):
        EngineConfig(model=llama_dir, kv_offloading_size=1.0, enable_prefix_caching=False)
    with pytest.raises(ValidationError, match="tensor_parallel_size must be 1"):
        EngineConfig(model=llama_dir, kv_offloading_size=1.0, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="engine.kv_offloading_size: 100000000.0 GiB"):
        LLM(llama_dir, dtype="float32", num_kv_blocks=POOL_BLOCKS, warmup_tokens=0,
            kv_offloading_size=1e8)
    with pytest.raises(ValueError, match="engine.kv_offloading_disk_size: 100000000.0 GiB"):
        LLM(llama_dir, dtype="float32", num_kv_blocks=POOL_BLOCKS, warmup_tokens=0,
            kv_offloading_size=0.001, kv_offloading_disk_size=1e8,
            kv_offloading_disk_dir=str(tmp_path))


def test_a_decode_reservation_waits_for_its_disk_reads_off_the_engine_thread(llama_dir,
                                                                             tmp_path):
    """A disaggregated request's reservation on a decode worker: while its cached prefix is
    read from disk it is not granted (asked again next tick, as when blocks are short); then
    it is, with the prefix as cached tokens."""
    import time

    llm = _llm(llama_dir, host_blocks=2, disk_blocks=64, tmp_path=tmp_path)
    _rounds(llm, 1)  # the first documents' blocks are on disk by now
    remote = llm.engine.remote
    assert remote.reserve("r-wait", PROMPTS[0], GREEDY) is None  # reads started
    deadline = time.monotonic() + 10
    reservation = None
    while reservation is None and time.monotonic() < deadline:
        time.sleep(0.01)
        reservation = remote.reserve("r-wait", PROMPTS[0], GREEDY)
    assert reservation is not None and reservation.num_cached_tokens == 64
    assert llm.engine.kv_tiers.report()["disk"]["read_ahead_blocks"] >= 4
    remote.fail("r-wait")
    llm.engine.close()
