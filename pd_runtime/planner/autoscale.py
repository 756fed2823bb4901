"""The autoscaler's decision: from the traffic the router saw and the workers' live costs, the
split of prefill and decode workers that meets the SLO at that load, by the planner's simulator.

Pure (no I/O, clock or Ray): the controller (pd_runtime/workers/elastic.py acts on it) and an
offline replay of a day's traffic call the same `decide`, so the simulated decisions are the
controller's. Every candidate is simulated on the same resampled requests (common random
numbers): two splits differ only by their workers, not by their luck.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Optional

from pd_runtime.config import AutoscaleConfig, RoutingConfig, SLOTarget
from pd_runtime.planner.costs import ClusterCosts
from pd_runtime.planner.plan import cell
from pd_runtime.planner.profile import ROUTER_OVERHEAD_S
from pd_runtime.planner.simulator import Topology, simulate
from pd_runtime.planner.workload import SimRequest, arrival_offsets

# Requests per simulated candidate: enough that one request is a third of a percent of the
# attainment, few enough that ~15 candidates take 1-2 s on a 2-core CPU (~50 ms each).
SIM_REQUESTS = 300

Split = tuple[int, int]  # (prefill workers, decode workers)


@dataclass
class Traffic:
    """What the router saw over the window: each request's (arrival, seconds since the window
    began; prompt tokens; output tokens)."""

    window_s: float
    requests: list[tuple[float, int, int]] = field(default_factory=list)

    def __post_init__(self):
        if self.window_s <= 0:
            raise ValueError(f"traffic window_s must be > 0, got {self.window_s}")

    @property
    def rate(self) -> float:
        return len(self.requests) / self.window_s


@dataclass
class ScaleDecision:
    """`desired` is what the pools should become now; `predicted` holds the simulated
    attainment and goodput of the current split ("current") and of the split the planner
    wants ("wanted": `desired`, unless a cooldown holds the pools), with every candidate's
    attainment ("candidates") and the target."""

    desired: dict[str, int]
    reason: str  # a metric label: scale_up scale_down re_split hold cooldown idle at_limit
    rate: float  # req/s planned for: observed x (1 + headroom)
    predicted: dict
    current: dict[str, int] = field(default_factory=dict)
    observed_rate: float = 0.0

    def describe(self) -> str:
        now, wanted = self.predicted.get("current") or {}, self.predicted.get("wanted") or {}
        return (f"{self.reason}: {_name(self.current)} -> {_name(self.desired)}"
                f" for {self.rate:.2f} req/s ({self.observed_rate:.2f} observed);"
                f" attainment {cell(now.get('attainment'))} -> {_name(wanted)}"
                f" {cell(wanted.get('attainment'))} (target {self.predicted.get('target')}),"
                f" goodput {cell(now.get('goodput_rps'))} -> {cell(wanted.get('goodput_rps'))}"
                " req/s")


def _name(split: dict[str, int]) -> str:
    return f"{split.get('prefill', '?')}P+{split.get('decode', '?')}D" if split else "-"


# ---------------------------------------------------------------------------------- costs
def costs_from_loads(loads: dict[str, dict], *, max_model_len: int = 4096,
                     rpc_s: float = 0.003) -> ClusterCosts:
    """The planner's cost model from live load reports (worker id -> a worker's load(), with
    its "role"), as `pd-runtime profile --url` reads them (ClusterCosts.from_loads). Of each
    role, the report whose step-cost fit has seen the most steps; without a prefill pool, the
    decode workers' costs stand for both (the same engine)."""
    best: dict[str, dict] = {}
    for worker_id in sorted(loads):
        load = loads[worker_id]
        report = load.get("step_costs") or {}
        if not report.get("coefficients"):
            continue  # a worker that has not fitted its steps yet
        role = "decode" if load.get("role") == "colocated" else load.get("role")
        held = best.get(role)
        if held is None or report.get("steps", 0) > held["step_costs"].get("steps", 0):
            best[role] = load
    decode = best.get("decode")
    if decode is None:
        raise ValueError("no decode or colocated worker reports step costs yet")
    prefill = best.get("prefill") or decode
    costs = ClusterCosts.from_loads(
        prefill, decode, prefill_engine=_degree(prefill), decode_engine=_degree(decode),
        num_layers=1, stream_layers=True, rpc_s=rpc_s, router_overhead_s=ROUTER_OVERHEAD_S,
        max_model_len=max_model_len, note="autoscale: live load reports")
    if "prefill" in best:
        # The router sends the decode pool only the shorter prompts, so its prefill fit never
        # saw the long ones a pool of 0 prefill workers would give it; the prefill pool's fit
        # did (profile.py does the same).
        for name in ("prefill_token_s", "prefill_attention_s"):
            costs.decode.coefficients[name] = costs.prefill.coefficients[name]
    return costs


def _degree(load: dict) -> dict:
    return {"tensor_parallel_size": int(load.get("tensor_parallel_size") or 1)}


