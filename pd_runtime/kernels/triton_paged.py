"""Attention over the paged KV cache in Triton: the GPU path of pd_runtime/kernels/attention.py.

Same cache layout and semantics as the torch reference there (`write_kv`, `decode_attention`,
`prefill_attention`); on CPU the tests run these kernels under `TRITON_INTERPRET=1`.
Softmax and accumulation are float32; outputs are in q's dtype.

Every launch takes only static shapes from the host (no `.item()`, no data-dependent sizes):
sequence lengths are read inside the kernels, so decode can be captured in a CUDA graph.
A sliding window (`window` > 0) limits each query to its last `window` keys, its own included;
the blocks wholly before it are not read. Attention sinks (gpt-oss: `sinks`, a float32 logit per
query head) join each row's softmax after its keys, with no value.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from pd_runtime.kernels.triton_launch import (DEFAULT_SM_COUNT, MIN_BLOCK_SIZE, MIN_GROUP_ROWS,
                                               NUM_WARPS, PREFILL_BLOCK_M, PREFILL_BLOCK_M_WIDE,
                                               decode_num_warps, default_num_splits,
                                               prefill_keys_per_tile, tile_keys)

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16)
SUPPORTED_HEAD_DIMS = (64, 128, 256)  # 256: Gemma 3 1B-12B
LOG2E = 1.4426950408889634


def unsupported_reason(dtype: torch.dtype, head_dim: int, block_size: int, num_heads: int,
                       num_kv_heads: int) -> str | None:
    """None when the kernels take this shape, else a message naming the field."""
    if dtype not in SUPPORTED_DTYPES:
        return f"dtype {dtype}: the Triton kernels take bfloat16 or float16"
    if head_dim not in SUPPORTED_HEAD_DIMS:
        return f"head_dim {head_dim}: the Triton kernels take 64, 128 or 256"
    if block_size < MIN_BLOCK_SIZE or block_size & (block_size - 1):
        return f"block_size {block_size}: 16 or 32 (or another power of two >= 16)"
    if num_kv_heads < 1 or num_heads < 1 or num_heads % num_kv_heads:
        return f"num_heads {num_heads}: not a multiple of num_kv_heads {num_kv_heads}"
    return None


def _check(kv_layer: torch.Tensor, q: torch.Tensor | None = None) -> None:
    """ValueError naming the field when the kernels do not take this cache (and query)."""
    _, _, kv_heads, block_size, head_dim = kv_layer.shape
    heads = kv_heads if q is None else q.shape[1]
    reason = unsupported_reason(kv_layer.dtype, head_dim, block_size, heads, kv_heads)
    if reason is None and kv_layer.stride(4) != 1:
        reason = "kv_layer: head_dim must be its contiguous dimension"
    if reason is None and q is not None and q.dtype != kv_layer.dtype:
        reason = f"q dtype {q.dtype} differs from the cache's {kv_layer.dtype}"
    if reason is None and q is not None and q.shape[2] != head_dim:
        reason = f"q head_dim {q.shape[2]} differs from the cache's {head_dim}"
    if reason is not None:
        raise ValueError(reason)


def _sinks(sinks: torch.Tensor | None, heads: int) -> torch.Tensor | None:
    """The sink logits as the kernels read them: `[heads]` float32, contiguous."""
    if sinks is None:
        return None
    if sinks.numel() != heads:
        raise ValueError(f"sinks: {sinks.numel()} logits for {heads} query heads")
    return sinks.reshape(heads).to(torch.float32).contiguous()


def _check_inner_strides(**tensors: torch.Tensor) -> None:
    """The kernels step only the outer dimensions by stride: the last one must be dense."""
    for name, tensor in tensors.items():
        if tensor.stride(-1) != 1:
            raise ValueError(f"{name}: its last dimension must be contiguous")


# ---------------------------------------------------------------------------------------------
# write_kv


@triton.jit
def _write_kv_kernel(k_ptr, v_ptr, kv_ptr, slot_ptr,
                     stride_kt, stride_kh, stride_vt, stride_vh,
                     stride_kv, stride_blk, stride_head, stride_tok,
                     BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr):
    token = tl.program_id(0)
    head = tl.program_id(1)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    dims = tl.arange(0, HEAD_DIM)
    keep = (dims < HEAD_DIM) & (slot >= 0)  # slot < 0: a padding row, nothing written
    block = slot // BLOCK_SIZE
    dest = kv_ptr + block * stride_blk + head * stride_head + (slot % BLOCK_SIZE) * stride_tok
    k = tl.load(k_ptr + token * stride_kt + head * stride_kh + dims, mask=keep)
    v = tl.load(v_ptr + token * stride_vt + head * stride_vh + dims, mask=keep)
    tl.store(dest + dims, k, mask=keep)
    tl.store(dest + stride_kv + dims, v, mask=keep)


def write_kv(kv_layer: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Scatter new K/V rows (`[T, kv_heads, head_dim]`) into their slots
    (`block * block_size + offset`); a slot < 0 is skipped (padding rows of a graph batch)."""
    _check(kv_layer)
    tokens, kv_heads, head_dim = k.shape
    if tokens == 0:
        return
    _check_inner_strides(k=k, v=v, slot_mapping=slot_mapping)
    _write_kv_kernel[(tokens, kv_heads)](
        k, v, kv_layer, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), *kv_layer.stride()[:4],
        BLOCK_SIZE=kv_layer.shape[3], HEAD_DIM=head_dim, num_warps=1)


