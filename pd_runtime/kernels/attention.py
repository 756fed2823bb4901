"""Attention over the paged KV cache: the torch reference path, correct everywhere, fast on CPU.

Layout of one layer's cache: `[2, num_blocks, kv_heads, block_size, head_dim]` (K, V). A block
is one contiguous chunk (what kv_transfer ships); inside it each KV head's tokens are
contiguous, so gathering a sequence's blocks head by head yields `[kv_heads, tokens, head_dim]`
ready for matmul without a transpose copy.

Sliding windows (Mistral, Phi-3-mini, the layers a Qwen2/SmolLM3 config marks): with
`meta.window` W > 0 a query at position p sees the keys at positions p - W + 1 .. p, as
transformers masks them; 0 is full causal attention.

Attention sinks (gpt-oss): with `meta.sinks`, each query head's learned logit joins the softmax
(its max and its total) but has no value row, so a row's probabilities sum below 1.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from pd_runtime.kernels import fixed_order, kv_quant, native


@dataclass
class PrefillSegment:
    """One sequence's prefill chunk inside the flat token batch."""

    start: int                 # offset of its first token in the flat batch
    num_tokens: int            # tokens computed this step
    context_len: int           # tokens in the KV after this step (cached prefix + chunk)
    block_table: torch.Tensor  # [num_blocks] int64, covers context_len


