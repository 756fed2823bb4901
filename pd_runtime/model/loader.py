"""Loads an HF model directory (config.json + single or sharded safetensors, or PyTorch .bin
weights as older checkpoints ship them) into LlamaModel.

Every missing file, missing tensor or shape mismatch is a ModelLoadError naming file and tensor.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import torch
from safetensors import safe_open

from pd_runtime.model import gpt_oss, tensor_parallel
from pd_runtime.model.llama import LlamaModel
from pd_runtime.model.model_config import ModelConfig, ModelLoadError, load_model_config, served

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def cpu_has_fast_bf16() -> bool:
    """Whether this CPU multiplies bf16 natively (AVX512-BF16 or AMX). Without either, torch's
    bf16 matmul is emulated: ~40x slower than float32 on an AVX2-only EPYC (0.6 vs 25 GFLOP/s
    per core measured), which makes bf16 the wrong default there."""
    import platform

    if platform.machine().lower() not in ("x86_64", "amd64"):
        return True  # Arm and others: trust the checkpoint's dtype
    cpu = torch.cpu
    checks = [getattr(cpu, name, None) for name in ("_is_avx512_bf16_supported",
                                                    "_is_amx_tile_supported")]
    return any(check() for check in checks if check is not None)


def resolve_dtype(requested: str, cfg: ModelConfig, device: str = "cpu") -> torch.dtype:
    """`auto`: the checkpoint's dtype, except on a CPU where half precision is emulated (float16
    always; bfloat16 without AVX512-BF16 or AMX): float32 there; and on a GPU, where a float32
    checkpoint (or one that names no dtype) runs in half precision as vLLM runs it: bfloat16,
    float16 on a GPU older than Ampere, which only emulates bfloat16 (the GPU attention kernels
    take those two only)."""
    name = cfg.torch_dtype if requested == "auto" else requested
    dtype = _DTYPES.get(name.replace("torch.", ""), torch.float32)
    if requested == "auto" and torch.device(device).type == "cuda" and dtype == torch.float32:
        dtype = torch.bfloat16 if not torch.cuda.is_available() or \
            torch.cuda.get_device_capability(torch.device(device))[0] >= 8 else torch.float16
        log.info("dtype auto: the checkpoint's %s runs as %s on the GPU (set engine.dtype to "
                 "choose)", name, str(dtype).removeprefix("torch."))
    if requested == "auto" and torch.device(device).type == "cpu" and dtype != torch.float32:
        fast = dtype == torch.bfloat16 and cpu_has_fast_bf16()
        if not fast:
            log.info("dtype auto: %s is emulated on this CPU (no AVX512-BF16/AMX); using float32",
                     name)
            dtype = torch.float32
    return dtype


def _shard_files(model_dir: Path) -> dict[str, Path]:
    """tensor name -> weights file: safetensors (single, sharded by an index, or any *.safetensors),
    else PyTorch's pickled files (pytorch_model.bin, sharded by its index), as older checkpoints
    ship them; read with torch.load(weights_only=True), which runs no pickled code."""
    for index_name, single_name, pattern in (
            ("model.safetensors.index.json", "model.safetensors", "*.safetensors"),
            ("pytorch_model.bin.index.json", "pytorch_model.bin", "pytorch_model*.bin")):
        index = model_dir / index_name
        if index.is_file():
            weight_map = json.loads(index.read_text()).get("weight_map", {})
            files = {name: model_dir / fname for name, fname in weight_map.items()}
            for f in set(files.values()):
                if not f.is_file():
                    raise ModelLoadError(f"{f}: listed in {index.name} but missing")
            return files
        single = model_dir / single_name
        candidates = [single] if single.is_file() else sorted(model_dir.glob(pattern))
        if candidates:
            files = {}
            for f in candidates:
                for name in _open_weights(f).keys():
                    files[name] = f
            return files
    raise ModelLoadError(f"{model_dir}: no model.safetensors or *.safetensors found (nor "
                         "pytorch_model.bin)")


def _open_weights(path: Path):
    """A weights file as a mapping-like reader: `keys()` and `get_tensor(name)`."""
    if path.suffix == ".safetensors":
        return safe_open(str(path), framework="pt")
    try:
        return _PickledWeights(torch.load(str(path), map_location="cpu", weights_only=True,
                                          mmap=True))
    except Exception as exc:  # not a state dict torch can read without running code
        raise ModelLoadError(f"{path}: not a PyTorch weights file torch.load can read safely "
                             f"(weights_only): {exc}") from None


class _PickledWeights:
    def __init__(self, state: dict):
        self.state = state

    def keys(self):
        return self.state.keys()

    def get_tensor(self, name: str) -> torch.Tensor:
        return self.state[name]


# Where a checkpoint keeps its decoder: a causal LM's own, or the text model inside a
# multimodal one (Gemma 3 4B and up: the Hub's files, and transformers 5's save_pretrained).
TEXT_PREFIXES = ("model.", "language_model.model.", "model.language_model.")


class _TensorReader:
    def __init__(self, files: dict[str, Path], dtype: torch.dtype, device: str):
        self.files, self.dtype, self.device = files, dtype, device
        self._handles = {}
        self.read: set[str] = set()
        # Names are asked for as a causal LM's ("model.", "lm_head."); read under these.
        self.prefix = next((p for p in TEXT_PREFIXES if p + "embed_tokens.weight" in files),
                           "model.")
        self.head = "language_model.lm_head.weight" if self.prefix == "language_model.model." \
            else "lm_head.weight"

    def name(self, name: str) -> str:
        """The checkpoint's name of a causal LM's tensor."""
        if name == "lm_head.weight":
            return self.head
        return self.prefix + name.removeprefix("model.") if name.startswith("model.") else name

    def get(self, name: str, shape: tuple[int, ...],
            dtype: torch.dtype | None = None) -> torch.Tensor:
        """The tensor in the model's dtype (or `dtype`: packed bytes keep theirs)."""
        name = self.name(name)
        path = self.files.get(name)
        if path is None:
            raise ModelLoadError(f"tensor {name!r} missing from the checkpoint")
        if path not in self._handles:
            self._handles[path] = _open_weights(path)
        tensor = self._handles[path].get_tensor(name)
        self.read.add(name)
        if tuple(tensor.shape) != tuple(shape):
            raise ModelLoadError(f"{path.name}: tensor {name!r} has shape {tuple(tensor.shape)}, "
                                 f"config.json implies {tuple(shape)}")
        return tensor.to(device=self.device, dtype=dtype or self.dtype)