# ---------------------------------------------------------------------------------------------
# Shared pieces of the attention kernels


@triton.jit
def _key_ptrs(kv_ptr, table_ptr, first, kv_head, lo, context_len, stride_blk, stride_head,
              stride_tok, KEYS: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Where positions first..first+KEYS-1 of a sequence (`first` a multiple of KEYS) sit in
    the cache, `[KEYS, HEAD_DIM]` pointers into K (V is `stride_kv` on), and which of them to
    read: lo <= position < context_len (the rest may hold anything, NaN included, and their
    table entries are not read). A tile within one cache block reads its table entry once;
    a wider one gathers each row through its own block's entry."""
    positions = first + tl.arange(0, KEYS)
    read = (positions >= lo) & (positions < context_len)
    rows = (positions % BLOCK_SIZE)[:, None] * stride_tok + tl.arange(0, HEAD_DIM)[None, :]
    if KEYS <= BLOCK_SIZE:  # (the loops visit only tiles with a key to read: a real block)
        block = tl.load(table_ptr + first // BLOCK_SIZE).to(tl.int64)
        base = kv_ptr + block * stride_blk + kv_head * stride_head
        return base + rows, read
    else:
        block = tl.load(table_ptr + positions // BLOCK_SIZE, mask=read, other=0).to(tl.int64)
        return kv_ptr + kv_head * stride_head + block[:, None] * stride_blk + rows, read


@triton.jit
def _dot(a, b, IN_F32: tl.constexpr):
    """tl.dot with float32 accumulation. IN_F32 (the interpreter only): triton 3.7.1's
    interpreter multiplies bfloat16 operands as their raw uint16 bits, so they go in as float32
    there; bf16/fp16 products are exact in float32, so the result is what the GPU computes."""
    if IN_F32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32))
    else:
        return tl.dot(a, b)


@triton.jit
def _online_softmax_step(q, k, v, visible, m_i, l_i, acc, qk_scale, DOT_IN_F32: tl.constexpr,
                         SOFTCAP: tl.constexpr):
    """One key block into the running (max, sum, output) of each query row, flash-attention
    style, in float32 and base 2 (`qk_scale` includes log2 e). A row none of whose keys is
    visible yet keeps max -inf and contributes nothing. SOFTCAP > 0 (Gemma 2): the scaled
    score s becomes SOFTCAP * tanh(s / SOFTCAP), tanh from exp(-2|x|) (no overflow)."""
    scores = _dot(q, tl.trans(k), DOT_IN_F32) * qk_scale
    if SOFTCAP > 0:
        x = scores / (1.4426950408889634 * SOFTCAP)
        e = tl.exp(-2.0 * tl.abs(x))
        t = (1.0 - e) / (1.0 + e)
        scores = SOFTCAP * tl.where(x < 0, -t, t) * 1.4426950408889634
    scores = tl.where(visible, scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    probs = tl.exp2(scores - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(probs, 1)
    acc = acc * alpha[:, None] + _dot(probs.to(v.dtype), v, DOT_IN_F32)
    return m_new, l_i, acc


@triton.jit
def _add_sink(m_i, l_i, acc, sink):
    """A sink logit (base 2) into each row's running max and sum: a key with no value."""
    m_new = tl.maximum(m_i, sink)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    return l_i * alpha + tl.exp2(sink - m_safe), acc * alpha[:, None]


# ---------------------------------------------------------------------------------------------
# decode: split-K over the context, then a reduction over the splits


@triton.jit
def _decode_split_kernel(q_ptr, kv_ptr, table_ptr, lens_ptr, out_ptr,
                         max_ptr, sum_ptr, part_ptr, sinks_ptr,
                         qk_scale, window,
                         stride_qb, stride_qh, stride_ob, stride_oh, stride_table,
                         stride_kv, stride_blk, stride_head, stride_tok,
                         GROUP: tl.constexpr, GROUP_ROWS: tl.constexpr,
                         NUM_SPLITS: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                         KEYS: tl.constexpr, HEAD_DIM: tl.constexpr, DOT_IN_F32: tl.constexpr,
                         SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr):
    """Program (sequence b, kv head, split): the group's query heads against the split's range
    of key tiles. One split writes the normalized output (its sinks added); several write
    float32 partials (running max, sum, unnormalized output) per (b, head, split) for the
    reduction (which adds the sinks)."""
    b = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    context_len = tl.load(lens_ptr + b).to(tl.int32)
    rows = tl.arange(0, GROUP_ROWS)
    heads = kv_head * GROUP + rows
    dims = tl.arange(0, HEAD_DIM)
    row_ok = rows < GROUP
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + dims[None, :],
                mask=row_ok[:, None], other=0.0)

    lo = tl.where(window > 0, tl.maximum(context_len - window, 0), 0)  # the first key seen
    # This sequence's key tiles (from the window's first) shared evenly by the splits: the
    # split count comes from the table's static width, the shares from the length (a CUDA
    # graph replays with any lengths and still spreads each sequence over every split).
    end_tile = (context_len + KEYS - 1) // KEYS
    lo_tile = lo // KEYS
    share = (end_tile - lo_tile + NUM_SPLITS - 1) // NUM_SPLITS
    first = lo_tile + split * share
    last = tl.minimum(first + share, end_tile)
    table = table_ptr + b * stride_table
    m_i = tl.full([GROUP_ROWS], float("-inf"), tl.float32)
    l_i = tl.full([GROUP_ROWS], 0.0, tl.float32)
    acc = tl.full([GROUP_ROWS, HEAD_DIM], 0.0, tl.float32)
    for tile in range(first, last):
        k_ptrs, read = _key_ptrs(kv_ptr, table, tile * KEYS, kv_head, lo, context_len,
                                 stride_blk, stride_head, stride_tok, KEYS, BLOCK_SIZE,
                                 HEAD_DIM)
        k = tl.load(k_ptrs, mask=read[:, None], other=0.0)
        v = tl.load(k_ptrs + stride_kv, mask=read[:, None], other=0.0)
        visible = read[None, :]
        m_i, l_i, acc = _online_softmax_step(q, k, v, visible, m_i, l_i, acc, qk_scale,
                                             DOT_IN_F32, SOFTCAP)

    if NUM_SPLITS == 1:
        if HAS_SINKS:
            sink = tl.load(sinks_ptr + heads, mask=row_ok, other=float("-inf")) * 1.4426950408889634
            l_i, acc = _add_sink(m_i, l_i, acc, sink)
        # context_len 0 (a padding row): l = 0, acc = 0 -> zeros, not NaN
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(out_ptr + b * stride_ob + heads[:, None] * stride_oh + dims[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
    else:
        part = (b * GROUP * tl.num_programs(1) + heads) * NUM_SPLITS + split
        tl.store(max_ptr + part, m_i, mask=row_ok)
        tl.store(sum_ptr + part, l_i, mask=row_ok)
        tl.store(part_ptr + part[:, None] * HEAD_DIM + dims[None, :], acc, mask=row_ok[:, None])


@triton.jit
def _decode_reduce_kernel(max_ptr, sum_ptr, part_ptr, sinks_ptr, out_ptr, stride_ob, stride_oh,
                          NUM_SPLITS: tl.constexpr, SPLITS_POW2: tl.constexpr,
                          HEAD_DIM: tl.constexpr, HAS_SINKS: tl.constexpr):
    """Program (sequence b, head): rescale each split's partial to the global max and sum (the
    head's sink among them). Empty splits (max -inf) weigh 0; a row with no keys at all writes
    zeros."""
    b = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    splits = tl.arange(0, SPLITS_POW2)
    dims = tl.arange(0, HEAD_DIM)
    base = (b * tl.num_programs(1) + head) * NUM_SPLITS
    ok = splits < NUM_SPLITS
    m = tl.load(max_ptr + base + splits, mask=ok, other=float("-inf"))
    s = tl.load(sum_ptr + base + splits, mask=ok, other=0.0)
    part = tl.load(part_ptr + (base + splits)[:, None] * HEAD_DIM + dims[None, :],
                   mask=ok[:, None], other=0.0)
    sink = tl.full([], float("-inf"), tl.float32)  # (none: weighs exp2(-inf) = 0)
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + head) * 1.4426950408889634
    m_all = tl.maximum(tl.max(m, 0), sink)
    m_safe = tl.where(m_all == float("-inf"), 0.0, m_all)
    weight = tl.exp2(m - m_safe)
    total = tl.sum(s * weight, 0) + tl.exp2(sink - m_safe)
    out = tl.sum(part * weight[:, None], 0) / tl.where(total == 0.0, 1.0, total)
    tl.store(out_ptr + b * stride_ob + head * stride_oh + dims, out.to(out_ptr.dtype.element_ty))


# Whether the kernels were decorated under TRITON_INTERPRET=1 (they run on CPU tensors).
INTERPRETED = not isinstance(_decode_split_kernel, triton.runtime.JITFunction)


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return DEFAULT_SM_COUNT


def decode_attention(q: torch.Tensor, kv_layer: torch.Tensor, block_tables: torch.Tensor,
                     context_lens: torch.Tensor, scale: float, *, out: torch.Tensor | None = None,
                     num_splits: int | None = None, window: int = 0,
                     softcap: float = 0.0, sinks: torch.Tensor | None = None,
                     keys_per_tile: int | None = None,
                     num_warps: int | None = None) -> torch.Tensor:
    """One query token per sequence (its key already written): q `[B, heads, head_dim]` ->
    `[B, heads, head_dim]`; keys 0..context_lens[b]-1 visible (the last `window` of them, with
    a window; `sinks`: `[heads]` float32 sink logits); context_len 0 writes zeros.
    num_splits, keys_per_tile and num_warps: the benchmarks' variants of the launch."""
    _check(kv_layer, q)
    batch, heads, head_dim = q.shape
    _, _, kv_heads, block_size, _ = kv_layer.shape
    if out is None:
        out = torch.empty_like(q)
    if batch == 0:
        return out
    _check_inner_strides(q=q, out=out, block_tables=block_tables, context_lens=context_lens)
    max_blocks = block_tables.shape[1]
    if num_splits is None:
        num_splits = default_num_splits(batch, kv_heads, max_blocks, _sm_count(q.device))
    num_splits = max(1, min(num_splits, max_blocks))
    group = heads // kv_heads
    if num_splits == 1:
        maxes = sums = parts = out  # unused
    else:
        maxes = torch.empty(batch, heads, num_splits, dtype=torch.float32, device=q.device)
        sums = torch.empty_like(maxes)
        parts = torch.empty(batch, heads, num_splits, head_dim, dtype=torch.float32,
                            device=q.device)
    sinks = _sinks(sinks, heads)
    _decode_split_kernel[(batch, kv_heads, num_splits)](
        q, kv_layer, block_tables, context_lens, out, maxes, sums, parts,
        out if sinks is None else sinks,
        scale * LOG2E, window,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        *kv_layer.stride()[:4],
        GROUP=group, GROUP_ROWS=max(MIN_GROUP_ROWS, triton.next_power_of_2(group)),
        NUM_SPLITS=num_splits, BLOCK_SIZE=block_size,
        KEYS=tile_keys(keys_per_tile, block_size), HEAD_DIM=head_dim,
        DOT_IN_F32=INTERPRETED, SOFTCAP=float(softcap), HAS_SINKS=sinks is not None,
        num_warps=num_warps or decode_num_warps(head_dim))
    if num_splits > 1:
        _decode_reduce_kernel[(batch, heads)](
            maxes, sums, parts, out if sinks is None else sinks, out, out.stride(0),
            out.stride(1), NUM_SPLITS=num_splits, SPLITS_POW2=triton.next_power_of_2(num_splits),
            HEAD_DIM=head_dim, HAS_SINKS=sinks is not None, num_warps=NUM_WARPS)
    return out


# ---------------------------------------------------------------------------------------------
# prefill: S segments (chunks, possibly after a cached prefix) in one launch


@triton.jit
def _prefill_kernel(q_ptr, kv_ptr, out_ptr, starts_ptr, lens_ptr, table_ptr, sinks_ptr,
                    qk_scale, window,
                    stride_qt, stride_qh, stride_ot, stride_oh, stride_table,
                    stride_kv, stride_blk, stride_head, stride_tok,
                    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                    KEYS: tl.constexpr, HEAD_DIM: tl.constexpr, DOT_IN_F32: tl.constexpr,
                    SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr):
    """Program (row tile, segment, kv head). A segment's rows are its (query token, query head
    of the group) pairs, token-major, so each key tile is loaded once for the whole group;
    row r is token r // GROUP, head kv_head * GROUP + r % GROUP. Keys are read KEYS at a time
    through the segment's table, up to the tile's last query position (causal)."""
    tile = tl.program_id(0)
    seg = tl.program_id(1)
    kv_head = tl.program_id(2)
    start = tl.load(starts_ptr + seg).to(tl.int64)
    num_queries = (tl.load(starts_ptr + seg + 1) - start).to(tl.int32)
    context_len = tl.load(lens_ptr + seg).to(tl.int32)
    cached = context_len - num_queries

    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    tokens = rows // GROUP
    heads = kv_head * GROUP + rows % GROUP
    row_ok = tokens < num_queries
    positions_q = cached + tokens
    dims = tl.arange(0, HEAD_DIM)
    q_ptrs = q_ptr + (start + tokens)[:, None] * stride_qt + heads[:, None] * stride_qh \
        + dims[None, :]
    q = tl.load(q_ptrs, mask=row_ok[:, None], other=0.0)

    # The tile's last query position bounds its keys; an empty tile loops zero times.
    last_token = tl.minimum((tile * BLOCK_M + BLOCK_M - 1) // GROUP, num_queries - 1)
    end = tl.where(tile * BLOCK_M < num_queries * GROUP, cached + last_token + 1, 0)
    # With a window, the tile's first query position bounds its keys from below as well.
    lo = tl.where(window > 0, tl.maximum(cached + (tile * BLOCK_M) // GROUP - window + 1, 0), 0)
    table = table_ptr + seg * stride_table
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, tl.float32)
    acc = tl.full([BLOCK_M, HEAD_DIM], 0.0, tl.float32)
    for key_tile in range(lo // KEYS, (end + KEYS - 1) // KEYS):
        k_ptrs, read = _key_ptrs(kv_ptr, table, key_tile * KEYS, kv_head, lo, end,
                                 stride_blk, stride_head, stride_tok, KEYS, BLOCK_SIZE,
                                 HEAD_DIM)
        k = tl.load(k_ptrs, mask=read[:, None], other=0.0)
        v = tl.load(k_ptrs + stride_kv, mask=read[:, None], other=0.0)
        positions_k = key_tile * KEYS + tl.arange(0, KEYS)
        visible = (positions_k[None, :] <= positions_q[:, None]) & read[None, :] \
            & ((window <= 0) | (positions_k[None, :] > positions_q[:, None] - window))
        m_i, l_i, acc = _online_softmax_step(q, k, v, visible, m_i, l_i, acc, qk_scale,
                                             DOT_IN_F32, SOFTCAP)

    if HAS_SINKS:
        sink = tl.load(sinks_ptr + heads, mask=row_ok, other=float("-inf")) * 1.4426950408889634
        l_i, acc = _add_sink(m_i, l_i, acc, sink)
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    o_ptrs = out_ptr + (start + tokens)[:, None] * stride_ot + heads[:, None] * stride_oh \
        + dims[None, :]
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


def prefill_attention(q: torch.Tensor, kv_layer: torch.Tensor, query_start_loc: torch.Tensor,
                      context_lens: torch.Tensor, block_tables: torch.Tensor, scale: float, *,
                      max_query_len: int, out: torch.Tensor | None = None,
                      window: int = 0, softcap: float = 0.0,
                      sinks: torch.Tensor | None = None,
                      keys_per_tile: int | None = None, rows_per_tile: int | None = None,
                      num_warps: int = NUM_WARPS) -> torch.Tensor:
    """S prefill segments in one launch; their own K/V already in the cache (write_kv first).
    q `[T, heads, head_dim]`: segment s is q[qsl[s]:qsl[s+1]], its query i at position
    context_lens[s] - n_s + i, attending causally to keys 0..that position (the last `window`
    of them, with a window). keys_per_tile, rows_per_tile (query rows per program, a power of
    two >= 16) and num_warps: the benchmarks' variants of the tiling."""
    _check(kv_layer, q)
    tokens, heads, head_dim = q.shape
    _, _, kv_heads, block_size, _ = kv_layer.shape
    if out is None:
        out = torch.empty_like(q)
    segments = context_lens.shape[0]
    if tokens == 0 or segments == 0 or max_query_len <= 0:
        return out
    _check_inner_strides(q=q, out=out, block_tables=block_tables, context_lens=context_lens,
                         query_start_loc=query_start_loc)
    group = heads // kv_heads
    block_m = rows_per_tile or (PREFILL_BLOCK_M if head_dim <= 128 else PREFILL_BLOCK_M_WIDE)
    if block_m < MIN_GROUP_ROWS or block_m & (block_m - 1):
        raise ValueError(f"rows_per_tile {block_m}: a power of two >= {MIN_GROUP_ROWS}")
    grid = (triton.cdiv(max_query_len * group, block_m), segments, kv_heads)
    sinks = _sinks(sinks, heads)
    _prefill_kernel[grid](
        q, kv_layer, out, query_start_loc, context_lens, block_tables,
        out if sinks is None else sinks, scale * LOG2E, window,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        *kv_layer.stride()[:4],
        GROUP=group, BLOCK_M=block_m, BLOCK_SIZE=block_size,
        KEYS=tile_keys(keys_per_tile, prefill_keys_per_tile(head_dim)), HEAD_DIM=head_dim,
        DOT_IN_F32=INTERPRETED, SOFTCAP=float(softcap), HAS_SINKS=sinks is not None,
        num_warps=num_warps)
    return out
