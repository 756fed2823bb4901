"""Per-request routing: colocated or disaggregated, and which workers, from live settings.

Decision: uncached = prompt tokens - best expected prefix hit on a decode worker; disaggregate
when uncached > max_local_prefill_tokens and the prefill pool's queued tokens are under
max_prefill_queue_tokens (mode `auto`), or always / never by mode. Worker choice: lowest cost
(see DecodeCostWeights / PrefillCostWeights), ties broken at random; unhealthy or draining
workers never chosen.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Optional

from pd_runtime.config import RoutingConfig


@dataclass
class WorkerState:
    worker_id: str
    role: str
    healthy: bool = True
    draining: bool = False
    load: dict = field(default_factory=dict)
    inflight: int = 0  # routed by us since the last load report arrived

    @property
    def available(self) -> bool:
        return self.healthy and not self.draining


@dataclass
class Decision:
    path: str                     # colocated | disaggregated
    reason: str                   # why; a metric label
    decode_worker: Optional[str]
    prefill_worker: Optional[str]
    prompt_tokens: int
    expected_hit_tokens: int


def _fraction(num: float, den: float) -> float:
    return min(1.0, max(0.0, num / den)) if den > 0 else 0.0


def decode_cost(w: WorkerState, hit: int, prompt_len: int, cfg: RoutingConfig) -> float:
    weights = cfg.decode_cost
    load = w.load
    running = _fraction(load.get("num_running", 0) + load.get("num_waiting", 0) + w.inflight,
                        load.get("max_num_seqs", 128))
    free = _fraction(load.get("free_blocks", 1), load.get("total_blocks", 1))
    overlap = _fraction(hit, prompt_len)
    return (running * weights.weight_running - free * weights.weight_free_blocks
            - overlap * weights.weight_prefix_overlap)


def prefill_cost(w: WorkerState, hit: int, prompt_len: int, cfg: RoutingConfig) -> float:
    weights = cfg.prefill_cost
    queued = _fraction(w.load.get("queued_prefill_tokens", 0) + w.inflight * prompt_len,
                       max(1, cfg.max_prefill_queue_tokens))
    return queued * weights.weight_queued_tokens - _fraction(hit, prompt_len) \
        * weights.weight_prefix_overlap


def _cheapest(costs: dict[str, float], rng: random.Random) -> Optional[str]:
    if not costs:
        return None
    best = min(costs.values())
    return rng.choice(sorted(w for w, c in costs.items() if c <= best + 1e-9))


def decide(prompt_len: int, decode: list[WorkerState], prefill: list[WorkerState],
           hits: dict[str, int], cfg: RoutingConfig, rng: random.Random) -> Decision:
    """hits: worker id -> expected cached prompt tokens there."""
    d_costs = {w.worker_id: decode_cost(w, hits.get(w.worker_id, 0), prompt_len, cfg)
               for w in decode if w.available}
    d = _cheapest(d_costs, rng)
    best_hit = hits.get(d, 0) if d else 0
    p_pool = [w for w in prefill if w.available]
    p_costs = {w.worker_id: prefill_cost(w, hits.get(w.worker_id, 0), prompt_len, cfg)
               for w in p_pool}
    queued = sum(w.load.get("queued_prefill_tokens", 0) + w.inflight * prompt_len
                 for w in p_pool)

    def make(path, reason, p=None):
        return Decision(path, reason, d, p, prompt_len, best_hit)

    if d is None:
        return make("none", "no_decode_worker")
    if cfg.mode == "always_colocated":
        return make("colocated", "mode_always_colocated")
    if not p_pool:
        return make("colocated", "no_prefill_worker")
    p = _cheapest(p_costs, rng)
    if cfg.mode == "always_disaggregated":
        return make("disaggregated", "mode_always_disaggregated", p)
    uncached = prompt_len - best_hit
    if uncached <= cfg.max_local_prefill_tokens:
        reason = "short_prompt" if prompt_len <= cfg.max_local_prefill_tokens else "prefix_cached"
        return make("colocated", reason)
    if queued >= cfg.max_prefill_queue_tokens:
        return make("colocated", "prefill_saturated")
    return make("disaggregated", "long_prompt", p)
