"""The native CPU decode attention (pd_runtime/kernels/native.py, built here with the machine's compiler):
against float32 attention computed by torch, on the fast paths (group 1/2/4/8, head_dim 64/128)
and the portable one; the torch path when the kernel is off; and inside the engine, a
request's bf16 tokens do not depend on its company."""

from __future__ import annotations

import pytest
import torch

from pd_runtime.kernels import attention, native
from pd_runtime import LLM, SamplingParams
from tests.test_engine_invariance import mixed_prompts


def _cpu_has(flag: str) -> bool:
    with open("/proc/cpuinfo") as f:
        return any(flag in line.split() for line in f if line.startswith("flags"))


def _fp32_attention(q, k, v, lens, scale, window=0):
    """q [B, KH, G, d], k/v [rows, KH, cap, d] -> float32 [B, KH, G, d], keys j < lens[b]
    (and j >= lens[b] - window, with a window)."""
    batch = q.shape[0]
    scores = torch.matmul(q.float(), k[:batch].float().transpose(-1, -2)) * scale
    visible = torch.arange(k.shape[2])[None, :] < lens[:, None]
    if window:
        visible &= torch.arange(k.shape[2])[None, :] >= (lens - window)[:, None]
    scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
    return torch.matmul(scores.softmax(-1), v[:batch].float())


def test_the_kernel_builds_on_this_machine():
    # CI and the target machines have a C compiler; without one the torch path runs (below).
    assert native.available()


def test_loading_a_build_prunes_builds_unused_for_a_month(tmp_path):
    import os
    import time
    current, recent, stale = (tmp_path / f"pd_runtime_cpu-{n}.so" for n in ("cur", "recent", "stale"))
    other, partial = tmp_path / "unrelated.so", tmp_path / "tmpab12.so.partial"
    for path in (current, recent, stale, other, partial):
        path.write_bytes(b"x")
    month = 31 * 24 * 3600
    for path in (current, stale, other, partial):
        os.utime(path, (time.time() - month, time.time() - month))
    native._prune(tmp_path, current)
    assert current.exists() and time.time() - current.stat().st_mtime < 60  # marked used now
    assert recent.exists() and other.exists() and not stale.exists() and not partial.exists()
    assert not native._mark_used(tmp_path / "pd_runtime_cpu-missing.so")


@pytest.mark.parametrize("group,dim", [(1, 64), (2, 64), (4, 128), (8, 64), (3, 32), (2, 48)])
def test_decode_attention_matches_float32(group, dim):
    gen = torch.Generator().manual_seed(group * 1000 + dim)
    batch, kv_heads, cap = 5, 2, 70
    q = torch.randn(batch, kv_heads, group, dim, generator=gen).to(torch.bfloat16)
    k = torch.randn(batch + 2, kv_heads, cap, dim, generator=gen).to(torch.bfloat16)  # spare rows
    v = torch.randn(batch + 2, kv_heads, cap, dim, generator=gen).to(torch.bfloat16)
    lens = torch.tensor([1, 70, 33, 2, 64])
    out = native.decode_attention_bf16(q, k, v, lens, dim ** -0.5)
    assert out is not None and out.dtype == torch.bfloat16 and out.shape == q.shape
    want = _fp32_attention(q, k, v, lens, dim ** -0.5)
    # one bf16 rounding of values of magnitude <= ~3: 2^-8 relative
    assert torch.allclose(out.float(), want, atol=2e-2, rtol=1e-2)
    # a sequence of length 1 sees exactly its one value row
    assert torch.equal(out[0], v[0, :, :1].expand(kv_heads, group, dim))
    # keys past a sequence's length are never read: garbage there changes nothing
    k2, v2 = k.clone(), v.clone()
    for b, n in enumerate(lens.tolist()):
        k2[b, :, n:], v2[b, :, n:] = float("nan"), float("inf")
    assert torch.equal(native.decode_attention_bf16(q, k2, v2, lens, dim ** -0.5), out)


