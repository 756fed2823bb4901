"""Builds the worker pools on Ray from validated config: one placement group per pool, one
restartable actor per worker, all ready before the first request.

Topology is data: the ClusterConfig says how many workers of each role, with which resources,
engine settings and placement; this module only turns it into actors.
"""

from __future__ import annotations

import logging
import os
from typing import Optional

from pd_runtime.api import ModelCard
from pd_runtime.config import EngineConfig, KVTransferConfig, RecoveryConfig
from pd_runtime.workers.client import PoolClient, WorkerRef

log = logging.getLogger(__name__)


def worker_actor_class():
    import ray

    from pd_runtime.workers.worker import PDWorker

    return ray.remote(PDWorker)


def start_worker(role: str, worker_id: str, engine_config: EngineConfig,
                 kv_config: KVTransferConfig, *, num_cpus: float = 1, num_gpus: float = 0,
                 resources: Optional[dict] = None, memory: Optional[int] = None,
                 max_restarts: int = 3, recovery: Optional[RecoveryConfig] = None,
                 scheduling_strategy=None, namespace: Optional[str] = None,
                 placement_timeout_s: float = 120.0,
                 accelerator_type: Optional[str] = None) -> WorkerRef:
    """Create one worker actor (not yet waited for). The resources are one rank's: a worker of
    tensor_parallel_size t > 1 gets a STRICT_PACK placement group of its own with t such
    bundles (the custom resources and memory in the first only), its actor in bundle 0 and its
    other ranks' actors, which it starts, in the others (workers/tp_rank.py); the group's
    `scheduling_strategy` is then not used. Each rank computes on num_cpus threads unless
    engine.num_threads says otherwise."""
    ranks = engine_config.tensor_parallel_size
    options = dict(name=f"pd-{worker_id}", num_cpus=num_cpus, num_gpus=num_gpus,
                   resources=resources or {}, max_restarts=max_restarts,
                   # Requests are not retried by Ray: a lost stream is migrated by the client.
                   max_task_retries=0, max_concurrency=1000)
    if memory:
        options["memory"] = memory
    if namespace:
        options["namespace"] = namespace
    if accelerator_type:
        options["accelerator_type"] = accelerator_type
    rank_resources = None
    if ranks > 1:
        scheduling_strategy = _rank_group(worker_id, ranks, options, placement_timeout_s)
        rank_resources = {"num_cpus": num_cpus, "num_gpus": num_gpus}
        if accelerator_type:
            rank_resources["accelerator_type"] = accelerator_type
    if scheduling_strategy is not None:
        options["scheduling_strategy"] = scheduling_strategy
    if engine_config.num_threads is None:
        engine_config = engine_config.model_copy(
            update={"num_threads": max(1, int(num_cpus or 1))})
    handle = worker_actor_class().options(**options).remote(
        role, worker_id, engine_config.model_dump(), kv_config.model_dump(),
        (recovery or RecoveryConfig()).model_dump(), rank_resources)
    return WorkerRef(worker_id, role, handle)


def _rank_group(worker_id: str, ranks: int, options: dict, timeout_s: float):
    """A tensor-parallel worker's placement group, ready: `ranks` bundles on one node."""
    import ray
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    first = {"CPU": options["num_cpus"], "GPU": options["num_gpus"], **options["resources"]}
    if options.get("memory"):
        first["memory"] = options["memory"]
    rank = {"CPU": options["num_cpus"], "GPU": options["num_gpus"]}
    if options.get("accelerator_type"):  # how Ray spells the constraint in a bundle
        first[f"accelerator_type:{options['accelerator_type']}"] = 0.001
        rank = {**rank, f"accelerator_type:{options['accelerator_type']}": 0.001}
    bundles = [{k: v for k, v in b.items() if v} or {"CPU": 0.001} for b in
               [first] + [rank] * (ranks - 1)]
    pg = placement_group(bundles, strategy="STRICT_PACK", name=f"pd-{worker_id}-ranks")
    try:
        ray.get(pg.ready(), timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        ray.util.remove_placement_group(pg)
        raise RuntimeError(f"worker {worker_id}: no node fits its {ranks} tensor-parallel ranks "
                           f"({bundles}) within {timeout_s:g} s; a worker's ranks share one "
                           "node (STRICT_PACK)") from None
    return PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=0,
                                            placement_group_capture_child_tasks=False)


