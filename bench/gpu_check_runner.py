"""Running the GPU check's stages: each in its own process group under min(its limit, what is
left of the budget), its output logged and read back into summary rows, whatever became of it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from typing import Callable, Optional

from bench.gpu_check_plan import (MIN_STAGE_S, REPO, STAGE_MISSING, STAGE_SKIPPED, Context,
                                  Row, Stage, StageRun, _failed_rows)
from bench.gpu_check_stages import ratio_rows


def _last_json(text: str) -> Optional[dict]:
    for line in reversed(text.strip().splitlines()):
        line = line.strip()
        if line.startswith("{") and line.endswith("}"):
            try:
                return json.loads(line)
            except ValueError:
                return None
    return None


def run_stage(argv: list[str], timeout_s: float, env: dict) -> tuple[int | None, str, float]:
    """(exit code or None on timeout, combined output, seconds). The stage runs in its own
    process group, so a timeout ends everything it started (a transfer's two processes)."""
    start = time.monotonic()
    proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout_s)
        return proc.returncode, output, time.monotonic() - start
    except subprocess.TimeoutExpired:
        for sig, grace in ((signal.SIGTERM, 5), (signal.SIGKILL, 5)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                output, _ = proc.communicate(timeout=grace)
                break
            except subprocess.TimeoutExpired:
                output = ""
        return None, output or "", time.monotonic() - start


def stage_env(base: dict, twin: bool) -> dict:
    """The stages' environment: the repository importable (no install on the device machine),
    output unbuffered, and on the GPU the Triton interpreter off: tests/conftest.py turns it on
    for the CPU suite unless told otherwise, and the GPU tests are about the compiled kernels."""
    env = dict(base)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), base.get("PYTHONPATH")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    if not twin:
        env["TRITON_INTERPRET"] = "0"
    return env


def run_all(ctx: Context, stages: list[Stage], budget_s: float, log) -> list[Row]:
    """Run `stages` in order, each under min(its limit, what is left of `budget_s`); the rows
    of every stage, whatever became of it, then the ratio rows."""
    start = time.monotonic()
    env = stage_env(dict(os.environ), ctx.twin)
    rows: list[Row] = []

    def say(text: str) -> None:
        print(f"[{time.monotonic() - start:6.1f}s] {text}", flush=True)

    for stage in stages:
        remaining = budget_s - (time.monotonic() - start)
        limit = min(ctx.sizes["stage_s"][stage.name], remaining)
        run = StageRun(stage.name, "skipped")
        argv = stage.command(ctx)
        unmet = [n for n in stage.needs if ctx.runs.get(n) and ctx.runs[n].status != "ok"]
        if unmet:
            run.note = f"not started: {', '.join(unmet)} did not pass"
        elif remaining < MIN_STAGE_S:
            run.note = "not started: global budget spent"
        elif isinstance(argv, str):
            run.status, run.note = "missing", argv
        else:
            say(f"{stage.name}: start (limit {limit:.0f} s)")
            try:
                code, output, seconds = run_stage(argv, limit, env)
            except OSError as exc:  # the program itself could not start
                code, output, seconds = 1, f"{type(exc).__name__}: {exc}", 0.0
            run.returncode, run.output, run.seconds = code, output, seconds
            run.data = _last_json(output)
            if code is None:
                run.status, run.note = "timeout", f"timed out after {limit:.0f} s"
            elif code == STAGE_MISSING or (run.data or {}).get("missing"):
                run.status, run.note = "missing", str((run.data or {}).get("missing", "missing"))
            elif code == STAGE_SKIPPED:  # this device cannot run it: one row saying why
                run.status = "skipped"
                run.note = f"skipped: {(run.data or {}).get('skipped', 'not for this device')}"
            elif code != 0:
                run.status = "failed"
                run.note = str((run.data or {}).get("error") or _last_line(output)
                               or f"exit {code}")
            else:
                run.status = "ok"
            log.write(f"\n===== {stage.name}: {run.status} in {seconds:.1f} s, exit {code}\n"
                      f"$ {' '.join(argv)}\n{output}\n")
            log.flush()
        ctx.runs[stage.name] = run
        stage_rows = _guarded(stage.name, lambda: stage.rows(ctx, run)
                              if run.status in ("ok", "failed") else _failed_rows(stage.name, run))
        rows.extend(stage_rows)
        say(f"{stage.name}: {run.status} in {run.seconds:.1f} s"
            + "".join(f"\n           {r.stage}: {r.figure} [{r.result}]" for r in stage_rows))
        if run.status not in ("ok", "skipped"):
            for line in run.output.strip().splitlines()[-12:]:
                print(f"           | {line[:200]}", flush=True)
    rows.extend(_guarded("ratios", lambda: ratio_rows(ctx)))
    return rows


def _guarded(name: str, make_rows: Callable[[], list[Row]]) -> list[Row]:
    """A stage's rows; output it did not expect (a changed JSON field) is one error row, not
    the end of the run."""
    try:
        return make_rows()
    except Exception as exc:
        return [Row(name, f"could not read its output: {type(exc).__name__}: {exc}"[:90],
                    "runs", "error")]


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1][:200] if lines else ""
