"""Speculative decoding by prompt lookup (pd_runtime/engine/spec_decode/speculative.py): the drafter, and
outputs that equal plain decoding (greedy, and seeded sampling token for token), alone, batched
and disaggregated; the acceptance rule keeps the target distribution (chi-square)."""

from __future__ import annotations

import math
import random
import time

import pytest
import torch

from pd_runtime import LLM, SamplingParams
from pd_runtime.engine.sampling.sampler import Sampler
from pd_runtime.engine.spec_decode.speculative import LookupState, PromptLookup, accepted_count
from tests.test_disaggregated_engine import disaggregated

ENGINE = dict(dtype="float32", num_kv_blocks=256, warmup_tokens=0, num_threads=1)
SPEC = dict(speculative_method="ngram", speculative_tokens=4, speculative_ngram_min=1)


# ---------------------------------------------------------------------------------- the drafter
def test_lookup_proposes_what_followed_the_latest_earlier_match():
    lookup = PromptLookup(num_tokens=3, ngram_max=3, ngram_min=1)
    state = LookupState()
    tokens = [1, 2, 3, 4, 9, 1, 2, 3, 5, 6, 1, 2, 3]
    # [1, 2, 3] occurred twice before; the latest was followed by 5, 6, 1.
    assert lookup.propose(state, tokens, limit=8) == [5, 6, 1]
    assert lookup.propose(LookupState(), tokens, limit=2) == [5, 6]
    # Nothing earlier matches the last token: no guess.
    assert lookup.propose(LookupState(), [1, 2, 3, 7], limit=8) == []
    # Incremental: the index grows with the context and finds the longest match.
    tokens += [5]
    assert lookup.propose(state, tokens, limit=8) == [6, 1, 2]
    # A repeat still going on: the guesses continue its period past the context's end.
    assert lookup.propose(LookupState(), [9, 4, 7, 4, 7, 4], limit=8) == [7, 4, 7]


def test_a_drafter_that_keeps_missing_backs_off():
    lookup = PromptLookup(num_tokens=2, ngram_max=2, ngram_min=1, max_backoff=4)
    state = LookupState()
    tokens = [7, 8, 7]
    skipped = []
    for _ in range(12):
        drafts = lookup.propose(state, tokens, limit=4)
        skipped.append(not drafts)
        if drafts:
            lookup.verified(state, len(drafts), 0)
    # Misses back off 1, 2, 4, 4 ... steps.
    assert skipped == [False, True, False, True, True, False, True, True, True, True, False,
                       True]
    lookup.verified(state, 2, 1)
    assert state.misses == 0


def test_accepted_prefix():
    assert accepted_count([4, 5, 6], [4, 5, 9, 1]) == 2
    assert accepted_count([4, 5, 6], [1, 5, 6, 1]) == 0
    assert accepted_count([4, 5, 6], [4, 5, 6, 1]) == 3


