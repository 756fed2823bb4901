"""Tensor-parallel workers served: a decode worker of two ranks on a local Ray (two actors in a
STRICT_PACK placement group of two bundles: the worker's, rank 0, and its second rank's, which
it started) streams the offline engine's tokens, greedy and seeded; one rank killed mid-stream ends the worker, Ray restarts
it whole (new ranks) and the stream continues there with the same tokens. Then the product
itself: `pd-runtime serve -tp 2 --in-process`, through the official openai client."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from pd_runtime import LLM, SamplingParams
from pd_runtime.config import EngineConfig, KVTransferConfig
from tests.chaos_support import processes
from tests.chaos_support.product import free_port, stop_serve, wait_ready

ray = pytest.importorskip("ray")

from tests.workers_ray_support.cluster import collect, params, prompts, text_of, tokens_of  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def sharded(llama_dir):
    """A decode worker of two ranks (d2) and one of one (d1), prefill workers likewise (p2,
    p1): every rank pair linked over gloo."""
    from pd_runtime.workers.client import PoolClient
    from pd_runtime.workers.pool import start_worker, wait_ready as workers_ready

    ray.init(address="local", num_cpus=8, include_dashboard=False, namespace="pd-test-tp",
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
    kv = KVTransferConfig(backend="torch_dist", transfer_timeout_s=10.0, lease_timeout_s=10.0)
    workers = {}
    for role, name, degree in (("decode", "d2", 2), ("decode", "d1", 1),
                               ("prefill", "p2", 2), ("prefill", "p1", 1)):
        engine = EngineConfig(model=llama_dir, dtype="float32", num_kv_blocks=128,
                              num_threads=1, tensor_parallel_size=degree, warmup_tokens=16)
        workers[name] = start_worker(role, name, engine, kv, num_cpus=1, max_restarts=3)
    workers_ready(list(workers.values()))
    yield workers, PoolClient([], [workers["d2"]], recovery_wait_s=120)
    ray.shutdown()


@pytest.fixture(scope="module")
def reference(llama_dir):
    llm = LLM(llama_dir, dtype="float32", num_kv_blocks=128)
    ps = prompts()
    return ps, {seeded: [o.token_ids for o in llm.generate(
        ps, [SamplingParams(**params(i, seeded)) for i in range(len(ps))])]
        for seeded in (False, True)}


def test_a_two_rank_worker_streams_the_offline_tokens(sharded, reference):
    workers, client = sharded
    worker = workers["d2"]
    ps, ref = reference
    load = ray.get(worker.handle.load.remote())
    assert len(load["rank_pids"]) == 1  # the second rank, beside the actor's own process
    title = Path(f"/proc/{load['rank_pids'][0]}/cmdline").read_bytes()
    assert b"ray::TensorParallelRank" in title, title  # a Ray actor of its own
    group = [g for g in ray.util.placement_group_table().values()
             if g["name"] == "pd-d2-ranks"]
    assert len(group) == 1 and group[0]["strategy"] == "STRICT_PACK" and \
        group[0]["state"] == "CREATED", group
    assert [b.get("CPU") for b in group[0]["bundles"].values()] == [1.0, 1.0], group
    for seeded in (False, True):
        for i in (0, 2):
            chunks = collect(client, f"tp-{seeded}-{i}", ps[i], params(i, seeded))
            assert tokens_of(chunks) == ref[seeded][i], (seeded, i)


def test_a_killed_rank_restarts_the_worker_whole_and_the_stream_goes_on(sharded, reference):
    import asyncio

    workers, client = sharded
    worker = workers["d2"]
    ps, ref = reference
    load = ray.get(worker.handle.load.remote())
    rank_pid, actor_pid = load["rank_pids"][0], load["pid"]

    async def run():
        chunks = []
        async for chunk in client.generate("tp-kill", ps[3], params(3, True)):
            chunks.append(chunk)
            if len(chunks) == 3:
                os.kill(rank_pid, signal.SIGKILL)
        return chunks

    chunks = asyncio.run(run())
    assert tokens_of(chunks) == ref[True][3]
    assert chunks[-1].migrations == 1
    after = ray.get(worker.handle.load.remote())
    assert after["pid"] != actor_pid and after["rank_pids"] and \
        after["rank_pids"][0] != rank_pid  # a new incarnation with new ranks
    _gone(rank_pid)


def test_build_pools_places_each_tensor_parallel_worker_in_a_group_of_its_ranks(
        sharded, llama_dir, reference):
    """From YAML-shaped config: a colocated pool of one worker at tensor_parallel_size 2 gets a
    STRICT_PACK placement group of two one-rank bundles, its second rank an actor there, and
    serves the single-rank tokens."""
    from pd_runtime.config import ClusterConfig
    from pd_runtime.workers.pool import build_pools

    cfg = ClusterConfig.model_validate({
        "model": llama_dir, "prefill": {"num_workers": 0}, "decode": {"num_workers": 0},
        "colocated": {"num_workers": 1, "resources": {"num_cpus": 1},
                      "engine": {"tensor_parallel_size": 2, "dtype": "float32",
                                 "num_kv_blocks": 128, "warmup_tokens": 16}}})
    client = build_pools(cfg, llama_dir)
    worker = client.decode[0]
    try:
        group = [g for g in ray.util.placement_group_table().values()
                 if g["name"] == f"pd-{worker.worker_id}-ranks"]
        assert len(group) == 1 and group[0]["strategy"] == "STRICT_PACK", group
        assert [b.get("CPU") for b in group[0]["bundles"].values()] == [1.0, 1.0], group
        load = ray.get(worker.handle.load.remote())
        assert load["tensor_parallel_size"] == 2 and len(load["rank_pids"]) == 1
        assert b"ray::TensorParallelRank" in \
            Path(f"/proc/{load['rank_pids'][0]}/cmdline").read_bytes()
        ps, ref = reference
        chunks = collect(client, "pools-tp", ps[0], params(0, False))
        assert tokens_of(chunks) == ref[False][0]
    finally:
        ray.kill(worker.handle)
    _gone(load["rank_pids"][0])  # the rank ends with its worker


def _rank_bytes(worker) -> list[dict]:
    return ray.get(worker.handle.load.remote())["kv_transfer"]["ranks"]


@pytest.mark.parametrize("prefill, decode", [("p2", "d1"), ("p1", "d2"), ("p2", "d2")])
def test_disaggregated_between_degrees_is_exact_and_each_rank_gets_its_heads(
        sharded, reference, prefill, decode):
    """Prefill at one degree, decode at another: the colocated single-rank tokens, and the
    bytes say each decode rank received its own KV head (the test model has two, one a rank
    at degree 2) and nothing else: equal shares, summing to what the prefill ranks sent."""
    from pd_runtime.workers.client import PoolClient

    workers, _ = sharded
    p, d = workers[prefill], workers[decode]
    client = PoolClient([p], [d], recovery_wait_s=30)
    ps, ref = reference
    for seeded in (False, True):
        for i in (1, 3):
            sent_before, got_before = _rank_bytes(p), _rank_bytes(d)
            chunks = collect(client, f"dis-{prefill}-{decode}-{seeded}-{i}", ps[i],
                             params(i, seeded), disaggregate=True)
            assert {c.path for c in chunks} == {"disaggregated"}
            assert tokens_of(chunks) == ref[seeded][i], (prefill, decode, seeded, i)
            sent = [a["bytes_sent"] - b["bytes_sent"] for a, b in zip(_wait_sent(p, sent_before),
                                                                     sent_before)]
            got = [a["bytes_received"] - b["bytes_received"]
                   for a, b in zip(_rank_bytes(d), got_before)]
            assert sum(sent) == sum(got) > 0, (sent, got)
            assert len(set(got)) == 1 and len(set(sent)) == 1, (sent, got)  # equal shares


@pytest.mark.parametrize("prefill, decode", [("p2", "d1"), ("p1", "d2")])
def test_through_the_router_disaggregated_across_degrees(sharded, llama_dir, prefill, decode):
    """The router over HTTP (the official openai client), every request disaggregated between
    workers of different degrees: the colocated single-rank engine's completions."""
    from pd_runtime.config import ClusterConfig
    from pd_runtime.router.core import PoolBackend
    from pd_runtime.workers.client import PoolClient
    from tests.router_support.serving import serving

    workers, _ = sharded
    cfg = ClusterConfig.model_validate({"model": llama_dir, "router": {
        "routing": {"mode": "always_disaggregated"}}})
    backend = PoolBackend(PoolClient([workers[prefill]], [workers[decode]],
                                     recovery_wait_s=30), cfg, llama_dir)
    backend.start()
    offline = LLM(llama_dir, dtype="float32", num_kv_blocks=128)
    try:
        with serving(backend, cfg.router) as (_, port):
            client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused",
                                   max_retries=0)
            model = client.models.list().data[0].id
            for i in range(3):
                prompt = [(13 * i + 7 * j) % 400 + 9 for j in range(30 + 17 * i)]
                want = offline.generate([prompt], SamplingParams(
                    max_tokens=10, temperature=0.0, ignore_eos=True))[0]
                got = client.completions.create(model=model, prompt=prompt,
                                                max_tokens=10, temperature=0,
                                                extra_body={"ignore_eos": True})
                assert got.choices[0].text == want.text, (prefill, decode, i)
            decisions = {}  # path -> requests routed there
            for line in httpx.get(f"http://127.0.0.1:{port}/metrics").text.splitlines():
                if line.startswith("pd_routing_decisions_total{"):
                    path = line.split('path="')[1].split('"')[0]
                    decisions[path] = decisions.get(path, 0) + float(line.split()[-1])
            assert decisions.get("disaggregated") == 3 and not decisions.get("colocated"), \
                decisions
    finally:
        backend.stop()


