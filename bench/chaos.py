"""The chaos suite, long form: `pd-runtime serve` (one prefill, one decode worker, bench model,
bf16 by default) under open-loop load while workers are killed or stopped at seeded points,
clients disconnect in storms, a burst lands far over capacity and links fail; prints the table.

    unshare -n sh -c 'ip link set lo up; exec .venv/bin/python bench/chaos.py [--dtype bfloat16]
        [--rate 2] [--phase-s 30] [--fault-at-s 10] [--stop-s 5] [--long-stop-s 10]
        [--phases NAME ...] [--json OUT]'

Every request streams over HTTP and is classified against the offline engine's output for the
same request alone (tokens and text identical: correct; an OpenAI error: failed; anything else
different: wrong; no end within --hung-s: hung). Targets checked at the end: wrong == 0 and
hung == 0 everywhere, failed == 0 for each single worker kill or stop, and p99 TTFT during the
--long-stop-s prefill stop under 3x the fault-free p99 TTFT.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.common import bench_model, machine_line  # noqa: E402
from tests.chaos_support import faults, plans, report  # noqa: E402
from tests.chaos_support.product import ServedProduct, chaos_config, free_port  # noqa: E402
from tests.chaos_support.runner import RunSettings, run_phase, wait_quiescent  # noqa: E402
from tests.chaos_support.workload import (  # noqa: E402
    Shapes, SpecFactory, ambiguous_token_strings, references, vocab_size)

WORKER_FAULTS = [(action, role, point) for action in ("kill", "stop")
                 for role in ("prefill", "decode") for point in plans.POINTS]
LINK_FAULTS = {"drop": 0.2, "delay_s": 0.2, "corrupt": 0.2, "duplicate": 0.2}
TTFT_RATIO_TARGET = 3.0


def build_plans(args, vocab: int) -> list[plans.PhasePlan]:
    rng = random.Random(args.seed)
    shapes = Shapes(short_tokens=tuple(args.short_len), long_tokens=tuple(args.long_len),
                    max_tokens=tuple(args.output_len))
    factory = SpecFactory(vocab, args.seed, shapes)

    def load(name: str) -> list[plans.Arrival]:
        return plans.open_loop(factory, name, args.rate, args.phase_s, rng)

    out = [plans.PhasePlan("fault-free", load("fault-free")),
           plans.timed_fault(factory, "stop", "prefill", args.fault_at_s,
                             load(f"stop-prefill-{args.long_stop_s:g}s"),
                             stop_s=args.long_stop_s)]
    for action, role, point in WORKER_FAULTS:
        name = f"{action}-{role}-{point}"
        out.append(plans.worker_fault(factory, rng, action, role, point, load(name),
                                      at_s=args.fault_at_s, window_s=3.0, stop_s=args.stop_s,
                                      delay_kv_send_s=args.delay_kv_send_s, num_probes=0))
    out.append(plans.disconnect_storm(factory, rng, args.storm, max_tokens=256))
    out.append(plans.burst(factory, rng, args.burst))
    out.extend(plans.link_fault(factory, rng, kind, value, args.link_requests)
               for kind, value in LINK_FAULTS.items())
    if args.phases:
        out = [p for p in out if p.name in args.phases or p.name == "fault-free"]
    return out


def deployment_overrides(args) -> dict:
    """What the run changes in chaos_config's deployment (one prefill and one decode worker,
    routing by prompt length, a thread each)."""
    engine = {"max_waiting_requests": args.max_waiting_requests,
              "num_threads": None if args.engine_threads == "default"
              else int(args.engine_threads)}
    routing = {"mode": args.routing_mode}
    if args.routing_mode == "slo":
        routing["slo"] = {"ttft_s": args.slo_ttft_s, "tpot_s": args.slo_tpot_s}
    # Ray's logical CPUs: one per worker at least (two decode workers and a prefill worker on a
    # 2-core box would otherwise never be placed).
    cpus = max(os.cpu_count() or 1, 1 + args.decode_workers)
    return {"prefill": {"engine": engine},
            "decode": {"engine": dict(engine), "num_workers": args.decode_workers},
            "recovery": {"max_restarts": -1}, "router": {"routing": routing},
            "ray": {"num_cpus": cpus}}


def refusals(phase) -> dict[str, tuple[int, int]]:
    """Prompt class -> (refused with 429, sent)."""
    out: dict[str, tuple[int, int]] = {}
    for r in phase.results:
        refused, sent = out.get(r.spec.kind, (0, 0))
        out[r.spec.kind] = (refused + (r.status == 429), sent + 1)
    return out


def refusal_line(phase) -> str:
    return f"{phase.plan.name}: refused " + ", ".join(
        f"{kind} {n} of {sent} ({n / sent:.0%})"
        for kind, (n, sent) in sorted(refusals(phase).items()))


def targets(phases, ttft_free) -> list[str]:
    """One line per target: met or missed, with the figures."""
    lines = []
    for p in phases:
        c = p.counts
        bad = {k: c[k] for k in ("wrong", "hung", "unclear") if c[k]}
        single = p.plan.fault.action in ("kill", "stop")
        if single and c["failed"]:
            bad["failed"] = c["failed"]
        if not p.quiescent:
            bad["blocks not back"] = p.quiesce_detail
        lines.append(f"{'MISSED' if bad else 'met'}: {p.plan.name}" +
                     (f" {bad}" if bad else ""))
        if p.plan.fault.point == "at_time" and p.plan.fault.action == "stop":
            during = p.ttft_p99(during_fault=True)
            if during is None or ttft_free is None:
                lines.append(f"MISSED: {p.plan.name} p99 TTFT ratio: no TTFT measured")
            else:
                ratio = during / ttft_free
                lines.append(f"{'met' if ratio < TTFT_RATIO_TARGET else 'MISSED'}: "
                             f"{p.plan.name} p99 TTFT during the stop {during:.2f}s = "
                             f"{ratio:.2f}x fault-free {ttft_free:.2f}s "
                             f"(target < {TTFT_RATIO_TARGET:g}x)")
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="default: the bench model")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--rate", type=float, default=2.0, help="open-loop requests per second")
    ap.add_argument("--phase-s", type=float, default=30.0, help="open-loop load per phase")
    ap.add_argument("--fault-at-s", type=float, default=10.0)
    ap.add_argument("--stop-s", type=float, default=5.0, help="SIGSTOP length in the matrix")
    ap.add_argument("--long-stop-s", type=float, default=10.0,
                    help="the prefill stop whose p99 TTFT is held to 3x fault-free")
    ap.add_argument("--delay-kv-send-s", type=float, default=2.0)
    ap.add_argument("--short-len", type=int, nargs=2, default=[32, 256])
    ap.add_argument("--long-len", type=int, nargs=2, default=[640, 1280])
    ap.add_argument("--output-len", type=int, nargs=2, default=[16, 48])
    ap.add_argument("--max-local-prefill-tokens", type=int, default=512)
    ap.add_argument("--max-waiting-requests", type=int, default=32,
                    help="per worker: the capacity the burst goes far over")
    ap.add_argument("--storm", type=int, default=48, help="clients in the disconnect storm")
    ap.add_argument("--burst", type=int, default=192, help="requests in the burst")
    ap.add_argument("--link-requests", type=int, default=16)
    ap.add_argument("--hung-s", type=float, default=180.0)
    ap.add_argument("--reference", choices=["alone", "batch"], default="alone",
                    help="offline reference: each request alone (any dtype) or one batch")
    ap.add_argument("--check-alone", type=int, default=24,
                    help="with --reference batch: recompute this many at random alone and "
                         "report any that differ (batch invariance of the reference itself)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads of the offline reference (two lose on a busy box)")
    ap.add_argument("--phases", nargs="*", help="run only these (fault-free always runs)")
    ap.add_argument("--routing-mode", choices=["auto", "slo"], default="auto",
                    help="auto: by prompt length (the chaos default); slo: the product's "
                    "default, by predicted TTFT/TPOT against --slo-ttft-s/--slo-tpot-s")
    ap.add_argument("--slo-ttft-s", type=float, default=2.5)
    ap.add_argument("--slo-tpot-s", type=float, default=0.1)
    ap.add_argument("--decode-workers", type=int, default=1)
    ap.add_argument("--engine-threads", default="1",
                    help="each worker's engine.num_threads; 'default': the product's (null)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="write every request's record here")
    args = ap.parse_args()

    model = bench_model(args.model)
    phase_plans = build_plans(args, vocab_size(model))
    unsupported = faults.link_faults_unsupported()
    if unsupported:
        print(f"# link phases skipped: {unsupported}", file=sys.stderr)
        phase_plans = [p for p in phase_plans if p.fault.action != "link"]
    specs = [s for p in phase_plans for s in p.specs()]
    import torch

    torch.set_num_threads(args.threads)
    start = time.monotonic()
    refs = references(model, args.dtype, specs, alone=args.reference == "alone")
    print(f"# {len(specs)} references ({args.reference}) in {time.monotonic() - start:.0f}s",
          file=sys.stderr)
    if args.reference == "batch" and args.check_alone:
        sample = random.Random(args.seed).sample(specs, min(args.check_alone, len(specs)))
        alone = references(model, args.dtype, sample, alone=True)
        differ = [s.label for s in sample if alone[s.label] != refs[s.label]]
        tokens = [lbl for lbl in differ if (alone[lbl].token_ids, alone[lbl].text)
                  != (refs[lbl].token_ids, refs[lbl].text)]
        logprobs_only = sorted(set(differ) - set(tokens))
        print(f"# reference check: {len(sample) - len(differ)} of {len(sample)} requests alone "
              f"equal their batched reference (tokens, text, logprobs); tokens or text differ "
              f"for {tokens or 'none'}"
              + (f", logprobs only for {logprobs_only}" if logprobs_only else ""))
    ambiguous = ambiguous_token_strings(model)
    settings = RunSettings(hung_bound_s=args.hung_s, back_timeout_s=180.0,
                           quiesce_timeout_s=120.0, trigger_timeout_s=args.phase_s + 60)
    config = chaos_config(model, free_port(), args.dtype, None, args.max_local_prefill_tokens,
                          deployment_overrides(args))
    product = ServedProduct(config, Path(tempfile.mkdtemp(prefix="pd-chaos-")))
    done = []
    try:
        product.start()
        for plan in phase_plans:
            ok, detail = wait_quiescent(product, settings.quiesce_timeout_s)
            if not ok:
                print(f"# {plan.name}: not at baseline before the phase: {detail}",
                      file=sys.stderr)
            phase = asyncio.run(run_phase(product, plan, refs, ambiguous, settings))
            done.append(phase)
            print(report.row(phase), file=sys.stderr, flush=True)
    finally:
        left = product.stop()
    free = next((p for p in done if p.plan.name == "fault-free"), None)
    print(f"# {machine_line()}; model {model}, {args.dtype}; open loop {args.rate}/s for "
          f"{args.phase_s:g}s per phase, half long ({args.long_len[0]}-{args.long_len[1]} "
          f"tokens), half short ({args.short_len[0]}-{args.short_len[1]}), "
          f"{args.output_len[0]}-{args.output_len[1]} out; faults at {args.fault_at_s:g}s; "
          f"seed {args.seed}")
    print(report.table(done))
    print(report.details(done))
    for line in targets(done, free.ttft_p99() if free else None):
        print(line)
    for phase in done:
        print(refusal_line(phase))
    print(f"processes left after stop: {len(left)}; serve log {product.log_path}")
    if args.json:
        Path(args.json).write_text(json.dumps([{
            "phase": p.plan.name, "fault": p.plan.fault.describe(),
            "recovery_s": p.recovery_s, "notes": p.notes,
            "requests": [{"label": r.spec.label, "kind": r.spec.kind, "id": r.response_id,
                          "class": r.label_class, "detail": r.detail, "ttft_s": r.ttft_s,
                          "status": r.status} for r in p.results]} for p in done], indent=1))
    return 1 if left else 0


if __name__ == "__main__":
    sys.exit(main())
