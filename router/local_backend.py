"""A Backend over one in-process engine (always the colocated path, "local"): for tests and quick
single-process runs; the Ray pools with routing are router/core.py.

Tenants and API keys come from RouterConfig.tenants; per-tenant rate limits are not applied here.
The engine runs on an EngineLoop thread created lazily inside the serving event loop.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from typing import Any, AsyncIterator, Optional

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from pd_runtime.api import (EngineOverloadedError, InvalidRequestError, SamplingParams,
                            error_chunk, output_chunk)
from pd_runtime.config import EngineConfig, RouterConfig, TenantConfig
from router.backend import BackendError

log = logging.getLogger(__name__)

PATH = "local"


class LocalBackend:
    def __init__(self, engine_config: EngineConfig, router_config: Optional[RouterConfig] = None):
        from pd_runtime.engine.engine import LLMEngine  # torch: only where an engine lives

        self.router_config = router_config or RouterConfig()
        self.engine = LLMEngine(engine_config)
        self.tokenizer = self.engine.tokenizer
        self.max_model_len = self.engine.max_model_len
        self.model_name = self.router_config.model_name(engine_config.model)
        self._tenants = list(self.router_config.tenants)
        self._loop = None  # EngineLoop, bound to the event loop that serves
        self.started = time.time()
        self.registry = CollectorRegistry()
        self._http_requests = Counter("router_http_requests", "HTTP requests by route and status",
                                      ["path", "status"], registry=self.registry)
        self._http_latency = Histogram("router_http_request_seconds", "HTTP request latency",
                                       ["path"], registry=self.registry)
        self._refusals = Counter("router_admission_refusals", "Requests refused by admission",
                                 ["tenant"], registry=self.registry)
        blocks = Gauge("engine_free_kv_blocks", "Free KV blocks", registry=self.registry)
        blocks.set_function(lambda: self.engine.block_manager.num_free_blocks)

    # -- Backend -----------------------------------------------------------------------------
    def authenticate(self, api_key: Optional[str]) -> Optional[TenantConfig]:
        if not self._tenants:
            return None
        if api_key is None:
            raise BackendError(401, "missing API key (send Authorization: Bearer <key>)",
                               code="invalid_api_key")
        for tenant in self._tenants:  # constant-time compares: the key is a secret
            if hmac.compare_digest(tenant.api_key.encode(), api_key.encode()):
                return tenant
        raise BackendError(401, "invalid API key", code="invalid_api_key")

    async def generate(self, request_id: str, prompt_ids: list[int], params: dict, *,
                       priority: int = 0,
                       tenant: Optional[TenantConfig] = None) -> AsyncIterator[dict]:
        loop = self._engine_loop()
        salt = tenant.tenant_id if tenant is not None and not tenant.share_prefix_cache else None
        stream = loop.open_stream(request_id)
        finished = False
        try:
            try:
                await loop.call(lambda e: e.add_request(
                    request_id, prompt_ids, SamplingParams(**params), priority, salt))
            except (InvalidRequestError, EngineOverloadedError) as exc:
                finished = True
                if isinstance(exc, EngineOverloadedError):
                    self._refusals.labels(tenant.tenant_id if tenant else "anonymous").inc()
                yield error_chunk(exc)
                return
            except Exception as exc:  # a bug, not the user's doing: 500, and the loop goes on
                finished = True
                log.exception("%s: engine refused the request", request_id)
                yield error_chunk(exc, status=500)
                return
            while not finished:
                out = await stream.get()
                finished = out.finished
                yield output_chunk(out, PATH)
        finally:
            if not finished:  # the consumer went away: free the request's blocks next step
                loop.close_stream(request_id)
                loop.post(lambda e: e.abort(request_id))

    def health(self) -> dict:
        return {"backend": PATH, "model": self.model_name, "uptime_s": time.time() - self.started,
                "engine_steps": self._loop.steps if self._loop is not None else 0}

    def ready(self) -> bool:
        return True  # the engine was built in __init__

    def active_config(self) -> dict:
        return {"backend": PATH, "model": self.model_name, "max_model_len": self.max_model_len,
                "routing": self.router_config.routing.model_dump(),
                "tenants": [t.tenant_id for t in self._tenants]}

    def metrics_text(self) -> bytes:
        return generate_latest(self.registry)

    def observe(self, event: str, **fields: Any) -> None:
        if event == "http_request":
            self._http_requests.labels(fields.get("path", ""), str(fields.get("status"))).inc()
            self._http_latency.labels(fields.get("path", "")).observe(fields.get("latency_s", 0))

    # -- lifecycle ---------------------------------------------------------------------------
    def _engine_loop(self):
        from pd_runtime.workers.engine_loop import EngineLoop

        running = asyncio.get_running_loop()
        if self._loop is not None and self._loop.loop is not running:
            self._loop.stop()  # served again from another event loop: one engine thread only
            self._loop = None
        if self._loop is None:
            self._loop = EngineLoop(self.engine, running)
        return self._loop

    def close(self) -> None:
        if self._loop is not None:
            self._loop.stop()
            self._loop = None
