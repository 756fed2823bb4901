"""The 8-bit KV cache (`kv_cache_dtype: int8`, pd_runtime/kernels/kv_quant.py): logits close to the 16-bit
cache's on the four architectures, the same tokens disaggregated as colocated, fewer bytes
shipped per request in the ratio the row layout says, and the pools made to agree."""

from __future__ import annotations

import asyncio
import random

import pytest

from pd_runtime import LLM, SamplingParams
from pd_runtime.config import ClusterConfig, EngineConfig
from tests.pool_support import pair_config

# Largest |logit difference| against the bf16 cache, in units of the logits' standard
# deviation, at every step until the greedy outputs part (measured 0.028-0.040 on the four
# test models).
TOLERANCE = 0.06


def _capture(llm: LLM) -> list:
    engine, logits = llm.engine, []
    sample = engine._sample

    def recording(rows, sampled):
        logits.append(rows[-1].float().clone())
        return sample(rows, sampled)

    engine._sample = recording
    return logits


@pytest.mark.parametrize("architecture", ["llama", "mistral", "qwen2", "qwen3"])
def test_logits_stay_close_to_the_16_bit_cache(model_factory, architecture):
    model = model_factory(architecture)
    prompt = [random.Random(1).randrange(5, 400) for _ in range(100)]
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    base = LLM(model, dtype="bfloat16", warmup_tokens=0, num_threads=1)
    eight = LLM(model, dtype="bfloat16", warmup_tokens=0, num_threads=1, kv_cache_dtype="int8")
    assert eight.engine.runner.kv_cache.element_size() == 1
    want, got = _capture(base), _capture(eight)
    x = base.generate([prompt], params)[0].token_ids
    y = eight.generate([prompt], params)[0].token_ids
    same = next((i for i in range(len(x)) if x[i] != y[i]), len(x))
    for step, (a, b) in enumerate(zip(want[:same + 1], got[:same + 1])):
        assert (a - b).abs().max() <= TOLERANCE * a.std(), (architecture, step)


def _bytes_and_tokens(model: str, kv_cache_dtype: str, prompts) -> tuple:
    from pd_runtime.workers.local_pool import LocalPool

    engine = {"dtype": "bfloat16", "num_kv_blocks": 256, "num_threads": 1, "warmup_tokens": 0,
              "kv_cache_dtype": kv_cache_dtype}
    pool = LocalPool(pair_config(model, engine), model)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)

    async def one(i, prompt, disaggregate):
        tokens = []
        async for chunk in pool.generate(f"r{i}-{disaggregate}", prompt, params,
                                         disaggregate=disaggregate):
            assert chunk.error is None, chunk.error
            tokens += chunk.token_ids
        return tokens

    async def run():
        remote = [await one(i, p, True) for i, p in enumerate(prompts)]
        local = [await one(i, p, False) for i, p in enumerate(prompts)]
        return remote, local

    try:
        remote, local = asyncio.run(run())
        sent = pool.worker("prefill-0").agent.metrics()["bytes_sent"]
        head_dim = pool.worker("decode-0").engine.model_config.head_dim
    finally:
        pool.close()
    return sent, remote, local, head_dim


def test_disaggregated_equals_colocated_and_ships_fewer_bytes(llama_dir):
    """Both sides store the same int8 rows, so a disaggregated request decodes from exactly
    the KV a colocated one computes; the prefill worker ships (head_dim + 4) / (2 x head_dim)
    of the bf16 cache's bytes for the same requests."""
    rng = random.Random(4)
    prompts = [[rng.randrange(5, 400) for _ in range(n)] for n in (20, 48, 90)]
    sent16, remote16, local16, head_dim = _bytes_and_tokens(llama_dir, "auto", prompts)
    sent8, remote8, local8, _ = _bytes_and_tokens(llama_dir, "int8", prompts)
    assert remote16 == local16 and remote8 == local8
    assert sent16 > 0 and sent8 * 2 * head_dim == sent16 * (head_dim + 4)


def test_the_pools_must_agree_and_int8_needs_the_fixed_order_kernel(llama_dir):
    with pytest.raises(ValueError, match="prefill.engine.kv_cache_dtype"):
        ClusterConfig.model_validate({
            "model": llama_dir, "prefill": {"num_workers": 1,
                                            "engine": {"kv_cache_dtype": "int8"}},
            "decode": {"num_workers": 1}})
    with pytest.raises(ValueError, match="batch_invariant"):
        EngineConfig(model=llama_dir, kv_cache_dtype="int8", batch_invariant=False)
    with pytest.raises(ValueError, match="device"):
        EngineConfig(model=llama_dir, kv_cache_dtype="int8", device="cuda")
