"""Attention over the paged KV cache: the torch reference path, correct everywhere, fast on CPU.

Layout of one layer's cache: `[2, num_blocks, block_size, num_kv_heads, head_dim]` (K, V).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass
class PrefillSegment:
    """One sequence's prefill chunk inside the flat token batch."""

    start: int                 # offset of its first token in the flat batch
    num_tokens: int            # tokens computed this step
    context_len: int           # tokens in the KV after this step (cached prefix + chunk)
    block_table: torch.Tensor  # [num_blocks] int64, covers context_len


@dataclass
class AttentionMetadata:
    """Everything attention needs for one step; decodes come first in the flat batch."""

    slot_mapping: torch.Tensor                 # [num_tokens] int64: cache slot of each new token
    num_decode_tokens: int = 0
    decode_block_tables: torch.Tensor | None = None  # [num_decodes, max_blocks] int64
    decode_context_lens: torch.Tensor | None = None  # [num_decodes] int64
    prefills: list[PrefillSegment] = field(default_factory=list)


def write_kv(kv_layer: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Scatter new K/V rows ([num_tokens, kv_heads, head_dim]) into their cache slots."""
    _, num_blocks, block_size, kv_heads, head_dim = kv_layer.shape
    flat = kv_layer.view(2, num_blocks * block_size, kv_heads, head_dim)
    flat[0].index_copy_(0, slot_mapping, k)
    flat[1].index_copy_(0, slot_mapping, v)


def gather_kv(kv_layer: torch.Tensor, block_table: torch.Tensor, length: int):
    """K and V of one sequence, `[length, kv_heads, head_dim]` each, in token order."""
    _, _, block_size, kv_heads, head_dim = kv_layer.shape
    blocks = kv_layer[:, block_table]  # [2, n, block_size, kv_heads, head_dim]
    kv = blocks.reshape(2, -1, kv_heads, head_dim)[:, :length]
    return kv[0], kv[1]


def decode_attention(q: torch.Tensor, kv_layer: torch.Tensor, block_tables: torch.Tensor,
                     context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """One query token per sequence: q `[B, heads, head_dim]` -> `[B, heads, head_dim]`."""
    batch, heads, head_dim = q.shape
    _, _, block_size, kv_heads, _ = kv_layer.shape
    group = heads // kv_heads
    max_len = block_tables.shape[1] * block_size
    kv = kv_layer[:, block_tables]  # [2, B, max_blocks, block_size, kv_heads, head_dim]
    kv = kv.view(2, batch, max_len, kv_heads, head_dim).transpose(2, 3)
    # GQA without repeating K/V: the query heads of one group ride along the query-length axis.
    qg = q.view(batch, kv_heads, group, head_dim)
    positions = torch.arange(max_len, device=q.device)
    mask = (positions[None, :] < context_lens[:, None]).view(batch, 1, 1, max_len)
    out = F.scaled_dot_product_attention(qg, kv[0], kv[1], attn_mask=mask, scale=scale)
    return out.reshape(batch, heads, head_dim)


def prefill_attention(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                      kv_layer: torch.Tensor, seg: PrefillSegment, scale: float) -> torch.Tensor:
    """A chunk of n query tokens attending causally to the cached prefix and to itself."""
    n, heads, head_dim = q.shape
    kv_heads = k_new.shape[1]
    cached = seg.context_len - n
    if cached == 0:
        k, v = k_new, v_new
    else:
        k, v = gather_kv(kv_layer, seg.block_table, seg.context_len)
    qh = q.transpose(0, 1).unsqueeze(0)            # [1, heads, n, d]
    kh = k.transpose(0, 1).unsqueeze(0)            # [1, kv_heads, L, d]
    vh = v.transpose(0, 1).unsqueeze(0)
    gqa = heads != kv_heads
    if cached == 0:
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale,
                                             enable_gqa=gqa)
    else:
        rows = torch.arange(n, device=q.device)[:, None] + cached
        mask = torch.arange(seg.context_len, device=q.device)[None, :] <= rows
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale,
                                             enable_gqa=gqa)
    return out.squeeze(0).transpose(0, 1)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_layer: torch.Tensor,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Write this step's K/V into the cache, then attend: `[T, heads, d]` -> `[T, heads, d]`."""
    write_kv(kv_layer, k, v, meta.slot_mapping)
    out = torch.empty_like(q)
    nd = meta.num_decode_tokens
    if nd:
        out[:nd] = decode_attention(q[:nd], kv_layer, meta.decode_block_tables,
                                    meta.decode_context_lens, scale)
    for seg in meta.prefills:
        s, e = seg.start, seg.start + seg.num_tokens
        out[s:e] = prefill_attention(q[s:e], k[s:e], v[s:e], kv_layer, seg, scale)
    return out
