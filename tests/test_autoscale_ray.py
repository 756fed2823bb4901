"""The autoscaler acting on real Ray pools, in compressed time (issue 48): a load step low ->
high -> none, short prompts then long. The test drives the controller: under the burst it asks
for the most workers the bounds allow (Autoscaler.act: what a scale-up decision does; the
decision's judgement is tests/test_autoscale_decide.py's), and once the window has passed with no
request it runs a round (Autoscaler.step, from the router's own traffic log), which drains back
to the minimum. Between them a re-split to long prompts only turns a decode worker into a
prefill worker in place (a re-role: drained, no restart). Every request is checked token for token against the offline engine; none fails
across the scale events; the drained workers' actors are gone, their metrics series too, and
the remaining worker's KV blocks are free again."""

from __future__ import annotations

import asyncio
import random
import threading
import time

import pytest
import ray

from pd_runtime import LLM, SamplingParams
from pd_runtime.config import ClusterConfig

pytestmark = pytest.mark.timeout(300)

NUM_BLOCKS = 160


def _prompts(n: int, lengths: tuple, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, 500) for _ in range(rng.choice(lengths))] for _ in range(n)]


def _params() -> SamplingParams:
    return SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def deployment(llama_dir):
    from pd_runtime.router.core import PoolBackend
    from pd_runtime.workers.elastic import Autoscaler
    from pd_runtime.workers.pool import build_pools

    ray.init(address="local", num_cpus=4, include_dashboard=False, namespace="pd-autoscale",
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
    engine = dict(dtype="float32", num_kv_blocks=NUM_BLOCKS, num_threads=1, warmup_tokens=64)
    cfg = ClusterConfig.model_validate({
        "model": llama_dir, "placement": {"enabled": False},
        "prefill": {"num_workers": 0, "engine": engine},
        "decode": {"num_workers": 1, "engine": engine},
        "recovery": {"health_check_interval_s": 0.2},
        "planner": {"autoscale": {
            "enabled": True, "window_s": 5.0, "cooldown_s": 0.0, "scale_down_delay_s": 0.0,
            "prefill": {"min_workers": 0, "max_workers": 2},
            "decode": {"min_workers": 1, "max_workers": 2}}}})
    client = build_pools(cfg, llama_dir)
    backend = PoolBackend(client, cfg, llama_dir)
    backend.start()
    scaler = Autoscaler(cfg, client, llama_dir, backend)
    backend.autoscale_status = scaler.status
    yield cfg, client, backend, scaler
    backend.stop()
    ray.shutdown()


def _serve(backend, prompts, rid: str, start_s: float = 0.0) -> list:
    """Each prompt through the router (routing, admission, the pools), spread over start_s."""
    async def one(i, prompt):
        await asyncio.sleep(start_s * i / max(1, len(prompts)))
        chunks = []
        async for chunk in backend.generate(f"{rid}-{i}", prompt, _params()):
            chunks.append(chunk)
        return chunks

    async def every():
        return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))

    return asyncio.run(every())


def _tokens(chunks) -> list[int]:
    assert chunks and chunks[-1].finished and chunks[-1].error is None, chunks[-1:]
    return [t for c in chunks for t in c.token_ids]


