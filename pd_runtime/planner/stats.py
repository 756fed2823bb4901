"""Percentiles, one definition for the simulator and the load generator that it is compared
with (bench/goodput_summary.py)."""

from __future__ import annotations

from typing import Optional


def percentile(values: list[float], q: float) -> Optional[float]:
    """Linear interpolation between closest ranks (numpy's default); None for no values. The
    load generator's summaries (bench/goodput_summary.py) use this one, so measured and
    simulated percentiles mean the same."""
    if not values:
        return None
    ordered = sorted(values)
    k = (len(ordered) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)
