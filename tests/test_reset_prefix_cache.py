"""Emptying the prefix cache, as vLLM's LLM.reset_prefix_cache and its development endpoint
POST /reset_prefix_cache (what a load generator sends for a cold start): the next request
computes its whole prompt, gives the same tokens, and requests in flight are untouched."""

from __future__ import annotations

import httpx
import openai
import pytest

from pd_runtime import LLM, SamplingParams
from pd_runtime.config import RouterConfig
from pd_runtime.engine.kv_cache.block_manager import BlockManager
from pd_runtime.engine.sequence import Request
from tests.router_support.serving import assert_error_body, local

PROMPT = [3 + (7 * i) % 200 for i in range(70)]  # four full blocks of 16, and a tail
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def _request(rid: str, tokens: list[int]) -> Request:
    return Request(rid, list(tokens), GREEDY)


def test_block_manager_forgets_cached_blocks_and_keeps_held_ones():
    bm = BlockManager(16, 16, "m")
    done, running = _request("a", PROMPT), _request("b", PROMPT[:40])
    for req in (done, running):
        assert bm.allocate(req, req.num_tokens, bm.match_prefix(req))
        req.num_computed_tokens = req.num_tokens
        bm.cache_full_blocks(req)
    bm.free(done)
    held = list(running.block_ids)
    assert bm.cached_prefix_tokens(PROMPT) == 64
    assert bm.reset_prefix_cache() == 4  # running's two full blocks are shared with done's
    assert bm.cached_prefix_tokens(PROMPT) == 0
    assert running.block_ids == held and all(bm.blocks[b].ref_count == 1 for b in held)
    assert bm.num_free_blocks == 16 - len(held)
    # Cached again by the next request that computes them, and freed as ever.
    again = _request("c", PROMPT)
    assert bm.match_prefix(again) == []
    bm.allocate(again, again.num_tokens)
    again.num_computed_tokens = again.num_tokens
    bm.cache_full_blocks(again)
    assert bm.cached_prefix_tokens(PROMPT) == 64
    bm.free(running)
    bm.free(again)
    assert bm.num_free_blocks == 16


def test_offline_reset_computes_the_prompt_again(llama_dir):
    llm = LLM(llama_dir, dtype="float32", num_kv_blocks=64)
    first = llm.generate([PROMPT], GREEDY)[0]
    cached = llm.generate([PROMPT], GREEDY)[0]
    assert (first.num_cached_tokens, cached.num_cached_tokens) == (0, 64)
    assert llm.reset_prefix_cache() is True
    cold = llm.generate([PROMPT], GREEDY)[0]
    assert cold.num_cached_tokens == 0
    assert first.token_ids == cached.token_ids == cold.token_ids
    assert llm.engine.block_manager.num_free_blocks == 64


def _cached(client, name) -> int:
    got = client.completions.create(model=name, prompt=PROMPT, max_tokens=3, temperature=0,
                                    extra_body={"ignore_eos": True})
    return got.usage.prompt_tokens_details.cached_tokens


def test_the_development_endpoint_empties_every_worker(llama_dir):
    """On with router.dev_endpoints: 200 with each worker's forgotten blocks, then a repeated
    prompt hits nothing; a request streaming through the reset finishes as it would have."""
    with local(llama_dir, RouterConfig(routing={"mode": "always_colocated"},
                                       dev_endpoints=True)) as (backend, port):
        base = f"http://127.0.0.1:{port}"
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
        name = backend.model_name
        _cached(client, name)
        assert _cached(client, name) == 64
        stream = client.completions.create(model=name, prompt=PROMPT[:50], max_tokens=40,
                                           temperature=0, stream=True,
                                           extra_body={"ignore_eos": True})
        first = next(iter(stream))
        reset = httpx.post(base + "/reset_prefix_cache", timeout=30)
        assert reset.status_code == 200, reset.text
        assert reset.json()["workers"]["decode-0"] >= 4
        text = first.choices[0].text + "".join(e.choices[0].text for e in stream if e.choices)
        alone = client.completions.create(model=name, prompt=PROMPT[:50], max_tokens=40,
                                          temperature=0, extra_body={"ignore_eos": True})
        assert text == alone.choices[0].text
        # Those two cached PROMPT[:48] again; with nothing in flight, a reset leaves nothing.
        assert _cached(client, name) == 48
        assert httpx.post(base + "/reset_prefix_cache", timeout=30).status_code == 200
        assert _cached(client, name) == 0
        assert _cached(client, name) == 64


@pytest.mark.parametrize("env", [None, "1"])
def test_off_by_default_and_on_with_vllms_switch(llama_dir, monkeypatch, env):
    if env is not None:
        monkeypatch.setenv("VLLM_SERVER_DEV_MODE", env)
    else:
        monkeypatch.delenv("VLLM_SERVER_DEV_MODE", raising=False)
    with local(llama_dir) as (backend, port):
        reset = httpx.post(f"http://127.0.0.1:{port}/reset_prefix_cache", timeout=30)
        if env is None:
            assert_error_body(reset, 404)
        else:
            assert reset.status_code == 200 and set(reset.json()["workers"]) == {"decode-0"}
