"""Serving a Backend over real HTTP on 127.0.0.1 for tests, and the check of an OpenAI error
body, shared by the HTTP test modules.
"""

from __future__ import annotations

import contextlib
import itertools
import os

import httpx

from pd_runtime.config import ClusterConfig, RouterConfig
from pd_runtime.entrypoints.openai.app import create_app
from pd_runtime.entrypoints.openai.server import start_in_thread

ENGINE = dict(dtype="float32", num_kv_blocks=256, num_threads=1)
ERROR_KEYS = {"message", "type", "param", "code"}
APPS: dict = {}  # port -> the app served there (tests look at app.state)


_SERVERS = itertools.count()


@contextlib.contextmanager
def serving(backend, router_config: RouterConfig | None = None):
    # An owner of its own: the configured port (8000) is not the one bound here, and another
    # test server's start-up must not take this one's runs for a crashed predecessor's.
    app = create_app(backend, router_config or RouterConfig(),
                     owner=f"test-{os.getpid()}-{next(_SERVERS)}")
    server, port = start_in_thread(app)
    APPS[port] = app
    try:
        yield backend, port
    finally:
        server.stop()
        APPS.pop(port, None)
        if hasattr(backend, "close"):
            backend.close()


@contextlib.contextmanager
def local(model_dir: str, router_config: RouterConfig | None = None, **engine):
    """The router's PoolBackend over one in-process decode worker (LocalPool: the worker as on
    Ray, without Ray), served over HTTP; `engine_of(backend)` is its engine. Routing is
    always colocated (one worker): no latency-target admission unless a test asks for it."""
    from pd_runtime.workers.local_pool import LocalPool
    from pd_runtime.router.core import PoolBackend

    router_config = router_config or RouterConfig(routing={"mode": "always_colocated"})
    cfg = ClusterConfig.model_validate({
        "model": model_dir, "router": router_config.model_dump(),
        "prefill": {"num_workers": 0},
        "decode": {"num_workers": 1, "engine": {**ENGINE, **engine}},
        "kv_transfer": {"backend": "local"}})
    pool = LocalPool(cfg, model_dir)
    try:
        backend = PoolBackend(pool, cfg, model_dir)
        backend.start()
        try:
            with serving(backend, router_config) as served:
                yield served
        finally:
            backend.stop()
    finally:
        pool.close()


def engine_of(backend):
    """The engine of a `local` backend's one worker."""
    return backend.client.worker("decode-0").engine


def assert_error_body(response: httpx.Response, status: int, param=None) -> dict:
    assert response.status_code == status, response.text[:500]
    assert response.headers.get("x-request-id")
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == ERROR_KEYS, body
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    if param is not None:
        assert body["error"]["param"] == param, body
    return body["error"]