def test_a_load_step_grows_and_shrinks_the_pools_without_losing_a_request(deployment, llama_dir):
    cfg, client, backend, scaler = deployment
    reference = LLM(llama_dir, dtype="float32", num_kv_blocks=NUM_BLOCKS)
    short, long = _prompts(6, (20, 40), 1), _prompts(12, (300, 400), 2)
    expected = {tuple(p): o.token_ids for p, o in
                zip(short + long, reference.generate(short + long, [_params()] * 18))}

    baseline = ray.get(client.decode[0].handle.free_blocks.remote())
    # Low: a few short prompts on the one decode worker.
    for chunks, prompt in zip(_serve(backend, short, "low"), short):
        assert _tokens(chunks) == expected[tuple(prompt)]
    assert scaler.current() == {"prefill": 0, "decode": 1}

    # High: a burst of long prompts while the controller decides and starts workers.
    answers: list = []
    server = threading.Thread(target=lambda: answers.extend(_serve(backend, long, "high", 3.0)))
    server.start()
    time.sleep(1.0)
    scaler.act(scaler.current(), {"prefill": 1, "decode": 2})
    server.join()
    assert scaler.current() == {"prefill": 1, "decode": 2}, scaler.status()
    started = [e for e in scaler.pools.events if e["kind"] == "start"]
    assert started and all(e["seconds"] > 0 for e in started)
    for chunks, prompt in zip(answers, long):
        assert _tokens(chunks) == expected[tuple(prompt)]

    # The new workers serve: another burst spreads over them, exact again.
    for chunks, prompt in zip(_serve(backend, long[:6], "more"), long[:6]):
        assert _tokens(chunks) == expected[tuple(prompt)]
    # (asked of each worker now: the router's copy of a load report may be a check behind)
    busy = {w.worker_id for w in client.prefill + client.decode
            if (ray.get(w.handle.load.remote())["step_costs"] or {}).get("steps")}
    assert len(busy) > 1, busy

    # Long prompts only: a decode worker turns into a prefill worker (drained, then re-roled
    # in place: the same process and engine, no cold start), and serves as one.
    was = {w.worker_id: ray.get(w.handle.load.remote()) for w in client.decode}
    scaler.act(scaler.current(), {"prefill": 2, "decode": 1})
    assert scaler.current() == {"prefill": 2, "decode": 1}, scaler.status()
    turned = next(w for w in client.prefill if w.worker_id.startswith("decode-"))
    assert turned.role == "prefill"
    was = was[turned.worker_id]
    event = next(e for e in scaler.pools.events if e["kind"] == "re_role")
    assert event["worker_id"] == turned.worker_id and event["seconds"] > 0
    others = [w for w in client.prefill if w is not turned]
    for w in others:  # (routed nothing for this burst: the turned worker must prefill it)
        w.draining = True
    for chunks, prompt in zip(_serve(backend, long[6:], "turned"), long[6:]):
        assert _tokens(chunks) == expected[tuple(prompt)]
    for w in others:
        w.draining = False
    now = ray.get(turned.handle.load.remote())
    assert (now["role"], now["pid"], now["engine_id"]) == ("prefill", was["pid"],
                                                          was["engine_id"])
    assert now["num_steps"] > was["num_steps"], (now["num_steps"], was["num_steps"])

    # None: once the window has passed with no request, back to the minimum, each drained
    # worker finishing what it was given first (a stream started just before the round).
    before = {w.worker_id: w.handle for w in client.prefill + client.decode}
    late: list = []
    server = threading.Thread(target=lambda: late.extend(_serve(backend, short[:3], "late")))
    server.start()
    shrunk = scaler.step(now=time.monotonic() + cfg.planner.autoscale.window_s + 1.0)
    server.join()
    assert shrunk.reason in ("idle", "scale_down"), shrunk.describe()
    assert scaler.current() == {"prefill": 0, "decode": 1}
    for chunks, prompt in zip(late, short[:3]):
        assert _tokens(chunks) == expected[tuple(prompt)]
    assert any(e["kind"] == "drain" for e in scaler.pools.events)
    remaining = client.decode[0]
    drained = sorted(set(before) - {remaining.worker_id})
    assert drained == sorted(["prefill-0", turned.worker_id]), drained
    for worker_id in drained:
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(before[worker_id].load.remote(), timeout=30)
    deadline = time.monotonic() + 20
    while ray.get(remaining.handle.free_blocks.remote()) != baseline \
            and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ray.get(remaining.handle.free_blocks.remote()) == baseline
    load = ray.get(remaining.handle.load.remote())
    assert not any(load["records"].values()), load["records"]
    text = backend.metrics_text().decode()
    assert 'pd_autoscale_workers{kind="actual",role="decode"} 1.0' in text
    assert 'pd_autoscale_decisions_total{reason="%s"}' % shrunk.reason in text
    for gone in drained:  # their series ended with them
        assert f'pd_worker_running{{worker="{gone}"}}' not in text
    assert backend.active_config()["autoscale"]["events"]
