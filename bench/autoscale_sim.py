"""The autoscaler over a simulated day (issue 48): a diurnal trace at several scales, the pools
sized each slice by `decide` (pd_runtime/planner/autoscale.py, the function the live controller,
pd_runtime/workers/elastic.py, calls) against static splits, on the planner's simulator.

The day: arrivals follow a cosine between a night trough (04:00) and a day peak (16:00); the
bimodal mix (128 or 2048 prompt tokens, 64 out) shifts from 15% long at night to 30% in the
afternoon (15:00). It is cut into slices of the controller's interval; in each, the split is
the one `decide` chose from the slice before (its window), and the slice is then simulated on
that split: a fresh cluster each slice (no queue, cache or worker carries over from one slice to
the next; a started worker serves at once and a drained one stops at once). Static splits: the
smallest that meets the attainment target over the day, found in hindsight by the planner's own
search (scored on one slice an hour, then run on every slice), and the largest split the
autoscaler chose (sized for the peak).

Costs: a worker's step costs as a load report (`costs_from_loads`, as the controller reads live
ones), calibrated to this box's figures in docs/BENCHMARKS.md (no cost-model file: `pd-runtime
profile` needs a server). See BOX_COEFFICIENTS.

    .venv/bin/python bench/autoscale_sim.py [--peak-workers 16 64 512] [--slice-minutes 10]
        [--jobs 2] [--json FILE] [--plot FILE]
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pd_runtime.config import AutoscaleConfig, PoolBounds, RoutingConfig, SLOTarget  # noqa: E402
from pd_runtime.planner.autoscale import (SHARD_WORKERS, SIM_REQUESTS,  # noqa: E402
                                          WHOLE_POOL_WORKERS, SplitBounds, Traffic,
                                          costs_from_loads, decide, fewest, search, shards,
                                          simulate_split)
from pd_runtime.planner.workload import SimRequest, arrival_offsets  # noqa: E402

DAY_S = 86400.0
SHORT, LONG, OUTPUT = 128, 2048, 64
# One worker = the box's two cores. Prefill: docs/BENCHMARKS.md "Fetching a prefix from a peer"
# (recompute, 128-3072 tokens, one core) fitted as step + tokens + tokens^2/2 attention, scaled
# to "a 2048-token prompt ~0.93 s of prefill on both cores" (Goodput as DistServe defines it).
# Decode: "Tensor parallel on the CPU", t=1: 6.48 / 13.13 / 39.60 ms a step at batch 1 / 8 / 32,
# context 512. KV: 16 KiB a token (t=1), gloo's ~3 GB/s at 2048 tokens (KV transfer on the CPU).
BOX_COEFFICIENTS = dict(step_s=0.0054, prefill_token_s=1.51e-4, prefill_attention_s=2.74e-7,
                        decode_seq_s=9.5e-4, decode_context_s=2.4e-7)
# Observed requests/s a worker takes at the peak's mix (what `decide` chose at 16:00 in a trial
# run, with its 20% headroom): the peak rate of a scale is this times its workers.
PEAK_RATE_PER_WORKER = 2.8


def box_load(role: str) -> dict:
    """A worker's load report with the box's step costs (the fields costs_from_loads reads)."""
    return {"role": role, "max_num_seqs": 128, "max_num_batched_tokens": 2048,
            "total_blocks": 4096, "block_size": 16, "kv_bytes_per_token": 16384,
            "kv_transfer": {"send_gbps": 3.0}, "num_threads": 2, "tensor_parallel_size": 1,
            "step_costs": {"coefficients": dict(BOX_COEFFICIENTS), "steps": 1000}}


# ------------------------------------------------------------------------------------ the day
@dataclass(frozen=True)
class Day:
    peak_rate: float
    trough_share: float = 0.2   # the night's rate, of the peak's
    slice_s: float = 600.0

    def rate(self, t: float) -> float:
        wave = (1 - math.cos(2 * math.pi * (t - 4 * 3600) / DAY_S)) / 2  # 0 at 04:00, 1 at 16:00
        return self.peak_rate * (self.trough_share + (1 - self.trough_share) * wave)

    @staticmethod
    def long_share(t: float) -> float:
        return 0.15 + 0.15 * (1 - math.cos(2 * math.pi * (t - 3 * 3600) / DAY_S)) / 2

    @property
    def slices(self) -> int:
        return round(DAY_S / self.slice_s)

    def count(self, index: int, seed: int) -> int:
        """Slice `index`'s arrivals: Poisson with the rate's integral over it (normal approx.)."""
        mean = self.rate((index + 0.5) * self.slice_s) * self.slice_s
        rng = random.Random(f"{seed}:{index % self.slices}:count")
        return max(0, round(mean + math.sqrt(mean) * rng.gauss(0, 1)))


class SliceRequests(Sequence):
    """A slice's arrivals as a Traffic window holds them, (seconds, prompt, output), without
    building 10^5-10^6 tuples: `decide` reads only their number and the lengths of those it
    draws. Times spread evenly (decide plans at the window's rate, not its times)."""

    def __init__(self, day: Day, index: int, seed: int):
        self.slice_s, self.key = day.slice_s, f"{seed}:{index % day.slices}"
        self.n = day.count(index, seed)
        self.long = day.long_share((index + 0.5) * day.slice_s)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[float, int, int]:
        if not 0 <= i < self.n:
            raise IndexError(i)
        long = random.Random(f"{self.key}:{i}").random() < self.long
        return self.slice_s * (i + 0.5) / self.n, LONG if long else SHORT, OUTPUT


# ------------------------------------------------------------------------------- one scale
class Scale:
    """One scale's day: the cluster's bounds (up to twice the peak's workers per pool), the
    autoscaler's run, and any split's outcome on any slice (each slice's sample the same for
    every system: its own seed)."""

    def __init__(self, peak_workers: int, slice_s: float, eval_s: float, seed: int):
        self.peak_workers, self.eval_s, self.seed = peak_workers, eval_s, seed
        self.day = Day(PEAK_RATE_PER_WORKER * peak_workers, slice_s=slice_s)
        self.slo = SLOTarget(ttft_s=2.5, tpot_s=0.1)
        self.routing = RoutingConfig(slo=self.slo)
        self.cfg = AutoscaleConfig(enabled=True, interval_s=slice_s, window_s=slice_s,
                                   prefill=PoolBounds(min_workers=0, max_workers=peak_workers),
                                   decode=PoolBounds(min_workers=1, max_workers=peak_workers))
        self.costs = costs_from_loads({"prefill-0": box_load("prefill"),
                                       "decode-0": box_load("decode")})
        self.outcomes: dict[tuple[tuple[int, int], int], float] = {}

    def traffic(self, index: int) -> Traffic:
        return Traffic(self.day.slice_s, SliceRequests(self.day, index, self.seed))

    def attainment(self, split: tuple[int, int], index: int) -> float:
        """Slice `index` on `split`: within both targets, of the requests sent (refusals miss)."""
        key = (split, index)
        if key not in self.outcomes:
            window = self.traffic(index).requests
            rate, total = len(window) / self.day.slice_s, sum(split)
            if rate <= 0:
                self.outcomes[key] = 1.0
                return 1.0
            # Enough of the slice's arrivals for each simulated pool (whole, or its largest
            # shard) to see eval_s seconds of them.
            reach = max(p + d for p, d in shards(split)) / total \
                if total > WHOLE_POOL_WORKERS else 1.0
            rng = random.Random(f"{self.seed}:{index}:eval")
            times = arrival_offsets(rate, rng, num_requests=max(
                SIM_REQUESTS, math.ceil(rate * self.eval_s * reach * 1.05) + 10))
            requests = [SimRequest(i, t, LONG if rng.random() < window.long else SHORT, OUTPUT)
                        for i, t in enumerate(times)]
            result = simulate_split(self.costs, split, requests, self.slo, self.routing,
                                    self.seed, self.eval_s)
            self.outcomes[key] = result["good"] / max(1, result["sent"])
        return self.outcomes[key]

    def autoscale(self) -> tuple[list[tuple[int, int]], list[dict]]:
        """Each slice's split as `decide` chose it from the slice before, from the split it
        chose for the day's last slice (a day like this one before it); each decision's
        reason, seconds and splits simulated. The cooldown (30 s) never holds a slice-long
        interval."""
        def step(index: int, now: tuple[int, int]):
            began = time.monotonic()
            d = decide(self.traffic(index - 1), {"prefill": now[0], "decode": now[1]},
                       self.cfg, self.costs, self.slo, since_change_s=self.day.slice_s,
                       routing=self.routing)
            return (d.desired["prefill"], d.desired["decode"]), {
                "reason": d.reason, "seconds": round(time.monotonic() - began, 3),
                "simulated": len(d.predicted.get("candidates", {})),
                "predicted": round(d.predicted["wanted"]["attainment"] or 0.0, 4)}
        now, _ = step(self.day.slices - 1, (1, 1))
        splits, decisions = [], []
        for index in range(self.day.slices):
            now, decision = step(index, now)
            splits.append(now)
            decisions.append(decision)
        return splits, decisions

    def hindsight(self, start: tuple[int, int], target: float) -> tuple[tuple[int, int], int]:
        """The smallest static split meeting `target` over the day, by the planner's search,
        each split scored on one slice an hour (else the best goodput of those it tried);
        and how many it tried."""
        per_hour = max(1, round(3600 / self.day.slice_s))
        sample = range(per_hour // 2, self.day.slices, per_hour)
        counts = {i: len(self.traffic(i).requests) for i in sample}

        def day_share(split: tuple[int, int]) -> float:
            return sum(counts[i] * self.attainment(split, i) for i in sample) / \
                max(1, sum(counts.values()))
        scores = search(day_share, SplitBounds(self.cfg), target, start)
        best = fewest(scores, target) or max(scores, key=lambda s: (scores[s], -sum(s)))
        return best, len(scores)

    def summary(self, splits: list[tuple[int, int]]) -> dict:
        """Worker-hours, goodput (requests within both targets a second, over the day), the
        attainment over the day and in its worst hour, and the scale events."""
        good = sent = 0.0
        hours: dict[int, list[float]] = {}
        for index, split in enumerate(splits):
            n = len(self.traffic(index).requests)
            g = n * self.attainment(split, index)
            good, sent = good + g, sent + n
            hour = hours.setdefault(int(index * self.day.slice_s // 3600), [0.0, 0.0])
            hour[0], hour[1] = hour[0] + g, hour[1] + n
        worst = min(hours, key=lambda h: hours[h][0] / max(1, hours[h][1]))
        return {"worker_hours": sum(map(sum, splits)) * self.day.slice_s / 3600,
                "goodput_rps": good / DAY_S, "attainment": good / max(1, sent),
                "worst_hour": hours[worst][0] / max(1, hours[worst][1]), "worst_hour_at": worst,
                "scale_events": sum(a != b for a, b in zip(splits, splits[1:])),
                "smallest": list(min(splits, key=sum)), "largest": list(max(splits, key=sum)),
                "attainment_by_slice": [round(self.attainment(s, i), 4)
                                        for i, s in enumerate(splits)],
                "splits": [list(s) for s in splits]}


def run_scale(args: tuple[int, float, float, int]) -> dict:
    peak_workers, slice_s, eval_s, seed = args
    began = time.monotonic()
    scale = Scale(peak_workers, slice_s, eval_s, seed)
    auto, decisions = scale.autoscale()
    seconds, reasons = [d["seconds"] for d in decisions], [d["reason"] for d in decisions]
    auto_s = time.monotonic() - began
    peak = max(auto, key=sum)
    static, tried = scale.hindsight(peak, scale.cfg.attainment)
    hindsight_s = time.monotonic() - began - auto_s
    n = scale.day.slices
    systems = {"autoscale": scale.summary(auto),
               f"static {static[0]}P+{static[1]}D (hindsight)": scale.summary([static] * n),
               f"static {peak[0]}P+{peak[1]}D (peak)": scale.summary([peak] * n)}
    return {"peak_workers": peak_workers, "peak_rate": scale.day.peak_rate,
            "trough_rate": scale.day.rate(4 * 3600), "slices": n, "slice_s": slice_s,
            "requests": sum(len(scale.traffic(i).requests) for i in range(n)),
            "rates": [round(scale.day.rate((i + 0.5) * slice_s), 2) for i in range(n)],
            "long_shares": [round(Day.long_share((i + 0.5) * slice_s), 3) for i in range(n)],
            "decide_s": {"mean": sum(seconds) / n, "p90": sorted(seconds)[int(0.9 * n)],
                         "max": max(seconds), "total": sum(seconds)},
            "simulated_per_decision": sum(d["simulated"] for d in decisions) / n,
            "reasons": {r: reasons.count(r) for r in sorted(set(reasons))},
            "decisions": decisions,
            "hindsight_tried": tried, "hindsight_s": hindsight_s,
            "wall_s": time.monotonic() - began, "systems": systems}


# ---------------------------------------------------------------------------------- report
NOTES = [
    "- Costs: worker load reports calibrated to this box's figures in docs/BENCHMARKS.md (no "
    "cost-model file; bench/autoscale_sim.py BOX_COEFFICIENTS): {coefficients}.",
    "- SLO TTFT 2.5 s, TPOT 100 ms; decide's defaults: 90% attainment target, 20% headroom, "
    "routing slo; the split of each slice decided on the slice before (window = interval = a "
    "slice).",
    "- Each slice simulated apart on its split ({eval_s:g} simulated s of its arrivals a pool, "
    "a fresh cluster: no queue carries over, workers start and drain at once); pools past "
    f"{WHOLE_POOL_WORKERS} workers as shards of at most {SHARD_WORKERS} (planner/autoscale.py "
    "simulate_split), in decide and here.",
    "- Hindsight static: the planner's search over static splits, each scored on one slice an "
    "hour; the one chosen then run on every slice. Peak static: the autoscaler's largest split.",
]


def table(results: list[dict]) -> str:
    lines = ["| peak workers (peak / trough req/s) | system | workers (min-max) | worker-hours | "
             "goodput req/s | attainment | worst hour (at) | scale events |",
             "|---|---|---|---|---|---|---|---|"]
    for r in results:
        for name, s in r["systems"].items():
            lo, hi = s["smallest"], s["largest"]
            span = f"{sum(lo)}" if lo == hi else f"{sum(lo)}-{sum(hi)}"
            lines.append(
                f"| {r['peak_workers']} ({r['peak_rate']:.0f} / {r['trough_rate']:.0f}) | {name} "
                f"| {span} | {s['worker_hours']:.0f} | {s['goodput_rps']:.1f} | "
                f"{100 * s['attainment']:.1f}% | {100 * s['worst_hour']:.1f}% "
                f"({s['worst_hour_at']:02d}:00) | {s['scale_events']} |")
    return "\n".join(lines)


def plot(results: list[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(2, len(results), figsize=(5 * len(results), 6), squeeze=False)
    for col, r in enumerate(results):
        hours = [(i + 0.5) * r["slice_s"] / 3600 for i in range(r["slices"])]
        top, bottom = axes[0][col], axes[1][col]
        for name, s in r["systems"].items():
            top.step(hours, [sum(x) for x in s["splits"]], where="mid", label=name)
            bottom.plot(hours, s["attainment_by_slice"], label=name, lw=1)
        rate = top.twinx()
        rate.plot(hours, r["rates"], color="grey", ls=":", label="req/s")
        rate.set_ylabel("req/s (dotted)")
        top.set_title(f"peak ~{r['peak_workers']} workers")
        top.set_ylabel("workers")
        bottom.set_ylabel("within both targets")
        bottom.set_xlabel("hour of the day")
        bottom.axhline(0.9, color="grey", lw=0.5)
        top.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--peak-workers", type=int, nargs="+", default=[16, 64, 512])
    ap.add_argument("--slice-minutes", type=float, default=10.0)
    ap.add_argument("--eval-seconds", type=float, default=30.0,
                    help="simulated seconds of each slice's traffic per simulated pool")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--jobs", type=int, default=2, help="scales run in parallel")
    ap.add_argument("--json")
    ap.add_argument("--plot")
    args = ap.parse_args()
    began = time.monotonic()
    work = [(n, args.slice_minutes * 60, args.eval_seconds, args.seed)
            for n in sorted(args.peak_workers, reverse=True)]  # the longest first
    if args.jobs > 1 and len(work) > 1:
        with multiprocessing.get_context("fork").Pool(min(args.jobs, len(work))) as pool:
            results = pool.map(run_scale, work, chunksize=1)
    else:
        results = [run_scale(w) for w in work]
    results.sort(key=lambda r: r["peak_workers"])
    print("\n".join(NOTES).format(coefficients=BOX_COEFFICIENTS, eval_s=args.eval_seconds))
    for r in results:
        d = r["decide_s"]
        print(f"- peak {r['peak_workers']}: {r['slices']} slices of {r['slice_s'] / 60:g} min, "
              f"{r['requests']} requests in the day; decide {d['mean']:.2f} s mean, "
              f"{d['p90']:.2f} p90, {d['max']:.2f} max, {r['simulated_per_decision']:.0f} splits "
              f"simulated a decision ({r['reasons']}); hindsight search "
              f"{r['hindsight_tried']} splits in {r['hindsight_s']:.0f} s; {r['wall_s']:.0f} s "
              "in all")
    print(table(results))
    print(f"wall {time.monotonic() - began:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results},
                                              indent=1))
    if args.plot:
        plot(results, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
