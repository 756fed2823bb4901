"""In-process worker pools for tests (LocalPool: the workers as on Ray, without Ray)."""

from __future__ import annotations

import contextlib

from pd_runtime.config import ClusterConfig, RouterConfig


def pair_config(model_dir: str, engine: dict, **sections) -> ClusterConfig:
    """One prefill and one decode worker running `engine`, KV over the in-process link;
    `sections` adds or replaces top-level config sections (router, recovery, ...)."""
    return ClusterConfig.model_validate({
        "model": model_dir, "kv_transfer": {"backend": "local"},
        "prefill": {"num_workers": 1, "engine": engine},
        "decode": {"num_workers": 1, "engine": engine}, **sections})


@contextlib.contextmanager
def served(cfg: ClusterConfig, model_dir: str, router: RouterConfig):
    """The pools of `cfg` in process behind the router over HTTP on 127.0.0.1: yields the base
    URL; everything is stopped after."""
    from pd_runtime.workers.local_pool import LocalPool
    from pd_runtime.router.core import PoolBackend
    from tests.router_support.serving import serving

    pool = LocalPool(cfg, model_dir)
    try:
        backend = PoolBackend(pool, cfg, model_dir)
        backend.start()
        try:
            with serving(backend, router) as (_, port):
                yield f"http://127.0.0.1:{port}"
        finally:
            backend.stop()
    finally:
        pool.close()
