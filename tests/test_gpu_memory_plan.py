"""The GPU memory arithmetic of the shipped GPU cluster files (issue 13): weights + KV + side
buffers + activations + CUDA graphs + context fit the GPU each pool names in
`resources.accelerator_type`, computed from the model's config.json (Llama 3.1 8B's, as
published) without its weights."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pd_runtime.config import EngineConfig, ResourcesConfig
from pd_runtime.config_loading import load_cluster_config
from pd_runtime.engine.kv_cache.memory_plan import (GIB, GPU_MEMORY_BYTES, check_fits, plan_memory,
                                           weight_bytes)
from pd_runtime.model.model_config import load_model_config

CONFIGS = Path(__file__).resolve().parent.parent / "cluster_configs"

# Meta-Llama-3.1-8B-Instruct/config.json, the fields the plan reads.
LLAMA_31_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
    "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009],
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
}


@pytest.fixture(scope="module")
def llama_8b(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama-3.1-8b")
    (path / "config.json").write_text(json.dumps(LLAMA_31_8B))
    return load_model_config(path)


def test_weight_count_is_the_published_one(llama_8b):
    assert weight_bytes(llama_8b, 2) == 2 * 8_030_261_248  # 8.03B parameters, bf16


@pytest.mark.parametrize("name", ["gpu-single-node.yaml", "gpu-multi-node.yaml"])
def test_every_gpu_pool_fits_the_gpu_it_names(name, llama_8b):
    config = load_cluster_config(CONFIGS / name)
    pools = [p for p in (config.prefill, config.decode, config.colocated)
             if p is not None and p.num_workers and p.resources.num_gpus]
    assert pools, f"{name} has no GPU pool"
    for pool in pools:
        gpu = pool.resources.accelerator_type
        assert gpu in GPU_MEMORY_BYTES, f"{name}: a GPU pool names no known accelerator_type"
        engine = pool.engine_config(config.model)
        plan = plan_memory(engine, llama_8b, engine.max_model_len, GPU_MEMORY_BYTES[gpu])
        check_fits(plan, GPU_MEMORY_BYTES[gpu], name)  # raises with the table when over
        assert plan.side_buffers == 0  # no second copy of the KV on a GPU
        assert plan.kv_cache <= engine.kv_cache_memory_bytes
        # The KV cache is most of what is left after the weights (the point of the file).
        assert plan.kv_cache > 0.6 * (GPU_MEMORY_BYTES[gpu] - plan.weights)


def test_a_plan_over_the_device_names_the_fields(llama_8b):
    engine = EngineConfig(model="/m", device="cuda", dtype="bfloat16",
                          kv_cache_memory_bytes=70 * GIB, max_model_len=32768)
    plan = plan_memory(engine, llama_8b, 32768)
    with pytest.raises(ValueError, match="kv_cache_memory_bytes") as err:
        check_fits(plan, GPU_MEMORY_BYTES["H100"], "decode")
    assert "GiB over" in str(err.value) and "weights" in str(err.value)
    # The same engine without CUDA graphs and with 60 GiB of KV fits.
    smaller = engine.model_copy(update={"kv_cache_memory_bytes": 60 * GIB})
    check_fits(plan_memory(smaller, llama_8b, 32768), GPU_MEMORY_BYTES["H100"], "decode")


def test_the_cpu_side_buffer_is_counted_where_it_exists(llama_8b):
    engine = EngineConfig(model="/m", dtype="bfloat16", kv_cache_memory_bytes=GIB)
    plan = plan_memory(engine, llama_8b, 8192)
    assert plan.side_buffers == plan.kv_cache and plan.cuda_graphs == 0 and plan.runtime == 0


def test_accelerator_type_reaches_ray():
    res = ResourcesConfig(num_gpus=1, accelerator_type="H100")
    assert res.ray_options()["accelerator_type"] == "H100"
    assert res.bundle()["accelerator_type:H100"] > 0
    with pytest.raises(ValueError, match="accelerator_type"):
        ResourcesConfig(accelerator_type="H100")  # no GPU reserved


def test_gpu_memory_utilization_gives_the_kv_cache_what_the_share_leaves(llama_8b):
    """vLLM's --gpu-memory-utilization: the whole plan comes to the share of the device (to
    within one KV block), the KV cache taking what the rest leaves; more activations, less
    KV; num_kv_blocks still wins; a CPU engine keeps kv_cache_memory_bytes."""
    device = GPU_MEMORY_BYTES["H200"]
    engine = EngineConfig(model="/m", device="cuda", dtype="bfloat16", max_model_len=32768,
                          gpu_memory_utilization=0.9)
    plan = plan_memory(engine, llama_8b, 32768, device)
    block = 2 * 32 * 8 * 128 * 2 * engine.block_size  # K and V, 32 layers, 8 heads, bf16
    assert 0 <= 0.9 * device - plan.total < block
    assert plan.kv_cache > 100 * GIB  # H200: 126 GiB share, 15 GiB of weights
    check_fits(plan, device, "decode")
    wider = engine.model_copy(update={"max_num_batched_tokens": 16384})
    wide_plan = plan_memory(wider, llama_8b, 32768, device)
    assert wide_plan.activations > plan.activations
    assert plan.kv_cache - wide_plan.kv_cache >= wide_plan.activations - plan.activations - block
    assert 0 <= 0.9 * device - wide_plan.total < block
    pinned = engine.model_copy(update={"num_kv_blocks": 1000})
    assert plan_memory(pinned, llama_8b, 32768, device).kv_cache == 1000 * block
    on_cpu = EngineConfig(model="/m", dtype="bfloat16", kv_cache_memory_bytes=GIB,
                          gpu_memory_utilization=0.9)
    assert plan_memory(on_cpu, llama_8b, 8192).kv_cache <= GIB


def test_a_draft_model_takes_its_part_of_the_share(llama_8b, tmp_path):
    """Speculative decoding with a draft model builds a second model, with as many KV blocks
    as the target's, in the same process: the share covers both (a 1B-shaped draft)."""
    from pd_runtime.engine.kv_cache.memory_plan import _draft_bytes

    draft_dir = _written(tmp_path / "draft", {
        **LLAMA_31_8B, "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
        "num_attention_heads": 32, "num_key_value_heads": 8, "tie_word_embeddings": True})
    device = GPU_MEMORY_BYTES["H100"]
    engine = EngineConfig(model="/m", device="cuda", dtype="bfloat16", max_model_len=32768,
                          gpu_memory_utilization=0.9, speculative_method="draft",
                          speculative_model=str(draft_dir))
    plan = plan_memory(engine, llama_8b, 32768, device)
    draft_rest, draft_block = _draft_bytes(engine, 32768)
    block = 2 * 32 * 8 * 128 * 2 * engine.block_size
    assert draft_block == 2 * 16 * 8 * 64 * 2 * engine.block_size  # head_dim 2048 / 32
    assert draft_rest > 2 * GIB  # its 1.2B bf16 weights and activations
    blocks = plan.kv_cache // block
    whole = plan.total + draft_rest + blocks * draft_block
    assert 0 <= 0.9 * device - whole < block + draft_block
    alone = plan_memory(engine.model_copy(update={"speculative_method": None,
                                                  "speculative_model": None}),
                        llama_8b, 32768, device)
    assert alone.kv_cache > plan.kv_cache


