"""Benchmark of the Triton paged-attention kernels (kernels/triton_paged.py) on one device:
decode GB/s against the device's copy bandwidth and prefill TFLOP/s against its bf16 matmul
rate, both ceilings measured in the same run, after every kernel is checked against the torch
reference (kernels/attention.py) on the device.

    python bench/gpu_kernels.py [--device cuda|cpu] [--memory-budget-gib 24] [--dtype bfloat16]
        [--heads 32 --kv-heads 8 --head-dim 128 --block-size 16] [--no-check]

What is counted (the bytes and operations no kernel can avoid):
- decode moves q, each visible K and V row once, the block tables and lengths, and writes the
  output; split-K partials are the kernel's own overhead and are not counted.
- the copy ceiling: `dst.copy_(src)` of N bytes moves 2N (read + write). Both figures count
  every byte that crosses device memory, whichever direction (HBM bandwidth is shared by reads
  and writes), so decode / copy compares like with like. A read-only rate (a sum over the same
  N bytes) is printed beside it for reference.
- prefill FLOPs: 4 * heads * head_dim per visible (query, key) pair (QK^T and PV, a multiply-add
  being 2); masked-out work is not counted. The ceiling is an 8192^3 bf16 torch.matmul.
Timings: CUDA events after warm-up; decode launches are replayed from a CUDA graph (launch
overhead out; eager if capture fails, and said so), rotating over block tables that cover
several times the L2 so small shapes are not served from cache; median of rounds.

`--device cpu` runs tiny shapes under TRITON_INTERPRET=1 (set here, before triton is imported):
it proves the plumbing, not the speed. The last line of stdout is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}
# bf16/fp16 outputs of fp32-accumulated attention: |out - ref| / |ref| lands near 3e-3.
MAX_REL_ERR = 1e-2
MISSING_EXIT = 3  # the kernels module is not there: nothing to check or time


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
    from kernels import attention as ref

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
    from kernels import attention as ref

    kv = torch.nan_to_num(case.kv.float(), nan=0.0)
    return ref.decode_attention(case.q.float(), kv, case.block_tables.long(),
                                case.context_lens.long(), case.shape.scale)


def reference_prefill(case: PagedCase) -> torch.Tensor:
    from kernels import attention as ref

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
    from kernels import attention as ref

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


# ---------------------------------------------------------------------------------- timing
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_median(run, device: torch.device, rounds: int) -> float:
    """Median seconds of `run()` over `rounds`, after one warm-up call."""
    run()
    _sync(device)
    times = []
    for _ in range(rounds):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t = time.perf_counter()
            run()
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def time_launches(calls: list, device: torch.device, reps: int, rounds: int) -> tuple[float, str]:
    """Seconds per launch of `reps` launches cycling over `calls` (each reading other memory),
    replayed from a CUDA graph where capture works (no launch gaps), eager otherwise."""
    for call in calls:
        call()  # compile, allocate
    _sync(device)

    def eager():
        for i in range(reps):
            calls[i % len(calls)]()

    run, method = eager, "eager"
    if device.type == "cuda":
        try:
            side = torch.cuda.Stream(device)
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                calls[0]()
            torch.cuda.current_stream(device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                eager()
            run, method = graph.replay, "cuda graph"
        except Exception as exc:  # reported, not fatal: the eager figure includes launch gaps
            method = f"eager (graph capture failed: {type(exc).__name__}: {exc})"[:160]
            torch.cuda.synchronize(device)
    return time_median(run, device, rounds) / reps, method


def copy_bandwidth(device: torch.device, num_bytes: int, rounds: int) -> tuple[float, float]:
    """(copy GB/s counting read + write, read-only GB/s of a sum over the same bytes)."""
    src = torch.randint(0, 255, (num_bytes,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    copy_s = time_median(lambda: dst.copy_(src), device, rounds)
    words = src.view(torch.float32)
    read_s = time_median(lambda: words.sum(), device, rounds)
    return 2 * num_bytes / copy_s / 1e9, num_bytes / read_s / 1e9


def matmul_tflops(device: torch.device, n: int, rounds: int) -> float:
    """bf16 n x n x n on random data (zeros run faster than real data would)."""
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    seconds = time_median(lambda: torch.matmul(a, b), device, rounds)
    return 2 * n ** 3 / seconds / 1e12


# ---------------------------------------------------------------------------------- sweeps
def decode_bytes(shape: Shape, batch: int, context: int, width: int) -> int:
    elem = _elem(shape.dtype)
    return (batch * shape.kv_bytes(context) + 2 * batch * shape.heads * shape.head_dim * elem
            + batch * (width + 1) * 4)


def decode_sweep(tp, shape: Shape, device, batches: list[int], contexts: list[int],
                 budget_bytes: int, rotation_bytes: int, rounds: int, copy_gbs: float) -> list:
    combos = [(b, c) for b in batches for c in contexts if b * shape.kv_bytes(c) <= budget_bytes]
    skipped = [(b, c) for b in batches for c in contexts if (b, c) not in combos]
    if skipped:
        print(f"  decode: skipped (KV over the {budget_bytes / 2**30:.1f} GiB budget): "
              f"{skipped}", flush=True)
    if not combos:
        return []
    bs = shape.block_size
    # One cache for every shape: the largest shape's KV, or the rotation span if larger.
    need = max(b * -(-c // bs) for b, c in combos)
    rotation_blocks = rotation_bytes // shape.kv_bytes(bs)
    num_blocks = max(need, min(rotation_blocks, budget_bytes // shape.kv_bytes(bs)))
    gen = torch.Generator().manual_seed(5)
    kv = torch.empty(2, num_blocks, shape.kv_heads, bs, shape.head_dim, dtype=shape.dtype,
                     device=device)
    kv.normal_()
    print(f"  decode: cache {num_blocks} blocks = {kv.numel() * kv.element_size() / 2**30:.2f} "
          f"GiB, {len(combos)} shapes", flush=True)
    results = []
    for batch, context in combos:
        blocks = batch * -(-context // bs)
        rotations = max(1, min(64, num_blocks // blocks,
                               -(-rotation_bytes // (batch * shape.kv_bytes(context)))))
        perm = torch.randperm(num_blocks, generator=gen)
        lens = torch.full((batch,), context, dtype=torch.int32, device=device)
        q = torch.randn(batch, shape.heads, shape.head_dim, generator=gen).to(device, shape.dtype)
        out = torch.empty_like(q)
        tables = [perm[i * blocks:(i + 1) * blocks].view(batch, -1).to(device, torch.int32)
                  for i in range(rotations)]
        calls = [lambda t=t: tp.decode_attention(q, kv, t, lens, shape.scale, out=out)
                 for t in tables]
        num_bytes = decode_bytes(shape, batch, context, tables[0].shape[1])
        # ~20 ms of traffic per replay at 4 TB/s, at least one pass over the rotations
        reps = max(rotations, min(200, int(0.02 * 4e12 / num_bytes) + 1))
        if device.type == "cpu":
            reps = 1
        seconds, method = time_launches(calls, device, reps, rounds)
        gbs = num_bytes / seconds / 1e9
        splits = None
        if hasattr(tp, "default_num_splits"):
            sm = torch.cuda.get_device_properties(device).multi_processor_count \
                if device.type == "cuda" else getattr(tp, "DEFAULT_SM_COUNT", 132)
            splits = tp.default_num_splits(batch, shape.kv_heads, tables[0].shape[1], sm)
        results.append({"batch": batch, "context": context, "us": seconds * 1e6, "gbs": gbs,
                        "fraction_of_copy": gbs / copy_gbs, "bytes": num_bytes,
                        "rotations": rotations, "num_splits": splits, "timing": method})
        print(f"  decode B={batch:<4} ctx={context:<6} {seconds * 1e6:9.1f} us  {gbs:8.1f} GB/s "
              f"= {gbs / copy_gbs:6.1%} of copy  (splits {splits}, {rotations} table sets, "
              f"{method})", flush=True)
        del calls, tables, out, q
    del kv
    return results


def prefill_flops(shape: Shape, segments: list[tuple[int, int]]) -> float:
    pairs = sum(n * cached + n * (n + 1) // 2 for n, cached in segments)
    return 4.0 * shape.heads * shape.head_dim * pairs


def prefill_sweep(tp, shape: Shape, device, cases: list[tuple[str, list[tuple[int, int]]]],
                  rounds: int, matmul: float) -> list:
    results = []
    for name, segments in cases:
        case = _bench_prefill_case(shape, segments, device)
        out = torch.empty_like(case.q)
        max_query_len = case.max_query_len

        def call():
            tp.prefill_attention(case.q, case.kv, case.query_start_loc, case.context_lens,
                                 case.block_tables, shape.scale, max_query_len=max_query_len,
                                 out=out)

        seconds = time_median(call, device, rounds)
        tflops = prefill_flops(shape, segments) / seconds / 1e12
        results.append({"case": name, "segments": segments, "ms": seconds * 1e3,
                        "tflops": tflops, "fraction_of_matmul": tflops / matmul})
        print(f"  prefill {name:<22} {seconds * 1e3:9.2f} ms  {tflops:7.1f} TFLOP/s = "
              f"{tflops / matmul:6.1%} of matmul", flush=True)
        del case, out
    return results


def _bench_prefill_case(shape: Shape, segments, device) -> PagedCase:
    """A prefill launch's inputs with random cache contents (no reference needed)."""
    gen = torch.Generator().manual_seed(7)
    lens = [n + cached for n, cached in segments]
    num_blocks = sum(-(-n // shape.block_size) for n in lens) + 1
    kv = torch.empty(2, num_blocks, shape.kv_heads, shape.block_size, shape.head_dim,
                     dtype=shape.dtype, device=device).normal_()
    tables = _tables(lens, shape.block_size, num_blocks, device, gen)
    tokens = sum(n for n, _ in segments)
    q = torch.empty(tokens, shape.heads, shape.head_dim, dtype=shape.dtype,
                    device=device).normal_()
    starts = [0]
    for n, _ in segments:
        starts.append(starts[-1] + n)
    return PagedCase(shape, q, kv, tables, torch.tensor(lens, dtype=torch.int32, device=device),
                     torch.tensor(starts, dtype=torch.int32, device=device))


def summarize(decode: list, prefill: list, checks: list, long_context: int,
              long_batch: int) -> dict:
    """Headlines: decode at long contexts (context >= long_context, batch >= long_batch) as a
    fraction of copy bandwidth (median and minimum over those shapes), the longest prompt's and
    the chunked case's prefill rate, and whether every check passed."""
    long = [r for r in decode if r["context"] >= long_context and r["batch"] >= long_batch]
    fractions = [r["fraction_of_copy"] for r in long]
    out = {"checks_ok": bool(checks) and all(c["ok"] for c in checks),
           "max_rel_err": max((c["rel_err"] for c in checks), default=None),
           "decode_long": None, "prefill_longest": None, "prefill_chunked": None}
    if fractions:
        best = max(long, key=lambda r: r["fraction_of_copy"])
        out["decode_long"] = {
            "rule": f"context >= {long_context}, batch >= {long_batch}", "shapes": len(long),
            "median_fraction": statistics.median(fractions), "min_fraction": min(fractions),
            "best": {k: best[k] for k in ("batch", "context", "gbs", "fraction_of_copy")}}
    fresh = [r for r in prefill if r["case"].startswith("prompt")]
    if fresh:
        longest = max(fresh, key=lambda r: r["segments"][0][0])
        out["prefill_longest"] = {k: longest[k] for k in ("case", "tflops",
                                                           "fraction_of_matmul")}
    chunked = [r for r in prefill if r["case"].startswith("chunk")]
    if chunked:
        out["prefill_chunked"] = {k: chunked[0][k] for k in ("case", "tflops",
                                                              "fraction_of_matmul")}
    return out


# ---------------------------------------------------------------------------------- main
def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


# Per device: the shapes a run covers unless told otherwise. cuda: Llama-3.1-8B attention;
# cpu: tiny, for the interpreter.
DEFAULTS = {
    "cuda": dict(heads=32, kv_heads=8, head_dim=128, block_size=16, batches="1,8,32,64,128",
                 contexts="1024,4096,8192,16384,32768", prompts="1024,4096,8192,16384,32768",
                 chunk="2048:16384", memory_budget_gib=24.0, copy_mib=1024, matmul_n=8192,
                 rounds=7, long_context=16384, long_batch=8,
                 check_lens="1,17,1000,4097,8191,32768",
                 check_segments="1000:0,700:3000,1:77,2048:16384,33:15"),
    "cpu": dict(heads=4, kv_heads=2, head_dim=64, block_size=16, batches="1,2",
                contexts="32,80", prompts="24,40", chunk="8:32", memory_budget_gib=1.0,
                copy_mib=32, matmul_n=256, rounds=1, long_context=80, long_batch=1,
                check_lens="1,17,80", check_segments="20:0,9:30,1:7"),
}


def _segments(text: str) -> list[tuple[int, int]]:
    return [tuple(int(x) for x in part.split(":")) for part in text.split(",") if part]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    for name in DEFAULTS["cuda"]:
        ap.add_argument("--" + name.replace("_", "-"), default=None,
                        type=float if name == "memory_budget_gib" else
                        (int if isinstance(DEFAULTS["cuda"][name], int) else str))
    ap.add_argument("--no-check", action="store_true", help="time only")
    ap.add_argument("--no-bench", action="store_true", help="check only")
    args = ap.parse_args(argv)
    for name, value in DEFAULTS[args.device].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # read when triton is imported, below
    elif not torch.cuda.is_available():
        print(json.dumps({"error": "--device cuda, but torch sees no CUDA device"}))
        return 2
    try:
        from kernels import triton_paged as tp
    except ImportError as exc:
        print(json.dumps({"missing": f"kernels.triton_paged: {exc}"}))
        return MISSING_EXIT
    device = torch.device(args.device)
    shape = Shape(args.heads, args.kv_heads, args.head_dim, args.block_size, DTYPES[args.dtype])
    reason = tp.unsupported_reason(shape.dtype, shape.head_dim, shape.block_size, shape.heads,
                                   shape.kv_heads)
    if reason:
        print(json.dumps({"error": f"shape not supported by the kernels: {reason}"}))
        return 2
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (interpreter)"
    print(f"# {name}, torch {torch.__version__}, {shape}", flush=True)
    result: dict = {"device": name, "torch": torch.__version__, "shape": {
        "heads": shape.heads, "kv_heads": shape.kv_heads, "head_dim": shape.head_dim,
        "block_size": shape.block_size, "dtype": args.dtype}}
    try:
        import triton

        result["triton"] = triton.__version__
    except ImportError:
        pass
    checks = []
    if not args.no_check:
        start = time.perf_counter()
        checks = correctness_checks(tp, shape, device, _ints(args.check_lens),
                                    _segments(args.check_segments))
        result["checks_s"] = time.perf_counter() - start
    result["checks"] = checks
    decode, prefill = [], []
    if not args.no_bench:
        copy_gbs, read_gbs = copy_bandwidth(device, args.copy_mib << 20, args.rounds)
        matmul = matmul_tflops(device, args.matmul_n, args.rounds)
        print(f"  ceilings: copy {copy_gbs:.1f} GB/s (read + write), read {read_gbs:.1f} GB/s, "
              f"bf16 matmul {args.matmul_n}^3 {matmul:.1f} TFLOP/s", flush=True)
        result.update(copy_gbs=copy_gbs, read_gbs=read_gbs, matmul_tflops=matmul)
        l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) \
            if device.type == "cuda" else 0
        rotation_bytes = max(8 * l2, 256 << 20) if device.type == "cuda" else 0
        decode = decode_sweep(tp, shape, device, _ints(args.batches), _ints(args.contexts),
                              int(args.memory_budget_gib * 2**30), rotation_bytes, args.rounds,
                              copy_gbs)
        if device.type == "cuda":
            torch.cuda.empty_cache()
        chunk, prefix = _segments(args.chunk)[0]
        cases = [(f"prompt {n}", [(n, 0)]) for n in _ints(args.prompts)]
        cases.append((f"chunk {chunk} over {prefix}", [(chunk, prefix)]))
        prefill = prefill_sweep(tp, shape, device, cases, args.rounds, matmul)
    result.update(decode=decode, prefill=prefill,
                  summary=summarize(decode, prefill, checks, args.long_context, args.long_batch))
    print(json.dumps(result))
    return 0 if all(c["ok"] for c in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
