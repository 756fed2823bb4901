"""Mixture-of-experts models (Mixtral, Qwen3-MoE) in the engine: a token's experts and their
sums do not depend on its company, so outputs stay bit-identical alone, batched and chunked, in
bfloat16 as in float32 (against transformers: tests/test_model_vs_transformers.py)."""

from __future__ import annotations

import pytest

from pd_runtime import LLM
from tests.test_batch_invariance import GREEDY, outputs, prompts, seeded


@pytest.fixture(scope="module", params=["mixtral", "qwen3_moe"])
def moe_model(request, model_factory):
    # head_dim 64; 8 experts, 2 (Mixtral) or 3 (Qwen3-MoE, its first layer dense) per token
    extra = {"num_experts_per_tok": 3, "mlp_only_layers": [0]} \
        if request.param == "qwen3_moe" else {}
    return model_factory(request.param, hidden_size=256, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=256, **extra)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_experts_give_the_same_tokens_alone_batched_and_chunked(moe_model, dtype):
    llm = LLM(moe_model, dtype=dtype, num_kv_blocks=512)
    assert llm.engine.model_config.num_experts == 8
    greedy = [outputs(llm.generate([p], GREEDY))[0] for p in prompts()]
    sampled = [outputs(llm.generate([p], seeded(i)))[0] for i, p in enumerate(prompts())]
    chunked = LLM(moe_model, dtype=dtype, num_kv_blocks=512, max_num_batched_tokens=64,
                  enable_prefix_caching=False)
    for engine in (llm, chunked):
        batch = prompts()
        assert outputs(engine.generate(batch, GREEDY)) == greedy
        assert outputs(engine.generate(batch, [seeded(i) for i in range(len(batch))])) == \
            sampled
