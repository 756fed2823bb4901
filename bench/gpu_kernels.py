"""Benchmark of the Triton paged-attention kernels (pd_runtime/kernels/triton_paged.py) on one device:
decode GB/s against the device's copy bandwidth and prefill TFLOP/s against its matmul rate
in the kernels' dtype, both ceilings measured in the same run, after every kernel is checked
against the torch reference (pd_runtime/kernels/attention.py) on the device.

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
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# The parts: gpu_kernels_cases (cases, reference, checks), gpu_kernels_timing (ceilings, sweeps).
from bench.gpu_kernels_cases import Shape, correctness_checks  # noqa: E402
from bench.gpu_kernels_timing import (copy_bandwidth, decode_sweep, matmul_tflops,  # noqa: E402
                                      prefill_sweep, summarize)

# tests/test_gpu.py reaches these through this module.
from bench.gpu_kernels_cases import (PagedCase, _poison_tails, check_write_kv,  # noqa: E402,F401
                                     compare, decode_case, prefill_case, reference_decode,
                                     reference_prefill, run_decode, run_prefill)

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}
MISSING_EXIT = 3  # the kernels module is not there: nothing to check or time


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
        from pd_runtime.kernels import triton_paged as tp
    except ImportError as exc:
        print(json.dumps({"missing": f"pd_runtime.kernels.triton_paged: {exc}"}))
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
        matmul = matmul_tflops(device, args.matmul_n, args.rounds, shape.dtype)
        print(f"  ceilings: copy {copy_gbs:.1f} GB/s (read + write), read {read_gbs:.1f} GB/s, "
              f"{args.dtype} matmul {args.matmul_n}^3 {matmul:.1f} TFLOP/s", flush=True)
        result.update(copy_gbs=copy_gbs, read_gbs=read_gbs, matmul_tflops=matmul)
        l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) \
            if device.type == "cuda" else 0
        rotation_bytes = max(8 * l2, 256 << 20) if device.type == "cuda" else 0
        decode = decode_sweep(tp, shape, device, _ints(args.batches), _ints(args.contexts),
                              int(args.memory_budget_gib * 2**30), rotation_bytes, args.rounds,
                              copy_gbs, compare_at=(args.long_context, args.long_batch))
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
