"""Presence, frequency and repetition penalties and logit_bias: their arithmetic against a
reference written here, their effect on the tiny model's greedy text, batch invariance, and
validation of their values.
"""

from __future__ import annotations

import collections
import math

import pytest
import torch

from pd_runtime import LLM, SamplingParams
from pd_runtime.api import InvalidRequestError
from pd_runtime.engine.sampling.sampler import Sampler


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(llama_dir, dtype="float32", num_kv_blocks=256, max_model_len=256)


def reference(row: list[float], p: SamplingParams, prompt: list[int],
              output: list[int]) -> list[float]:
    """The adjusted logits, token by token in plain Python: bias (OpenAI), then repetition
    (vLLM: prompt and output), then frequency and presence (OpenAI: output only)."""
    row = list(row)
    for token, bias in (p.logit_bias or {}).items():
        row[token] += bias
    for token in set(prompt) | set(output):
        value = row[token]
        row[token] = value / p.repetition_penalty if value > 0 else value * p.repetition_penalty
    for token, count in collections.Counter(output).items():
        row[token] -= count * p.frequency_penalty + p.presence_penalty
    return row


PENALTIES = [
    dict(repetition_penalty=1.7),
    dict(repetition_penalty=0.6),
    dict(frequency_penalty=1.5),
    dict(presence_penalty=-1.25),
    dict(frequency_penalty=-0.5, presence_penalty=2.0, repetition_penalty=1.2,
         logit_bias={"3": 7.5, "40": -100}),
    dict(logit_bias={5: 100}),
]


def test_adjusted_logits_match_the_reference():
    gen = torch.Generator().manual_seed(0)
    vocab = 64
    logits = torch.randn(len(PENALTIES), vocab, generator=gen) * 4
    histories = [(torch.randint(vocab, (9,), generator=gen).tolist(),
                  torch.randint(vocab, (13,), generator=gen).tolist())
                 for _ in PENALTIES]
    params = [SamplingParams(temperature=0, **kw) for kw in PENALTIES]
    adjusted = Sampler().adjust_logits(logits, params, histories)
    for i, (p, (prompt, output)) in enumerate(zip(params, histories)):
        want = reference(logits[i].tolist(), p, prompt, output)
        assert adjusted[i].tolist() == pytest.approx(want, abs=1e-5), PENALTIES[i]
        assert not torch.equal(adjusted[i], logits[i])  # every case really changes the row
    # The caller's logits stay raw (they give the logprobs).
    assert torch.equal(logits, torch.randn(len(PENALTIES), vocab,
                                           generator=torch.Generator().manual_seed(0)) * 4)


def test_no_adjustment_returns_the_same_tensor():
    logits = torch.randn(3, 32)
    params = [SamplingParams(), SamplingParams(temperature=0), SamplingParams(top_k=3)]
    assert Sampler().adjust_logits(logits, params, None) is logits


def test_rows_adjust_the_same_alone_and_in_any_batch():
    gen = torch.Generator().manual_seed(1)
    vocab = 128
    logits = torch.randn(len(PENALTIES) + 1, vocab, generator=gen)
    params = [SamplingParams(**kw) for kw in PENALTIES] + [SamplingParams()]
    histories = [([1, 2, 3], list(range(i, 20 + i))) for i in range(len(params))]
    together = Sampler().adjust_logits(logits, params, histories)
    for i in range(len(params)):
        alone = Sampler().adjust_logits(logits[i:i + 1], params[i:i + 1], histories[i:i + 1])
        assert torch.equal(alone[0], together[i])
    # And sampling: a seeded row draws the same token alone as next to other rows.
    seeded = SamplingParams(temperature=0.9, seed=4, frequency_penalty=1.0)
    batch = [seeded] + params
    rows = torch.cat([logits[:1], logits])
    hist = [histories[0]] + histories
    for _ in range(5):
        gens = [Sampler.make_generator(4)] + [None] * len(params)
        in_batch = Sampler(seed=9)(rows, batch, gens, hist).token_ids[0]
        single = Sampler(seed=123)(logits[:1], [seeded], [Sampler.make_generator(4)],
                                   hist[:1]).token_ids[0]
        assert in_batch == single


def test_penalties_need_histories():
    with pytest.raises(ValueError, match="histories"):
        Sampler()(torch.randn(1, 8), [SamplingParams(presence_penalty=1.0)], [None])


def _greedy(**kw) -> SamplingParams:
    return SamplingParams(max_tokens=32, temperature=0, ignore_eos=True, **kw)


