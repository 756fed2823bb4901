"""Rotary position embeddings: each family's inverse frequencies (default, linear, llama3, YaRN,
LongRoPE), the cos/sin tables the decoder indexes by position, and the rotation itself.
"""

from __future__ import annotations

import math

import torch

from pd_runtime.model.model_config import ModelConfig


def rotary_dim(cfg: ModelConfig) -> int:
    """The dimensions of each head rope turns (all but with Phi-3's partial_rotary_factor)."""
    return int(cfg.head_dim * cfg.rope.partial_rotary_factor)


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequencies after `rope_scaling` (default, linear, llama3, yarn, longrope's short
    or long factors: model_config.served), float32."""
    r = cfg.rope
    dim = rotary_dim(cfg)
    base = r.theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    if r.rope_type == "longrope":
        factors = r.long_factor if r.long else r.short_factor
        return 1.0 / (torch.tensor(factors, dtype=torch.float32) * base)
    inv = 1.0 / base
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
    if r.rope_type == "yarn":
        return _yarn_inv_freq(r, dim)
    return inv


def _yarn_inv_freq(r, dim: int) -> torch.Tensor:
    """YaRN: dimensions that turn more than beta_fast times over the pretraining context keep
    their frequency, those under beta_slow are interpolated by `factor`, a linear ramp between."""
    def dim_of(rotations: float) -> float:  # the dimension that turns `rotations` times
        return dim * math.log(r.original_max_position_embeddings / (rotations * 2 * math.pi)) \
            / (2 * math.log(r.theta))

    low, high = dim_of(r.beta_fast), dim_of(r.beta_slow)
    if r.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    base = r.theta ** (torch.arange(0, dim, 2).float() / dim)
    kept = 1 - ramp  # the share of each dimension's own (extrapolated) frequency
    return (1.0 / (r.factor * base)) * (1 - kept) + (1.0 / base) * kept


def rope_tables(cfg: ModelConfig, n_pos: int, device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of every position below `n_pos`, `[n_pos, rotary_dim]`, scaled by the rope's
    attention factor, in the model's dtype."""
    freqs = torch.arange(n_pos, dtype=torch.float32)[:, None] * rope_inv_freq(cfg)[None, :]
    emb = freqs.repeat_interleave(2, dim=-1) if cfg.rope.interleaved \
        else torch.cat((freqs, freqs), dim=-1)
    emb = emb.to(device)
    scale = rope_attention_scale(cfg)
    return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)


def rope_attention_scale(cfg: ModelConfig) -> float:
    """What cos and sin are multiplied by (YaRN's and LongRoPE's attention factor; 1
    otherwise)."""
    r = cfg.rope
    if r.rope_type not in ("yarn", "longrope"):
        return 1.0
    if r.attention_factor is not None:
        return r.attention_factor
    if r.rope_type == "longrope":
        return 1.0 if r.factor <= 1 else math.sqrt(
            1 + math.log(r.factor) / math.log(r.original_max_position_embeddings))

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if r.mscale and r.mscale_all_dim:
        return mscale(r.factor, r.mscale) / mscale(r.factor, r.mscale_all_dim)
    return mscale(r.factor)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               interleaved: bool = False) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin, rounded as that expression is, without the rotated copy
    (its halves are -x2 and x1; a + (-b) * s equals a - b * s exactly). With cos narrower than
    x (a partial rotary factor), its first dimensions turn and the rest pass through.
    `interleaved` (GLM-4's): pairs are neighbours (2i, 2i + 1), not halves, and the tables
    hold each pair's angle twice in a row (rope_tables)."""
    rot = cos.shape[-1]
    if rot < x.shape[-1]:
        out = x.clone()
        out[..., :rot] = apply_rope(x[..., :rot], cos, sin, interleaved)
        return out
    if interleaved:
        out = x * cos
        out[..., 0::2] -= x[..., 1::2] * sin[..., 0::2]
        out[..., 1::2] += x[..., 0::2] * sin[..., 1::2]
        return out
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    out = x * cos
    out[..., :half] -= x2 * sin[..., :half]
    out[..., half:] += x1 * sin[..., half:]
    return out
