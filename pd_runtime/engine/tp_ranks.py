"""The ranks of a tensor-parallel engine beyond the driver. The driver (`Ranks`) opens the
group's rendezvous and plan channel; a launcher starts the followers, which each run
`join` and then their runner's `follow`. Two launchers: `LocalProcesses` here (what the offline
`LLM(model, tensor_parallel_size=t)` and an in-process server start) and a worker's Ray actors
in its placement group (pd_runtime/workers/tp_rank.py).

A local follower is a fresh interpreter (`python -m pd_runtime.engine.tp_ranks`), not a fork
and not multiprocessing's spawn, which would import the user's script again. Any follower stops
when the driver sends its stop or its plan channel closes (the driver's process ended).
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import weakref
from typing import Callable, Protocol

import torch

from pd_runtime.config import EngineConfig
from pd_runtime.model.parallel_comm import TensorParallelError, TensorParallelGroup

log = logging.getLogger(__name__)

HOST = "127.0.0.1"  # a worker's ranks share a node (STRICT_PACK); the offline ranks a machine


class Followers(Protocol):
    """Ranks 1..t-1 as a launcher started them."""

    pids: list[int]

    def check_alive(self) -> None:
        """Raise TensorParallelError when a follower has ended."""

    def wait(self) -> None:
        """After the driver's stop: wait for the followers to end, ending the stragglers."""


Launcher = Callable[[EngineConfig, dict], Followers]  # (config, join spec) -> followers


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


class LocalProcesses:
    """Followers as processes of this machine running module `entry`'s main."""

    def __init__(self, config: EngineConfig, spec: dict, entry: str = __name__):
        self.processes = [subprocess.Popen([sys.executable, "-m", entry, str(rank),
                                            json.dumps(spec)], stdin=subprocess.DEVNULL)
                          for rank in range(1, config.tensor_parallel_size)]
        self.pids = [p.pid for p in self.processes]

    def check_alive(self) -> None:
        for rank, process in enumerate(self.processes, start=1):
            if process.poll() is not None:
                raise TensorParallelError(f"tensor-parallel rank {rank} (pid {process.pid}) "
                                          f"ended with code {process.returncode}")

    def wait(self) -> None:
        for process in self.processes:
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                log.warning("tensor-parallel rank process %d did not stop; killed", process.pid)
                process.kill()
                process.wait()


def local_processes(entry: str = __name__) -> Launcher:
    return lambda config, spec: LocalProcesses(config, spec, entry)


class Ranks:
    """The driver's group: the rendezvous, the followers `launch` started, rank 0's membership."""

    def __init__(self, config: EngineConfig, max_model_len: int, launch: Launcher,
                 timeout_s: float = 120.0):
        size = config.tensor_parallel_size
        store = TensorParallelGroup.create_store(HOST, size, timeout_s)
        spec = {"config": config.model_dump(mode="json"), "max_model_len": max_model_len,
                "port": store.port, "timeout_s": timeout_s}
        self.followers = launch(config, spec)
        self.group = None
        self._finalizer = weakref.finalize(self, _reap, self.followers, [])
        try:
            self.group = self._join(size, store, torch.device(rank_device(config, 0)),
                                    timeout_s)
        except Exception:
            self.close()
            raise
        self._finalizer.detach()
        self._finalizer = weakref.finalize(self, _reap, self.followers, [self.group])

    def _join(self, size: int, store, device: torch.device,
              timeout_s: float) -> TensorParallelGroup:
        """Rank 0's membership, formed in a thread while this one watches the followers: one
        that ends before the group forms (a load error, a bad device) fails the start at once,
        not when the rendezvous times out."""
        done: dict = {}

        def form():
            try:
                done["group"] = TensorParallelGroup(0, size, HOST, store.port, device,
                                                    timeout_s, store=store)
            except BaseException as exc:  # (re-raised in the caller's thread)
                done["error"] = exc

        thread = threading.Thread(target=form, name="tp-rendezvous", daemon=True)
        thread.start()
        while thread.is_alive():
            thread.join(0.5)
            if thread.is_alive():
                try:
                    self.followers.check_alive()
                except TensorParallelError as exc:
                    raise TensorParallelError(f"before the group formed: {exc}") from None
        if "error" in done:
            raise done["error"]
        return done["group"]

    @property
    def pids(self) -> list[int]:
        return list(self.followers.pids)

    def check_alive(self) -> None:
        """Raise TensorParallelError when a follower has ended (a collective with it would
        fail, or on NCCL wait for the watchdog)."""
        self.followers.check_alive()

    def close(self) -> None:
        """Close the plan channel (a follower's stop) and wait for the followers to end,
        ending the stragglers; also at garbage collection and interpreter exit."""
        self._finalizer()


def start(config: EngineConfig, model_config, max_model_len: int,
          launch: Launcher | None = None) -> Ranks | None:
    """The follower ranks of an engine of `config` (None at one rank), started by `launch`
    (default: local processes); a model that cannot split over them is refused
    (ModelLoadError naming why) before any starts."""
    from pd_runtime.api import ModelLoadError
    from pd_runtime.model.tensor_parallel import unsupported_reason

    reason = unsupported_reason(model_config, config.tensor_parallel_size)
    if reason is not None:
        raise ModelLoadError(f"{config.model}: tensor_parallel_size "
                             f"{config.tensor_parallel_size}: {reason}")
    if config.tensor_parallel_size == 1:
        return None
    return Ranks(config, max_model_len, launch or local_processes())


def _reap(followers: Followers, groups: list) -> None:
    for group in groups:
        group.close()
    followers.wait()


def join(rank: int, spec: dict):
    """A follower rank's start: join the group, load its part of the model; returns
    (group, runner), for `runner.follow()`. `spec["device"]`, when given, is the rank's device
    (a Ray rank sees only its own GPU); else `rank_device`."""
    from pd_runtime.engine.model_runner import ModelRunner

    config = EngineConfig(**spec["config"])
    config = config.model_copy(update={"device": spec.get("device") or rank_device(config, rank)})
    if config.device.startswith("cuda"):  # Triton and bare synchronize() use the current one
        torch.cuda.set_device(config.device)
    threads = threads_per_rank(config)
    if threads:
        torch.set_num_threads(threads)
    group = TensorParallelGroup(rank, config.tensor_parallel_size, HOST, spec["port"],
                                torch.device(config.device), spec["timeout_s"])
    return group, ModelRunner(config, spec["max_model_len"], group)


def command_line(argv: list[str]) -> tuple[int, dict]:
    """A local follower's (rank, spec), with its log lines marked by rank."""
    rank = int(argv[0])
    logging.basicConfig(level=logging.WARNING,
                        format=f"tp rank {rank}: %(levelname)s %(name)s: %(message)s")
    return rank, json.loads(argv[1])


def main(argv: list[str]) -> None:
    group, runner = join(*command_line(argv))
    runner.follow()
    group.close()


if __name__ == "__main__":
    main(sys.argv[1:])
