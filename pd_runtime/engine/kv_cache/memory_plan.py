"""What one engine holds in GPU memory, from its settings and the model's config.json alone:
weights, KV cache, side buffers, the transient activations of its largest step, the CUDA-graph
pool, the caching allocator's reserve and the CUDA context. A worker on a GPU checks it against
the device before allocating (ModelRunner), and a cluster file that names its GPUs
(`resources.accelerator_type`) is checked by the tests, so a configuration that cannot fit
fails with the field to change, not with an out-of-memory error at the first long prompt.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Optional

import torch

from pd_runtime.config import EngineConfig
from pd_runtime.kernels.triton_launch import MAX_SPLITS, PROGRAMS_PER_SM
from pd_runtime.model.model_config import ModelConfig

GIB = 1 << 30
MIB = 1 << 20
# Memory of one device as the driver reports it (nvidia-smi), by Ray's accelerator type name.
GPU_MEMORY_BYTES = {
    "H200": 143_771 * MIB,
    "H100": 81_559 * MIB,
    "A100-80G": 81_920 * MIB,
    "A100-40G": 40_960 * MIB,
    "L40S": 46_068 * MIB,
    "A10G": 23_028 * MIB,
    "L4": 23_034 * MIB,
}
# The CUDA context, cuBLAS workspaces and Triton's compiled kernels: measured ~0.5-0.8 GiB
# per process on recent drivers; 1 GiB is kept for them.
RUNTIME_BYTES = 1 * GIB
# Vocabulary-wide float32 rows alive at once while sampling (logits, raw logprobs, adjusted
# copy, probabilities, noise, the sort of top-k/top-p and its scatter).
SAMPLER_ROW_COPIES = 7
# PyTorch's caching allocator reserves more than the live tensors at their peak: a step's large
# transients of many sizes split and strand cached segments. The first H200 run (bench model,
# 8192-token chunks, docs/BENCHMARKS.md) reserved 0.21 GiB above a plan whose activations were
# 0.60 GiB (0.56 since the decode partials' bound); half the activations are kept for it.
ALLOCATOR_SLACK = 0.5
# The decode kernel launches at most PROGRAMS_PER_SM programs (sequences x kv heads x splits)
# per SM whenever it splits, at most MAX_SPLITS splits (pd_runtime/kernels/triton_launch.py):
# the plan keeps twice that, sequences x splits < 2 x PROGRAMS_PER_SM x SMs / kv heads
# (tests/test_triton_kernels.py), as margin; MAX_SMS bounds the SMs of any device it may meet.
MAX_SMS = 192


@dataclass
class MemoryPlan:
    weights: int            # and the rope tables
    kv_cache: int
    side_buffers: int       # the decode side buffer (host paths only: 0 on a GPU)
    activations: int        # the largest eager step's transient tensors
    cuda_graphs: int        # the captured decode graphs' memory pool (kept for the run)
    allocator: int          # the caching allocator's reserve above the live activations
    runtime: int            # CUDA context and library workspaces

    @property
    def total(self) -> int:
        return sum(getattr(self, f.name) for f in fields(self))

    def table(self) -> str:
        rows = [f"{f.name:>13}: {getattr(self, f.name) / GIB:7.2f} GiB" for f in fields(self)]
        return "\n".join(rows + [f"{'total':>13}: {self.total / GIB:7.2f} GiB"])


def decode_buffer_fraction(engine: EngineConfig) -> float:
    """The decode side buffer's size as a fraction of the KV cache: as configured on the
    host, 0 on any other device (the GPU kernels read the blocks in place)."""
    return engine.decode_kv_buffer_fraction if torch.device(engine.device).type == "cpu" else 0.0


def weight_bytes(cfg: ModelConfig, elem: int, experts: Optional[int] = None) -> int:
    """The weights of `cfg`'s layers (a tensor-parallel rank's: tensor_parallel.local_config,
    and `experts` of them held whole; None: all)."""
    experts = cfg.num_experts if experts is None else experts
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    h, inter = cfg.hidden_size, cfg.intermediate_size
    per_layer = h * (q + 2 * kv) + q * h + (h if cfg.block_norms == "parallel" else 2 * h)
    per_layer += (q + 2 * kv) if cfg.qkv_bias else 0
    per_layer += h if cfg.o_bias else 0
    if cfg.qk_norm:  # a weight per head's dimension, over all heads (OLMo), a head's (Cohere)
        per_layer += q + kv if cfg.qk_norm_whole or cfg.norm_kind == "layer" else 2 * cfg.head_dim
    per_layer += 2 * h if cfg.block_norms == "sandwich" else 0  # (Gemma 2/3's MLP norms)
    per_layer += cfg.num_heads if cfg.attn_sinks else 0  # (gpt-oss's sink logits)
    dense = 3 * h * inter + (2 * inter + h if cfg.mlp_bias else 0)
    sparse = experts * 3 * h * cfg.moe_intermediate_size + cfg.num_experts * h  # and router
    sparse += 3 * h * cfg.shared_expert_size + (h if cfg.shared_expert_size else 0)
    if cfg.expert_bias:  # gpt-oss's: the experts' (dequantized MXFP4: the weights as above)
        sparse += experts * (2 * cfg.moe_intermediate_size + h) + cfg.num_experts
    mlps = (cfg.num_layers - len(cfg.sparse_layers)) * dense + len(cfg.sparse_layers) * sparse
    embed = cfg.vocab_size * h
    return elem * (cfg.num_layers * per_layer + mlps
                   + embed * (1 if cfg.tie_word_embeddings else 2) + h)


def rope_table_bytes(cfg: ModelConfig, elem: int, max_model_len: int) -> int:
    """The cos and sin tables the model keeps for every position it serves (a second pair for
    the windowed layers' own rope, Gemma 3's and OLMo 3's; float32 where the model turns in
    float32), pd_runtime/model/llama.py."""
    rotary = int(cfg.head_dim * cfg.rope.partial_rotary_factor)
    table_elem = 4 if cfg.rope_tables_float32 else elem
    return 2 * max_model_len * rotary * table_elem * (2 if cfg.local_rope is not None else 1)


def step_activation_bytes(cfg: ModelConfig, elem: int, tokens: int, rows: int) -> int:
    """Peak transient bytes of a step of `tokens` tokens sampling `rows` rows: the residual
    stream and norm output, qkv and the rotated q/k, attention output, the MLP's gate_up,
    activation and down outputs (all alive around the MLP), then the logits and the
    sampler's vocabulary-wide rows, and the decode kernel's split partials."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    h, inter = cfg.hidden_size, cfg.intermediate_size
    mlp = max(inter, cfg.experts_per_token * cfg.moe_intermediate_size)  # (the chosen experts')
    layer = tokens * (3 * h + 2 * (q + 2 * kv) + q + 3 * mlp) * elem
    sampler = rows * cfg.vocab_size * 4 * SAMPLER_ROW_COPIES
    split_rows = min(rows * MAX_SPLITS, -(-2 * PROGRAMS_PER_SM * MAX_SMS // cfg.num_kv_heads))
    splits = split_rows * cfg.num_heads * (cfg.head_dim + 2) * 4
    return layer + sampler + splits


def plan_memory(engine: EngineConfig, cfg: ModelConfig, max_model_len: int,
                device_bytes: Optional[int] = None) -> MemoryPlan:
    """The plan of one engine (of each rank, at tensor_parallel_size t: its part of the
    weights and its KV heads; `cfg` is the whole model's); `max_model_len` as the engine
    resolves it. `device_bytes`: the GPU's memory, which `gpu_memory_utilization` takes its
    share of (see kv_cache_budget)."""
    from pd_runtime.model.loader import resolve_dtype
    from pd_runtime.model.tensor_parallel import local_config

    ranks = engine.tensor_parallel_size
    whole, cfg = cfg, local_config(cfg, ranks)
    dtype = resolve_dtype(engine.dtype, cfg, engine.device)
    elem = torch.tensor([], dtype=dtype).element_size()
    kv_per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * elem
    block_bytes = kv_per_token * engine.block_size
    num_blocks = engine.num_kv_blocks or max(1, kv_cache_budget(
        engine, whole, max_model_len, device_bytes, block_bytes) // block_bytes)
    kv = num_blocks * block_bytes
    on_gpu = torch.device(engine.device).type == "cuda"
    side = int(kv * decode_buffer_fraction(engine))
    rows = engine.max_num_seqs
    eager = step_activation_bytes(cfg, elem, engine.max_num_batched_tokens, rows)
    graphs = 0
    if on_gpu and engine.cuda_graphs and not cfg.num_experts:  # (none for experts' models)
        batch = min(engine.cuda_graph_max_batch_size, engine.max_num_seqs)
        graphs = step_activation_bytes(cfg, elem, batch, batch) \
            + batch * (-(-max_model_len // engine.block_size) * 4 + 64)  # static buffers
    weights = weight_bytes(cfg, elem, whole.num_experts // ranks) \
        + rope_table_bytes(cfg, elem, max_model_len)
    return MemoryPlan(weights=weights, kv_cache=kv, side_buffers=side,
                      activations=eager, cuda_graphs=graphs,
                      allocator=int(eager * ALLOCATOR_SLACK) if on_gpu else 0,
                      runtime=RUNTIME_BYTES if on_gpu else 0)


def kv_cache_budget(engine: EngineConfig, cfg: ModelConfig, max_model_len: int,
                    device_bytes: Optional[int], block_bytes: int) -> int:
    """The KV cache's bytes (of one rank, `cfg` being the whole model's):
    `kv_cache_memory_bytes`, or on a GPU with `gpu_memory_utilization` what that share of
    `device_bytes` leaves after the rest of the plan (a ValueError naming the field when it
    leaves less than one block of `block_bytes`)."""
    share = engine.gpu_memory_utilization
    if share is None or torch.device(engine.device).type != "cuda":
        return engine.kv_cache_memory_bytes
    if device_bytes is None:
        raise ValueError("engine.gpu_memory_utilization: the GPU's memory is needed to plan it")
    rest = plan_memory(engine.model_copy(update={"gpu_memory_utilization": None,
                                                 "num_kv_blocks": 1}), cfg, max_model_len)
    rest_bytes = rest.total - rest.kv_cache
    draft_rest, draft_block = _draft_bytes(engine, max_model_len)
    budget = int(device_bytes * share) - rest_bytes - draft_rest
    # A draft model holds as many KV blocks as the target, of its own size (draft_model.py).
    blocks = max(0, budget) // (block_bytes + draft_block)
    if blocks < 1:
        raise ValueError(
            f"engine.gpu_memory_utilization: {share} of {device_bytes / GIB:.1f} GiB is "
            f"{device_bytes * share / GIB:.1f} GiB, and the engine needs "
            f"{(rest_bytes + draft_rest) / GIB:.1f} GiB besides its KV cache"
            + (f" (its draft model's {draft_rest / GIB:.1f} GiB included)" if draft_rest else "")
            + "; raise it, or lower max_num_batched_tokens, max_num_seqs or "
            f"cuda_graph_max_batch_size:\n{rest.table()}")
    return blocks * block_bytes


def _draft_bytes(engine: EngineConfig, max_model_len: int) -> tuple[int, int]:
    """A draft model's (weights and activations, bytes of one KV block), built in the same
    process as its target (pd_runtime/engine/spec_decode/draft_model.py); (0, 0) without one."""
    if engine.speculative_method != "draft" or not engine.speculative_model:
        return 0, 0
    from pd_runtime.model.model_config import load_model_config

    draft = engine.model_copy(update={  # whole, on the driver rank (draft_model.py)
        "model": engine.speculative_model, "num_kv_blocks": 1, "cuda_graphs": False,
        "tensor_parallel_size": 1,
        "gpu_memory_utilization": None, "speculative_method": None,
        "speculative_model": None, "kv_cache_dtype": "auto"})
    plan = plan_memory(draft, load_model_config(engine.speculative_model), max_model_len)
    return plan.total - plan.kv_cache - plan.runtime, plan.kv_cache  # one CUDA context


def check_fits(plan: MemoryPlan, device_bytes: int, where: str, what: str = "GPU memory",
               has: str = "the device has") -> None:
    """Raise a ValueError naming the settings to change when the plan exceeds the device (or
    a budget: `what` and `has` word it)."""
    if plan.total <= device_bytes:
        return
    over = plan.total - device_bytes
    raise ValueError(
        f"{where}: this engine needs {plan.total / GIB:.3f} GiB of {what} and {has} "
        f"{device_bytes / GIB:.3f} GiB ({over / GIB:.3f} GiB over); lower "
        f"engine.kv_cache_memory_bytes (or num_kv_blocks), max_num_batched_tokens, "
        f"max_num_seqs or cuda_graph_max_batch_size:\n{plan.table()}")
