"""The GPU check's stages, in order: how each one is started (a command line, or why it cannot
run) and how its output becomes rows of the summary table, then the ours-over-HF ratios."""

from __future__ import annotations

import dataclasses
import re
import sys

from bench.gpu_check_plan import REPO, Context, Row, Stage, StageRun, _failed_rows

CHECK_SCRIPT = REPO / "bench" / "gpu_check.py"  # a body stage runs it again with --stage NAME


def _self(ctx: Context, stage: str, *extra: str) -> list[str]:
    return [sys.executable, str(CHECK_SCRIPT), "--stage", stage,
            "--mode", ctx.mode, "--model-dir", ctx.model_dir, *extra]


def _env_rows(ctx: Context, run: StageRun) -> list[Row]:
    d = run.data or {}
    if not d:
        return _failed_rows("environment", run)
    missing = [m for m, ok in d.get("imports", {}).items() if not ok]
    figure = (f"{d.get('device')}, torch {d.get('torch')}, triton {d.get('triton')}, "
              f"transformers {d.get('transformers')}")
    if missing:
        figure += f"; missing: {', '.join(missing)}"
    needed = d.get("imports", {}).get("pydantic", False) and (ctx.twin or d.get("cuda"))
    return [Row("environment", figure, "CUDA device; engine imports",
                "pass" if needed else "FAIL")]


def _tests_command(ctx: Context) -> list[str]:
    limit = int(ctx.sizes["stage_s"]["tests"])
    # with the KV transfers between two processes on one GPU (torch_dist by CUDA IPC, ucx)
    return [sys.executable, "-m", "pytest", "tests/test_gpu.py",
            "tests/test_kv_transfer_two_process.py", "-k", "not (two_process and not cuda)",
            "-q", "-rs", "-p", "no:cacheprovider", f"--timeout={min(limit, 90)}"]


def _tests_rows(ctx: Context, run: StageRun) -> list[Row]:
    counts = {}
    tail = run.output.strip().splitlines()[-1] if run.output.strip() else ""
    for number, kind in re.findall(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed)",
                                   tail):
        counts["error" if kind.startswith("error") else kind] = int(number)
    if not counts:
        return _failed_rows("tests/test_gpu.py", run)
    figure = ", ".join(f"{n} {k}" for k, n in counts.items())
    bad = counts.get("failed", 0) + counts.get("error", 0)
    if ctx.twin:  # no CUDA here: the GPU tests skip, the helper tests run
        ok = run.returncode == 0 and not bad
        return [Row("tests/test_gpu.py", figure + " (no GPU)", "collects; CPU parts pass",
                    "pass" if ok else "FAIL")]
    ok = run.returncode == 0 and not bad and not counts.get("skipped")
    return [Row("tests/test_gpu.py", figure, "all pass, none skipped",
                "pass" if ok else "FAIL")]


def _kernels_command(ctx: Context) -> list[str]:
    return [sys.executable, str(REPO / "bench" / "gpu_kernels.py"),
            "--device", ctx.sizes["device"], *ctx.sizes["kernels_args"]]


def _kernels_rows(ctx: Context, run: StageRun) -> list[Row]:
    d = run.data or {}
    if "summary" not in d:
        return _failed_rows("kernels", run)
    s = d["summary"]
    checks = d.get("checks", [])
    rows = [Row("kernels vs torch reference",
                f"{sum(c['ok'] for c in checks)}/{len(checks)} ok, max rel err "
                f"{s['max_rel_err']:.1e}" if checks else "no checks ran",
                "rel err < 1e-2, no NaN, write_kv exact", "pass" if s["checks_ok"] else "FAIL")]
    if "copy_gbs" in d:
        dtype = d.get("shape", {}).get("dtype", "bfloat16")  # the kernels' and the matmul's
        rows.append(Row("device ceilings", f"copy {d['copy_gbs']:.0f} GB/s (r+w), read "
                        f"{d['read_gbs']:.0f} GB/s, {dtype} matmul "
                        f"{d['matmul_tflops']:.0f} TFLOP/s",
                        "measured", "info"))
    long = s.get("decode_long")
    if long:
        best = long["best"]
        rows.append(Row(f"decode attn ({long['rule']})",
                        f"median {long['median_fraction']:.0%} of copy (min "
                        f"{long['min_fraction']:.0%}, {long['shapes']} shapes; each at its "
                        f"best of the variants: "
                        f"{long.get('median_best_variant', float('nan')):.0%}); best "
                        f"{best['gbs']:.0f} GB/s at B={best['batch']} ctx={best['context']}",
                        ">= 70% of copy", ctx.verdict(long["median_fraction"] >= 0.7)))
    elif "copy_gbs" in d:
        rows.append(Row("decode attn", "no long-context shape ran", ">= 70% of copy",
                        ctx.verdict(False)))
    for key in ("prefill_longest", "prefill_chunked"):
        p = s.get(key)
        if p:
            rows.append(Row(f"prefill attn, {p['case']}",
                            f"{p['tflops']:.1f} TFLOP/s = {p['fraction_of_matmul']:.0%} of matmul"
                            + "".join(f"; {label}: {v:.1f}" for label, v in
                                      (p.get("variants_tflops") or {}).items()),
                            "reported", "info"))
    return rows