def test_a_prefix_cached_on_the_decode_side_is_not_shipped_across_degrees(sharded, llama_dir):
    """Two prompts sharing 64 tokens, prefilled by two ranks, decoded by one: the second finds
    the shared blocks in the decode worker's prefix cache, and only the rest is shipped
    (fewer bytes); both give the single-rank engine's tokens."""
    from pd_runtime.workers.client import PoolClient

    workers, _ = sharded
    p, d = workers["p2"], workers["d1"]
    client = PoolClient([p], [d], recovery_wait_s=30)
    shared = [(11 * i) % 450 + 20 for i in range(64)]
    prompts = [shared + [5, 6, 7, 8, 9], shared + [300, 301, 302, 303, 304, 305, 306]]
    greedy = dict(max_tokens=8, temperature=0.0, ignore_eos=True)
    want = [o.token_ids for o in LLM(llama_dir, dtype="float32", num_kv_blocks=128).generate(
        prompts, SamplingParams(**greedy))]
    shipped = []
    for i, prompt in enumerate(prompts):
        before = sum(r["bytes_received"] for r in _rank_bytes(d))
        chunks = collect(client, f"prefix-{i}", prompt, greedy, disaggregate=True)
        assert tokens_of(chunks) == want[i]
        shipped.append(sum(r["bytes_received"] for r in _rank_bytes(d)) - before)
    assert 0 < shipped[1] < shipped[0] / 2, shipped  # 4 of 5 blocks cached, 1 shipped


