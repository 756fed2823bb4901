"""The Ray side of router replicas (pd_runtime/entrypoints/openai/replicas.py): replicas 1..N-1 as
Ray actors on the serving node, each a router over the same worker actors, serving the shared port.
"""

from __future__ import annotations

import logging
import os
from typing import Optional

from pd_runtime.config import ClusterConfig

log = logging.getLogger(__name__)


class RouterReplica:
    """One more router (a Ray actor): the same app over the same workers, on the shared port."""

    def __init__(self, cfg_json: str, model_dir: str, config_path: Optional[str], workers: list,
                 model_card: dict, index: int, host: str, port: int,
                 log_level: str = "warning"):
        from pd_runtime.api import ModelCard
        from pd_runtime.workers.client import PoolClient, WorkerRef
        from pd_runtime.entrypoints.openai.replicas import build_router
        from pd_runtime.entrypoints.openai.server import BackgroundServer
        from pd_runtime.gateway.recorder import owner_name

        logging.basicConfig(level=logging.INFO)
        cfg = ClusterConfig.model_validate_json(cfg_json)
        refs = [WorkerRef(worker_id, role, handle) for worker_id, role, handle in workers]
        client = PoolClient([r for r in refs if r.role == "prefill"],
                            [r for r in refs if r.role != "prefill"],
                            recovery_wait_s=cfg.recovery.decode_recovery_wait_s,
                            model_card=ModelCard.from_dict(model_card))
        self.index = index
        self.backend, app = build_router(client, cfg, model_dir, config_path,
                                         owner_name(host, port, index))
        self.server = BackgroundServer(app, host, port, log_level=log_level,
                                       reuse_port=True).start()

    def ready(self) -> int:
        return self.index

    def stop(self) -> None:
        self.server.stop()
        self.backend.stop()


def start_replicas(client, cfg: ClusterConfig, model_dir: str, config_path: Optional[str],
                   host: str, port: int, log_level: str = "warning") -> list:
    """Replicas 1..N-1 as Ray actors on this node, each serving `port` once this returns."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    # The actors' working directory is not ours: paths they read must be absolute.
    model_dir = os.path.abspath(model_dir)
    config_path = os.path.abspath(config_path) if config_path else None
    count = cfg.router.replicas
    if count == 1:
        return []
    template = cfg.router.chat_template_path()
    if template is not None:
        cfg = cfg.model_copy(update={"router": cfg.router.model_copy(update={
            "chat_template": str(template.resolve())})})
    workers = [(w.worker_id, w.role, w.handle) for w in client.prefill + client.decode]
    card = client.fetch_model_card().to_dict()
    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    actor = ray.remote(num_cpus=0, max_restarts=3)(RouterReplica)
    replicas = [actor.options(name=f"pd-router-{i}", scheduling_strategy=here,
                              namespace=cfg.ray.namespace).remote(
        cfg.model_dump_json(), model_dir, config_path, workers, card, i, host, port,
        log_level)
        for i in range(1, count)]
    ray.get([r.ready.remote() for r in replicas], timeout=120)
    log.info("%d router replicas serve %s:%d", count, host, port)
    return replicas
