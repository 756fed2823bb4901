"""Router replicas: `router.replicas: N` routers serving one port together, over the same worker
pools. Replica 0 is the `pd-runtime serve` process; replicas 1..N-1 are Ray actors on its node
(pd_runtime/workers/router_replicas.py starts them); this module builds one replica.

Every replica binds the port with SO_REUSEPORT and the kernel spreads new connections over
them, so any load balancer (or none) works in front. What must be shared is shared through the
run store: run records and idempotency keys (a retry may land on another replica; it follows
the run through the store), the usage ledger and the tenants' rate-limit buckets. Each replica
polls the workers' load reports itself.
"""

from __future__ import annotations

from typing import Optional

from pd_runtime.config import ClusterConfig


def shared_store(cfg: ClusterConfig):
    """The store that replicas share rate limits through (None with one replica)."""
    if cfg.router.replicas == 1:
        return None
    from pd_runtime.gateway.open import open_store

    return open_store(cfg.router.runs.store)


def build_router(client, cfg: ClusterConfig, model_dir: str, config_path: Optional[str],
                 owner: str):
    """(backend, app) of one router replica over `client`'s pools."""
    from pd_runtime.entrypoints.openai.app import create_app, open_recorder
    from pd_runtime.router.core import PoolBackend

    backend = PoolBackend(client, cfg, model_dir, config_path=config_path)
    backend.tenants.shared = shared_store(cfg)
    backend.start()
    recorder = open_recorder(cfg.router, owner)
    return backend, create_app(backend, cfg.router, recorder=recorder, owner=owner)