def _wait_sent(worker, before, timeout_s: float = 10.0) -> list[dict]:
    """The prefill ranks' byte counts once the send ended (counted as each chunk leaves)."""
    deadline = time.monotonic() + timeout_s
    while True:
        now = _rank_bytes(worker)
        if all(a["bytes_sent"] > b["bytes_sent"] for a, b in zip(now, before)) \
                or time.monotonic() > deadline:
            return now
        time.sleep(0.1)


def _gone(pid: int, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)
    raise AssertionError(f"process {pid} outlived its worker")


@pytest.mark.parametrize("family, overrides, ranks", [
    ("llama", {}, 4),                                    # 2 KV heads over 4 ranks: replicated
    ("mixtral", {"num_local_experts": 4}, 2), ("mistral", {"sliding_window": 24}, 2)])
def test_serve_with_tensor_parallel_flag_matches_offline(model_factory, tmp_path, family,
                                                         overrides, ranks):
    """The product as a vLLM user starts it: `-tp 2` (in one process the default deployment
    serves colocated), the openai client's completion equal to the offline engine's at t = 1,
    for a GQA model, a mixture of experts and a sliding window (prompt past it)."""
    llama_dir = model_factory(family, **overrides)
    port = free_port()
    exe = Path(sys.executable).with_name("pd-runtime")
    log = open(tmp_path / "serve.log", "wb")
    proc = subprocess.Popen([str(exe), "serve", llama_dir, "--in-process", "-tp", str(ranks),
                             "--dtype", "float32", "--port", str(port)],
                            cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_ready(proc, base, tmp_path / "serve.log")
        followers = [p for p in processes.tree(proc.pid, session=proc.pid)
                 if "pd_runtime.workers.tp_rank" in p.cmdline]
        assert len(followers) == ranks - 1, followers  # the decode worker's other ranks
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
        model = client.models.list().data[0].id
        prompt = [(5 * i) % 300 + 7 for i in range(40)]
        want = LLM(llama_dir, dtype="float32").generate(
            [prompt], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))[0]
        got = client.completions.create(model=model, prompt=prompt, max_tokens=10,
                                        temperature=0, extra_body={"ignore_eos": True})
        assert got.choices[0].text == want.text
    finally:
        assert stop_serve(proc) == 0
        log.close()
    time.sleep(1)
    left = [p for p in processes.tree(proc.pid, session=proc.pid) if processes.alive(p)]
    assert not left, f"left behind: {left}"
