"""Attention over the paged KV cache: the torch reference path, correct everywhere, fast on CPU.

Layout of one layer's cache: `[2, num_blocks, kv_heads, block_size, head_dim]` (K, V). A block
is one contiguous chunk (what kv_transfer ships); inside it each KV head's tokens are
contiguous, so gathering a sequence's blocks head by head yields `[kv_heads, tokens, head_dim]`
ready for matmul without a transpose copy.
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


class DecodeKVBuffer:
    """Contiguous, padded K/V of the running decode batch, per layer `[B, kv_heads, cap, d]`.

    While the batch's requests stay the same, each step appends one token per sequence here
    instead of gathering every block from the paged cache again (measured: the gather was a
    quarter of a decode step). The paged cache stays the source of truth; any change of the
    batch rebuilds the buffer from it. Bounded by `max_bytes`; beyond it the gather path runs.
    """

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.request_ids: tuple = ()
        self.lens: list[int] = []
        self.k: list[torch.Tensor | None] = []
        self.v: list[torch.Tensor | None] = []
        self.capacity = 0
        self.rebuilds = 0

    def plan(self, request_ids: tuple, context_lens: list[int], num_layers: int,
             row_bytes: int) -> bool | None:
        """Decide for this step: False = append to the buffer, True = rebuild it from the
        paged cache, None = do not use it (too large)."""
        longest = max(context_lens)
        reuse = (request_ids == self.request_ids and longest <= self.capacity
                 and all(n == m + 1 for n, m in zip(context_lens, self.lens)))
        self.request_ids, self.lens = request_ids, list(context_lens)
        if reuse:
            return False
        capacity = -(-(longest + 32) // 32) * 32  # headroom: appends for ~32 steps
        if 2 * num_layers * len(request_ids) * capacity * row_bytes > self.max_bytes:
            self.request_ids, self.capacity = (), 0
            return None
        self.capacity = capacity
        self.k, self.v = [None] * num_layers, [None] * num_layers
        self.rebuilds += 1
        return True


@dataclass
class AttentionMetadata:
    """Everything attention needs for one step; decodes come first in the flat batch."""

    slot_mapping: torch.Tensor                 # [num_tokens] int64: block * block_size + offset
    num_decode_tokens: int = 0
    decode_block_tables: torch.Tensor | None = None  # [num_decodes, max_blocks] int64
    decode_context_lens: torch.Tensor | None = None  # [num_decodes] int64
    prefills: list[PrefillSegment] = field(default_factory=list)
    # Decode through the contiguous batch buffer (None: gather from the paged cache).
    decode_buffer: DecodeKVBuffer | None = None
    decode_buffer_rebuild: bool = False
    layer: int = 0  # set by the model before each layer's attention


def write_kv(kv_layer: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Scatter new K/V rows (`[num_tokens, kv_heads, head_dim]`) into their cache slots."""
    block_size = kv_layer.shape[3]
    blocks = torch.div(slot_mapping, block_size, rounding_mode="floor")
    offsets = slot_mapping - blocks * block_size
    kv_layer[0, blocks, :, offsets] = k
    kv_layer[1, blocks, :, offsets] = v


def gather_heads(kv_layer: torch.Tensor, block_tables: torch.Tensor):
    """K and V of sequences' blocks as `[batch, kv_heads, blocks * block_size, head_dim]`.

    One index_select per K and V over a `[num_blocks * kv_heads, block_size * head_dim]` view;
    measured several times faster on CPU than advanced indexing plus a transpose copy.
    """
    _, num_blocks, kv_heads, block_size, head_dim = kv_layer.shape
    tables = block_tables.view(-1, block_tables.shape[-1])
    batch, width = tables.shape
    heads = torch.arange(kv_heads, device=tables.device)
    rows = (tables[:, None, :] * kv_heads + heads[None, :, None]).reshape(-1)
    shape = (batch, kv_heads, width * block_size, head_dim)
    k = kv_layer[0].view(num_blocks * kv_heads, -1).index_select(0, rows).view(shape)
    v = kv_layer[1].view(num_blocks * kv_heads, -1).index_select(0, rows).view(shape)
    return k, v


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, masked: torch.Tensor,
            scale: float) -> torch.Tensor:
    """softmax(q k^T * scale) v with `masked` positions excluded; softmax in float32."""
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * scale
    probs = scores.masked_fill_(masked, float("-inf")).softmax(dim=-1).to(q.dtype)
    return torch.matmul(probs, v)