def _model_rows(ctx: Context, run: StageRun) -> list[Row]:
    d = run.data or {}
    if "params" not in d:
        return _failed_rows("model", run)
    how = "reused" if d.get("reused") else f"written in {d['seconds']:.1f} s"
    return [Row("bench model", f"{d['params'] / 1e6:.1f}M params, head_dim {d['head_dim']}, "
                f"bf16, {how}", "written", "pass")]


def _engine_rows(label: str):
    def rows(ctx: Context, run: StageRun) -> list[Row]:
        d = run.data or {}
        if "tokens_per_s" not in d:
            return _failed_rows(label, run)
        figure = f"{d['tokens_per_s']:.0f} out tok/s ({d['output_tokens']} in {d['elapsed_s']:.1f} s)"
        if d.get("graph_capture_s") is not None:
            figure += f", graph capture {d['graph_capture_s']:.1f} s"
        out = [Row(label, figure, "measured", "info")]
        if d.get("plan_gib") is not None:  # memory_plan.py's estimate must cover what ran
            out.append(Row(f"{label}: memory plan",
                           f"plan {d['plan_gib']:.2f} GiB, torch peak reserved "
                           f"{d['peak_reserved_gib']:.2f} GiB (allocated "
                           f"{d.get('peak_allocated_gib', float('nan')):.2f})", "plan >= peak",
                           ctx.verdict(d["plan_gib"] >= d["peak_reserved_gib"])))
        return out
    return rows


def _transfer_command(backend: str, stage: str):
    def command(ctx: Context) -> list[str] | str:
        script = REPO / "bench" / "gpu_transfer.py"
        if not script.exists():
            return "bench/gpu_transfer.py is not there"
        # (stopping 15 s before the stage's limit: the sizes measured by then are reported;
        # ucx also says which protocol and transport UCX picked, in the log)
        return [sys.executable, str(script), "--device", ctx.sizes["device"],
                "--backend", backend, *ctx.sizes["transfer_args"],
                "--deadline-s", str(max(5, ctx.sizes["stage_s"][stage] - 15)),
                *(["--ucx-info"] if backend == "ucx" else [])]
    return command


def _transfer_rows(backend: str):
    def rows(ctx: Context, run: StageRun) -> list[Row]:
        name = f"P->D transfer ({backend}{', ' + run.data['mode'] if (run.data or {}).get('mode') else ''})"
        points = (run.data or {}).get("transfer")
        if not points:
            return _failed_rows(f"P->D transfer ({backend})", run)
        big = max(points, key=lambda p: p["bytes"])
        figure = (f"{big['gbs']:.1f} GB/s = {big['ratio']:.0%} of device copy "
                  f"({big['copy_gbs']:.0f} GB/s) at {big['tokens']} tokens")
        if big.get("raw_gbs") is not None:
            figure += f"; bare link {big['raw_gbs']:.1f} GB/s"
        out = [Row(name, figure, "reported", "info")]
        if (run.data or {}).get("stopped"):
            out.append(Row(name, str(run.data["stopped"])[:90], "every size", "info"))
        if (run.data or {}).get("error"):
            out.append(Row(name, str(run.data["error"])[:90], "no error", "FAIL"))
        return out
    return rows


