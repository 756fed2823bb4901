"""The whole product on a local Ray: pools from YAML, the router with its policy, the official
`openai` client over HTTP on 127.0.0.1. Both paths, live reload of the routing section, and a
client disconnect that frees every block.
"""

from __future__ import annotations

import asyncio

import re
import time

import httpx
import openai
import pytest
import yaml

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.timeout(300)

NUM_BLOCKS = 96
AUTH = {"Authorization": "Bearer key-acme"}


def write_config(path, model_dir, **routing):
    cfg = yaml.safe_load(open("cluster_configs/local.yaml"))
    cfg["model"] = model_dir
    for pool in ("prefill", "decode"):
        cfg[pool]["engine"].update(dtype="float32", num_kv_blocks=NUM_BLOCKS, num_threads=1)
    cfg["router"]["reload_interval_s"] = 0.1
    cfg["router"]["tenants"] = [
        {"tenant_id": "acme", "api_key": "key-acme"},
        {"tenant_id": "other", "api_key": "key-other"},
        {"tenant_id": "slow", "api_key": "key-slow", "requests_per_minute": 2},
    ]
    # The length rule, unless a test asks for another mode: its reasons are easy to assert.
    cfg["router"]["routing"].update({"mode": "auto", **routing})
    cfg["recovery"]["health_check_interval_s"] = 0.2
    path.write_text(yaml.safe_dump(cfg))


@pytest.fixture(scope="module")
def product(llama_dir, tmp_path_factory):
    from pd_runtime.config_loading import load_cluster_config
    from pd_runtime.workers.pool import build_pools
    from pd_runtime.entrypoints.openai.app import create_app
    from pd_runtime.router.core import PoolBackend
    from pd_runtime.entrypoints.openai.server import start_in_thread

    path = tmp_path_factory.mktemp("cfg") / "cluster.yaml"
    write_config(path, llama_dir, max_local_prefill_tokens=64)
    cfg = load_cluster_config(path)
    ray.init(address="local", num_cpus=4, include_dashboard=False, namespace="pd-e2e")
    client = build_pools(cfg, llama_dir)
    backend = PoolBackend(client, cfg, llama_dir, config_path=str(path))
    backend.start()
    server, port = start_in_thread(create_app(backend, cfg.router))
    yield dict(path=path, backend=backend, port=port, model_dir=llama_dir,
               client=openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1",
                                    api_key="key-acme", max_retries=0))
    server.stop()
    backend.stop()
    ray.shutdown()


def decisions(port) -> dict:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics").text
    out = {}
    for path, reason, value in re.findall(
            r'pd_routing_decisions_total\{path="(\w+)",reason="(\w+)"\} ([0-9.]+)', text):
        out[(path, reason)] = float(value)
    return out


def free_blocks(backend):
    c = backend.client
    return [ray.get(w.handle.free_blocks.remote()) for w in c.prefill + c.decode]


SHORT = "The decode worker"
LONG = " ".join(f"word{i}" for i in range(60))  # well over 64 tokens


def fresh_long(tag: str) -> str:
    """A long prompt no worker has cached (a cached prefix would keep it colocated)."""
    return " ".join(f"{tag}{i}" for i in range(60))


def complete(client, prompt, **kw):
    return client.completions.create(model=client.models.list().data[0].id, prompt=prompt,
                                     max_tokens=12, temperature=0, **kw)


def test_both_paths_same_greedy_text_and_metrics(product):
    client, port = product["client"], product["port"]
    before = decisions(port)
    short = complete(client, SHORT)
    long = complete(client, LONG)
    after = decisions(port)
    assert after.get(("colocated", "short_prompt"), 0) > before.get(("colocated",
                                                                     "short_prompt"), 0)
    assert after.get(("disaggregated", "long_prompt"), 0) > before.get(("disaggregated",
                                                                        "long_prompt"), 0)
    from pd_runtime import LLM, SamplingParams

    llm = LLM(product["model_dir"], dtype="float32", num_kv_blocks=NUM_BLOCKS)
    ref = llm.generate([SHORT, LONG], SamplingParams(max_tokens=12, temperature=0))
    assert short.choices[0].text == ref[0].text
    assert long.choices[0].text == ref[1].text
    # Streaming, chat, on the disaggregated path: the same text as non-streaming.
    stream = client.completions.create(model=short.model, prompt=LONG, max_tokens=12,
                                       temperature=0, stream=True,
                                       stream_options={"include_usage": True})
    pieces, usage = [], None
    for event in stream:
        if event.choices:
            pieces.append(event.choices[0].text)
        usage = event.usage or usage
    assert "".join(pieces) == ref[1].text and usage.completion_tokens == 12
    chat = client.chat.completions.create(model=short.model, max_tokens=8, temperature=0,
                                          messages=[{"role": "user", "content": LONG}])
    assert chat.choices[0].message.content is not None
    text = httpx.get(f"http://127.0.0.1:{port}/metrics").text
    assert 'pd_ttft_seconds_count{path="disaggregated"}' in text
    assert 'pd_ttft_seconds_count{path="colocated"}' in text


