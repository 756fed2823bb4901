"""Compile the Triton paged-attention kernels for an H100/H200 (sm_90) on a machine without a
GPU, and print each variant's registers and local memory (spills) as one JSON line.

Triton's CUDA backend ships ptxas and cuobjdump, so the real compiler runs here: what the
interpreter never sees (a construct the backend rejects, a tile that spills) shows without a
GPU. Run in a process without TRITON_INTERPRET (tests/test_triton_compile.py does). A spill
shows as STACK bytes on sm_90 (spill stores go to the stack frame; LOCAL stays 0).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from pd_runtime.kernels import triton_launch as launch  # noqa: E402
from pd_runtime.kernels import triton_paged as tp  # noqa: E402

POINTER_TYPES = {"q_ptr": "*bf16", "kv_ptr": "*bf16", "out_ptr": "*bf16", "k_ptr": "*bf16",
                 "v_ptr": "*bf16", "max_ptr": "*fp32", "sum_ptr": "*fp32", "part_ptr": "*fp32",
                 "sinks_ptr": "*fp32"}  # the rest (tables, lengths, starts, slots): int32


def _signature(fn, constants: dict) -> dict:
    sig = {}
    for name in fn.arg_names:
        if name in constants:
            sig[name] = "constexpr"
        elif name.endswith("_ptr"):
            sig[name] = POINTER_TYPES.get(name, "*i32")
        else:
            sig[name] = "fp32" if name == "qk_scale" else "i32"
    return sig


def resources(fn, constants: dict, num_warps: int = launch.NUM_WARPS) -> dict:
    """Registers per thread and local-memory bytes of one compiled variant (sm_90)."""
    source = ASTSource(fn, _signature(fn, constants),
                       constexprs={(fn.arg_names.index(k),): v for k, v in constants.items()})
    kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": num_warps})
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(kernel.asm["cubin"])
        cubin.flush()
        usage = subprocess.run([str(tool), "--dump-resource-usage", cubin.name],
                               capture_output=True, text=True, check=True).stdout
    found = re.search(r"REG:(\d+) STACK:(\d+).*?LOCAL:(\d+)", usage, re.S)
    # (sm_90 spills into the stack frame: STACK; LOCAL stays 0 there)
    return {"registers": int(found.group(1)), "stack_bytes": int(found.group(2)),
            "local_bytes": int(found.group(3))}


def variants():
    """The shapes the engine launches: head_dim 64/128/256, block 16 and 32, GQA 4, with and
    without Gemma 2's softcap and gpt-oss's sinks."""
    common = dict(DOT_IN_F32=False)
    for head_dim in tp.SUPPORTED_HEAD_DIMS:
        for block, softcap, sinks in ((16, 0.0, False), (32, 0.0, False), (16, 50.0, True)):
            feature = dict(SOFTCAP=softcap, HAS_SINKS=sinks, **common)
            name = f"d{head_dim} bs{block}" + (" softcap sinks" if sinks else "")
            yield f"decode {name}", tp._decode_split_kernel, dict(
                GROUP=4, GROUP_ROWS=launch.MIN_GROUP_ROWS, NUM_SPLITS=8, BLOCK_SIZE=block,
                KEYS=block, HEAD_DIM=head_dim, **feature)
            yield f"prefill {name}", tp._prefill_kernel, dict(
                GROUP=4, BLOCK_SIZE=block, HEAD_DIM=head_dim,
                BLOCK_M=launch.PREFILL_BLOCK_M if head_dim <= 128 else launch.PREFILL_BLOCK_M_WIDE,
                KEYS=launch.prefill_keys_per_tile(head_dim),
                **feature)
        yield f"reduce d{head_dim}", tp._decode_reduce_kernel, dict(
            NUM_SPLITS=launch.MAX_SPLITS, SPLITS_POW2=launch.MAX_SPLITS, HEAD_DIM=head_dim,
            HAS_SINKS=True)
        yield f"write_kv d{head_dim}", tp._write_kv_kernel, dict(BLOCK_SIZE=16, HEAD_DIM=head_dim)


def main() -> None:
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        sys.exit("run without TRITON_INTERPRET: the interpreter compiles nothing")
    print(json.dumps({name: resources(fn, constants, 1 if name.startswith("write_kv")
                                      else launch.NUM_WARPS)
                      for name, fn, constants in variants()}))


if __name__ == "__main__":
    main()
