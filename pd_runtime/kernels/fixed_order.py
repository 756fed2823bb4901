"""Batch-invariant attention: every query row of a step, decode or prefill, through one native
kernel with a fixed reduction order per row, reading its sequence's K/V from the paged cache.

A row's output then depends only on its query and the K/V of its own positions: not on what else
was batched, how the prompt was chunked, or whether its prefix was computed this step, in an
earlier chunk, by another worker or taken from the prefix cache (cpu_fixed_order_attention.c
says how the order is fixed). The paged cache is read in place, so no side buffer is needed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from pd_runtime.kernels import native


@dataclass
class FixedOrderRows:
    """Which keys each query token of the flat batch sees."""

    block_tables: torch.Tensor  # [num_seqs, width] int64: each scheduled sequence's blocks
    seq: torch.Tensor           # [num_tokens] int64: row of block_tables of each token
    lens: torch.Tensor          # [num_tokens] int64: keys visible to each token (position + 1)

    @classmethod
    def build(cls, tables: list[list[int]], starts: list[int], counts: list[int]) -> "FixedOrderRows":
        """Sequences in flat-batch order: sequence i owns `counts[i]` consecutive tokens at
        positions starts[i], starts[i] + 1, ...; its block ids are tables[i]. A run of decodes
        (one token each) takes one tensor, a prefill chunk one range: no per-token Python."""
        width = max(len(t) for t in tables)
        block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long)
        seq, lens, i = [], [], 0
        while i < len(counts):
            if counts[i] == 1:
                end = i
                while end < len(counts) and counts[end] == 1:
                    end += 1
                seq.append(torch.arange(i, end))
                lens.append(torch.tensor([start + 1 for start in starts[i:end]], dtype=torch.long))
                i = end
            else:
                seq.append(torch.full((counts[i],), i, dtype=torch.long))
                lens.append(torch.arange(starts[i] + 1, starts[i] + counts[i] + 1))
                i += 1
        return cls(block_tables, torch.cat(seq), torch.cat(lens))


def unsupported_reason(dtype: torch.dtype, device: str, head_dim: int) -> Optional[str]:
    """Why this model cannot run the fixed-order kernel here, or None when it can."""
    if torch.device(device).type != "cpu":
        return f"no fixed-order attention kernel for device {device!r} (CPU only)"
    if dtype not in (torch.bfloat16, torch.float32):
        return f"no fixed-order attention kernel for {dtype} (bfloat16 and float32 only)"
    if head_dim % 8 or head_dim > 256:
        return f"head_dim {head_dim} is not a multiple of 8 up to 256"
    if not native.available():
        return "the native CPU kernels did not build (no C compiler, or PD_RUNTIME_NATIVE_KERNELS=0)"
    return None


class FixedOrderKernelError(RuntimeError):
    """The kernel refused a step's inputs that unsupported_reason accepted (or ran out of
    memory): no other path may stand in silently, the outputs would stop being invariant."""


def attend(q: torch.Tensor, kv_layer: torch.Tensor, rows: FixedOrderRows,
           scale: float, window: int = 0, softcap: float = 0.0,
           sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
    """`[T, heads, d]` attention of every token over its own keys (already in the cache; the
    last `window` of them, with a window; `sinks`: each head's sink logit)."""
    out = native.fixed_order_attention(q, kv_layer, rows.block_tables, rows.seq, rows.lens, scale,
                                       window=window, softcap=softcap, sinks=sinks)
    if out is None:
        raise FixedOrderKernelError(
            f"fixed-order attention refused q {tuple(q.shape)} {q.dtype} stride {q.stride()}, "
            f"cache {tuple(kv_layer.shape)}")
    return out
