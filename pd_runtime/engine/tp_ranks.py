"""The ranks of a tensor-parallel engine beyond the driver, as local processes: what the
offline `LLM(model, tensor_parallel_size=t)` starts (a Ray worker starts its ranks as actors
of one placement group instead, pd_runtime/workers/). Each runs `follow_plans`.

A follower is a fresh interpreter (`python -m pd_runtime.engine.tp_ranks`), not a fork and not
multiprocessing's spawn, which would import the user's script again. It stops when the
driver sends its stop or its plan channel closes (the driver's process ended).
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import weakref

import torch

from pd_runtime.config import EngineConfig
from pd_runtime.model.parallel_comm import TensorParallelError, TensorParallelGroup

log = logging.getLogger(__name__)

HOST = "127.0.0.1"  # a worker's ranks share a node (STRICT_PACK); the offline ranks a machine


def threads_per_rank(config: EngineConfig) -> int | None:
    """torch threads of each rank: `num_threads`, else on the CPU the cores this process may
    use shared out among the ranks (t ranks of all the cores each would oversubscribe them)."""
    if config.num_threads or config.tensor_parallel_size == 1 or config.device != "cpu":
        return config.num_threads
    return max(1, len(os.sched_getaffinity(0)) // config.tensor_parallel_size)


def rank_device(config: EngineConfig, rank: int) -> str:
    """A local rank's device: on CUDA one GPU a rank, from the configured one on (`cuda` or
    `cuda:0`: rank r takes cuda:r; `cuda:2`: cuda:2 + r); any other device as configured."""
    device = torch.device(config.device)
    if device.type != "cuda":
        return config.device
    return f"cuda:{(device.index or 0) + rank}"


class LocalRanks:
    """The driver's group, with ranks 1..t-1 started here as processes running `entry`'s
    main (this module's by default; a worker's adds its transfer agent)."""

    def __init__(self, config: EngineConfig, max_model_len: int, timeout_s: float = 120.0,
                 entry: str = __name__):
        size = config.tensor_parallel_size
        store = TensorParallelGroup.create_store(HOST, size, timeout_s)
        args = [json.dumps({"config": config.model_dump(mode="json"),
                            "max_model_len": max_model_len, "port": store.port,
                            "timeout_s": timeout_s})]
        self.processes = [subprocess.Popen([sys.executable, "-m", entry, str(rank), *args],
                                           stdin=subprocess.DEVNULL)
                          for rank in range(1, size)]
        self.group = None
        self._finalizer = weakref.finalize(self, _reap, self.processes, [])
        try:
            self.group = TensorParallelGroup(0, size, HOST, store.port,
                                             torch.device(rank_device(config, 0)), timeout_s,
                                             store=store)
        except Exception:
            self.close()
            raise
        self._finalizer.detach()
        self._finalizer = weakref.finalize(self, _reap, self.processes, [self.group])

    def check_alive(self) -> None:
        """Raise TensorParallelError when a rank's process has ended (a collective with it
        would fail, or on NCCL wait for the watchdog)."""
        for rank, process in enumerate(self.processes, start=1):
            if process.poll() is not None:
                raise TensorParallelError(f"tensor-parallel rank {rank} (pid {process.pid}) "
                                          f"ended with code {process.returncode}")

    def close(self) -> None:
        """Close the plan channel (a follower's stop) and wait for the followers to end,
        killing the stragglers; also at garbage collection and interpreter exit."""
        self._finalizer()


def start(config: EngineConfig, model_config, max_model_len: int,
          entry: str | None = None) -> "LocalRanks | None":
    """The follower ranks of an engine of `config` (None at one rank); a model that cannot
    split over them is refused (ModelLoadError naming why) before any starts."""
    from pd_runtime.api import ModelLoadError
    from pd_runtime.model.tensor_parallel import unsupported_reason

    reason = unsupported_reason(model_config, config.tensor_parallel_size)
    if reason is not None:
        raise ModelLoadError(f"{config.model}: tensor_parallel_size "
                             f"{config.tensor_parallel_size}: {reason}")
    if config.tensor_parallel_size == 1:
        return None
    return LocalRanks(config, max_model_len, entry=entry or __name__)


def _reap(processes: list[subprocess.Popen], groups: list) -> None:
    for group in groups:
        group.close()
    for process in processes:
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            log.warning("tensor-parallel rank process %d did not stop; killed", process.pid)
            process.kill()
            process.wait()


def join(argv: list[str]):
    """A follower rank's start, from its command line: join the group, load its part of the
    model; returns (group, runner), for `runner.follow()`."""
    from pd_runtime.engine.model_runner import ModelRunner

    rank, spec = int(argv[0]), json.loads(argv[1])
    logging.basicConfig(level=logging.WARNING,
                        format=f"tp rank {rank}: %(levelname)s %(name)s: %(message)s")
    config = EngineConfig(**spec["config"])
    config = config.model_copy(update={"device": rank_device(config, rank)})
    if config.device.startswith("cuda"):  # Triton and bare synchronize() use the current one
        torch.cuda.set_device(config.device)
    threads = threads_per_rank(config)
    if threads:
        torch.set_num_threads(threads)
    group = TensorParallelGroup(rank, config.tensor_parallel_size, HOST, spec["port"],
                                torch.device(config.device), spec["timeout_s"])
    return group, ModelRunner(config, spec["max_model_len"], group)


def main(argv: list[str]) -> None:
    group, runner = join(argv)
    runner.follow()
    group.close()


if __name__ == "__main__":
    main(sys.argv[1:])