def test_structured_outputs_same_text_on_both_paths(product):
    """The prefill worker chooses the first token under the grammar, the decode worker goes on
    from it: the text of a disaggregated request is the offline engine's, as a colocated one's."""
    from pd_runtime import LLM, SamplingParams

    client, port = product["client"], product["port"]
    schema = {"type": "object", "required": ["id", "ok"], "additionalProperties": False,
              "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                             "ok": {"type": "boolean"}}}
    llm = LLM(product["model_dir"], dtype="float32", num_kv_blocks=NUM_BLOCKS)
    cases = [({"guided_regex": "[a-z]{3,8}"}, {"regex": "[a-z]{3,8}"}),
             ({"structured_outputs": {"json": schema, "disable_any_whitespace": True}},
              {"json": schema, "disable_any_whitespace": True})]
    for i, (extra, spec) in enumerate(cases):
        for prompt in (SHORT + f" {i}", fresh_long(f"so{i}x")):
            before = decisions(port)
            got = client.completions.create(model=client.models.list().data[0].id,
                                            prompt=prompt, max_tokens=40, temperature=1.0,
                                            seed=3, extra_body=extra)
            after = decisions(port)
            want = llm.generate([prompt], SamplingParams(max_tokens=40, temperature=1.0, seed=3,
                                                         structured_outputs=spec))[0]
            assert got.choices[0].text == want.text, (extra, prompt[:20])
            assert got.choices[0].finish_reason == want.finish_reason == "stop"
            if prompt != SHORT + f" {i}":
                assert after.get(("disaggregated", "long_prompt"), 0) == before.get(
                    ("disaggregated", "long_prompt"), 0) + 1


def set_routing(product, **routing):
    write_config(product["path"], product["model_dir"], **routing)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        active = httpx.get(f"http://127.0.0.1:{product['port']}/v1/router/config",
                           headers=AUTH).json()
        if all(active["routing"][k] == v for k, v in routing.items()):
            return active
        time.sleep(0.05)
    raise AssertionError(f"routing config not reloaded: {active}")


def test_hot_reload_moves_long_prompts_and_rejects_broken_edits(product):
    port = product["port"]
    set_routing(product, max_local_prefill_tokens=100_000)
    before = decisions(port)
    complete(product["client"], fresh_long("alpha"))
    mid = decisions(port)
    assert mid.get(("colocated", "short_prompt"), 0) == before.get(("colocated",
                                                                    "short_prompt"), 0) + 1
    set_routing(product, max_local_prefill_tokens=16)  # lowered in the file: no restart
    complete(product["client"], fresh_long("beta"))
    after = decisions(port)
    assert after.get(("disaggregated", "long_prompt"), 0) == mid.get(
        ("disaggregated", "long_prompt"), 0) + 1
    # A broken edit: logged and rejected, the previous settings stay in force.
    product["path"].write_text(product["path"].read_text().replace(
        "max_local_prefill_tokens: 16", "max_local_prefill_tokens: -5"))
    deadline = time.monotonic() + 10
    active = {}
    while time.monotonic() < deadline:
        active = httpx.get(f"http://127.0.0.1:{port}/v1/router/config", headers=AUTH).json()
        # (A check can land mid-write and see an empty file first: also rejected, then the
        # next check sees the whole edit.)
        if "max_local_prefill_tokens" in (active["last_reload_error"] or ""):
            break
        time.sleep(0.05)
    assert "max_local_prefill_tokens" in active["last_reload_error"]
    assert active["routing"]["max_local_prefill_tokens"] == 16
    set_routing(product, max_local_prefill_tokens=64)


def test_client_disconnect_frees_blocks_everywhere(product):
    backend, client = product["backend"], product["client"]
    start = [NUM_BLOCKS] * 2
    deadline = time.monotonic() + 20
    while free_blocks(backend) != start and time.monotonic() < deadline:
        time.sleep(0.1)
    assert free_blocks(backend) == start
    stream = client.completions.create(model=client.models.list().data[0].id, prompt=LONG,
                                       max_tokens=400, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    got = 0
    for event in stream:
        got += 1
        if got == 3:
            break
    stream.close()  # the client goes away mid-stream
    deadline = time.monotonic() + 20
    while free_blocks(backend) != start and time.monotonic() < deadline:
        time.sleep(0.1)
    assert free_blocks(backend) == start


def tenant_client(product, key):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{product['port']}/v1", api_key=key,
                         max_retries=0)


def test_api_keys_tenant_salts_and_rate_limits(product):
    with pytest.raises(openai.AuthenticationError):
        complete(tenant_client(product, "wrong-key"), SHORT)
    # The same long prompt: cached for the tenant that ran it, never for another tenant.
    prompt = fresh_long("tenantcase")
    acme, other = product["client"], tenant_client(product, "key-other")
    complete(acme, prompt)
    again = complete(acme, prompt)
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    theirs = complete(other, prompt)
    assert theirs.usage.prompt_tokens_details.cached_tokens == 0
    assert theirs.choices[0].text == again.choices[0].text
    slow = tenant_client(product, "key-slow")
    complete(slow, SHORT)
    complete(slow, SHORT)
    with pytest.raises(openai.RateLimitError) as err:
        complete(slow, SHORT)
    assert float(err.value.response.headers["retry-after"]) > 0
    text = httpx.get(f"http://127.0.0.1:{product['port']}/metrics").text
    assert 'pd_admission_refusals_total{reason="requests_per_minute",tenant="slow"}' in text


def test_slo_mode_routes_by_prediction_and_refuses_early(product):
    client, port = product["client"], product["port"]
    set_routing(product, mode="slo", slo={"ttft_s": 30.0, "tpot_s": 5.0})
    before = decisions(port)
    assert complete(client, SHORT).choices[0].text
    assert complete(client, fresh_long("gamma")).choices[0].text
    after = decisions(port)
    routed = sum(after.get((path, reason), 0) - before.get((path, reason), 0)
                 for path in ("colocated", "disaggregated") for reason in ("slo_local", "slo_remote"))
    assert routed == 2
    text = httpx.get(f"http://127.0.0.1:{port}/metrics").text
    rates = re.findall(r'pd_cost_model_prefill_tokens_per_second\{worker="([^"]+)"\} ([0-9.e+]+)', text)
    assert len(rates) == 2 and all(float(v) > 0 for _, v in rates)
    assert re.search(r'pd_worker_step_seconds\{worker="[^"]+"\} [0-9.e-]+', text)
    # The workers' own step histograms and token counters, as vLLM exports them.
    steps = dict(re.findall(r'pd_worker_step_duration_seconds_count\{worker="([^"]+)"\} ([0-9.e+]+)',
                            text))
    assert len(steps) == 2 and all(float(v) > 0 for v in steps.values())
    for kind in ("prefill", "decode"):
        counts = re.findall(rf'pd_worker_{kind}_tokens_total\{{worker="[^"]+"\}} ([0-9.e+]+)', text)
        assert len(counts) == 2 and sum(float(v) for v in counts) > 0
    # Targets no worker could meet even idle: served one at a time per worker (waiting would
    # not help, so a refusal would be for ever)...
    set_routing(product, mode="slo", slo={"ttft_s": 0.0005, "tpot_s": 5.0})
    assert complete(client, fresh_long("delta")).choices[0].text
    assert decisions(port).get(("colocated", "slo_best_effort"), 0) \
        + decisions(port).get(("disaggregated", "slo_best_effort"), 0) >= 1
    # ...and the others, while those are queued, refused at once: 429 with Retry-After.
    model = client.models.list().data[0].id

    async def burst():
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}/v1", headers=AUTH,
                                     timeout=60) as http:
            return await asyncio.gather(*(http.post("/completions", json={
                "model": model, "prompt": fresh_long(f"eps{i}"), "max_tokens": 4})
                for i in range(16)))

    started = time.monotonic()
    answers = asyncio.run(burst())
    refused = [r for r in answers if r.status_code == 429]
    assert refused and all(r.status_code in (200, 429) for r in answers)
    assert all(int(r.headers["Retry-After"]) >= 1 for r in refused)
    assert "latency targets for this request even idle" in refused[0].json()["error"]["message"]
    assert time.monotonic() - started < 30
    assert decisions(port).get(("none", "slo_ttft_unmet"), 0) >= len(refused)
    set_routing(product, max_local_prefill_tokens=64)
