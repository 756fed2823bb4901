"""The caller's side of the pools: sends a request down the colocated or disaggregated path
and keeps its stream whole across a decode worker's death by migrating it.

Migration: the request goes to another decode worker with the prompt plus every token already
streamed; the new worker continues after them, so the caller sees no token lost or repeated.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import random
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Optional

from pd_runtime.workers.stream import error_chunk

log = logging.getLogger(__name__)


def _actor_lost(exc: BaseException) -> bool:
    import ray.exceptions as rex

    return isinstance(exc, (rex.RayActorError, rex.ActorUnavailableError, rex.WorkerCrashedError))


@dataclass
class WorkerRef:
    worker_id: str
    role: str
    handle: Any
    healthy: bool = True
    load: dict = field(default_factory=dict)


class PoolClient:
    def __init__(self, prefill: list[WorkerRef], decode: list[WorkerRef], max_migrations: int = 3):
        self.prefill = prefill
        self.decode = decode
        self.max_migrations = max_migrations
        self.migrations = 0
        self._rr = itertools.count()

    # -- worker choice (the router's policy replaces these) ----------------------------------
    @staticmethod
    def _pick(workers: list[WorkerRef], exclude: set[str]) -> Optional[WorkerRef]:
        live = [w for w in workers if w.healthy and not w.load.get("draining")
                and w.worker_id not in exclude]
        if not live:
            return None
        best = min(w.load.get("num_running", 0) + w.load.get("num_waiting", 0) for w in live)
        return random.choice([w for w in live if w.load.get("num_running", 0)
                              + w.load.get("num_waiting", 0) == best])

    async def refresh(self, timeout_s: float = 2.0) -> None:
        """Poll every worker's load; a worker that does not answer is marked unhealthy until it
        answers again (a restarted actor rejoins this way)."""
        async def one(w: WorkerRef):
            try:
                w.load = await asyncio.wait_for(w.handle.load.remote(), timeout_s)
                w.healthy = True
            except Exception:
                w.healthy = False

        await asyncio.gather(*(one(w) for w in self.prefill + self.decode))

    # -- requests ----------------------------------------------------------------------------
    async def generate(self, request_id: str, prompt: Any, params: dict,
                       disaggregate: bool = False, priority: int = 0,
                       cache_salt: Optional[str] = None,
                       decode_worker: Optional[str] = None,
                       prefill_worker: Optional[str] = None) -> AsyncIterator[dict]:
        """Chunks of the request, in order, each with `token_ids`, `text`, `finished`; an error
        chunk (with `error`) ends the stream when the request cannot be served."""
        streamed: list[int] = []
        lost: set[str] = set()
        migrations = 0
        while True:
            d = next((w for w in self.decode if w.worker_id == decode_worker), None) \
                if decode_worker and decode_worker not in lost else self._pick(self.decode, lost)
            if d is None:
                yield error_chunk(RuntimeError(
                    "no decode worker is available to serve this request"
                    + (f" (lost {len(lost)} during it)" if lost else "")))
                return
            p = None
            if disaggregate and not streamed:
                p = next((w for w in self.prefill if w.worker_id == prefill_worker), None) \
                    or self._pick(self.prefill, set())
            if streamed:
                gen = d.handle.generate.remote(request_id, prompt, params, priority, cache_salt,
                                               resume_output_ids=list(streamed))
            elif p is not None:
                gen = d.handle.generate_disaggregated.remote(request_id, prompt, params,
                                                             p.handle, priority, cache_salt)
            else:
                gen = d.handle.generate.remote(request_id, prompt, params, priority, cache_salt)
            finished = False
            try:
                async for ref in gen:
                    chunk = await ref
                    streamed.extend(chunk.get("token_ids", []))
                    chunk["worker_id"] = d.worker_id
                    chunk["migrations"] = migrations
                    finished = chunk.get("finished", False)
                    yield chunk
                    if finished:
                        return
                raise RuntimeError("worker stream ended early")
            except BaseException as exc:
                if finished:
                    return
                if isinstance(exc, (GeneratorExit, asyncio.CancelledError)):
                    # The caller went away: release the request wherever it lives.
                    d.handle.abort.remote(request_id)
                    raise
                if not (_actor_lost(exc) or isinstance(exc, RuntimeError)):
                    raise
                log.warning("decode worker %s lost during %s (%s); migrating with %d tokens",
                            d.worker_id, request_id, type(exc).__name__, len(streamed))
                d.healthy = False
                lost.add(d.worker_id)
                migrations += 1
                self.migrations += 1
                if migrations > self.max_migrations:
                    yield error_chunk(RuntimeError(f"request {request_id} lost {migrations} "
                                                   "workers; giving up"))
                    return
