"""Helpers shared by the bench scripts: the bench model, prompts, physical limits of the box."""

from __future__ import annotations

import json
import platform
import random
import time
from pathlib import Path

import torch


def bench_model(path: str | None) -> str:
    if path:
        return path
    from pd_runtime.cli import ensure_default_model

    return str(ensure_default_model())


def random_prompts(model_dir: str, num_prompts: int, input_len: int, seed: int = 0):
    """Token-id prompts every engine gets identically (ids 0-4 are the special tokens)."""
    vocab = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
    rng = random.Random(seed)
    return [[rng.randrange(5, vocab) for _ in range(input_len)] for _ in range(num_prompts)]


def best_of(fn, repeats: int = 5, budget_s: float = 0.0) -> float:
    """The fastest of `repeats` timings of `fn`, and of as many more as `budget_s` seconds of
    timings allow: a bound wants what the box can give, and a shared box's other jobs only
    slow single timings down."""
    fn()
    best, spent, timings = float("inf"), 0.0, 0
    while timings < repeats or spent < budget_s:
        start = time.perf_counter()
        fn()
        took = time.perf_counter() - start
        best, spent, timings = min(best, took), spent + took, timings + 1
    return best


def copy_bandwidth_gbs(num_bytes: int = 1 << 28, budget_s: float = 0.0) -> float:
    """Bytes copied per second by `copy_` (what a weight read + write costs), best of 5 (and
    of `budget_s` seconds of timings)."""
    src = torch.empty(num_bytes, dtype=torch.uint8).fill_(1)
    dst = torch.empty_like(src)
    return num_bytes / best_of(lambda: dst.copy_(src), budget_s=budget_s) / 1e9


def read_bandwidth_gbs(num_bytes: int = 1 << 28, budget_s: float = 0.0) -> float:
    """Bytes read per second by a reduction (the decode-step bound: weights are only read),
    best of 5 (and of `budget_s` seconds of timings)."""
    src = torch.ones(num_bytes // 4, dtype=torch.float32)
    return num_bytes / best_of(lambda: src.sum(), budget_s=budget_s) / 1e9


def _engine_linear(dtype: torch.dtype, k: int, n: int, checkpoint_dtype: torch.dtype | None):
    """A random `[n, k]` weight held as the engine holds one on this CPU: its values rounded
    through the checkpoint's dtype (a bf16 checkpoint run in float32 keeps bf16 values, which
    the native float32 kernel packs as bf16), cast to `dtype` and packed by the engine's
    prepack_weight. Returns (x -> x @ weight.T by the engine's linear, bytes one weight value
    occupies in what that call reads)."""
    from pd_runtime.model.llama import linear, prepack_weight

    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(n, k, generator=gen).to(checkpoint_dtype or dtype).to(dtype)
    packed = prepack_weight(weight)
    read = getattr(packed, "panels", weight)  # the native kernel's panels, else the weight's dtype
    return (lambda x: linear(x, weight, packed)), read.element_size()


def matmul_gflops(dtype: torch.dtype, rows: int, k: int, n: int, threads: int | None = None,
                  checkpoint_dtype: torch.dtype | None = None, budget_s: float = 1.0) -> float:
    """GFLOP/s of `[rows, k] x [k, n]` in `dtype` through the linear the engine runs for that
    dtype here (pd_runtime.model.llama.linear on a prepack_weight weight: the native float32
    kernel, oneDNN's packed bf16, else F.linear), on `threads` torch threads (None: the
    current count), the best of 5 timings and of `budget_s` seconds of them (best_of).
    Random data: zeros run faster than real values. The weight stays in the caches between
    calls, so the rate is at least what the same call reaches in a step."""
    call, _ = _engine_linear(dtype, k, n, checkpoint_dtype)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(1)).to(dtype)
    calls = max(1, 64 // rows)  # enough work per timing for small calls
    before = torch.get_num_threads()
    torch.set_num_threads(threads or before)
    try:
        seconds = best_of(lambda: [call(x) for _ in range(calls)], budget_s=budget_s) / calls
    finally:
        torch.set_num_threads(before)
    return 2 * rows * k * n / seconds / 1e9


def linear_weight_value_bytes(dtype: torch.dtype,
                              checkpoint_dtype: torch.dtype | None = None) -> int:
    """Bytes per weight value that the engine's linear reads in `dtype` (2 for a bf16
    checkpoint run in float32 by the native kernel, which packs its bf16 values as bf16)."""
    return _engine_linear(dtype, 64, 16, checkpoint_dtype)[1]


def machine_line() -> str:
    cpu = "unknown CPU"
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return (f"{cpu}, {torch.get_num_threads()} torch threads, Python {platform.python_version()}, "
            f"torch {torch.__version__}")
