"""bench/gpu_check.py, the prepared GPU run, proven on CPU: its CPU twin runs every stage at toy
sizes and reports a figure for each (tensor_parallel at t=2 on device cpu over gloo); a stage
that hangs, fails or finds nothing to run is reported and the next one still runs; one that
this device cannot run (one GPU for the two-GPU stage) is reported skipped, not failed."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench import gpu_check

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.timeout(360)  # the twin's own budget is 270 s (bench/gpu_check_plan.py)
def test_cpu_twin_reports_every_stage_with_a_figure(tmp_path):
    out = tmp_path / "gpu_check.json"
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "gpu_check.py"), "--cpu-twin",
                           "--out", str(out), "--model-dir", str(tmp_path / "model")],
                          cwd=REPO, capture_output=True, text=True, timeout=330)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    summary = json.loads(out.read_text())
    assert summary["mode"] == "cpu-twin"
    stages = summary["stages"]
    assert list(stages) == [s.name for s in gpu_check.STAGES]
    assert {name: s["status"] for name, s in stages.items()} == \
        {s.name: "ok" for s in gpu_check.STAGES}
    rows = {r["stage"]: r for r in summary["rows"]}
    for prefix in ("environment", "tests/test_gpu.py", "kernels vs torch reference",
                   "device ceilings", "decode attn", "prefill attn, prompt",
                   "prefill attn, chunk", "bench model", "engine, CUDA graphs on",
                   "engine, CUDA graphs off", "HF generate", "P->D transfer",
                   "ours (graphs on) / HF generate", "ours (graphs off) / HF generate",
                   "tensor parallel: greedy t=2 vs t=1", "tensor parallel: decode step",
                   "tensor parallel: gloo all-reduce", "P->D transfer cpu to cpu (gloo)"):
        matching = [r for name, r in rows.items() if name.startswith(prefix)]
        assert matching, f"no row for {prefix}: {sorted(rows)}"
        assert all(r["figure"] and r["result"] in ("pass", "info") for r in matching), matching
    # the kernels' checks ran against the reference, and the engines made their tokens
    kernels = stages["kernels"]["data"]
    assert kernels["checks"] and all(c["ok"] for c in kernels["checks"])
    assert stages["engine_graphs"]["data"]["output_tokens"] == \
        stages["hf"]["data"]["output_tokens"] > 0
    # t=2 on the CPU: the same greedy tokens as t=1, every batch timed at both, the all-reduce
    # and the transfer between the two ranks' devices measured
    tp = stages["tensor_parallel"]["data"]
    assert tp["tokens"]["problems"] == [] and tp["tokens"]["prompts"] > 0
    assert [r["batch"] for r in tp["decode"]] == \
        gpu_check.SIZES["cpu"]["tensor_parallel"]["batches"]
    assert all(r["t1_ms"] > 0 and r["t2_ms"] > 0 for r in tp["decode"])
    assert tp["allreduce"]["backend"] == "gloo"
    assert all(v > 0 for v in tp["allreduce"]["us"].values())
    assert tp["transfer"]["peer_device"] == "cpu" and tp["transfer"]["transfer"]
    assert summary["table"] in proc.stdout  # the one table, printed last
    log = (tmp_path / "gpu_check.log").read_text()
    assert all(f"===== {s.name}: ok" in log for s in gpu_check.STAGES)


def _fake_stage(name: str, code: str, needs: tuple[str, ...] = ()) -> gpu_check.Stage:
    def rows(ctx, run):
        if run.status != "ok":
            return gpu_check._failed_rows(name, run)
        return [gpu_check.Row(name, str(run.data), "runs", "pass")]
    return gpu_check.Stage(name, lambda ctx: [sys.executable, "-c", code], rows, needs)


def _context(tmp_path, limits: dict) -> gpu_check.Context:
    sizes = dict(gpu_check.SIZES["cpu"], stage_s=limits)
    return gpu_check.Context("cpu", sizes, str(tmp_path))


def test_a_hung_failed_or_missing_stage_does_not_stop_the_others(tmp_path):
    # the hung stage starts a child of its own: the timeout must end the whole group
    pidfile = tmp_path / "child.pid"
    hang = ("import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', "
            "'import time; time.sleep(120)']); "
            f"open({str(pidfile)!r}, 'w').write(str(p.pid)); time.sleep(120)")
    stages = [
        _fake_stage("hang", hang),
        _fake_stage("fail", "import sys; print('boom'); sys.exit(1)"),
        gpu_check.Stage("absent", lambda ctx: "what it runs is not there",
                        lambda ctx, run: gpu_check._failed_rows("absent", run)),
        _fake_stage("model", "import sys; sys.exit(2)"),
        _fake_stage("needs_model", "print('{}')", needs=("model",)),
        _fake_stage("fine", "import json; print('noise'); print(json.dumps({'x': 1}))"),
    ]
    ctx = _context(tmp_path, {s.name: 3 if s.name == "hang" else 30 for s in stages})
    log = (tmp_path / "log").open("w")
    start = time.monotonic()
    rows = gpu_check.run_all(ctx, stages, budget_s=60, log=log)
    assert time.monotonic() - start < 30
    status = {name: run.status for name, run in ctx.runs.items()}
    assert status == {"hang": "timeout", "fail": "failed", "absent": "missing",
                      "model": "failed", "needs_model": "skipped", "fine": "ok"}
    assert ctx.runs["fail"].note == "boom"
    assert "model did not pass" in ctx.runs["needs_model"].note
    assert ctx.runs["fine"].data == {"x": 1}
    assert [r.result for r in rows if r.stage == "fine"] == ["pass"]
    child = int(pidfile.read_text())
    time.sleep(0.5)
    assert not Path(f"/proc/{child}").exists() or \
        Path(f"/proc/{child}/stat").read_text().split()[2] == "Z", "the hung stage's child lives"


def test_a_stage_this_device_cannot_run_is_skipped_not_failed(tmp_path):
    """The two-GPU stage on one GPU: one row saying why, and the run still passes; a stage
    left unstarted (the budget spent) fails it."""
    skip = (f"import json, sys; print(json.dumps({{'skipped': 'needs 2 GPUs, this device "
            f"has 1'}})); sys.exit({gpu_check.STAGE_SKIPPED})")
    stages = [_fake_stage("two_gpus", skip), _fake_stage("fine", "print('{}')")]
    ctx = _context(tmp_path, {"two_gpus": 30, "fine": 30})
    rows = gpu_check.run_all(ctx, stages, budget_s=60, log=(tmp_path / "log").open("w"))
    assert ctx.runs["two_gpus"].status == "skipped"
    (row,) = [r for r in rows if r.stage == "two_gpus"]
    assert row.figure == "skipped: needs 2 GPUs, this device has 1" and row.result == "skipped"
    assert gpu_check.run_passed(rows, ctx.runs)

    late = [_fake_stage("slow", "import time; time.sleep(1.5); print('{}')"),
            _fake_stage("late", "print('{}')")]
    ctx = _context(tmp_path, {"slow": 30, "late": 30})
    rows = gpu_check.run_all(ctx, late, budget_s=gpu_check.MIN_STAGE_S + 1.0,
                             log=(tmp_path / "log2").open("w"))
    assert not gpu_check.run_passed(rows, ctx.runs)


def test_the_tensor_parallel_body_skips_on_one_gpu(tmp_path, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    args = argparse.Namespace(mode="gpu", model_dir=str(tmp_path / "model"))
    assert gpu_check.BODIES["tensor_parallel"](args) == {
        "skipped": "needs 2 GPUs, this device has 1", "gpus": 1}
    assert not (tmp_path / "model").exists()  # nothing written before the skip


def test_tensor_parallel_rows_on_the_gpu(tmp_path):
    """bf16 at t=2 may part from t=1 at a near tie (a pass, with where it parted); a parting
    elsewhere fails; a failed part is a FAIL row beside the figures of the others."""
    from bench.gpu_check_stages import _tensor_parallel_rows

    ctx = _context(tmp_path, {})
    ctx.mode = "gpu"
    data = {"devices": ["cuda:0", "cuda:1"],
            "tokens": {"prompts": 16, "identical": 15, "tokens_each": 64,
                       "first_divergence": {"prompt": 4, "token": 37}, "problems": []},
            "decode": [{"batch": 1, "t1_ms": 8.0, "t2_ms": 6.0},
                       {"batch": 64, "t1_ms": 12.0, "t2_ms": 9.0}],
            "allreduce": {"backend": "nccl", "hidden": 2048, "dtype": "bfloat16", "calls": 100,
                          "layers": 16, "us": {"1": 20.0, "64": 30.0}},
            "transfer": {"device": "cuda:0", "peer_device": "cuda:1", "mode": "nccl",
                         "transfer": [{"tokens": 2048, "bytes": 2**28, "gbs": 90.0,
                                       "copy_gbs": 1800.0, "ratio": 0.05, "raw_gbs": 100.0}]}}
    rows = {r.stage: r for r in _tensor_parallel_rows(ctx, gpu_check.StageRun(
        "tensor_parallel", "ok", returncode=0, data=data))}
    tokens = rows["tensor parallel: greedy t=2 vs t=1"]
    assert tokens.result == "pass" and "15/16 prompts identical" in tokens.figure \
        and "token 37 (prompt 4)" in tokens.figure
    assert "b=64 9.00/12.00 ms = 0.75x" in rows["tensor parallel: decode step t=2/t=1"].figure
    assert "x32 a step at b=64: 0.96 ms" in rows["tensor parallel: nccl all-reduce"].figure
    assert rows["P->D transfer cuda:0 to cuda:1 (nccl)"].figure.startswith("90.0 GB/s")

    data["tokens"]["problems"] = ["sequence 4 parts at step 37 (5 vs 9) where no run has ..."]
    data["transfer"] = {"device": "cuda:0", "peer_device": "cuda:1", "transfer": [],
                        "error": "RuntimeError: NCCL error"}
    data["error"] = "transfer: ..."
    rows = _tensor_parallel_rows(ctx, gpu_check.StageRun("tensor_parallel", "failed",
                                                         returncode=1, data=data))
    results = {r.stage: r.result for r in rows}
    assert results["tensor parallel: greedy t=2 vs t=1"] == "FAIL"
    assert results["P->D transfer cuda:0 to cuda:1 (torch_dist)"] == "FAIL"
    assert results["tensor parallel"] == "FAIL"
    assert results["tensor parallel: decode step t=2/t=1"] == "info"


def test_stages_past_the_global_budget_are_not_started(tmp_path):
    stages = [_fake_stage("slow", "import time; time.sleep(1.5); print('{}')"),
              _fake_stage("late", "print('{}')")]
    ctx = _context(tmp_path, {"slow": 30, "late": 30})
    rows = gpu_check.run_all(ctx, stages, budget_s=gpu_check.MIN_STAGE_S + 1.0,
                             log=(tmp_path / "log").open("w"))
    assert ctx.runs["slow"].status == "ok"
    assert ctx.runs["late"].status == "skipped"
    assert "budget" in ctx.runs["late"].note
    assert [r.result for r in rows if r.stage == "late"] == ["skipped"]


def test_pytest_summary_and_ratio_verdicts(tmp_path):
    ctx = _context(tmp_path, {})
    ctx.mode = "gpu"
    run = gpu_check.StageRun("tests", "ok", returncode=0,
                             output="....\n12 passed, 1 skipped in 30.1s\n")
    (row,) = gpu_check._tests_rows(ctx, run)
    assert row.figure == "12 passed, 1 skipped" and row.result == "FAIL"  # a skip on the GPU
    run.output = "....\n3 failed, 10 passed in 30.1s\n"
    run.returncode = 1
    assert gpu_check._tests_rows(ctx, run)[0].result == "FAIL"
    run.output, run.returncode = "13 passed in 9.0s\n", 0
    assert gpu_check._tests_rows(ctx, run)[0].result == "pass"

    def ratio(ours: float, hf: float) -> str:
        ctx.runs = {"engine_graphs": gpu_check.StageRun("engine_graphs", "ok",
                                                        data={"tokens_per_s": ours}),
                    "hf": gpu_check.StageRun("hf", "ok", data={"tokens_per_s": hf})}
        (row,) = gpu_check.ratio_rows(ctx)
        return row.result

    assert ratio(3500.0, 1000.0) == "pass"
    assert ratio(2500.0, 1000.0) == "FAIL"
    ctx.mode = "cpu"
    assert ratio(2500.0, 1000.0) == "info"  # the twin's speeds carry no target


def test_the_memory_plan_must_cover_the_measured_peak(tmp_path):
    """The engine stage reports memory_plan.py's estimate beside torch's peak on the device:
    a plan below the peak (an engine that could run out of memory at a longer step) fails."""
    from bench.gpu_check_stages import _engine_rows

    ctx = _context(tmp_path, {})
    ctx.mode = "gpu"
    rows = _engine_rows("engine")
    data = {"tokens_per_s": 100.0, "output_tokens": 10, "elapsed_s": 0.1, "plan_gib": 20.0}
    for peak, result in ((18.5, "pass"), (21.0, "FAIL")):
        run = gpu_check.StageRun("engine_graphs", "ok", data={**data, "peak_reserved_gib": peak})
        speed, memory = rows(ctx, run)
        assert memory.result == result and "peak reserved" in memory.figure
    no_plan = gpu_check.StageRun("engine_graphs", "ok", data={
        k: v for k, v in data.items() if k != "plan_gib"})
    assert len(rows(ctx, no_plan)) == 1  # the CPU twin has no device plan


@pytest.mark.parametrize("rows", [[gpu_check.Row("a", "b" * 200, "c", "pass")]])
def test_table_keeps_one_line_per_row(rows):
    table = gpu_check.format_table(rows)
    assert len(table.splitlines()) == 3 and "stage" in table.splitlines()[0]


def test_a_stage_whose_output_cannot_be_read_is_one_error_row(tmp_path):
    def unexpected(ctx, run):
        return [gpu_check.Row("odd", run.data["a field it never printed"], "runs", "pass")]

    stages = [gpu_check.Stage("odd", lambda ctx: [sys.executable, "-c", "print('{}')"],
                              unexpected),
              _fake_stage("after", "print('{}')")]
    ctx = _context(tmp_path, {"odd": 30, "after": 30})
    rows = gpu_check.run_all(ctx, stages, budget_s=60, log=(tmp_path / "log").open("w"))
    assert rows[0].result == "error" and "KeyError" in rows[0].figure
    assert ctx.runs["after"].status == "ok"
