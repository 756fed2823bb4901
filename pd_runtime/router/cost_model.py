"""The router's live cost model: what a prefill, a decode step and a KV transfer take on each
worker, from the step costs the workers fit to their own steps (pd_runtime/engine/step_costs.py)
and the transfer rates their links measure. Refreshed with every load report; exported in
/metrics (pd_runtime/router/metrics.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

# Before a link has finished a transfer: loopback gloo on the 2-core box (MACHINE-NOTES).
_DEFAULT_TRANSFER_GBPS = 1.0
_RPC_S = 0.003  # a Ray call and its answer, router -> worker -> router
# A block back from host memory, from disk: measured on the 2-core box (docs/BENCHMARKS.md "KV
# tiers under multi-turn chat": 84 and 214 us for 256 KiB); a worker's own hits replace them.
_TIER_BLOCK_S = {"host": 1e-4, "disk": 3e-4}


@dataclass
class WorkerCosts:
    """Seconds per unit of work on one worker (the coefficients of its StepCostModel)."""

    step_s: float = 5e-3
    prefill_token_s: float = 2e-4
    prefill_attention_s: float = 0.0
    decode_seq_s: float = 1e-3
    decode_context_s: float = 0.0
    max_batched_tokens: int = 2048
    step_s_ewma: float = 0.0     # measured: the mean step lately, prefill chunks included
    decode_s_ewma: float = 0.0   # measured: the decode part of it (0: not reported)
    steps: int = 0
    pace_wait_s: float = 0.0     # measured: the wait a step paid lately for the prefill
                                 # workers beside it (engine.min_step_interval_s)
    # Seconds to bring one block back from a lower tier (engine/kv_cache/tiers.py), as the
    # worker measured its hits there (disk: the read and check too); before any, a guess.
    tier_block_s: dict = field(default_factory=lambda: dict(_TIER_BLOCK_S))

    @classmethod
    def from_report(cls, load: dict) -> "WorkerCosts":
        report = load.get("step_costs") or {}
        c = report.get("coefficients") or {}
        base = cls()
        return cls(step_s=c.get("step_s", base.step_s),
                   prefill_token_s=c.get("prefill_token_s", base.prefill_token_s),
                   prefill_attention_s=c.get("prefill_attention_s", base.prefill_attention_s),
                   decode_seq_s=c.get("decode_seq_s", base.decode_seq_s),
                   decode_context_s=c.get("decode_context_s", base.decode_context_s),
                   max_batched_tokens=load.get("max_num_batched_tokens", base.max_batched_tokens),
                   step_s_ewma=report.get("step_s_ewma", 0.0),
                   decode_s_ewma=report.get("decode_s_ewma", 0.0), steps=report.get("steps", 0),
                   pace_wait_s=load.get("pace_wait_s") or 0.0,
                   tier_block_s=_tier_block_s(load.get("kv_tiers") or {}))

    def prefill_s(self, tokens: int, context: int = 0) -> float:
        """Compute time of `tokens` prompt tokens after `context` cached or earlier ones, in
        chunks of the step budget (each chunk pays a step's fixed cost)."""
        if tokens <= 0:
            return 0.0
        attention = tokens * context + tokens * (tokens + 1) // 2
        chunks = math.ceil(tokens / max(1, self.max_batched_tokens))
        return (tokens * self.prefill_token_s + attention * self.prefill_attention_s
                + chunks * self.step_s)

    def decode_step_s(self, batch: int, context: int) -> float:
        if batch <= 0:
            return 0.0
        return self.step_s + batch * self.decode_seq_s + context * self.decode_context_s

    def prefill_tokens_per_s(self, tokens: int = 1024) -> float:
        return tokens / max(self.prefill_s(tokens), 1e-9)


def _tier_block_s(tiers: dict) -> dict:
    out = dict(_TIER_BLOCK_S)
    for tier in out:
        stats = tiers.get(tier) or {}
        if stats.get("hit_blocks"):
            out[tier] = (stats.get("load_s", 0.0) + stats.get("read_s", 0.0)) \
                / stats["hit_blocks"]
    return out


class CostModel:
    """Per worker costs and per link transfer rates, as last reported."""

    def __init__(self):
        self.workers: dict[str, WorkerCosts] = {}
        self.transfer_gbps: dict[str, float] = {}      # prefill worker id -> GB/s it sends at
        self.kv_bytes_per_token: dict[str, int] = {}

    def update(self, worker_id: str, load: dict) -> None:
        self.workers[worker_id] = WorkerCosts.from_report(load)
        rate = (load.get("kv_transfer") or {}).get("send_gbps")
        if rate:
            self.transfer_gbps[worker_id] = rate
        if load.get("kv_bytes_per_token"):
            self.kv_bytes_per_token[worker_id] = load["kv_bytes_per_token"]

    def costs(self, worker_id: str) -> WorkerCosts:
        return self.workers.get(worker_id) or WorkerCosts()

    def transfer_s(self, prefill_worker: str, tokens: int) -> float:
        per_token = self.kv_bytes_per_token.get(prefill_worker, 0)
        gbps = self.transfer_gbps.get(prefill_worker, _DEFAULT_TRANSFER_GBPS)
        return tokens * per_token / (gbps * 1e9) + _RPC_S

    rpc_s = _RPC_S
