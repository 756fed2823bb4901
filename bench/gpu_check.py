"""The prepared GPU check (issue 13): the Triton kernels against the reference and their
benchmark, the engine's offline throughput with and without CUDA graphs against HF `generate`,
a P->D transfer on the device, and the GPU tests; one summary table at the end.

    python bench/gpu_check.py [--out FILE] [--budget-s 450] [--only STAGE,...] [--cpu-twin]

Every stage runs in its own subprocess under its own time limit (and what is left of the global
budget); one that fails, times out or finds a dependency missing is reported and the next one
runs. This process imports no torch, so it holds no CUDA context. Progress goes to stdout, each
stage's whole output to gpu_check.log beside the summary JSON (`--out`, by default
$OUT/gpu_check.json when OUT is set).

`--cpu-twin` runs every stage at toy sizes on the CPU (kernels under TRITON_INTERPRET=1, the
engine on device cpu, the transfer with --device cpu): the plumbing, in about a minute; its
speed figures mean nothing and are reported without targets. Inside, `--stage NAME` runs one
stage's body (the engine, HF generate, the model writer, the environment report).

On the lent H200 (its image has torch, triton, transformers, xxhash, msgpack, safetensors but
no pydantic and no ucxx): here, once, `echo /.whl/ >> .git/info/exclude` and
`python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp
--platform manylinux_2_17_x86_64 -d .whl pydantic==2.14.4 pydantic_core==2.50.5
annotated_types==0.8.0 typing_inspection==0.4.5 typing_extensions==4.16.0`; then one device
call carrying `.whl`, timeout ~540 s: `python3 -m pip install -q --no-index --no-deps
--no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export
PYTHONPATH=/tmp/site || exit; PYTHONUNBUFFERED=1 python3 bench/gpu_check.py`. Without ucxx
the transfer stage reports itself missing (its wheels are CUDA 12 builds, ~54 MB).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

REPO = Path(__file__).resolve().parent.parent
HERE = Path(__file__).resolve()
STAGE_MISSING = 3  # a stage's exit code when what it runs is not there (yet)

# Sizes per mode. gpu: a ~0.9B Llama (head_dim 128, bf16) at batch 64; cpu twin: toys.
SIZES = {
    "gpu": dict(
        device="cuda", budget_s=450.0,
        model=dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=16,
                   num_attention_heads=16, num_key_value_heads=8, vocab_size=32000,
                   max_position_embeddings=4096),
        tokenizer_vocab=8000, num_prompts=64, prompt_len=512, output_len=256,
        max_num_batched_tokens=8192, kv_cache_gib=8.0,
        # expected on an H200: env 10, kernels 60, model 30, engines 40 each, hf 25,
        # transfer 30, tests 100 (Triton builds for ~50 kernel variants): ~350 of the 450
        stage_s=dict(env=30, kernels=110, model=75, engine_graphs=80, hf=60, engine_eager=70,
                     transfer=60, tests=150),
        kernels_args=[], transfer_args=[]),
    "cpu": dict(
        device="cpu", budget_s=240.0,
        model=dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                   num_attention_heads=2, num_key_value_heads=1, vocab_size=512,
                   max_position_embeddings=512),
        tokenizer_vocab=512, num_prompts=4, prompt_len=24, output_len=6,
        max_num_batched_tokens=256, kv_cache_gib=0.0625,
        stage_s=dict(env=30, kernels=90, model=40, engine_graphs=60, hf=60, engine_eager=60,
                     transfer=60, tests=90),
        kernels_args=["--batches", "2", "--contexts", "40", "--prompts", "24", "--chunk", "8:24",
                      "--check-lens", "1,40", "--check-segments", "20:0,9:24",
                      "--long-context", "40", "--long-batch", "1"],
        transfer_args=["--tokens", "64", "--iters", "3"]),
}
MIN_STAGE_S = 5.0  # less than this left of the global budget: the stage is not started


# ---------------------------------------------------------------------------------- report
@dataclass
class Row:
    """One line of the summary table. result: pass | FAIL | info (no target) | missing (a
    dependency not there) | error | timeout | skipped (not started)."""

    stage: str
    figure: str
    target: str
    result: str

    def as_dict(self) -> dict:
        return {"stage": self.stage, "figure": self.figure, "target": self.target,
                "result": self.result}


@dataclass
class StageRun:
    name: str
    status: str                 # ok | failed | missing | timeout | error | skipped
    seconds: float = 0.0
    returncode: Optional[int] = None
    data: Optional[dict] = None  # the stage's last JSON line
    output: str = ""
    note: str = ""


@dataclass
class Stage:
    name: str
    command: Callable[["Context"], list[str] | str]  # argv, or why it cannot run (missing)
    rows: Callable[["Context", StageRun], list[Row]]
    needs: tuple[str, ...] = ()


@dataclass
class Context:
    mode: str                      # gpu | cpu
    sizes: dict
    model_dir: str
    transfer_backend: str
    runs: dict[str, StageRun] = field(default_factory=dict)

    @property
    def twin(self) -> bool:
        return self.mode == "cpu"

    def verdict(self, ok: bool) -> str:
        """Performance targets apply on the GPU only: the twin's figures are plumbing."""
        return "info" if self.twin else ("pass" if ok else "FAIL")


