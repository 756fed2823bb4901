"""The autoscaler on real Ray pools, in compressed time (issue 48): a load step low -> high ->
none, short prompts then long. The controller's rounds are driven by the test (Autoscaler.step)
instead of its interval; the traffic it plans for is the router's own log. Every request is
checked token for token against the offline engine; no request fails across the scale events;
the drained worker's actor is gone and every remaining worker's KV blocks are free again."""

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
            "enabled": True, "window_s": 5.0, "cooldown_s": 0.0,
            # Targets no split meets (the decision's judgement is tests/test_autoscale_decide.py's):
            # under load the controller asks for the most workers the bounds allow (at_limit),
            # with no traffic for the fewest; this test is about acting on that.
            "ttft_s": 0.001, "tpot_s": 0.0001,
            "prefill": {"min_workers": 0, "max_workers": 1},
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
    grown = scaler.step()
    server.join()
    assert grown.reason == "at_limit", grown.describe()
    assert scaler.current() == {"prefill": 1, "decode": 2}, scaler.status()
    started = [e for e in scaler.pools.events if e["kind"] == "start"]
    assert started and all(e["seconds"] > 0 for e in started)
    for chunks, prompt in zip(answers, long):
        assert _tokens(chunks) == expected[tuple(prompt)]

    # The new workers serve: another burst spreads over them, exact again.
    for chunks, prompt in zip(_serve(backend, long[:6], "more"), long[:6]):
        assert _tokens(chunks) == expected[tuple(prompt)]
    busy = {w.worker_id for w in client.prefill + client.decode
            if (w.load.get("step_costs") or {}).get("steps")}
    assert len(busy) > 1, busy

    # None: once the window has passed with no request, back to the minimum, each drained
    # worker finishing what it was given first (a stream started just before the round).
    added = [w.handle for w in client.prefill + client.decode if w.worker_id not in ("decode-0",)]
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
    for handle in added:
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(handle.load.remote(), timeout=30)
    remaining = client.decode[0]
    deadline = time.monotonic() + 20
    while ray.get(remaining.handle.free_blocks.remote()) != baseline \
            and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ray.get(remaining.handle.free_blocks.remote()) == baseline
    load = ray.get(remaining.handle.load.remote())
    assert not any(load["records"].values()), load["records"]
    text = backend.metrics_text().decode()
    assert 'pd_autoscale_workers{kind="actual",role="decode"} 1.0' in text
    assert "pd_autoscale_decisions_total" in text
    assert backend.active_config()["autoscale"]["events"]
