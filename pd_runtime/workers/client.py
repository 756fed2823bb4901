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
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Optional

from pd_runtime.api import STREAM_CHUNK_VERSION, GenerationRequest, ModelCard, StreamChunk

log = logging.getLogger(__name__)


def _version_mismatch(worker_id: str, chunk) -> StreamChunk:
    """The answer when a worker streams another version's chunks (a rolling restart's mix)."""
    return StreamChunk.from_error(RuntimeError(
        f"worker {worker_id} streams chunks of version {getattr(chunk, 'version', None)}; "
        f"this router reads version {STREAM_CHUNK_VERSION}"))


def _actor_lost(exc: BaseException) -> bool:
    import ray.exceptions as rex

    return isinstance(exc, (rex.RayActorError, rex.ActorUnavailableError, rex.WorkerCrashedError))


@dataclass
class _Progress:
    """One request's progress across its decode workers: the tokens (and characters of text)
    the caller already has, the workers lost during it, and until when a worker may still come
    back for it."""

    recover_by: float
    streamed: list[int] = field(default_factory=list)
    text_len: int = 0
    lost: set[str] = field(default_factory=set)
    migrations: int = 0


def _no_decode_worker(run: _Progress, waited_s: float) -> StreamChunk:
    return StreamChunk.from_error(RuntimeError(
        "no decode worker is available to serve this request"
        + (f" (lost {len(run.lost)} during it)" if run.lost else "")
        + f"; waited {waited_s:.0f}s"), retry_after_s=1.0)


def _gave_up(request_id: str, run: _Progress) -> StreamChunk:
    return StreamChunk.from_error(RuntimeError(
        f"request {request_id} lost {run.migrations} workers; giving up"), retry_after_s=1.0)


@dataclass
class WorkerRef:
    worker_id: str
    role: str
    handle: Any
    healthy: bool = True
    load: dict = field(default_factory=dict)
    # Consecutive probes that found the actor dead: a new call to an actor that Ray is
    # restarting waits for it, so a probe fails at once only once its restarts are used up.
    dead_probes: int = 0
    # The placement-group bundle it holds (a Ray scheduling strategy), if any: a worker
    # started later in its place reuses it (workers/elastic.py); a stopped actor leaves it
    # reserved.
    placement: Any = None
    # Drained by the autoscaler: routed nothing new, whatever its load reports still say.
    draining: bool = False

    @property
    def dead(self) -> bool:
        """Gone for good, as far as two probes in a row can tell."""
        return self.dead_probes >= 2


class _WorkerLost(RuntimeError):
    """Ray's control store says the worker is not alive while its stream still waits."""


def _actor_state(handle) -> Optional[str]:
    """The actor's state in Ray's control store (ALIVE, RESTARTING, DEAD, ...); None when it
    cannot be told (private API: best effort)."""
    try:
        from ray._private import state

        return state.actors(actor_id=handle._actor_id.hex()).get("State")
    except Exception:
        return None


async def _stream_items(gen, handle, stall_s: float):
    """The items of a worker's stream. When none has come for `stall_s` and the control store
    says the actor was killed (restarting or dead), raises _WorkerLost: a stream notices that by
    itself only after many seconds (~17 s measured), which a request would wait out."""
    it = gen.__aiter__()
    nxt = None
    try:
        while True:
            nxt = asyncio.ensure_future(it.__anext__())
            while not (await asyncio.wait({nxt}, timeout=stall_s))[0]:
                state = await asyncio.to_thread(_actor_state, handle)
                if state in ("RESTARTING", "DEAD"):
                    raise _WorkerLost(f"its actor is {state.lower()}")
            try:
                item = nxt.result()
            except StopAsyncIteration:
                return
            yield item
    finally:
        if nxt is not None and not nxt.done():
            nxt.cancel()


def _actor_died(exc: BaseException) -> bool:
    import ray.exceptions as rex

    return isinstance(exc, rex.ActorDiedError)


