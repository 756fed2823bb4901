"""Serving a Backend over real HTTP on 127.0.0.1 for tests, and the check of an OpenAI error
body, shared by the HTTP test modules.
"""

from __future__ import annotations

import contextlib

import httpx

from pd_runtime.config import EngineConfig, RouterConfig
from router.app import create_app
from router.local_backend import LocalBackend
from router.server import start_in_thread

ENGINE = dict(dtype="float32", num_kv_blocks=256, num_threads=1)
ERROR_KEYS = {"message", "type", "param", "code"}
APPS: dict = {}  # port -> the app served there (tests look at app.state)


@contextlib.contextmanager
def serving(backend, router_config: RouterConfig | None = None):
    app = create_app(backend, router_config or RouterConfig())
    server, port = start_in_thread(app)
    APPS[port] = app
    try:
        yield backend, port
    finally:
        server.stop()
        APPS.pop(port, None)
        if hasattr(backend, "close"):
            backend.close()


def local(model_dir: str, router_config: RouterConfig | None = None, **engine):
    backend = LocalBackend(EngineConfig(model=model_dir, **{**ENGINE, **engine}), router_config)
    return serving(backend, router_config)


def assert_error_body(response: httpx.Response, status: int, param=None) -> dict:
    assert response.status_code == status, response.text[:500]
    assert response.headers.get("x-request-id")
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == ERROR_KEYS, body
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    if param is not None:
        assert body["error"]["param"] == param, body
    return body["error"]
