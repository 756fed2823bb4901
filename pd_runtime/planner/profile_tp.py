"""What `pd-runtime profile` records for planning tensor-parallel workers (pd_runtime/planner/
tensor_parallel.py): the model's shape, and the runtime's own all-reduce timed on this machine.

The all-reduce is model/parallel_comm.py's TensorParallelGroup, the one a worker's ranks use,
with each rank a thread of this process over loopback (the ranks of a worker share a node; on
the 2-core box two threads and two processes time alike, 0.7-0.8 ms for a small tensor).
Gloo on the CPU only: NCCL needs t GPUs, and a GPU deployment's figures are the plan's
--all-reduce-* flags (or a profile taken at t).
"""

from __future__ import annotations

import threading
import time

from pd_runtime.planner.costs import AllReduceCosts, ModelShape
from pd_runtime.planner.host import nnls


def model_shape(model_dir: str, dtype: str = "auto", device: str = "cpu") -> ModelShape:
    """From the model's config.json, with the engines' dtype and the degrees the model's own
    rule allows (up to engine.tensor_parallel_size's limit)."""
    from pd_runtime.config import EnginePoolSettings
    from pd_runtime.model.loader import resolve_dtype
    from pd_runtime.model.model_config import load_model_config
    from pd_runtime.model.tensor_parallel import unsupported_reason

    cfg = load_model_config(model_dir)
    limit = max(getattr(m, "le", 1) or 1
                for m in EnginePoolSettings.model_fields["tensor_parallel_size"].metadata)
    return ModelShape(num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads,
                      hidden_size=cfg.hidden_size,
                      activation_bytes=resolve_dtype(dtype, cfg, device).itemsize,
                      tensor_parallel_sizes=[t for t in range(1, limit + 1)
                                             if unsupported_reason(cfg, t) is None])


def time_all_reduce(ranks: int, token_bytes: int, max_tokens: int,
                    repeats: int = 10) -> AllReduceCosts:
    """The all-reduce of 1 to `max_tokens` tokens' hidden states (`token_bytes` each) over
    `ranks` ranks: the median of `repeats` calls at each size, fitted as latency + bytes / rate
    by least squares (both >= 0)."""
    import torch

    from pd_runtime.engine.tp_ranks import HOST
    from pd_runtime.model.parallel_comm import TensorParallelGroup

    if ranks < 2:
        raise ValueError(f"an all-reduce needs 2 or more ranks, not {ranks}")
    sizes = sorted({1, 16, min(128, max_tokens), min(512, max_tokens)})
    store = TensorParallelGroup.create_store(HOST, ranks, timeout_s=60.0)
    groups: list = [None] * ranks
    times: dict[int, list[float]] = {n: [] for n in sizes}
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        try:
            group = groups[r] = TensorParallelGroup(
                r, ranks, HOST, store.port, torch.device("cpu"), timeout_s=60.0,
                store=store if r == 0 else None)
            for n in sizes:
                x = torch.ones(n, -(-token_bytes // 4))  # float32: the bytes are what counts
                group.all_reduce(x)  # the first call of a size sets up its buffers
                for _ in range(repeats):
                    started = time.perf_counter()
                    group.all_reduce(x)
                    if r == 0:
                        times[n].append(time.perf_counter() - started)
        except BaseException as exc:  # reported by the caller, after every rank is joined
            errors.append(exc)

    threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in range(1, ranks)]
    for thread in threads:
        thread.start()
    rank(0)
    for thread in threads:
        thread.join(timeout=120.0)
    for group in groups:
        if group is not None:
            group.close()
    if errors or any(len(v) < repeats for v in times.values()):
        raise RuntimeError(f"timing the all-reduce over {ranks} ranks failed: "
                           f"{errors[0] if errors else 'a rank did not finish'}")
    medians = {n: sorted(v)[len(v) // 2] for n, v in times.items()}
    latency, per_byte = nnls([[1.0, n * token_bytes] for n in sizes],
                             [medians[n] for n in sizes])
    largest = max(sizes) * token_bytes
    # A rate too fast to show at these sizes: the largest one's bytes over its whole time
    # (a lower bound on the rate, so the cost is not understated).
    gbps = 1e-9 / per_byte if per_byte > 0 else largest / medians[max(sizes)] / 1e9
    return AllReduceCosts(latency_s=latency, gbps=gbps,
                          source=f"measured: gloo, {ranks} ranks on this machine's loopback, "
                                 f"{sizes[0]}-{sizes[-1]} tokens x {token_bytes} B")


def measure(ranks: list[int], model: ModelShape, device: str, max_tokens: int,
            note: dict) -> dict[int, AllReduceCosts]:
    """time_all_reduce at each number of ranks the caller asks for, where this machine can
    run it; what was not measured, and why, goes into `note` (the cost model's source)."""
    out = {}
    for t in sorted(set(ranks) - {0, 1}):
        if device != "cpu":
            note[f"all_reduce_{t}"] = f"not measured: {device} (NCCL) all-reduces are not " \
                                      "timed here; the plan's --all-reduce-* flags set them"
            continue
        try:
            out[t] = time_all_reduce(t, model.hidden_size * model.activation_bytes, max_tokens)
        except (RuntimeError, OSError) as exc:
            note[f"all_reduce_{t}"] = f"not measured: {exc}"
    return out
