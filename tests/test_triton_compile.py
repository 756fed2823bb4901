"""The Triton kernels compiled for real, for an H100/H200 (sm_90), on this GPU-less machine:
tests/sm90_compile.py runs Triton's CUDA backend (its bundled ptxas and cuobjdump) on every
launch the engine makes, with the specialization Triton's launcher gives its arguments, in a
process without the interpreter."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from pd_runtime.kernels import triton_launch as launch

SCRIPT = Path(__file__).resolve().parent / "sm90_compile.py"


def test_every_kernel_variant_compiles_for_sm90_pipelined_without_spilling(tmp_path):
    """Each variant compiles (the interpreter accepts constructs the backend may not) and keeps
    its tiles in registers: a spill to local memory would cost a memory-bound kernel its
    bandwidth. The attention kernels' key loops are software-pipelined (their loads become
    asynchronous copies: the next tiles are in flight while one is computed), which needs the
    loads vectorized. Decode at head_dim <= 128 keeps PROGRAMS_PER_SM programs resident per
    SM at once (registers and shared memory), as its split count assumes."""
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_HOME=str(tmp_path))
    run = subprocess.run([sys.executable, str(SCRIPT)], env=env, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    usage = json.loads(run.stdout.strip().splitlines()[-1])
    assert len(usage) == 27, sorted(usage)
    spilled = {name: u for name, u in usage.items() if u["stack_bytes"] or u["local_bytes"]}
    assert not spilled, spilled
    attention = {name: u for name, u in usage.items() if name.startswith(("decode", "prefill"))}
    assert len(attention) == 21
    unpipelined = {name: u for name, u in attention.items() if u["async_copies"] == 0}
    assert not unpipelined, unpipelined
    decode = {name: u for name, u in attention.items()
              if name.startswith("decode") and int(name.split()[1][1:]) <= 128}
    assert len(decode) == 8
    for name, u in decode.items():
        warps = launch.decode_num_warps(int(name.split()[1][1:]))
        assert _resident_per_sm(u, warps) >= launch.PROGRAMS_PER_SM, (name, u)


# An H100/H200 SM: 64K registers (allocated per thread in multiples of 8), 228 KiB of shared
# memory (1 KiB of it reserved per program), at most 32 programs.
SM_REGISTERS, SM_SHARED_BYTES, SM_MAX_PROGRAMS = 65536, 228 * 1024, 32


def _resident_per_sm(usage: dict, warps: int) -> int:
    """How many programs of this kernel an SM holds at once: the fewest its registers, its
    shared memory and the program cap allow. (With one warp the registers always allow 8:
    255 per thread at most; the shared memory is what can fall short.)"""
    registers = -(-usage["registers"] // 8) * 8 * 32 * warps
    shared = usage["shared_bytes"] + 1024
    return min(SM_REGISTERS // registers, SM_SHARED_BYTES // shared, SM_MAX_PROGRAMS)


def test_resident_programs_follow_registers_and_shared_memory():
    assert _resident_per_sm({"registers": 202, "shared_bytes": 20484}, 1) == 9  # 208 x 32
    assert _resident_per_sm({"registers": 64, "shared_bytes": 12292}, 4) == 8
    assert _resident_per_sm({"registers": 79, "shared_bytes": 40000}, 1) == 5  # shared-bound