def test_a_share_too_small_for_the_weights_names_the_field(llama_8b):
    engine = EngineConfig(model="/m", device="cuda", dtype="bfloat16", max_model_len=32768,
                          gpu_memory_utilization=0.15)
    with pytest.raises(ValueError, match="engine.gpu_memory_utilization: 0.15 of 79.6 GiB") \
            as err:
        plan_memory(engine, llama_8b, 32768, GPU_MEMORY_BYTES["H100"])
    assert "weights" in str(err.value)  # the rest of the plan, as a table
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        EngineConfig(model="/m", gpu_memory_utilization=1.2)


def test_dtype_auto_runs_a_float32_checkpoint_in_half_precision_on_a_gpu(tmp_path):
    """vLLM's `auto`: a float32 checkpoint (or one naming no dtype) runs in bfloat16 on a GPU
    (the Triton kernels take bfloat16 and float16 only: float32 was refused there), while
    the CPU keeps float32 and a dtype asked for by name is kept."""
    import torch

    from pd_runtime.model.loader import resolve_dtype

    for fields in ({"torch_dtype": "float32"}, {}):
        path = tmp_path / str(len(fields))
        path.mkdir()
        raw = {k: v for k, v in LLAMA_31_8B.items() if k != "torch_dtype"}
        (path / "config.json").write_text(json.dumps({**raw, **fields}))
        cfg = load_model_config(path)
        assert resolve_dtype("auto", cfg, "cuda") in (torch.bfloat16, torch.float16)
        assert resolve_dtype("auto", cfg, "cuda:1") in (torch.bfloat16, torch.float16)
        assert resolve_dtype("auto", cfg, "cpu") == torch.float32
        assert resolve_dtype("float32", cfg, "cuda") == torch.float32
    bf16 = load_model_config(_written(tmp_path / "bf16", LLAMA_31_8B))
    assert resolve_dtype("auto", bf16, "cuda") == torch.bfloat16
    assert resolve_dtype("float16", bf16, "cuda") == torch.float16


