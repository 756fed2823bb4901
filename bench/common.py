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


def best_of(fn, repeats: int = 5) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def copy_bandwidth_gbs(num_bytes: int = 1 << 28) -> float:
    """Bytes copied per second by `copy_` (what a weight read + write costs), best of 5."""
    src = torch.empty(num_bytes, dtype=torch.uint8).fill_(1)
    dst = torch.empty_like(src)
    return num_bytes / best_of(lambda: dst.copy_(src)) / 1e9


def read_bandwidth_gbs(num_bytes: int = 1 << 28) -> float:
    """Bytes read per second by a reduction (the decode-step bound: weights are only read)."""
    src = torch.ones(num_bytes // 4, dtype=torch.float32)
    return num_bytes / best_of(lambda: src.sum()) / 1e9


def bf16_matmul_gflops(n: int = 2048) -> float:
    a = torch.randn(n, n).bfloat16()
    b = torch.randn(n, n).bfloat16()
    return 2 * n ** 3 / best_of(lambda: a @ b, 3) / 1e9


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
