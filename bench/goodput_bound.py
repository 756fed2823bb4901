"""The box's physical bound for a goodput workload: requests per second this machine could serve
if its linear layers ran at the matmul rate measured now and its decode steps read KV at the
memory rate measured now, with nothing else costing anything (no scheduling, no attention
kernels' own overhead, every decode batch as large as it needs to be, so the weights' reads are
free). Measured on the machine the bench runs on: the server's when both are local.

Per request: FLOPs of its linears over its prompt (each prompt token's layers; the LM head
for its last token only) and its output (every layer and the LM head per token), plus its
attention (QK and PV over the context so far); bytes of KV its decode reads (each output
token reads the whole context). The bound is 1 / max(FLOPs / matmul rate, bytes / read rate)
on all the cores this process may use, in the dtype the engine resolves for the model
(`auto` as `pd-runtime serve` runs it, unless given).
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass


from bench.common import matmul_gflops, read_bandwidth_gbs
from bench.offline_throughput import step_linears


@dataclass
class Bound:
    dtype: str
    threads: int
    matmul_gflops: float       # at a prefill chunk's MLP shape, all threads
    read_gbs: float
    flops_per_request: float   # mean over the workload's requests
    kv_bytes_per_request: float
    rps: float                 # the bound, requests per second

    def as_dict(self) -> dict:
        return asdict(self)


def request_cost(cfg, prompt_len: int, output_len: int, kv_elem_bytes: int) -> tuple[float, float]:
    """(FLOPs, KV bytes read) of one request of `prompt_len` in and `output_len` out."""
    def per_token(linears) -> float:
        return sum(calls * 2 * k * n * share for calls, k, n, share in linears)

    decode_token = per_token(step_linears(cfg, prefill=False))
    lm_head = 2 * cfg.hidden_size * cfg.vocab_size
    # a prompt token runs every layer; step_linears(prefill=True) stops at the last layer's
    # qkv (the rows that are not sampled), so count whole layers and one LM head
    prompt_token = decode_token - lm_head
    q_width = cfg.num_heads * cfg.head_dim
    kv_row = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * kv_elem_bytes

    def attention(ctx_from: int, ctx_to: int) -> float:  # tokens at from..to-1, each over
        # its context (position + 1)
        positions = (ctx_to * (ctx_to + 1) - ctx_from * (ctx_from + 1)) / 2
        return 4 * q_width * cfg.num_layers * positions

    # the first output token comes from the prompt's last row; each later one is a decode step
    flops = prompt_len * prompt_token + lm_head + attention(0, prompt_len) \
        + max(0, output_len - 1) * decode_token \
        + attention(prompt_len, prompt_len + max(0, output_len - 1))
    kv_bytes = kv_row * sum(prompt_len + i for i in range(1, output_len))
    return flops, kv_bytes


def measure(model_dir: str, lengths: list[tuple[int, int]], dtype_name: str = "auto",
            budget_s: float = 1.0) -> Bound:
    """The bound for requests of these (prompt_len, output_len), measured now."""
    from pd_runtime.model.loader import resolve_dtype
    from pd_runtime.model.model_config import load_model_config

    cfg = load_model_config(model_dir)
    dtype = resolve_dtype(dtype_name, cfg, "cpu")
    checkpoint_dtype = resolve_dtype(cfg.torch_dtype, cfg, "cpu")
    threads = len(os.sched_getaffinity(0))
    costs = [request_cost(cfg, p, o, dtype.itemsize) for p, o in lengths]
    flops = sum(c[0] for c in costs) / len(costs)
    kv_bytes = sum(c[1] for c in costs) / len(costs)
    inter = cfg.intermediate_size or cfg.hidden_size * 4
    rate = matmul_gflops(dtype, 512, cfg.hidden_size, 2 * inter, threads, checkpoint_dtype,
                         budget_s)
    read = read_bandwidth_gbs(budget_s=budget_s)
    seconds = max(flops / (rate * 1e9), kv_bytes / (read * 1e9))
    return Bound(str(dtype).removeprefix("torch."), threads, rate, read, flops, kv_bytes,
                 1.0 / seconds)


def line(bound: Bound) -> str:
    return (f"# the box's bound for this mix: {bound.rps:.2f} req/s ({bound.dtype}, "
            f"{bound.threads} threads: {bound.flops_per_request / 1e9:.1f} GFLOP a request at "
            f"{bound.matmul_gflops:.0f} GFLOP/s, {bound.kv_bytes_per_request / 1e6:.1f} MB of KV "
            f"read at {bound.read_gbs:.1f} GB/s)")
