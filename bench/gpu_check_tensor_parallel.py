"""The GPU check's tensor_parallel stage (issue 44), run by `gpu_check.py --stage tensor_parallel`:
the bench model offline at t=1 and t=2, a bare all-reduce between two ranks, a KV transfer
from one device to the other. Needs two GPUs; the CPU twin runs it on device cpu over gloo.

One part after the other, on the devices the t=2 engine uses (cuda:0 and cuda:1):
1. t=1, then t=2 (CUDA graphs off at both, so the step times compare alike): greedy tokens
   with logprobs, then decode steps at a few batch sizes, timed; then t=2 with CUDA graphs
   (NCCL all-reduces inside them), its tokens against eager t=2's and its decode steps timed.
2. The runtime's own all-reduce (TensorParallelGroup: NCCL, on the CPU gloo) of [batch,
   hidden] between this process and a spawned peer, as the row-parallel layers call it.
3. bench/gpu_transfer.py with the receiver on the other device: torch_dist over NCCL.
A part that fails is reported in "error" and the others still run.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import statistics
import subprocess
import sys
import time

from bench.gpu_check_bodies import bench_prompts, body_model, engine_kwargs
from bench.gpu_check_plan import REPO, SIZES

# Two bf16 runs whose sums are split otherwise (t=2 adds two partial products) are compared
# as tests/test_gpu.py compares two of ours (its TOL_BF16): equal tokens with logprobs within
# this many nats, up to a first difference that is a near tie.
TOL_BF16 = 0.1
TIMEOUT_S = 30.0  # the all-reduce peer's rendezvous


def _devices(mode: str) -> list[str]:
    """The two ranks' devices, as the engine's tp_ranks.rank_device places them."""
    return ["cuda:0", "cuda:1"] if SIZES[mode]["device"] == "cuda" else ["cpu", "cpu"]


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def _say(message: str) -> None:
    print(f"[tensor_parallel] {message}", flush=True)


# ------------------------------------------------------------------------------ engines
def decode_step_ms(engine, prompts: list[list[int]], steps: int, tag: str) -> float:
    """Median milliseconds of the engine's steps that decoded the whole batch and ran no
    prompt token: `prompts` added at once, with enough new tokens that about `steps` such steps
    run (prompts finish prefill over several steps; the first finished decode meanwhile)."""
    from pd_runtime.api import SamplingParams

    batch = len(prompts)
    prefill_steps = -(-batch * len(prompts[0]) // engine.config.max_num_batched_tokens)
    params = SamplingParams(max_tokens=steps + prefill_steps + 1, temperature=0.0,
                            ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", prompt, params)
    times = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step()  # (returns sampled tokens: the device has finished the step)
        elapsed = time.perf_counter() - start
        if engine.last_step_prefill_tokens == 0 and engine.last_step_decode_tokens == batch:
            times.append(elapsed)
    if not times:
        raise RuntimeError(f"batch {batch}: no step decoded the whole batch")
    return 1e3 * statistics.median(times)


def run_engine(args, size: int, graphs: bool = False) -> tuple[list, dict[int, float]]:
    """Degree `size`: the greedy traces of the stage's prompts, decode step ms per batch."""
    import gc

    import torch

    from pd_runtime.api import SamplingParams
    from pd_runtime.engine.llm import LLM
    from tests.gpu_traces import ours_traces

    sizes = SIZES[args.mode]
    tp = sizes["tensor_parallel"]
    llm = LLM(args.model_dir, **engine_kwargs(
        sizes, tensor_parallel_size=size, cuda_graphs=graphs,
        max_num_seqs=max(tp["batches"] + [tp["num_prompts"]])))
    try:
        warm = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        llm.generate(bench_prompts(dict(sizes, num_prompts=2), seed=1), warm)
        prompts = bench_prompts(dict(sizes, num_prompts=tp["num_prompts"],
                                     prompt_len=tp["prompt_len"]), seed=0)
        greedy = SamplingParams(max_tokens=tp["output_len"], temperature=0.0, ignore_eos=True,
                                logprobs=5)
        traces = ours_traces(llm.generate(prompts, greedy))
        steps = {}
        for batch in tp["batches"]:
            batch_prompts = bench_prompts(dict(sizes, num_prompts=batch,
                                               prompt_len=tp["context"]), seed=100 + batch)
            steps[batch] = decode_step_ms(llm.engine, batch_prompts, tp["steps"],
                                          f"t{size}-b{batch}")
            _say(f"t={size}{' graphs' if graphs else ''} batch {batch}: "
                 f"{steps[batch]:.2f} ms a decode step")
        if graphs and not llm.engine.runner.graphs.replays:
            raise RuntimeError("cuda_graphs on, but no decode step replayed a graph")
    finally:
        llm.engine.close()  # the follower ranks stop; their GPU is free for the next part
    del llm
    gc.collect()
    if sizes["device"] == "cuda":
        torch.cuda.empty_cache()
    return traces, steps


