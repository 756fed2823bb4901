"""Tensor parallel on the CPU: decode step time and memory per rank, t=1 against t=2.
Both in one run on the same cores (t=1 with all of them, t=2 with cores // 2 threads a rank).

Two cores are not a tensor-parallel target: splitting a model over ranks pays when each rank
brings memory bandwidth or memory of its own (GPUs, sockets). Here both ranks share one memory
system and the same two cores, so this measures what the split costs (all-reduces, a plan sent
to the follower each step, replicated embedding and LM head), not what it would gain.

    .venv/bin/python bench/tensor_parallel.py [--model DIR] [--batch 1 8 32] [--context 512]
        [--steps 16] [--repeats 5] [--cores N] [--png docs/tensor_parallel_cpu.png]
        [--json FILE] [--quick]

Decode: `batch` requests of `context` random token ids (greedy, ignore_eos, prefix cache off)
are added to each engine and stepped until every prompt has run; then windows of `steps` timed
`engine.step()` calls, each decoding the whole batch and no prompt token, alternate between
t=1 and t=2 (`repeats` each; the median step of a window, the median of the windows). The
context grows by `steps` a window: from `context` to about `context + repeats * steps`, the
same at both t. Beside wall time, the CPU time every thread of the engine's processes ran in
those steps (/proc schedstat): at t=2 CPU near wall time means the two ranks mostly took turns
rather than computing together; OpenMP's spin-waits count too (others' jobs inflate them).
The driver's all-reduces inside those steps are timed by wrapping its group's `all_reduce`
(they include waiting for the follower); a bare gloo all-reduce of one step's hidden states
between two processes of one thread, times the calls a step makes, is the collective alone.
Memory: each t in a fresh process (so one engine's RSS is not another's): the tensors the
driver's model holds (plain weights, the packed copies the linears run from, rope tables), rank
1's part built by the same loader, the KV cache and decode side buffer, and VmRSS of the driver
and follower after a decode of the largest batch.
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
from bench.common import bench_model, machine_line, random_prompts  # noqa: E402
from bench.tensor_parallel_report import plot, report  # noqa: E402

HOST = "127.0.0.1"
BLOCK_SIZE = 16  # the engine's default block_size: the KV cache is sized in its blocks


def log(message: str) -> None:
    print(f"[tensor_parallel] {message}", file=sys.stderr, flush=True)


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def cpu_seconds(pids: list[int]) -> float:
    """Seconds the processes' threads have run: each process's CPU clock (Linux's per-process
    clock id, nanoseconds and current; /proc's schedstat of a running thread lags by up to a
    scheduler tick, and a few-millisecond step on a fast CPU then read 0)."""
    return sum(time.clock_gettime(((~pid) << 3) | 2) for pid in pids)


# ------------------------------------------------------------------------------- engines
def engine_args(args, size: int) -> dict:
    """The same engine at every t but for its degree and threads (the same cores in all)."""
    tokens = args.context + fill_steps(max(args.batch), args.context) + args.repeats * args.steps
    blocks_per_seq = -(-tokens // BLOCK_SIZE)
    return dict(tensor_parallel_size=size, num_threads=max(1, args.cores // size),
                dtype=args.dtype, enable_prefix_caching=False, max_num_seqs=max(args.batch),
                num_kv_blocks=max(args.batch) * blocks_per_seq + 16)


def make_llm(model: str, args, size: int):
    from pd_runtime import LLM, SamplingParams

    llm = LLM(model, **engine_args(args, size))
    llm.generate([[5, 6, 7, 8] * 8] * 2, SamplingParams(max_tokens=4, temperature=0.0,
                                                       ignore_eos=True))  # warm-up
    return llm


class CallTimer:
    """Wraps a bound method on its instance: seconds and calls since `reset`."""

    def __init__(self, owner, name: str):
        self.seconds, self.calls = 0.0, 0
        inner = getattr(owner, name)

        def timed(*a, **kw):
            start = time.perf_counter()
            try:
                return inner(*a, **kw)
            finally:
                self.seconds += time.perf_counter() - start
                self.calls += 1

        setattr(owner, name, timed)

    def reset(self) -> None:
        self.seconds, self.calls = 0.0, 0


def fill_steps(batch: int, context: int, max_num_batched_tokens: int = 2048) -> int:
    """At most the steps until every prompt of the batch ran: tokens the first prompts decode
    meanwhile (their decodes take part of each step's token budget, hence the margin)."""
    return 2 * -(-batch * context // max_num_batched_tokens) + 2


def start_batch(llm, prompts: list, decode_steps: int, threads: int, tag: str) -> None:
    """Add the batch and step until every request decodes (all prompts run); each can then
    decode `decode_steps` more tokens (`end_batch` aborts what is left)."""
    from pd_runtime import SamplingParams

    torch.set_num_threads(threads)  # the other engine's construction set the process's count
    engine = llm.engine
    tokens = decode_steps + fill_steps(len(prompts), len(prompts[0]),
                                       engine.config.max_num_batched_tokens)
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", prompt, params)
    engine.step()
    while engine.last_step_prefill_tokens or engine.last_step_decode_tokens != len(prompts):
        engine.step()


def end_batch(llm) -> None:
    for request_id in list(llm.engine.requests):
        llm.engine.abort(request_id)


def decode_window(llm, batch: int, steps: int, threads: int,
                  timer: CallTimer | None = None) -> dict:
    """`steps` decode steps of the whole batch, each timed (wall and the processes' CPU)."""
    torch.set_num_threads(threads)
    engine = llm.engine
    pids = [os.getpid(), *engine.rank_pids()]
    step_s, cpu_s, reduce_s, reduce_calls = [], [], [], []
    for _ in range(steps):
        if timer:
            timer.reset()
        cpu = cpu_seconds(pids)
        start = time.perf_counter()
        engine.step()
        step_s.append(time.perf_counter() - start)
        cpu_s.append(cpu_seconds(pids) - cpu)
        if engine.last_step_prefill_tokens or engine.last_step_decode_tokens != batch:
            raise RuntimeError(f"a step of the window ran {engine.last_step_prefill_tokens} "
                               f"prompt tokens, {engine.last_step_decode_tokens} decodes")
        if timer:
            reduce_s.append(timer.seconds)
            reduce_calls.append(timer.calls)
    return {"step_ms": 1e3 * statistics.median(step_s), "steps": len(step_s),
            "cpu_ms": 1e3 * statistics.median(cpu_s), "load": os.getloadavg()[0],
            "allreduce_ms": 1e3 * statistics.median(reduce_s) if reduce_s else None,
            "allreduces_per_step": statistics.median(reduce_calls) if reduce_calls else None}


def time_decode(model: str, args) -> list[dict]:
    """Both engines live in this process, each holding the same batch (the t=2 follower idles
    on its socket while t=1 runs); short windows of steps alternate between them, so a load
    that drifts hits both alike and both see the same contexts."""
    llms = {1: make_llm(model, args, 1), 2: make_llm(model, args, 2)}
    threads = {size: max(1, args.cores // size) for size in llms}
    timer = CallTimer(llms[2].engine.runner.tp, "all_reduce")
    rows = []
    try:
        for batch in args.batch:
            prompts = random_prompts(model, batch, args.context, seed=batch)
            for size, llm in llms.items():
                log(f"batch {batch}: prompts at t={size}")
                start_batch(llm, prompts, args.repeats * args.steps, threads[size],
                            f"t{size}-b{batch}")
            runs: dict[int, list[dict]] = {1: [], 2: []}
            for rep in range(args.repeats):
                for size in (1, 2) if rep % 2 == 0 else (2, 1):
                    run = decode_window(llms[size], batch, args.steps, threads[size],
                                        timer if size == 2 else None)
                    runs[size].append(run)
                    log(f"batch {batch} window {rep + 1}/{args.repeats} t={size}: "
                        f"{run['step_ms']:.2f} ms/step ({run['cpu_ms']:.2f} CPU ms), "
                        f"load {run['load']:.2f}")
            for llm in llms.values():
                end_batch(llm)
            rows.append({"batch": batch, "runs": runs,
                         "t1_step_ms": statistics.median(r["step_ms"] for r in runs[1]),
                         "t2_step_ms": statistics.median(r["step_ms"] for r in runs[2]),
                         "t1_cpu_ms": statistics.median(r["cpu_ms"] for r in runs[1]),
                         "t2_cpu_ms": statistics.median(r["cpu_ms"] for r in runs[2]),
                         "t2_allreduce_ms": statistics.median(r["allreduce_ms"] for r in runs[2]),
                         "allreduces_per_step": runs[2][0]["allreduces_per_step"]})
    finally:
        llms[2].engine.close()
    return rows


# -------------------------------------------------------------------- the bare collective
def allreduce_times(model: str, args, batches: list[int], calls: int) -> dict[int, float]:
    """Median seconds of one gloo all-reduce of `[batch, hidden]` between this process and a
    peer process, one thread each, as the t=2 ranks call it."""
    from pd_runtime.model.model_config import load_model_config
    from pd_runtime.model.parallel_comm import TensorParallelGroup

    hidden = load_model_config(model).hidden_size
    dtype = args.dtype_run  # the hidden states' dtype: the model's as it runs
    store = TensorParallelGroup.create_store(HOST, 2, timeout_s=60)
    spec = json.dumps({"port": store.port, "batches": batches, "hidden": hidden,
                       "calls": calls, "dtype": dtype})
    peer = subprocess.Popen([sys.executable, __file__, "--allreduce-peer", spec],
                            stdin=subprocess.DEVNULL)
    torch.set_num_threads(1)
    group = TensorParallelGroup(0, 2, HOST, store.port, torch.device("cpu"), 60, store=store)
    try:
        return _allreduce_loop(group, batches, hidden, calls, getattr(torch, dtype))
    finally:
        group.close()
        peer.wait(timeout=60)


def _allreduce_loop(group, batches, hidden, calls, dtype) -> dict[int, float]:
    out = {}
    for batch in batches:
        x = torch.randn(batch, hidden).to(dtype)
        times = []
        for i in range(calls + 10):
            start = time.perf_counter()
            group.all_reduce(x)
            if i >= 10:
                times.append(time.perf_counter() - start)
        out[batch] = statistics.median(times)
    return out


def allreduce_peer(spec: str) -> None:
    from pd_runtime.model.parallel_comm import TensorParallelGroup

    s = json.loads(spec)
    torch.set_num_threads(1)
    group = TensorParallelGroup(1, 2, HOST, s["port"], torch.device("cpu"), 60)
    _allreduce_loop(group, s["batches"], s["hidden"], s["calls"], getattr(torch, s["dtype"]))
    group.close()


# --------------------------------------------------------------------------------- memory
def held_bytes(model) -> dict[str, int]:
    """Bytes of the storages a LlamaModel holds, each counted once (a tied LM head is the
    embedding): `packed` the linears' run-time copies, `tables` rope, `weights` the rest."""
    seen: set = set()
    sizes = {"weights": 0, "packed": 0, "tables": 0}

    def visit(obj, kind: str) -> None:
        if isinstance(obj, torch.Tensor):
            if obj.is_mkldnn:  # oneDNN's packed bf16 (no storage to share): its elements
                key, nbytes = id(obj), obj.numel() * obj.element_size()
            else:
                storage = obj.untyped_storage()
                key, nbytes = storage.data_ptr(), storage.nbytes()
            if key not in seen:
                seen.add(key)
                sizes[kind] += nbytes
        elif isinstance(obj, dict):
            for value in obj.values():
                visit(value, kind)
        elif isinstance(obj, (list, tuple)):
            for value in obj:
                visit(value, kind)
        elif hasattr(obj, "__dict__") and type(obj).__module__.startswith("pd_runtime.kernels"):
            visit(vars(obj), kind)  # native.PackedLinear: its panels

    for name, value in vars(model).items():
        kind = "packed" if "packed" in name else \
            "tables" if name in ("cos", "sin", "local_rope") else "weights"
        if name != "cfg":
            visit(value, kind)
    return sizes


class _RankOnly:
    """What the loader reads of a group: a rank's place (no communication at load)."""

    def __init__(self, rank: int, size: int):
        self.rank, self.size = rank, size


def memory_probe(model: str, args, size: int) -> list[dict]:
    """Run in a fresh process (see `main`): one engine of degree `size`, a decode of the
    largest batch, then what each rank holds."""
    from pd_runtime.model.loader import load_model

    base_rss = rss_bytes(os.getpid())
    llm = make_llm(model, args, size)
    engine, runner = llm.engine, llm.engine.runner
    threads = max(1, args.cores // size)
    prompts = random_prompts(model, max(args.batch), args.context, seed=7)
    start_batch(llm, prompts, args.steps, threads, "mem")
    decode_window(llm, len(prompts), min(args.steps, 8), threads)
    buffer = runner.decode_buffer
    kv = {"kv_cache_bytes": runner.kv_cache.numel() * runner.kv_cache.element_size(),
          "kv_bytes_per_token": runner.kv_bytes_per_token,
          "decode_buffer_bytes": sum(t.numel() * t.element_size()
                                     for t in (*buffer.k, *buffer.v) if t is not None)}
    pids = [os.getpid(), *engine.rank_pids()]
    rss = [rss_bytes(pid) for pid in pids]  # before rank 1's part is built here
    ranks = [{"tp": size, "rank": 0, "pid": pids[0], "rss_bytes": rss[0],
              **held_bytes(runner.model), **kv}]
    for rank in range(1, size):  # the follower's tensors, as its loader builds them
        part = load_model(model, engine.config.dtype, "cpu", engine.max_model_len,
                          engine.config.batch_invariant, _RankOnly(rank, size))
        # Its cache has the driver's shape: the same blocks (agreed), the same heads a rank.
        ranks.append({"tp": size, "rank": rank, "pid": pids[rank], "rss_bytes": rss[rank],
                      **held_bytes(part), **kv})
        del part
    engine.close()
    return [{**r, "base_rss_bytes": base_rss} for r in ranks]


def run_memory_probe(model: str, args, size: int) -> list[dict]:
    cmd = [sys.executable, __file__, "--model", model, "--memory-probe", str(size),
           "--batch", *map(str, args.batch), "--context", str(args.context),
           "--steps", str(args.steps), "--repeats", str(args.repeats), "--cores", str(args.cores),
           "--dtype", args.dtype]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, timeout=1200)
    if proc.returncode != 0:
        raise RuntimeError(f"memory probe at t={size} failed (exit {proc.returncode})")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description="\n\n".join(__doc__.split("\n\n")[:2]),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: the embedded bench model")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32], help="decode batches")
    ap.add_argument("--context", type=int, default=512, help="prompt tokens per request")
    ap.add_argument("--steps", type=int, default=16,
                    help="whole-batch decode steps per window (median of a window)")
    ap.add_argument("--repeats", type=int, default=5,
                    help="windows per (batch, t), alternating t; the median of their medians")
    ap.add_argument("--cores", type=int, default=len(os.sched_getaffinity(0)),
                    help="threads at t=1; t=2 takes cores // 2 a rank (default: this "
                         "process's cores)")
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                    help="the engines' dtype (auto: float32 on a CPU without fast bf16)")
    ap.add_argument("--allreduce-calls", type=int, default=200,
                    help="timed bare all-reduces per batch")
    ap.add_argument("--png", default=str(Path(__file__).resolve().parent.parent / "docs"
                                         / "tensor_parallel_cpu.png"),
                    help="the figure (default: docs/tensor_parallel_cpu.png; '' for none)")
    ap.add_argument("--json", help="also write the result here")
    ap.add_argument("--quick", action="store_true",
                    help="batches 1 and 4, context 32, 2 windows of 4 steps (a smoke test)")
    ap.add_argument("--memory-probe", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--allreduce-peer", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.quick:
        args.batch, args.context, args.steps, args.repeats = [1, 4], 32, 4, 2
        args.allreduce_calls = 20
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.allreduce_peer:
        return allreduce_peer(args.allreduce_peer)
    model = bench_model(args.model)
    if args.memory_probe:
        print(json.dumps(memory_probe(model, args, args.memory_probe)))
        return
    from pd_runtime.model.loader import resolve_dtype
    from pd_runtime.model.model_config import load_model_config

    dtype_run = str(resolve_dtype(args.dtype, load_model_config(model), "cpu")).split(".")[-1]
    args.dtype_run, machine = dtype_run, machine_line()  # (the runs change the thread count)
    log(f"{machine}; load {os.getloadavg()[0]:.2f}; model {model}, {dtype_run}")
    memory = []
    for size in (1, 2):
        log(f"memory at t={size} (a fresh process)")
        memory += run_memory_probe(model, args, size)
    log("decode steps, t=1 and t=2 in this process")
    decode = time_decode(model, args)
    calls = int(decode[0]["allreduces_per_step"])
    log(f"bare gloo all-reduce, {calls} calls a step")
    bare = allreduce_times(model, args, args.batch, args.allreduce_calls)
    for row in decode:
        row["bare_allreduce_ms"] = 1e3 * bare[row["batch"]] * row["allreduces_per_step"]
    result = {"machine": machine, "load_average": os.getloadavg()[0],
              "config": {"model": model, "batch": args.batch, "context": args.context,
                         "steps": args.steps, "repeats": args.repeats, "cores": args.cores,
                         "dtype": args.dtype, "dtype_run": dtype_run},
              "decode": decode, "memory": memory}
    print(f"# {result['machine']}, load {result['load_average']:.2f}; two cores are not a "
          f"tensor-parallel target: the same {args.cores} cores at t=1 and t=2")
    print(f"# {model} ({dtype_run}); context {args.context} random tokens (+{args.steps} a "
          f"window), greedy; median of {args.repeats} windows of {args.steps} decode steps")
    report(result)
    if args.png:
        plot(result, args.png)
        log(f"wrote {args.png}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
