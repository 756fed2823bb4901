"""The autoscaler's decision: from the traffic the router saw and the workers' live costs, the
split of prefill and decode workers that meets the SLO at that load, by the planner's simulator.

Pure (no I/O, clock or Ray): the controller (pd_runtime/workers/elastic.py acts on it) and an
offline replay of a day's traffic (bench/autoscale_sim.py) call the same `decide`, so the
simulated decisions are the controller's. Every candidate is simulated on the same resampled
requests (common random numbers): two splits differ only by their workers, not by their luck.

At scale: bounds allowing more than EXHAUSTIVE_CANDIDATES splits are searched, not enumerated
(`search`), and a pool of more than WHOLE_POOL_WORKERS is simulated as shards (`simulate_split`):
the router's slo policy weighs every (prefill, decode) pair for each request, so one simulated
request to 128P+384D would cost ~0.8 s of CPU.
"""

from __future__ import annotations

import bisect
import itertools
import math
import random
from dataclasses import dataclass, field
from typing import Callable, Optional

from pd_runtime.config import AutoscaleConfig, RoutingConfig, SLOTarget
from pd_runtime.planner.costs import ClusterCosts
from pd_runtime.planner.plan import cell
from pd_runtime.planner.profile import ROUTER_OVERHEAD_S
from pd_runtime.planner.simulator import Topology, simulate
from pd_runtime.planner.workload import SimRequest, arrival_offsets

