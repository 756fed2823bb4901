"""In the batch-invariant mode (EngineConfig.batch_invariant, on by default), a request's tokens,
text and logprobs are bit-identical alone, in a batch, chunked, after a prefix-cache hit and
after preemption, in bfloat16 as in float32. Prompts span several blocks; the logprobs (float32,
compared exactly) show any rounding difference in the logits even where no token flips."""

from __future__ import annotations

import random

import pytest

from pd_runtime import LLM, SamplingParams

LENGTHS = (300, 211, 57, 340, 129, 5)
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=2)


def seeded(i: int) -> SamplingParams:
    return SamplingParams(max_tokens=24, temperature=1.5, top_p=0.95, seed=500 + i,
                          ignore_eos=True, logprobs=2)


def prompts(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, 500) for _ in range(n)] for n in LENGTHS]


def outputs(results) -> list[tuple]:
    return [(r.token_ids, r.text, r.logprobs) for r in results]


@pytest.fixture(scope="module", params=["llama", "qwen3", "mistral-window", "gemma3", "gemma2",
                                        "gemma", "olmo2", "olmo3", "glm4", "cohere2"])
def model(request, model_factory):
    # head_dim 64 and two query heads per KV head: the shapes the native kernels specialise;
    # Qwen3 for its q/k norms (whose bf16 rows once depended on the batch); a sliding window
    # shorter than most prompts (chunks and cached prefixes then start before it)
    family, extra = {"mistral-window": ("mistral", {"sliding_window": 70}),
                     "gemma3": ("gemma3", {"sliding_window": 70, "layer_types": [
                         "sliding_attention", "full_attention"]}),
                     "gemma2": ("gemma2", {"sliding_window": 70, "attn_logit_softcapping": 2.0,
                                           "final_logit_softcapping": 3.0}),
                     "olmo3": ("olmo3", {"sliding_window": 70, "layer_types": [
                         "sliding_attention", "full_attention"]}),
                     "cohere2": ("cohere2", {"sliding_window": 70, "layer_types": [
                         "sliding_attention", "full_attention"]})}.get(
        request.param, (request.param, {}))
    return model_factory(family, hidden_size=256, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=512, **extra)


@pytest.fixture(scope="module", params=["bfloat16", "float32"])
def alone(request, model):
    """Each prompt run by itself, greedy and seeded, on one engine."""
    dtype = request.param
    llm = LLM(model, dtype=dtype, num_kv_blocks=512, batch_invariant=True)
    greedy = [outputs(llm.generate([p], GREEDY))[0] for p in prompts()]
    sampled = [outputs(llm.generate([p], seeded(i)))[0] for i, p in enumerate(prompts())]
    return dtype, greedy, sampled


def check_all(llm: LLM, alone) -> None:
    _, greedy, sampled = alone
    batch = prompts()
    assert outputs(llm.generate(batch, GREEDY)) == greedy
    assert outputs(llm.generate(batch, [seeded(i) for i in range(len(batch))])) == sampled


def test_batched_with_prompts_of_other_lengths(model, alone):
    llm = LLM(model, dtype=alone[0], num_kv_blocks=512, batch_invariant=True)
    check_all(llm, alone)


def test_chunked_prefill(model, alone):
    # 40-token chunks: boundaries fall mid-block, decodes share steps with chunks
    llm = LLM(model, dtype=alone[0], num_kv_blocks=512, max_num_batched_tokens=40,
              batch_invariant=True)
    check_all(llm, alone)


def test_preempted_and_recomputed(model, alone):
    llm = LLM(model, dtype=alone[0], num_kv_blocks=40, batch_invariant=True)
    check_all(llm, alone)
    assert llm.engine.scheduler.num_preemptions > 0, "setup must actually preempt"
    assert llm.engine.block_manager.num_free_blocks == 40


def test_prefix_cache_hit(model, alone):
    dtype = alone[0]
    first = prompts()[0]
    # 16 full blocks in common with `first`, then tails of 7 and 33 tokens
    shared = [first[:256] + list(range(7, 14)), first[:256] + list(range(40, 73))]
    params = [GREEDY, seeded(0)]
    cold = LLM(model, dtype=dtype, num_kv_blocks=512, enable_prefix_caching=False,
               batch_invariant=True)
    expected = [outputs(cold.generate([p], sp))[0] for p in shared for sp in params]
    warm = LLM(model, dtype=dtype, num_kv_blocks=512, batch_invariant=True)
    warm.generate([first], GREEDY)
    got = []
    for p in shared:
        for sp in params:
            out = warm.generate([p], sp)[0]
            assert out.num_cached_tokens >= 256
            got.append(outputs([out])[0])
    assert got == expected
