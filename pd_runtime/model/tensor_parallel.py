"""How a decoder's weights split over the t ranks of a tensor-parallel worker (Megatron's
layout); the communication is model/parallel_comm.py.

Rank r of t holds, in every layer:
- attention: query heads [r*H/t, (r+1)*H/t) in the fused qkv rows (column parallel), with
  their KV heads: [r*K/t, (r+1)*K/t) when K >= t, else the one KV head its query heads read
  (head r*K // t, replicated on t/K ranks, as vLLM replicates it); the output projection's
  matching input columns (row parallel: partial sums, all-reduced);
- the dense MLP: gate and up rows [r*I/t, (r+1)*I/t) (column parallel), down's matching
  input columns (row parallel, all-reduced);
- a sparse MLP: experts [r*E/t, (r+1)*E/t) whole (expert parallel); the router and a shared
  expert replicated. Each rank fills its experts' weighted outputs, zeros elsewhere, and
  the all-reduce adds zeros only: the experts' sum is t=1's, bit for bit;
- norms, the embedding and the LM head replicated (every rank holds the whole hidden state
  after each all-reduce; only the driver computes logits).
Row-parallel biases are added once, after the all-reduce.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from pd_runtime.model.model_config import ModelConfig


def kv_heads_of_rank(num_kv_heads: int, size: int, rank: int) -> range:
    """The global KV heads rank `rank` of `size` holds (docs/kv_transfer.md draws them)."""
    if num_kv_heads >= size:
        per = num_kv_heads // size
        return range(rank * per, (rank + 1) * per)
    head = rank * num_kv_heads // size
    return range(head, head + 1)


def unsupported_reason(cfg: ModelConfig, size: int) -> str | None:
    """Why this model cannot be split over `size` ranks, or None."""
    if size == 1:
        return None
    if cfg.num_heads % size:
        return f"its {cfg.num_heads} attention heads do not divide by {size}"
    kv = cfg.num_kv_heads
    if kv % size and size % kv:
        return (f"its {kv} KV heads and {size} ranks: one must divide the other (each rank "
                "holds whole KV heads, or one replicated)")
    if cfg.qk_norm and cfg.qk_norm_whole:
        return "its q/k norms span all heads (OLMo 2's), which a rank does not hold"
    dense = cfg.num_layers > len(cfg.sparse_layers)
    if dense and cfg.intermediate_size % size:
        return f"its MLP width {cfg.intermediate_size} does not divide by {size}"
    if cfg.num_experts and cfg.num_experts % size:
        return f"its {cfg.num_experts} experts do not divide by {size}"
    return None


def local_config(cfg: ModelConfig, size: int) -> ModelConfig:
    """The config one rank's layers compute with: its heads and MLP width (experts keep their
    global count: the router scores all of them)."""
    if size == 1:
        return cfg
    return replace(cfg, num_heads=cfg.num_heads // size,
                   num_kv_heads=len(kv_heads_of_rank(cfg.num_kv_heads, size, 0)),
                   intermediate_size=cfg.intermediate_size // size)


def shard_layer(layer: dict, cfg: ModelConfig, rank: int, size: int) -> dict:
    """Rank `rank`'s part of one layer's weights (`cfg`: the whole model's), as new tensors:
    the whole layer's memory is freed once the caller drops it."""
    if size == 1:
        return layer
    d = cfg.head_dim
    q_size, kv_size = cfg.num_heads * d, cfg.num_kv_heads * d
    q_local = cfg.num_heads // size * d
    q_rows = torch.arange(rank * q_local, (rank + 1) * q_local)
    heads = kv_heads_of_rank(cfg.num_kv_heads, size, rank)
    kv_rows = torch.arange(heads.start * d, heads.stop * d)
    qkv_rows = torch.cat([q_rows, q_size + kv_rows, q_size + kv_size + kv_rows])
    width = cfg.intermediate_size // size
    mlp_rows = torch.arange(rank * width, (rank + 1) * width)
    gate_up_rows = torch.cat([mlp_rows, cfg.intermediate_size + mlp_rows])
    experts = cfg.num_experts // size if cfg.num_experts else 0
    out = {}
    for name, weight in layer.items():
        if name in ("qkv", "qkv_bias"):
            part = weight[qkv_rows]
        elif name == "o":
            part = weight[:, q_rows]
        elif name in ("gate_up", "gate_up_bias"):
            part = weight[gate_up_rows]
        elif name == "down":
            part = weight[:, mlp_rows]
        elif name.startswith("experts_"):
            part = weight[rank * experts:(rank + 1) * experts]
        elif name == "sinks":  # one per query head
            part = weight[rank * (cfg.num_heads // size):(rank + 1) * (cfg.num_heads // size)]
        elif name in ("q_norm", "k_norm") and weight.dim() == 2:  # Cohere's: one per head
            part = weight[rank * (cfg.num_heads // size):(rank + 1) * (cfg.num_heads // size)] \
                if name == "q_norm" else weight[heads.start:heads.stop]
        else:  # norms, router, shared expert, row-parallel biases: every rank's
            out[name] = weight
            continue
        out[name] = part.clone()
    return out