@pytest.mark.parametrize("group,dim", [(2, 64), (4, 128), (3, 32)])
def test_decode_attention_over_a_sliding_window(group, dim):
    """With a window, each row's last `window` keys only; the keys before are never read."""
    gen = torch.Generator().manual_seed(group + dim)
    batch, kv_heads, cap, window = 5, 2, 70, 20
    q = torch.randn(batch, kv_heads, group, dim, generator=gen).to(torch.bfloat16)
    k = torch.randn(batch, kv_heads, cap, dim, generator=gen).to(torch.bfloat16)
    v = torch.randn(batch, kv_heads, cap, dim, generator=gen).to(torch.bfloat16)
    lens = torch.tensor([1, 70, 33, 20, 21])
    out = native.decode_attention_bf16(q, k, v, lens, dim ** -0.5, window)
    want = _fp32_attention(q, k, v, lens, dim ** -0.5, window)
    assert torch.allclose(out.float(), want, atol=2e-2, rtol=1e-2)
    assert not torch.allclose(want, _fp32_attention(q, k, v, lens, dim ** -0.5), atol=0.05)
    k2, v2 = k.clone(), v.clone()
    for b, n in enumerate(lens.tolist()):
        k2[b, :, :max(n - window, 0)], v2[b, :, :max(n - window, 0)] = float("nan"), float("inf")
    assert torch.equal(native.decode_attention_bf16(q, k2, v2, lens, dim ** -0.5, window), out)


def test_inputs_the_kernel_does_not_take_return_none():
    q = torch.randn(2, 1, 2, 24).to(torch.bfloat16)  # head_dim not a multiple of 16
    k = torch.randn(2, 1, 8, 24).to(torch.bfloat16)
    assert native.decode_attention_bf16(q, k, k, torch.tensor([3, 8]), 0.2) is None
    assert native.decode_attention_bf16(q.float(), k.float(), k.float(), torch.tensor([3, 8]), 0.2) is None


def test_decode_attention_falls_back_to_torch_when_the_kernel_is_off(monkeypatch):
    gen = torch.Generator().manual_seed(3)
    cache = torch.randn(2, 6, 2, 4, 64, generator=gen).to(torch.bfloat16)  # [2, blocks, kvh, bs, d]
    q = torch.randn(2, 4, 64, generator=gen).to(torch.bfloat16)
    tables, lens = torch.tensor([[0, 1], [2, 3]]), torch.tensor([5, 8])
    fast = attention.decode_attention(q, cache, tables, lens, 0.125)
    monkeypatch.setattr(native, "available", lambda: False)
    assert not attention.uses_native_decode(q)
    slow = attention.decode_attention(q, cache, tables, lens, 0.125)
    assert torch.allclose(fast.float(), slow.float(), atol=2e-2)


@pytest.mark.timeout(300)
def test_bf16_tokens_identical_alone_and_in_a_batch(model_factory, monkeypatch):
    # head_dim 64 and 2 query heads per KV head: the kernel's fast path, in the engine's
    # decode buffer (the regular paths: batch_invariant off); each request alone, then all 12
    # in one batch. (Not with chunked prefill: a chunk that attends to cached KV takes another
    # attention path than a whole prompt, and in bf16 the two round differently; the
    # batch-invariant mode shows that invariance, tests/test_batch_invariance.py.)
    model = model_factory("llama", hidden_size=256, num_attention_heads=4, num_key_value_heads=2)
    ran = []
    kernel = native.decode_attention_bf16
    monkeypatch.setattr(native, "decode_attention_bf16", lambda *a: ran.append(kernel(*a)) or ran[-1])
    prompts = mixed_prompts(12, seed=4)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    llm = LLM(model, dtype="bfloat16", num_kv_blocks=256, batch_invariant=False)
    alone = [llm.generate([p], params)[0].token_ids for p in prompts]
    batched = LLM(model, dtype="bfloat16", num_kv_blocks=256, batch_invariant=False)
    assert [o.token_ids for o in batched.generate(prompts, params)] == alone
    assert ran and all(out is not None for out in ran)  # every decode went through the kernel