# ---------------------------------------------------------------------------------- exactness
def repetitive_prompts(n: int, seed: int = 0) -> list[list[int]]:
    """Prompts that repeat a phrase (the drafter finds guesses in them), of mixed lengths."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        phrase = [rng.randrange(5, 400) for _ in range(rng.choice([6, 12, 20]))]
        out.append(phrase * rng.choice([2, 3, 5]) + phrase[:rng.randrange(1, len(phrase))])
    return out


def run(llm: LLM, prompts, params) -> list[list[int]]:
    return [r.token_ids for r in llm.generate(prompts, params)]


@pytest.fixture(scope="module")
def engines(llama_dir):
    return LLM(llama_dir, **ENGINE), LLM(llama_dir, **ENGINE, **SPEC)


def draft_settings(model_factory, llama_dir, which: str) -> dict:
    """`self`: the target as its own draft (its guesses all hold under greedy); `small`: a
    one-layer model of other weights with the same tokenizer (its guesses mostly fail)."""
    model = llama_dir if which == "self" else model_factory("llama", num_hidden_layers=1,
                                                            seed=7)
    return dict(speculative_method="draft", speculative_model=model, speculative_tokens=4)


@pytest.fixture(scope="module", params=["ngram", "draft-self", "draft-small"])
def speculating(request, model_factory, llama_dir, engines):
    """(plain engine, speculating engine) for each drafter."""
    if request.param == "ngram":
        return engines
    settings = draft_settings(model_factory, llama_dir, request.param.split("-")[1])
    return engines[0], LLM(llama_dir, **ENGINE, **settings)


def looping_prompt(plain: LLM) -> list[int]:
    """A prompt and the model's own greedy continuation of it: a random-weight model's greedy
    output falls into a short cycle within ~60 tokens, so decoding on from there repeats what
    the context holds and guesses get accepted."""
    seed = [11, 42, 97, 5, 300, 17]
    return seed + run(plain, [seed], SamplingParams(max_tokens=60, temperature=0,
                                                    ignore_eos=True))[0]


@pytest.mark.parametrize("batched", [False, True])
def test_greedy_speculation_equals_plain_decoding(speculating, batched):
    plain, spec = speculating
    prompts = repetitive_prompts(6) + [looping_prompt(plain)]
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    before = dict(spec.engine.speculator.stats.__dict__)
    if batched:
        expected, got = run(plain, prompts, params), run(spec, prompts, params)
    else:
        expected = [run(plain, [p], params)[0] for p in prompts]
        got = [run(spec, [p], params)[0] for p in prompts]
    assert got == expected
    stats = spec.engine.speculator.stats
    assert stats.drafted > before["drafted"]
    config = spec.engine.config
    if config.speculative_method == "ngram" or config.speculative_model == config.model:
        assert stats.accepted > before["accepted"]  # guesses that hold, kept
    else:  # the small draft's guesses mostly fail: the rejection path, rolled back
        assert stats.drafted - before["drafted"] > stats.accepted - before["accepted"]
    assert spec.engine.block_manager.num_free_blocks == spec.engine.block_manager.num_blocks
    draft = spec.engine.speculator.draft_model
    if draft is not None:  # the draft's mirrors go with their requests (at the next step)
        spec.generate([[5, 6, 7]], SamplingParams(max_tokens=1))
        assert not draft.mirrors and draft.blocks.num_free_blocks == draft.blocks.num_blocks


@pytest.mark.parametrize("sampling", [dict(temperature=1.0), dict(temperature=1.0, top_k=5),
                                      dict(temperature=0.8, top_p=0.9),
                                      dict(temperature=1.0, repetition_penalty=1.3,
                                           presence_penalty=0.5)])
def test_seeded_sampling_with_speculation_equals_plain(speculating, sampling):
    """A seeded request draws each emitted token with the same noise as plain decoding (the
    generator is put back after a rejection), so the tokens are the same ones."""
    plain, spec = speculating
    prompts = repetitive_prompts(4, seed=3) + [looping_prompt(plain)]
    params = [SamplingParams(max_tokens=32, seed=100 + i, ignore_eos=True, **sampling)
              for i in range(len(prompts))]
    before = spec.engine.speculator.stats.drafted
    assert run(spec, prompts, params) == run(plain, prompts, params)
    assert spec.engine.speculator.stats.drafted > before


def test_banned_and_allowed_tokens_with_speculation_equal_plain(speculating):
    """vLLM's bad_words and allowed_token_ids under speculation: each draft row is judged on
    the output up to its own position, so the tokens equal plain decoding alone (greedy and
    seeded), no banned spelling appears and every token is an allowed one."""
    plain, spec = speculating
    loop = looping_prompt(plain)
    prompts = repetitive_prompts(4, seed=3) + [loop]
    cycle = loop[-8:]
    bad = [[cycle[0], cycle[1]], [cycle[3]]]
    allowed = sorted(set(loop) | set(range(5, 40)))
    params = [SamplingParams(max_tokens=32, seed=100 + i, temperature=float(i % 2),
                             ignore_eos=True, bad_words_token_ids=bad,
                             allowed_token_ids=allowed if i != 4 else None)
              for i in range(len(prompts))]
    before = spec.engine.speculator.stats.drafted
    expected = [run(plain, [p], q)[0] for p, q in zip(prompts, params)]
    got = run(spec, prompts, params)
    assert got == expected
    assert spec.engine.speculator.stats.drafted > before
    for i, tokens in enumerate(got):
        assert cycle[3] not in tokens
        assert all(tokens[j:j + 2] != bad[0] for j in range(len(tokens)))
        assert i == 4 or set(tokens) <= set(allowed)


@pytest.mark.parametrize("drafter", ["ngram", "draft-small"])
def test_speculation_on_the_decode_side_of_a_disaggregated_request(llama_dir, engines,
                                                                   model_factory, drafter):
    """The decode worker speculates once the KV has arrived; tokens and text equal colocated
    plain decoding."""
    plain, _ = engines
    prefill = LLM(llama_dir, **ENGINE).engine
    settings = SPEC if drafter == "ngram" else draft_settings(model_factory, llama_dir, "small")
    decode = LLM(llama_dir, **ENGINE, **settings).engine
    prompts = repetitive_prompts(4, seed=5) + [looping_prompt(plain)]
    params = [SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)] * 3 + \
        [SamplingParams(max_tokens=30, seed=9 + i, temperature=1.0, ignore_eos=True)
         for i in range(2)]
    texts = {}
    got = disaggregated(prefill, decode, [(f"r{i}", p) for i, p in enumerate(prompts)], params,
                        texts)
    expected = plain.generate(prompts, params)
    assert [got[f"r{i}"] for i in range(len(prompts))] == [r.token_ids for r in expected]
    assert [texts[f"r{i}"] for i in range(len(prompts))] == [r.text for r in expected]
    assert decode.speculator.stats.drafted > 0
    assert decode.block_manager.num_free_blocks == decode.block_manager.num_blocks
    assert prefill.block_manager.num_free_blocks == prefill.block_manager.num_blocks


def test_streamed_chunks_carry_every_accepted_token(engines):
    """A step that keeps several tokens streams them as one output with all of their ids and
    text; max_tokens cuts the guesses where plain decoding stops."""
    plain, spec = engines
    prompt = looping_prompt(plain)
    for max_tokens in (1, 2, 11):
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        full = plain.generate([prompt], params)[0]
        engine = spec.engine
        engine.add_request(f"s{max_tokens}", prompt, params)
        tokens, text, chunks = [], "", []
        while engine.has_unfinished_requests():
            for out in engine.step():
                tokens += out.new_token_ids
                text += out.new_text
                chunks.append(len(out.new_token_ids))
        assert tokens == full.token_ids and text == full.text
        assert sum(chunks) == max_tokens
    assert max(chunks) > 1  # some step kept more than one token


# ---------------------------------------------------------------------------------- distribution
def chi_square_p(observed: list[int], expected_probs: list[float]) -> float:
    """p-value of Pearson's chi-square test (bins with expected >= 5)."""
    n = sum(observed)
    stat, dof = 0.0, -1
    for o, p in zip(observed, expected_probs):
        e = n * p
        stat += (o - e) ** 2 / e
        dof += 1
    # Survival function of chi-square via the regularized upper gamma (series for small dof).
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64),
                                         torch.tensor(stat / 2.0, dtype=torch.float64)))