def _written(path: Path, config: dict) -> Path:
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.mark.parametrize("config, params", [
    # Mixtral-8x7B and Qwen3-30B-A3B as published (their config.json's fields the plan reads)
    ({"architectures": ["MixtralForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336,
      "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
      "vocab_size": 32000, "num_local_experts": 8, "num_experts_per_tok": 2,
      "tie_word_embeddings": False, "torch_dtype": "bfloat16", "rope_theta": 1e6},
     46_702_792_704),
    ({"architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 2048, "intermediate_size": 6144,
      "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4,
      "head_dim": 128, "vocab_size": 151936, "num_experts": 128, "num_experts_per_tok": 8,
      "moe_intermediate_size": 768, "decoder_sparse_step": 1, "mlp_only_layers": [],
      "norm_topk_prob": True, "tie_word_embeddings": False, "torch_dtype": "bfloat16"},
     30_532_122_624),
    ({"architectures": ["Qwen2MoeForCausalLM"], "hidden_size": 2048, "intermediate_size": 5632,
      "num_hidden_layers": 24, "num_attention_heads": 16, "num_key_value_heads": 16,
      "vocab_size": 151936, "num_experts": 60, "num_experts_per_tok": 4,
      "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632,
      "tie_word_embeddings": False, "torch_dtype": "bfloat16"},  # Qwen1.5-MoE-A2.7B: 14.3B
     14_315_784_192),
    ({"architectures": ["GptOssForCausalLM"], "attention_bias": True, "head_dim": 64,
      "hidden_size": 2880, "intermediate_size": 2880, "num_attention_heads": 64,
      "num_experts_per_tok": 4, "num_hidden_layers": 24, "num_key_value_heads": 8,
      "num_local_experts": 32, "sliding_window": 128, "tie_word_embeddings": False,
      "vocab_size": 201088, "quantization_config": {"quant_method": "mxfp4"}},
     20_914_757_184),  # gpt-oss-20b (its MXFP4 experts dequantized: bf16 like the rest)
    ({"architectures": ["Olmo2ForCausalLM"], "hidden_size": 4096, "intermediate_size": 11008,
      "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
      "vocab_size": 100352, "rope_theta": 500000, "tie_word_embeddings": False},
     7_298_617_344),  # OLMo-2-1124-7B: q/k norms over all heads (not experts: the plan's sum)
    ({"architectures": ["OlmoeForCausalLM"], "hidden_size": 2048, "intermediate_size": 1024,
      "num_hidden_layers": 16, "num_attention_heads": 16, "num_key_value_heads": 16,
      "vocab_size": 50304, "num_experts": 64, "num_experts_per_tok": 8, "clip_qkv": None,
      "tie_word_embeddings": False}, 6_919_161_856),  # OLMoE-1B-7B
    ({"architectures": ["GraniteMoeForCausalLM"], "hidden_size": 1024, "intermediate_size": 512,
      "num_hidden_layers": 24, "num_attention_heads": 16, "num_key_value_heads": 8,
      "vocab_size": 49155, "num_local_experts": 32, "num_experts_per_tok": 8,
      "tie_word_embeddings": True}, 1_334_628_352),  # granite-3.0-1b-a400m
    ({"architectures": ["Glm4ForCausalLM"], "attention_bias": True, "head_dim": 128,
      "hidden_size": 4096, "intermediate_size": 13696, "num_attention_heads": 32,
      "num_hidden_layers": 40, "num_key_value_heads": 2, "vocab_size": 151552,
      "tie_word_embeddings": False}, 9_400_279_040),  # GLM-4-9B-0414: four norms a layer
    ({"architectures": ["CohereForCausalLM"], "hidden_size": 8192, "intermediate_size": 22528,
      "num_hidden_layers": 40, "num_attention_heads": 64, "num_key_value_heads": 64,
      "vocab_size": 256000, "use_qk_norm": True},  # Command R's shape, R+'s q/k norms; tied
     34_981_486_592),
    ({"architectures": ["Cohere2ForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336,
      "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
      "vocab_size": 256000}, 8_028_033_024),  # Command R7B: one norm a layer
])
def test_expert_weights_are_counted(tmp_path, config, params):
    cfg = load_model_config(_written(tmp_path / "moe", config))
    assert weight_bytes(cfg, 2) == 2 * params


def test_the_activation_term_covers_a_measured_step(tmp_path):
    """The plan's transient bytes of the largest eager step against what such a step holds at
    its peak, measured: torch's profiler follows every allocation of a 512-token prefill of a
    bfloat16 model on the CPU (the same layers, norms, MLP and sampler as on a GPU; attention
    by the host kernels). A plan below it would let the first long prompt run out of memory."""
    import warnings

    from torch.profiler import ProfilerActivity, profile

    from pd_runtime.api import SamplingParams
    from pd_runtime.engine.llm import LLM
    from pd_runtime.engine.kv_cache.memory_plan import step_activation_bytes
    from pd_runtime.model.tiny import make_tiny_model

    tokens, rows = 512, 4
    path = make_tiny_model(tmp_path / "m", preset="bench", hidden_size=256,
                           intermediate_size=704, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, vocab_size=8000, dtype="bfloat16",
                           tokenizer_vocab_size=8000)
    llm = LLM(str(path), device="cpu", dtype="bfloat16", max_num_seqs=rows,
              max_num_batched_tokens=tokens, kv_cache_memory_bytes=1 << 26,
              enable_prefix_caching=False)
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    llm.generate([[7] * 40], params)  # first-call allocations out of the way
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True,
                 with_stack=True) as prof:
        llm.generate([[(i * 7) % 7000 + 5 for i in range(tokens)]], params)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # (deprecated for CUDA's snapshots)
        prof.export_memory_timeline(str(tmp_path / "timeline.json"), device="cpu")
    _, sizes = json.loads((tmp_path / "timeline.json").read_text())
    totals = [sum(s) for s in sizes]
    peak = max(totals) - totals[0]
    planned = step_activation_bytes(load_model_config(path), 2, tokens, rows)
    assert 0.3 * planned < peak <= planned, (peak, planned)


@pytest.mark.parametrize("overrides", [
    {},
    {"architecture": "olmo3", "sliding_window": 48,  # float32 tables, a second rope
     "layer_types": ["sliding_attention", "full_attention"]},
    {"architecture": "glm4", "head_dim": 64},  # rope over half of each head
])
def test_the_rope_tables_are_counted_as_the_model_holds_them(tmp_path, overrides):
    from pd_runtime.engine.kv_cache.memory_plan import rope_table_bytes
    from pd_runtime.model.loader import load_model
    from pd_runtime.model.tiny import make_tiny_model

    path = make_tiny_model(tmp_path / "m", preset="test", dtype="bfloat16", hidden_size=256,
                           intermediate_size=512, num_attention_heads=4, num_key_value_heads=1,
                           **overrides)
    model = load_model(path, "bfloat16", "cpu", 300)
    tables = [model.cos, model.sin, *(model.local_rope or ())]
    assert rope_table_bytes(model.cfg, 2, 300) == sum(t.nbytes for t in tables)


# Mixtral-8x7B-Instruct-v0.1/config.json, the fields the plan reads.
MIXTRAL_8X7B = {
    "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
    "num_key_value_heads": 8, "vocab_size": 32000, "max_position_embeddings": 32768,
    "num_local_experts": 8, "num_experts_per_tok": 2, "rms_norm_eps": 1e-5,
    "rope_theta": 1e6, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "bos_token_id": 1, "eos_token_id": 2,
}


@pytest.mark.parametrize("ranks", [1, 2, 4])
def test_a_rank_plans_its_part_of_the_weights_experts_included(ranks, llama_8b, tmp_path):
    """At tensor_parallel_size t each rank holds 1/t of the layers' weights (a mixture of
    experts: E/t experts whole) beside the whole embedding and LM head, and the KV cache of
    gpu_memory_utilization is what that rank's plan leaves: Mixtral-8x7B (93 GiB of bf16
    weights) cannot start on one H100 and can on two or four."""
    (tmp_path / "config.json").write_text(json.dumps(MIXTRAL_8X7B))
    mixtral = load_model_config(tmp_path)
    device = GPU_MEMORY_BYTES["H100"]
    engine = EngineConfig(model="/m", device="cuda", dtype="bfloat16", max_model_len=8192,
                          gpu_memory_utilization=0.9, tensor_parallel_size=ranks)
    embed_and_head = 2 * 2 * 32000 * 4096
    layers = weight_bytes(mixtral, 2) - embed_and_head
    if ranks == 1:
        with pytest.raises(ValueError, match="gpu_memory_utilization"):
            plan_memory(engine, mixtral, 8192, device)
        return
    plan = plan_memory(engine, mixtral, 8192, device)
    rope = plan.weights - embed_and_head - layers // ranks
    assert 0 <= rope < 64 * 2**20, plan.table()  # the rest is the rope tables
    assert 0 <= 0.9 * device - plan.total < 2 * 32 * (8 // ranks) * 128 * 2 * 16
    dense = plan_memory(engine.model_copy(update={"tensor_parallel_size": 1}), llama_8b,
                        8192, device)
    assert plan_memory(engine, llama_8b, 8192, device).kv_cache > dense.kv_cache