def _repeating_prompt(llm) -> tuple[list[int], list[int]]:
    """A one-token prompt whose greedy continuation repeats some token at least 4 times."""
    for first in range(100, 140):
        out = llm.generate([[first]], _greedy())[0].token_ids
        if max(collections.Counter(out).values()) >= 4:
            return [first], out
    raise AssertionError("no prompt of the tiny model repeats a token; pick another search")


def test_frequency_penalty_stops_a_greedy_repeat(llm):
    prompt, base = _repeating_prompt(llm)
    token, count = collections.Counter(base).most_common(1)[0]
    out = llm.generate([prompt], _greedy(frequency_penalty=2.0))[0].token_ids
    assert collections.Counter(out)[token] < count
    assert max(collections.Counter(out).values()) <= 2, out
    # A negative penalty rewards repeats instead: fewer distinct tokens than unpenalized.
    more = llm.generate([prompt], _greedy(frequency_penalty=-2.0))[0].token_ids
    assert len(set(more)) < len(set(base)) < len(set(out))


def test_logit_bias_forces_and_bans(llm):
    prompt = [10, 20, 30, 40]
    base = llm.generate([prompt], _greedy(logprobs=20))[0]
    forced_token = 77 if 77 not in base.token_ids[:1] else 78
    forced = llm.generate([prompt], _greedy(logit_bias={str(forced_token): 100},
                                            logprobs=20))[0]
    assert forced.token_ids == [forced_token] * 32
    banned = set(base.token_ids[:8])
    out = llm.generate([prompt], _greedy(logit_bias={t: -100 for t in banned}))[0].token_ids
    assert not banned & set(out)
    # Logprobs are the raw model's (vLLM's default): the first step's distribution is the same
    # with or without the bias, so the forced token's logprob is its unbiased one.
    first = {t: lp.logprob for t, lp in base.logprobs[0].items()}
    runner_up = sorted(first.items(), key=lambda kv: -kv[1])[1][0]
    second = llm.generate([prompt], _greedy(logit_bias={runner_up: 100}, logprobs=20))[0]
    assert second.token_ids[0] == runner_up
    assert second.logprobs[0][runner_up].logprob == pytest.approx(first[runner_up], abs=1e-6)
    assert second.logprobs[0][runner_up].rank == 2  # drawn by the bias, ranked by the model
    assert {t: lp.logprob for t, lp in second.logprobs[0].items()} == \
        pytest.approx(first, abs=1e-6)