def compare_tokens(t1: list, t2: list) -> dict:
    """How many prompts came out identical, the earliest divergence, and the problems
    tests/gpu_traces.compare_traces finds (none: identical or parting at near ties)."""
    from tests.gpu_traces import compare_traces

    firsts = []
    for i, (a, b) in enumerate(zip(t1, t2, strict=True)):
        first = next((t for t, (x, y) in enumerate(zip(a.tokens, b.tokens)) if x != y), None)
        if first is not None:
            firsts.append({"prompt": i, "token": first})
    return {"prompts": len(t1), "identical": len(t1) - len(firsts),
            "tokens_each": len(t1[0].tokens) if t1 else 0,
            "first_divergence": min(firsts, key=lambda f: f["token"]) if firsts else None,
            "problems": compare_traces(t1, t2, TOL_BF16, min_shared=0.5)}


# ---------------------------------------------------------------------- bare all-reduce
def _allreduce_loop(group, device: str, batches: list[int], hidden: int,
                    calls: int) -> dict[int, float]:
    """Mean seconds of one all-reduce of [batch, hidden] bf16 over `calls` in a row (NCCL's
    queue on the stream, as a forward pass issues them), after a few untimed ones."""
    import torch

    out = {}
    for batch in batches:
        x = torch.zeros(batch, hidden, dtype=torch.bfloat16, device=device)
        for _ in range(5):  # the first builds NCCL's communicator
            group.all_reduce(x)
        _sync(device)
        start = time.perf_counter()
        for _ in range(calls):
            group.all_reduce(x)
        _sync(device)
        out[batch] = (time.perf_counter() - start) / calls
    return out


def _allreduce_peer(port: int, device: str, batches: list[int], hidden: int, calls: int) -> None:
    import torch

    from pd_runtime.engine.tp_ranks import HOST
    from pd_runtime.model.parallel_comm import TensorParallelGroup

    if device.startswith("cuda"):
        torch.cuda.set_device(device)
    group = TensorParallelGroup(1, 2, HOST, port, torch.device(device), TIMEOUT_S)
    try:
        _allreduce_loop(group, device, batches, hidden, calls)
    finally:
        group.close()


