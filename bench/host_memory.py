"""How fast another process copies out of KV-cache memory (process_vm_readv, what UCX's shared
memory transport does for a pull), for torch's default allocation and for host_zeros (huge
pages, 2 MiB aligned), in the same run.

Run: .venv/bin/python bench/host_memory.py [--mib 16] [--iters 30]
The source lives in a spawned process; this process pulls it into an aligned buffer.
"""

from __future__ import annotations

import argparse
import ctypes
import multiprocessing as mp
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from pd_runtime.engine.kv_cache.host_memory import host_zeros  # noqa: E402


class _IOVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def _source(conn, kind, size):
    buf = torch.zeros(size, dtype=torch.uint8) if kind == "torch.zeros" else host_zeros((size,), torch.uint8)
    buf.fill_(1)
    conn.send((os.getpid(), buf.data_ptr()))
    conn.recv()


def _pull_rate(kind, size, iters):
    ctx = mp.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    child = ctx.Process(target=_source, args=(child_conn, kind, size), daemon=True)
    child.start()
    pid, address = conn.recv()
    dst = host_zeros((size,), torch.uint8)
    libc = ctypes.CDLL(None, use_errno=True)
    local, remote = _IOVec(dst.data_ptr(), size), _IOVec(address, size)
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        done = libc.process_vm_readv(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
        times.append(time.perf_counter() - start)
        if done != size:
            raise OSError(ctypes.get_errno(), "process_vm_readv failed")
    conn.send(None)
    child.join()
    return size / statistics.median(times) / 1e9


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--mib", type=int, default=16)
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    size = args.mib << 20
    rates = {"torch.zeros": [], "host_zeros": []}
    for _ in range(args.rounds):  # alternating, so a change of load hits both
        for kind in rates:
            rates[kind].append(_pull_rate(kind, size, args.iters))
    for kind, values in rates.items():
        print(f"{kind:12s} {args.mib} MiB pull: " + ", ".join(f"{v:.1f}" for v in values) + " GB/s")
    ratio = statistics.median(rates["host_zeros"]) / statistics.median(rates["torch.zeros"])
    print(f"host_zeros / torch.zeros: {ratio:.2f}x (median of {args.rounds} rounds)")


if __name__ == "__main__":
    main()
