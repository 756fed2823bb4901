"""Sampling controls, stop conditions, logprobs, and validation of bad input."""

from __future__ import annotations

import math

import pytest
import torch

from pd_runtime import LLM, SamplingParams
from pd_runtime.api import InvalidRequestError, RequestTooLargeError
from pd_runtime.engine.sampling.sampler import Sampler


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(llama_dir, dtype="float32", num_kv_blocks=256, max_model_len=256)


def test_top_k_and_top_p_and_min_p_restrict_support():
    torch.manual_seed(0)
    logits = torch.randn(1, 100) * 3
    order = logits[0].argsort(descending=True).tolist()
    sampler = Sampler(seed=1)

    def draws(**kw):
        params = SamplingParams(temperature=1.0, **kw)
        return {sampler(logits, [params], [None]).token_ids[0] for _ in range(300)}

    assert draws(top_k=3) <= set(order[:3])
    probs = logits[0].softmax(-1)
    sorted_probs = probs[order]
    keep = int((sorted_probs.cumsum(0) - sorted_probs < 0.5).sum())
    assert draws(top_p=0.5) <= set(order[:keep])
    allowed = {i for i in range(100) if probs[i] >= 0.3 * probs.max()}
    assert draws(min_p=0.3) <= allowed
    assert len(draws()) > 5  # unrestricted sampling really samples
    assert len(draws(top_k=3)) > 1


def test_sampling_follows_distribution():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2]]))
    sampler = Sampler(seed=7)
    params = SamplingParams(temperature=1.0)
    counts = [0, 0, 0]
    for _ in range(3000):
        counts[sampler(logits, [params], [None]).token_ids[0]] += 1
    assert abs(counts[0] / 3000 - 0.5) < 0.04 and abs(counts[2] / 3000 - 0.2) < 0.04


def test_seed_reproducible_and_distinct(llm):
    prompt = [[10, 20, 30, 40]]
    a = llm.generate(prompt, SamplingParams(max_tokens=16, temperature=1.0, seed=5,
                                            ignore_eos=True))[0].token_ids
    b = llm.generate(prompt, SamplingParams(max_tokens=16, temperature=1.0, seed=5,
                                            ignore_eos=True))[0].token_ids
    c = llm.generate(prompt, SamplingParams(max_tokens=16, temperature=1.0, seed=6,
                                            ignore_eos=True))[0].token_ids
    assert a == b and a != c


def test_max_tokens_stop_token_ids_and_eos(llm):
    prompt = [[10, 20, 30, 40]]
    base = llm.generate(prompt, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0]
    assert len(base.token_ids) == 12 and base.finish_reason == "length"
    stop_at = base.token_ids[5]
    first = base.token_ids.index(stop_at)
    out = llm.generate(prompt, SamplingParams(max_tokens=12, temperature=0,
                                              stop_token_ids=[stop_at], ignore_eos=True))[0]
    assert out.token_ids == base.token_ids[:first + 1] and out.finish_reason == "stop"
    # The stop token's text is left out, unless include_stop_str_in_output (vLLM's behaviour).
    tok = llm.tokenizer
    first = next(i for i, t in enumerate(base.token_ids)
                 if i >= 2 and tok.decode([t]).strip() and t not in base.token_ids[:i])
    texts = [llm.generate(prompt, SamplingParams(
        max_tokens=12, temperature=0, stop_token_ids=[base.token_ids[first]], ignore_eos=True,
        include_stop_str_in_output=include))[0].text for include in (False, True)]
    assert texts == [tok.decode(base.token_ids[:first]), tok.decode(base.token_ids[:first + 1])]
    assert texts[0] != texts[1]
    # Make the model's own greedy token an eos: generation must stop there unless ignore_eos.
    engine = llm.engine
    saved = engine.eos_token_ids
    try:
        engine.eos_token_ids = frozenset({base.token_ids[2]})
        out = llm.generate(prompt, SamplingParams(max_tokens=12, temperature=0))[0]
        assert out.token_ids == base.token_ids[:base.token_ids.index(base.token_ids[2]) + 1]
        assert out.finish_reason == "stop"
        out = llm.generate(prompt, SamplingParams(max_tokens=12, temperature=0,
                                                  ignore_eos=True))[0]
        assert out.token_ids == base.token_ids
    finally:
        engine.eos_token_ids = saved


def test_min_tokens_holds_back_eos_stop_ids_and_stop_strings(llm):
    """vLLM's min_tokens: no EOS (ignore_eos or not) and no stop token id among the first
    min_tokens, and stop strings only in the text after them."""
    prompt = [[10, 20, 30, 40]]
    eos = min(llm.engine.eos_token_ids)

    def run(**kw):
        return llm.generate(prompt, SamplingParams(**{"max_tokens": 12, "temperature": 0,
                                                      **kw}))[0]

    assert run(logit_bias={eos: 100}).token_ids == [eos]
    out = run(logit_bias={eos: 100}, min_tokens=5)
    assert len(out.token_ids) == 6 and eos not in out.token_ids[:5]
    assert out.token_ids[5] == eos and out.finish_reason == "stop"
    # Under ignore_eos too (as vLLM: load generators send both to fix lengths).
    out = run(logit_bias={eos: 100}, min_tokens=5, ignore_eos=True)
    assert eos not in out.token_ids[:5] and out.token_ids[5:] == [eos] * 7
    out = run(logit_bias={42: 100}, stop_token_ids=[42], min_tokens=3, ignore_eos=True)
    assert out.token_ids[3:] == [42] and 42 not in out.token_ids[:3]

    base = run(ignore_eos=True, max_tokens=8)
    stop = base.text[:3]
    assert len(stop) == 3 and base.text.count(stop) == 1
    assert run(ignore_eos=True, max_tokens=8, stop=[stop]).text == ""
    kept = run(ignore_eos=True, max_tokens=8, stop=[stop], min_tokens=8)
    assert kept.token_ids == base.token_ids and kept.text == base.text