def _self(ctx: Context, stage: str, *extra: str) -> list[str]:
    return [sys.executable, str(HERE), "--stage", stage,
            "--mode", ctx.mode, "--model-dir", ctx.model_dir, *extra]


def _failed_rows(name: str, run: StageRun) -> list[Row]:
    reason = run.note or f"exit {run.returncode}"
    return [Row(name, reason[:90], "runs", run.status if run.status != "failed" else "error")]


# ---------------------------------------------------------------------------------- stages
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
    return [sys.executable, "-m", "pytest", "tests/test_gpu.py", "-q", "-rs",
            "-p", "no:cacheprovider", f"--timeout={min(limit, 90)}"]


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
        rows.append(Row("device ceilings", f"copy {d['copy_gbs']:.0f} GB/s (r+w), read "
                        f"{d['read_gbs']:.0f} GB/s, bf16 matmul {d['matmul_tflops']:.0f} TFLOP/s",
                        "measured", "info"))
    long = s.get("decode_long")
    if long:
        best = long["best"]
        rows.append(Row(f"decode attn ({long['rule']})",
                        f"median {long['median_fraction']:.0%} of copy (min "
                        f"{long['min_fraction']:.0%}, {long['shapes']} shapes); best "
                        f"{best['gbs']:.0f} GB/s at B={best['batch']} ctx={best['context']}",
                        ">= 70% of copy", ctx.verdict(long["median_fraction"] >= 0.7)))
    elif "copy_gbs" in d:
        rows.append(Row("decode attn", "no long-context shape ran", ">= 70% of copy",
                        ctx.verdict(False)))
    for key in ("prefill_longest", "prefill_chunked"):
        p = s.get(key)
        if p:
            rows.append(Row(f"prefill attn, {p['case']}",
                            f"{p['tflops']:.1f} TFLOP/s = {p['fraction_of_matmul']:.0%} of matmul",
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
        return [Row(label, figure, "measured", "info")]
    return rows


def _transfer_command(ctx: Context) -> list[str] | str:
    script = REPO / "bench" / "gpu_transfer.py"
    if not script.exists():
        return "bench/gpu_transfer.py is not there"
    return [sys.executable, str(script), "--device", ctx.sizes["device"],
            "--backend", ctx.transfer_backend, *ctx.sizes["transfer_args"]]


def _transfer_rows(ctx: Context, run: StageRun) -> list[Row]:
    name = f"P->D transfer ({ctx.transfer_backend})"
    points = (run.data or {}).get("transfer")
    if not points:
        return _failed_rows(name, run)
    big = max(points, key=lambda p: p["bytes"])
    figure = (f"{big['gbs']:.1f} GB/s = {big['ratio']:.0%} of device copy "
              f"({big['copy_gbs']:.0f} GB/s) at {big['tokens']} tokens")
    if big.get("raw_gbs") is not None:
        figure += f"; bare link {big['raw_gbs']:.1f} GB/s"
    rows = [Row(name, figure, "reported", "info")]
    if (run.data or {}).get("error"):
        rows.append(Row(name, str(run.data["error"])[:90], "no error", "FAIL"))
    return rows


# The headline figures first (kernels, engine vs HF), the GPU tests last: a first GPU
# run that hangs in them then costs no figure, only the time left.
STAGES = [
    Stage("env", lambda ctx: _self(ctx, "env"), _env_rows),
    Stage("kernels", _kernels_command, _kernels_rows),
    Stage("model", lambda ctx: _self(ctx, "model"), _model_rows),
    Stage("engine_graphs", lambda ctx: _self(ctx, "engine", "--graphs", "on"),
          _engine_rows("engine, CUDA graphs on"), needs=("model",)),
    Stage("hf", lambda ctx: _self(ctx, "hf"), _engine_rows("HF generate"), needs=("model",)),
    Stage("engine_eager", lambda ctx: _self(ctx, "engine", "--graphs", "off"),
          _engine_rows("engine, CUDA graphs off"), needs=("model",)),
    Stage("transfer", _transfer_command, _transfer_rows),
    Stage("tests", _tests_command, _tests_rows),
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


# ---------------------------------------------------------------------------------- runner
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


def format_table(rows: list[Row]) -> str:
    widths = [max(len(getattr(r, f)) for r in rows + [Row("stage", "figure", "target", "result")])
              for f in ("stage", "figure", "target", "result")]
    widths = [min(w, cap) for w, cap in zip(widths, (44, 96, 40, 8))]
    lines = []
    for r in [Row("stage", "figure", "target", "result")] + rows:
        lines.append("  ".join(getattr(r, f)[:w].ljust(w) for f, w in
                               zip(("stage", "figure", "target", "result"), widths)).rstrip())
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


# ---------------------------------------------------------------------------------- stage bodies
# Run in the stage's own process (`--stage NAME`); each prints one JSON line last.
def body_env(args) -> dict:
    import importlib
    import platform

    out = {"python": platform.python_version()}
    for name in ("torch", "triton", "transformers"):
        try:
            out[name] = importlib.import_module(name).__version__
        except Exception as exc:  # reported in the table, not fatal here
            out[name] = f"none ({type(exc).__name__})"
    import torch

    out["cuda"] = torch.cuda.is_available()
    out["device"] = torch.cuda.get_device_name(0) if out["cuda"] else "cpu"
    if out["cuda"]:
        free, total = torch.cuda.mem_get_info()
        out["gpu_memory_gib"] = {"free": free / 2**30, "total": total / 2**30}
    imports = {}
    for name in ("pydantic", "xxhash", "msgpack", "safetensors", "tokenizers", "yaml",
                 "ucxx", "kernels.triton_paged", "pd_runtime.engine.llm"):
        try:
            importlib.import_module(name)
            imports[name] = True
        except Exception as exc:
            imports[name] = False
            print(f"import {name}: {type(exc).__name__}: {exc}")
    out["imports"] = imports
    out["gpu_transfer_script"] = (REPO / "bench" / "gpu_transfer.py").exists()
    return out


def _model_fields(sizes: dict) -> dict:
    return dict(sizes["model"], dtype="bfloat16", tokenizer_vocab_size=sizes["tokenizer_vocab"])


def body_model(args) -> dict:
    """The bench model at this mode's size, written once per directory (a rerun reuses it)."""
    from pd_runtime.model.tiny import make_tiny_model

    sizes = SIZES[args.mode]
    fields = _model_fields(sizes)
    path = Path(args.model_dir)
    stamp = path / "gpu_check_fields.json"
    start = time.perf_counter()
    reused = stamp.exists() and json.loads(stamp.read_text()) == fields \
        and (path / "model.safetensors").exists()
    if not reused:
        make_tiny_model(path, preset="bench", **fields)
        stamp.write_text(json.dumps(fields))
    m = sizes["model"]
    head_dim = m["hidden_size"] // m["num_attention_heads"]
    kv_dim = m["num_key_value_heads"] * head_dim
    per_layer = 2 * m["hidden_size"] ** 2 + 2 * m["hidden_size"] * kv_dim \
        + 3 * m["hidden_size"] * m["intermediate_size"] + 2 * m["hidden_size"]
    params = m["num_hidden_layers"] * per_layer + 2 * m["vocab_size"] * m["hidden_size"] \
        + m["hidden_size"]
    return {"params": params, "head_dim": head_dim, "seconds": time.perf_counter() - start,
            "reused": reused, "path": str(path)}


def bench_prompts(sizes: dict, seed: int) -> list[list[int]]:
    """Token-id prompts both engines get (ids below 5 are the special tokens)."""
    import random

    rng = random.Random(seed)
    return [[rng.randrange(5, sizes["tokenizer_vocab"]) for _ in range(sizes["prompt_len"])]
            for _ in range(sizes["num_prompts"])]


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def body_engine(args) -> dict:
    """Our engine over the batch: one warm-up pass of the same shape (kernel builds, the batch
    sizes a ramp-up goes through), then the timed generate, prefill included."""
    from pd_runtime.config import EngineConfig
    from pd_runtime.engine.llm import LLM
    from pd_runtime.api import SamplingParams

    sizes = SIZES[args.mode]
    device = sizes["device"]
    graphs = args.graphs == "on"
    kwargs = dict(device=device, dtype="bfloat16", batch_invariant=False,
                  max_num_seqs=sizes["num_prompts"],
                  max_num_batched_tokens=sizes["max_num_batched_tokens"],
                  kv_cache_memory_bytes=int(sizes["kv_cache_gib"] * 2**30),
                  enable_prefix_caching=False)
    if "cuda_graphs" in EngineConfig.model_fields:
        kwargs["cuda_graphs"] = graphs
    elif graphs and device == "cuda":
        return {"missing": "EngineConfig has no cuda_graphs field"}
    start = time.perf_counter()
    llm = LLM(args.model_dir, **kwargs)
    init_s = time.perf_counter() - start
    capture_s = getattr(llm.engine.runner, "graph_capture_s", None)
    warm = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    llm.generate(bench_prompts(sizes, seed=1), warm)
    _sync(device)
    prompts = bench_prompts(sizes, seed=0)
    params = SamplingParams(max_tokens=sizes["output_len"], temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    _sync(device)
    elapsed = time.perf_counter() - start
    produced = sum(len(o.token_ids) for o in outs)
    if produced != len(prompts) * sizes["output_len"]:
        return {"error": f"{produced} tokens produced, {len(prompts) * sizes['output_len']} "
                         f"expected"}
    return {"engine": f"pd-runtime (cuda_graphs {args.graphs})", "tokens_per_s": produced / elapsed,
            "output_tokens": produced, "elapsed_s": elapsed, "init_s": init_s,
            "graph_capture_s": capture_s, "cuda_graphs_field": "cuda_graphs" in kwargs,
            "first_tokens": outs[0].token_ids[:8]}


def left_padded(prompts: list[list[int]], pad_id: int):
    """input_ids and attention_mask of a batch, padded on the left (decoder-only generate)."""
    import torch

    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, p in enumerate(prompts):
        ids[row, width - len(p):] = torch.tensor(p)
        mask[row, width - len(p):] = 1
    return ids, mask


def body_hf(args) -> dict:
    """transformers' generate on the same model, batch and device: static batch, bf16, greedy,
    exactly output_len new tokens (min_new_tokens = max_new_tokens)."""
    import torch
    from transformers import AutoModelForCausalLM

    sizes = SIZES[args.mode]
    device = sizes["device"]
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.bfloat16)
    model = model.to(device).eval()
    pad = model.generation_config.pad_token_id
    n = sizes["output_len"]

    def generate(prompts, new_tokens):
        ids, mask = left_padded(prompts, pad)
        ids, mask = ids.to(device), mask.to(device)
        out = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, pad_token_id=pad)
        return out.shape[1] - ids.shape[1], out

    with torch.inference_mode():
        generate(bench_prompts(sizes, seed=1), 4)
        _sync(device)
        start = time.perf_counter()
        new, out = generate(bench_prompts(sizes, seed=0), n)
        _sync(device)
        elapsed = time.perf_counter() - start
    if new != n:
        return {"error": f"generate made {new} new tokens per row, {n} expected"}
    produced = new * out.shape[0]
    return {"engine": "transformers generate", "tokens_per_s": produced / elapsed,
            "output_tokens": produced, "elapsed_s": elapsed,
            "attn_implementation": getattr(model.config, "_attn_implementation", None),
            "first_tokens": out[0, -n:][:8].tolist()}


BODIES = {"env": body_env, "model": body_model, "engine": body_engine, "hf": body_hf}


# ---------------------------------------------------------------------------------- main
def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu-twin", action="store_true", help="every stage at toy sizes on CPU")
    ap.add_argument("--out", default=None,
                    help="summary JSON (default $OUT/gpu_check.json when OUT is set); the log "
                         "goes beside it as gpu_check.log")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="global time budget (default 450 on the GPU, 240 for the twin)")
    ap.add_argument("--only", default=None, help="comma-separated stages: "
                    + ",".join(s.name for s in STAGES))
    ap.add_argument("--stage-s", action="append", default=[], metavar="STAGE=SECONDS",
                    help="override one stage's time limit")
    ap.add_argument("--model-dir", default=None,
                    help="where the bench model is written (default: a folder under /tmp)")
    ap.add_argument("--transfer-backend", default="ucx", choices=["ucx", "torch_dist"])
    ap.add_argument("--stage", choices=sorted(BODIES), help=argparse.SUPPRESS)
    ap.add_argument("--mode", choices=sorted(SIZES), default="gpu", help=argparse.SUPPRESS)
    ap.add_argument("--graphs", choices=["on", "off"], default="on", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    mode = "cpu" if args.cpu_twin else args.mode
    if args.model_dir is None:
        args.model_dir = f"/tmp/pd-runtime-gpu-check-model-{mode}"

    if args.stage:  # one stage's body, in its own process
        args.mode = mode
        result = BODIES[args.stage](args)
        print(json.dumps(result), flush=True)
        return STAGE_MISSING if "missing" in result else (1 if "error" in result else 0)

    sizes = dict(SIZES[mode], stage_s=dict(SIZES[mode]["stage_s"]))
    for item in args.stage_s:
        name, _, seconds = item.partition("=")
        if name not in sizes["stage_s"]:
            ap.error(f"--stage-s: unknown stage {name!r}")
        sizes["stage_s"][name] = float(seconds)
    only = set(args.only.split(",")) if args.only else None
    if only and only - {s.name for s in STAGES}:
        ap.error(f"--only: unknown stages {sorted(only - {s.name for s in STAGES})}")
    out = Path(args.out) if args.out else (Path(os.environ["OUT"]) / "gpu_check.json"
                                           if os.environ.get("OUT") else None)
    log_path = out.with_name("gpu_check.log") if out else Path(os.devnull)
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
    budget = args.budget_s or sizes["budget_s"]
    ctx = Context(mode, sizes, args.model_dir, args.transfer_backend)
    started = time.time()
    print(f"# gpu_check ({'CPU twin' if ctx.twin else 'GPU'}), budget {budget:.0f} s, "
          f"{time.strftime('%Y-%m-%d %H:%M:%S')}", flush=True)
    with open(log_path, "w") as log:
        rows = run_all(ctx, [s for s in STAGES if not only or s.name in only], budget, log)
    elapsed = time.time() - started
    table = format_table(rows)
    print(f"\n{table}\n\n# {elapsed:.0f} s in all", flush=True)
    summary = {"date": time.strftime("%Y-%m-%d"), "mode": "cpu-twin" if ctx.twin else "gpu",
               "budget_s": budget, "elapsed_s": elapsed, "rows": [r.as_dict() for r in rows],
               "stages": {name: {"status": r.status, "seconds": r.seconds, "note": r.note,
                                 "data": r.data} for name, r in ctx.runs.items()},
               "table": table}
    if out:
        out.write_text(json.dumps(summary, indent=1, default=str) + "\n")
        print(f"# summary: {out}; log: {log_path}", flush=True)
    return 0 if all(r.result in ("pass", "info") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
