"""Plots of bench/goodput.py results, one line per system (--label): goodput, p99 TTFT and p99
TPOT against offered rate, and TTFT/TPOT CDFs at one rate; prints each system's knee and peak.

    .venv/bin/python bench/goodput_plot.py A.json [B.json ...] [--out goodput.png]
        [--cdf-out goodput_cdf.png] [--cdf-rate R]

The knee is the highest offered rate whose goodput is at least 90% of it: past it, requests
start missing their SLOs or being refused faster than the offered load grows.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Optional

KNEE_FRACTION = 0.9


def rate_points(doc: dict) -> list[dict]:
    """The open-loop points' summaries, by offered rate (closed-loop and burst have none)."""
    points = [p["summary"] for p in doc["points"] if p["summary"]["offered_rate"] is not None]
    return sorted(points, key=lambda s: s["offered_rate"])


def knee_and_peak(summaries: list[dict]) -> dict:
    """knee: the highest offered rate with goodput >= 90% of it (None if none);
    peak: the highest goodput and the offered rate it came at."""
    rated = [s for s in summaries if s["offered_rate"] is not None]
    kept = [s["offered_rate"] for s in rated
            if s["goodput_rps"] >= KNEE_FRACTION * s["offered_rate"]]
    best = max(rated, key=lambda s: s["goodput_rps"], default=None)
    return {"knee_rate": max(kept, default=None),
            "peak_goodput_rps": best["goodput_rps"] if best else None,
            "peak_at_rate": best["offered_rate"] if best else None}


def nearest_point(doc: dict, rate: float) -> Optional[dict]:
    points = [p for p in doc["points"] if p["summary"]["offered_rate"] is not None]
    return min(points, key=lambda p: abs(p["summary"]["offered_rate"] - rate), default=None)


def _cdf(ax, values: list[float], label: str) -> None:
    ordered = sorted(values)
    n = len(ordered)
    ax.step(ordered, [(i + 1) / n for i in range(n)], where="post", label=label)


def plot(docs: list[dict], out: str, cdf_out: str, cdf_rate: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    slo = docs[0]["config"]
    fig, (good, ttft, tpot) = plt.subplots(1, 3, figsize=(15, 4.5))
    top = 0.0
    for doc in docs:
        points = rate_points(doc)
        rates = [s["offered_rate"] for s in points]
        top = max([top, *rates])
        good.plot(rates, [s["goodput_rps"] for s in points], marker="o", label=doc["label"])
        ttft.plot(rates, [s["ttft_s"]["p99"] for s in points], marker="o", label=doc["label"])
        tpot.plot(rates, [s["tpot_s"]["p99"] for s in points], marker="o", label=doc["label"])
    good.plot([0, top], [0, top], ":", color="gray", label="goodput = offered")
    ttft.axhline(slo["slo_ttft"], linestyle="--", color="red", label="SLO")
    tpot.axhline(slo["slo_tpot"], linestyle="--", color="red", label="SLO")
    for ax, title, unit in ((good, "goodput", "req/s"), (ttft, "p99 TTFT", "s"),
                            (tpot, "p99 TPOT", "s")):
        ax.set(title=title, xlabel="offered rate (req/s)", ylabel=unit)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)

    fig, (ttft, tpot) = plt.subplots(1, 2, figsize=(11, 4.5))
    for doc in docs:
        point = nearest_point(doc, cdf_rate)
        if point is None:
            continue
        done = [r for r in point["requests"] if r["outcome"] == "completed"]
        label = f"{doc['label']} @ {point['summary']['offered_rate']:g}/s"
        _cdf(ttft, [r["ttft_s"] for r in done], label)
        _cdf(tpot, [r["tpot_s"] for r in done if r["tpot_s"] is not None], label)
    for ax, name, limit in ((ttft, "TTFT", slo["slo_ttft"]), (tpot, "TPOT", slo["slo_tpot"])):
        ax.axvline(limit, linestyle="--", color="red", label="SLO")
        ax.set(title=f"{name} CDF", xlabel="seconds", ylabel="fraction of completed")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(cdf_out, dpi=120)
    plt.close(fig)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", nargs="+", help="JSON files from bench/goodput.py --json")
    ap.add_argument("--out", default="goodput.png")
    ap.add_argument("--cdf-out", default="goodput_cdf.png")
    ap.add_argument("--cdf-rate", type=float,
                    help="offered rate of the CDFs (default: the first system's knee)")
    args = ap.parse_args(argv)
    docs = [json.loads(Path(path).read_text()) for path in args.results]
    first = None
    for doc in docs:
        found = knee_and_peak(rate_points(doc))
        first = first or found
        knee = "none" if found["knee_rate"] is None else f"{found['knee_rate']:g}/s"
        peak = "none" if found["peak_goodput_rps"] is None else \
            f"{found['peak_goodput_rps']:.2f} req/s at {found['peak_at_rate']:g}/s"
        print(f"{doc['label']}: knee {knee}, peak goodput {peak}")
    cdf_rate = args.cdf_rate if args.cdf_rate is not None else \
        first["knee_rate"] or first["peak_at_rate"] or 0.0
    plot(docs, args.out, args.cdf_out, cdf_rate)
    print(f"wrote {args.out} and {args.cdf_out} (CDFs at {cdf_rate:g}/s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
