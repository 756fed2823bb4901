"""Mixture-of-experts models (Mixtral, Qwen3-MoE, Qwen2-MoE) in the engine: a token's experts and their
sums do not depend on its company, so outputs stay bit-identical alone, batched and chunked, in
bfloat16 as in float32 (against transformers: tests/test_model_vs_transformers.py)."""

from __future__ import annotations

import pytest

from pd_runtime import LLM
from tests.test_batch_invariance import GREEDY, outputs, prompts, seeded


@pytest.fixture(scope="module", params=["mixtral", "qwen3_moe", "qwen2_moe"])
def moe_model(request, model_factory):
    # head_dim 64; 8 experts, 2 (Mixtral) or 3 (Qwen3-MoE, its first layer dense) per token
    extra = {"num_experts_per_tok": 3, "mlp_only_layers": [0]} \
        if request.param != "mixtral" else {}
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


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "qwen2_moe"])
def test_an_expert_block_is_transformers_bit_for_bit_in_bfloat16(model_factory, family):
    """The router's weights kept in float32 (Mixtral) or cast to bf16 (Qwen) before they scale
    an expert's output: in float32 both read alike, in bf16 each matches only its own."""
    import torch
    from transformers import AutoModelForCausalLM

    from pd_runtime.model.loader import load_model

    path = model_factory(family, hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=256, num_experts_per_tok=2)
    ours = load_model(path, dtype="bfloat16")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    x = torch.randn(97, 256, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    for index in (0, 1):
        with torch.no_grad():
            want = hf.model.layers[index].mlp(x[None])[0]
        assert torch.equal(ours._experts(ours.layers[index], ours.packed[index], x), want), \
            (family, index)


def test_expert_config_defaults_are_the_config_classes(model_factory, tmp_path):
    """What a hand-written config leaves out reads as transformers' classes read it."""
    import json
    import shutil

    from pd_runtime.model.model_config import load_model_config

    for family, drop, check in (
            ("qwen3_moe", ("num_experts_per_tok",), lambda c: c.experts_per_token == 8),
            ("mixtral", ("rope_parameters", "rope_theta", "rope_scaling"),
             lambda c: c.rope.theta == 1e6)):
        path = tmp_path / family
        shutil.copytree(model_factory(family), path)
        raw = json.loads((path / "config.json").read_text())
        for key in drop:
            raw.pop(key, None)
        (path / "config.json").write_text(json.dumps(raw))
        assert check(load_model_config(path)), family
    raw = json.loads((path / "config.json").read_text())  # Mixtral's num_experts alias
    raw["num_experts"] = raw.pop("num_local_experts")
    (path / "config.json").write_text(json.dumps(raw))
    assert load_model_config(path).num_experts == 8
    qwen = tmp_path / "qwen3_moe"
    raw = json.loads((qwen / "config.json").read_text())
    raw.update(use_sliding_window=True, sliding_window=64, max_window_layers=2)
    (qwen / "config.json").write_text(json.dumps(raw))
    assert load_model_config(qwen).sliding_window == 64  # every layer: no max_window_layers


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_a_disaggregated_expert_model_equals_colocated(moe_model, dtype):
    """The prompt's KV computed by a prefill engine and decoded by another (the engines'
    disaggregation hooks, as tests/test_disaggregated_engine.py drives them): the same tokens
    and text as one engine, greedy and seeded."""
    from tests.test_disaggregated_engine import GREEDY as SHORT, disaggregated
    from tests.test_disaggregated_engine import prompts as short_prompts
    from tests.test_disaggregated_engine import seeded as short_seeded

    prefill = LLM(moe_model, dtype=dtype, num_kv_blocks=128).engine
    decode = LLM(moe_model, dtype=dtype, num_kv_blocks=128).engine
    colocated = LLM(moe_model, dtype=dtype, num_kv_blocks=128)
    ps = short_prompts()
    for params in ([SHORT] * len(ps), [short_seeded(i) for i in range(len(ps))]):
        want = colocated.generate(ps, params)
        items = [(f"r{i}-{params[0].seed}", p) for i, p in enumerate(ps)]
        texts = {}
        got = disaggregated(prefill, decode, items, params, texts)
        assert [got[rid] for rid, _ in items] == [o.token_ids for o in want]
        assert [texts[rid] for rid, _ in items] == [o.text for o in want]
    assert prefill.block_manager.num_free_blocks == decode.block_manager.num_free_blocks == 128
