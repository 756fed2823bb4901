"""gpt-oss's own parts: its experts as the checkpoint holds them, and their clamped SwiGLU.

A gpt-oss layer's experts are stacked in the checkpoint, transposed against a linear weight
(`mlp.experts.gate_up_proj` `[experts, hidden, 2 x size]`, `down_proj` `[experts, size,
hidden]`), with biases, and the gate and up columns interleaved (gate j at 2j, up j at 2j + 1).
They load into the decoder's layout (model/loader.py: `experts_gate_up` `[experts, 2 x size,
hidden]`, gate then up; `experts_down` `[experts, hidden, size]`), one expert at a time.

OpenAI's own checkpoints hold the experts in MXFP4 (quantization_config quant_method "mxfp4"):
per weight row, groups of 32 values as 4-bit e2m1 numbers (two a byte, the low nibble first;
`_blocks` `[experts, rows, groups, 16]` uint8) times a power of two per group (`_scales`
`[experts, rows, groups]` uint8, the exponent biased by 127), rows in a linear weight's
layout. They are dequantized at load into the model's dtype, exactly (every e2m1 value times a
power of two is a bf16 number): the experts then take 4x their bytes in the file (bf16).
"""

from __future__ import annotations

import torch

from pd_runtime.api import ModelLoadError


# The 16 values of a 4-bit e2m1 number (sign, 2 exponent bits, 1 mantissa bit), by its bits.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
               -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def load_experts(reader, cfg, prefix: str) -> dict:
    """A gpt-oss layer's router (with its bias) and experts (with theirs), from bf16 tensors
    or MXFP4 blocks and scales."""
    h, size, n = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts
    block = prefix + "mlp."
    gate_up = torch.empty(n, 2 * size, h, dtype=reader.dtype, device=reader.device)
    down = torch.empty(n, h, size, dtype=reader.dtype, device=reader.device)
    if cfg.quantization == "mxfp4":
        packed = {}
        for name, rows, width in (("gate_up_proj", 2 * size, h), ("down_proj", h, size)):
            if width % 32:
                raise ModelLoadError(f"{block}experts.{name}: MXFP4 groups of 32 do not divide "
                                     f"its rows of {width}")
            packed[name] = (
                reader.get(f"{block}experts.{name}_blocks", (n, rows, width // 32, 16),
                           dtype=torch.uint8),
                reader.get(f"{block}experts.{name}_scales", (n, rows, width // 32),
                           dtype=torch.uint8))
        for e in range(n):
            gate_up[e] = deinterleave(dequantize_mxfp4(*(t[e] for t in packed["gate_up_proj"]),
                                                       reader.dtype))
            down[e] = dequantize_mxfp4(*(t[e] for t in packed["down_proj"]), reader.dtype)
        del packed
    else:
        stacked_gate_up = reader.get(block + "experts.gate_up_proj", (n, h, 2 * size))
        stacked_down = reader.get(block + "experts.down_proj", (n, size, h))
        for e in range(n):
            gate_up[e] = deinterleave(stacked_gate_up[e].t())
            down[e] = stacked_down[e].t()
        del stacked_gate_up, stacked_down
    gate_up_bias = reader.get(block + "experts.gate_up_proj_bias", (n, 2 * size))
    return {"router": reader.get(block + "router.weight", (n, h)),
            "router_bias": reader.get(block + "router.bias", (n,)),
            "experts_gate_up": gate_up, "experts_down": down,
            "experts_gate_up_bias": deinterleave(gate_up_bias.t()).t().contiguous(),
            "experts_down_bias": reader.get(block + "experts.down_proj_bias", (n, h))}


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor,
                     dtype: torch.dtype) -> torch.Tensor:
    """MXFP4 rows (`blocks` `[rows, groups, 16]` uint8, `scales` `[rows, groups]` uint8) as
    `[rows, groups x 32]` numbers of `dtype`."""
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=blocks.device)
    values = torch.stack([table[(blocks & 0x0F).long()], table[(blocks >> 4).long()]], dim=-1)
    values = values.reshape(*scales.shape, 32)
    exponents = scales.to(torch.int32)[..., None] - 127
    return torch.ldexp(values, exponents).reshape(scales.shape[0], -1).to(dtype)


def deinterleave(rows: torch.Tensor) -> torch.Tensor:
    """Rows gate 0, up 0, gate 1, up 1, ... -> all gates, then all ups."""
    return torch.cat([rows[0::2], rows[1::2]], dim=0)


def clamped_swiglu(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's activation of `[rows, 2 x size]` (gate then up), in transformers' order of
    operations: g = min(gate, limit), u = clamp(up, -limit, limit), (u + 1) * (g *
    sigmoid(g * alpha))."""
    gate, up = gate_up.chunk(2, dim=-1)
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))
