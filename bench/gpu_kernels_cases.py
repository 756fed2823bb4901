"""The paged-attention kernels' test cases and their checks against the torch reference
(pd_runtime/kernels/attention.py): inputs with NaN past every context, the reference, the comparison."""

from __future__ import annotations

from dataclasses import dataclass

import torch

# bf16/fp16 outputs of fp32-accumulated attention: |out - ref| / |ref| lands near 3e-3.
MAX_REL_ERR = 1e-2


@dataclass(frozen=True)
class Shape:
    heads: int
    kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    @property
    def scale(self) -> float:
        return self.head_dim ** -0.5

    def kv_bytes(self, tokens: int) -> int:
        """K and V of `tokens` positions in one layer."""
        return 2 * tokens * self.kv_heads * self.head_dim * _elem(self.dtype)


def _elem(dtype: torch.dtype) -> int:
    return torch.tensor([], dtype=dtype).element_size()


# ---------------------------------------------------------------------------------- cases
@dataclass
class PagedCase:
    """Queries over a paged cache `[2, num_blocks, kv_heads, block_size, head_dim]`. Decode:
    q `[B, heads, d]`, one row per sequence. Prefill: q `[T, heads, d]`, segment s being
    q[query_start_loc[s]:query_start_loc[s+1]], its K/V already in the cache (k_new, v_new)."""

    shape: Shape
    q: torch.Tensor
    kv: torch.Tensor
    block_tables: torch.Tensor      # [S, width] int32, padded with block 0
    context_lens: torch.Tensor      # [S] int32: keys in the cache after this step
    query_start_loc: torch.Tensor | None = None  # [S + 1] int32 (prefill)
    k_new: torch.Tensor | None = None            # [T, kv_heads, d] (prefill)
    v_new: torch.Tensor | None = None

    @property
    def max_query_len(self) -> int:
        return int((self.query_start_loc[1:] - self.query_start_loc[:-1]).max())


