"""Mixture-of-experts models (Mixtral, Qwen3-MoE, Qwen2-MoE, gpt-oss) in the engine: a token's experts and their
sums do not depend on its company, so outputs stay bit-identical alone, batched and chunked, in
bfloat16 as in float32 (against transformers: tests/test_model_vs_transformers.py)."""

from __future__ import annotations

import pytest

from pd_runtime import LLM
from tests.test_batch_invariance import GREEDY, outputs, prompts, seeded


@pytest.fixture(scope="module", params=["mixtral", "qwen3_moe", "qwen2_moe", "gpt_oss",
                                        "olmoe", "granitemoe"])
def moe_model(request, model_factory):
    # head_dim 64; 8 experts, 2 (Mixtral) or 3 (Qwen3-MoE, its first layer dense) per token;
    # gpt-oss 4 per token, a window of 70 on its first layer, sinks in both
    extra = {"mixtral": {}, "gpt_oss": {"sliding_window": 70}, "olmoe": {},
             "granitemoe": {"embedding_multiplier": 4.0, "residual_multiplier": 0.5}}.get(
        request.param, {"num_experts_per_tok": 3, "mlp_only_layers": [0]})
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


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "qwen2_moe", "gpt_oss", "olmoe",
                                    "granitemoe"])
def test_an_expert_block_is_transformers_bit_for_bit_in_bfloat16(model_factory, family):
    """The router's weights kept in float32 (Mixtral) or cast to bf16 (Qwen, gpt-oss) before
    they scale an expert's output: in float32 both read alike, in bf16 each matches only its
    own (gpt-oss: its expert biases added to the rounded products)."""
    import torch
    from transformers import AutoModelForCausalLM

    from pd_runtime.model.loader import load_model

    # 16 experts, 8 a token (OLMoE's and Granite MoE's releases pick 8): the weights' rounding
    # shows over thousands of rows
    experts = {"gpt_oss": "num_local_experts", "mixtral": "num_local_experts",
               "granitemoe": "num_local_experts"}.get(family, "num_experts")
    path = model_factory(family, hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=256, num_experts_per_tok=8, **{experts: 16})
    ours = load_model(path, dtype="bfloat16")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    x = torch.randn(2000, 256, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    if family == "gpt_oss" and _bf16_matmul_sums_by_layout():
        # gpt-oss's experts multiply `x @ w` by the checkpoint's [hidden, out] weights, ours
        # `F.linear` by [out, hidden] ones (every family's layout). Where torch's bf16 GEMM is
        # oneDNN's (AVX-512 CPUs) both layouts sum alike; elsewhere (an AVX2-only EPYC) torch's
        # own GEMM loops sum them in different float32 orders, and ~1 product in 10,000
        # rounds one ulp apart: neither is wrong. There transformers runs on the same numbers
        # laid out as ours (a strided view: the same kernel as our F.linear); routing, biases,
        # clamp and sum are still compared bit for bit.
        for decoder in hf.model.layers:
            for w in (decoder.mlp.experts.gate_up_proj, decoder.mlp.experts.down_proj):
                w.data = w.data.transpose(1, 2).contiguous().transpose(1, 2)
    for index in (0, 1):
        with torch.no_grad():
            layer = hf.model.layers[index]  # (GraniteMoE's block: block_sparse_moe)
            block = layer.mlp if hasattr(layer, "mlp") else layer.block_sparse_moe
            out = block(x[None])  # (gpt-oss's: with its router scores)
        want = (out[0] if isinstance(out, tuple) else out)[0]
        assert torch.equal(ours._experts(ours.layers[index], ours.packed[index], x), want), \
            (family, index)


def _bf16_matmul_sums_by_layout() -> bool:
    """Whether this CPU's bf16 `a @ b` and `F.linear(a, b.T contiguous)` can round apart."""
    import torch
    import torch.nn.functional as F

    gen = torch.Generator().manual_seed(0)
    a, b = (torch.randn(rows, 256, generator=gen).to(torch.bfloat16) for rows in (300, 256))
    return not torch.equal(a @ b, F.linear(a, b.t().contiguous()))


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


def test_a_hub_gpt_oss_config_reads_as_transformers_reads_it(tmp_path):
    """gpt-oss-20b's config.json as the Hub ships it (rope_theta and rope_scaling, no
    layer_types, experts_per_token beside num_experts_per_tok), and the same file stripped to
    what the config class supplies: the fields transformers' GptOssConfig reads."""
    import json

    from transformers import GptOssConfig

    from pd_runtime.model.model_config import load_model_config

    hub = {"architectures": ["GptOssForCausalLM"], "attention_bias": True, "head_dim": 64,
           "experts_per_token": 4, "hidden_act": "silu", "hidden_size": 2880,
           "initial_context_length": 4096, "intermediate_size": 2880,
           "max_position_embeddings": 131072, "model_type": "gpt_oss",
           "num_attention_heads": 64, "num_experts_per_tok": 4, "num_hidden_layers": 24,
           "num_key_value_heads": 8, "num_local_experts": 32, "rms_norm_eps": 1e-05,
           "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                            "original_max_position_embeddings": 4096, "rope_type": "yarn",
                            "truncate": False},
           "rope_theta": 150000, "sliding_window": 128, "swiglu_limit": 7.0,
           "tie_word_embeddings": False, "vocab_size": 201088}
    bare = {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss"}
    for raw in (hub, bare):
        (tmp_path / "config.json").write_text(json.dumps(raw))
        ours = load_model_config(tmp_path)
        theirs = GptOssConfig(**{k: v for k, v in raw.items() if k != "architectures"})
        sliding = tuple(i for i, t in enumerate(theirs.layer_types) if t == "sliding_attention")
        rope = theirs.rope_parameters
        assert (ours.num_layers, ours.num_experts, ours.experts_per_token, ours.sliding_window,
                ours.window_layers, ours.head_dim, ours.num_kv_heads, ours.vocab_size) == \
            (theirs.num_hidden_layers, theirs.num_local_experts, theirs.num_experts_per_tok,
             theirs.sliding_window, sliding, theirs.head_dim, theirs.num_key_value_heads,
             theirs.vocab_size)
        assert (ours.rope.rope_type, ours.rope.theta, ours.rope.factor, ours.rope.truncate,
                ours.rope.original_max_position_embeddings) == \
            (rope["rope_type"], rope["rope_theta"], rope["factor"], rope["truncate"],
             rope["original_max_position_embeddings"])
        assert ours.attn_sinks and ours.qkv_bias and ours.o_bias and not ours.tie_word_embeddings
        assert (ours.swiglu_alpha, ours.swiglu_limit) == (theirs.swiglu_alpha,
                                                          theirs.swiglu_limit)
        assert ours.torch_dtype == "bfloat16"  # (named by neither: its weights are bf16)
    (tmp_path / "config.json").write_text(json.dumps({**bare, "num_experts": 32}))
    assert load_model_config(tmp_path).num_experts == GptOssConfig(num_experts=32) \
        .num_local_experts == 32  # the alias, as transformers maps it


def test_mxfp4_is_read_for_gpt_oss_only(model_factory, tmp_path):
    """MXFP4 experts load for gpt-oss (tests/test_model_vs_transformers.py checks their
    values); rows MXFP4's groups of 32 do not divide, or another family's quantized
    checkpoint, are refused naming why."""
    import json
    import shutil

    from pd_runtime.api import ModelLoadError
    from pd_runtime.model.loader import load_model

    quant = {"quant_method": "mxfp4"}
    for family, extra, match in (("gpt_oss", {"hidden_size": 48, "num_attention_heads": 3,
                                              "num_key_value_heads": 1},
                                  "groups of 32 do not divide its rows of 48"),
                                 ("mixtral", {}, "quantized checkpoints are not supported")):
        path = tmp_path / family
        shutil.copytree(model_factory(family, **extra), path)
        raw = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps({**raw, "quantization_config": quant}))
        with pytest.raises(ModelLoadError, match=match):
            load_model(path, dtype="float32")


def test_olmoe_clip_qkv_is_refused_naming_it(model_factory, tmp_path):
    import json
    import shutil

    from pd_runtime.api import ModelLoadError
    from pd_runtime.model.model_config import load_model_config

    path = tmp_path / "olmoe"
    shutil.copytree(model_factory("olmoe"), path)
    raw = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**raw, "clip_qkv": 8.0}))
    with pytest.raises(ModelLoadError, match="clip_qkv 8.0 is not supported"):
        load_model_config(path)

