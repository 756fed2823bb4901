"""The router's HTTP front door end to end on 127.0.0.1: the official `openai` client against
the router's PoolBackend over an in-process worker (LocalPool), error statuses and bodies,
disconnects. Body limits and what is accepted: tests/test_http_intake.py; the schema fuzzer:
tests/test_http_fuzz.py; vLLM's request extensions: tests/test_http_vllm_fields.py.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest

from pd_runtime.config import RouterConfig, TenantConfig
from pd_runtime.tokenizer import Tokenizer
from tests.router_support.scripted_backend import ScriptedBackend, error, token_chunk
from tests.router_support.served_model import client, greedy, offline, server  # noqa: F401
from tests.router_support.serving import ERROR_KEYS, assert_error_body, engine_of, local, serving


# ---------------------------------------------------------------------------------- happy paths
def test_completions_match_offline_greedy(server, client, offline):
    backend, _ = server
    prompt = "The quick brown fox"
    want = offline.generate(prompt, greedy(12))[0]
    extra = {"ignore_eos": True}
    got = client.completions.create(model=backend.model_name, prompt=prompt, max_tokens=12,
                                    temperature=0, extra_body=extra)
    assert got.id.startswith("cmpl-") and got.choices[0].text == want.text
    assert got.usage.prompt_tokens == len(want.prompt_token_ids)
    assert got.usage.completion_tokens == 12
    by_ids = client.completions.create(model=backend.model_name, prompt=want.prompt_token_ids,
                                       max_tokens=12, temperature=0, extra_body=extra)
    assert by_ids.choices[0].text == want.text
    streamed = list(client.completions.create(model=backend.model_name, prompt=prompt,
                                              max_tokens=12, temperature=0, stream=True,
                                              extra_body=extra))
    assert "".join(c.choices[0].text for c in streamed) == want.text
    assert streamed[-1].choices[0].finish_reason == "length"


def test_chat_matches_offline_greedy(server, client, offline):
    backend, _ = server
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    ids = backend.tokenizer.encode_chat(messages)
    want = offline.generate(ids, greedy(10))[0]
    got = client.chat.completions.create(model=backend.model_name, messages=messages,
                                         max_tokens=10, temperature=0,
                                         extra_body={"ignore_eos": True})
    assert got.id.startswith("chatcmpl-") and got.object == "chat.completion"
    assert got.choices[0].message.role == "assistant"
    assert got.choices[0].message.content == want.text
    chunks = list(client.chat.completions.create(
        model=backend.model_name, messages=messages, max_completion_tokens=10, temperature=0,
        stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want.text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    assert chunks[-1].usage.prompt_tokens == len(ids)
    assert all(c.usage is None for c in chunks[:-1])


def test_n_choices_with_seed_differ_and_reproduce(server, client):
    backend, _ = server
    args = dict(model=backend.model_name, prompt="Once upon", max_tokens=8, temperature=1.0,
                extra_body={"ignore_eos": True})
    two = client.completions.create(n=2, seed=7, **args)
    assert [c.index for c in two.choices] == [0, 1]
    assert two.choices[0].text != two.choices[1].text
    assert two.usage.completion_tokens == 16
    # Choice i runs with seed + i: the same as a single request with that seed.
    second = client.completions.create(n=1, seed=8, **args)
    assert second.choices[0].text == two.choices[1].text
    streamed = list(client.completions.create(n=2, seed=7, stream=True, **args))
    texts = ["".join(c.choices[0].text for c in streamed if c.choices[0].index == i)
             for i in range(2)]
    assert texts == [c.text for c in two.choices]


def test_batch_prompts_and_token_id_lists(server, client, offline):
    backend, _ = server
    prompts = ["alpha beta", "gamma"]
    want = [o.text for o in offline.generate(prompts, greedy(6))]
    got = client.completions.create(model=backend.model_name, prompt=prompts, n=2,
                                    max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    assert [c.index for c in got.choices] == [0, 1, 2, 3]
    assert [c.text for c in got.choices] == [want[0], want[0], want[1], want[1]]
    ids = [backend.tokenizer.encode(p) for p in prompts]
    assert got.usage.prompt_tokens == sum(map(len, ids))
    by_ids = client.completions.create(model=backend.model_name, prompt=ids, max_tokens=6,
                                       temperature=0, extra_body={"ignore_eos": True})
    assert [c.text for c in by_ids.choices] == want


def test_logprobs_formats(server, client):
    backend, _ = server
    got = client.completions.create(model=backend.model_name, prompt="hello", max_tokens=5,
                                    temperature=0, logprobs=3, extra_body={"ignore_eos": True})
    lp = got.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert all(v <= 0 for v in lp.token_logprobs)
    assert all(1 <= len(top) <= 3 for top in lp.top_logprobs)
    # Greedy: the sampled token is the most likely one.
    assert all(abs(max(top.values()) - v) < 1e-5 for top, v in zip(lp.top_logprobs,
                                                                   lp.token_logprobs))
    assert lp.text_offset[0] == 0
    chat = client.chat.completions.create(
        model=backend.model_name, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
        temperature=0, logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(len(e.top_logprobs) == 2 for e in content)
    assert all(e.bytes == list(e.token.encode()) for e in content)
    streamed = list(client.completions.create(model=backend.model_name, prompt="hello",
                                              max_tokens=5, temperature=0, logprobs=1,
                                              stream=True, extra_body={"ignore_eos": True}))
    tokens = [t for c in streamed if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    assert tokens == lp.tokens


def test_echo_stop_and_side_endpoints(server, client):
    backend, port = server
    got = client.completions.create(model=backend.model_name, prompt="echo me", max_tokens=3,
                                    temperature=0, echo=True)
    assert got.choices[0].text.startswith("echo me")
    models = client.models.list()
    assert [m.id for m in models.data] == [backend.model_name]
    base = f"http://127.0.0.1:{port}"
    assert httpx.get(f"{base}/health").json()["status"] == "ok"
    assert httpx.get(f"{base}/ready").status_code == 200
    from importlib import metadata

    assert httpx.get(f"{base}/version").json() == {"version": metadata.version("pd-runtime")}
    config = httpx.get(f"{base}/v1/router/config").json()
    assert config["routing"]["mode"] == "always_colocated"  # as local() configures it
    metrics = httpx.get(f"{base}/metrics")
    assert metrics.status_code == 200
    assert 'router_http_requests_total{path="/v1/completions",status="200"}' in metrics.text


# ---------------------------------------------------------------------------------- errors
def test_openai_client_sees_typed_400s(server, client):
    backend, _ = server
    name = backend.model_name
    cases = [
        (dict(model="no-such-model", prompt="x"), "model"),
        (dict(model=name, prompt="x", temperature=-1), "temperature"),
        (dict(model=name, prompt="x", top_p=0), "top_p"),
        (dict(model=name, prompt="x", max_tokens=0), "max_tokens"),
        (dict(model=name, prompt="x", n=0), "n"),
        (dict(model=name, prompt="x", logprobs=99), "logprobs"),
        (dict(model=name, prompt=""), "prompt"),
        (dict(model=name, prompt=[]), "prompt"),
        (dict(model=name, prompt=[1] * backend.max_model_len), "prompt"),
        (dict(model=name, prompt="x", max_tokens=backend.max_model_len), "prompt"),
        (dict(model=name, prompt="x", stop=[""]), "stop"),
        (dict(model=name, prompt="x", extra_body={"top_k": "3"}), "top_k"),
        (dict(model=name, prompt="x", extra_body={"min_tokens": 3}), "min_tokens"),
    ]
    for args, param in cases:
        with pytest.raises(openai.BadRequestError) as caught:
            client.completions.create(**{"max_tokens": 2, **args})
        assert caught.value.status_code == 400
        assert caught.value.body["param"] == param, (args, caught.value.body)
        if param == "model":
            assert caught.value.body["code"] == "model_not_found"
    for args, param in [(dict(messages=[]), "messages"),
                        (dict(messages=[{"role": "user", "content": "x"}], logprobs=False,
                              top_logprobs=2), "top_logprobs"),
                        (dict(messages=[{"role": "user", "content": "x"}],
                              max_completion_tokens=0), "max_completion_tokens")]:
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(model=name, **args)
        assert caught.value.body["param"] == param


def test_raw_http_errors(server):
    backend, port = server
    url = f"http://127.0.0.1:{port}/v1/completions"
    assert_error_body(httpx.post(url, content=b"{not json"), 400)
    assert_error_body(httpx.post(url, content=b"[1, 2]"), 400)
    assert_error_body(httpx.post(url, json={"prompt": "x", "max_tokens": "3"}), 400, "max_tokens")
    assert_error_body(httpx.post(url, json={"prompt": "x", "stream": "yes"}), 400, "stream")
    assert_error_body(httpx.post(url, json={"prompt": "x", "seed": 1 << 70}), 400, "seed")
    assert_error_body(httpx.post(url, json={"prompt": [[1, 2], "x", 3]}), 400, "prompt")
    assert_error_body(httpx.post(url, json={"prompt": "x", "priority": True}), 400, "priority")
    assert_error_body(httpx.post(url + "x", json={}), 404)
    not_allowed = httpx.get(url)
    assert_error_body(not_allowed, 405)
    assert not_allowed.headers["allow"] == "POST"
    chat = f"http://127.0.0.1:{port}/v1/chat/completions"
    assert_error_body(httpx.post(chat, json={"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]}), 400, "messages")
    assert_error_body(httpx.post(chat, json={"messages": "hi"}), 400, "messages")


def test_api_keys(llama_dir):
    tenants = [TenantConfig(tenant_id="acme", api_key="sk-acme"),
               TenantConfig(tenant_id="beta", api_key="sk-beta", share_prefix_cache=True)]
    with local(llama_dir, RouterConfig(tenants=tenants, routing={"mode": "always_colocated"})
               ) as (backend, port):
        base = f"http://127.0.0.1:{port}"
        body = {"prompt": "hi", "max_tokens": 2}
        assert_error_body(httpx.post(f"{base}/v1/completions", json=body), 401)
        assert_error_body(httpx.post(f"{base}/v1/completions", json=body,
                                     headers={"Authorization": "Bearer sk-wrong"}), 401)
        assert_error_body(httpx.get(f"{base}/v1/models"), 401)
        assert httpx.get(f"{base}/health").status_code == 200
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{base}/v1", api_key="nope", max_retries=0
                          ).completions.create(model=backend.model_name, prompt="x")
        for key in ("sk-acme", "sk-beta"):
            good = openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0)
            assert good.completions.create(model=backend.model_name, prompt="hi",
                                           max_tokens=2).choices[0].finish_reason


def test_admission_refusal_is_429_with_retry_after(llama_dir):
    with local(llama_dir, max_num_seqs=1, max_waiting_requests=1) as (backend, port):
        url = f"http://127.0.0.1:{port}/v1/completions"

        async def burst():
            async with httpx.AsyncClient(timeout=60) as http:
                body = {"prompt": "hi", "max_tokens": 100, "ignore_eos": True}
                return await asyncio.gather(*[
                    http.post(url, json={**body, "stream": i % 2 == 1}) for i in range(6)])

        responses = asyncio.run(burst())
        statuses = sorted(r.status_code for r in responses)
        assert 200 in statuses and 429 in statuses, statuses
        for refused in (r for r in responses if r.status_code == 429):
            assert_error_body(refused, 429)
            assert int(refused.headers["retry-after"]) >= 1


def _wait_idle(backend, free_at_start: int, deadline_s: float = 10.0) -> None:
    engine = engine_of(backend)
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if not engine.requests and engine.block_manager.num_free_blocks == free_at_start:
            return
        time.sleep(0.02)
    raise AssertionError(f"blocks not freed: {engine.block_manager.num_free_blocks} free, "
                         f"{free_at_start} at start, requests {list(engine.requests)}")


def test_disconnect_mid_stream_frees_blocks(server):
    backend, port = server
    engine = engine_of(backend)
    free_at_start = engine.block_manager.num_free_blocks
    body = {"prompt": "a long story", "max_tokens": 1500, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body,
                      timeout=30) as response:
        assert response.status_code == 200
        events = response.iter_lines()
        assert next(e for e in events if e.startswith("data:"))
        assert engine.requests  # it is running now
        steps_at_close = engine.num_steps
    _wait_idle(backend, free_at_start)
    assert engine.num_steps - steps_at_close < 200  # aborted, not run to its 1500 tokens


def test_disconnect_while_waiting_non_streaming_frees_blocks(server):
    backend, port = server
    engine = engine_of(backend)
    free_at_start = engine.block_manager.num_free_blocks
    body = {"prompt": "another long story", "max_tokens": 1500, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=0.5)
    steps_at_close = engine.num_steps
    _wait_idle(backend, free_at_start)
    assert engine.num_steps - steps_at_close < 200


# ---------------------------------------------------------------------------------- chunk errors
@pytest.fixture(scope="module")
def tokenizer(llama_dir):
    return Tokenizer(llama_dir)


@pytest.mark.parametrize("chunk, status", [
    (error(429, retry_after_s=2.5), 429), (error(503), 503), (error(400, param="prompt"), 400),
    (error(200, "not an error status"), 503)])
def test_error_before_first_token_sets_the_status(tokenizer, chunk, status):
    with serving(ScriptedBackend(tokenizer, [chunk])) as (_, port):
        for stream in (False, True):
            response = httpx.post(f"http://127.0.0.1:{port}/v1/completions",
                                  json={"prompt": "x", "stream": stream})
            err = assert_error_body(response, status)
            if status == 429:
                assert response.headers["retry-after"] == "3"
            if status == 400:
                assert err["param"] == "prompt"


def test_error_after_first_token_is_an_sse_error_event(tokenizer):
    script = [token_chunk("a"), error(503, "worker lost"), token_chunk("never")]
    with serving(ScriptedBackend(tokenizer, script)) as (_, port):
        response = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions",
                              json={"messages": [{"role": "user", "content": "x"}],
                                    "stream": True})
        assert response.status_code == 200
        events = [line[len("data: "):] for line in response.text.splitlines()
                  if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        assert json.loads(events[0])["choices"][0]["delta"]["content"] == "a"
        err = json.loads(events[-2])["error"]
        assert set(err) == ERROR_KEYS and err["message"] == "worker lost"


def test_not_ready_is_503(tokenizer):
    with serving(ScriptedBackend(tokenizer, [], is_ready=False)) as (_, port):
        assert_error_body(httpx.get(f"http://127.0.0.1:{port}/ready"), 503)


def test_scripted_disconnect_closes_the_backend_stream(tokenizer):
    script = [token_chunk(str(i)) for i in range(1000)]
    backend = ScriptedBackend(tokenizer, script, step_s=0.01)
    with serving(backend) as (_, port):
        with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions",
                          json={"prompt": "x", "stream": True, "n": 2}, timeout=10) as response:
            next(line for line in response.iter_lines() if line.startswith("data:"))
        end = time.monotonic() + 5
        while len(backend.closed) < 2 and time.monotonic() < end:
            time.sleep(0.01)
        assert len(backend.closed) == 2, backend.closed