def _tables(lens: list[int], block_size: int, num_blocks: int, device, gen) -> torch.Tensor:
    """Each sequence's blocks drawn at random (distinct across sequences), padded with 0."""
    counts = [-(-n // block_size) for n in lens]
    if sum(counts) > num_blocks:
        raise ValueError(f"{sum(counts)} blocks wanted, cache has {num_blocks}")
    perm = torch.randperm(num_blocks, generator=gen)
    width = max(max(counts), 1)
    tables = torch.zeros(len(lens), width, dtype=torch.int32)
    used = 0
    for row, count in enumerate(counts):
        tables[row, :count] = perm[used:used + count].to(torch.int32)
        used += count
    return tables.to(device)


def _poison_tails(kv: torch.Tensor, tables: torch.Tensor, lens: list[int]) -> None:
    """NaN in every slot past a sequence's context in its last block: a kernel that reads an
    invisible key turns its output into NaN."""
    block_size = kv.shape[3]
    for row, n in enumerate(lens):
        if n % block_size:
            block = int(tables[row, (n - 1) // block_size])
            kv[:, block, :, n % block_size:] = float("nan")


def decode_case(shape: Shape, lens: list[int], device, seed: int = 0,
                spare_blocks: int = 3) -> PagedCase:
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-n // shape.block_size) for n in lens) + spare_blocks
    kv = torch.randn(2, num_blocks, shape.kv_heads, shape.block_size, shape.head_dim,
                     generator=gen).to(device=device, dtype=shape.dtype)
    tables = _tables(lens, shape.block_size, num_blocks, device, gen)
    _poison_tails(kv, tables, lens)
    q = torch.randn(len(lens), shape.heads, shape.head_dim, generator=gen).to(device, shape.dtype)
    return PagedCase(shape, q, kv, tables, torch.tensor(lens, dtype=torch.int32, device=device))


def prefill_case(shape: Shape, segments: list[tuple[int, int]], device,
                 seed: int = 0) -> PagedCase:
    """`segments`: (query tokens, cached tokens before them) each; the queries' own K/V are
    written into the cache by the torch reference's write_kv."""
    from pd_runtime.kernels import attention as ref

    gen = torch.Generator().manual_seed(seed)
    lens = [n + cached for n, cached in segments]
    num_blocks = sum(-(-n // shape.block_size) for n in lens) + 3
    kv = torch.randn(2, num_blocks, shape.kv_heads, shape.block_size, shape.head_dim,
                     generator=gen).to(device=device, dtype=shape.dtype)
    tables = _tables(lens, shape.block_size, num_blocks, device, gen)
    _poison_tails(kv, tables, lens)
    tokens = sum(n for n, _ in segments)
    q = torch.randn(tokens, shape.heads, shape.head_dim, generator=gen).to(device, shape.dtype)
    k_new = torch.randn(tokens, shape.kv_heads, shape.head_dim, generator=gen).to(device,
                                                                                  shape.dtype)
    v_new = torch.randn(tokens, shape.kv_heads, shape.head_dim, generator=gen).to(device,
                                                                                  shape.dtype)
    starts = [0]
    slots = []
    for row, (n, cached) in enumerate(segments):
        starts.append(starts[-1] + n)
        pos = torch.arange(cached, cached + n, device=device)
        slots.append(tables[row].long()[pos // shape.block_size] * shape.block_size
                     + pos % shape.block_size)
    ref.write_kv(kv, k_new, v_new, torch.cat(slots))
    return PagedCase(shape, q, kv, tables, torch.tensor(lens, dtype=torch.int32, device=device),
                     torch.tensor(starts, dtype=torch.int32, device=device), k_new, v_new)


def reference_decode(case: PagedCase) -> torch.Tensor:
    """The torch reference in float32 (NaN tails zeroed: it reads whole blocks, then masks)."""
    from pd_runtime.kernels import attention as ref

    kv = torch.nan_to_num(case.kv.float(), nan=0.0)
    return ref.decode_attention(case.q.float(), kv, case.block_tables.long(),
                                case.context_lens.long(), case.shape.scale)


def reference_prefill(case: PagedCase) -> torch.Tensor:
    from pd_runtime.kernels import attention as ref

    kv = torch.nan_to_num(case.kv.float(), nan=0.0)
    out = torch.empty(case.q.shape, dtype=torch.float32, device=case.q.device)
    starts = case.query_start_loc.tolist()
    for row, ctx in enumerate(case.context_lens.tolist()):
        a, b = starts[row], starts[row + 1]
        blocks = case.block_tables[row, :-(-ctx // case.shape.block_size)].long()
        seg = ref.PrefillSegment(0, b - a, ctx, blocks)
        out[a:b] = ref.prefill_attention(case.q[a:b].float(), case.k_new[a:b].float(),
                                         case.v_new[a:b].float(), kv, seg, case.shape.scale)
    return out


def run_decode(tp, case: PagedCase, num_splits: int | None = None) -> torch.Tensor:
    """The Triton decode into a NaN-poisoned output (unwritten elements stay NaN)."""
    out = torch.full_like(case.q, float("nan"))
    tp.decode_attention(case.q, case.kv, case.block_tables, case.context_lens, case.shape.scale,
                        out=out, num_splits=num_splits)
    return out


def run_prefill(tp, case: PagedCase) -> torch.Tensor:
    out = torch.full_like(case.q, float("nan"))
    tp.prefill_attention(case.q, case.kv, case.query_start_loc, case.context_lens,
                         case.block_tables, case.shape.scale, max_query_len=case.max_query_len,
                         out=out)
    return out


def compare(out: torch.Tensor, ref: torch.Tensor) -> dict:
    """max |out - ref|, |out - ref| / |ref| (norms), and whether it passes; NaN never does."""
    diff = out.float() - ref
    max_abs = diff.abs().max().item() if diff.numel() else 0.0
    rel = (diff.norm() / ref.norm().clamp_min(1e-30)).item() if diff.numel() else 0.0
    ok = bool(torch.isfinite(out).all().item()) and rel < MAX_REL_ERR
    return {"max_abs_err": max_abs, "rel_err": rel, "ok": ok}


def check_write_kv(tp, shape: Shape, device, tokens: int = 37, seed: int = 0) -> dict:
    """Triton write_kv against the reference's on distinct random slots, some of them -1
    (padding rows: nothing written). Exact equality, the whole cache compared."""
    from pd_runtime.kernels import attention as ref

    gen = torch.Generator().manual_seed(seed)
    num_blocks = -(-tokens // shape.block_size) + 4
    cache = torch.randn(2, num_blocks, shape.kv_heads, shape.block_size, shape.head_dim,
                        generator=gen).to(device, shape.dtype)
    slots = torch.randperm(num_blocks * shape.block_size, generator=gen)[:tokens]
    slots[::5] = -1
    k = torch.randn(tokens, shape.kv_heads, shape.head_dim, generator=gen).to(device, shape.dtype)
    v = torch.randn(tokens, shape.kv_heads, shape.head_dim, generator=gen).to(device, shape.dtype)
    slots = slots.to(device)
    expected = cache.clone()
    valid = slots >= 0
    ref.write_kv(expected, k[valid], v[valid], slots[valid])
    tp.write_kv(cache, k, v, slots)
    wrong = (cache != expected).sum().item()
    return {"max_abs_err": (cache.float() - expected.float()).abs().max().item(),
            "rel_err": 0.0 if wrong == 0 else float("inf"), "ok": wrong == 0}


def correctness_checks(tp, shape: Shape, device, decode_lens: list[int],
                       segments: list[tuple[int, int]]) -> list[dict]:
    """Every kernel against the reference on the device, at this shape."""
    results = []

    def record(name: str, detail: str, result: dict) -> None:
        results.append({"check": name, "detail": detail, **result})
        print(f"  check {name:<8} {detail:<44} max abs err {result['max_abs_err']:.2e}  "
              f"rel {result['rel_err']:.2e}  {'ok' if result['ok'] else 'FAILED'}", flush=True)

    record("write_kv", "37 slots, every 5th -1", check_write_kv(tp, shape, device))
    case = decode_case(shape, decode_lens, device, seed=1)
    expected = reference_decode(case)
    for splits in (None, 1, 3):
        record("decode", f"lens {_short(decode_lens)} splits {splits or 'auto'}",
               compare(run_decode(tp, case, splits), expected))
    case = prefill_case(shape, segments, device, seed=2)
    record("prefill", f"(queries, cached) {_short(segments)}",
           compare(run_prefill(tp, case), reference_prefill(case)))
    return results


def _short(items: list) -> str:
    text = ",".join(str(i).replace(" ", "") for i in items)
    return text if len(text) <= 34 else text[:31] + "..."