class _RecordingSampler(Sampler):
    """The engine's sampler, unchanged, keeping what each call was given."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __call__(self, logits, params, generators, histories=None):
        self.calls.append((logits.clone(), list(params),
                           [(list(a), list(b)) for a, b in histories]))
        return super().__call__(logits, params, generators, histories)


@pytest.mark.parametrize("kw", [dict(repetition_penalty=1.8),
                                dict(repetition_penalty=1.3, frequency_penalty=0.7,
                                     presence_penalty=0.4, logit_bias={"9": 3.0})])
def test_engine_tokens_follow_the_reference_on_raw_logits(llm, kw):
    engine = llm.engine
    saved, engine.sampler = engine.sampler, _RecordingSampler()
    try:
        prompt, base = _repeating_prompt(llm)
        engine.sampler.calls.clear()
        out = llm.generate([prompt], _greedy(**kw))[0].token_ids
        calls = engine.sampler.calls
    finally:
        engine.sampler = saved
    assert out != base  # the penalty changed the text
    assert len(calls) == len(out)
    for step, (logits, params, histories) in enumerate(calls):
        prompt_ids, output_ids = histories[0]
        assert prompt_ids == prompt and output_ids == out[:step]
        want = reference(logits[0].tolist(), params[0], prompt_ids, output_ids)
        assert want[out[step]] >= max(want) - 1e-5, step


def test_a_request_decodes_the_same_alone_and_batched_with_other_penalties(llm):
    prompt = [100, 7, 8]
    others = [([5, 6, 7], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True,
                                         repetition_penalty=2.0)),
              ([11, 12], SamplingParams(max_tokens=40, temperature=1.0, seed=3, ignore_eos=True,
                                        presence_penalty=-1.0, logit_bias={"4": 5})),
              ([13], SamplingParams(max_tokens=10, ignore_eos=True))]
    for mine in (_greedy(frequency_penalty=0.8, repetition_penalty=1.2, logit_bias={"6": 2}),
                 SamplingParams(max_tokens=32, temperature=0.8, seed=21, ignore_eos=True,
                                presence_penalty=1.5, repetition_penalty=0.9)):
        alone = llm.generate([prompt], mine)[0].token_ids
        batched = llm.generate([prompt] + [p for p, _ in others],
                               [mine] + [s for _, s in others])[0].token_ids
        assert batched == alone
        plain = SamplingParams(**{**vars(mine), "frequency_penalty": 0.0,
                                  "presence_penalty": 0.0, "repetition_penalty": 1.0,
                                  "logit_bias": None})
        assert llm.generate([prompt], plain)[0].token_ids != alone  # the penalties did act


@pytest.mark.parametrize("kwargs,param", [
    (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(presence_penalty=math.nan), "presence_penalty"),
    (dict(frequency_penalty=-3), "frequency_penalty"),
    (dict(frequency_penalty=True), "frequency_penalty"),
    (dict(repetition_penalty=0), "repetition_penalty"),
    (dict(repetition_penalty=math.inf), "repetition_penalty"),
    (dict(logit_bias={"5": 101}), "logit_bias"),
    (dict(logit_bias={"5": math.nan}), "logit_bias"),
    (dict(logit_bias={"-5": 1}), "logit_bias"),
    (dict(logit_bias={"x": 1}), "logit_bias"),
    (dict(logit_bias={"7": 1, "007": 2}), "logit_bias"),
    (dict(logit_bias=[1, 2]), "logit_bias"),
    (dict(logit_bias={str(i): 1 for i in range(301)}), "logit_bias"),
])
def test_invalid_penalties_rejected(kwargs, param):
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams(**kwargs)
    assert err.value.param == param


def test_engine_refuses_logit_bias_beyond_the_vocabulary(llama_dir):
    from pd_runtime import LLM
    from pd_runtime.api import InvalidRequestError

    llm = LLM(llama_dir, dtype="float32", num_kv_blocks=16)
    vocab = llm.engine.model_config.vocab_size
    with pytest.raises(InvalidRequestError) as err:
        llm.engine.add_request("lb", [5, 6, 7], SamplingParams(logit_bias={vocab: 1.0}))
    assert err.value.param == "logit_bias"
    assert llm.engine.block_manager.num_free_blocks == 16 and not llm.engine.requests


def test_allowed_tokens_outlast_bans_that_would_leave_nothing():
    """allowed_token_ids with a bad word spelt only with allowed tokens: where the bans would
    rule out every allowed token, they give way (an allowed token is chosen, never a token
    outside the list, as argmax over all -inf would give); elsewhere they hold. The mask is
    made once per request, not every step."""
    sampler = Sampler()
    logits = torch.randn(2, 50)
    logits[:, 0] = 10.0  # the likeliest token is one neither row allows
    only_nine = SamplingParams(temperature=0, allowed_token_ids=[9, 9],
                               bad_words_token_ids=[[9, 9]])
    two = SamplingParams(temperature=0, allowed_token_ids=[9, 12],
                         bad_words_token_ids=[[9, 9]])
    assert only_nine.allowed_token_ids == [9]  # each once
    logits[1, 9], logits[1, 12] = 5.0, 4.0
    got = sampler(logits, [only_nine, two], [None, None], [([1], [9]), ([1], [9])])
    assert got.token_ids == [9, 12]  # row 0: the ban gave way; row 1: it held
    got = sampler(logits, [only_nine, two], [None, None], [([1], []), ([1], [])])
    assert got.token_ids == [9, 9]
    mask = sampler._allowed[id(two)][2]
    sampler(logits, [two], [None], [([1], [])])
    assert sampler._allowed[id(two)][2] is mask and id(only_nine) not in sampler._allowed


def test_engine_refuses_allowed_tokens_that_are_all_ruled_out(llama_dir):
    """Every allowed token a one-token bad word, or EOS while min_tokens holds it back: no
    first token can be chosen, so the request is a 400 naming allowed_token_ids."""
    llm = LLM(llama_dir, dtype="float32", num_kv_blocks=16)
    eos = min(llm.engine.eos_token_ids)
    for params in (SamplingParams(allowed_token_ids=[9], bad_words_token_ids=[[9], [3, 4]]),
                   SamplingParams(allowed_token_ids=[eos], min_tokens=2, max_tokens=4),
                   SamplingParams(allowed_token_ids=[eos, 9], bad_words_token_ids=[[9]],
                                  min_tokens=1)):
        with pytest.raises(InvalidRequestError) as err:
            llm.engine.add_request("all-out", [5, 6, 7], params)
        assert err.value.param == "allowed_token_ids"
    assert not llm.engine.requests
    # One allowed token left: accepted.
    llm.engine.add_request("one-left", [5, 6, 7], SamplingParams(
        allowed_token_ids=[9, 10], bad_words_token_ids=[[9]], max_tokens=2))
    assert "one-left" in llm.engine.requests