@pytest.mark.parametrize("sampling", [dict(temperature=1.0), dict(temperature=1.0, top_k=3),
                                      dict(temperature=1.0, top_p=0.8)])
def test_the_acceptance_rule_keeps_the_target_distribution(sampling):
    """The rule as the engine runs it (the sampler's draws at each drafted position, then the
    kept prefix): over many unseeded draws on a 6-token vocabulary, the first emitted token
    follows p0 and, where the first draft was kept, the second follows p1; a rejected draft
    leaves a token from p0 without it."""
    from types import SimpleNamespace

    from pd_runtime.engine.spec_decode.speculative import Speculator

    torch.manual_seed(0)
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.2, -0.5, 0.0], [0.1, 1.2, 0.3, 2.0, -1.0, 0.8]])
    drafts = [1, 3]  # proposed after the last token; row 0 checks draft 0, row 1 draft 1
    params = SamplingParams(**sampling)
    sampler = Sampler(seed=1234)
    target = [sampler._filtered_probs(row[None].clone(), [params])[0].tolist()
              for row in logits]
    full = torch.cat([logits, logits[1:]])  # row 2: the bonus position, as row 1 here
    speculator = Speculator(SimpleNamespace(speculative_tokens=2, speculative_ngram_max=2,
                                            speculative_ngram_min=1))

    class Req:
        lookup = LookupState()

    first, second, rejected = [0] * 6, [0] * 6, [0] * 6
    trials = 6000
    for _ in range(trials):
        result = sampler(full, [params] * 3, [None] * 3)
        kept = speculator.verify(Req, drafts, result.token_ids)
        first[kept[0]] += 1
        if kept[0] == drafts[0]:
            second[kept[1]] += 1
        else:
            rejected[kept[0]] += 1

    def check(counts, probs):
        bins = [(c, p) for c, p in zip(counts, probs) if p * sum(counts) >= 5]
        rest = (sum(counts) - sum(c for c, _ in bins), 1 - sum(p for _, p in bins))
        if rest[1] * sum(counts) >= 5:
            bins.append(rest)
        else:
            assert rest[0] <= max(5, 0.01 * sum(counts))
        if len(bins) < 2:
            return
        assert chi_square_p([c for c, _ in bins], [p for _, p in bins]) > 1e-3

    check(first, target[0])
    check(second, target[1])
    without = [0.0 if i == drafts[0] else p for i, p in enumerate(target[0])]
    check(rejected, [p / sum(without) for p in without])
    assert speculator.stats.accepted > 0 and math.isfinite(speculator.stats.report()[
        "tokens_per_verification"])


