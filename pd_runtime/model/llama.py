"""One decoder for the Llama family (Llama, Mistral, Qwen2 with qkv bias, Qwen3 with q/k norm).

Runs a flat batch of tokens from many sequences against the paged KV cache; weights are fused
(qkv, gate_up) at load time so every layer is four matmuls.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.attention import AttentionMetadata, paged_attention
from pd_runtime.model.model_config import ModelConfig


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Same op order as the reference implementation: normalise in fp32, cast, then scale.
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequencies after `rope_scaling` (default, linear, llama3), float32."""
    r = cfg.rope
    dim = cfg.head_dim
    inv = 1.0 / (r.theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if r.rope_type == "linear":
        return inv / r.factor
    if r.rope_type == "llama3":
        old_len = r.original_max_position_embeddings
        low_wavelen = old_len / r.low_freq_factor
        high_wavelen = old_len / r.high_freq_factor
        wavelen = 2 * torch.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / r.factor, inv)
        smooth = (old_len / wavelen - r.low_freq_factor) / (r.high_freq_factor - r.low_freq_factor)
        smoothed = (1 - smooth) * scaled / r.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled)
    return inv


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class LlamaModel:
    """Holds the fused weights; `forward` returns final hidden states for the flat batch."""

    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype,
                 device: str = "cpu", max_positions: int | None = None):
        self.cfg = cfg
        self.dtype = dtype
        self.device = device
        self.scale = cfg.head_dim ** -0.5
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        w = weights
        self.embed = w["embed"]
        self.final_norm = w["final_norm"]
        self.lm_head = w.get("lm_head", self.embed)
        self.layers = w["layers"]
        n_pos = max_positions or cfg.max_position_embeddings
        freqs = torch.arange(n_pos, dtype=torch.float32)[:, None] * rope_inv_freq(cfg)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1).to(device)
        self.cos = emb.cos().to(dtype)
        self.sin = emb.sin().to(dtype)

    def _attention(self, layer: dict, x: torch.Tensor, cos, sin, kv_layer, meta) -> torch.Tensor:
        cfg = self.cfg
        qkv = F.linear(x, layer["qkv"], layer.get("qkv_bias"))
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, cfg.num_heads, cfg.head_dim)
        k = k.view(-1, cfg.num_kv_heads, cfg.head_dim)
        v = v.view(-1, cfg.num_kv_heads, cfg.head_dim)
        if cfg.qk_norm:
            q = rms_norm(q, layer["q_norm"], cfg.rms_norm_eps)
            k = rms_norm(k, layer["k_norm"], cfg.rms_norm_eps)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        out = paged_attention(q, k, v.contiguous(), kv_layer, meta, self.scale)
        return F.linear(out.reshape(-1, self.q_size), layer["o"])

    def _mlp(self, layer: dict, x: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(x, layer["gate_up"]).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, layer["down"])

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        eps = self.cfg.rms_norm_eps
        h = F.embedding(input_ids, self.embed)
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        for index, (layer, kv_layer) in enumerate(zip(self.layers, kv_caches)):
            meta.layer = index
            h = h + self._attention(layer, rms_norm(h, layer["in_norm"], eps), cos, sin,
                                    kv_layer, meta)
            h = h + self._mlp(layer, rms_norm(h, layer["post_norm"], eps))
        return rms_norm(h, self.final_norm, eps)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.lm_head).float()