def test_a_stop_token_completing_a_character_leaves_no_replacement_char(llm):
    """'日' is three byte tokens; a stop on the third leaves its bytes out, not a U+FFFD."""
    tok, engine = llm.tokenizer, llm.engine
    a, b, c = tok.encode("日", add_special_tokens=False)
    for include, want in ((False, "ok "), (True, "ok 日")):
        engine.add_request(f"bytes-{include}", [10, 20, 30], SamplingParams(
            max_tokens=8, temperature=0, stop_token_ids=[c], logit_bias={c: 100},
            include_stop_str_in_output=include),
            resume_output_ids=tok.encode("ok ", add_special_tokens=False) + [a, b])
        text = None
        while engine.has_unfinished_requests():
            for out in engine.step():
                text = out.text  # the whole text so far (the resumed tokens' included)
        assert text == want and "\ufffd" not in text


def test_stop_strings_cut_text(llm):
    prompt = ["The quick brown fox"]
    base = llm.generate(prompt, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))[0]
    text = base.text
    stop = text[8:11]
    assert len(stop) == 3
    out = llm.generate(prompt, SamplingParams(max_tokens=30, temperature=0, stop=[stop],
                                              ignore_eos=True))[0]
    assert out.finish_reason == "stop"
    assert out.text == text[:text.index(stop)]
    assert len(out.token_ids) < len(base.token_ids)
    kept = llm.generate(prompt, SamplingParams(max_tokens=30, temperature=0, stop=[stop],
                                               include_stop_str_in_output=True,
                                               ignore_eos=True))[0]
    assert kept.text == text[:text.index(stop) + 3] and kept.token_ids == out.token_ids


def test_logprobs_are_log_softmax_of_logits(llm):
    out = llm.generate([[10, 20, 30]], SamplingParams(max_tokens=4, temperature=0, logprobs=3,
                                                      ignore_eos=True))[0]
    assert len(out.logprobs) == 4
    for token, entry in zip(out.token_ids, out.logprobs):
        lp = entry[token].logprob
        top = {t: v.logprob for t, v in entry.items()}  # greedy: the token is among the top-3
        assert len(top) == 3 and entry[token].rank == 1
        assert max(top.values()) == pytest.approx(lp, abs=1e-5)  # greedy token is the top one
        assert top[token] == pytest.approx(lp)
        assert lp <= 0
        assert math.fsum(math.exp(v) for v in top.values()) <= 1.0 + 1e-5


@pytest.mark.parametrize("kwargs,param", [
    (dict(temperature=-0.5), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-3), "top_k"),
    (dict(min_p=2.0), "min_p"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens=4, min_tokens=5), "min_tokens"),
    (dict(min_tokens=-1), "min_tokens"),
    (dict(logprobs=100), "logprobs"),
    (dict(stop=[""]), "stop"),
])
def test_invalid_sampling_values_rejected(kwargs, param):
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams(**kwargs)
    assert err.value.param == param


def test_bad_prompts_rejected_before_allocation(llm):
    engine = llm.engine
    free = engine.block_manager.num_free_blocks
    with pytest.raises(InvalidRequestError, match="empty"):
        engine.add_request("e1", "", SamplingParams())
    with pytest.raises(InvalidRequestError, match="empty"):
        engine.add_request("e2", [], SamplingParams())
    with pytest.raises(RequestTooLargeError, match="max_model_len"):
        engine.add_request("e3", [7] * 300, SamplingParams())
    with pytest.raises(InvalidRequestError, match="token ids"):
        engine.add_request("e4", [7, 10**9], SamplingParams())
    with pytest.raises(RequestTooLargeError, match="KV blocks"):
        small = LLM(llm.engine.config.model, dtype="float32", num_kv_blocks=4)
        small.engine.add_request("e5", [7] * 40, SamplingParams(max_tokens=100))
    assert engine.block_manager.num_free_blocks == free
    assert not engine.has_unfinished_requests()


def test_streamed_deltas_never_carry_text_a_stop_string_cuts(llm):
    engine = llm.engine
    base = llm.generate(["The quick brown fox"], SamplingParams(max_tokens=30, temperature=0,
                                                                ignore_eos=True))[0]
    stop = base.text[10:14]
    assert len(stop) == 4
    engine.add_request("stream-stop", "The quick brown fox",
                       SamplingParams(max_tokens=30, temperature=0, ignore_eos=True,
                                      stop=[stop]))
    deltas, final = [], None
    while engine.has_unfinished_requests():
        for out in engine.step():
            deltas.append(out.new_text)
            final = out
    assert final.finished and final.finish_reason == "stop"
    assert "".join(deltas) == final.text == base.text[:base.text.index(stop)]
