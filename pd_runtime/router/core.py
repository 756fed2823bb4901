"""The router's backend over the Ray pools: authenticates, rate-limits, routes each request
(policy.py) to a decode worker, alone or with a prefill worker, streams the chunks back, and
keeps worker health, load and metrics current.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import random
import resource
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Optional

from pd_runtime.api import SamplingParams, StreamChunk
from pd_runtime.config import ClusterConfig, TenantConfig
from pd_runtime.cpu_time import cpu_s, read_stat
from pd_runtime.router.capacity import CapacityChanged
from pd_runtime.router.cost_model import CostModel
from pd_runtime.router.ledger import Ledgers
from pd_runtime.router.metrics import RouterMetrics
from pd_runtime.router.metrics_vllm import VllmNames
from pd_runtime.router.policy import Decision, WorkerState, decide, decide_slo, slo_target
from pd_runtime.router.prefix_index import PrefixIndex, follow_kv_events
from pd_runtime.router.reload import RoutingReloader
from pd_runtime.router.tenants import Tenants
from pd_runtime.router.traffic import TrafficLog
from pd_runtime.tokenizer import Tokenizer

log = logging.getLogger(__name__)


def _refusal(status: int, kind: str, message: str, retry_after_s: float = 1.0) -> StreamChunk:
    chunk = StreamChunk.from_error(RuntimeError(message), status)
    chunk.error.type, chunk.error.retry_after_s = kind, retry_after_s
    return chunk


def _tenant_id(tenant: Optional[TenantConfig]) -> str:
    return tenant.tenant_id if tenant else "anonymous"


@dataclass
class _Routed:
    """A routed request while it streams: where it went and what its chunks are measured
    against (`first`, `last`: when its first and latest tokens came back)."""

    request_id: str
    decision: Decision
    chosen: list[str]  # the decode worker, then the prefill worker if any
    prompt_len: int
    tenant_id: str
    arrival: float
    dispatched: float
    decode_ledger: Any
    first: Optional[float] = None
    last: Optional[float] = None
    status: str = "error"  # "ok" once finished, "cancelled" when the client went away

    @property
    def path(self) -> str:
        return self.decision.path

    @property
    def runner(self) -> str:
        """The worker that computes the prompt."""
        return self.decision.prefill_worker or self.decision.decode_worker


# The parts of a worker's load report that describe what its work costs (GET
# /v1/router/workers; pd_runtime/planner/costs.py reads them).
_COST_FIELDS = ("step_costs", "max_num_seqs", "max_num_batched_tokens", "total_blocks",
                "block_size", "kv_bytes_per_token", "kv_transfer", "kv_overlap", "host",
                "num_threads", "cpu_s", "engine_thread_cpu_s")


# How much later than the default tier a flex request is scheduled (engine priorities: lower
# first, with aging, so flex work is delayed under load, never starved).
FLEX_PRIORITY = 10

class PoolBackend:
    """`client`: the pools' client (pd_runtime.workers.client.PoolClient, or anything with its
    interface). What the router knows of the model comes from the workers' model card, so it
    reads no model files: `model_dir` only names the model (router.served_model_name)."""

    def __init__(self, client, cfg: ClusterConfig, model_dir: str,
                 config_path: Optional[str] = None):
        self.client = client
        self.cfg = cfg
        self.model_name = cfg.router.model_name(model_dir)
        card = client.fetch_model_card()
        self.tokenizer = Tokenizer(card.tokenizer_files)
        self.max_model_len = card.max_model_len  # as the workers enforce it
        if cfg.router.chat_template is not None:
            self.tokenizer.use_chat_template(cfg.router.chat_template_text())
        if cfg.router.reasoning_parser != "auto":
            self.tokenizer.reasoning_format = None if cfg.router.reasoning_parser == "none" \
                else cfg.router.reasoning_parser
        if cfg.router.tool_call_parser != "auto":
            self.tokenizer.tool_call_format = None if cfg.router.tool_call_parser == "none" \
                else cfg.router.tool_call_parser
        self.sampling_defaults = card.sampling_defaults \
            if cfg.router.sampling_defaults == "model" else {}
        if self.sampling_defaults:
            log.info("requests that leave them out get the model's sampling defaults "
                     "(generation_config.json): %s; router.sampling_defaults: openai turns "
                     "this off", self.sampling_defaults)
        self.metrics = RouterMetrics()
        self.tenants = Tenants(cfg.router.tenants)
        self.index = PrefixIndex(card.identity, card.block_size)
        self.reloader = RoutingReloader(config_path, cfg.router.routing,
                                        cfg.router.reload_interval_s,
                                        on_result=lambda r: self.metrics.reloads.labels(r).inc())
        self.inflight: dict[str, int] = {}
        self.costs = CostModel()
        self.ledgers = Ledgers()
        self._engine_ids: dict[str, str] = {}
        self._rng = random.Random()
        # What the router's own CPU went on (and vLLM's token counters on /metrics).
        self.served = {"requests": 0, "prompt_tokens": 0, "output_tokens": 0}
        self.metrics.registry.register(VllmNames(self.metrics, self.model_name, self.served))
        self._health_thread: Optional[threading.Thread] = None
        self._stopping = threading.Event()
        self.capacity = CapacityChanged()  # wakes requests held by `overload: queue`
        # What the autoscaler plans for; kept only where it runs (planner.autoscale).
        self.traffic = TrafficLog() if cfg.planner.autoscale.enabled else None
        self.autoscale_status = None  # set by the serve command when it runs the autoscaler

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
                self.ledgers[w.worker_id].slowdown = 1.0  # and what it measured is moot
            self._engine_ids[w.worker_id] = engine_id
            tiers = w.load.get("kv_tiers") or {}  # blocks evicted to host and disk still hit
            self.index.set_capacity(w.worker_id, w.load.get("total_blocks", 1) + sum(
                (tiers.get(t) or {}).get("capacity_blocks", 0) for t in ("host", "disk")))
            self.costs.update(w.worker_id, w.load)
            c = self.costs.costs(w.worker_id)
            self.metrics.observe_costs(w.worker_id, c.prefill_tokens_per_s(),
                                       self.costs.transfer_gbps.get(w.worker_id, 0.0))
            # The report now counts what we routed there; count afresh from here.
            self.inflight[w.worker_id] = 0
        if self.reloader.current.kv_events:  # (reloads live)
            await follow_kv_events(self.index, self.client.prefill + self.client.decode)
        else:
            self.index.stop_following()
        self.capacity.notify()


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

    async def reset_prefix_cache(self, timeout_s: float = 10.0) -> dict:
        """Empty every worker's prefix cache, and what the router remembers of them: worker id
        -> the cached blocks it forgot (None: unreachable, or no answer within `timeout_s`)."""
        workers = self.client.prefill + self.client.decode

        async def one(w) -> Optional[int]:
            if not w.healthy:
                return None
            try:
                return await asyncio.wait_for(w.handle.reset_prefix_cache.remote(), timeout_s)
            except Exception as exc:
                log.warning("worker %s did not reset its prefix cache: %s", w.worker_id, exc)
                return None

        forgotten = await asyncio.gather(*(one(w) for w in workers))
        for w in workers:
            self.index.forget(w.worker_id)
        return {w.worker_id: n for w, n in zip(workers, forgotten)}

    def active_config(self) -> dict:
        return {"routing": self.reloader.current.model_dump(),
                "config_file": str(self.reloader.path) if self.reloader.path else None,
                "last_reload_error": self.reloader.last_error,
                "sampling_defaults": self.sampling_defaults,
                "autoscale": self.autoscale_status() if self.autoscale_status else
                {"enabled": False}}

    def worker_reports(self) -> dict:
        """worker id -> role, health and the cost figures of its last load report."""
        return {w.worker_id: {"role": w.role, "healthy": w.healthy,
                              "load": {k: w.load.get(k) for k in _COST_FIELDS}}
                for w in self.client.prefill + self.client.decode}

    def host_report(self) -> dict:
        """The router process itself: the CPU it has used (its own and its children's, the
        body parser's), the requests and output tokens it has served, the node and cores it
        runs on; `pd-runtime profile` fits the router's CPU per request and per token from it."""
        return {"cpu_s": process_cpu_s(), "time": time.monotonic(),
                "cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                else os.cpu_count(), "host": socket.gethostname(), **self.served}

    def metrics_text(self) -> bytes:
        return self.metrics.text()

    def observe(self, event: str, **fields) -> None:
        if event == "http_request":
            path = fields.get("path", "")
            self.metrics.http_requests.labels(path, str(fields.get("status"))).inc()
            self.metrics.http_latency.labels(path).observe(fields.get("latency_s", 0.0))

    def _states(self, workers) -> list[WorkerState]:
        return [WorkerState(w.worker_id, w.role, w.healthy,
                            getattr(w, "draining", False) or bool(w.load.get("draining")),
                            w.load, self.inflight.get(w.worker_id, 0)) for w in workers]

    async def admit_tenant(self, tenant: Optional[TenantConfig],
                           tokens: int) -> Optional[StreamChunk]:
        """A request of `tokens` (prompt + most output) against the tenant's rate limits: None
        when admitted (and charged), else the 429 chunk to answer with."""
        limit, wait = await self.tenants.admit_async(tenant, tokens)
        if not limit:
            return None
        tenant_id = _tenant_id(tenant)
        self.metrics.refusals.labels(tenant_id, limit).inc()
        return _refusal(429, "rate_limit_exceeded", f"tenant {tenant_id} is over its {limit} "
                        f"limit", retry_after_s=wait if math.isfinite(wait) else 60)

    async def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams, *,
                       priority: int = 0, tenant: Optional[TenantConfig] = None,
                       deadline: Optional[float] = None, flex: bool = False,
                       cache_salt: Optional[str] = None,
                       prepaid: bool = False) -> AsyncIterator[StreamChunk]:
        """`flex` (service_tier "flex"): not held to the latency targets. Routed by load as
        `mode: auto` routes, never refused for a target, and scheduled after the default tier
        (FLEX_PRIORITY later), so it waits rather than getting a 429. `cache_salt`: the
        request's own (vLLM's field), kept apart from every tenant's. `prepaid`: the tenant's
        rate limits were charged for this request already (a beam search's steps:
        `admit_tenant` once for them all)."""
        arrival = time.monotonic()
        self.served["requests"] += 1
        if self.traffic is not None:
            self.traffic.record(len(prompt_ids), params.max_tokens, arrival)
        refusal = None if prepaid else \
            await self.admit_tenant(tenant, len(prompt_ids) + params.max_tokens)
        if refusal is not None:
            yield refusal
            return
        salt = self.tenants.cache_salt(tenant, cache_salt)
        hashes = self.index.hashes(prompt_ids, salt)
        hits = self._expected_hits(prompt_ids, params, hashes)
        decision = await self._route(prompt_ids, params, hits, _tenant_id(tenant), arrival, flex,
                                     self.index.tier_load_s(hashes, hits, self._tier_block_s))
        refusal = await self._refusal_for(decision, request_id, prompt_ids, params, tenant,
                                          prepaid)
        if refusal is not None:
            yield refusal
            return
        run = self._dispatch(request_id, prompt_ids, params, decision, hashes, tenant, arrival,
                             flex)
        try:
            async for chunk in self.client.generate(
                    request_id, prompt_ids, params, disaggregate=run.path == "disaggregated",
                    priority=priority + (FLEX_PRIORITY if flex else 0), cache_salt=salt,
                    decode_worker=decision.decode_worker,
                    prefill_worker=decision.prefill_worker, deadline=deadline):
                self._observe_chunk(run, chunk, time.monotonic())
                yield chunk
                if chunk.error is not None:
                    return
        except (GeneratorExit, asyncio.CancelledError):
            run.status = "cancelled"  # the client went away: not an error of ours
            raise
        finally:
            self._end(run)

    def _expected_hits(self, prompt_ids: list[int], params: SamplingParams,
                       hashes: list) -> dict[str, int]:
        """Worker id -> the prompt tokens its prefix cache is expected to hold. A scored prompt
        (prompt logprobs) is computed whole, under a salt of its own: it neither hits nor
        leaves blocks that the index could count."""
        if params.prompt_logprobs is not None:
            return {}
        return {w.worker_id: self.index.expected_hit_tokens(w.worker_id, hashes,
                                                            len(prompt_ids))
                for w in self.client.prefill + self.client.decode}

    async def _refusal_for(self, decision: Decision, request_id: str, prompt_ids: list[int],
                           params: SamplingParams, tenant: Optional[TenantConfig],
                           prepaid: bool) -> Optional[StreamChunk]:
        """The decision counted (and logged); the chunk to answer with when it serves nothing:
        a 429 when the policy refused (the tenant's charge refunded), a 503 without a decode
        worker."""
        tenant_id = _tenant_id(tenant)
        self.metrics.decisions.labels(decision.path, decision.reason).inc()
        if decision.predicted_ttft_s is not None:
            log.debug("route %s (%d tokens): %s %s decode=%s prefill=%s predicted ttft %.3fs "
                      "tpot %.1fms", request_id, len(prompt_ids), decision.path, decision.reason,
                      decision.decode_worker, decision.prefill_worker, decision.predicted_ttft_s,
                      decision.predicted_tpot_s * 1000)
        if decision.path == "none" and decision.retry_after_s is not None:
            self.metrics.refusals.labels(tenant_id, decision.reason).inc()
            if not prepaid:
                await self.tenants.refund_async(tenant, len(prompt_ids) + params.max_tokens)
            return _refusal(429, "overloaded", decision.refusal,
                            retry_after_s=decision.retry_after_s)
        if decision.decode_worker is None:
            self.metrics.refusals.labels(tenant_id, "no_worker").inc()
            return _refusal(503, "unavailable", "no decode worker is available"
                            + (f" (waited {self.client.recovery_wait_s:.0f}s)"
                               if self.client.decode else ""), retry_after_s=2.0)
        return None

    def _dispatch(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                  decision: Decision, hashes: list, tenant: Optional[TenantConfig],
                  arrival: float, flex: bool) -> "_Routed":
        """The request counted where the decision sends it: in flight on its workers, its
        blocks in their prefix index, its prefill queued in the ledger of the worker that
        computes the prompt (flex prefills wait behind the default tier's: not in its queue)
        and its tokens in the decode worker's."""
        chosen = [w for w in (decision.decode_worker, decision.prefill_worker) if w]
        for w in chosen:
            self.inflight[w] = self.inflight.get(w, 0) + 1
            if params.prompt_logprobs is None:
                self.index.record(w, hashes)
        run = _Routed(request_id, decision, chosen, len(prompt_ids), _tenant_id(tenant), arrival,
                      time.monotonic(), self.ledgers[decision.decode_worker])
        if not flex:
            self.ledgers[run.runner].add_prefill(request_id, decision.prefill_s or self._prefill_s(
                run.runner, len(prompt_ids) - decision.expected_hit_tokens), run.dispatched)
        run.decode_ledger.start(request_id, len(prompt_ids))
        return run

    def _observe_chunk(self, run: "_Routed", chunk: StreamChunk, now: float) -> None:
        """A chunk on its way out: its tokens in the ledgers and latency metrics, the route
        on it; a refusal by the worker's queue counted."""
        if chunk.error is not None:
            if chunk.error.status == 429:
                self.metrics.refusals.labels(run.tenant_id, "worker_queue_full").inc()
            return
        if chunk.token_ids:
            self.served["output_tokens"] += len(chunk.token_ids)
            run.decode_ledger.grow(run.request_id, len(chunk.token_ids))
            if run.first is None:
                self._observe_first_token(run, chunk, now)
            else:
                self.metrics.itl.labels(run.path).observe(now - run.last)
            run.last = now
        chunk.route_reason, chunk.workers = run.decision.reason, run.chosen
        if chunk.finished:
            run.status = "ok"
            self._observe_final(run.path, chunk)

    def _observe_first_token(self, run: "_Routed", chunk: StreamChunk, now: float) -> None:
        """The prompt computed: its prefill leaves the runner's queue (a measured one teaches
        the ledger its pace, unless a lost worker or a fallback delayed it), TTFT observed."""
        run.first = now
        self.served["prompt_tokens"] += run.prompt_len
        self.ledgers[run.runner].prefill_done(
            run.request_id, now, measured=not chunk.migrations and not chunk.prefill_fallback)
        self.capacity.notify()
        self.metrics.ttft.labels(run.path).observe(now - run.arrival)
        if run.decision.predicted_ttft_s is not None:
            self.metrics.ttft_error.labels(run.path).observe(
                now - run.dispatched - run.decision.predicted_ttft_s)
            log.debug("first token %s: ttft %.3fs from dispatch", run.request_id,
                      now - run.dispatched)

    def _end(self, run: "_Routed") -> None:
        """The request's stream is over (finished, failed or abandoned): out of the ledgers,
        counted by its status."""
        now = time.monotonic()
        self.ledgers[run.runner].finish(run.request_id, now)
        run.decode_ledger.finish(run.request_id, now)
        self.capacity.notify()
        self.metrics.requests.labels(run.path, run.status).inc()
        if run.status == "ok":
            self.metrics.e2e.labels(run.path).observe(time.monotonic() - run.arrival)

    def _tier_block_s(self, worker_id: str) -> dict:
        return self.costs.costs(worker_id).tier_block_s

    def _prefill_s(self, worker_id: str, uncached: int) -> float:
        return self.costs.costs(worker_id).prefill_s(uncached)

    def _decide(self, prompt_ids: list[int], params: SamplingParams, hits: dict[str, int],
                tenant_id: str, waited_s: float = 0.0, flex: bool = False,
                tier_s: Optional[dict[str, float]] = None) -> Decision:
        cfg = self.reloader.current
        decode, prefill = self._states(self.client.decode), self._states(self.client.prefill)
        if not any(s.available for s in decode):
            # No decode worker up (one restarting, or lost): the prefill workers stand in and
            # serve whole requests, as a colocated worker does, until one is back
            # (PoolClient.wait_for_decode does the same for a migrating stream).
            decode, prefill = [s for s in prefill if s.available], []
        if params.prompt_logprobs is not None:  # scored where the prompt is computed
            prefill = []
        if cfg.mode != "slo" or flex:
            return decide(len(prompt_ids), decode, prefill, hits, cfg, self._rng)
        target = slo_target(cfg, tenant_id, len(prompt_ids))
        return decide_slo(len(prompt_ids), params.max_tokens, decode, prefill,
                          hits, cfg, target, self.costs, self.ledgers, time.monotonic(),
                          self._rng, waited_s, tier_s)

    async def _route(self, prompt_ids: list[int], params: SamplingParams, hits: dict[str, int],
                     tenant_id: str, arrival: float, flex: bool = False,
                     tier_s: Optional[dict[str, float]] = None) -> Decision:
        """The policy's decision; with no decode worker up, waits a bounded time for one (one
        is restarting?); slo mode with `overload: queue`: holds the request until an option
        meets its targets, for up to max_queue_s."""
        decision = self._decide(prompt_ids, params, hits, tenant_id, flex=flex, tier_s=tier_s)
        if decision.decode_worker is None and decision.retry_after_s is None \
                and self.client.decode:
            deadline = arrival + self.client.recovery_wait_s
            if await self.client.wait_for_decode(set(), deadline) is not None:
                decision = self._decide(prompt_ids, params, hits, tenant_id, flex=flex,
                                        tier_s=tier_s)
        while decision.retry_after_s is not None:
            cfg = self.reloader.current
            held = time.monotonic() - arrival
            if cfg.overload != "queue" or held >= cfg.max_queue_s:
                break
            # Re-decided when capacity may have freed, or when its decision said it would
            # have to wait (the ledgers' queues drain by the clock).
            await self.capacity.wait(min(decision.retry_after_s, cfg.max_queue_s - held))
            decision = self._decide(prompt_ids, params, hits, tenant_id,
                                    time.monotonic() - arrival, flex, tier_s)
        return decision

    def _observe_final(self, path: str, chunk: StreamChunk) -> None:
        if chunk.queue_s is not None:
            self.metrics.queue.labels(path).observe(chunk.queue_s)
        if chunk.kv_transfer_s is not None:
            self.metrics.kv_transfer.observe(chunk.kv_transfer_s)
            if chunk.kv_arrived is False:
                self.metrics.kv_fallbacks.inc()
        if chunk.migrations:
            self.metrics.migrations.inc(chunk.migrations)


def process_cpu_s() -> float:
    """CPU seconds of this process (all threads) and its children: the ones that have ended
    and, on Linux, the live ones (the body parser's process pool)."""
    own, ended = resource.getrusage(resource.RUSAGE_SELF), \
        resource.getrusage(resource.RUSAGE_CHILDREN)
    total = own.ru_utime + own.ru_stime + ended.ru_utime + ended.ru_stime
    me = os.getpid()
    try:
        pids = [p for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return total
    for pid in pids:
        fields = read_stat(f"/proc/{pid}/stat")
        if fields is not None and int(fields[1]) == me:  # a child of ours
            total += cpu_s(fields)
    return total