def wait_ready(workers: list[WorkerRef], timeout_s: float = 300.0) -> list[dict]:
    """Each worker's ready() report, once all answered; their model cards must agree."""
    import ray

    infos = ray.get([w.handle.ready.remote() for w in workers], timeout=timeout_s)
    for info in infos:
        log.info("worker %s ready (%s, pid %s, %d KV blocks)", info["worker_id"], info["role"],
                 info["pid"], info["num_blocks"])
    cards = [ModelCard.from_dict(info["model_card"]) for info in infos]
    for info, card in zip(infos[1:], cards[1:]):
        diff = cards[0].differs_from(card)
        if diff is not None:
            raise RuntimeError(f"workers {infos[0]['worker_id']} and {info['worker_id']} serve "
                               f"the model differently ({diff}); the pools must agree")
    return infos


def check_tensor_parallel(cfg) -> None:
    """Refuse tensor-parallel workers beside a prefill pool over the in-process transfer
    backend (`local`), naming the field: a worker's other ranks are processes of their own,
    which in-process links cannot reach (torch_dist and ucx link every rank pair)."""
    sharded = [role for role, pool in cfg.pools().items()
               if pool.num_workers and pool.engine.tensor_parallel_size > 1]
    if sharded and cfg.prefill.num_workers and cfg.kv_transfer.backend == "local":
        raise ValueError(f"{sharded[0]}.engine.tensor_parallel_size: "
                         f"{cfg.pools()[sharded[0]].engine.tensor_parallel_size} with a prefill "
                         "pool over kv_transfer.backend 'local' (in-process links cannot reach "
                         "a worker's other ranks): use torch_dist or ucx on Ray, or serve "
                         "colocated (prefill.num_workers: 0)")