def test_fused_rms_norm_and_residual_add_match_torch(monkeypatch):
    from pd_runtime.model import llama

    gen = torch.Generator().manual_seed(7)
    h = (torch.randn(37, 96, generator=gen) * 3).to(torch.bfloat16)  # 96: a tail after 16-lanes
    delta = torch.randn(37, 96, generator=gen).to(torch.bfloat16)
    w = (torch.rand(96, generator=gen) + 0.5).to(torch.bfloat16)
    h_fused = h.clone()
    fused = llama.add_rms_norm(h_fused, delta, w, 1e-6)
    plain = llama.rms_norm(h, w, 1e-6)
    monkeypatch.setattr(native, "_library", None)  # the torch expressions from here on
    h_torch = h.clone()
    want = llama.add_rms_norm(h_torch, delta, w, 1e-6)
    assert torch.equal(h_fused, h_torch)  # the residual add rounds exactly as torch's add_
    for got, ref in ((fused, want), (plain, llama.rms_norm(h, w, 1e-6))):
        # the float32 sum of squares adds in another order: at most a last-bit difference
        assert torch.allclose(got.float(), ref.float(), rtol=2 ** -7, atol=0)
        assert (got != ref).float().mean() < 0.01


@pytest.mark.parametrize("seqs,n,heads,kv_heads,dim", [(3, 37, 4, 2, 64), (1, 1, 2, 2, 64),
                                                       (2, 64, 8, 2, 128), (1, 130, 4, 4, 64)])
def test_prefill_attention_matches_float32(seqs, n, heads, kv_heads, dim):
    gen = torch.Generator().manual_seed(n * 7 + dim)
    qkv = torch.randn(seqs * n, (heads + 2 * kv_heads) * dim, generator=gen).to(torch.bfloat16)
    # views into the fused projection, as the model passes them
    q = qkv[:, :heads * dim].view(-1, heads, dim)
    k = qkv[:, heads * dim:(heads + kv_heads) * dim].view(-1, kv_heads, dim)
    v = qkv[:, (heads + kv_heads) * dim:].view(-1, kv_heads, dim)
    out = native.prefill_attention_bf16(q, k, v, seqs, dim ** -0.5)
    group = heads // kv_heads
    if not _cpu_has("avx512_bf16"):
        # the kernel needs AVX512-BF16: without it, it declines and attention keeps torch's SDPA
        assert out is None
        out = attention.causal_prefill(q, k, v, seqs, dim ** -0.5)
    assert out is not None and out.shape == q.shape
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.float().view(seqs, n, heads, dim).transpose(1, 2),
        k.float().view(seqs, n, kv_heads, dim).transpose(1, 2).repeat_interleave(group, 1),
        v.float().view(seqs, n, kv_heads, dim).transpose(1, 2).repeat_interleave(group, 1),
        is_causal=True, scale=dim ** -0.5).transpose(1, 2).reshape(seqs * n, heads, dim)
    assert torch.allclose(out.float(), ref, atol=3e-2, rtol=2e-2)
    # a prompt's first token sees only itself
    assert torch.equal(out.view(seqs, n, heads, dim)[:, 0],
                       v.view(seqs, n, kv_heads, dim)[:, 0].repeat_interleave(group, 1))


def _paged(cache_blocks, kv_heads, block_size, dim, dtype, gen):
    """A random one-layer cache `[2, blocks, kv_heads, block_size, dim]`."""
    return torch.randn(2, cache_blocks, kv_heads, block_size, dim, generator=gen).to(dtype)


