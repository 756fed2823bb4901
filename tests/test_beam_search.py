"""Beam search (pd_runtime/beam_search.py; pd_runtime/entrypoints/openai/beam_search.py, vLLM's
use_beam_search): the search on a table model (EOS set aside, the length penalty, the width), and
over HTTP with the official `openai` client and offline (LLM.beam_search) against transformers'
`generate(num_beams=...)` on the same weights; fields it would ignore are 400s naming them."""

from __future__ import annotations

import asyncio
import math

import openai
import pytest
import torch
from transformers import AutoModelForCausalLM

from pd_runtime.beam_search import BeamSpec, search
from tests.router_support.serving import local

EOS = 9


def table_step(table: dict):
    """A model as a table: the last token -> {next token: probability}."""
    async def step(prompts):
        return [{t: math.log(p) for t, p in table[prompt[-1]].items()} for prompt in prompts]
    return step


def run(table, width, max_tokens, length_penalty=1.0, ignore_eos=False):
    return asyncio.run(search(table_step(table), [0], BeamSpec(width, length_penalty, False),
                              max_tokens, frozenset({EOS}), ignore_eos))


TABLE = {0: {1: 0.5, 2: 0.3, EOS: 0.2},
         1: {3: 0.4, EOS: 0.6},
         2: {4: 0.9, 3: 0.1},
         3: {4: 0.5, 3: 0.5},
         4: {4: 0.7, EOS: 0.3},
         EOS: {4: 0.5, EOS: 0.5}}  # read only with ignore_eos


def test_the_best_beams_and_what_ends_them():
    beams = run(TABLE, 2, 3, length_penalty=0.0)  # 0: plain summed log-probability
    # Finished: 1 then EOS (0.5 x 0.6 = 0.3), EOS at once (0.2); the best live beam after 3
    # steps, 2 4 4 (0.3 x 0.9 x 0.7 = 0.189), falls behind both. A finished beam's EOS is not
    # in its tokens.
    assert [(b.tokens, b.eos) for b in beams] == [([1], EOS), ([], EOS)]
    assert [round(math.exp(b.logprob), 9) for b in beams] == [0.3, 0.2]
    wide = run(TABLE, 3, 3, length_penalty=0.0)
    assert [(b.tokens, b.eos) for b in wide] == [([1], EOS), ([], EOS), ([2, 4, 4], None)]


def test_ignore_eos_keeps_extending_and_width_bounds_the_beams():
    beams = run(TABLE, 3, 3, ignore_eos=True)
    assert len(beams) == 3 and all(len(b.tokens) == 3 and b.eos is None for b in beams)
    scores = [b.logprob for b in beams]
    assert scores == sorted(scores, reverse=True)
    # Every 3-token path's probability, best three: exhaustive check of the search.
    paths = []
    for a, pa in TABLE[0].items():
        for b, pb in TABLE[a].items():
            for c, pc in TABLE[b].items():
                paths.append(([a, b, c], math.log(pa * pb * pc)))
    best = sorted(paths, key=lambda p: -p[1])[:3]
    assert [b.tokens for b in beams] == [p[0] for p in best]


def test_a_length_penalty_favours_longer_beams():
    short = run(TABLE, 1, 4, length_penalty=0.0)[0]
    long = run(TABLE, 1, 4, length_penalty=8.0)[0]
    assert len(long.tokens) > len(short.tokens)


@pytest.fixture(scope="module")
def served(llama_dir):
    with local(llama_dir) as (backend, port):
        yield backend, openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x",
                                     max_retries=0)


def test_beams_match_transformers(served, llama_dir):
    backend, client = served
    from pd_runtime import LLM

    hf = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    prompts = ([11, 12, 13, 14], [(7 * i) % 400 + 5 for i in range(40)])
    offline = LLM(llama_dir, dtype="float32", num_kv_blocks=256).beam_search(
        list(prompts), 3, 6, ignore_eos=True)  # both prompts' beams, one batch a step
    for prompt, beams in zip(prompts, offline):
        done = client.completions.create(
            model=backend.model_name, prompt=prompt, n=3, max_tokens=6,
            extra_body={"use_beam_search": True, "ignore_eos": True, "return_token_ids": True})
        got = [c.model_extra["token_ids"] for c in sorted(done.choices, key=lambda c: c.index)]
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), num_beams=3, num_return_sequences=3,
                              do_sample=False, max_new_tokens=6, length_penalty=1.0)
        assert got == [row[len(prompt):].tolist() for row in ref]
        assert [b.token_ids for b in beams] == got and [b.text for b in beams] == \
            [c.text for c in sorted(done.choices, key=lambda c: c.index)]
        assert [c.finish_reason for c in done.choices] == ["length"] * 3
        assert done.usage.completion_tokens == 18 and done.usage.prompt_tokens == len(prompt)
        assert [c.text for c in done.choices] == \
            [backend.tokenizer.decode(t) for t in got]


def test_chat_and_stream_take_beam_search(served):
    backend, client = served
    kw = dict(model=backend.model_name, messages=[{"role": "user", "content": "Hi"}], n=2,
              max_tokens=5, extra_body={"use_beam_search": True, "ignore_eos": True})
    done = client.chat.completions.create(**kw)
    texts = [c.message.content for c in sorted(done.choices, key=lambda c: c.index)]
    assert len(texts) == 2 and texts[0] != texts[1]
    streamed = {}
    for event in client.chat.completions.create(stream=True, **kw):
        for choice in event.choices:
            streamed[choice.index] = streamed.get(choice.index, "") + \
                (choice.delta.content or "")
    assert [streamed[i] for i in range(2)] == texts


@pytest.mark.parametrize("extra, param", [
    ({"stop": ["x"]}, "stop"), ({"logprobs": 2}, "logprobs"),
    ({"presence_penalty": 0.5}, "presence_penalty"), ({"logit_bias": {"5": 1}}, "logit_bias"),
    ({"n": 11}, "n"), ({"guided_regex": "a+"}, "use_beam_search"),
    ({"length_penalty": "long"}, "length_penalty")])
def test_what_beam_search_would_ignore_is_refused(served, extra, param):
    backend, client = served
    body = {"use_beam_search": True, **extra}
    n = body.pop("n", 2)
    kwargs = {"logprobs": body.pop("logprobs")} if "logprobs" in body else {}
    with pytest.raises(openai.BadRequestError) as raised:
        client.completions.create(model=backend.model_name, prompt=[11, 12], n=n,
                                  max_tokens=3, extra_body=body, **kwargs)
    assert raised.value.body["param"] == param


def test_a_search_counts_once_against_the_tenants_limits(llama_dir):
    """Its steps are requests of their own to the workers, but a tenant's rate limits see one
    request (of its prompt and every beam's tokens): 12 steps pass a 2-requests-a-minute
    limit, the third search does not."""
    from pd_runtime.config_router import RouterConfig

    config = RouterConfig(routing={"mode": "always_colocated"}, tenants=[
        {"tenant_id": "t", "api_key": "k", "requests_per_minute": 2}])
    with local(llama_dir, config) as (backend, port):
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="k",
                               max_retries=0)
        kw = dict(model=backend.model_name, prompt=[11, 12, 13], n=2, max_tokens=6,
                  extra_body={"use_beam_search": True, "ignore_eos": True})
        for _ in range(2):
            assert len(client.completions.create(**kw).choices) == 2
        with pytest.raises(openai.RateLimitError):
            client.completions.create(**kw)
