"""The float32 linear layers: the native kernel (pd_runtime/kernels/cpu_linear.c) against torch's GEMM
(`F.linear`, its peer) on the bench model's weight shapes, and a whole decode step's linears
against the bound the box's read bandwidth sets.

    python bench/linear_kernel.py [--model DIR] [--threads 1] [--rows 1 2 4 8 16 32 128 2048]

Per shape and row count: best-of times of both and their ratio (>1: the kernel is faster),
GFLOP/s. Then every linear of one forward of the model (8 layers x 4 + lm_head) for a decode
batch of each size, weights read from memory as in serving (they do not fit the caches), with
the time reading the weights alone would take at the measured read bandwidth. Times move with
the box's load; the ratios within one run are what to read.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.common import bench_model, best_of, machine_line, read_bandwidth_gbs  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: the embedded bench model")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 128, 2048])
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from pd_runtime.kernels import native
    from pd_runtime.model.llama import linear
    from pd_runtime.model.loader import load_model

    model = load_model(bench_model(args.model), "float32", "cpu", 4096, False)
    if model.cfg.num_experts:
        sys.exit("a dense model's linears are measured here (the experts' are not packed)")
    packed = model.packed[0]
    if not isinstance(packed["qkv"], native.PackedLinear):
        sys.exit("the native float32 linear does not run here (no build, or no AVX2 + FMA)")
    print(machine_line())
    print(f"weights packed as {'bf16' if packed['qkv'].is_bf16 else 'float32'} values")
    shapes = [(name, model.layers[0][name], packed[name]) for name in ("qkv", "o", "gate_up", "down")]
    shapes.append(("lm_head", model.lm_head, model.lm_head_packed))
    print(f"{'shape':>18} {'rows':>5} {'torch ms':>9} {'native ms':>9} {'ratio':>6} {'GFLOP/s':>8}")
    for name, weight, pack in shapes:
        n, k = weight.shape
        for rows in args.rows:
            x = torch.randn(rows, k)
            calls = max(1, 64 // rows)  # enough work per timing for small calls
            theirs = best_of(lambda: [F.linear(x, weight) for _ in range(calls)], 7) / calls
            ours = best_of(lambda: [linear(x, weight, pack) for _ in range(calls)], 7) / calls
            print(f"{name + f' {n}x{k}':>18} {rows:>5} {theirs * 1e3:>9.3f} {ours * 1e3:>9.3f} "
                  f"{theirs / ours:>6.2f} {2 * n * k * rows / ours / 1e9:>8.1f}")

    read = read_bandwidth_gbs()
    weight_bytes = sum(p.panels.numel() * p.panels.element_size()
                       for layer in model.packed for p in layer.values()) \
        + model.lm_head_packed.panels.numel() * model.lm_head_packed.panels.element_size()
    print(f"\nread bandwidth {read:.1f} GB/s; one forward's packed weights {weight_bytes / 1e6:.0f} MB"
          f" -> {weight_bytes / read / 1e9 * 1e3:.2f} ms to read them once")
    print(f"{'batch':>5} {'torch ms':>9} {'native ms':>9} {'ratio':>6} {'native / read bound':>20}")
    for rows in (1, 4, 8, 16, 32):
        hidden, inter = model.cfg.hidden_size, model.cfg.intermediate_size
        inputs = {hidden: torch.randn(rows, hidden), inter: torch.randn(rows, inter)}

        def step(native_path: bool):
            for layer, pk in zip(model.layers, model.packed):
                for name in ("qkv", "o", "gate_up", "down"):
                    w = layer[name]
                    x = inputs[w.shape[1]]
                    linear(x, w, pk[name]) if native_path else F.linear(x, w)
            x = inputs[hidden]
            linear(x, model.lm_head, model.lm_head_packed) if native_path else F.linear(x, model.lm_head)

        theirs = best_of(lambda: step(False), 7)
        ours = best_of(lambda: step(True), 7)
        print(f"{rows:>5} {theirs * 1e3:>9.2f} {ours * 1e3:>9.2f} {theirs / ours:>6.2f} "
              f"{ours / (weight_bytes / read / 1e9):>20.2f}")


if __name__ == "__main__":
    main()