def _dense_keys(cache, table, length):
    """K and V of a sequence's first `length` positions as `[length, kv_heads, dim]`."""
    _, _, kv_heads, block_size, dim = cache.shape
    k = cache[0, table].permute(0, 2, 1, 3).reshape(-1, kv_heads, dim)[:length]
    v = cache[1, table].permute(0, 2, 1, 3).reshape(-1, kv_heads, dim)[:length]
    return k, v


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("heads,kv_heads,dim,block_size,window,sinks", [
    (4, 2, 64, 16, 0, False), (4, 2, 16, 4, 0, False), (8, 8, 128, 16, 0, False),
    (6, 2, 24, 8, 0, False),
    (4, 2, 64, 16, 21, False), (6, 2, 24, 8, 8, False),  # sliding windows: across groups, blocks
    (8, 2, 64, 16, 0, True), (4, 2, 64, 16, 21, True)])  # gpt-oss's sinks, with its window
def test_fixed_order_attention_rows_do_not_depend_on_their_company(dtype, heads, kv_heads, dim,
                                                                    block_size, window, sinks):
    from pd_runtime.kernels.fixed_order import FixedOrderRows

    gen = torch.Generator().manual_seed(heads * 100 + dim + block_size)
    cache = _paged(96, kv_heads, block_size, dim, dtype, gen)
    length, scale = 83, dim ** -0.5
    table = torch.randperm(96, generator=gen)[:-(-length // block_size)].tolist()
    other = [b for b in range(96) if b not in table][:12]
    q = torch.randn(length, heads, dim, generator=gen).to(dtype)
    # (sinks of about the scores' size and above: they take a share of every row)
    sink = torch.randn(heads, generator=gen) * 2 + 1 if sinks else None

    def attend(tables, starts, counts, q_rows):
        rows = FixedOrderRows.build(tables, starts, counts)
        out = native.fixed_order_attention(q_rows, cache, rows.block_tables, rows.seq, rows.lens,
                                           scale, window=window, sinks=sink)
        assert out is not None and out.dtype == dtype
        return out

    whole = attend([table], [0], [length], q)  # a fresh prompt
    k, v = _dense_keys(cache, table, length)
    group = heads // kv_heads
    scores = torch.einsum("nhd,lhd->hnl", q.double(), k.double().repeat_interleave(group, 1))
    causal = torch.arange(length)[None, :] <= torch.arange(length)[:, None]
    if window:
        causal &= torch.arange(length)[None, :] > torch.arange(length)[:, None] - window
    logits = (scores * scale).masked_fill(~causal, float("-inf"))
    if sinks:  # a column of the softmax with no value row
        column = sink.double()[:, None, None].expand(heads, length, 1)
        probs = torch.cat([logits, column], -1).softmax(-1)[..., :-1]
        assert probs.sum(-1).mean() < 0.95  # the sinks take a share
    else:
        probs = logits.softmax(-1)
    want = torch.einsum("hnl,lhd->nhd", probs, v.double().repeat_interleave(group, 1))
    tolerance = 1e-2 if dtype == torch.bfloat16 else 1e-5
    assert torch.allclose(whole.double(), want, atol=tolerance, rtol=tolerance)
    # the same rows as decodes, one at a time: bit for bit
    for t in (0, 1, 15, 16, 17, 40, length - 1):
        assert torch.equal(attend([table], [t], [1], q[t:t + 1]), whole[t:t + 1])
    # as chunks over their cached prefix, batched behind another sequence's decode and chunk
    noise = torch.randn(5, heads, dim, generator=gen).to(dtype)
    for start, end in ((0, 9), (9, 37), (37, 38), (38, length)):
        rows = torch.cat([noise[:1], q[start:end], noise[1:]])
        out = attend([other, table, other[::-1]], [30, start, 11], [1, end - start, 4], rows)
        assert torch.equal(out[1:1 + end - start], whole[start:end])


def test_fixed_order_attention_reads_only_its_own_keys():
    from pd_runtime.kernels.fixed_order import FixedOrderRows

    gen = torch.Generator().manual_seed(11)
    cache = _paged(8, 2, 16, 64, torch.bfloat16, gen)
    q = torch.randn(3, 4, 64, generator=gen).to(torch.bfloat16)
    rows = FixedOrderRows.build([[5, 2]], [18], [3])  # positions 18-20 see 19-21 keys
    out = native.fixed_order_attention(q, cache, rows.block_tables, rows.seq, rows.lens, 0.125)
    spoiled = cache.clone()
    spoiled[:, 2, :, 5:] = float("nan")  # past position 20 (block 2 holds 16-31)
    spoiled[:, [0, 1, 3, 4, 6, 7]] = float("inf")
    again = native.fixed_order_attention(q, spoiled, rows.block_tables, rows.seq, rows.lens, 0.125)
    assert torch.equal(out, again)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_silu_mul_matches_torch_and_each_element_stands_alone(dtype):
    gen = torch.Generator().manual_seed(5)
    gate_up = (torch.randn(37, 2 * 100, generator=gen) * 4).to(dtype)  # 100: a partial lane group
    out = native.silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    want = torch.nn.functional.silu(gate.double()) * up.double()
    tolerance = 2 ** -7 if dtype == torch.bfloat16 else 1e-6
    assert torch.allclose(out.double(), want, rtol=tolerance, atol=tolerance)
    # any row subset, any row count: the same bits
    for rows in ([0], [36], list(range(5)), list(range(3, 37))):
        assert torch.equal(native.silu_mul(gate_up[rows]), out[rows])
    # an element alone equals itself inside a row (no remainder loop that rounds differently)
    single = torch.stack([native.silu_mul(gate_up[2:3, [i, 100 + i]])[0, 0] for i in range(100)])
    assert torch.equal(single, out[2])


def _cpu_has_avx2_fma() -> bool:
    return _cpu_has("avx2") and _cpu_has("fma")


@pytest.mark.parametrize("n, k, bias, bf16_values", [(96, 64, False, True), (200, 600, True, True),
                                                     (1000, 300, True, True), (40, 600, True, False)])
def test_native_linear_matches_torch_and_rows_do_not_depend_on_their_company(n, k, bias,
                                                                            bf16_values):
    """cpu_linear.c: float32 `x @ W.T + b` within float32 rounding of torch's, and each row
    bit-identical whatever the row count (and so the register tile it fell in), the row's place
    or the thread count; weights packed as bf16 (a bf16 checkpoint's values) or float32. n not
    a multiple of the 16-column panel; k crossing a 512-wide k block."""
    import torch.nn.functional as F

    from pd_runtime.model.llama import linear, prepack_weight

    gen = torch.Generator().manual_seed(n + k)
    weight = torch.randn(n, k, generator=gen)
    if bf16_values:
        weight = weight.bfloat16().float()
    b = torch.randn(n, generator=gen) if bias else None
    packed = prepack_weight(weight, b)
    if not _cpu_has_avx2_fma():  # the kernel needs AVX2 + FMA; without them torch's GEMM runs
        assert packed is None
        return
    assert isinstance(packed, native.PackedLinear) and packed.is_bf16 == bf16_values
    x = torch.randn(64, k, generator=gen)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        full = linear(x, weight, packed, b)
        torch.testing.assert_close(full, F.linear(x, weight, b), rtol=1e-4, atol=1e-4)
        for rows in (*range(1, 20), 33):
            for offset in (0, 7):
                part = linear(x[offset:offset + rows], weight, packed, b)
                assert torch.equal(part, full[offset:offset + rows]), (rows, offset)
        for count in (2, 3):
            torch.set_num_threads(count)
            assert torch.equal(linear(x, weight, packed, b), full)
            assert torch.equal(linear(x[:3], weight, packed, b), full[:3])
    finally:
        torch.set_num_threads(threads)


def test_native_linear_declines_what_it_cannot_take():
    """Inputs the kernel does not take give None (the caller's error), never a bad read."""
    weight = torch.randn(32, 16)
    packed = native.pack_linear(weight)
    if not _cpu_has_avx2_fma():
        assert packed is None
        return
    assert native.linear_f32(torch.randn(2, 15), packed) is None            # wrong k
    assert native.linear_f32(torch.randn(2, 16).double(), packed) is None   # not float32
    assert native.linear_f32(torch.randn(2, 16), packed, torch.randn(31)) is None  # bias size
    assert native.pack_linear(weight.bfloat16()) is None  # bf16 weights: oneDNN's path
    assert native.linear_f32(torch.randn(0, 16), packed).shape == (0, 32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("heads,kv_heads,dim,block_size", [(4, 4, 64, 16), (8, 2, 64, 32),
                                                           (8, 1, 128, 16), (6, 2, 24, 8)])
def test_fixed_order_attention_over_an_int8_cache(dtype, heads, kv_heads, dim, block_size):
    """The 8-bit cache (pd_runtime/kernels/kv_quant.py): each row widened as value x its scale inside the
    kernel. Against the float32 cache holding exactly those values: bit for bit (float32
    queries) or within bf16 rounding; against float64 attention over them; rows still do not
    depend on their company; untouched rows poisoned to show nothing else is read."""
    from pd_runtime.kernels import kv_quant
    from pd_runtime.kernels.fixed_order import FixedOrderRows

    gen = torch.Generator().manual_seed(heads * 10 + kv_heads + dim)
    cache8 = kv_quant.quantize(_paged(64, kv_heads, block_size, dim, torch.float32, gen) * 3)
    assert cache8.dtype == torch.int8 and cache8.shape[-1] == dim + 4
    values = kv_quant.dequantize(cache8)
    length, scale = 71, dim ** -0.5
    table = torch.randperm(64, generator=gen)[:-(-length // block_size)].tolist()
    q = torch.randn(length, heads, dim, generator=gen).to(dtype)
    rows = FixedOrderRows.build([table], [0], [length])
    poisoned = cache8.clone()
    unused = [b for b in range(64) if b not in table]
    poisoned[:, unused] = 127  # huge values and scales: any read of them shows
    out = native.fixed_order_attention(q, poisoned, rows.block_tables, rows.seq, rows.lens, scale)
    assert out is not None and out.dtype == dtype
    over_values = native.fixed_order_attention(q, values.to(dtype) if dtype == torch.float32
                                               else values.to(torch.float32).to(dtype),
                                               rows.block_tables, rows.seq, rows.lens, scale)
    if dtype == torch.float32:
        assert torch.equal(out, over_values)
    k, v = _dense_keys(values, table, length)
    group = heads // kv_heads
    scores = torch.einsum("nhd,lhd->hnl", q.double(), k.double().repeat_interleave(group, 1))
    causal = torch.arange(length)[None, :] <= torch.arange(length)[:, None]
    probs = (scores * scale).masked_fill(~causal, float("-inf")).softmax(-1)
    want = torch.einsum("hnl,lhd->nhd", probs, v.double().repeat_interleave(group, 1))
    tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-5
    assert torch.allclose(out.double(), want, atol=tolerance, rtol=tolerance)
    for t in (0, 15, 16, 40, length - 1):  # as decodes: the same bits
        one = FixedOrderRows.build([table], [t], [1])
        assert torch.equal(native.fixed_order_attention(q[t:t + 1], poisoned, one.block_tables,
                                                        one.seq, one.lens, scale), out[t:t + 1])


def test_int8_rows_round_trip_within_half_a_step():
    from pd_runtime.kernels import kv_quant

    x = torch.randn(50, 4, 64, generator=torch.Generator().manual_seed(3)) * 5
    x[3, 1] = 0.0  # a row of zeros: scale 1, values 0
    rows = kv_quant.quantize(x)
    back = kv_quant.dequantize(rows)
    step = x.abs().amax(-1, keepdim=True) / 127
    assert torch.all((back - x).abs() <= step / 2 + 1e-6)
    assert torch.equal(back[3, 1], torch.zeros(64))
    assert rows[..., :64].abs().max() <= 127