def _buffered_kv(kv_layer: torch.Tensor, meta: AttentionMetadata, k_new: torch.Tensor,
                 v_new: torch.Tensor):
    """This layer's decode K/V from the batch buffer, appending this step's token first."""
    buf, layer = meta.decode_buffer, meta.layer
    if meta.decode_buffer_rebuild:
        k, v = gather_heads(kv_layer, meta.decode_block_tables)  # includes this step's token
        batch, kv_heads, length, head_dim = k.shape
        width = min(length, buf.capacity)
        buf.k[layer] = k.new_zeros(batch, kv_heads, buf.capacity, head_dim)
        buf.v[layer] = v.new_zeros(batch, kv_heads, buf.capacity, head_dim)
        buf.k[layer][:, :, :width] = k[:, :, :width]
        buf.v[layer][:, :, :width] = v[:, :, :width]
    else:
        rows = torch.arange(k_new.shape[0])
        pos = meta.decode_context_lens - 1
        buf.k[layer][rows, :, pos] = k_new
        buf.v[layer][rows, :, pos] = v_new
    # The whole (contiguous) buffer: a slice would make matmul copy it; the mask hides the tail.
    return buf.k[layer], buf.v[layer]


def decode_attention(q: torch.Tensor, kv_layer: torch.Tensor, block_tables: torch.Tensor,
                     context_lens: torch.Tensor, scale: float, kv=None) -> torch.Tensor:
    """One query token per sequence: q `[B, heads, head_dim]` -> `[B, heads, head_dim]`.
    `kv`: this batch's K/V as `[B, kv_heads, L, d]` when already at hand (the buffer)."""
    batch, heads, head_dim = q.shape
    kv_heads = kv_layer.shape[2]
    k, v = kv if kv is not None else gather_heads(kv_layer, block_tables)
    # GQA without repeating K/V: a group's query heads ride along the query-length axis.
    qg = q.view(batch, kv_heads, heads // kv_heads, head_dim)
    positions = torch.arange(k.shape[2], device=q.device)
    masked = (positions[None, :] >= context_lens[:, None]).view(batch, 1, 1, -1)
    return _attend(qg, k, v, masked, scale).reshape(batch, heads, head_dim)


def prefill_attention(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                      kv_layer: torch.Tensor, seg: PrefillSegment, scale: float) -> torch.Tensor:
    """A chunk of n query tokens attending causally to the cached prefix and to itself."""
    n, heads, head_dim = q.shape
    kv_heads = k_new.shape[1]
    cached = seg.context_len - n
    qh = q.transpose(0, 1).unsqueeze(0)                  # [1, heads, n, d]
    if cached == 0:
        kh = k_new.transpose(0, 1).unsqueeze(0)          # [1, kv_heads, n, d]
        vh = v_new.transpose(0, 1).unsqueeze(0)
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale,
                                             enable_gqa=heads != kv_heads)
        return out.squeeze(0).transpose(0, 1)
    k, v = gather_heads(kv_layer, seg.block_table)       # [1, kv_heads, blocks*bs, d]
    k, v = k[:, :, :seg.context_len], v[:, :, :seg.context_len]
    qg = q.view(n, kv_heads, heads // kv_heads, head_dim).permute(1, 2, 0, 3)  # [kvh, G, n, d]
    qg = qg.reshape(1, kv_heads, -1, head_dim)
    rows = (torch.arange(n, device=q.device) + cached).repeat(heads // kv_heads)
    masked = torch.arange(seg.context_len, device=q.device)[None, :] > rows[:, None]
    out = _attend(qg, k, v, masked.view(1, 1, *masked.shape), scale)  # [1, kvh, G*n, d]
    return out.view(kv_heads, heads // kv_heads, n, head_dim).permute(2, 0, 1, 3) \
        .reshape(n, heads, head_dim)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_layer: torch.Tensor,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Write this step's K/V into the cache, then attend: `[T, heads, d]` -> `[T, heads, d]`."""
    write_kv(kv_layer, k, v, meta.slot_mapping)
    nd = meta.num_decode_tokens
    kv = _buffered_kv(kv_layer, meta, k[:nd], v[:nd]) if nd and meta.decode_buffer else None
    if nd and not meta.prefills:
        return decode_attention(q, kv_layer, meta.decode_block_tables,
                                meta.decode_context_lens, scale, kv)
    out = torch.empty_like(q)
    if nd:
        out[:nd] = decode_attention(q[:nd], kv_layer, meta.decode_block_tables,
                                    meta.decode_context_lens, scale, kv)
    for seg in meta.prefills:
        s, e = seg.start, seg.start + seg.num_tokens
        out[s:e] = prefill_attention(q[s:e], k[s:e], v[s:e], kv_layer, seg, scale)
    return out
