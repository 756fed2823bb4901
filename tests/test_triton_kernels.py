"""The Triton paged-attention kernels (pd_runtime/kernels/triton_paged.py) against the torch reference
(pd_runtime/kernels/attention.py), run on CPU tensors under the Triton interpreter.

The reference runs in float32 on the same bf16/fp16 values. Tolerances: bf16 atol = rtol =
1e-2, fp16 atol = rtol = 1e-3 (the kernels round the output, and the probabilities before the
P.V product, to the input dtype; the largest errors measured were about half of these).
"""

from __future__ import annotations

import os

import pytest
import torch

# Before triton.jit decorates the kernels: only then do they run on CPU tensors.
os.environ["TRITON_INTERPRET"] = "1"

import triton

from pd_runtime.kernels import attention as reference
from pd_runtime.kernels import triton_launch, triton_paged

# triton.jit reads the variable when it decorates, triton.language's own helpers (tl.max,
# tl.sum) included: had anything imported triton before this module, the kernels could not run.
if not triton_paged.INTERPRETED or isinstance(triton.language.max, triton.runtime.JITFunction):
    raise RuntimeError("triton was imported before TRITON_INTERPRET=1 was set: set it before "
                       "any import of triton (e.g. at the top of tests/conftest.py)")

TOLERANCE = {torch.bfloat16: 1e-2, torch.float16: 1e-3}
LAYERS, NUM_BLOCKS = 2, 24
SCALE = 0.3

# (dtype, block_size, head_dim, heads, kv_heads): every value of each field at least once,
# GQA ratios 1, 4 and 8.
CASES = [
    pytest.param(torch.bfloat16, 16, 64, 4, 4, id="bf16-bs16-d64-gqa1"),
    pytest.param(torch.float16, 32, 128, 8, 2, id="fp16-bs32-d128-gqa4"),
    pytest.param(torch.bfloat16, 32, 64, 8, 1, id="bf16-bs32-d64-gqa8"),
    pytest.param(torch.float16, 16, 128, 16, 2, id="fp16-bs16-d128-gqa8"),
    pytest.param(torch.bfloat16, 16, 128, 8, 2, id="bf16-bs16-d128-gqa4"),
    pytest.param(torch.bfloat16, 16, 256, 8, 4, id="bf16-bs16-d256-gqa2"),  # Gemma 3 4B
]


