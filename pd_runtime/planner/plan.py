"""`pd-runtime plan`: the split of N workers into prefill and decode pools, and the routing
threshold, that maximizes goodput for a workload under latency targets, by simulating each
candidate (pd_runtime/planner/simulator.py) over a range of arrival rates.

Candidates: every prefill share of the devices on a grid (0 prefill workers: all colocated),
refined around the best; for each, the threshold modes that differ for this workload (`auto`
at each distinct prompt length, and `always_disaggregated`); and, given several degrees
(--tensor-parallel-sizes), each pair of prefill and decode degrees, a worker of degree t taking
t devices (pd_runtime/planner/tensor_parallel.py). A candidate's score is its SLO capacity:
the highest arrival rate at which at least 90% of requests meet both targets, found by
bisection (or, with --rates, its peak goodput over those rates); ties go to fewer devices,
then fewer prefill workers.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional

from pd_runtime.config import RoutingConfig, SLOTarget
from pd_runtime.planner.costs import ClusterCosts
from pd_runtime.planner.simulator import Topology, simulate
from pd_runtime.planner.tensor_parallel import describe, role_costs
from pd_runtime.planner.workload import Workload

_SHARES = (0.0, 0.125, 0.25, 0.375, 0.5, 0.625, 0.75)
ATTAINMENT = 0.9  # the share of requests within both targets a rate must keep to count
_BISECTIONS = 5


@dataclass
class Candidate:
    topology: Topology
    points: list[dict]  # one simulate() result per rate, with "rate", in rate order
    capacity: Optional[float] = None  # SLO capacity (req/s); None: scored by peak goodput

    @property
    def peak(self) -> dict:
        """The point to show: at its SLO capacity, else its best goodput."""
        if self.capacity is not None:
            at = [p for p in self.points if p["rate"] == self.capacity]
            if at:
                return at[0]
        return max(self.points, key=lambda p: (p["goodput_rps"], -p["rate"]))

    @property
    def score(self) -> float:
        return self.capacity if self.capacity is not None else self.peak["goodput_rps"]

    @property
    def name(self) -> str:
        return self.topology.name


def parse_slo(text: str) -> SLOTarget:
    """"ttft=2.5,tpot=0.1" (seconds; "ms" suffix for milliseconds)."""
    values = {}
    for part in text.split(","):
        key, _, value = part.partition("=")
        key, value = key.strip(), value.strip().lower()
        if key not in ("ttft", "tpot") or not value:
            raise ValueError(f"--slo: expected ttft=SECONDS,tpot=SECONDS, got {text!r}")
        scale = 1e-3 if value.endswith("ms") else 1.0
        try:
            values[key] = float(value.removesuffix("ms").removesuffix("s")) * scale
        except ValueError:
            raise ValueError(f"--slo: {key}={value!r} is not a number") from None
        if values[key] <= 0:
            raise ValueError(f"--slo: {key} must be > 0")
    if set(values) != {"ttft", "tpot"}:
        raise ValueError(f"--slo: both ttft and tpot are needed, got {text!r}")
    return SLOTarget(ttft_s=values["ttft"], tpot_s=values["tpot"])


def default_rates(costs: ClusterCosts, workload: Workload, workers: int,
                  sample: list) -> list[float]:
    """Six rates around what the workers could serve if nothing waited on anything."""
    c = costs.decode.worker_costs()
    mean_prompt = sum(r.prompt_len for r in sample) / len(sample)
    mean_out = sum(r.max_tokens for r in sample) / len(sample)
    per_request = c.prefill_s(int(mean_prompt)) + mean_out * (c.decode_seq_s + c.step_s / 8)
    capacity = workers / max(per_request, 1e-6)
    return [round(capacity * f, 3) for f in (0.125, 0.25, 0.5, 0.75, 1.0, 1.5)]


def thresholds(sample: list) -> list[int]:
    """The `auto` thresholds that route this workload differently: just under each distinct
    prompt length (that length and longer go to the prefill pool)."""
    lengths = sorted({r.prompt_len for r in sample})
    if len(lengths) > 8:  # a spread of lengths: quantiles
        lengths = [lengths[int(len(lengths) * q)] for q in (0.1, 0.25, 0.5, 0.75, 0.9)]
    return sorted({max(0, n - 1) for n in lengths})


def candidates(devices: int, sample: list, base: RoutingConfig,
               degrees: tuple[tuple[int, int], ...] = ((1, 1),)) -> list[Topology]:
    """Splits of `devices` for each (prefill, decode) pair of worker degrees."""
    out = []
    for prefill_tp, decode_tp in degrees:
        for prefill in sorted({round(devices * s / prefill_tp) for s in _SHARES}):
            out.extend(_split(devices, prefill, sample, base, prefill_tp, decode_tp))
    return out


def _split(devices: int, prefill: int, sample: list, base: RoutingConfig, prefill_tp: int,
           decode_tp: int) -> list[Topology]:
    """`prefill` workers of degree prefill_tp and as many decode workers of degree decode_tp
    as the devices left hold (none: no candidate)."""
    decode = (devices - prefill * prefill_tp) // decode_tp
    if prefill < 0 or decode < 1:
        return []
    return _modes(prefill, decode, sample, base, prefill_tp, decode_tp)


def _modes(prefill: int, decode: int, sample: list, base: RoutingConfig, prefill_tp: int = 1,
           decode_tp: int = 1) -> list[Topology]:
    degrees = {"prefill_tp": prefill_tp if prefill else 1, "decode_tp": decode_tp}
    if prefill == 0:
        return [Topology(0, decode, base.model_copy(update={"mode": "always_colocated"}),
                         **degrees)]
    # max_prefill_queue_tokens bounds the whole prefill pool's queue (pd_runtime/router/policy.py): the
    # configured value is taken as one worker's share and scaled with the pool.
    pool = {"max_prefill_queue_tokens": base.max_prefill_queue_tokens * prefill}
    out = [Topology(prefill, decode, base.model_copy(
        update={"mode": "always_disaggregated", **pool}), **degrees)]
    for t in thresholds(sample):
        if t >= max(r.prompt_len for r in sample):
            continue  # nothing would be disaggregated: the colocated candidate covers it
        out.append(Topology(prefill, decode, base.model_copy(
            update={"mode": "auto", "max_local_prefill_tokens": t, **pool}), **degrees))
    return out


def evaluate(costs: ClusterCosts, topology: Topology, workload: Workload, rates: list[float],
             slo: SLOTarget, duration_s: float, seed: int,
             num_requests: Optional[int] = None) -> Candidate:
    points = [_point(costs, topology, workload, rate, slo, duration_s, seed, num_requests)
              for rate in rates]
    return Candidate(topology, points)


def _point(costs, topology, workload, rate, slo, duration_s, seed, num_requests) -> dict:
    requests = workload.requests(rate, num_requests=num_requests,
                                 duration_s=None if num_requests else duration_s, seed=seed)
    result = {"rate": rate, **simulate(costs, topology, requests, slo, seed)}
    result["attainment"] = result["good"] / max(1, result["sent"])
    return result


def capacity(costs: ClusterCosts, topology: Topology, workload: Workload, slo: SLOTarget,
             duration_s: float, seed: int, guess: float,
             num_requests: Optional[int] = None) -> Candidate:
    """The highest rate with >= ATTAINMENT of requests within the targets: bracketed from
    `guess` (halved or doubled until it holds and fails), then bisected geometrically."""
    points: list[dict] = []

    def holds(rate: float) -> bool:
        point = _point(costs, topology, workload, rate, slo, duration_s, seed, num_requests)
        points.append(point)
        return point["attainment"] >= ATTAINMENT

    def done(rate: float) -> Candidate:
        return Candidate(topology, sorted(points, key=lambda p: p["rate"]), rate)

    if holds(guess):
        low, high = guess, None
        for _ in range(6):
            if not holds(low * 2):
                high = low * 2
                break
            low *= 2
        if high is None:
            return done(low)
    else:
        low, high = None, guess
        for _ in range(6):
            if holds(high / 2):
                low = high / 2
                break
            high /= 2
        if low is None:
            return done(0.0)
    for _ in range(_BISECTIONS):
        mid = (low * high) ** 0.5
        if holds(mid):
            low = mid
        else:
            high = mid
    return done(low)


def plan(costs: ClusterCosts, workload: Workload, slo: SLOTarget, devices: int,
         rates: Optional[list[float]] = None, duration_s: float = 60.0, seed: int = 0,
         base: Optional[RoutingConfig] = None, progress=None,
         num_requests: Optional[int] = None,
         tensor_parallel_sizes: Optional[list[int]] = None,
         devices_per_node: Optional[int] = None) -> tuple[list[Candidate], dict]:
    """Every candidate evaluated, best first, and what the search cost. Each rate runs for
    duration_s simulated seconds, or num_requests requests when given (large pools at high
    rates: the same statistics for less run time). `devices`: GPUs, or on the CPU per-rank CPU
    sets (a pool's resources); at t=1 the workers. `tensor_parallel_sizes`: the worker degrees
    to consider for either pool (each at most `devices_per_node`: a worker's ranks share a
    node); None: the degrees the cost model's pools were measured at."""
    if devices < 1:
        raise ValueError("--devices must be >= 1")
    prefill_degrees, decode_degrees = _degrees(costs, tensor_parallel_sizes,
                                               devices_per_node or devices)
    started = time.monotonic()
    base = base or RoutingConfig()
    sample = workload.requests(rate=1.0, num_requests=2000, seed=seed) \
        if workload.arrival != "trace" else workload.requests(seed=seed)
    guess = default_rates(costs, workload, devices, sample)[3]
    tried: dict[str, Candidate] = {}

    def run(tops: list[Topology]) -> None:
        for top in tops:
            if top.name not in tried:
                tried[top.name] = evaluate(costs, top, workload, rates, slo, duration_s, seed,
                                           num_requests) if rates else \
                    capacity(costs, top, workload, slo, duration_s, seed, guess, num_requests)
                if progress is not None:
                    progress(top.name, tried[top.name])

    run(candidates(devices, sample, base,
                   tuple((p, d) for p in prefill_degrees for d in decode_degrees)))
    if not tried:
        raise ValueError(f"no worker of degree {min(decode_degrees)} fits in {devices} devices")
    best = _ranked(tried)[0].topology
    # Refine: the prefill counts next to the best one on the grid (at each prefill degree
    # when the best has no prefill pool).
    for prefill_tp in prefill_degrees if not best.num_prefill else (best.prefill_tp,):
        step = max(1, round(devices * 0.125 / prefill_tp) // 2)
        near = {best.num_prefill + d for d in (-step, -1, 1, step)}
        run([t for p in sorted(near)
             for t in _split(devices, p, sample, base, prefill_tp, best.decode_tp)])
    ranked = _ranked(tried)
    return ranked, {"candidates": len(tried), "rates": rates, "duration_s": duration_s,
                    "simulations": sum(len(c.points) for c in tried.values()),
                    "num_requests": num_requests, "seconds": time.monotonic() - started,
                    "degrees": {"prefill": prefill_degrees, "decode": decode_degrees},
                    "sources": [describe(costs, role, t)
                                for role, ts in (("prefill", prefill_degrees),
                                                 ("decode", decode_degrees)) for t in ts]}


def _degrees(costs: ClusterCosts, sizes: Optional[list[int]],
             per_node: int) -> tuple[list[int], list[int]]:
    """The prefill and decode degrees to consider, each checked now (its costs measured or
    derivable, its ranks within a node) rather than mid-search."""
    if sizes is None:
        prefill, decode = [costs.prefill.tensor_parallel_size], \
            [costs.decode.tensor_parallel_size]
    else:
        prefill = decode = sorted(set(sizes))
    for t in sorted(set(prefill + decode)):
        if t < 1 or t > per_node:
            raise ValueError(f"--tensor-parallel-sizes: {t} is outside 1..{per_node} (a "
                             "worker's ranks share one node: --devices-per-node)")
    for role, ts in (("prefill", prefill), ("decode", decode)):
        for t in ts:
            role_costs(costs, role, t)  # raises, naming what is missing
    return prefill, decode


def _ranked(tried: dict[str, Candidate]) -> list[Candidate]:
    return sorted(tried.values(), key=lambda c: (-c.score, c.topology.devices,
                                                 c.topology.num_prefill, c.name))


# ---------------------------------------------------------------------------------- output
def cell(x: Optional[float], scale: float = 1.0, digits: int = 2) -> str:
    """A table cell: "-" for no value."""
    return "-" if x is None else f"{x * scale:.{digits}f}"


def table(ranked: list[Candidate], top: int = 8) -> str:
    by_capacity = bool(ranked) and ranked[0].capacity is not None
    width = max([26] + [len(c.name) for c in ranked[:top]])
    lines = [f"{'rank':>4}  {'configuration':<{width}} "
             f"{'SLO cap/s' if by_capacity else 'peak good/s':>11} {'at rate':>8} "
             f"{'TTFT p50/p99 s':>15} {'TPOT p50/p99 ms':>16} {'refused':>7}  paths"]
    for i, cand in enumerate(ranked[:top], 1):
        p = cand.peak
        ttft, tpot, f = p["ttft_s"], p["tpot_s"], cell
        paths = " ".join(f"{k}:{v}" for k, v in sorted(p["paths"].items()))
        lines.append(f"{i:>4}  {cand.name:<{width}} {cand.score:>11.2f} {p['rate']:>8.2f} "
                     f"{f(ttft['p50']):>7}/{f(ttft['p99']):<7} "
                     f"{f(tpot['p50'], 1e3, 1):>8}/{f(tpot['p99'], 1e3, 1):<7} "
                     f"{p['refused']:>7}  {paths}")
    return "\n".join(lines)


def plot(ranked: list[Candidate], path: str, slo: SLOTarget, top: int = 6) -> None:
    """Goodput against offered rate, one line per configuration (the best `top`): the rates
    each one was simulated at (given, or its capacity search's)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for cand in ranked[:top]:
        xs = [p["rate"] for p in cand.points]
        ax.plot(xs, [p["goodput_rps"] for p in cand.points], marker="o", label=cand.name)
    xs = sorted({p["rate"] for c in ranked[:top] for p in c.points})
    ax.plot(xs, xs, linestyle=":", color="grey", label="offered")
    ax.set_xlabel("offered rate (requests/s)")
    ax.set_ylabel("goodput (requests/s within targets)")
    ax.set_title(f"simulated goodput, TTFT <= {slo.ttft_s:g}s, TPOT <= {slo.tpot_s * 1e3:g}ms")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
