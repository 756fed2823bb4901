"""A follower rank of a tensor-parallel worker: the engine's follower (its part of the model and
of the KV cache, running the driver's plans) with a transfer agent over that cache, served to
the driver (kv_transfer/rank_rpc.py), so KV moves between this rank and the peers' ranks
directly.

On Ray a worker of degree t is t actors in one STRICT_PACK placement group of t bundles
(pd_runtime/workers/pool.py): the worker's actor is rank 0, in bundle 0, and starts ranks
1..t-1 as `TensorParallelRank` actors in bundles 1..t-1 (`ray_rank_actors`). They are owned by
the worker's actor, so they die with it, and its restart starts them anew: the group starts,
fails and restarts as one unit. Outside a Ray actor (an in-process server) the followers are
local processes running this module.
"""

from __future__ import annotations

import logging
import os
import sys
import time

from pd_runtime.config import EngineConfig, KVTransferConfig
from pd_runtime.engine import tp_ranks
from pd_runtime.kv_transfer.rank_rpc import RankAgentServer
from pd_runtime.kv_transfer.registry import create_agent
from pd_runtime.model.parallel_comm import TensorParallelError

log = logging.getLogger(__name__)

AGENT_PORT_KEY = "kvt/rank/{rank}"  # where a rank publishes its agent server's port


def serve_rank(rank: int, spec: dict) -> None:
    """Join the group, serve a transfer agent over this rank's cache, follow the driver's plans
    until it stops or is gone."""
    group, runner = tp_ranks.join(rank, spec)

    def make_agent(on_release, kv: dict, engine_id: str, model_id: str, extra: dict):
        return create_agent(KVTransferConfig(**kv), runner.kv_caches, engine_id=engine_id,
                            model_id=model_id, on_release=on_release, extra=extra)

    server = RankAgentServer(make_agent, tp_ranks.HOST)
    group.store.set(AGENT_PORT_KEY.format(rank=group.rank), str(server.port))
    runner.follow()
    group.close()


class TensorParallelRank:
    """A follower rank as a Ray actor (wrapped by `ray.remote` in `ray_rank_actors`)."""

    def pid(self) -> int:
        return os.getpid()

    def run(self, rank: int, spec: dict) -> None:
        logging.basicConfig(level=logging.WARNING,
                            format=f"tp rank {rank}: %(levelname)s %(name)s: %(message)s")
        serve_rank(rank, spec)


class RayRankActors:
    """Ranks 1..t-1 as actors in bundles 1..t-1 of the calling actor's placement group, each
    with one rank's CPUs and GPUs (`rank_resources`: num_cpus, num_gpus)."""

    RAY_CHECK_S = 0.5

    def __init__(self, config: EngineConfig, spec: dict, rank_resources: dict,
                 start_timeout_s: float = 300.0):
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        pg = ray.util.get_current_placement_group()
        size = config.tensor_parallel_size
        if pg is None or len(pg.bundle_specs) < size:
            raise TensorParallelError(
                f"a worker of tensor_parallel_size {size} runs in a placement group of {size} "
                "bundles, its ranks' (pd_runtime/workers/pool.py start_worker makes one)")
        if config.device.startswith("cuda"):  # each rank sees only its own GPU
            spec = {**spec, "device": "cuda"}
        actor = ray.remote(TensorParallelRank)
        self.actors = [actor.options(
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                pg, placement_group_bundle_index=rank),
            max_restarts=0, max_concurrency=2, **rank_resources).remote()
            for rank in range(1, size)]
        self.pids = ray.get([a.pid.remote() for a in self.actors], timeout=start_timeout_s)
        self.runs = [a.run.remote(rank, spec) for rank, a in enumerate(self.actors, start=1)]
        self._checked = time.monotonic()

    def check_alive(self) -> None:
        """Each step: the ranks' processes (they share this node) are alive, a read of /proc;
        every `RAY_CHECK_S` also Ray's word that their `run` has not ended (~0.1 ms a call)."""
        import ray

        for rank, pid in enumerate(self.pids, start=1):
            if not _process_alive(pid):
                raise TensorParallelError(f"tensor-parallel rank {rank} (pid {pid}, a Ray "
                                          "actor) is gone")
        now = time.monotonic()
        if now - self._checked < self.RAY_CHECK_S:
            return
        self._checked = now
        ended, _ = ray.wait(self.runs, num_returns=1, timeout=0)
        if ended:
            rank = self.runs.index(ended[0]) + 1
            try:
                ray.get(ended[0])
                why = "it returned"
            except Exception as exc:  # RayActorError: the actor's process is gone
                why = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            raise TensorParallelError(f"tensor-parallel rank {rank} (pid {self.pids[rank - 1]},"
                                      f" a Ray actor) ended: {why}")

    def wait(self) -> None:
        import ray

        _, pending = ray.wait(self.runs, num_returns=len(self.runs), timeout=10)
        if pending:
            log.warning("%d tensor-parallel rank actor(s) did not stop; killed", len(pending))
        for actor in self.actors:
            ray.kill(actor)


def _process_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")  # zombie, dead
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True


def launcher(rank_resources: dict | None) -> tp_ranks.Launcher:
    """How a worker starts its followers: Ray actors beside it when it is an actor placed in
    a group (`rank_resources` given), else local processes running this module."""
    if rank_resources is None:
        return tp_ranks.local_processes(__name__)
    return lambda config, spec: RayRankActors(config, spec, rank_resources)


def main(argv: list[str]) -> None:
    serve_rank(*tp_ranks.command_line(argv))


if __name__ == "__main__":
    main(sys.argv[1:])
