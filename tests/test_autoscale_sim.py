"""bench/autoscale_sim.py's day, fast: the curve and the mix it follows, a slice's window as
`decide` reads it, and one small scale end to end (each slice's split the decision on the slice
before it, the static splits, the summary's sums).
"""

from __future__ import annotations

import pytest

from bench.autoscale_sim import DAY_S, LONG, SHORT, Day, Scale, SliceRequests, run_scale


def test_the_day_runs_from_the_night_trough_to_the_afternoon_peak():
    day = Day(peak_rate=100.0, slice_s=3600.0)
    assert day.rate(4 * 3600) == pytest.approx(20.0) and day.rate(16 * 3600) == pytest.approx(100)
    assert min(day.rate(t) for t in range(0, int(DAY_S), 600)) >= 20.0 - 1e-9
    assert Day.long_share(3 * 3600) == pytest.approx(0.15)
    assert Day.long_share(15 * 3600) == pytest.approx(0.30)
    assert day.slices == 24
    # The slice before the first is the day's last (a day like this one before it).
    assert day.count(-1, seed=0) == day.count(23, seed=0)


def test_a_slice_window_holds_its_arrivals_and_their_mix():
    day = Day(peak_rate=50.0, slice_s=600.0)
    window = SliceRequests(day, 96, seed=0)  # 16:00
    assert abs(len(window) - 50.0 * 600) < 5 * (50.0 * 600) ** 0.5
    rows = [window[i] for i in range(0, len(window), 7)]
    assert {p for _, p, _ in rows} == {SHORT, LONG} and all(o == 64 for _, _, o in rows)
    share = sum(p == LONG for _, p, _ in rows) / len(rows)
    assert abs(share - window.long) < 0.03
    assert window[5] == SliceRequests(day, 96, seed=0)[5]
    assert 0 < rows[0][0] < rows[-1][0] < 600
    with pytest.raises(IndexError):
        window[len(window)]


def test_one_small_scale_end_to_end():
    """Peak ~4 workers, four 6-hour slices, 5 simulated seconds a slice."""
    r = run_scale((4, 6 * 3600.0, 5.0, 0))
    assert r["slices"] == 4 and sum(r["reasons"].values()) == 4
    auto, hindsight, peak = r["systems"].values()
    assert len(auto["splits"]) == 4 and all(d >= 1 for _, d in auto["splits"])
    assert peak["largest"] == auto["largest"] == max(auto["splits"], key=sum)
    assert hindsight["scale_events"] == peak["scale_events"] == 0
    for s in r["systems"].values():
        hours = sum(map(sum, s["splits"])) * 6
        assert s["worker_hours"] == pytest.approx(hours)
        assert 0 <= s["worst_hour"] <= s["attainment"] + 1e-9 <= 1 + 1e-9
        assert s["goodput_rps"] == pytest.approx(
            sum(a * n for a, n in zip(s["attainment_by_slice"], slice_counts(r))) / DAY_S,
            rel=1e-3)


def slice_counts(r: dict) -> list[int]:
    day = Day(peak_rate=r["peak_rate"], slice_s=r["slice_s"])
    return [day.count(i, seed=0) for i in range(r["slices"])]


def test_a_scale_sizes_its_bounds_by_the_peak():
    scale = Scale(64, 600.0, 30.0, 0)
    assert scale.cfg.prefill.max_workers == scale.cfg.decode.max_workers == 64
    assert scale.cfg.window_s == scale.cfg.interval_s == 600.0
