"""The router's backend over the Ray pools: authenticates, rate-limits, routes each request
(policy.py) to a decode worker, alone or with a prefill worker, streams the chunks back, and
keeps worker health, load and metrics current.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import threading
import time
from typing import AsyncIterator, Optional

from pd_runtime.config import ClusterConfig, TenantConfig
from pd_runtime.model.model_config import context_limit, load_model_config
from pd_runtime.model.tokenizer import Tokenizer
from pd_runtime.workers.client import PoolClient
from pd_runtime.workers.stream import error_chunk
from router.metrics import RouterMetrics
from router.policy import WorkerState, decide
from router.prefix_index import PrefixIndex
from router.reload import RoutingReloader
from router.tenants import Tenants

log = logging.getLogger(__name__)


def _refusal(status: int, kind: str, message: str, retry_after_s: float = 1.0) -> dict:
    chunk = error_chunk(RuntimeError(message), status)
    chunk["error"].update(type=kind, retry_after_s=retry_after_s)
    return chunk


class PoolBackend:
    def __init__(self, client: PoolClient, cfg: ClusterConfig, model_dir: str,
                 config_path: Optional[str] = None):
        self.client = client
        self.cfg = cfg
        self.model_name = cfg.router.model_name(model_dir)
        self.tokenizer = Tokenizer(model_dir)
        model_cfg = load_model_config(model_dir)
        engine = cfg.decode.engine if cfg.decode.num_workers else cfg.colocated.engine
        self.max_model_len = context_limit(model_cfg, engine.max_model_len, model_dir)  # as the workers'
        self.metrics = RouterMetrics()
        self.tenants = Tenants(cfg.router.tenants)
        self.index = PrefixIndex(model_cfg.identity, engine.block_size)
        self.reloader = RoutingReloader(config_path, cfg.router.routing,
                                        cfg.router.reload_interval_s,
                                        on_result=lambda r: self.metrics.reloads.labels(r).inc())
        self.inflight: dict[str, int] = {}
        self._engine_ids: dict[str, str] = {}
        self._rng = random.Random()
        self._health_thread: Optional[threading.Thread] = None
        self._stopping = threading.Event()

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        """First load report now, then health checks on their own thread and event loop, so
        they never wait behind HTTP traffic (and need no particular loop to start from)."""
        asyncio.run(self.refresh())
        self.reloader.start()
        self._health_thread = threading.Thread(target=self._health_loop, daemon=True,
                                               name="router-health")
        self._health_thread.start()

    def stop(self) -> None:
        self.reloader.stop()
        self._stopping.set()
        if self._health_thread:
            self._health_thread.join(timeout=10)

    def _health_loop(self) -> None:
        interval = self.cfg.recovery.health_check_interval_s
        while not self._stopping.wait(interval):
            try:
                asyncio.run(self.refresh())
            except Exception:
                log.exception("worker health check failed")

    async def refresh(self) -> None:
        await self.client.refresh()
        for w in self.client.prefill + self.client.decode:
            self.metrics.observe_worker(w.worker_id, w.healthy, w.load)
            if not w.healthy:
                continue
            engine_id = w.load.get("engine_id")
            if self._engine_ids.get(w.worker_id) not in (None, engine_id):
                self.index.forget(w.worker_id)  # restarted: its cache is empty again
            self._engine_ids[w.worker_id] = engine_id
            self.index.set_capacity(w.worker_id, w.load.get("total_blocks", 1))
            # The report now counts what we routed there; count afresh from here.
            self.inflight[w.worker_id] = 0

    # -- the Backend interface ---------------------------------------------------------------
    def authenticate(self, api_key: Optional[str]) -> Optional[TenantConfig]:
        return self.tenants.authenticate(api_key)

    def ready(self) -> bool:
        return any(w.healthy for w in self.client.decode)

    def health(self) -> dict:
        """Every worker's state: up, unreachable (restarting, stopped or slow to answer) or
        dead (its restarts are used up: it will not come back); "degraded" unless all are up.
        """
        workers = {}
        for w in self.client.prefill + self.client.decode:
            state = "up" if w.healthy else "dead" if w.dead else "unreachable"
            workers[w.worker_id] = {"role": w.role, "healthy": w.healthy, "state": state,
                                    "pid": w.load.get("pid"),
                                    "engine_id": w.load.get("engine_id")}
        up = all(w["state"] == "up" for w in workers.values())
        return {"status": "ok" if up else "degraded", "workers": workers}

    def active_config(self) -> dict:
        return {"routing": self.reloader.current.model_dump(),
                "config_file": str(self.reloader.path) if self.reloader.path else None,
                "last_reload_error": self.reloader.last_error}

    def metrics_text(self) -> bytes:
        return self.metrics.text()

    def _states(self, workers) -> list[WorkerState]:
        return [WorkerState(w.worker_id, w.role, w.healthy, bool(w.load.get("draining")),
                            w.load, self.inflight.get(w.worker_id, 0)) for w in workers]

    async def generate(self, request_id: str, prompt_ids: list[int], params: dict, *,
                       priority: int = 0, tenant: Optional[TenantConfig] = None
                       ) -> AsyncIterator[dict]:
        arrival = time.monotonic()
        tenant_id = tenant.tenant_id if tenant else "anonymous"
        limit, wait = self.tenants.admit(tenant, len(prompt_ids) + params.get("max_tokens", 16))
        if limit:
            self.metrics.refusals.labels(tenant_id, limit).inc()
            yield _refusal(429, "rate_limit_exceeded", f"tenant {tenant_id} is over its "
                           f"{limit} limit", retry_after_s=wait if math.isfinite(wait) else 60)
            return
        salt = self.tenants.cache_salt(tenant)
        hashes = self.index.hashes(prompt_ids, salt)
        workers = self.client.prefill + self.client.decode
        hits = {w.worker_id: self.index.expected_hit_tokens(w.worker_id, hashes,
                                                            len(prompt_ids)) for w in workers}
        decision = decide(len(prompt_ids), self._states(self.client.decode),
                          self._states(self.client.prefill), hits, self.reloader.current,
                          self._rng)
        if decision.decode_worker is None and self.client.decode:
            # None up right now (one is restarting?): wait a bounded time for one, then decide.
            deadline = arrival + self.client.recovery_wait_s
            if await self.client.wait_for_decode(set(), deadline) is not None:
                decision = decide(len(prompt_ids), self._states(self.client.decode),
                                  self._states(self.client.prefill), hits,
                                  self.reloader.current, self._rng)
        self.metrics.decisions.labels(decision.path, decision.reason).inc()
        if decision.decode_worker is None:
            self.metrics.refusals.labels(tenant_id, "no_worker").inc()
            yield _refusal(503, "unavailable", "no decode worker is available"
                           + (f" (waited {self.client.recovery_wait_s:.0f}s)"
                              if self.client.decode else ""), retry_after_s=2.0)
            return
        chosen = [w for w in (decision.decode_worker, decision.prefill_worker) if w]
        for w in chosen:
            self.inflight[w] = self.inflight.get(w, 0) + 1
            self.index.record(w, hashes)
        path = decision.path
        first = last = None
        status = "error"
        try:
            async for chunk in self.client.generate(
                    request_id, prompt_ids, params, disaggregate=path == "disaggregated",
                    priority=priority, cache_salt=salt, decode_worker=decision.decode_worker,
                    prefill_worker=decision.prefill_worker):
                now = time.monotonic()
                if "error" in chunk:
                    if chunk["error"].get("status") == 429:
                        self.metrics.refusals.labels(tenant_id, "worker_queue_full").inc()
                    yield chunk
                    return
                if chunk["token_ids"]:
                    if first is None:
                        first = now
                        self.metrics.ttft.labels(path).observe(now - arrival)
                    else:
                        self.metrics.itl.labels(path).observe(now - last)
                    last = now
                chunk["route_reason"] = decision.reason
                if chunk.get("finished"):
                    status = "ok"
                    self._observe_final(path, chunk)
                yield chunk
        except (GeneratorExit, asyncio.CancelledError):
            status = "cancelled"  # the client went away: not an error of ours
            raise
        finally:
            self.metrics.requests.labels(path, status).inc()
            if status == "ok":
                self.metrics.e2e.labels(path).observe(time.monotonic() - arrival)

    def _observe_final(self, path: str, chunk: dict) -> None:
        if chunk.get("queue_s") is not None:
            self.metrics.queue.labels(path).observe(chunk["queue_s"])
        if chunk.get("kv_transfer_s") is not None:
            self.metrics.kv_transfer.observe(chunk["kv_transfer_s"])
            if chunk.get("kv_arrived") is False:
                self.metrics.kv_fallbacks.inc()
        if chunk.get("migrations"):
            self.metrics.migrations.inc(chunk["migrations"])
