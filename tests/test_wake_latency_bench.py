"""bench/wake_latency.py in quick mode: a few run-record waits (SQLite, the writer in this
process) and SLO-queue holds, each with a latency the summary reports."""

from __future__ import annotations

import json


def test_quick_mode_reports_both_waits(llama_dir, tmp_path):
    from bench.wake_latency import main

    out = tmp_path / "wake.json"
    results = main(["--quick", "--model-dir", llama_dir, "--out", str(out)])
    assert json.loads(out.read_text()) == results
    cases = [*results["records"].values(), results["slo_queue"]]
    assert set(results["records"]) == {"sqlite/this_process/follow",
                                       "sqlite/this_process/stored"}
    for summary in cases:
        assert summary["n"] == 3 and 0 <= summary["p50_ms"] <= summary["p99_ms"]
