"""Compile the Triton paged-attention kernels for an H100/H200 (sm_90) on a machine without a
GPU, and print each variant's registers, spills and software pipelining as one JSON line.

Triton's CUDA backend ships ptxas and cuobjdump, so the real compiler runs here: what the
interpreter never sees (a construct the backend rejects, a tile that spills, a loop whose loads
are not pipelined) shows without a GPU. Each variant is what the engine launches: the public
functions of pd_runtime/kernels/triton_paged.py are called with host tensors of the engine's
shapes, their kernel launches recorded, and each compiled with the specialization Triton's
launcher would give those arguments (pointers and integers divisible by 16 marked so: without
that mark loads are not vectorized and loops not pipelined, and the figures mean nothing).
Run in a process without TRITON_INTERPRET (tests/test_triton_compile.py does). A spill shows
as STACK bytes on sm_90 (spill stores go to the stack frame; LOCAL stays 0).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime.jit import create_function_from_signature

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from pd_runtime.kernels import triton_launch as launch  # noqa: E402
from pd_runtime.kernels import triton_paged as tp  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
KERNELS = ("_write_kv_kernel", "_decode_split_kernel", "_decode_reduce_kernel", "_prefill_kernel")


class _Recorder:
    """Stands in for a JIT kernel: `kernel[grid](*args, **kwargs)` records the launch."""

    def __init__(self, fn, launches: list):
        self.fn, self.launches = fn, launches

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append((self.fn, args, kwargs))


def recorded(call) -> list:
    """The kernel launches `call()` makes: [(jit function, args, kwargs)]."""
    launches: list = []
    saved = {name: getattr(tp, name) for name in KERNELS}
    try:
        for name, fn in saved.items():
            setattr(tp, name, _Recorder(fn, launches))
        call()
    finally:
        for name, fn in saved.items():
            setattr(tp, name, fn)
    return launches


def compile_launch(fn, args: tuple, kwargs: dict):
    """The kernel Triton's launcher would compile for these arguments on sm_90."""
    backend = make_backend(TARGET)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound,
                                                          specialization, options)
    return triton.compile(ASTSource(fn, signature, constexprs, attrs), target=TARGET,
                          options=options.__dict__)


def resources(kernel) -> dict:
    """Registers per thread, stack/local bytes (spills), shared memory and how many of the
    kernel's loads became asynchronous copies (a pipelined loop's)."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(kernel.asm["cubin"])
        cubin.flush()
        usage = subprocess.run([str(tool), "--dump-resource-usage", cubin.name],
                               capture_output=True, text=True, check=True).stdout
    found = re.search(r"REG:(\d+) STACK:(\d+).*?LOCAL:(\d+)", usage, re.S)
    return {"registers": int(found.group(1)), "stack_bytes": int(found.group(2)),
            "local_bytes": int(found.group(3)), "shared_bytes": kernel.metadata.shared,
            "async_copies": kernel.asm["ttgir"].count("async_copy_global_to_local")}


def _engine_tensors(head_dim: int, block: int, heads: int = 32, kv_heads: int = 8,
                    tokens: int = 24, seqs: int = 3, width: int = 37):
    """A layer's view of a two-layer cache and a fused qkv projection's q/k/v, as the engine
    holds them (pd_runtime/engine/model_runner.py, pd_runtime/model/llama.py), bf16."""
    cache = torch.zeros(2, 2, 64, kv_heads, block, head_dim, dtype=torch.bfloat16)
    qkv = torch.zeros(tokens, (heads + 2 * kv_heads) * head_dim, dtype=torch.bfloat16)
    q = qkv[:, :heads * head_dim].view(tokens, heads, head_dim)
    k = qkv[:, heads * head_dim:(heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    v = qkv[:, (heads + kv_heads) * head_dim:].view(tokens, kv_heads, head_dim).contiguous()
    tables = torch.zeros(seqs, width, dtype=torch.int32)  # (a width not divisible by 16)
    return cache[1], q, k, v, tables


def variants(**overrides):
    """The launches the engine makes: head_dim 64/128/256, block 16 and 32, GQA 4, with and
    without Gemma 2's softcap and gpt-oss's sinks, decode also over a table 64 wide;
    `overrides` go to decode_attention and prefill_attention (the benchmarks' tilings).
    Yields (name, jit function, args, kwargs)."""
    for head_dim in tp.SUPPORTED_HEAD_DIMS:
        for block, softcap, sinks in ((16, 0.0, False), (32, 0.0, False), (16, 50.0, True)):
            kv, q, k, v, tables = _engine_tensors(head_dim, block)
            extra = dict(softcap=softcap, sinks=torch.zeros(q.shape[1]) if sinks else None)
            name = f"d{head_dim} bs{block}" + (" softcap sinks" if sinks else "")
            seqs = tables.shape[0]
            lens = torch.full((seqs,), 300, dtype=torch.int32)
            out = torch.empty_like(q)
            decode_kw = {key: val for key, val in overrides.items() if key != "rows_per_tile"}
            launches = recorded(lambda: tp.decode_attention(
                q[:seqs], kv, tables, lens, 0.1, out=out[:seqs], num_splits=8,
                **extra, **decode_kw))
            yield f"decode {name}", *launches[0]
            starts = torch.tensor([0, 8, 16, 24], dtype=torch.int32)
            launches = recorded(lambda: tp.prefill_attention(
                q, kv, starts, lens, tables, 0.1,
                max_query_len=8, out=out, **extra, **overrides))
            yield f"prefill {name}", *launches[0]
        kv, q, k, v, tables = _engine_tensors(head_dim, 16, width=64)
        lens = torch.full((tables.shape[0],), 300, dtype=torch.int32)
        # a CUDA graph's table (max_model_len wide, here divisible by 16: another specialization)
        launches = recorded(lambda: tp.decode_attention(q[:3], kv, tables, lens, 0.1,
                                                        num_splits=8))
        yield f"decode d{head_dim} bs16 table 64", *launches[0]
        launches = recorded(lambda: tp.decode_attention(
            q[:3], kv, tables, lens, 0.1, num_splits=launch.MAX_SPLITS,
            sinks=torch.zeros(q.shape[1])))
        yield f"reduce d{head_dim}", *launches[1]
        launches = recorded(lambda: tp.write_kv(kv, k, v, torch.zeros(k.shape[0],
                                                                      dtype=torch.int64)))
        yield f"write_kv d{head_dim}", *launches[0]


def main() -> None:
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        sys.exit("run without TRITON_INTERPRET: the interpreter compiles nothing")
    print(json.dumps({name: resources(compile_launch(fn, args, kwargs))
                      for name, fn, args, kwargs in variants()}))


if __name__ == "__main__":
    main()
