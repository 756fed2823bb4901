"""The prepared GPU check (issue 13): the Triton kernels against the reference and their
benchmark, the engine's offline throughput with and without CUDA graphs against HF `generate`,
P->D transfers on the device (torch_dist: CUDA IPC on one GPU; then UCX), the GPU tests, and
tensor parallel (issue 44: t=2 against t=1 on two GPUs: greedy tokens, decode step times, the
NCCL all-reduce, a torch_dist transfer GPU to GPU over NCCL; on one GPU one row "skipped: needs
2 GPUs, this device has 1", which does not fail the run); one summary table at the end.

    python bench/gpu_check.py [--out FILE] [--budget-s 480] [--only STAGE,...] [--cpu-twin]

Every stage runs in its own subprocess under its own time limit (and what is left of the global
budget); one that fails, times out or finds a dependency missing is reported and the next one
runs. This process imports no torch, so it holds no CUDA context. Progress goes to stdout, each
stage's whole output to gpu_check.log beside the summary JSON (`--out`, by default
$OUT/gpu_check.json when OUT is set).

`--cpu-twin` runs every stage at toy sizes on the CPU (kernels under TRITON_INTERPRET=1, the
engine on device cpu, the transfer with --device cpu, tensor parallel at t=2 on cpu over
gloo): the plumbing, in about a minute and a half; its speed figures mean nothing and are
reported without targets. Inside, `--stage NAME` runs one stage's body (the engine, HF
generate, the model writer, the environment report, tensor parallel).

On the lent H200 (its image has torch, triton, transformers, numpy, xxhash, msgpack,
safetensors but no pydantic and no ucxx): here, once, `bash bench/gpu_deps.sh` (fills the
git-ignored .whl/ with pydantic's wheels and ucxx-cu12 installed for CPython 3.12 and packed,
~23 MB); then one device call carrying `.whl`, timeout ~540 s: `python3 -m pip install -q
--no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && tar
-xJf .whl/ucxx-site-cp312.tar.xz -C /tmp/site && export PYTHONPATH=/tmp/site || exit;
PYTHONUNBUFFERED=1 python3 bench/gpu_check.py`. Without ucxx (the `tar` step left out of that
call) the transfer_ucx stage reports it missing and the others run. tensor_parallel runs last:
on one GPU it skips in seconds; on a device with two, give the call `--budget-s 570` (timeout
600): the other stages take ~440 s and it ~100 (run alone on a fresh machine, where it builds
the Triton kernels itself: `--only model,tensor_parallel --stage-s tensor_parallel=180`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# The parts: gpu_check_plan (sizes, rows, the table), gpu_check_stages (what each stage runs
# and reports), gpu_check_runner (running them), gpu_check_bodies and
# gpu_check_tensor_parallel (the `--stage` bodies).
from bench.gpu_check_bodies import body_engine, body_env, body_hf, body_model  # noqa: E402
from bench.gpu_check_tensor_parallel import body_tensor_parallel  # noqa: E402
from bench.gpu_check_plan import (SIZES, STAGE_MISSING, STAGE_SKIPPED, Context,  # noqa: E402
                                  format_table, run_passed)
from bench.gpu_check_runner import run_all  # noqa: E402
from bench.gpu_check_stages import STAGES  # noqa: E402

# tests/test_gpu_check_script.py reaches these through this module.
from bench.gpu_check_plan import (MIN_STAGE_S, Row, Stage, StageRun,  # noqa: E402,F401
                                  _failed_rows)
from bench.gpu_check_stages import _tests_rows, ratio_rows  # noqa: E402,F401

BODIES = {"env": body_env, "model": body_model, "engine": body_engine, "hf": body_hf,
          "tensor_parallel": body_tensor_parallel}


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu-twin", action="store_true", help="every stage at toy sizes on CPU")
    ap.add_argument("--out", default=None,
                    help="summary JSON (default $OUT/gpu_check.json when OUT is set); the log "
                         "goes beside it as gpu_check.log")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="global time budget (default 480 on the GPU, 240 for the twin)")
    ap.add_argument("--only", default=None, help="comma-separated stages: "
                    + ",".join(s.name for s in STAGES))
    ap.add_argument("--stage-s", action="append", default=[], metavar="STAGE=SECONDS",
                    help="override one stage's time limit")
    ap.add_argument("--model-dir", default=None,
                    help="where the bench model is written (default: a folder under /tmp)")
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
        return STAGE_MISSING if "missing" in result else STAGE_SKIPPED if "skipped" in result \
            else 1 if "error" in result else 0

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
    ctx = Context(mode, sizes, args.model_dir)
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
    return 0 if run_passed(rows, ctx.runs) else 1


if __name__ == "__main__":
    sys.exit(main())