# A layer's norms by their checkpoint names: post_norm is the attention output's in Gemma's and
# OLMo's sandwich (the MLP input's in Llama's), pre_ff_norm the MLP input's there; GLM-4 names
# its four otherwise.
NORM_NAMES = {None: {"post_norm": "post_attention_layernorm.weight",
                     "pre_ff_norm": "pre_feedforward_layernorm.weight",
                     "post_ff_norm": "post_feedforward_layernorm.weight"},
              "glm4": {"post_norm": "post_self_attn_layernorm.weight",
                       "pre_ff_norm": "post_attention_layernorm.weight",
                       "post_ff_norm": "post_mlp_layernorm.weight"}}

GEMMA_NORMS = ("in_norm", "post_norm", "pre_ff_norm", "post_ff_norm", "q_norm", "k_norm")


def load_model(model_dir: str | Path, dtype: str = "auto", device: str = "cpu",
               max_positions: int | None = None, batch_invariant: bool = False,
               tp=None) -> LlamaModel:
    """The model, or with `tp` (a TensorParallelGroup) that rank's part of it: each layer is
    read whole and cut at once, so a rank holds at most one whole layer beside its part."""
    model_dir = Path(model_dir)
    cfg = load_model_config(model_dir)
    cfg = served(cfg, max_positions or cfg.max_position_embeddings)  # LongRoPE's factors
    tp_size, tp_rank = (tp.size, tp.rank) if tp is not None else (1, 0)
    reason = tensor_parallel.unsupported_reason(cfg, tp_size)
    if reason is not None:
        raise ModelLoadError(f"{model_dir}: tensor_parallel_size {tp_size}: {reason}")
    torch_dtype = resolve_dtype(dtype, cfg, device)
    reader = _TensorReader(_shard_files(model_dir), torch_dtype, device)
    h, d, inter = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    q_out, kv_out = cfg.num_heads * d, cfg.num_kv_heads * d

    def norm(name: str, size) -> torch.Tensor:
        """A norm's weight; with float32_norms in float32 (model/llama.py: rms_norm): gpt-oss's
        as the checkpoint stores them (transformers keeps them so), OLMo 2's rounded to the
        model's dtype first (as transformers holds them)."""
        shape = size if isinstance(size, tuple) else (size,)
        if cfg.family == "gpt_oss":
            return reader.get(name, shape, dtype=torch.float32)
        weight = reader.get(name, shape)
        return weight.float() if cfg.float32_norms else weight

    layers = []
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        if cfg.family == "phi3":  # stored fused, q|k|v and gate|up, as the decoder holds them
            qkv = reader.get(p + "self_attn.qkv_proj.weight", (q_out + 2 * kv_out, h))
        else:
            qkv = torch.cat([reader.get(p + f"self_attn.{n}_proj.weight", (o, h))
                             for n, o in (("q", q_out), ("k", kv_out), ("v", kv_out))], 0)
        names = NORM_NAMES.get(cfg.family, NORM_NAMES[None])
        layer = {"qkv": qkv, "o": reader.get(p + "self_attn.o_proj.weight", (h, q_out))}
        if cfg.block_norms != "parallel":  # (Cohere's one norm a layer is its input's)
            layer["post_norm"] = norm(p + names["post_norm"], h)
        if cfg.block_norms != "post":  # (OLMo 2 norms no block's input)
            layer["in_norm"] = norm(p + "input_layernorm.weight", h)
        if i in cfg.sparse_layers:
            layer.update(_experts(reader, cfg, p))
        elif cfg.family in ("phi3", "glm4"):  # stored fused, gate|up
            layer["gate_up"] = reader.get(p + "mlp.gate_up_proj.weight", (2 * inter, h))
            layer["down"] = reader.get(p + "mlp.down_proj.weight", (h, inter))
        else:
            layer["gate_up"] = torch.cat([reader.get(p + "mlp.gate_proj.weight", (inter, h)),
                                          reader.get(p + "mlp.up_proj.weight", (inter, h))], 0)
            layer["down"] = reader.get(p + "mlp.down_proj.weight", (h, inter))
        if cfg.qkv_bias:
            layer["qkv_bias"] = torch.cat(
                [reader.get(p + f"self_attn.{n}_proj.bias", (o,))
                 for n, o in (("q", q_out), ("k", kv_out), ("v", kv_out))], 0)
        if cfg.o_bias:
            layer["o_bias"] = reader.get(p + "self_attn.o_proj.bias", (h,))
        if cfg.mlp_bias:
            layer["gate_up_bias"] = torch.cat([reader.get(p + "mlp.gate_proj.bias", (inter,)),
                                               reader.get(p + "mlp.up_proj.bias", (inter,))], 0)
            layer["down_bias"] = reader.get(p + "mlp.down_proj.bias", (h,))
        if cfg.qk_norm:  # per head, or (OLMo 2) over all of them; Cohere's a weight a head
            layer["q_norm"] = norm(p + "self_attn.q_norm.weight", q_out if cfg.qk_norm_whole
                                   else (cfg.num_heads, d) if cfg.norm_kind == "layer" else d)
            layer["k_norm"] = norm(p + "self_attn.k_norm.weight", kv_out if cfg.qk_norm_whole
                                   else (cfg.num_kv_heads, d) if cfg.norm_kind == "layer" else d)
        if cfg.block_norms == "sandwich":  # the MLP's own input norm
            layer["pre_ff_norm"] = norm(p + names["pre_ff_norm"], h)
        if cfg.block_norms in ("sandwich", "post"):  # the norm of the MLP's output
            layer["post_ff_norm"] = norm(p + names["post_ff_norm"], h)
        if cfg.attn_sinks:  # float32, as the attention kernels read them
            layer["sinks"] = reader.get(p + "self_attn.sinks", (cfg.num_heads,)).float()
        layers.append(tensor_parallel.shard_layer(layer, cfg, tp_rank, tp_size))
        del layer
    weights = {
        "embed": reader.get("model.embed_tokens.weight", (cfg.vocab_size, h)),
        "final_norm": norm("model.norm.weight", h),
        "layers": layers,
    }
    if not cfg.tie_word_embeddings:
        if reader.head in reader.files:
            if tp_rank == 0:  # only the driver rank computes logits
                weights["lm_head"] = reader.get("lm_head.weight", (cfg.vocab_size, h))
        else:
            raise ModelLoadError(f"{model_dir}: config.json says tie_word_embeddings=false but "
                                 "tensor 'lm_head.weight' is missing")
    _check_all_read(reader, model_dir)
    if cfg.gemma_norms:  # offsets from 1, applied in float32 (model/llama.py: gemma_rms_norm)
        weights["final_norm"] = 1.0 + weights["final_norm"].float()
        for layer in layers:
            for name in GEMMA_NORMS:
                if name in layer:  # (Gemma 2 has no q/k norms)
                    layer[name] = 1.0 + layer[name].float()
    n_params = sum(t.numel() for t in reader_tensors(weights))
    log.info("loaded %s (%s, %.1fM params%s, %s) from %s", cfg.family, cfg.identity,
             n_params / 1e6, f" on rank {tp_rank} of {tp_size}" if tp_size > 1 else "",
             torch_dtype, model_dir)
    return LlamaModel(tensor_parallel.local_config(cfg, tp_size), weights, torch_dtype, device,
                      max_positions, batch_invariant, tp)


