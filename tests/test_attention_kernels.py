"""Paged attention kernels against dense attention computed from the same K/V, float32."""

from __future__ import annotations

import pytest
import torch

from pd_runtime.kernels.attention import (AttentionMetadata, PrefillSegment, decode_attention,
                               paged_attention, prefill_attention, write_kv)


def dense(q, k, v, causal_offset, scale):
    """q [n, H, d], k/v [L, kvh, d]; query i sees keys <= causal_offset + i."""
    heads, kv_heads = q.shape[1], k.shape[1]
    k = k.repeat_interleave(heads // kv_heads, dim=1)
    v = v.repeat_interleave(heads // kv_heads, dim=1)
    scores = torch.einsum("nhd,lhd->hnl", q, k) * scale
    n, length = q.shape[0], k.shape[0]
    allowed = torch.arange(length)[None, :] <= (torch.arange(n)[:, None] + causal_offset)
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hnl,lhd->nhd", scores.softmax(-1), v)


def make_cache(num_blocks=40, kv_heads=2, block_size=4, head_dim=8):
    return torch.zeros(2, num_blocks, kv_heads, block_size, head_dim)


def fill(cache, block_table, k, v):
    bs = cache.shape[3]
    slots = torch.tensor([block_table[i // bs] * bs + i % bs for i in range(k.shape[0])])
    write_kv(cache, k, v, slots)


def test_decode_matches_dense():
    torch.manual_seed(0)
    cache = make_cache()
    gen = torch.randperm(40).tolist()
    lens = [1, 5, 13, 16]
    tables, ks, vs = [], [], []
    for n in lens:
        table = [gen.pop() for _ in range(-(-n // 4))]
        k, v = torch.randn(n, 2, 8), torch.randn(n, 2, 8)
        fill(cache, table, k, v)
        tables.append(table)
        ks.append(k)
        vs.append(v)
    width = max(map(len, tables))
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    q = torch.randn(len(lens), 4, 8)
    out = decode_attention(q, cache, bt, torch.tensor(lens), 0.3)
    for i, n in enumerate(lens):
        ref = dense(q[i:i + 1], ks[i], vs[i], n - 1, 0.3)
        torch.testing.assert_close(out[i:i + 1], ref, rtol=1e-5, atol=1e-5)


def test_prefill_chunk_with_cached_prefix_matches_dense():
    torch.manual_seed(1)
    cache = make_cache()
    table = [7, 3, 30, 12, 0]
    total, chunk = 18, 7
    k, v = torch.randn(total, 2, 8), torch.randn(total, 2, 8)
    fill(cache, table, k[:total - chunk], v[:total - chunk])
    q = torch.randn(chunk, 4, 8)
    seg = PrefillSegment(0, chunk, total, torch.tensor(table))
    meta = AttentionMetadata(slot_mapping=torch.tensor(
        [table[p // 4] * 4 + p % 4 for p in range(total - chunk, total)]), prefills=[seg])
    out = paged_attention(q, k[-chunk:], v[-chunk:], cache, meta, 0.3)
    torch.testing.assert_close(out, dense(q, k, v, total - chunk, 0.3), rtol=1e-5, atol=1e-5)
    # A fresh prompt (no cached prefix) takes the causal fast path; same answer.
    q2 = torch.randn(total, 4, 8)
    seg2 = PrefillSegment(0, total, total, torch.tensor(table))
    torch.testing.assert_close(prefill_attention(q2, k, v, cache, seg2, 0.3),
                               dense(q2, k, v, 0, 0.3), rtol=1e-5, atol=1e-5)


def test_decode_buffer_keeps_rows_and_matches_the_gather_path():
    from pd_runtime.kernels.attention import DecodeKVBuffer

    torch.manual_seed(2)
    cache = make_cache(num_blocks=64)
    buf = DecodeKVBuffer(max_bytes=1 << 30)
    tables = {"a": [5, 9, 2, 40, 41], "b": [7, 1, 30, 31, 32], "c": [11, 12, 13, 14, 15],
              "d": [16, 17, 18, 19, 20], "e": [21, 22, 23, 24, 25]}
    lens = {"a": 3, "b": 6, "c": 9, "d": 4, "e": 7}
    for name, n in lens.items():
        fill(cache, tables[name], torch.randn(n - 1, 2, 8), torch.randn(n - 1, 2, 8))
    batches = [("a", "b"), ("a", "b"), ("a", "b", "c"), ("a", "b", "c"), ("b", "c"),
               ("c", "b"), ("c", "b", "a"), ("d", "c", "e", "b")]
    fresh_rows = []
    for batch in batches:
        q = torch.randn(len(batch), 4, 8)
        k, v = torch.randn(len(batch), 2, 8), torch.randn(len(batch), 2, 8)
        ctx = [lens[n] for n in batch]
        bt = torch.tensor([tables[n] for n in batch])
        slots = torch.tensor([tables[n][(c - 1) // 4] * 4 + (c - 1) % 4
                              for n, c in zip(batch, ctx)])
        fresh = buf.plan(batch, ctx, 1, 2 * 8 * 4)
        fresh_rows.append(fresh)
        meta = AttentionMetadata(slot_mapping=slots, num_decode_tokens=len(batch),
                                 decode_block_tables=bt[fresh] if fresh else None,
                                 decode_context_lens=torch.tensor(ctx), decode_buffer=buf)
        got = paged_attention(q, k, v, cache, meta, 0.3)
        want = decode_attention(q, cache, bt, torch.tensor(ctx), 0.3)  # gathers (K/V written)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        for n in batch:
            lens[n] += 1
    # Gathers only rows new to the batch (all of them when the rows outgrow the buffer); rows
    # that stay are appended to and moved, also when requests leave or reorder.
    assert fresh_rows == [[0, 1], [], [0, 1, 2], [], [], [], [2], [0, 2]]
    assert buf.rebuilds == 2 and buf.rows == 4


def test_mixed_step_with_batched_fresh_prompts_matches_dense():
    """Decodes, three fresh prompts of one length (one batched causal call), a fresh prompt of
    another length and a chunk with cached KV, all in one flat batch, as the runner builds it."""
    from pd_runtime.kernels.attention import prefill_runs

    torch.manual_seed(3)
    cache = make_cache(num_blocks=80)
    free = torch.randperm(80).tolist()
    # (cached tokens, new tokens) per sequence; decodes first, as the runner orders them.
    shapes = [(5, 1), (9, 1), (0, 6), (0, 6), (0, 6), (0, 3), (7, 4)]
    q_parts, k_parts, v_parts, slots, segs, refs = [], [], [], [], [], []
    start = 0
    for cached, n in shapes:
        total = cached + n
        table = [free.pop() for _ in range(-(-total // 4))]
        k, v = torch.randn(total, 2, 8), torch.randn(total, 2, 8)
        if cached:
            fill(cache, table, k[:cached], v[:cached])
        q = torch.randn(n, 4, 8)
        q_parts.append(q)
        k_parts.append(k[cached:])
        v_parts.append(v[cached:])
        slots += [table[p // 4] * 4 + p % 4 for p in range(cached, total)]
        if n > 1:
            segs.append(PrefillSegment(start, n, total, torch.tensor(table)))
        refs.append((q, k, v, cached, table, total))
        start += n
    decodes = [r for r, (_, n) in zip(refs, shapes) if n == 1]
    width = max(len(r[4]) for r in decodes)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots), num_decode_tokens=len(decodes),
        decode_block_tables=torch.tensor([r[4] + [0] * (width - len(r[4])) for r in decodes]),
        decode_context_lens=torch.tensor([r[5] for r in decodes]), prefills=segs)
    runs = prefill_runs(segs)
    assert [(s, count) for s, count, _ in runs] == [(2, 3), (20, 1), (23, 0)]
    out = paged_attention(torch.cat(q_parts), torch.cat(k_parts), torch.cat(v_parts), cache,
                          meta, 0.3)
    want = torch.cat([dense(q, k, v, cached, 0.3) for q, k, v, cached, _, _ in refs])
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


def test_prepacked_linear_is_bitwise_f_linear_or_absent():
    """The oneDNN prepacked bf16 weight is used only where it reproduces F.linear exactly
    (float32 weights go to the native kernel: tests/test_native_kernels.py)."""
    import torch.nn.functional as F

    from pd_runtime.model.llama import linear, prepack_weight

    torch.manual_seed(4)
    weight = torch.randn(96, 64).bfloat16()
    bias = torch.randn(96).bfloat16()
    for b in (None, bias):
        packed = prepack_weight(weight, b)
        if packed is None:  # no oneDNN bf16 path on this CPU: the fallback is F.linear itself
            continue
        for rows in (1, 5, 64, 333):
            x = torch.randn(rows, 64).bfloat16()
            assert torch.equal(linear(x, weight, packed, b), F.linear(x, weight, b))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_row_stable_linear_rows_do_not_depend_on_the_row_count(dtype):
    """The batch-invariant mode's matmuls: padded to the probed row count, a row's bits are the
    same in a call of any size, at any place (float32 `F.linear` alone is not, see
    pd_runtime/kernels/row_stable.py)."""
    from pd_runtime.kernels import row_stable
    from pd_runtime.model.llama import linear, prepack_weight

    gen = torch.Generator().manual_seed(6)
    weight = torch.randn(192, 96, generator=gen).to(dtype)
    bias = torch.randn(192, generator=gen).to(dtype)
    packed = prepack_weight(weight, bias)
    min_rows = row_stable.stable_min_rows(lambda x: linear(x, weight, packed, bias), 96, dtype,
                                          "cpu", key=("test_row_stable", dtype))
    assert min_rows is not None
    x = torch.randn(300, 96, generator=gen).to(dtype)
    whole = linear(x, weight, packed, bias, min_rows)
    for rows in [*range(1, 41), 77, 150, 297]:
        for start in (0, 3):
            part = linear(x[start:start + rows], weight, packed, bias, min_rows)
            assert torch.equal(part, whole[start:start + rows]), (rows, start)


def test_row_stability_probe_finds_a_rare_single_row_difference():
    """A matmul path that rounds one element differently, for one row, only when called with
    a single row (what bf16 GEMV against GEMM does on AVX2, about one element in 8000): the
    probe must see it wherever the row sits, and pad single-row calls."""
    from pd_runtime.kernels import row_stable

    gen = torch.Generator().manual_seed(2)
    weight = torch.randn(64, 32, generator=gen)
    probe_input = torch.randn(row_stable._REFERENCE_ROWS, 32, generator=torch.Generator()
                              .manual_seed(0))
    odd_row = probe_input[97]  # not among the first few rows

    def fn(x):  # float64 sums rounded to float32: the same bits at any row count
        out = (x.double() @ weight.double().T).float()
        if x.shape[0] == 1 and torch.equal(x[0], odd_row):
            out[0, 5] += 1e-3
        return out

    assert row_stable.stable_min_rows(fn, 32, torch.float32, "cpu", key=("odd_row",)) == 2


def _gpt_oss_attention(q, k, v, sinks, first, scale, window=0):
    """transformers' own gpt-oss eager attention (the sinks' definition): q `[n, H, d]` at
    positions first.., k/v `[L, kvh, d]`."""
    from types import SimpleNamespace

    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    n, heads, _ = q.shape
    length, kv_heads = k.shape[:2]
    rows, keys = torch.arange(n)[:, None] + first, torch.arange(length)[None, :]
    visible = (keys <= rows) & ((keys > rows - window) if window else True)
    mask = torch.zeros(n, length).masked_fill(~visible, float("-inf"))
    module = SimpleNamespace(sinks=sinks, num_key_value_groups=heads // kv_heads, training=False)
    out, _ = eager_attention_forward(module, q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                     v.transpose(0, 1)[None], mask[None, None], scale)
    return out[0]  # [n, H, d]


@pytest.mark.parametrize("window", [0, 6])
def test_sinks_match_transformers_gpt_oss_attention(window):
    """gpt-oss's attention sinks on every reference path (decode, a chunk over a cached
    prefix, fresh prompts batched, and all three in one step) against transformers' eager
    attention; sinks large enough to take most of the probability."""
    gen = torch.Generator().manual_seed(3 + window)
    heads, kv_heads, d, bs, scale = 8, 2, 8, 4, 0.4
    sinks = torch.randn(heads, generator=gen) * 2 + torch.tensor([3.0, -2, 0, 1, 4, -5, 2, 0])
    cache = make_cache(kv_heads=kv_heads, block_size=bs, head_dim=d)
    table = [7, 3, 30, 12, 0]
    total, chunk = 18, 7
    k, v = torch.randn(total, kv_heads, d, generator=gen), torch.randn(total, kv_heads, d,
                                                                       generator=gen)
    fill(cache, table, k, v)
    q = torch.randn(total, heads, d, generator=gen)
    want = _gpt_oss_attention(q, k, v, sinks, 0, scale, window)
    plain = _gpt_oss_attention(q, k, v, sinks - 1e4, 0, scale, window)
    assert not torch.allclose(want, plain, atol=0.05)  # the sinks matter
    bt = torch.tensor([table])
    got = decode_attention(q[-1:], cache, bt, torch.tensor([total]), scale, window=window,
                           sinks=sinks)
    torch.testing.assert_close(got, want[-1:], rtol=1e-5, atol=1e-5)
    seg = PrefillSegment(0, chunk, total, bt[0])
    got = prefill_attention(q[-chunk:], k[-chunk:], v[-chunk:], cache, seg, scale, window,
                            sinks=sinks)
    torch.testing.assert_close(got, want[-chunk:], rtol=1e-5, atol=1e-5)
    # One step: a decode (the whole sequence's last token), two fresh 9-token prompts batched
    # (the sequence's first 9 tokens twice), and a chunk over its cached prefix.
    cache2 = make_cache(kv_heads=kv_heads, block_size=bs, head_dim=d)
    fill(cache2, table, k[:-1], v[:-1])
    fill(cache2, [1, 2, 4], k[:9], v[:9])
    fill(cache2, [5, 6, 8], k[:9], v[:9])
    fill(cache2, [9, 10, 11, 13, 14], k[:total - chunk], v[:total - chunk])
    n = 9
    qs = torch.cat([q[-1:], q[:n], q[:n], q[-chunk:]])
    ks = torch.cat([k[-1:], k[:n], k[:n], k[-chunk:]])
    vs = torch.cat([v[-1:], v[:n], v[:n], v[-chunk:]])
    slot = lambda tbl, p: tbl[p // bs] * bs + p % bs  # noqa: E731
    slots = [slot(table, total - 1)] + [slot([1, 2, 4], p) for p in range(n)] \
        + [slot([5, 6, 8], p) for p in range(n)] \
        + [slot([9, 10, 11, 13, 14], p) for p in range(total - chunk, total)]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots), num_decode_tokens=1, decode_block_tables=bt,
        decode_context_lens=torch.tensor([total]),
        prefills=[PrefillSegment(1, n, n, torch.tensor([1, 2, 4])),
                  PrefillSegment(1 + n, n, n, torch.tensor([5, 6, 8])),
                  PrefillSegment(1 + 2 * n, chunk, total, torch.tensor([9, 10, 11, 13, 14]))],
        window=window, sinks=sinks)
    out = paged_attention(qs, ks, vs, cache2, meta, scale)
    torch.testing.assert_close(out, torch.cat([want[-1:], want[:n], want[:n], want[-chunk:]]),
                               rtol=1e-5, atol=1e-5)
