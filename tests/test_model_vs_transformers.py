"""Our decoder against `transformers` with the same weights, float32: logits and greedy tokens."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from pd_runtime.kernels.attention import AttentionMetadata, PrefillSegment
from pd_runtime import LLM, SamplingParams
from pd_runtime.model.loader import load_model
from pd_runtime.tokenizer import Tokenizer

PROMPTS = ["Hello world, this is a test of the engine",
           "The quick brown fox jumps over the lazy dog. " * 3,
           "a",
           "café naïve 日本語 🙂 mixed bytes",
           "one two three four five six seven eight nine ten eleven twelve thirteen",
           "def f(x):\n    return x * 2\n",
           "short",
           "The prefill worker computes the KV cache and ships it to the decode worker " * 2]

VARIANTS = {
    "llama": ("llama", {}),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {}),
    "mistral": ("mistral", {}),
    "llama-tied": ("llama", {"tie_word_embeddings": True}),
    # Biases where transformers builds them: attention_bias puts them on q/k/v and o (Llama,
    # Qwen3, Granite), mlp_bias on gate/up/down (Llama, Granite).
    "llama-biases": ("llama", {"attention_bias": True, "mlp_bias": True}),
    "qwen3-bias": ("qwen3", {"attention_bias": True}),
    # Granite: Llama with an embedding, residual, attention and logits scaling of its own.
    "granite": ("granite", {"embedding_multiplier": 6.0, "residual_multiplier": 0.3,
                            "attention_multiplier": 0.1, "logits_scaling": 2.0,
                            "tie_word_embeddings": True}),
    "granite-biases": ("granite", {"embedding_multiplier": 2.0, "residual_multiplier": 0.5,
                                   "attention_multiplier": 0.25, "logits_scaling": 1.5,
                                   "attention_bias": True, "mlp_bias": True}),
    # Phi-3 / Phi-4: q/k/v and gate/up stored fused; Phi-4's rope base.
    "phi3": ("phi3", {"rope_parameters": {"rope_type": "default", "rope_theta": 250000.0}}),
    # Phi-3.5-mini / Phi-4-mini: LongRoPE over three quarters of each head (head_dim 16: 12
    # turned, 6 pairs); served within its pretraining context (SERVED): the short factors.
    "phi3-longrope": ("phi3", {"max_position_embeddings": 8192,
                               "original_max_position_embeddings": 256,
                               "rope_parameters": {
                                   "rope_type": "longrope", "rope_theta": 10000.0,
                                   "partial_rotary_factor": 0.75,
                                   "short_factor": [1.0, 1.1, 1.3, 1.7, 2.6, 4.0],
                                   "long_factor": [1.0, 2.0, 4.0, 8.0, 16.0, 32.0]}}),
    # Mixture of experts: Mixtral (every layer sparse, 8 experts, top 2, renormalized) and
    # Qwen3-MoE (the first layer dense by mlp_only_layers; top 3 of 8, renormalized or not).
    "mixtral": ("mixtral", {}),
    "qwen3-moe": ("qwen3_moe", {"num_experts_per_tok": 3, "norm_topk_prob": True,
                                "mlp_only_layers": [0]}),
    "qwen3-moe-unnormalized": ("qwen3_moe", {"norm_topk_prob": False,
                                             "num_experts_per_tok": 2}),
    # Qwen2-MoE: q/k/v biases, a shared expert gated by a sigmoid beside 4 routed of 8.
    "qwen2-moe": ("qwen2_moe", {"num_experts_per_tok": 4, "decoder_sparse_step": 1}),
    "qwen3-moe-bias": ("qwen3_moe", {"attention_bias": True, "num_experts_per_tok": 2}),
    # SmolLM3: no rope in every fourth layer (the test preset's 2 layers: the second).
    "smollm3": ("smollm3", {"no_rope_layer_interval": 2}),
    "smollm3-biases": ("smollm3", {"no_rope_layers": [0, 1], "attention_bias": True,
                                   "mlp_bias": True, "tie_word_embeddings": True}),
    # Sliding windows (shorter than most prompts): Mistral v0.1's and Phi-3-mini's on every
    # layer, Qwen2's from max_window_layers on, SmolLM3's on its NoPE layers.
    "mistral-window": ("mistral", {"sliding_window": 8}),
    "phi3-window": ("phi3", {"sliding_window": 7}),
    "qwen2-window": ("qwen2", {"use_sliding_window": True, "sliding_window": 6,
                               "max_window_layers": 1}),
    "smollm3-window": ("smollm3", {"use_sliding_window": True, "sliding_window": 5,
                                   "no_rope_layer_interval": 2}),
    # Gemma 3: norms as offsets from 1 around each block, tanh GELU, a scaled embedding, its
    # query_pre_attn_scalar, q/k norms, a window and a rope base of its own on the sliding
    # layers; then linear rope scaling on the full-attention layers (Gemma 3 4B and up).
    "gemma3": ("gemma3", {"sliding_window": 8, "query_pre_attn_scalar": 24,
                          "layer_types": ["sliding_attention", "full_attention"]}),
    "gemma3-scaled": ("gemma3", {"sliding_window": 6, "layer_types": ["full_attention",
                                                                      "sliding_attention"],
                                 "rope_parameters": {
                                     "full_attention": {"rope_type": "linear", "factor": 8.0,
                                                        "rope_theta": 1e6},
                                     "sliding_attention": {"rope_type": "default",
                                                           "rope_theta": 1e4}}}),
    # The first Gemma: norms as offsets from 1 (pre-norm blocks as Llama's), tanh GELU, a
    # scaled embedding, tied embeddings, GQA here (Gemma 2B's is MQA).
    "gemma": ("gemma", {}),
    # Gemma 2: Gemma's norms and scalings, every other layer windowed, and soft-capping of the
    # attention scores and of the logits (caps small enough to bite on this model).
    "gemma2": ("gemma2", {"sliding_window": 8, "query_pre_attn_scalar": 24,
                          "attn_logit_softcapping": 2.0, "final_logit_softcapping": 3.0}),
    # gpt-oss: a sink logit per query head, q/k/v/o biases, every other layer windowed, YaRN
    # (untruncated); experts with biases and a clamped SwiGLU (a limit low enough to clamp),
    # its router's bias, top 2 of 8 by logit.
    "gpt-oss": ("gpt_oss", {"sliding_window": 6, "swiglu_limit": 1.0,
                            "num_experts_per_tok": 2}),
    # ... its experts in MXFP4 as OpenAI's checkpoints hold them (transformers dequantizes).
    "gpt-oss-mxfp4": ("gpt_oss", {"sliding_window": 6, "num_experts_per_tok": 2,
                                  "quantization": "mxfp4"}),
    # OLMo 2: each block's output normed (no norm on its input), q and k normed over all
    # heads at once before rope, norms scaled in float32.
    "olmo2": ("olmo2", {}),
    # GLM-4 (0414): rope over half of each head in neighbouring pairs, four norms a layer
    # (each block's input and output), q/k/v biases, gate and up stored fused.
    "glm4": ("glm4", {}),
    # Cohere (Command R): one LayerNorm a layer whose output attention and the MLP both take,
    # rope in neighbouring pairs turned in float32, the logits scaled; per-head q/k LayerNorms
    # (Command R+). Cohere 2 (Command R7B): a window on three layers of four, which alone turn.
    "cohere": ("cohere", {"logit_scale": 0.5}),
    "cohere-qknorm": ("cohere", {"use_qk_norm": True, "logit_scale": 0.5}),
    "cohere2": ("cohere2", {"sliding_window": 6, "logit_scale": 0.5,
                            "layer_types": ["sliding_attention", "full_attention"]}),
    # OLMo 3: OLMo 2 with a window on three layers of four (here the first of two), YaRN on
    # the full-attention layers only (its file's rope_scaling), plain rope on the windowed.
    "olmo3": ("olmo3", {"sliding_window": 6, "layer_types": ["sliding_attention",
                                                            "full_attention"],
                        "rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                         "original_max_position_embeddings": 512,
                                         "beta_fast": 32, "beta_slow": 1}}),
    # OLMoE: Llama's blocks, q and k normed over all heads, every layer 8 experts (top 2),
    # probabilities renormalized over the chosen or not.
    "olmoe": ("olmoe", {}),
    # GraniteMoE: Granite's scalings, every layer 8 experts stored stacked, top 2 by logit.
    "granitemoe": ("granitemoe", {"embedding_multiplier": 6.0, "residual_multiplier": 0.3,
                                  "attention_multiplier": 0.1, "logits_scaling": 2.0}),
    "olmoe-normalized": ("olmoe", {"norm_topk_prob": True, "num_experts_per_tok": 3}),
    "llama3-rope": ("llama", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0,
                                               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                               "original_max_position_embeddings": 64}}),
    "linear-rope": ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
    # YaRN as Qwen checkpoints enable it for long contexts (Qwen2/3 read rope scaling as Llama).
    "yarn-rope": ("qwen3", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                             "original_max_position_embeddings": 512}}),
    "yarn-mscale": ("llama", {"rope_scaling": {"rope_type": "yarn", "factor": 8.0,
                                               "original_max_position_embeddings": 16,
                                               "mscale": 0.9, "mscale_all_dim": 0.7,
                                               "beta_fast": 16, "beta_slow": 2}}),
}


# The context a variant is served with where it is not the model's own (max_model_len).
SERVED = {"phi3-longrope": 256}


def our_logits(model, prompts_ids: list[list[int]]) -> list[torch.Tensor]:
    """All-position logits for several prompts run together as one flat prefill batch."""
    cfg = model.cfg
    block_size = 16
    total_blocks = sum(-(-len(p) // block_size) for p in prompts_ids)
    kv = torch.zeros(cfg.num_layers, 2, total_blocks, cfg.num_kv_heads, block_size,
                     cfg.head_dim, dtype=model.dtype)
    ids, pos, slots, segs, next_block = [], [], [], [], 0
    for p in prompts_ids:
        nb = -(-len(p) // block_size)
        table = list(range(next_block, next_block + nb))[::-1]  # non-contiguous on purpose
        next_block += nb
        segs.append(PrefillSegment(len(ids), len(p), len(p), torch.tensor(table)))
        ids += p
        pos += range(len(p))
        slots += [table[i // block_size] * block_size + i % block_size for i in range(len(p))]
    meta = AttentionMetadata(slot_mapping=torch.tensor(slots), prefills=segs)
    hidden = model.forward(torch.tensor(ids), torch.tensor(pos), list(kv.unbind(0)), meta)
    logits = model.compute_logits(hidden)
    return [logits[s.start:s.start + s.num_tokens] for s in segs]


_HF_CACHE: dict = {}


def _variant(name: str, model_factory):
    if name not in _HF_CACHE:
        arch, overrides = VARIANTS[name]
        path = model_factory(arch, **overrides)
        # (Gemma 2's soft-capping and gpt-oss's sinks are in transformers' eager attention.)
        extra = {"attn_implementation": "eager"} if arch in ("gemma2", "gpt_oss") else {}
        if overrides.get("quantization") == "mxfp4":
            from transformers import Mxfp4Config

            extra["quantization_config"] = Mxfp4Config(dequantize=True)
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **extra).eval()
        # Our ignore_eos keeps sampling eos; HF's min_new_tokens would mask it: drop eos instead.
        hf.generation_config.eos_token_id = None
        _HF_CACHE[name] = (name, path, hf)
    return _HF_CACHE[name]


@pytest.fixture(params=sorted(VARIANTS))
def variant(request, model_factory):
    return _variant(request.param, model_factory)


# Greedy runs cover each family once plus llama3 and YaRN rope scaling; logits pin every variant.
@pytest.fixture(params=["llama", "qwen2", "qwen3", "llama3-rope", "yarn-rope", "granite",
                        "llama-biases", "phi3", "phi3-longrope", "smollm3", "mixtral",
                        "qwen3-moe", "qwen2-moe", "mistral-window", "qwen2-window", "gemma3",
                        "gemma3-scaled", "gemma2", "gemma", "gpt-oss", "gpt-oss-mxfp4",
                        "olmo2", "olmo3", "olmoe", "granitemoe", "glm4", "cohere",
                        "cohere-qknorm", "cohere2"])
def greedy_variant(request, model_factory):
    return _variant(request.param, model_factory)


def test_logits_match_transformers(variant):
    name, path, hf = variant
    tok = Tokenizer(path)
    prompts_ids = [tok.encode(p) for p in PROMPTS]
    ours = our_logits(load_model(path, dtype="float32", max_positions=SERVED.get(name)),
                      prompts_ids)
    for ids, got in zip(prompts_ids, ours):
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0].float()
        assert got.shape == ref.shape
        rel = ((got - ref).abs().max() / ref.abs().max()).item()
        assert rel < 1e-4, f"{name}: max relative logit error {rel:.2e}"


def test_greedy_tokens_match_transformers(greedy_variant):
    name, path, hf = greedy_variant
    llm = LLM(path, dtype="float32", num_kv_blocks=512, max_model_len=SERVED.get(name))
    prompts_ids = [llm.tokenizer.encode(p) for p in PROMPTS]
    assert len({len(p) for p in prompts_ids}) >= 6, "prompts must differ in length"
    outs = llm.generate(prompts_ids, SamplingParams(max_tokens=64, temperature=0.0,
                                                    ignore_eos=True))
    for ids, out in zip(prompts_ids, outs):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([ids]), max_new_tokens=64, do_sample=False)[0, len(ids):].tolist()
        assert out.token_ids == ref, f"{name}: greedy tokens differ for prompt of {len(ids)}"
    assert llm.engine.block_manager.num_free_blocks == 512


def test_bfloat16_runs_and_tracks_float32(llama_dir):
    tok = Tokenizer(llama_dir)
    ids = [tok.encode(PROMPTS[0])]
    f32 = our_logits(load_model(llama_dir, dtype="float32"), ids)[0]
    bf16 = our_logits(load_model(llama_dir, dtype="bfloat16"), ids)[0]
    assert bf16.dtype == torch.float32  # logits are always returned in fp32
    # bf16 has ~3 significant digits; the argmax should mostly agree.
    agree = (f32.argmax(-1) == bf16.argmax(-1)).float().mean().item()
    assert agree > 0.8


def test_yarn_serves_its_extended_context(model_factory):
    """With YaRN the context is the pretraining one times the factor (as vLLM derives it), past
    max_position_embeddings; greedy tokens there are transformers' own."""
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}
    path = model_factory("qwen3", max_position_embeddings=64, rope_scaling=yarn)
    llm = LLM(path, dtype="float32", num_kv_blocks=64)
    assert llm.engine.max_model_len == 128
    prompt = llm.tokenizer.encode(PROMPTS[1] * 2)[:90]
    out = llm.generate([prompt], SamplingParams(max_tokens=30, temperature=0.0,
                                                ignore_eos=True))[0]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=30, do_sample=False)[0, 90:]
    assert out.token_ids == ref.tolist()