class PoolClient:
    def __init__(self, prefill: list[WorkerRef], decode: list[WorkerRef], max_migrations: int = 3,
                 recovery_wait_s: float = 20.0, probe_interval_s: float = 0.25,
                 stall_check_s: float = 2.0, model_card: Optional[ModelCard] = None):
        self.prefill = prefill
        self.decode = decode
        self.model_card = model_card  # what the router knows of the model (fetch_model_card)
        self.max_migrations = max_migrations
        # How long a request waits for a decode worker (after losing one, or finding none).
        self.recovery_wait_s = recovery_wait_s
        self.probe_interval_s = probe_interval_s
        self.stall_check_s = stall_check_s  # a stream this quiet is checked on (see _stream_items)
        self.migrations = 0
        self._rr = itertools.count()

    def fetch_model_card(self, timeout_s: float = 60.0) -> ModelCard:
        """The served model's card from the first worker that answers (decode first); kept."""
        import ray

        if self.model_card is None:
            errors = []
            for w in self.decode + self.prefill:
                try:
                    info = ray.get(w.handle.ready.remote(), timeout=timeout_s)
                except Exception as exc:
                    errors.append(f"{w.worker_id}: {type(exc).__name__}")
                    continue
                self.model_card = ModelCard.from_dict(info["model_card"])
                break
            else:
                raise RuntimeError("no worker answered with its model card"
                                   + (f" ({'; '.join(errors)})" if errors else ""))
        return self.model_card

    # -- worker choice (the router's policy replaces these) ----------------------------------
    @staticmethod
    def _pick(workers: list[WorkerRef], exclude: set[str]) -> Optional[WorkerRef]:
        live = [w for w in workers if w.healthy and not w.draining
                and not w.load.get("draining") and w.worker_id not in exclude]
        if not live:
            return None
        best = min(w.load.get("num_running", 0) + w.load.get("num_waiting", 0) for w in live)
        return random.choice([w for w in live if w.load.get("num_running", 0)
                              + w.load.get("num_waiting", 0) == best])

    async def probe(self, w: WorkerRef, timeout_s: float = 1.0) -> bool:
        """Ask one worker for its load; a worker that does not answer is marked unhealthy until
        it answers again (a restarted actor rejoins this way), one whose restarts are used up
        is marked dead."""
        try:
            w.load = await asyncio.wait_for(w.handle.load.remote(), timeout_s)
            w.healthy, w.dead_probes = True, 0
        except Exception as exc:
            w.healthy = False
            w.dead_probes = w.dead_probes + 1 if _actor_died(exc) else 0
        return w.healthy

    async def refresh(self, timeout_s: float = 1.0) -> None:
        """Poll every worker's load (see probe)."""
        await asyncio.gather(*(self.probe(w, timeout_s) for w in self.prefill + self.decode))

    async def wait_for_decode(self, exclude: set[str], deadline: float) -> Optional[WorkerRef]:
        """A decode worker to serve a request: at once if one is up; with none up, a prefill
        worker stands in (it serves whole requests as a colocated worker does: a dead decode
        pool costs its capacity, not a wait for its restart); with neither, the first that
        comes back (another one, or a restarted actor) before `deadline` (time.monotonic())."""
        while True:
            d = self._pick(self.decode, exclude) or self._pick(self.decode, set()) \
                or self._pick(self.prefill, exclude)
            if d is not None:
                return d
            if time.monotonic() >= deadline or all(w.dead for w in self.decode):
                return None
            await asyncio.sleep(self.probe_interval_s)
            remaining = deadline - time.monotonic()
            down = [w for w in self.decode if not w.healthy]
            await asyncio.gather(*(self.probe(w, max(0.1, min(1.0, remaining)))
                                   for w in down))

    # -- requests ----------------------------------------------------------------------------
    async def generate(self, request_id: str, prompt: Any, params: dict,
                       disaggregate: bool = False, priority: int = 0,
                       cache_salt: Optional[str] = None,
                       decode_worker: Optional[str] = None,
                       prefill_worker: Optional[str] = None,
                       deadline: Optional[float] = None) -> AsyncIterator[StreamChunk]:
        """Chunks of the request, in order, each with `token_ids`, `text`, `finished`; an error
        chunk (with `error`) ends the stream when the request cannot be served.

        A decode worker lost mid-request costs latency, not the request: it continues on
        another decode worker, or on the restarted one, with the prompt and every token (and
        the exact text) already streamed, for up to `recovery_wait_s` without a worker.
        `deadline` (time.time()): the workers end the request there (a 504 error chunk).
        """
        run = _Progress(recover_by=time.monotonic() + self.recovery_wait_s)
        while True:
            d = await self._decode_for(decode_worker, run)
            if d is None:
                yield _no_decode_worker(run, self.recovery_wait_s)
                return
            # A retry is a new request on its worker; the old one may linger there a moment.
            rid = request_id if not run.migrations else f"{request_id}~{run.migrations}"
            request = GenerationRequest.make(rid, prompt, params, priority, cache_salt, deadline)
            gen = self._call(d, request, run, disaggregate, prefill_worker)
            finished = False
            try:
                async for ref in _stream_items(gen, d.handle, self.stall_check_s):
                    chunk = self._received(await ref, request_id, d, run)
                    if chunk.error is not None:  # a refusal or bad input: the answer, not a loss
                        yield chunk
                        return
                    finished = chunk.finished
                    yield chunk
                    if finished:
                        return
                raise RuntimeError("worker stream ended early")
            except BaseException as exc:
                if finished:
                    return
                if isinstance(exc, (GeneratorExit, asyncio.CancelledError)):
                    # The caller went away: release the request wherever it lives.
                    d.handle.abort.remote(rid)
                    raise
                if not (_actor_lost(exc) or isinstance(exc, RuntimeError)):
                    raise
                self._lose(d, rid, request_id, exc, run)
                if run.migrations > self.max_migrations:
                    yield _gave_up(request_id, run)
                    return

    async def _decode_for(self, decode_worker: Optional[str],
                          run: "_Progress") -> Optional[WorkerRef]:
        """The decode worker the router chose, while it is up and none was lost; else the
        first one up before `run.recover_by` (None: none came)."""
        d = next((w for w in self.decode + self.prefill if w.worker_id == decode_worker),
                 None) if decode_worker and not run.lost else None
        if d is None or not d.healthy:
            d = await self.wait_for_decode(run.lost, run.recover_by)
        return d

    def _call(self, d: WorkerRef, request: GenerationRequest, run: "_Progress",
              disaggregate: bool, prefill_worker: Optional[str]):
        """The stream of `request` on `d`: resumed after the tokens streamed so far, or with
        its prompt computed by a prefill worker (the chosen one if up, else any), or here.
        The chosen one may be another decode worker: one that holds the prompt's prefix
        computes only the rest and ships the KV, a fetch from a peer (the same transfer,
        credits and failure handling as a prefill worker's)."""
        if run.streamed:
            return d.handle.generate.remote(request, resume_output_ids=list(run.streamed),
                                            resume_text_len=run.text_len)
        p = (next((w for w in self.prefill + self.decode if w.worker_id == prefill_worker
                   and w.healthy and w is not d), None)
             or self._pick([w for w in self.prefill if w is not d], set())) \
            if disaggregate else None  # (not itself: a prefill worker standing in for decode)
        if p is not None:
            # (its degree, when its load report says: how our ranks cut their receives)
            return d.handle.generate_disaggregated.remote(
                request, p.handle, p.load.get("tensor_parallel_size"))
        return d.handle.generate.remote(request)

    @staticmethod
    def _received(chunk: StreamChunk, request_id: str, d: WorkerRef,
                  run: "_Progress") -> StreamChunk:
        """A worker's chunk as the caller gets it: what it streamed remembered (for a
        migration), stamped with the caller's request id, the worker and the migrations; a
        chunk of another version becomes an error chunk."""
        if getattr(chunk, "version", None) != STREAM_CHUNK_VERSION:
            return _version_mismatch(d.worker_id, chunk)
        if chunk.error is None:
            run.streamed.extend(chunk.token_ids)
            run.text_len += len(chunk.text or "")
            chunk.request_id, chunk.worker_id = request_id, d.worker_id
            chunk.migrations = run.migrations
        return chunk

    def _lose(self, d: WorkerRef, rid: str, request_id: str, exc: BaseException,
              run: "_Progress") -> None:
        """`d` lost during the request: marked down, told to drop it if it still lives, and
        the request's next attempt given a fresh recovery wait."""
        log.warning("decode worker %s lost during %s (%s); migrating with %d tokens",
                    d.worker_id, request_id, type(exc).__name__, len(run.streamed))
        d.healthy = False
        run.lost.add(d.worker_id)
        try:
            d.handle.abort.remote(rid)  # if it still lives, free what it holds
        except Exception:
            pass
        run.migrations += 1
        self.migrations += 1
        run.recover_by = time.monotonic() + self.recovery_wait_s