def default_threads(cfg, role: str, pool, machine_cores: Optional[int] = None) -> Optional[int]:
    """A worker's torch threads when its engine.num_threads is null: None (start_worker then
    gives it its num_cpus), except a prefill worker on the CPU of a local cluster, which takes
    this machine's cores shared among the prefill pool's workers (at least its num_cpus).
    Prefill is compute-bound and comes in bursts; the decode workers' steps leave most of their
    cores idle at the loads their TPOT target allows, and a long prompt's prefill borrows them
    (measured on the 2-core box, bimodal 128/2048-token load: goodput at 90% within TTFT 2.5 s /
    TPOT 100 ms from 0.5 to 1.5-2.5 req/s, decode TPOT p99 19-67 ms; docs/BENCHMARKS.md). On a
    remote cluster the nodes' cores are not known here: num_cpus."""
    if role != "prefill" or pool.engine.num_threads is not None or cfg.ray.address \
            or pool.engine.device != "cpu" or pool.engine.tensor_parallel_size > 1:
        return None
    cores = machine_cores or len(os.sched_getaffinity(0))
    return max(1, int(pool.resources.num_cpus or 1), cores // max(1, pool.num_workers))


def default_step_interval(cfg, role: str, pool) -> Optional[float]:
    """A worker's engine.min_step_interval_s when it is null: 0.8 x the router's TPOT target for
    a decode worker on the CPU of a local cluster that has a prefill pool (while a prefill
    worker computes, its steps leave the cores that pool borrows what its streams do not need;
    the rest of the time they run back to back, so a stream's mean TPOT stays well under the
    target), else 0."""
    if pool.engine.min_step_interval_s is not None:
        return None
    shares_cores = role == "decode" and not cfg.ray.address and pool.engine.device == "cpu" \
        and cfg.prefill.num_workers > 0
    return cfg.router.routing.slo.tpot_s * 0.8 if shares_cores else 0.0


def check_local_fit(cfg, have: dict) -> None:
    """On a local Ray the cluster is this machine and will not grow: pools whose workers need
    more CPUs or GPUs than it has fail the start now, not after placement.ready_timeout_s.
    `have`: the cluster's resources (ray.cluster_resources())."""
    if cfg.ray.address:
        return
    want: dict[str, float] = {}
    for pool in cfg.pools().values():
        bundle = pool.resources.bundle()
        for name in ("CPU", "GPU"):
            want[name] = want.get(name, 0.0) + bundle.get(name, 0.0) * pool.num_workers \
                * pool.engine.tensor_parallel_size
    short = {name: amount for name, amount in want.items() if amount > have.get(name, 0.0) + 1e-9}
    if short:
        asks = ", ".join(f"{role}: {pool.num_workers} x {pool.resources.bundle()}"
                         + (f" x {pool.engine.tensor_parallel_size} ranks"
                            if pool.engine.tensor_parallel_size > 1 else "")
                         for role, pool in cfg.pools().items() if pool.num_workers)
        raise RuntimeError(
            f"the pools need {short} of this local Ray's "
            f"{ {n: have.get(n, 0.0) for n in short} } ({asks}): lower a pool's num_workers or "
            "resources.num_cpus / num_gpus, or give the local Ray more CPUs with ray.num_cpus "
            "(its GPUs are the machine's)")


def pool_engine(cfg, role: str, pool, model_dir: str) -> EngineConfig:
    """The engine settings a worker of `pool` runs: the pool's, with this machine's defaults
    for threads and step pacing filled in (`pool.num_workers`: the pool's size they share)."""
    engine = pool.engine_config(model_dir)
    threads = default_threads(cfg, role, pool)
    if threads is not None:
        engine = engine.model_copy(update={"num_threads": threads})
        log.info("%s workers: %d threads each (engine.num_threads null: this machine's "
                 "cores shared among them)", role, threads)
    interval = default_step_interval(cfg, role, pool)
    if interval is not None:
        engine = engine.model_copy(update={"min_step_interval_s": interval})
    return engine


def start_pool_worker(cfg, role: str, worker_id: str, engine: EngineConfig,
                      scheduling_strategy=None) -> WorkerRef:
    """One worker of a pool of `cfg`, with the pool's resources (not yet waited for)."""
    res = getattr(cfg, role).resources
    return start_worker(role, worker_id, engine, cfg.kv_transfer, num_cpus=res.num_cpus,
                        num_gpus=res.num_gpus, resources=res.custom, memory=res.memory_bytes,
                        max_restarts=cfg.recovery.max_restarts, recovery=cfg.recovery,
                        scheduling_strategy=scheduling_strategy, namespace=cfg.ray.namespace,
                        placement_timeout_s=cfg.placement_for(role).ready_timeout_s,
                        accelerator_type=res.accelerator_type)


def build_pools(cfg, model_dir: str, ready_timeout_s: float = 600.0) -> PoolClient:
    """Start every pool of a ClusterConfig and return a client over them."""
    import ray
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    check_tensor_parallel(cfg)
    check_local_fit(cfg, ray.cluster_resources())
    pools = {role: [] for role in cfg.pools()}
    for role, pool in cfg.pools().items():
        if pool.num_workers == 0:
            continue
        res = pool.resources
        placement = cfg.placement_for(role)
        strategy_for = [None] * pool.num_workers
        # (a tensor-parallel worker gets a placement group of its own: start_worker)
        if placement.enabled and pool.engine.tensor_parallel_size == 1:
            bundles = [res.bundle() for _ in range(pool.num_workers)]
            pg = placement_group(bundles, strategy=placement.strategy, name=f"pd-{role}")
            try:
                ray.get(pg.ready(), timeout=placement.ready_timeout_s)
            except ray.exceptions.GetTimeoutError:
                ray.util.remove_placement_group(pg)
                raise RuntimeError(
                    f"the {role} pool's {pool.num_workers} workers ({bundles[0]} each, "
                    f"{placement.strategy}) could not be placed within "
                    f"{placement.ready_timeout_s:g} s: the cluster has "
                    f"{ray.available_resources()} free (all: {ray.cluster_resources()}); "
                    f"lower {role}.resources or num_workers, or give a local Ray more with "
                    "ray.num_cpus") from None
            strategy_for = [PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i)
                            for i in range(pool.num_workers)]
        engine = pool_engine(cfg, role, pool, model_dir)
        for i in range(pool.num_workers):
            ref = start_pool_worker(cfg, role, f"{role}-{i}", engine, strategy_for[i])
            ref.placement = strategy_for[i]
            pools[role].append(ref)
    infos = wait_ready([w for ws in pools.values() for w in ws], ready_timeout_s)
    # Colocated-role workers serve whole requests exactly like decode workers.
    return PoolClient(pools["prefill"], pools["decode"] + pools["colocated"],
                      recovery_wait_s=cfg.recovery.decode_recovery_wait_s,
                      model_card=ModelCard.from_dict(infos[0]["model_card"]))
