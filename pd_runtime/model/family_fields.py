"""The config.json fields of particular families, as transformers reads them: sliding windows
and which layers take them, experts, SmolLM3's layers without rope, Granite's scalings, Gemma's
norms, scalings and soft-caps, gpt-oss's sinks and experts (model_config.py assembles them into
a ModelConfig).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Optional

from pd_runtime.api import ModelLoadError


def sliding_window(raw: dict, path: Path, family: str) -> tuple[Optional[int], tuple[int, ...]]:
    """The sliding window and the layers it applies to (sliding_layers), as transformers reads
    them: Mistral's and OLMo 3's whenever set (4096 when the key is absent), Phi-3's,
    Mixtral's, Gemma's and gpt-oss's whenever set; Qwen's and SmolLM3's only with
    use_sliding_window."""
    if family in ("mistral", "olmo3"):
        window = raw.get("sliding_window", 4096)
    elif family in ("phi3", "mixtral", "gemma2", "gemma3", "gpt_oss", "cohere2"):
        window = raw.get("sliding_window")
    else:
        window = raw.get("sliding_window") if raw.get("use_sliding_window") else None
    if not window:
        return None, ()
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        raise ModelLoadError(f"{path}: sliding_window must be a positive integer, got {window!r}")
    chosen = sliding_layers(raw, path, family)
    return (window, chosen) if chosen else (None, ())


def sliding_layers(raw: dict, path: Path, family: str) -> tuple[int, ...]:
    """The layers transformers types "sliding_attention": a config's own layer_types, else the
    family's: Qwen2/3's from max_window_layers on, Qwen2-MoE's every other layer below it,
    SmolLM3's NoPE layers, Gemma's all but every sliding_window_pattern-th (Gemma 3: 5 of 6,
    Gemma 2: every other), gpt-oss's every other from the first, the others' every layer."""
    layers = int(raw.get("num_hidden_layers", 0))
    types = raw.get("layer_types")
    if isinstance(types, list) and len(types) == layers:
        return tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    if family in ("qwen2", "qwen3"):
        return tuple(range(int(raw.get("max_window_layers", 28)), layers))
    if family == "qwen2_moe":
        return tuple(i for i in range(min(layers, int(raw.get("max_window_layers", 28))))
                     if (i + 1) % 2)
    if family == "smollm3":
        return nope_layers(raw, path, family)
    if family == "gpt_oss":
        return tuple(range(0, layers, 2))
    if family == "olmo3":  # all but every fourth
        return tuple(i for i in range(layers) if (i + 1) % 4)
    if family == "cohere2":  # all but every sliding_window_pattern-th
        pattern = int(raw.get("sliding_window_pattern", 4))
        return tuple(i for i in range(layers) if (i + 1) % pattern)
    if family in ("gemma2", "gemma3"):
        pattern = int(raw.get("sliding_window_pattern", 6 if family == "gemma3" else 2))
        return tuple(i for i in range(layers) if (i + 1) % pattern)
    return tuple(range(layers))


def experts(raw: dict, path: Path, family: str) -> dict:
    """The mixture-of-experts fields, as transformers reads them: Mixtral's every layer sparse
    (num_local_experts, experts of intermediate_size, renormalized float32 weights); Qwen3-MoE's
    sparse where decoder_sparse_step divides the layer number and mlp_only_layers does not
    name it (experts of moe_intermediate_size, norm_topk_prob); gpt-oss's every layer sparse
    (num_local_experts of intermediate_size, softmax over the chosen logits: normalized);
    OLMoE's every layer (num_experts of intermediate_size, norm_topk_prob); GraniteMoE's as
    Mixtral's (softmax over the chosen logits)."""
    if family not in ("mixtral", "qwen3_moe", "qwen2_moe", "gpt_oss", "olmoe", "granitemoe"):
        return {}
    layers = int(raw["num_hidden_layers"])
    if family == "olmoe":
        experts = raw.get("num_experts", 64)
        size = raw.get("intermediate_size")
        sparse, norm = tuple(range(layers)), bool(raw.get("norm_topk_prob", False))
    elif family in ("mixtral", "gpt_oss", "granitemoe"):
        experts = raw.get("num_local_experts", raw.get("num_experts", 8))
        size = raw.get("intermediate_size")
        sparse, norm = tuple(range(layers)), True
    else:
        # (transformers 5 writes num_local_experts, the Hub's files num_experts.)
        qwen2 = family == "qwen2_moe"  # (its config class's defaults: 60 of 1408, top 4)
        experts = raw.get("num_experts", raw.get("num_local_experts", 60 if qwen2 else 128))
        size = raw.get("moe_intermediate_size", 1408 if qwen2 else 768)
        step = int(raw.get("decoder_sparse_step", 1))
        dense = set(raw.get("mlp_only_layers") or [])
        sparse = tuple(i for i in range(layers) if i not in dense and experts > 0
                       and step > 0 and (i + 1) % step == 0)
        norm = bool(raw.get("norm_topk_prob", False))
    top_k = raw.get("num_experts_per_tok", raw.get("experts_per_token", {
        "mixtral": 2, "qwen2_moe": 4, "gpt_oss": 4, "granitemoe": 2}.get(family, 8)))
    shared = raw.get("shared_expert_intermediate_size", 5632) if family == "qwen2_moe" else 0
    if not isinstance(shared, int) or isinstance(shared, bool) or shared < 0:
        raise ModelLoadError(f"{path}: shared_expert_intermediate_size must be an integer, "
                             f"got {shared!r}")
    for key, value in (("num_experts", experts), ("num_experts_per_tok", top_k),
                       ("moe_intermediate_size", size)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ModelLoadError(f"{path}: {key} must be a positive integer, got {value!r}")
    if top_k > experts:
        raise ModelLoadError(f"{path}: num_experts_per_tok {top_k} exceeds the {experts} "
                             "experts")
    return {"num_experts": experts, "experts_per_token": top_k, "moe_intermediate_size": size,
            "norm_topk_prob": norm, "router_weights_float32": family == "mixtral",
            "sparse_layers": sparse, "shared_expert_size": shared}


def nope_layers(raw: dict, path: Path, family: str) -> tuple[int, ...]:
    """SmolLM3's layers without rope, as transformers reads them: `no_rope_layers` holds a 1
    for each layer that rotates (absent: every `no_rope_layer_interval`-th layer does not);
    Cohere 2's full-attention layers (rope turns its windowed ones only)."""
    if family == "cohere2":  # (no window: no layer turns, as transformers reads it)
        windowed = set(sliding_layers(raw, path, family)) if raw.get("sliding_window") else ()
        return tuple(i for i in range(int(raw["num_hidden_layers"])) if i not in windowed)
    if family != "smollm3":
        return ()
    layers = int(raw["num_hidden_layers"])
    flags = raw.get("no_rope_layers")
    if flags is None:
        interval = int(raw.get("no_rope_layer_interval", 4))
        flags = [int((i + 1) % interval != 0) for i in range(layers)]
    if not isinstance(flags, list) or len(flags) < layers:
        raise ModelLoadError(f"{path}: no_rope_layers must hold a flag for each of the "
                             f"{layers} layers, got {flags!r}")
    return tuple(i for i, use_rope in enumerate(flags[:layers]) if not use_rope)


GEMMA1_DEFAULTS = {"vocab_size": 256000, "hidden_size": 3072, "intermediate_size": 24576,
                   "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 16,
                   "head_dim": 256, "max_position_embeddings": 8192, "rms_norm_eps": 1e-6,
                   "hidden_act": "gelu_pytorch_tanh"}


GEMMA3_DEFAULTS = {"vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216,
                    "num_hidden_layers": 26, "num_attention_heads": 8, "num_key_value_heads": 4,
                    "head_dim": 256, "max_position_embeddings": 131072, "rms_norm_eps": 1e-6,
                    "sliding_window": 4096, "hidden_activation": "gelu_pytorch_tanh"}


GEMMA2_DEFAULTS = {"vocab_size": 256000, "hidden_size": 2304, "intermediate_size": 9216,
                    "num_hidden_layers": 26, "num_attention_heads": 8, "num_key_value_heads": 4,
                    "head_dim": 256, "max_position_embeddings": 8192, "rms_norm_eps": 1e-6,
                    "sliding_window": 4096, "hidden_activation": "gelu_pytorch_tanh",
                    "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0}


GLM4_DEFAULTS = {"vocab_size": 151552, "hidden_size": 4096, "intermediate_size": 13696,
                 "num_hidden_layers": 40, "num_attention_heads": 32, "num_key_value_heads": 2,
                 "head_dim": 128, "max_position_embeddings": 131072,
                 "rms_norm_eps": 0.00000015625, "attention_bias": True,
                 "partial_rotary_factor": 0.5}
COHERE_DEFAULTS = {"vocab_size": 256000, "hidden_size": 8192, "intermediate_size": 22528,
                   "num_hidden_layers": 40, "num_attention_heads": 64,
                   "max_position_embeddings": 8192, "layer_norm_eps": 1e-5,
                   "logit_scale": 0.0625, "rope_theta": 500000.0}
OLMO_DEFAULTS = {"vocab_size": 50304, "hidden_size": 4096, "intermediate_size": 11008,
                 "num_hidden_layers": 32, "num_attention_heads": 32,
                 "max_position_embeddings": 2048, "rms_norm_eps": 1e-5}
OLMOE_DEFAULTS = {"vocab_size": 50304, "hidden_size": 2048, "intermediate_size": 2048,
                  "num_hidden_layers": 16, "num_attention_heads": 16,
                  "max_position_embeddings": 4096, "rms_norm_eps": 1e-5}

# What each family's config class supplies where a file leaves a field out.
CLASS_DEFAULTS = {"gemma": GEMMA1_DEFAULTS, "gemma2": GEMMA2_DEFAULTS,
                  "gemma3": GEMMA3_DEFAULTS, "olmo2": OLMO_DEFAULTS, "olmo3": OLMO_DEFAULTS,
                  "olmoe": OLMOE_DEFAULTS, "glm4": GLM4_DEFAULTS,
                  "cohere": COHERE_DEFAULTS, "cohere2": {**COHERE_DEFAULTS, "rope_theta": 1e4,
                                                         "sliding_window": 4096}}


def gemma(raw: dict, path: Path, family: str, hidden: int) -> dict:
    """Gemma's fields, as transformers reads them (the first Gemma: its norms, activation and
    embedding scale alone)."""
    if family == "gemma":
        return {"gemma_norms": True, "mlp_act": "gelu_tanh",
                "embedding_multiplier": math.sqrt(hidden)}
    if family not in ("gemma2", "gemma3"):
        return {}
    caps = {}
    for key, name in (("attn_logit_softcapping", "attn_softcap"),
                      ("final_logit_softcapping", "final_softcap")):
        cap = raw.get(key)
        if cap is not None and (not isinstance(cap, (int, float)) or isinstance(cap, bool)
                                or not cap > 0):
            raise ModelLoadError(f"{path}: {key} must be a positive number, got {cap!r}")
        caps[name] = None if cap is None else float(cap)
    scalar = raw.get("query_pre_attn_scalar", 256)
    if not isinstance(scalar, (int, float)) or isinstance(scalar, bool) or not scalar > 0:
        raise ModelLoadError(f"{path}: query_pre_attn_scalar must be a positive number, "
                             f"got {scalar!r}")
    common = {"gemma_norms": True, "block_norms": "sandwich", "mlp_act": "gelu_tanh",
              "embedding_multiplier": math.sqrt(hidden),
              "attention_multiplier": float(scalar) ** -0.5, **caps}
    if family == "gemma2":  # one rope for every layer
        return common
    # (Gemma 3's sliding layers turn by a rope of their own: model_config reads it.)
    return {**common, "local_rope_layers": sliding_layers(raw, path, family)}


def granite_scalings(raw: dict, path: Path, family: str) -> dict:
    if family not in ("granite", "granitemoe"):
        return {}
    out = {}
    for key in ("embedding_multiplier", "residual_multiplier", "attention_multiplier",
                "logits_scaling"):
        value = raw.get(key, 1.0)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
            raise ModelLoadError(f"{path}: {key} must be a positive number, got {value!r}")
        out[key] = float(value)
    return out


# What gpt-oss's config class supplies when a file leaves it out (the Hub's files name these
# mostly; the rope's theta and YaRN scaling by rope_theta and rope_scaling).
GPT_OSS_DEFAULTS = {"vocab_size": 201088, "hidden_size": 2880, "intermediate_size": 2880,
                    "num_hidden_layers": 36, "num_attention_heads": 64,
                    "num_key_value_heads": 8, "head_dim": 64,
                    "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
                    "sliding_window": 128, "num_local_experts": 128, "attention_bias": True}
GPT_OSS_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                "truncate": False, "original_max_position_embeddings": 4096}


def gpt_oss_defaults(raw: dict) -> dict:
    """A gpt-oss config with its class's defaults filled in (rope: YaRN over base 150000)."""
    out = {**GPT_OSS_DEFAULTS, **raw}
    if "num_experts" in raw and "num_local_experts" not in raw:  # (its alias, as transformers')
        out["num_local_experts"] = raw["num_experts"]
    if not raw.get("torch_dtype") and not raw.get("dtype"):  # its weights are bf16 (and MXFP4)
        out["torch_dtype"] = "bfloat16"
    if not raw.get("rope_parameters") and not raw.get("rope_scaling"):
        out["rope_scaling"] = dict(GPT_OSS_ROPE)
    if "rope_theta" not in raw and "rope_theta" not in (raw.get("rope_parameters") or {}):
        out["rope_theta"] = 150000.0
    return out


def gpt_oss(raw: dict, path: Path, family: str) -> dict:
    """gpt-oss's fields: a sink logit per query head in every attention; a router with a bias
    that softmaxes over the chosen experts' logits; experts with biases and a clamped SwiGLU
    (swiglu_alpha, swiglu_limit)."""
    if family != "gpt_oss":
        return {}
    out = {}
    for key, default in (("swiglu_alpha", 1.702), ("swiglu_limit", 7.0)):
        value = raw.get(key, default)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
            raise ModelLoadError(f"{path}: {key} must be a positive number, got {value!r}")
        out[key] = float(value)
    return {**out, "attn_sinks": True, "float32_norms": True, "expert_bias": True,
            "routing": "topk_softmax", "mlp_act": "clamped_swiglu"}


def layout(raw: dict, path: Path, family: str) -> dict:
    """OLMo 2's and 3's, OLMoE's and GraniteMoE's differences from Llama's decoder (OLMo 3's
    sliding layers turn by a rope of their own: model_config reads it)."""
    olmo = {"block_norms": "post", "float32_norms": True, "qk_norm_whole": True,
            "rope_float32": True, "rope_tables_float32": True}
    if family in ("cohere", "cohere2"):
        scale = raw.get("logit_scale", 0.0625)
        if not isinstance(scale, (int, float)) or isinstance(scale, bool) or not scale > 0:
            raise ModelLoadError(f"{path}: logit_scale must be a positive number, got {scale!r}")
        return {"block_norms": "parallel", "norm_kind": "layer", "rope_float32": True,
                "logit_scale": float(scale)}
    if family == "olmo3":
        return {**olmo, "local_rope_layers": sliding_layers(raw, path, family)}
    return {"olmo2": olmo,
            "olmoe": {"qk_norm_whole": True},
            "glm4": {"block_norms": "sandwich"},
            "granitemoe": {"routing": "topk_softmax_f32"}}.get(family, {})


def refuse_variants(raw: dict, path: Path, family: str) -> None:
    """Configs of a family's variants that compute otherwise than this decoder: refused by
    name rather than served wrongly."""
    text_type = (raw.get("text_config") or {}).get("model_type")
    if family == "mistral" and text_type not in (None, "mistral"):  # Mistral3's text model
        raise ModelLoadError(f"{path}: a text model of model_type {text_type!r} is not "
                             "supported (Mistral3ForConditionalGeneration: mistral's only)")
    scaling = {**(raw.get("rope_scaling") or {}), **(raw.get("rope_parameters") or {})}
    if scaling.get("llama_4_scaling_beta"):
        raise ModelLoadError(f"{path}: rope llama_4_scaling_beta is not supported")
    if family == "gemma" and raw.get("use_bidirectional_attention"):
        raise ModelLoadError(f"{path}: use_bidirectional_attention is not supported (a "
                             "causal decoder only)")
