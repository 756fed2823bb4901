"""gpt-oss's own parts: its experts as the checkpoint holds them, and their clamped SwiGLU.

A gpt-oss layer's experts are stacked in the checkpoint, transposed against a linear weight
(`mlp.experts.gate_up_proj` `[experts, hidden, 2 x size]`, `down_proj` `[experts, size,
hidden]`), with biases, and the gate and up columns interleaved (gate j at 2j, up j at 2j + 1).
They load into the decoder's layout (model/loader.py: `experts_gate_up` `[experts, 2 x size,
hidden]`, gate then up; `experts_down` `[experts, hidden, size]`), one expert at a time.
"""

from __future__ import annotations

import torch


def load_experts(reader, cfg, prefix: str) -> dict:
    """A gpt-oss layer's router (with its bias) and experts (with theirs)."""
    h, size, n = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts
    block = prefix + "mlp."
    gate_up = torch.empty(n, 2 * size, h, dtype=reader.dtype, device=reader.device)
    down = torch.empty(n, h, size, dtype=reader.dtype, device=reader.device)
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