# ---------------------------------------------------------------------------------- served
def test_served_through_the_router_with_the_openai_client(llama_dir, engines):
    """A prefill + decode pair whose decode worker speculates, behind the router over HTTP:
    short prompts colocated, long ones disaggregated; the official client's completions,
    streamed or not, equal plain decoding's text, and /metrics shows the acceptance."""
    import httpx
    import openai

    from pd_runtime.config import RouterConfig
    from tests.pool_support import pair_config, served

    plain, _ = engines
    # The first is long (disaggregated: 66 tokens, nothing cached yet), the second short.
    prompts = [looping_prompt(plain), [5, 9, 7] * 5] + repetitive_prompts(2, seed=8)
    router = RouterConfig(routing={"mode": "auto", "max_local_prefill_tokens": 32})
    engine = {"dtype": "float32", "num_kv_blocks": 256, "num_threads": 1, "warmup_tokens": 0}
    cfg = pair_config(llama_dir, engine, router=router.model_dump(),
                      recovery={"health_check_interval_s": 0.3})
    cfg.decode.engine = cfg.decode.engine.model_copy(update=SPEC)
    expected = [o.text for o in plain.generate(
        prompts, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))]
    with served(cfg, llama_dir, router) as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
        got, streamed, chunks = [], [], []
        for prompt in prompts:
            kwargs = dict(model=client.models.list().data[0].id, prompt=prompt,
                          max_tokens=24, temperature=0, extra_body={"ignore_eos": True})
            got.append(client.completions.create(**kwargs).choices[0].text)
            text = ""
            for event in client.completions.create(stream=True, **kwargs):
                if event.choices:
                    text += event.choices[0].text
                    chunks.append(event.choices[0].text)
            streamed.append(text)
        deadline = time.monotonic() + 10  # load reports come with health checks
        while True:
            metrics = httpx.get(base + "/metrics").text
            if _accepted(metrics) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        decisions = [line for line in metrics.splitlines()
                     if line.startswith("pd_routing_decisions_total")]
    assert got == expected and streamed == expected
    assert any('path="disaggregated"' in d for d in decisions), decisions
    assert any('path="colocated"' in d for d in decisions)
    assert _accepted(metrics) > 0


def _accepted(metrics: str) -> float:
    lines = [line for line in metrics.splitlines() if line.startswith(
        'pd_worker_speculative_tokens{kind="accepted_tokens",worker="decode-0"}')]
    return float(lines[0].split()[-1]) if lines else 0.0


def test_a_draft_model_must_share_the_tokenizer(llama_dir, model_factory):
    from pd_runtime.config import EngineConfig

    with pytest.raises(ValueError, match="speculative_model"):
        EngineConfig(model=llama_dir, speculative_method="draft")
    other = model_factory("llama", tokenizer_vocab_size=300)
    with pytest.raises(ValueError, match="tokenizer differs"):
        LLM(llama_dir, **ENGINE, speculative_method="draft", speculative_model=other)


def test_speculation_under_preemption_equals_plain(llama_dir, engines):
    """Few KV blocks: requests are preempted and recomputed mid-output while guessing (guesses
    never preempt anyone themselves); greedy tokens still equal plain decoding's, every block
    comes back."""
    plain, _ = engines
    small = dict(ENGINE, num_kv_blocks=24)
    spec = LLM(llama_dir, **small, **SPEC)
    prompts = [looping_prompt(plain)] + repetitive_prompts(5, seed=11)
    params = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    assert run(spec, prompts, params) == run(plain, prompts, params)
    engine = spec.engine
    assert engine.scheduler.num_preemptions > 0 and engine.speculator.stats.accepted > 0
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