# Requests per simulated candidate: enough that one request is a third of a percent of the
# attainment, few enough that ~15 candidates take 1-2 s on a 2-core CPU (~50 ms each).
SIM_REQUESTS = 300
# Bounds reaching past this many workers: each simulated pool sees SIM_SECONDS of arrivals (at
# least SIM_REQUESTS, at most SIM_MAX_REQUESTS in all), since 300 requests to 64 workers are
# ~1 s of traffic, too short for a queue to pass the TTFT target (a 4P+4D pool at twice its
# capacity met it for 88% of 300 requests, 32% of 3,000); and a pool past it is simulated as
# shards of at most SHARD_WORKERS, each with its share of the arrivals and its own router. At
# 16-64 workers and 40 simulated seconds the shards' attainment was within 2.2 points of the
# whole pool's (under it at 7 of 12 points), at a tenth to a fortieth of the CPU.
WHOLE_POOL_WORKERS = 8
SIM_SECONDS = 30.0
SIM_MAX_REQUESTS = 2000
SHARD_WORKERS = 4
# Bounds that allow more splits than this are searched (`search`) rather than enumerated.
EXHAUSTIVE_CANDIDATES = 16
# The prefill shares the search tries at a total besides the one it holds (then a climb from
# the best of them); and the finest step of that climb, as a share of the total.
SEARCH_SHARES = (0.0, 0.25, 0.5, 0.75)
SHARE_STEP = 1 / 32
# Hysteresis: a change the running split does not need must win by this much. Fewer workers are
# moved to only if they meet the target by MARGIN (a split at the line is kept until it misses,
# and one just under it is not shrunk back into); where no split meets it, another split is
# moved to only if it is MARGIN better, or completes THROUGHPUT_MARGIN more requests a second
# (an overload, where every split misses alike; a window whose requests no split can serve,
# one prompt too long for the TTFT target, changes nothing). 300 simulated requests: a point
# of attainment is 3 of them.
MARGIN = 0.02
THROUGHPUT_MARGIN = 0.1

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
    (default: RoutingConfig's, mode slo, at `slo`). Every split the bounds allow is simulated
    where they allow at most EXHAUSTIVE_CANDIDATES; more: those `search` visits."""
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
    bounds = SplitBounds(cfg, cpus, gpus)
    seconds, count = None, SIM_REQUESTS
    if bounds.totals() and bounds.totals()[-1] > WHOLE_POOL_WORKERS:
        seconds = SIM_SECONDS
        count = min(SIM_MAX_REQUESTS, max(SIM_REQUESTS, math.ceil(rate * SIM_SECONDS)))
    requests = _resample(traffic, rate, seed, count)
    results: dict[Split, dict] = {}

    def simulated(split: Split) -> dict:
        if split not in results:
            results[split] = simulate_split(costs, split, requests, slo, routing, seed, seconds)
        return results[split]

    def score(split: Split) -> float:
        return _share(simulated(split))

    few = list(itertools.islice(bounds.splits(), EXHAUSTIVE_CANDIDATES + 1))
    if len(few) <= EXHAUSTIVE_CANDIDATES:
        scores = {s: score(s) for s in few}
    else:
        scores = search(score, bounds, cfg.attainment, now)
        if bounds.fits(*now):
            scores.setdefault(now, score(now))
    predicted = {"current": _point(now, simulated(now) if now[1] >= 1 else None), **target,
                 "candidates": {_name(_as_dict(s)): round(a, 4) for s, a in scores.items()}}
    if not scores:
        predicted["wanted"] = predicted["current"]
        return _held(now, now, "at_limit", rate, observed, predicted, cfg, since_change_s)
    held = scores.get(now) if bounds.fits(*now) else None  # None: it must change
    wanted = fewest(scores, cfg.attainment)
    if wanted is not None:
        if held is not None and held >= cfg.attainment:
            # It meets the target: kept, unless fewer workers meet it by MARGIN.
            fewer = {s: a for s, a in scores.items() if sum(s) < sum(now)}
            wanted = fewest(fewer, cfg.attainment + MARGIN) or now
        reason = _change(wanted, now)
    else:  # the bounds cannot meet the target: the best they can do (then the most served,
        # the most workers), if it beats the running split by a margin
        def served(split: Split) -> float:
            return simulated(split).get("throughput_rps", 0.0)

        wanted = min(scores, key=lambda s: (-scores[s], -served(s), -sum(s), -s[1]))
        if held is not None and scores[wanted] < held + MARGIN \
                and served(wanted) < served(now) * (1 + THROUGHPUT_MARGIN):
            wanted = now
        reason = "at_limit"
    predicted["wanted"] = _point(wanted, simulated(wanted))
    return _held(wanted, now, reason, rate, observed, predicted, cfg, since_change_s)


def fewest(scores: dict[Split, float], target: float) -> Optional[Split]:
    """Of the splits that meet `target`, the fewest workers; among those the best score, then
    the most decode workers. None: none meets it."""
    meeting = [s for s in scores if scores[s] >= target]
    return min(meeting, key=lambda s: (sum(s), -scores[s], -s[1])) if meeting else None


def candidates(cfg: AutoscaleConfig, cpus: Optional[dict[str, float]] = None,
               gpus: Optional[dict[str, float]] = None) -> list[Split]:
    """Every (prefill, decode) within the pools' bounds, at least one decode worker, whose
    CPUs and GPUs fit the budget. A prefill pool of 0 is a candidate: the simulator (and the
    router) then run every request colocated on the decode workers."""
    return list(SplitBounds(cfg, cpus, gpus).splits())


class SplitBounds:
    """The splits the pools' bounds and the CPU/GPU budget allow. At one total, the prefill
    counts allowed are a range (each bound and budget is an interval in them); and a total
    that has a split allowed, every smaller one down to the minimum pools has one too."""

    def __init__(self, cfg: AutoscaleConfig, cpus: Optional[dict[str, float]] = None,
                 gpus: Optional[dict[str, float]] = None):
        self.cfg = cfg
        self.cpus = {"prefill": 1.0, "decode": 1.0, **(cpus or {})}
        self.gpus = {"prefill": 0.0, "decode": 0.0, **(gpus or {})}
        self.min_decode = max(1, cfg.decode.min_workers)

    def fits(self, p: int, d: int) -> bool:
        c = self.cfg
        return (c.prefill.min_workers <= p <= c.prefill.max_workers
                and self.min_decode <= d <= c.decode.max_workers
                and _fits(p, d, self.cpus, c.max_cpus) and _fits(p, d, self.gpus, c.max_gpus))

    def splits(self):
        """In order of prefill, then decode workers."""
        for p in range(self.cfg.prefill.min_workers, self.cfg.prefill.max_workers + 1):
            for d in range(self.min_decode, self.cfg.decode.max_workers + 1):
                if self.fits(p, d):
                    yield p, d

    def prefill_range(self, total: int) -> Optional[tuple[int, int]]:
        lo = max(self.cfg.prefill.min_workers, total - self.cfg.decode.max_workers)
        hi = min(self.cfg.prefill.max_workers, total - self.min_decode)
        inside = [p for p in range(lo, hi + 1) if self.fits(p, total - p)]
        return (inside[0], inside[-1]) if inside else None

    def totals(self) -> range:
        smallest = self.cfg.prefill.min_workers + self.min_decode
        if self.prefill_range(smallest) is None:
            return range(0)
        lo, hi = smallest, self.cfg.prefill.max_workers + self.cfg.decode.max_workers
        while lo < hi:  # the largest total with a split
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if self.prefill_range(mid) else (lo, mid - 1)
        return range(smallest, lo + 1)


def _fits(p: int, d: int, per_worker: dict[str, float], budget: Optional[float]) -> bool:
    # A small tolerance: fractional CPUs (0.5 a worker) must not miss the budget by rounding.
    return budget is None or p * per_worker["prefill"] + d * per_worker["decode"] <= budget + 1e-9


# ---------------------------------------------------------------------------------- search
def search(score: Callable[[Split], float], bounds: SplitBounds, target: float,
           start: Split) -> dict[Split, float]:
    """Where the bounds allow too many splits to simulate each: the splits visited and their
    scores. In rounds from `start` (the pools now: the answer is usually near them): the
    smallest total that meets `target` at the prefill share held (`_smallest`), then the best
    share at that total (`_best_share`); settled there, a total one smaller is tried at the
    shares that meet at it, and where one meets, on from it. Where none meets
    at the largest total, the best share there. Assumes that at one share more workers never
    score less (true of the simulation up to its noise)."""
    seen: dict[Split, float] = {}
    totals = bounds.totals()
    if not totals:
        return seen

    def scored(p: int, total: int) -> float:
        if _at(p, total) not in seen:
            seen[_at(p, total)] = score(_at(p, total))
        return seen[_at(p, total)]

    def tries(total: int, shares: tuple[float, ...]) -> list[int]:
        lo, hi = bounds.prefill_range(total)
        return list(dict.fromkeys(min(hi, max(lo, int(s * total + 0.5))) for s in shares))

    total = min(totals[-1], max(totals[0], sum(start)))
    share = start[0] / sum(start) if sum(start) else 0.0
    for _ in range(8):
        held = (total, share)
        found = _smallest(lambda t: scored(tries(t, (share,))[0], t) >= target, totals, total,
                          max(1, round(total * SHARE_STEP)))
        total = totals[-1] if found is None else found
        p = _best_share(lambda p: scored(p, total), bounds.prefill_range(total), total,
                        tries(total, (share, *SEARCH_SHARES)))
        share = p / total
        if (total, share) != held:
            continue
        if found is None or total == totals[0]:
            break
        # Settled. With a worker fewer, a share that meets at this total may still meet: this
        # one, those next to it (the climb tried them), another of the SEARCH_SHARES.
        step = max(1, round(total * SHARE_STEP)) / total
        shares = [s for s in (share, share - step, share + step, *SEARCH_SHARES)
                  if seen.get(_at(tries(total, (s,))[0], total), 0.0) >= target]
        fewer = next((p for p in tries(total - 1, tuple(shares))
                      if scored(p, total - 1) >= target), None)
        if fewer is None:
            break
        total, share = total - 1, fewer / (total - 1)
    return seen


def _smallest(meets: Callable[[int], bool], totals: range, start: int,
              first_step: int) -> Optional[int]:
    """The smallest of `totals` that meets: galloping from `start` (steps doubling from
    `first_step`), then bisecting; None where the largest does not."""
    if meets(start):
        good, step = start, first_step
        while good > totals[0]:
            t = max(totals[0], good - step)
            if not meets(t):
                bad = t
                break
            good, step = t, step * 2
        else:
            return good
    else:
        bad, step = start, first_step
        while True:
            if bad >= totals[-1]:
                return None
            t = min(totals[-1], bad + step)
            if meets(t):
                good = t
                break
            bad, step = t, step * 2
    while good - bad > 1:
        mid = (good + bad) // 2
        good, bad = (mid, bad) if meets(mid) else (good, mid)
    return good


def _at(p: int, total: int) -> Split:
    return p, total - p


def _best_share(scored: Callable[[int], float], allowed: tuple[int, int], total: int,
                tries: list[int]) -> int:
    """The prefill count with the best score at `total`: the best of `tries`, then a climb in
    steps of a sixteenth of the total halving down to SHARE_STEP of it (ties: fewer prefill
    workers, as `fewest` breaks them)."""
    def key(p: int) -> tuple[float, int]:
        return scored(p), -p

    best = max(tries, key=key)
    step, finest = max(1, total // 16), max(1, round(total * SHARE_STEP))
    while step >= finest:
        better = [p for p in (best - step, best + step)
                  if allowed[0] <= p <= allowed[1] and key(p) > key(best)]
        if better:
            best = max(better, key=key)
        else:
            step //= 2
    return best


# ---------------------------------------------------------------------------------- simulate
def simulate_split(costs: ClusterCosts, split: Split, requests: list[SimRequest],
                   slo: SLOTarget, routing: RoutingConfig, seed: int = 0,
                   seconds: Optional[float] = None) -> dict:
    """One split's simulation on the pool's arrivals `requests` (in time order): up to
    WHOLE_POOL_WORKERS the simulator's own result; a larger pool as its `shards`, each kind
    simulated once on the same requests, their times stretched to that shard's share of the
    arrivals (its workers over the pool's), weighed by the arrivals its kind takes. Then "good"
    is that weighed share of "sent" (not a whole number) and "goodput_rps" the shards' sum.
    `seconds`: each simulated pool takes the requests that reach it within that many seconds,
    at least SIM_REQUESTS (None: all of them)."""
    # The pools grow by workers like the running ones: of the degree their costs were read at.
    degrees = {"prefill_tp": costs.prefill.tensor_parallel_size,
               "decode_tp": costs.decode.tensor_parallel_size}

    def run(p: int, d: int, stretch: float) -> dict:
        taken = requests if seconds is None else \
            requests[:max(SIM_REQUESTS, bisect.bisect_right(
                [r.arrival_s for r in requests], seconds / stretch))]
        if stretch != 1.0:
            taken = [SimRequest(r.index, r.arrival_s * stretch, r.prompt_len, r.max_tokens)
                     for r in taken]
        return simulate(costs, Topology(p, d, routing, **degrees), taken, slo, seed)

    if sum(split) <= WHOLE_POOL_WORKERS:
        return run(*split, 1.0)
    kinds = shards(split)
    total, share, goodput, served = sum(split), 0.0, 0.0, 0.0
    for (p, d), count in kinds.items():
        result = run(p, d, total / (p + d))
        share += count * (p + d) / total * _share(result)
        goodput += count * result["goodput_rps"]
        served += count * result["throughput_rps"]
    return {"sent": len(requests), "good": share * len(requests), "goodput_rps": goodput,
            "throughput_rps": served,
            "shards": {_name(_as_dict(kind)): count for kind, count in kinds.items()}}


def shards(split: Split) -> dict[Split, int]:
    """A pool as shards of at most SHARD_WORKERS, each with a decode worker, as even as they
    come: prefill workers dealt from the first shard, decode workers from the last, so that
    their sizes differ by one at most. Kind -> how many."""
    p, d = split
    count = max(1, min(d, math.ceil((p + d) / SHARD_WORKERS)))
    out: dict[Split, int] = {}
    for i in range(count):
        kind = (p // count + (i < p % count), d // count + (i >= count - d % count))
        out[kind] = out.get(kind, 0) + 1
    return out


def _resample(traffic: Traffic, rate: float, seed: int, count: int) -> list[SimRequest]:
    """`count` Poisson arrivals at `rate`, each with the lengths of a request the window saw
    (drawn with replacement): the window's mix at the planned load, whatever its size."""
    rng = random.Random(f"{seed}:autoscale")
    times = arrival_offsets(rate, rng, num_requests=count)
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
    """The decision, unless the last change is too recent to change again, or to shrink
    (the wanted split stays in `predicted`)."""
    if wanted != now and (since_change_s < cfg.cooldown_s or (
            sum(wanted) < sum(now) and since_change_s < cfg.scale_down_delay_s)):
        wanted, reason = now, "cooldown"
    return ScaleDecision(_as_dict(wanted), reason, rate, predicted, _as_dict(now), observed)