def _experts(reader: "_TensorReader", cfg: ModelConfig, prefix: str) -> dict:
    """A sparse layer's router ("router": [experts, hidden]) and experts stacked
    ("experts_gate_up": [experts, 2 x size, hidden], gate then up; "experts_down":
    [experts, hidden, size]), from the checkpoint's per-expert tensors: Mixtral's
    block_sparse_moe.experts.E.w1 (gate), w3 (up), w2 (down); Qwen3-MoE's mlp.experts.E
    gate_proj, up_proj, down_proj."""
    if cfg.family == "gpt_oss":  # stacked, transposed, with biases
        return gpt_oss.load_experts(reader, cfg, prefix)
    h, size, n = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts
    if cfg.family == "granitemoe":  # stacked as the decoder holds them (gate then up)
        block = prefix + "block_sparse_moe."
        return {"router": reader.get(block + "router.layer.weight", (n, h)),
                "experts_gate_up": reader.get(block + "input_linear.weight", (n, 2 * size, h)),
                "experts_down": reader.get(block + "output_linear.weight", (n, h, size))}
    if cfg.family == "mixtral":
        block, names = prefix + "block_sparse_moe.", ("w1", "w3", "w2")
    else:
        block, names = prefix + "mlp.", ("gate_proj", "up_proj", "down_proj")
    # Filled expert by expert: one expert's tensors at a time beside the stacked ones.
    gate_up = torch.empty(n, 2 * size, h, dtype=reader.dtype, device=reader.device)
    down = torch.empty(n, h, size, dtype=reader.dtype, device=reader.device)
    for e in range(n):
        expert = f"{block}experts.{e}."
        gate_up[e, :size] = reader.get(expert + names[0] + ".weight", (size, h))
        gate_up[e, size:] = reader.get(expert + names[1] + ".weight", (size, h))
        down[e] = reader.get(expert + names[2] + ".weight", (h, size))
    out = {"router": reader.get(block + "gate.weight", (n, h)),
           "experts_gate_up": gate_up, "experts_down": down}
    shared = cfg.shared_expert_size
    if shared:  # Qwen2-MoE: mlp.shared_expert (an MLP) and mlp.shared_expert_gate
        out["shared_gate_up"] = torch.cat([
            reader.get(block + "shared_expert.gate_proj.weight", (shared, h)),
            reader.get(block + "shared_expert.up_proj.weight", (shared, h))], 0)
        out["shared_down"] = reader.get(block + "shared_expert.down_proj.weight", (h, shared))
        out["shared_gate"] = reader.get(block + "shared_expert_gate.weight", (1, h))
    return out