# ---------------------------------------------------------------------------------- decide
def decide(traffic: Traffic, current: dict[str, int], cfg: AutoscaleConfig, costs: ClusterCosts,
           slo: SLOTarget, *, since_change_s: float, cpus: Optional[dict[str, float]] = None,
           gpus: Optional[dict[str, float]] = None, routing: Optional[RoutingConfig] = None,
           seed: int = 0) -> ScaleDecision:
    """The split to move to. `cpus`/`gpus`: role -> what one worker holds (default 1 CPU, no
    GPU), checked against cfg.max_cpus/max_gpus; `routing`: the router's live settings
    (default: RoutingConfig's, mode slo, at `slo`)."""
    now = (current.get("prefill", 0), current.get("decode", 0))
    observed = traffic.rate
    rate = observed * (1 + cfg.headroom)
    target = {"target": cfg.attainment}
    if not traffic.requests:
        # Nothing to simulate: the smallest pools, but one decode worker to take the next one.
        idle = (cfg.prefill.min_workers, max(1, cfg.decode.min_workers))
        predicted = {"current": _point(now, None), "wanted": _point(idle, None), **target}
        return _held(idle, now, "hold" if idle == now else "idle", rate, observed, predicted,
                     cfg, since_change_s)

    routing = routing or RoutingConfig(slo=slo)
    requests = _resample(traffic, rate, seed)
    results: dict[Split, dict] = {}
    # The pools grow by workers like the running ones: of the degree their costs were read at.
    degrees = {"prefill_tp": costs.prefill.tensor_parallel_size,
               "decode_tp": costs.decode.tensor_parallel_size}

    def simulated(split: Split) -> dict:
        if split not in results:
            topology = Topology(split[0], split[1], routing, **degrees)
            results[split] = simulate(costs, topology, requests, slo, seed)
        return results[split]

    splits = candidates(cfg, cpus, gpus)
    scores = {s: _share(simulated(s)) for s in splits}
    predicted = {"current": _point(now, simulated(now) if now[1] >= 1 else None), **target,
                 "candidates": {_name(_as_dict(s)): round(a, 4) for s, a in scores.items()}}
    if not scores:
        predicted["wanted"] = predicted["current"]
        return _held(now, now, "at_limit", rate, observed, predicted, cfg, since_change_s)
    meeting = [s for s in splits if scores[s] >= cfg.attainment]
    if meeting:
        wanted = min(meeting, key=lambda s: (sum(s), -scores[s], -s[1]))
        if now in meeting and sum(wanted) >= sum(now):
            wanted = now  # no drain and start for a point of simulated attainment
        reason = _change(wanted, now)
    else:  # the bounds cannot meet the target: the best they can do, with the most workers
        # among equals (overloaded past what any split serves, all score alike, and more
        # capacity is what the real cluster needs then)
        wanted = min(splits, key=lambda s: (-scores[s], -sum(s), -s[1]))
        reason = "at_limit"
    predicted["wanted"] = _point(wanted, simulated(wanted))
    return _held(wanted, now, reason, rate, observed, predicted, cfg, since_change_s)


def candidates(cfg: AutoscaleConfig, cpus: Optional[dict[str, float]] = None,
               gpus: Optional[dict[str, float]] = None) -> list[Split]:
    """Every (prefill, decode) within the pools' bounds, at least one decode worker, whose
    CPUs and GPUs fit the budget. A prefill pool of 0 is a candidate: the simulator (and the
    router) then run every request colocated on the decode workers."""
    cpus = {"prefill": 1.0, "decode": 1.0, **(cpus or {})}
    gpus = {"prefill": 0.0, "decode": 0.0, **(gpus or {})}
    out = []
    for p in range(cfg.prefill.min_workers, cfg.prefill.max_workers + 1):
        for d in range(max(1, cfg.decode.min_workers), cfg.decode.max_workers + 1):
            if _fits(p, d, cpus, cfg.max_cpus) and _fits(p, d, gpus, cfg.max_gpus):
                out.append((p, d))
    return out


def _fits(p: int, d: int, per_worker: dict[str, float], budget: Optional[float]) -> bool:
    # A small tolerance: fractional CPUs (0.5 a worker) must not miss the budget by rounding.
    return budget is None or p * per_worker["prefill"] + d * per_worker["decode"] <= budget + 1e-9


def _resample(traffic: Traffic, rate: float, seed: int) -> list[SimRequest]:
    """SIM_REQUESTS Poisson arrivals at `rate`, each with the lengths of a request the window
    saw (drawn with replacement): the window's mix at the planned load, whatever its size."""
    rng = random.Random(f"{seed}:autoscale")
    times = arrival_offsets(rate, rng, num_requests=SIM_REQUESTS)
    out = []
    for i, t in enumerate(times):
        _, prompt_len, output_len = rng.choice(traffic.requests)
        # An aborted request may report no output: one token is the least a request asks for.
        out.append(SimRequest(i, t, max(1, prompt_len), max(1, output_len)))
    return out


def _change(wanted: Split, now: Split) -> str:
    if sum(wanted) != sum(now):
        return "scale_up" if sum(wanted) > sum(now) else "scale_down"
    return "re_split" if wanted != now else "hold"


def _share(result: dict) -> float:
    """Within both targets, of every request sent (refused ones missed)."""
    return result["good"] / max(1, result["sent"])


def _as_dict(split: Split) -> dict[str, int]:
    return {"prefill": split[0], "decode": split[1]}


def _point(split: Split, result: Optional[dict]) -> dict:
    return {**_as_dict(split), "attainment": None if result is None else _share(result),
            "goodput_rps": None if result is None else result["goodput_rps"]}


def _held(wanted: Split, now: Split, reason: str, rate: float, observed: float, predicted: dict,
          cfg: AutoscaleConfig, since_change_s: float) -> ScaleDecision:
    """The decision, unless the last change is too recent to change again (the wanted split
    stays in `predicted`)."""
    if wanted != now and since_change_s < cfg.cooldown_s:
        wanted, reason = now, "cooldown"
    return ScaleDecision(_as_dict(wanted), reason, rate, predicted, _as_dict(now), observed)
