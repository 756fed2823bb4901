"""The 8-bit KV cache (`kv_cache_dtype: int8`): each cached K or V row, one token of one KV
head, is stored as head_dim int8 values followed by its own float32 scale in the row's last 4
bytes, so the cache's last dimension is head_dim + 4 and a row decodes as value x scale.

A scale per row (per token and head) rather than per block: decoding appends one token at a
time to a block, and a block-wide scale would have to requantize the rows already there each
time a larger value arrived (and the prefill worker's blocks would have to be final before
they are shipped). The cost is 4 bytes per 64-128 values: a row of head_dim 64 takes 68 bytes
instead of bf16's 128 (0.53x), of head_dim 128 132 instead of 256 (0.52x). The scale lives in
the row, so everything that moves blocks (transfers, swap, the prefix cache) moves it with
them, untouched.

Symmetric, round to nearest: scale = max|x| / 127, q = round(x / scale) in [-127, 127]; a row
of zeros gets scale 1. The attention kernels (cpu_fixed_order_attention.c) widen a row as
float(q) * scale, exactly what `dequantize` computes here (the torch reference).
"""

from __future__ import annotations

import torch

SCALE_BYTES = 4


def row_width(head_dim: int) -> int:
    """Bytes (int8 elements) of one cached row."""
    return head_dim + SCALE_BYTES


def quantize(x: torch.Tensor) -> torch.Tensor:
    """`[..., d]` floats -> `[..., d + 4]` int8 rows."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1, keepdim=True)
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    values = torch.round(xf / scale).clamp_(-127, 127).to(torch.int8)
    return torch.cat([values, scale.contiguous().view(torch.int8)], dim=-1)


def dequantize(rows: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """`[..., d + 4]` int8 rows -> `[..., d]` values (float32 product, then `dtype`)."""
    d = rows.shape[-1] - SCALE_BYTES
    scale = rows[..., d:].contiguous().view(torch.float32)
    return (rows[..., :d].float() * scale).to(dtype)
