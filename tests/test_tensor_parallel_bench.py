"""bench/tensor_parallel.py's quick mode on the small test model: it runs t=1 and t=2 end to
end and reports every field (shape only: two cores are not a tensor-parallel target, and this
checks no speed)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_quick_mode_reports_decode_and_memory_per_rank(model_factory, tmp_path):
    out, png = tmp_path / "tp.json", tmp_path / "tp.png"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "tensor_parallel.py"), "--quick",
                           "--model", model_factory("llama"), "--json", str(out),
                           "--png", str(png)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert png.stat().st_size > 0
    assert [row["batch"] for row in result["decode"]] == [1, 4]
    for row in result["decode"]:
        for key in ("t1_step_ms", "t2_step_ms", "t1_cpu_ms", "t2_cpu_ms", "t2_allreduce_ms",
                    "bare_allreduce_ms"):
            assert row[key] > 0, key
        assert row["allreduces_per_step"] == 2 * 2  # o and down in each of the 2 layers
        assert {len(row["runs"]["1"]), len(row["runs"]["2"])} == {2}  # windows, alternating
        assert all(run["steps"] == 4 for size in "12" for run in row["runs"][size])
    ranks = [(r["tp"], r["rank"]) for r in result["memory"]]
    assert ranks == [(1, 0), (2, 0), (2, 1)]
    one, driver, follower = result["memory"]
    assert len({one["pid"], driver["pid"], follower["pid"]}) == 3
    for r in result["memory"]:
        assert r["rss_bytes"] > r["weights"] + r["packed"] > 0
    # Each rank holds half the heads: half the KV bytes a token; the same blocks.
    assert driver["kv_bytes_per_token"] == follower["kv_bytes_per_token"] \
        == one["kv_bytes_per_token"] // 2
    assert driver["kv_cache_bytes"] == one["kv_cache_bytes"] // 2
    # The linears are split, the embedding and norms are not: less than one rank's, more than half.
    assert one["weights"] / 2 < follower["weights"] < one["weights"]
    assert "two cores are not a tensor-parallel target" in proc.stdout
