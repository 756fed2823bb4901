"""Timing the paged-attention kernels: medians over CUDA events or CUDA graph replays, the
device's copy and matmul ceilings, the decode and prefill sweeps and their headline figures."""

from __future__ import annotations

import statistics
import time

import torch

from bench.gpu_kernels_cases import PagedCase, Shape, _elem, _tables
from pd_runtime.kernels import triton_launch as launch


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


def matmul_tflops(device: torch.device, n: int, rounds: int, dtype: torch.dtype) -> float:
    """n x n x n in `dtype` (the kernels' own: the prefill attention it bounds runs in it) on
    random data (zeros run faster than real data would)."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    seconds = time_median(lambda: torch.matmul(a, b), device, rounds)
    return 2 * n ** 3 / seconds / 1e12


# ---------------------------------------------------------------------------------- sweeps
def decode_bytes(shape: Shape, batch: int, context: int, width: int) -> int:
    elem = _elem(shape.dtype)
    return (batch * shape.kv_bytes(context) + 2 * batch * shape.heads * shape.head_dim * elem
            + batch * (width + 1) * 4)


def decode_sweep(tp, shape: Shape, device, batches: list[int], contexts: list[int],
                 budget_bytes: int, rotation_bytes: int, rounds: int, copy_gbs: float,
                 compare_at: tuple[int, int] | None = None) -> list:
    """GB/s of each (batch, context) with the kernel's defaults; at shapes with context and
    batch at least `compare_at`, also with half and twice its split count (within the
    kernel's cap), 32 and 64 keys per loop step in place of one cache block, and 1, 2, 4 and 8
    warps other than the default (whether the defaults sit near the best; `alternatives`:
    variant -> fraction of copy); at every shape, 4 warps where the default differs."""
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
        alternatives = {}
        warps = launch.decode_num_warps(shape.head_dim)
        # 4 warps (the earlier default) at every shape; the rest at long contexts only
        variants = {"4 warps": dict(num_warps=4)} if warps != 4 else {}
        if splits and compare_at and context >= compare_at[0] and batch >= compare_at[1]:
            most = min(tables[0].shape[1], launch.MAX_SPLITS)
            variants.update({f"{n} splits": dict(num_splits=n) for n in sorted(
                {max(1, splits // 2), min(splits * 2, most)} - {splits})})
            variants.update({f"{n} keys/step": dict(keys_per_tile=n) for n in (32, 64) if n > bs})
            variants.update({f"{n} warp{'s' * (n > 1)}": dict(num_warps=n) for n in (1, 2, 4, 8)
                             if n != warps})
        if splits:
            for label, kwargs in variants.items():
                other_calls = [lambda t=t, kw=kwargs: tp.decode_attention(
                    q, kv, t, lens, shape.scale, out=out, **kw) for t in tables]
                other_s, _ = time_launches(other_calls, device, reps, rounds)
                alternatives[label] = num_bytes / other_s / 1e9 / copy_gbs
                del other_calls
        results.append({"batch": batch, "context": context, "us": seconds * 1e6, "gbs": gbs,
                        "fraction_of_copy": gbs / copy_gbs, "bytes": num_bytes,
                        "rotations": rotations, "num_splits": splits, "timing": method,
                        "alternatives": alternatives})
        others = "".join(f", {n} {f:.1%}" for n, f in alternatives.items())
        print(f"  decode B={batch:<4} ctx={context:<6} {seconds * 1e6:9.1f} us  {gbs:8.1f} GB/s "
              f"= {gbs / copy_gbs:6.1%} of copy  (splits {splits}{others}, {rotations} table "
              f"sets, {method})", flush=True)
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

        def call(**kwargs):
            tp.prefill_attention(case.q, case.kv, case.query_start_loc, case.context_lens,
                                 case.block_tables, shape.scale, max_query_len=max_query_len,
                                 out=out, **kwargs)

        seconds = time_median(call, device, rounds)
        tflops = prefill_flops(shape, segments) / seconds / 1e12
        variants = {}  # the same with other tilings: label -> TFLOP/s
        default_keys = launch.prefill_keys_per_tile(shape.head_dim)
        tilings = {}
        if default_keys != shape.block_size:
            tilings["one block per step"] = dict(keys_per_tile=shape.block_size)
        if default_keys > 32:
            tilings["32 keys per step"] = dict(keys_per_tile=32)
        if shape.head_dim <= 128:
            tilings["128 rows, 8 warps"] = dict(rows_per_tile=128, num_warps=8)
            tilings["128 rows, 8 warps, 32 keys"] = dict(rows_per_tile=128, num_warps=8,
                                                         keys_per_tile=32)
        for label, kwargs in tilings.items():
            other_s = time_median(lambda kw=kwargs: call(**kw), device, rounds)
            variants[label] = prefill_flops(shape, segments) / other_s / 1e12
        results.append({"case": name, "segments": segments, "ms": seconds * 1e3,
                        "tflops": tflops, "fraction_of_matmul": tflops / matmul,
                        "variants_tflops": variants})
        others = "; ".join(f"{label}: {v:.1f}" for label, v in variants.items())
        print(f"  prefill {name:<22} {seconds * 1e3:9.2f} ms  {tflops:7.1f} TFLOP/s = "
              f"{tflops / matmul:6.1%} of matmul" + (f" ({others} TFLOP/s)" if others else ""),
              flush=True)
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
            # the median had each shape taken its best of the defaults and the variants
            "median_best_variant": statistics.median(
                max([r["fraction_of_copy"], *r.get("alternatives", {}).values()]) for r in long),
            "best": {k: best[k] for k in ("batch", "context", "gbs", "fraction_of_copy")}}
    fresh = [r for r in prefill if r["case"].startswith("prompt")]
    if fresh:
        longest = max(fresh, key=lambda r: r["segments"][0][0])
        out["prefill_longest"] = {k: longest.get(k) for k in (
            "case", "tflops", "fraction_of_matmul", "variants_tflops")}
    chunked = [r for r in prefill if r["case"].startswith("chunk")]
    if chunked:
        out["prefill_chunked"] = {k: chunked[0].get(k) for k in (
            "case", "tflops", "fraction_of_matmul", "variants_tflops")}
    return out