# Tensors a checkpoint may hold that the computation does not use: rotary tables older exports
# saved, and the output projection a tied model saves beside its embeddings.
_UNUSED = re.compile(r"(.*\.)?rotary_emb\.inv_freq|(language_model\.)?lm_head\.weight")


def _check_all_read(reader: _TensorReader, model_dir: Path) -> None:
    """A decoder tensor left unread means a config field this loader does not know changes the
    computation (as attention_bias's o_proj bias once did): refused, naming them, rather than
    served wrongly. Others (a vision tower beside the text model) are only logged."""
    unread = sorted(n for n in reader.files if n not in reader.read and not _UNUSED.fullmatch(n))
    decoder = [n for n in unread if n.startswith(reader.prefix) or n == reader.head]
    if decoder:
        more = f" and {len(decoder) - 5} more" if len(decoder) > 5 else ""
        raise ModelLoadError(f"{model_dir}: the checkpoint holds tensors this model's config does "
                             f"not account for: {', '.join(decoder[:5])}{more}")
    if unread:
        log.warning("%s: %d tensors outside the decoder are not used (%s, ...)", model_dir,
                    len(unread), unread[0])


def reader_tensors(weights: dict):
    yield weights["embed"]
    yield weights["final_norm"]
    if "lm_head" in weights:
        yield weights["lm_head"]
    for layer in weights["layers"]:
        yield from layer.values()