class PagedCache:
    """One layer of a poisoned (NaN) multi-layer cache, sequences written at scattered blocks
    through the reference write_kv. Block POISON is never allocated: the tables' padding
    points there, so reading past a sequence's blocks shows up as NaN."""

    POISON = NUM_BLOCKS - 1

    def __init__(self, dtype, block_size, head_dim, kv_heads, lens, seed):
        self.gen = torch.Generator().manual_seed(seed)
        self.dtype, self.block_size, self.head_dim = dtype, block_size, head_dim
        self.full = torch.full((LAYERS, 2, NUM_BLOCKS, kv_heads, block_size, head_dim),
                               float("nan"), dtype=dtype)
        self.kv = self.full[1]  # a view with an offset, as the engine passes it
        free = torch.randperm(NUM_BLOCKS - 1, generator=self.gen).tolist()
        tables, self.keys, self.values = [], [], []
        for n in lens:
            table = [free.pop() for _ in range(-(-n // block_size))]
            k, v = self.randn(n, kv_heads, head_dim), self.randn(n, kv_heads, head_dim)
            reference.write_kv(self.kv, k, v, self.slots(table, range(n)))
            tables.append(table)
            self.keys.append(k)
            self.values.append(v)
        width = max(map(len, tables)) + 1
        self.tables = torch.tensor([t + [self.POISON] * (width - len(t)) for t in tables])

    def randn(self, *shape):
        return torch.randn(*shape, generator=self.gen).to(self.dtype)

    def slots(self, table, positions):
        bs = self.block_size
        return torch.tensor([table[p // bs] * bs + p % bs for p in positions])

    def float32(self):
        """The layer in float32 for the reference, unwritten slots zero (the reference reads
        whole blocks and masks after the product, where NaN would survive)."""
        return self.kv.float().nan_to_num(0.0)


def assert_close(actual, expected, dtype):
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(actual.float(), expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype,block_size,head_dim,heads,kv_heads", CASES)
def test_decode_matches_reference(dtype, block_size, head_dim, heads, kv_heads):
    bs = block_size
    # 1 key, exactly a block, a padding row (0), one past a block, several blocks
    lens = [1, bs, 0, bs + 1, 3 * bs - 3]
    cache = PagedCache(dtype, bs, head_dim, kv_heads, [max(n, 1) for n in lens], seed=bs + heads)
    tables = cache.tables.to(torch.int32 if heads % 16 else torch.int64, copy=True)
    tables[2] = cache.POISON  # the padding row's table: nothing of it may be read
    context_lens = torch.tensor(lens)
    q = cache.randn(len(lens), heads, head_dim)

    live = context_lens > 0
    expected = reference.decode_attention(q[live].float(), cache.float32(),
                                          cache.tables[live], context_lens[live], SCALE)
    outs = {}
    for splits in (1, 3):
        out = torch.full_like(q, float("nan"))
        returned = triton_paged.decode_attention(q, cache.kv, tables, context_lens, SCALE,
                                                 out=out, num_splits=splits)
        assert returned is out and out.dtype == dtype
        assert_close(out[live], expected, dtype)
        assert torch.equal(out[~live], torch.zeros_like(out[~live]))  # zeros, not NaN
        outs[splits] = out
    assert_close(outs[3], outs[1].float(), dtype)


def test_decode_default_splits_come_from_static_shapes():
    split = triton_paged.default_num_splits
    assert split(batch=256, num_kv_heads=8, max_blocks=256, sm_count=132) == 1
    assert split(batch=1, num_kv_heads=8, max_blocks=256, sm_count=132) == triton_launch.MAX_SPLITS
    assert split(batch=4, num_kv_heads=8, max_blocks=256, sm_count=132) == 33  # 8 per SM
    # 1024 programs, not 1088: within one wave of 8 per SM
    assert split(batch=8, num_kv_heads=8, max_blocks=1024, sm_count=132) == 16
    assert split(batch=24, num_kv_heads=8, max_blocks=1024, sm_count=132) == 5
    assert split(batch=1, num_kv_heads=8, max_blocks=12, sm_count=132) == 3  # >= 4 blocks each
    assert split(batch=1, num_kv_heads=1, max_blocks=2, sm_count=132) == 1

    # num_splits=None (here 3 splits: a 12-block-wide table) agrees with a single split
    cache = PagedCache(torch.bfloat16, 16, 64, 1, [40, 3], seed=5)
    tables = torch.cat([cache.tables, torch.full((2, 8), cache.POISON)], dim=1)
    assert split(batch=2, num_kv_heads=1, max_blocks=tables.shape[1]) == 3
    q = cache.randn(2, 2, 64)
    lens = torch.tensor([40, 3])
    chosen = triton_paged.decode_attention(q, cache.kv, tables, lens, SCALE)
    single = triton_paged.decode_attention(q, cache.kv, tables, lens, SCALE, num_splits=1)
    assert_close(chosen, single.float(), torch.bfloat16)


@pytest.mark.parametrize("dtype,block_size,head_dim,heads,kv_heads", CASES)
def test_prefill_matches_reference(dtype, block_size, head_dim, heads, kv_heads):
    bs = block_size
    # (context after this step, chunk length): a fresh prompt one past a block, a chunk after
    # a cached prefix of several blocks, one token ending exactly on a block, a chunk that
    # starts mid-block and spans two blocks.
    segments = [(bs + 1, bs + 1), (3 * bs - 2, 5), (bs, 1), (2 * bs + 3, bs + 6)]
    cache = PagedCache(dtype, bs, head_dim, kv_heads, [c for c, _ in segments], seed=heads)
    chunks = [n for _, n in segments]
    starts = torch.tensor([0] + chunks).cumsum(0).to(torch.int32)
    context_lens = torch.tensor([c for c, _ in segments], dtype=torch.int32)
    q = cache.randn(int(starts[-1]), heads, head_dim)

    out = torch.full_like(q, float("nan"))
    returned = triton_paged.prefill_attention(q, cache.kv, starts, context_lens, cache.tables,
                                              SCALE, max_query_len=max(chunks), out=out)
    assert returned is out
    for s, (context_len, n) in enumerate(segments):
        begin, end = int(starts[s]), int(starts[s + 1])
        seg = reference.PrefillSegment(0, n, context_len, cache.tables[s])
        k_new = cache.keys[s][context_len - n:].float()
        v_new = cache.values[s][context_len - n:].float()
        expected = reference.prefill_attention(q[begin:end].float(), k_new, v_new,
                                               cache.float32(), seg, SCALE)
        assert_close(out[begin:end], expected, dtype)


WINDOW_CASES = [CASES[0], CASES[1]]


def _poison_before_windows(cache, lens, window):
    """NaN into every block wholly before a sequence's window (what a kernel must not read)."""
    bs = cache.block_size
    for row, n in enumerate(lens):
        for index in range(max(n - window, 0) // bs):
            cache.kv[:, int(cache.tables[row, index])] = float("nan")


@pytest.mark.parametrize("dtype,block_size,head_dim,heads,kv_heads", WINDOW_CASES)
@pytest.mark.parametrize("window", [5, 40])
def test_decode_sliding_window_matches_reference(dtype, block_size, head_dim, heads, kv_heads,
                                                 window):
    """Each sequence's last `window` keys only; blocks wholly before them are never read."""
    bs = block_size
    lens = [3, window, window + 1, 3 * bs + 7]
    cache = PagedCache(dtype, bs, head_dim, kv_heads, lens, seed=window + heads)
    context_lens = torch.tensor(lens)
    q = cache.randn(len(lens), heads, head_dim)
    expected = reference.decode_attention(q.float(), cache.float32(), cache.tables, context_lens,
                                          SCALE, window=window)
    full = reference.decode_attention(q.float(), cache.float32(), cache.tables, context_lens,
                                      SCALE)
    assert not torch.allclose(expected[3], full[3], atol=0.05)  # the window matters there
    _poison_before_windows(cache, lens, window)
    for splits in (1, 3):
        out = triton_paged.decode_attention(q, cache.kv, cache.tables, context_lens, SCALE,
                                            num_splits=splits, window=window)
        assert_close(out, expected, dtype)


@pytest.mark.parametrize("dtype,block_size,head_dim,heads,kv_heads", WINDOW_CASES)
@pytest.mark.parametrize("window", [5, 40])
def test_prefill_sliding_window_matches_reference(dtype, block_size, head_dim, heads, kv_heads,
                                                  window):
    bs = block_size
    segments = [(2 * bs + 3, 2 * bs + 3), (3 * bs - 2, bs + 5), (bs, 1)]  # fresh, chunks
    cache = PagedCache(dtype, bs, head_dim, kv_heads, [c for c, _ in segments], seed=window)
    chunks = [n for _, n in segments]
    starts = torch.tensor([0] + chunks).cumsum(0).to(torch.int32)
    context_lens = torch.tensor([c for c, _ in segments], dtype=torch.int32)
    q = cache.randn(int(starts[-1]), heads, head_dim)
    expected = []
    for s, (context_len, n) in enumerate(segments):
        begin, end = int(starts[s]), int(starts[s + 1])
        seg = reference.PrefillSegment(0, n, context_len, cache.tables[s])
        expected.append(reference.prefill_attention(
            q[begin:end].float(), cache.keys[s][context_len - n:].float(),
            cache.values[s][context_len - n:].float(), cache.float32(), seg, SCALE, window))
    # Blocks before the first query's window (the chunk after a cached prefix) are not read.
    first_queries = [c - n for c, n in segments]
    _poison_before_windows(cache, [q0 + 1 for q0 in first_queries], window)
    out = triton_paged.prefill_attention(q, cache.kv, starts, context_lens, cache.tables, SCALE,
                                         max_query_len=max(chunks), window=window)
    for s in range(len(segments)):
        assert_close(out[int(starts[s]):int(starts[s + 1])], expected[s], dtype)


def _check_decode_with(cache, q, context_lens, dtype, splits, window, **feature):
    """Triton decode with a `feature` (softcap, sinks) against the reference's, split as
    given; the feature must change the reference's output, so the check can fail."""
    expected = reference.decode_attention(q.float(), cache.float32(), cache.tables, context_lens,
                                          SCALE, window=window, **feature)
    plain = reference.decode_attention(q.float(), cache.float32(), cache.tables, context_lens,
                                       SCALE, window=window)
    assert not torch.allclose(expected, plain, atol=0.05)
    for count in splits:
        out = triton_paged.decode_attention(q, cache.kv, cache.tables, context_lens, SCALE,
                                            num_splits=count, window=window, **feature)
        assert_close(out, expected, dtype)


@pytest.mark.parametrize("dtype,block_size,head_dim,heads,kv_heads", [CASES[0]])
def test_softcapped_scores_match_reference(dtype, block_size, head_dim, heads, kv_heads):
    """Gemma 2's soft-capping (a scaled score s becomes cap * tanh(s / cap)), with a window, in
    decode and prefill; a small cap, so the capped scores differ from the plain ones."""
    bs, cap, window = block_size, 0.5, 20
    lens = [3, 2 * bs + 7]
    cache = PagedCache(dtype, bs, head_dim, kv_heads, lens, seed=7)
    context_lens = torch.tensor(lens)
    q = cache.randn(len(lens), heads, head_dim) * 4
    _check_decode_with(cache, q, context_lens, dtype, (1, 2), window=window, softcap=cap)
    n = lens[1]
    starts = torch.tensor([0, n], dtype=torch.int32)
    qp = cache.randn(n, heads, head_dim) * 4
    seg = reference.PrefillSegment(0, n, n, cache.tables[1])
    want = reference.prefill_attention(qp.float(), cache.keys[1].float(), cache.values[1].float(),
                                       cache.float32(), seg, SCALE, window, cap)
    out = triton_paged.prefill_attention(qp, cache.kv, starts, torch.tensor([n], dtype=torch.int32),
                                         cache.tables[1:], SCALE, max_query_len=n,
                                         window=window, softcap=cap)
    assert_close(out, want, dtype)


@pytest.mark.parametrize("dtype,block_size,head_dim,heads,kv_heads", [CASES[2], CASES[1]])
@pytest.mark.parametrize("window", [0, 20])
def test_sinks_match_reference(dtype, block_size, head_dim, heads, kv_heads, window):
    """gpt-oss's attention sinks (a logit per query head, no value) in decode, split or not,
    and in prefill (fresh and after a cached prefix), with and without its window."""
    bs = block_size
    lens = [3, 2 * bs + 7, 3 * bs]
    cache = PagedCache(dtype, bs, head_dim, kv_heads, lens, seed=11 + window)
    sinks = torch.randn(heads, generator=cache.gen) * 2 + 1
    context_lens = torch.tensor(lens)
    q = cache.randn(len(lens), heads, head_dim)
    _check_decode_with(cache, q, context_lens, dtype, (1, 3), window=window, sinks=sinks)
    segments = [(2 * bs + 7, 2 * bs + 7), (3 * bs, bs + 5)]  # a fresh prompt, a chunk
    chunks = [n for _, n in segments]
    starts = torch.tensor([0] + chunks).cumsum(0).to(torch.int32)
    qp = cache.randn(int(starts[-1]), heads, head_dim)
    out = torch.full_like(qp, float("nan"))
    triton_paged.prefill_attention(qp, cache.kv, starts,
                                   torch.tensor([c for c, _ in segments], dtype=torch.int32),
                                   cache.tables[1:], SCALE, max_query_len=max(chunks), out=out,
                                   window=window, sinks=sinks)
    for s, (context_len, n) in enumerate(segments):
        begin, end = int(starts[s]), int(starts[s + 1])
        seg = reference.PrefillSegment(0, n, context_len, cache.tables[s + 1])
        want = reference.prefill_attention(
            qp[begin:end].float(), cache.keys[s + 1][context_len - n:].float(),
            cache.values[s + 1][context_len - n:].float(), cache.float32(), seg, SCALE, window,
            sinks=sinks)
        assert_close(out[begin:end], want, dtype)


@pytest.mark.parametrize("dtype,block_size,head_dim", [
    (torch.bfloat16, 16, 64), (torch.float16, 32, 128)])
def test_write_kv_matches_reference_and_skips_negative_slots(dtype, block_size, head_dim):
    gen = torch.Generator().manual_seed(block_size)
    kv_heads, tokens = 2, 12
    full = torch.full((LAYERS, 2, NUM_BLOCKS, kv_heads, block_size, head_dim), 1e4,
                      dtype=dtype)
    # K and V as slices of one fused projection output, as the model produces them
    fused = torch.randn(tokens, 3, kv_heads, head_dim, generator=gen).to(dtype)
    k, v = fused[:, 1], fused[:, 2]
    slots = torch.randperm(NUM_BLOCKS * block_size, generator=gen)[:tokens]
    slots[[0, 5, 11]] = -1  # padding rows of a graph batch
    expected = full.clone()
    keep = slots >= 0
    reference.write_kv(expected[1], k[keep], v[keep], slots[keep])

    triton_paged.write_kv(full[1], k, v, slots)
    assert torch.equal(full, expected)


def test_unsupported_reason_names_the_field():
    ok = dict(dtype=torch.bfloat16, head_dim=128, block_size=16, num_heads=8, num_kv_heads=2)
    reason = triton_paged.unsupported_reason
    assert reason(**ok) is None
    assert reason(**{**ok, "dtype": torch.float16, "head_dim": 64, "block_size": 64}) is None
    assert "dtype torch.float32" in reason(**{**ok, "dtype": torch.float32})
    assert "head_dim 96" in reason(**{**ok, "head_dim": 96})
    assert "block_size 8" in reason(**{**ok, "block_size": 8})
    assert "block_size 48" in reason(**{**ok, "block_size": 48})
    assert "num_heads 6" in reason(**{**ok, "num_heads": 6, "num_kv_heads": 4})

    cache = torch.zeros(2, 4, 2, 16, 96, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="head_dim 96"):
        triton_paged.decode_attention(torch.zeros(1, 4, 96, dtype=torch.bfloat16), cache,
                                      torch.zeros(1, 1, dtype=torch.int32),
                                      torch.ones(1, dtype=torch.int32), SCALE)


def test_the_memory_plan_bounds_the_decode_splits_the_kernel_chooses():
    """memory_plan.py sizes the decode kernel's float32 partials from its launch shapes
    (pd_runtime/kernels/triton_launch.py): at most MAX_SPLITS splits, and whenever the kernel
    splits, fewer than 2 x PROGRAMS_PER_SM x SMs / kv heads (sequence, split) pairs."""
    from pd_runtime.engine.kv_cache.memory_plan import MAX_SMS

    split = triton_launch.default_num_splits
    assert split(1, 1, 1 << 20, sm_count=1000) == triton_launch.MAX_SPLITS
    for sms in (108, 132, 148, MAX_SMS):
        for kv_heads in (1, 2, 4, 8, 16):
            bound = 2 * triton_launch.PROGRAMS_PER_SM * sms / kv_heads
            for batch in range(1, 600):
                splits = split(batch, kv_heads, 1 << 14, sms)
                assert splits == 1 or batch * splits < bound, (sms, kv_heads, batch, splits)


@pytest.mark.parametrize("block_size,keys", [(16, 16), (32, 16), (32, 128)])
def test_any_keys_per_tile_gives_the_reference(block_size, keys):
    """Keys per loop step below, at and above the block size (the default gathers several
    blocks per step): decode split and whole, and prefill chunks after a cached prefix, over
    sequences of several tiles; a value that is not a power of two >= 16 is refused."""
    dtype, head_dim, heads, kv_heads = torch.bfloat16, 64, 8, 2
    lens = [2 * keys + 3, 2, keys]
    cache = PagedCache(dtype, block_size, head_dim, kv_heads, lens, seed=keys + block_size)
    context_lens = torch.tensor(lens)
    q = cache.randn(len(lens), heads, head_dim)
    expected = reference.decode_attention(q.float(), cache.float32(), cache.tables,
                                          context_lens, SCALE)
    for splits in (1, 3):
        out = triton_paged.decode_attention(q, cache.kv, cache.tables, context_lens, SCALE,
                                            num_splits=splits, keys_per_tile=keys)
        assert_close(out, expected, dtype)

    chunks = [keys + 5, 1, keys]
    starts = torch.tensor([0] + chunks).cumsum(0).to(torch.int32)
    qp = cache.randn(int(starts[-1]), heads, head_dim)
    out = triton_paged.prefill_attention(qp, cache.kv, starts, context_lens.to(torch.int32),
                                         cache.tables, SCALE, max_query_len=max(chunks),
                                         keys_per_tile=keys)
    for s, (context_len, n) in enumerate(zip(lens, chunks)):
        seg = reference.PrefillSegment(0, n, context_len, cache.tables[s])
        want = reference.prefill_attention(
            qp[int(starts[s]):int(starts[s + 1])].float(), cache.keys[s][context_len - n:].float(),
            cache.values[s][context_len - n:].float(), cache.float32(), seg, SCALE)
        assert_close(out[int(starts[s]):int(starts[s + 1])], want, dtype)
    wide = triton_paged.prefill_attention(qp, cache.kv, starts, context_lens.to(torch.int32),
                                          cache.tables, SCALE, max_query_len=max(chunks),
                                          keys_per_tile=keys, rows_per_tile=128, num_warps=8)
    assert_close(wide, out.float(), dtype)
    with pytest.raises(ValueError, match="rows_per_tile 48"):
        triton_paged.prefill_attention(qp, cache.kv, starts, context_lens.to(torch.int32),
                                       cache.tables, SCALE, max_query_len=max(chunks),
                                       rows_per_tile=48)
    with pytest.raises(ValueError, match="keys_per_tile 48"):
        triton_paged.decode_attention(q, cache.kv, cache.tables, context_lens, SCALE,
                                      keys_per_tile=48)