class DecodeKVBuffer:
    """Contiguous, padded K/V of the running decode batch: per layer `[rows, kv_heads, cap, d]`,
    batch entry i in row i, so the batch is the leading `[:B]` view (no copy for matmul).

    Each step appends one token per sequence here instead of gathering every block from the
    paged cache again (measured: the gather was a quarter of a decode step). A request that
    also decoded last step keeps its row (moved up when requests before it left); only requests
    new to the batch are gathered from the paged cache, which stays the source of truth.
    (Rebuilding the whole buffer whenever the batch changed cost ~0.1 s a step while prompts
    were still being admitted.) Rows grow by powers of two, `cap` with ~32 tokens of headroom;
    bounded by `max_bytes`, beyond which the gather path runs.
    """

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.request_ids: tuple = ()
        self.lens: list[int] = []
        self.k: list[torch.Tensor | None] = []
        self.v: list[torch.Tensor | None] = []
        self.capacity = 0      # tokens per row
        self.rows = 0
        self.rebuilds = 0      # reallocations (every row gathered again)
        # This step's work for each layer: rows moved (sources, destinations), rows gathered.
        self.moves: tuple[torch.Tensor, torch.Tensor] | None = None
        self.fresh: list[int] = []

    def plan(self, request_ids: tuple, context_lens: list[int], num_layers: int,
             row_bytes: int) -> list[int] | None:
        """Decide for this step; returns the batch indices to gather from the paged cache
        ([]: append only), or None: do not use the buffer (too large)."""
        old = {rid: (row, n) for row, (rid, n) in enumerate(zip(self.request_ids, self.lens))}
        self.request_ids, self.lens = tuple(request_ids), list(context_lens)
        batch, longest = len(request_ids), max(context_lens)
        self.moves = None
        if batch > self.rows or longest > self.capacity:
            capacity = self.capacity if longest <= self.capacity \
                else -(-(longest + 32) // 32) * 32  # headroom: appends for ~32 steps
            rows = max(self.rows, 1 << (batch - 1).bit_length())
            if 2 * num_layers * rows * capacity * row_bytes > self.max_bytes:
                rows = batch
            if 2 * num_layers * rows * capacity * row_bytes > self.max_bytes:
                self.request_ids, self.lens, self.capacity, self.rows = (), [], 0, 0
                self.k, self.v = [], []
                return None
            self.capacity, self.rows = capacity, rows
            self.k, self.v = [None] * num_layers, [None] * num_layers
            self.rebuilds += 1
            self.fresh = list(range(batch))
            return self.fresh
        src, dst, self.fresh = [], [], []
        for i, (rid, n) in enumerate(zip(request_ids, context_lens)):
            prev = old.get(rid)
            if prev is None or prev[1] + 1 != n:
                self.fresh.append(i)
            elif prev[0] != i:
                src.append(prev[0])
                dst.append(i)
        if src:
            self.moves = (torch.tensor(src), torch.tensor(dst))
        return self.fresh


@dataclass
class DeviceAttention:
    """Metadata of the GPU kernels (pd_runtime/kernels/triton_paged.py), all int32 on the device: the
    decodes' block tables and lengths, and the prefill segments as one varlen batch (query
    offsets relative to the first prefill token, context lengths, block tables)."""

    decode_block_tables: torch.Tensor  # [num_decodes, width]
    decode_context_lens: torch.Tensor  # [num_decodes]
    query_start_loc: torch.Tensor      # [num_segments + 1]
    context_lens: torch.Tensor         # [num_segments]
    block_tables: torch.Tensor         # [num_segments, width]
    max_query_len: int                 # a host int: the longest segment (the launch grid)


@dataclass
class AttentionMetadata:
    """Everything attention needs for one step; decodes come first in the flat batch."""

    slot_mapping: torch.Tensor                 # [num_tokens] int64: block * block_size + offset
    num_decode_tokens: int = 0
    # [num_decodes, max_blocks] int64; with the buffer, only its fresh rows' tables (or None).
    decode_block_tables: torch.Tensor | None = None
    decode_context_lens: torch.Tensor | None = None  # [num_decodes] int64
    prefills: list[PrefillSegment] = field(default_factory=list)
    # Decode through the contiguous batch buffer (None: gather from the paged cache).
    decode_buffer: DecodeKVBuffer | None = None
    # Decode key masks by window, each built by the first layer that needs it.
    decode_biases: dict = field(default_factory=dict)
    prefill_runs: list | None = None            # prefill_runs(prefills), built by the first layer
    layer: int = 0  # set by the model before each layer's attention, with its window
    window: int = 0
    softcap: float = 0.0  # Gemma 2: scores become softcap * tanh(score / softcap); 0: none
    sinks: torch.Tensor | None = None  # gpt-oss: the layer's `[heads]` float32 sink logits
    # Batch-invariant mode: every token through the fixed-order kernel (pd_runtime/kernels/fixed_order.py).
    fixed_order: fixed_order.FixedOrderRows | None = None
    # On CUDA: the Triton kernels module and their metadata (the paths above are not used).
    device_attention: DeviceAttention | None = None
    device_kernels: object = None
    # Called with a layer's index once its K/V are in the cache (the layer's attention ran):
    # a prefill worker ships each layer of a finishing prompt while the next ones compute.
    on_layer: object = None


def write_kv(kv_layer: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Scatter new K/V rows (`[num_tokens, kv_heads, head_dim]`) into their cache slots (an
    int8 cache takes them quantized, pd_runtime/kernels/kv_quant.py)."""
    if kv_layer.dtype == torch.int8:
        k, v = kv_quant.quantize(k), kv_quant.quantize(v)
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


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor,
            scale: float, softcap: float = 0.0, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(q k^T * scale + bias) v, softmax in float32; `bias` is 0 where a key is visible
    and -inf where not (every row keeps one key). Scaling and masking in one pass equals
    scale-then-masked_fill bit for bit (x * scale + 0 rounds once). Measured faster than the
    fused SDPA kernel for these shapes: for decode (2 query rows per head) ~2x. With a
    `softcap`, the scaled scores become softcap * tanh(score / softcap) first (transformers'
    order of operations). `sinks`: each query row's sink logit, broadcastable to
    `[..., rows, 1]`: a column of the softmax whose probability is dropped."""
    scores = torch.matmul(q, k.transpose(-1, -2))
    if softcap:
        scores = torch.tanh(scores * scale / softcap) * softcap
        logits = scores + bias
    else:
        logits = torch.add(bias, scores, alpha=scale)
    if sinks is None:
        return torch.matmul(logits.softmax(dim=-1).to(q.dtype), v)
    sink = sinks.to(logits.dtype).expand(*logits.shape[:-1], 1)
    probs = torch.cat([logits, sink], dim=-1).softmax(dim=-1)[..., :-1]
    return torch.matmul(probs.to(q.dtype), v)


def key_bias(visible: torch.Tensor) -> torch.Tensor:
    """The additive float32 mask of a bool `visible` mask."""
    return torch.zeros(visible.shape, device=visible.device).masked_fill_(~visible, float("-inf"))


def _buffered_kv(kv_layer: torch.Tensor, meta: AttentionMetadata, k_new: torch.Tensor,
                 v_new: torch.Tensor):
    """This layer's decode K/V `[B, kv_heads, cap, d]` from the batch buffer after this step's
    moves, gathers (`meta.decode_block_tables`: the fresh rows' tables) and appends."""
    buf, layer = meta.decode_buffer, meta.layer
    batch = k_new.shape[0]
    if buf.k[layer] is None:  # zeros, not empty: masked tails must hold finite values
        _, _, kv_heads, _, head_dim = kv_layer.shape
        buf.k[layer] = kv_layer.new_zeros(buf.rows, kv_heads, buf.capacity, head_dim)
        buf.v[layer] = kv_layer.new_zeros(buf.rows, kv_heads, buf.capacity, head_dim)
    bk, bv = buf.k[layer], buf.v[layer]
    if buf.moves is not None:  # read all sources before writing: a row may be both
        src, dst = buf.moves
        bk.index_copy_(0, dst, bk.index_select(0, src))
        bv.index_copy_(0, dst, bv.index_select(0, src))
    if buf.fresh:
        k, v = gather_heads(kv_layer, meta.decode_block_tables)  # includes this step's token
        width = min(k.shape[2], buf.capacity)
        first, last = buf.fresh[0], buf.fresh[-1]
        if last - first + 1 == len(buf.fresh):  # a run of rows (the usual: new arrivals last)
            bk[first:last + 1, :, :width] = k[:, :, :width]
            bv[first:last + 1, :, :width] = v[:, :, :width]
        else:
            rows = torch.tensor(buf.fresh)
            bk[rows, :, :width] = k[:, :, :width]
            bv[rows, :, :width] = v[:, :, :width]
    rows = torch.arange(batch)
    pos = meta.decode_context_lens - 1
    bk[rows, :, pos] = k_new
    bv[rows, :, pos] = v_new
    # The whole rows (contiguous): a slice of the length would make matmul copy it; the mask
    # hides the tail.
    return bk[:batch], bv[:batch]


def decode_attention(q: torch.Tensor, kv_layer: torch.Tensor, block_tables: torch.Tensor,
                     context_lens: torch.Tensor, scale: float, kv=None,
                     bias: torch.Tensor | None = None, window: int = 0,
                     softcap: float = 0.0, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """One query token per sequence: q `[B, heads, head_dim]` -> `[B, heads, head_dim]`.
    `kv`: this batch's K/V as `[B, kv_heads, L, d]` when already at hand (the buffer);
    `bias`: its `[B, 1, 1, L]` key mask (see decode_bias) when already built (one per step);
    `window`: the last `window` keys only (0: all); `sinks`: `[heads]` sink logits."""
    batch, heads, head_dim = q.shape
    kv_heads = kv_layer.shape[2]
    k, v = kv if kv is not None else gather_heads(kv_layer, block_tables)
    # GQA without repeating K/V: a group's query heads ride along the query-length axis.
    qg = q.view(batch, kv_heads, heads // kv_heads, head_dim)
    if uses_native_decode(q) and not softcap and sinks is None:
        out = native.decode_attention_bf16(qg, k, v, context_lens, scale, window)
        if out is not None:
            return out.view(batch, heads, head_dim)
    if bias is None or bias.shape[-1] != k.shape[2]:
        bias = decode_bias(context_lens, k.shape[2], window)
    group_sinks = None if sinks is None else sinks.view(kv_heads, heads // kv_heads, 1)
    return _attend(qg, k, v, bias, scale, softcap, group_sinks).reshape(batch, heads, head_dim)


def uses_native_decode(q: torch.Tensor) -> bool:
    """bf16 decode on the CPU runs the native kernel (pd_runtime/kernels/native.py) when it built: it reads
    K and V once, where batched matmuls over 2-row queries pay per-matrix overhead (measured
    ~0.5 ms less per layer at batch 64, ~300 keys). Otherwise the torch path below."""
    return q.dtype == torch.bfloat16 and q.device.type == "cpu" and native.available()


def decode_bias(context_lens: torch.Tensor, length: int, window: int = 0) -> torch.Tensor:
    """`[B, 1, 1, length]`: key j is visible to sequence b iff j < context_lens[b] (and
    j >= context_lens[b] - window, with a window)."""
    positions = torch.arange(length, device=context_lens.device)
    visible = positions[None, :] < context_lens[:, None]
    if window:
        visible &= positions[None, :] >= (context_lens - window)[:, None]
    return key_bias(visible).view(-1, 1, 1, length)


def window_visible(visible: torch.Tensor, keys: torch.Tensor, rows: torch.Tensor,
                   window: int) -> torch.Tensor:
    """A causal `visible` mask (query positions `rows`, key positions `keys`) narrowed to the
    last `window` keys of each row (unchanged for 0)."""
    return visible & (keys[None, :] > rows[:, None] - window) if window else visible


def prefill_attention(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                      kv_layer: torch.Tensor, seg: PrefillSegment, scale: float,
                      window: int = 0, softcap: float = 0.0,
                      sinks: torch.Tensor | None = None) -> torch.Tensor:
    """A chunk of n query tokens attending causally to the cached prefix and to itself."""
    n, heads, head_dim = q.shape
    cached = seg.context_len - n
    if cached == 0:
        return causal_prefill(q, k_new, v_new, 1, scale, window, softcap, sinks)
    k, v = gather_heads(kv_layer, seg.block_table)       # [1, kv_heads, blocks*bs, d]
    k, v = k[:, :, :seg.context_len], v[:, :, :seg.context_len]
    return _grouped_attend(q.view(1, n, heads, head_dim), k, v, cached, scale, window,
                           softcap, sinks).reshape(n, heads, head_dim)


def _grouped_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, first: int, scale: float,
                    window: int, softcap: float, sinks: torch.Tensor | None) -> torch.Tensor:
    """q `[S, n, heads, d]` (query i at position first + i), k/v `[S, kv_heads, L, d]` ->
    `[S, n, heads, d]`, causal (and windowed) over the keys. The query heads of a KV group are
    stacked along the rows: measured faster than SDPA with GQA."""
    seqs, n, heads, head_dim = q.shape
    kv_heads = k.shape[1]
    group = heads // kv_heads
    qg = q.view(seqs, n, kv_heads, group, head_dim).permute(0, 2, 3, 1, 4) \
        .reshape(seqs, kv_heads, group * n, head_dim)
    rows = (torch.arange(n, device=q.device) + first).repeat(group)
    keys = torch.arange(k.shape[2], device=q.device)
    visible = window_visible(keys[None, :] <= rows[:, None], keys, rows, window)
    if sinks is not None:  # rows are (head of the group, token): each head's for its n rows
        sinks = sinks.view(kv_heads, group, 1, 1).expand(kv_heads, group, n, 1) \
            .reshape(kv_heads, group * n, 1)
    out = _attend(qg, k, v, key_bias(visible), scale, softcap, sinks)  # [S, kvh, G*n, d]
    return out.view(seqs, kv_heads, group, n, head_dim).permute(0, 3, 1, 2, 4)


def causal_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_seqs: int,
                   scale: float, window: int = 0, softcap: float = 0.0,
                   sinks: torch.Tensor | None = None) -> torch.Tensor:
    """`num_seqs` fresh prompts of equal length, back to back in the flat batch, each causal
    over itself: one SDPA call for all of them (views, no copies) instead of one per prompt
    (with a softcap or sinks, which SDPA does not take: `_attend`, the query heads of a KV
    group along the rows as prefill_attention stacks them)."""
    tokens, heads, head_dim = q.shape
    n = tokens // num_seqs
    window = window if window < n else 0  # a window the prompt does not pass changes nothing
    if softcap or sinks is not None:
        kv_heads = k.shape[1]
        out = _grouped_attend(q.view(num_seqs, n, heads, head_dim),
                              k.view(num_seqs, n, kv_heads, head_dim).transpose(1, 2),
                              v.view(num_seqs, n, kv_heads, head_dim).transpose(1, 2),
                              0, scale, window, softcap, sinks)
        return out.reshape(tokens, heads, head_dim)
    if q.dtype == torch.bfloat16 and q.device.type == "cpu" and not window:
        # the native kernel: ~3x torch's flash kernel on bf16 here (bf16 pair products)
        out = native.prefill_attention_bf16(q, k, v, num_seqs, scale)
        if out is not None:
            return out
    mask = None
    if window:
        positions = torch.arange(n, device=q.device)
        mask = window_visible(positions[None, :] <= positions[:, None], positions, positions,
                              window)
    out = F.scaled_dot_product_attention(
        q.view(num_seqs, n, heads, head_dim).transpose(1, 2),
        k.view(num_seqs, n, -1, head_dim).transpose(1, 2),
        v.view(num_seqs, n, -1, head_dim).transpose(1, 2),
        attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=heads != k.shape[1])
    return out.transpose(1, 2).reshape(tokens, heads, head_dim)


def prefill_runs(prefills: list[PrefillSegment]) -> list[tuple[int, int, PrefillSegment]]:
    """Group the segments: (start, count, seg) where count > 0 means `count` back-to-back
    fresh prompts of seg's length (one batched causal call) and 0 a chunk with cached KV."""
    runs: list[tuple[int, int, PrefillSegment]] = []
    for seg in prefills:
        fresh = seg.context_len == seg.num_tokens
        if runs and fresh and runs[-1][1] and runs[-1][2].num_tokens == seg.num_tokens \
                and runs[-1][0] + runs[-1][1] * seg.num_tokens == seg.start:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1, runs[-1][2])
        else:
            runs.append((seg.start, 1 if fresh else 0, seg))
    return runs


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_layer: torch.Tensor,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Write this step's K/V into the cache, then attend: `[T, heads, d]` -> `[T, heads, d]`."""
    if meta.device_attention is not None:
        return device_paged_attention(q, k, v, kv_layer, meta, scale)
    write_kv(kv_layer, k, v, meta.slot_mapping)
    window, softcap, sinks = meta.window, meta.softcap, meta.sinks
    if meta.fixed_order is not None:
        return fixed_order.attend(q, kv_layer, meta.fixed_order, scale, window, softcap, sinks)
    nd = meta.num_decode_tokens
    decoded = None
    if nd:
        kv = _buffered_kv(kv_layer, meta, k[:nd], v[:nd]) if meta.decode_buffer else None
        bias = meta.decode_biases.get(window)
        if bias is None and (softcap or sinks is not None or not uses_native_decode(q)):
            length = kv[0].shape[2] if kv is not None \
                else meta.decode_block_tables.shape[1] * kv_layer.shape[3]
            bias = meta.decode_biases[window] = decode_bias(meta.decode_context_lens, length,
                                                            window)
        decoded = decode_attention(q[:nd], kv_layer, meta.decode_block_tables,
                                   meta.decode_context_lens, scale, kv, bias, window, softcap,
                                   sinks)
        if not meta.prefills:
            return decoded
    if meta.prefill_runs is None:
        meta.prefill_runs = prefill_runs(meta.prefills)
    out = torch.empty_like(q)
    if nd:
        out[:nd] = decoded
    for start, count, seg in meta.prefill_runs:
        if count:
            e = start + count * seg.num_tokens
            out[start:e] = causal_prefill(q[start:e], k[start:e], v[start:e], count, scale,
                                          window, softcap, sinks)
        else:
            e = start + seg.num_tokens
            out[start:e] = prefill_attention(q[start:e], k[start:e], v[start:e], kv_layer, seg,
                                             scale, window, softcap, sinks)
    return out


def device_paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           kv_layer: torch.Tensor, meta: AttentionMetadata,
                           scale: float) -> torch.Tensor:
    """The GPU path: the same computation as paged_attention's, by the Triton kernels, which
    read the blocks in place (the decodes first in the batch, then the prefill segments)."""
    kernels, dev, nd = meta.device_kernels, meta.device_attention, meta.num_decode_tokens
    kernels.write_kv(kv_layer, k, v, meta.slot_mapping)
    out = torch.empty_like(q)
    if nd:
        kernels.decode_attention(q[:nd], kv_layer, dev.decode_block_tables,
                                 dev.decode_context_lens, scale, out=out[:nd],
                                 window=meta.window, softcap=meta.softcap, sinks=meta.sinks)
    if q.shape[0] > nd:
        kernels.prefill_attention(q[nd:], kv_layer, dev.query_start_loc, dev.context_lens,
                                  dev.block_tables, scale, max_query_len=dev.max_query_len,
                                  out=out[nd:], window=meta.window, softcap=meta.softcap,
                                  sinks=meta.sinks)
    return out