def time_allreduce(args) -> dict:
    import torch

    from pd_runtime.engine.tp_ranks import HOST
    from pd_runtime.model.parallel_comm import TensorParallelGroup

    sizes = SIZES[args.mode]
    tp, hidden = sizes["tensor_parallel"], sizes["model"]["hidden_size"]
    devices = _devices(args.mode)
    store = TensorParallelGroup.create_store(HOST, 2, TIMEOUT_S)
    peer = mp.get_context("spawn").Process(target=_allreduce_peer, daemon=True, args=(
        store.port, devices[1], tp["allreduce_batches"], hidden, tp["allreduce_calls"]))
    peer.start()
    try:
        group = TensorParallelGroup(0, 2, HOST, store.port, torch.device(devices[0]),
                                    TIMEOUT_S, store=store)
        try:
            seconds = _allreduce_loop(group, devices[0], tp["allreduce_batches"], hidden,
                                      tp["allreduce_calls"])
        finally:
            group.close()
    finally:
        peer.join(TIMEOUT_S)
        if peer.is_alive():
            peer.kill()
            peer.join()
    return {"backend": "nccl" if devices[0].startswith("cuda") else "gloo", "hidden": hidden,
            "dtype": "bfloat16", "calls": tp["allreduce_calls"],
            "layers": sizes["model"]["num_hidden_layers"],
            "us": {str(b): 1e6 * s for b, s in seconds.items()}}


# ----------------------------------------------------------------------- KV transfer
def transfer_between_devices(args) -> dict:
    """bench/gpu_transfer.py (torch_dist) from the first device to the second: its JSON."""
    tp = SIZES[args.mode]["tensor_parallel"]
    devices = _devices(args.mode)
    deadline = tp["transfer_deadline_s"]
    argv = [sys.executable, str(REPO / "bench" / "gpu_transfer.py"), "--backend", "torch_dist",
            "--device", devices[0], "--peer-device", devices[1], *tp["transfer_args"],
            "--deadline-s", str(deadline)]
    # its progress (stderr) goes to the stage's log; its last stdout line is the JSON
    proc = subprocess.run(argv, cwd=REPO, stdout=subprocess.PIPE, text=True,
                          timeout=deadline + 40)
    lines = proc.stdout.strip().splitlines()
    if not lines or not lines[-1].startswith("{"):
        return {"error": f"gpu_transfer.py exit {proc.returncode}, no JSON line"}
    return json.loads(lines[-1])


# ----------------------------------------------------------------------------- the body
def body_tensor_parallel(args) -> dict:
    import torch

    if SIZES[args.mode]["device"] == "cuda" and torch.cuda.device_count() < 2:
        count = torch.cuda.device_count()
        return {"skipped": f"needs 2 GPUs, this device has {count}", "gpus": count}
    model = body_model(args)  # the bench model (written here when the model stage did not run)
    out: dict = {"devices": _devices(args.mode), "model_reused": model["reused"],
                 "gpus": torch.cuda.device_count() if torch.cuda.is_available() else 0}
    errors = []

    def part(name: str, work) -> None:
        start = time.perf_counter()
        try:
            work()
        except Exception as exc:  # reported; the next part still runs
            errors.append(f"{name}: {type(exc).__name__}: {exc}")
            _say(errors[-1])
        out.setdefault("seconds", {})[name] = time.perf_counter() - start

    runs: dict = {}  # degree (or "2g": t=2 with graphs) -> (traces, step ms)
    for size in (1, 2):
        part(f"engine t={size}", lambda size=size: runs.__setitem__(size, run_engine(args, size)))
    if SIZES[args.mode]["device"] == "cuda":
        part("engine t=2 graphs", lambda: runs.__setitem__("2g", run_engine(args, 2, True)))
    if 1 in runs and 2 in runs:
        out["tokens"] = compare_tokens(runs[1][0], runs[2][0])
        out["decode"] = [{"batch": b, "t1_ms": runs[1][1][b], "t2_ms": runs[2][1][b],
                          **({"t2_graphs_ms": runs["2g"][1][b]} if "2g" in runs else {})}
                         for b in runs[1][1]]
    if 2 in runs and "2g" in runs:  # the same kernels replayed: expected identical
        out["tokens_graphs_vs_eager_t2"] = compare_tokens(runs[2][0], runs["2g"][0])
    part("all-reduce", lambda: out.__setitem__("allreduce", time_allreduce(args)))
    part("transfer", lambda: out.__setitem__("transfer", transfer_between_devices(args)))
    if errors:
        out["error"] = "; ".join(errors)
    return out
