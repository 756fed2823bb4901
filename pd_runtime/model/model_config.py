"""Reads an HF `config.json` into the one architecture description our decoder understands.

Llama, Mistral, Qwen2, Qwen3, Granite, Phi-3 and SmolLM3 differ only in the flags and
multipliers below (Phi-3 stores q/k/v and gate/up fused, as our decoder holds them; SmolLM3
leaves rope out of every fourth layer); Mixtral and Qwen3-MoE replace the MLP of their sparse
layers by experts a router picks per token; Gemma 2 and 3 norm every block's input and output
(model/llama.py: _sandwich_layers), OLMo 2 and 3 norm only their outputs, Gemma 2 soft-caps its
attention scores and logits;
gpt-oss adds attention sinks and experts with biases and a clamped SwiGLU (model/gpt_oss.py);
anything else is refused.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import astuple, dataclass, field, replace
from pathlib import Path
from typing import Optional

from pd_runtime.api import ModelLoadError  # noqa: F401  (raised here, defined with the contract)
from pd_runtime.model import family_fields as fields


# architecture name -> family; model_type is the fallback key.
_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "GraniteForCausalLM": "granite",
    "Phi3ForCausalLM": "phi3",
    "SmolLM3ForCausalLM": "smollm3",
    "MixtralForCausalLM": "mixtral",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "GemmaForCausalLM": "gemma",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
    "Gemma3ForConditionalGeneration": "gemma3",  # its text model (images are not read)
    "Mistral3ForConditionalGeneration": "mistral",  # Mistral Small 3.1/3.2: its text model
    # Qwen2-VL, Qwen2.5-VL, Qwen3-VL: their text models (multimodal rope on text is plain rope)
    "Qwen2VLForConditionalGeneration": "qwen2",
    "Qwen2_5_VLForConditionalGeneration": "qwen2",
    "Qwen3VLForConditionalGeneration": "qwen3",
    "GptOssForCausalLM": "gpt_oss",
    "Olmo2ForCausalLM": "olmo2",
    "Olmo3ForCausalLM": "olmo3",
    "Glm4ForCausalLM": "glm4",
    "CohereForCausalLM": "cohere",
    "Cohere2ForCausalLM": "cohere2",
    "OlmoeForCausalLM": "olmoe",
    "GraniteMoeForCausalLM": "granitemoe",
}
_MODEL_TYPES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3",
                "granite": "granite", "phi3": "phi3", "smollm3": "smollm3",
                "mixtral": "mixtral", "qwen3_moe": "qwen3_moe", "qwen2_moe": "qwen2_moe",
                "gemma": "gemma", "gemma2": "gemma2", "gemma3_text": "gemma3",
                "gpt_oss": "gpt_oss", "olmo2": "olmo2", "olmo3": "olmo3", "olmoe": "olmoe",
                "glm4": "glm4", "cohere": "cohere", "cohere2": "cohere2",
                "granitemoe": "granitemoe"}


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    rope_type: str = "default"  # default | linear | llama3 | yarn | longrope
    factor: float = 1.0
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    original_max_position_embeddings: int = 8192  # llama3, yarn: the pretraining context
    beta_fast: float = 32.0  # yarn: the correction range's rotation bounds
    beta_slow: float = 1.0
    truncate: bool = True  # yarn: the correction range rounded outwards to whole dimensions
    attention_factor: Optional[float] = None  # yarn: cos/sin scale (None: from factor, mscale)
    mscale: Optional[float] = None
    mscale_all_dim: Optional[float] = None
    # longrope (Phi-3.5, Phi-4-mini): per-dimension divisors of the frequencies within the
    # pretraining context (short) and beyond it (long).
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    # Which of the two turns every position: the long ones when the served context passes the
    # pretraining one (`served`), as vLLM picks them.
    long: bool = False
    # The share of each head rope turns (Phi-4-mini's 0.75; the rest passes through).
    partial_rotary_factor: float = 1.0
    # Pairs of neighbouring dimensions turn together (GLM-4's), not the two halves.
    interleaved: bool = False


@dataclass(frozen=True)
class ModelConfig:
    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    torch_dtype: str
    rope: RopeConfig = field(default_factory=RopeConfig)
    # Attention over the last `sliding_window` positions only, in `window_layers`.
    sliding_window: Optional[int] = None
    window_layers: tuple[int, ...] = ()
    o_bias: bool = False  # the attention output projection's bias (attention_bias)
    mlp_bias: bool = False  # gate, up and down projections' biases
    # Granite's scalings (1.0, None: the others'): the embeddings are multiplied by the first,
    # each block's output by the second before it joins the residual stream, attention scores
    # by the third (None: 1/sqrt(head_dim)), and the logits divided by the last.
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    attention_multiplier: Optional[float] = None
    logits_scaling: float = 1.0
    # Layers whose attention applies no rope (SmolLM3's NoPE layers: every fourth by default).
    nope_layers: tuple[int, ...] = ()
    # Mixture of experts (Mixtral, Qwen3-MoE): in `sparse_layers` the MLP is `num_experts`
    # experts of `moe_intermediate_size`, of which the router's top `experts_per_token` run
    # for each token, weighted by their softmax probabilities (renormalized over the chosen
    # with `norm_topk_prob`; kept in float32 by Mixtral, cast to the model's dtype by Qwen).
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    router_weights_float32: bool = False
    sparse_layers: tuple[int, ...] = ()
    # Qwen2-MoE's shared expert beside the routed ones (its output scaled by a sigmoid gate).
    shared_expert_size: int = 0
    # Gemma: RMSNorm weights are offsets from 1, applied in float32 before the cast; the MLP's
    # activation is tanh-approximated GELU; the embeddings are scaled by sqrt(hidden_size)
    # rounded to the model's dtype. Gemma 3's sliding-window layers turn by `local_rope`.
    gemma_norms: bool = False
    # Where a layer's norms are: "pre" (Llama's: each block's input), "sandwich" (Gemma 2 and
    # 3: its input and its output, which is normed before it joins the residual stream),
    # "post" (OLMo 2: its output only) or "parallel" (Cohere: one norm, whose output both
    # attention and the MLP take, both added to the residual stream).
    block_norms: str = "pre"
    norm_kind: str = "rms"  # rms | layer (Cohere's: mean-centred, in float32, no bias)
    logit_scale: float = 1.0  # Cohere's: the logits multiplied by it (in the model's dtype)
    # OLMo 2: q and k normed over all their heads at once (weights of heads x head_dim).
    qk_norm_whole: bool = False
    mlp_act: str = "silu"  # silu | gelu_tanh | clamped_swiglu (gpt-oss's, below)
    local_rope: Optional[RopeConfig] = None
    local_rope_layers: tuple[int, ...] = ()  # its "sliding_attention" layers, window or not
    # Gemma 2's soft-capping: attention scores, then the logits, become cap * tanh(x / cap).
    attn_softcap: Optional[float] = None
    final_softcap: Optional[float] = None
    # How a router weighs the experts it picks: "softmax_topk" (a float32 softmax over all,
    # its top ones: Mixtral, Qwen, OLMoE), "topk_softmax" (the top logits, a softmax over them
    # in their dtype: gpt-oss) or "topk_softmax_f32" (the same in float32: GraniteMoE).
    routing: str = "softmax_topk"
    # gpt-oss: a learned sink logit per query head joins every attention softmax (with no
    # value); the router has a bias; the experts have biases and a clamped SwiGLU, mlp_act
    # "clamped_swiglu": (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g),
    # g = min(gate, limit).
    attn_sinks: bool = False
    float32_norms: bool = False  # RMSNorm weights applied in float32, before the cast
    rope_float32: bool = False  # OLMo 2, Cohere: q and k turned in float32, then cast
    rope_tables_float32: bool = False  # OLMo 2: cos and sin kept in float32 (not the dtype's)
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    expert_bias: bool = False  # (gpt-oss's router and experts have biases)
    # How the checkpoint stores weights: None (as numbers), "mxfp4" (gpt-oss's experts).
    quantization: Optional[str] = None

    @property
    def identity(self) -> str:
        """A short string covering the KV layout and the rope (handshakes and prefix-cache
        hashes start from it): two pools on one set of weights with different rope settings
        would otherwise exchange KV neither could use. The weights themselves are not in it."""
        r = self.rope
        rope = f"-rope{r.theta!r}"
        if r.rope_type != "default":  # every parameter of the scaling, digested
            digest = hashlib.sha256(repr(astuple(r)).encode()).hexdigest()[:8]
            rope += f"-{r.rope_type}-{digest}"
        # (The experts change no KV layout: a dense and a sparse model with equal attention
        # differ in their family name.)
        if self.local_rope is not None:  # the sliding layers' own rope
            local = (astuple(self.local_rope), self.local_rope_layers)
            rope += "-local" + hashlib.sha256(repr(local).encode()).hexdigest()[:8]
        if self.nope_layers:  # which layers' keys are rotated is part of the KV's meaning
            rope += "-nope" + hashlib.sha256(repr(self.nope_layers).encode()).hexdigest()[:8]
        return (f"{self.family}-L{self.num_layers}-H{self.hidden_size}-kv{self.num_kv_heads}"
                f"x{self.head_dim}-V{self.vocab_size}{rope}")


# Config classes whose rope base is not 1e4 when a file leaves it out.
_DEFAULT_THETA = {"smollm3": 2e6, "mixtral": 1e6}


def _rope_from(raw: dict, path: Path, family: str, head_dim: int) -> RopeConfig:
    # transformers 5 writes `rope_parameters` (theta inside); older files use rope_theta + rope_scaling.
    params = dict(raw.get("rope_parameters") or {})
    scaling = raw.get("rope_scaling") or {}
    params = {**scaling, **params}
    theta = params.get("rope_theta", raw.get("rope_theta", _DEFAULT_THETA.get(family, 1e4)))
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    if rope_type == "mrope":  # (Qwen2-VL's: its three sections share a text token's position,
        rope_type = "default"  # so on text it turns as plain rope; images are not read)
    if family == "phi3":  # as transformers' Phi3Config reads it: "su" and "yarn" are longrope
        rope_type = "longrope" if rope_type in ("su", "yarn") else rope_type
        if rope_type not in ("default", "longrope"):
            raise ModelLoadError(f"{path}: rope type {rope_type!r} is not supported for phi3 "
                                 "(default or longrope, as transformers reads it)")
    partial = params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
    partial = 1.0 if partial is None else partial
    # Phi-3's and GLM-4's attention turn part of each head (transformers' others turn all).
    if partial != 1 and (family not in ("phi3", "glm4") or not 0 < partial < 1
                         or int(head_dim * partial) % 2):
        raise ModelLoadError(f"{path}: partial_rotary_factor {partial!r} is not supported "
                             f"for {family} (head_dim {head_dim})")
    if rope_type not in ("default", "linear", "llama3", "yarn", "longrope") or \
            (rope_type == "longrope" and family != "phi3"):
        raise ModelLoadError(f"{path}: rope type {rope_type!r} is not supported "
                             "(supported: default, linear, llama3, yarn; longrope for Phi-3)")
    # As transformers reads it: a top-level original_max_position_embeddings first, then the
    # scaling's own, then the model's context.
    # (Phi3Config's own default: 4096.)
    original = raw.get("original_max_position_embeddings") or \
        params.get("original_max_position_embeddings") or \
        (4096 if family == "phi3" else raw.get("max_position_embeddings", 8192))

    def number(key: str, default):
        value = params.get(key)
        return default if value is None else float(value)

    factor = number("factor", 1.0)
    if rope_type in ("yarn", "longrope") and params.get("factor") is None:  # the context's ratio
        factor = int(raw.get("max_position_embeddings", original)) / int(original)
    short, long = (), ()
    if rope_type == "longrope":
        half = int(head_dim * partial) // 2
        for key in ("short_factor", "long_factor"):
            value = params.get(key)
            if not isinstance(value, list) or len(value) != half or not all(
                    isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0
                    for v in value):
                raise ModelLoadError(f"{path}: longrope's {key} must be {half} positive "
                                     f"numbers (one per rotated pair), got {value!r}")
        short = tuple(float(v) for v in params["short_factor"])
        long = tuple(float(v) for v in params["long_factor"])

    return RopeConfig(
        theta=float(theta),
        rope_type=rope_type,
        factor=factor,
        low_freq_factor=number("low_freq_factor", 1.0),
        high_freq_factor=number("high_freq_factor", 4.0),
        original_max_position_embeddings=int(original),
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        truncate=bool(params.get("truncate", True)),
        attention_factor=number("attention_factor", None),
        mscale=number("mscale", None),
        mscale_all_dim=number("mscale_all_dim", None),
        short_factor=short,
        long_factor=long,
        partial_rotary_factor=float(partial),
        interleaved=family in ("glm4", "cohere", "cohere2"),
    )


def load_model_config(model_dir: str | Path) -> ModelConfig:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ModelLoadError(f"{path}: missing (expected an HF model directory)")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"{path}: not valid JSON: {exc}") from exc
    if isinstance(raw.get("text_config"), dict):  # a multimodal model's: its text model's
        tied = raw.get("tie_word_embeddings")
        raw = {**raw, **raw["text_config"]}
        if tied and any(a.startswith("Qwen") for a in raw.get("architectures") or []):
            raw["tie_word_embeddings"] = True  # (Qwen-VL's configs tie if either says so)
    family = None
    for arch in raw.get("architectures") or []:
        family = family or _ARCHITECTURES.get(arch)
    family = family or _MODEL_TYPES.get(raw.get("model_type", ""))
    if family is None:
        raise ModelLoadError(
            f"{path}: unsupported architecture {raw.get('architectures')} / model_type "
            f"{raw.get('model_type')!r}; supported: {sorted(_ARCHITECTURES)}")

    if family in fields.CLASS_DEFAULTS:  # what a Hub config leaves to the class's defaults
        raw = {**fields.CLASS_DEFAULTS[family], **raw}
    elif family == "gpt_oss":
        raw = fields.gpt_oss_defaults(raw)

    # Quantized weights (AWQ, GPTQ, FP8, ...) would load as numbers without their scales: refuse,
    # but for gpt-oss's MXFP4 experts (dequantized at load: model/gpt_oss.py).
    quant = raw.get("quantization_config") or raw.get("compression_config")
    method = None
    if quant:
        method = (quant.get("quant_method") or quant.get("format")) \
            if isinstance(quant, dict) else quant
    if quant and (family, method) != ("gpt_oss", "mxfp4"):
        raise ModelLoadError(f"{path}: quantized checkpoints are not supported "
                             f"(quantization_config: {method!r}); serve the unquantized model "
                             "(kv_cache_dtype: int8 quantizes the KV cache)")

    fields.refuse_variants(raw, path, family)
    if raw.get("clip_qkv") is not None:  # (OLMoE's option; its releases leave it null)
        raise ModelLoadError(f"{path}: clip_qkv {raw['clip_qkv']!r} is not supported (only "
                             "null: q, k and v unclipped)")

    def need(key):
        if key not in raw:
            raise ModelLoadError(f"{path}: missing field {key!r}")
        return raw[key]

    attention_bias = bool(raw.get("attention_bias", False))
    # The MLP's activation: SiLU in every family read here but Gemma's tanh GELU (gpt-oss's
    # config says silu for its clamped SwiGLU); a checkpoint with another would run, wrongly,
    # with no error.
    gemma = family in ("gemma", "gemma2", "gemma3")
    act = raw.get("hidden_activation" if gemma else "hidden_act",
                  raw.get("hidden_act", raw.get("hidden_activation", "silu")))
    if family == "gemma":  # (GemmaConfig reads hidden_act; "gelu", the first releases', is tanh)
        act = {"gelu": "gelu_pytorch_tanh"}.get(raw.get("hidden_act"), raw.get("hidden_act"))
    if act not in (("gelu_pytorch_tanh",) if gemma else ("silu", "swish")):
        raise ModelLoadError(f"{path}: hidden_act {act!r} is not supported (only "
                             f"{'gelu_pytorch_tanh' if gemma else 'silu'})")
    hidden = int(need("hidden_size"))
    heads = int(need("num_attention_heads"))
    head_dim = raw.get("head_dim") or hidden // heads
    if family in ("cohere", "cohere2"):  # (their config classes ignore a file's head_dim)
        head_dim = hidden // heads
    window, window_layers = fields.sliding_window(raw, path, family)
    return ModelConfig(
        family=family,
        vocab_size=int(need("vocab_size")),
        hidden_size=hidden,
        intermediate_size=int(need("intermediate_size")),
        num_layers=int(need("num_hidden_layers")),
        num_heads=heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or heads),
        head_dim=int(head_dim),
        rms_norm_eps=float(raw.get("layer_norm_eps" if family in ("cohere", "cohere2")
                                   else "rms_norm_eps", 1e-6)),
        max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
        # (SmolLM3's, Gemma's and Cohere's config classes tie them unless told otherwise.)
        tie_word_embeddings=bool(raw.get("tie_word_embeddings",
                                         family in ("smollm3", "gemma", "gemma2",
                                                    "gemma3", "cohere", "cohere2"))),
        # As transformers builds them: Qwen2 has q/k/v biases always; Llama, Qwen3 and Granite
        # q/k/v/o biases with attention_bias (SmolLM3 too), Llama and Granite MLP biases with
        # mlp_bias (SmolLM3 too);
        # Mistral and Phi-3 none.
        qkv_bias=family == "qwen2" or (family == "qwen2_moe" and raw.get("qkv_bias", True))
        or (family not in ("mistral", "phi3", "mixtral", "qwen2_moe") and attention_bias),
        o_bias=family in ("llama", "qwen3", "qwen3_moe", "granite", "granitemoe", "smollm3",
                          "gpt_oss", "olmo2", "olmo3", "olmoe", "cohere", "cohere2")
        and attention_bias,
        mlp_bias=family in ("llama", "granite", "smollm3") and bool(raw.get("mlp_bias", False)),
        qk_norm=family in ("qwen3", "qwen3_moe", "gemma3", "olmo2", "olmo3", "olmoe")
        or (family == "cohere" and bool(raw.get("use_qk_norm"))),
        torch_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "float32"),
        rope=_rope_from(_typed_rope(raw, "full_attention", family) if family in TYPED_ROPES
                        else raw, path, family, int(head_dim)),
        sliding_window=window,
        window_layers=window_layers,
        **fields.granite_scalings(raw, path, family),
        **fields.gemma(raw, path, family, hidden),
        local_rope=_rope_from(_typed_rope(raw, "sliding_attention", family), path, family,
                              int(head_dim)) if family in TYPED_ROPES else None,
        nope_layers=fields.nope_layers(raw, path, family),
        **fields.experts(raw, path, family),
        **fields.gpt_oss(raw, path, family),
        **fields.layout(raw, path, family),
        quantization=method,
    )


# Families whose sliding and full-attention layers each turn by a rope of their own.
TYPED_ROPES = ("gemma3", "olmo3")


def _typed_rope(raw: dict, layer_type: str, family: str) -> dict:
    """The config a layer type's rope reads: transformers 5 writes rope_parameters per layer
    type; older files rope_theta and rope_scaling for the full-attention layers, and for the
    sliding ones Gemma 3's rope_local_base_freq (default 10000), OLMo 3's rope_theta (as vLLM
    reads it; transformers 5.25 gives them 500000 whatever it says: its releases' base),
    unscaled."""
    rest = {k: v for k, v in raw.items() if k not in ("rope_parameters", "rope_scaling")}
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and isinstance(params.get(layer_type), dict):
        return {**rest, "rope_parameters": params[layer_type]}
    gemma = family == "gemma3"
    if layer_type == "sliding_attention":
        return {**rest, "rope_theta": raw.get("rope_local_base_freq", 10000.0) if gemma
                else raw.get("rope_theta", 500000.0)}
    return {**rest, "rope_theta": raw.get("rope_theta", 1e6 if gemma else 500000.0),
            "rope_scaling": raw.get("rope_scaling")}


def served(model: ModelConfig, max_model_len: int) -> ModelConfig:
    """The model as a context of `max_model_len` serves it: LongRoPE's long factors for every
    position when that passes its pretraining context, else the short ones, whatever a
    sequence's length (as vLLM decides, once for the deployment). transformers instead turns a
    whole sequence by the long factors once it grows past the pretraining context, keys
    included, which a cache of keys turned once cannot follow; the two agree on every sequence
    longer than that context, and on all of them when the context is within it. The choice is
    in the identity: KV turned one way is never served to the other."""
    rope = model.rope
    if rope.rope_type == "longrope" and max_model_len > rope.original_max_position_embeddings:
        return replace(model, rope=replace(rope, long=True))
    return model


def context_limit(model: ModelConfig, requested: Optional[int], name: str = "") -> int:
    """The longest sequence (prompt + output) served for a model: `requested` (max_model_len;
    None = the model's), at most its max_position_embeddings (with YaRN, its pretraining context
    times the scaling factor, as vLLM derives it). An explicit request above it is refused
    naming the field (as vLLM refuses one above the model's context), not quietly cut down."""
    from pd_runtime.config import FieldValueError

    longest = model.max_position_embeddings
    rope = model.rope
    if rope.rope_type == "yarn":
        longest = int(rope.original_max_position_embeddings * rope.factor)
    if requested and requested > longest:
        raise FieldValueError(("max_model_len",), f"{requested} exceeds {name or 'the model'}'s "
                              f"context ({longest} tokens: max_position_embeddings"
                              + (", with YaRN's factor" if rope.rope_type == "yarn" else "")
                              + ")")
    return min(requested or longest, longest)