def test_longrope_long_factors_past_the_pretraining_context(model_factory, tmp_path):
    """Served with its whole context (the default max_model_len), a LongRoPE model turns every
    position by the long factors: transformers' own logits and greedy tokens for any sequence
    longer than the pretraining context (where it too turns the whole sequence by them); a
    shorter prompt gets the long factors too (as vLLM's), which transformers gives a model
    whose short factors are those long ones."""
    import json
    import shutil

    longrope = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
                "short_factor": [1.0, 1.1, 1.3, 1.7, 2.6, 4.0],
                "long_factor": [1.0, 2.0, 4.0, 8.0, 16.0, 32.0]}
    path = model_factory("phi3", max_position_embeddings=1024,
                         original_max_position_embeddings=32, rope_parameters=longrope)
    llm = LLM(path, dtype="float32", num_kv_blocks=64)
    assert llm.engine.max_model_len == 1024 and llm.engine.model_config.rope.long
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    long_prompts = [llm.tokenizer.encode(p)[:n] for p, n in ((PROMPTS[1], 40), (PROMPTS[7], 33))]
    assert all(len(p) > 32 for p in long_prompts)
    ours = our_logits(load_model(path, dtype="float32"), long_prompts)
    for ids, got in zip(long_prompts, ours):
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0].float()
        assert ((got - ref).abs().max() / ref.abs().max()).item() < 1e-4
    outs = llm.generate(long_prompts, SamplingParams(max_tokens=40, temperature=0.0,
                                                     ignore_eos=True))
    for ids, out in zip(long_prompts, outs):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([ids]), max_new_tokens=40, do_sample=False)
        assert out.token_ids == ref[0, len(ids):].tolist()
    # A short prompt, turned by the long factors: transformers' model whose short ones they are.
    swapped = tmp_path / "swapped"
    shutil.copytree(path, swapped)
    config = json.loads((swapped / "config.json").read_text())
    for key in ("rope_parameters", "rope_scaling"):  # (the file has both: either is read)
        if key in config:
            config[key]["short_factor"] = longrope["long_factor"]
    (swapped / "config.json").write_text(json.dumps(config))
    hf_swapped = AutoModelForCausalLM.from_pretrained(swapped, dtype=torch.float32).eval()
    short = llm.tokenizer.encode(PROMPTS[0])[:20]
    got = our_logits(load_model(path, dtype="float32"), [short])[0]
    with torch.no_grad():
        ref = hf_swapped(torch.tensor([short])).logits[0].float()
        plain = hf(torch.tensor([short])).logits[0].float()
    assert ((got - ref).abs().max() / ref.abs().max()).item() < 1e-4
    assert ((got - plain).abs().max() / plain.abs().max()).item() > 1e-3  # the factors differ


@pytest.mark.parametrize("name", ["mistral-window", "gemma2", "gpt-oss"])
def test_sliding_window_on_the_batched_paths(model_factory, name):
    """Outside the batch-invariant mode (decodes through the batch buffer, prompts in chunks
    over their cached prefix, prefix-cache hits), a sliding window (and Gemma 2's soft-capped
    scores) gives transformers' greedy tokens."""
    _, path, hf = _variant(name, model_factory)
    llm = LLM(path, dtype="float32", num_kv_blocks=128, batch_invariant=False,
              max_num_batched_tokens=16)
    prompts_ids = [llm.tokenizer.encode(p)[:n] for p, n in ((PROMPTS[1], 37), (PROMPTS[7], 30),
                                                            (PROMPTS[4], 9))]
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    first = llm.generate(prompts_ids, greedy)
    again = llm.generate(prompts_ids, greedy)  # whole blocks of each prompt from the cache
    assert any(o.num_cached_tokens for o in again)
    for ids, out, hit in zip(prompts_ids, first, again):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False)
        assert out.token_ids == hit.token_ids == ref[0, len(ids):].tolist()