def _tensor_parallel_rows(ctx: Context, run: StageRun) -> list[Row]:
    """t=2 against t=1 on two devices: the greedy tokens (a verdict on the GPU and in the
    twin: the split sums move bf16 bits, not tokens but at near ties), the step times, the bare
    all-reduce and the cross-device KV transfer (figures)."""
    d = run.data or {}
    if not any(key in d for key in ("tokens", "decode", "allreduce", "transfer")):
        return _failed_rows("tensor parallel", run)
    rows = []
    tokens = d.get("tokens")
    if tokens:
        figure = f"{tokens['identical']}/{tokens['prompts']} prompts identical " \
                 f"({tokens['tokens_each']} tokens each)"
        first = tokens.get("first_divergence")
        if first:
            figure += f"; first divergence at token {first['token']} (prompt {first['prompt']})"
        if tokens["problems"]:
            figure += f"; {tokens['problems'][0]}"
        rows.append(Row("tensor parallel: greedy t=2 vs t=1", figure,
                        "same, or parting at a near tie", "FAIL" if tokens["problems"] else "pass"))
    if d.get("decode"):
        rows.append(Row("tensor parallel: decode step t=2/t=1", ", ".join(
            f"b={r['batch']} {r['t2_ms']:.2f}/{r['t1_ms']:.2f} ms = {r['t2_ms'] / r['t1_ms']:.2f}x"
            for r in d["decode"]), "reported (graphs off at both)", "info"))
    reduce = d.get("allreduce")
    if reduce:
        us = reduce["us"]
        widest = max(us, key=int)
        per_step_ms = 2 * reduce["layers"] * us[widest] / 1e3  # two row-parallel layers a layer
        rows.append(Row(f"tensor parallel: {reduce['backend']} all-reduce",
                        f"[b, {reduce['hidden']}] bf16: " + ", ".join(
                            f"b={b} {v:.0f} us" for b, v in us.items())
                        + f"; x{2 * reduce['layers']} a step at b={widest}: {per_step_ms:.2f} ms",
                        "reported", "info"))
    transfer = d.get("transfer")
    if transfer is not None:
        label = f"P->D transfer {' to '.join(d.get('devices', ['?', '?']))} " \
                f"({transfer.get('mode') or 'torch_dist'})"
        if transfer.get("transfer"):
            rows += [dataclasses.replace(r, stage=label) for r in _transfer_rows("torch_dist")(
                ctx, StageRun(run.name, "ok", data=transfer))]
        else:
            rows.append(Row(label, str(transfer.get("error", "no size measured"))[:90],
                            "runs", "FAIL"))
    if d.get("error"):
        rows.append(Row("tensor parallel", str(d["error"])[:90], "no error", "FAIL"))
    return rows


# The headline figures first (kernels, engine vs HF), the GPU tests last: a first GPU
# run that hangs in them then costs no figure, only the time left. tensor_parallel last: on one
# GPU it skips in seconds; on two it takes what the others left (there: --budget-s 540).
STAGES = [
    Stage("env", lambda ctx: _self(ctx, "env"), _env_rows),
    Stage("kernels", _kernels_command, _kernels_rows),
    Stage("model", lambda ctx: _self(ctx, "model"), _model_rows),
    Stage("engine_graphs", lambda ctx: _self(ctx, "engine", "--graphs", "on"),
          _engine_rows("engine, CUDA graphs on"), needs=("model",)),
    Stage("hf", lambda ctx: _self(ctx, "hf"), _engine_rows("HF generate"), needs=("model",)),
    Stage("engine_eager", lambda ctx: _self(ctx, "engine", "--graphs", "off"),
          _engine_rows("engine, CUDA graphs off"), needs=("model",)),
    # the default backend (on one GPU: CUDA IPC), then UCX (cuda_ipc)
    Stage("transfer", _transfer_command("torch_dist", "transfer"), _transfer_rows("torch_dist")),
    Stage("transfer_ucx", _transfer_command("ucx", "transfer_ucx"), _transfer_rows("ucx")),
    Stage("tests", _tests_command, _tests_rows),
    Stage("tensor_parallel", lambda ctx: _self(ctx, "tensor_parallel"), _tensor_parallel_rows,
          needs=("model",)),
]


def ratio_rows(ctx: Context) -> list[Row]:
    """Ours over HF at the same batch, model and device: the issue's target is 3x (graphs on)."""
    hf = (ctx.runs.get("hf") or StageRun("hf", "skipped")).data or {}
    rows = []
    for stage, label, target in (("engine_graphs", "graphs on", 3.0),
                                 ("engine_eager", "graphs off", None)):
        ours = (ctx.runs.get(stage) or StageRun(stage, "skipped")).data or {}
        if stage not in ctx.runs:
            continue
        name = f"ours ({label}) / HF generate"
        if "tokens_per_s" in ours and "tokens_per_s" in hf:
            ratio = ours["tokens_per_s"] / hf["tokens_per_s"]
            rows.append(Row(name, f"{ratio:.2f}x", f">= {target:.0f}x" if target else "reported",
                            ctx.verdict(ratio >= target) if target else "info"))
        else:
            rows.append(Row(name, "no figure (a stage above did not finish)",
                            f">= {target:.0f}x" if target else "reported",
                            "FAIL" if target and not ctx.twin else "info"))
    return rows
