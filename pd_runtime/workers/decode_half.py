"""The decode half of a disaggregated request, on the decode worker: the request's whole flow
with its fallbacks, the prefill running on another worker.

In order: reserve blocks (ReservationQueue: wait while none are free, up to a deadline) ->
expect them in the transfer agent -> ask the prefill worker -> stream its first token -> wait
for the KV to land -> continue decoding. Prefill worker lost or its call failed before a token:
prefill here. Transfer failed after the token: prefill here too, keeping the token. The prefill
half is prefill_half.py.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import enum
import logging
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Optional

from pd_runtime.api import (DeadlineExceededError, EngineOverloadedError, GenerationRequest,
                            InvalidRequestError, StreamChunk)

log = logging.getLogger(__name__)


class Stage(enum.Enum):
    """Where a disaggregated request stands on its decode worker."""

    RESERVING = "reserving"    # waiting for KV blocks here (ReservationQueue)
    PREFILLING = "prefilling"  # blocks reserved and expected; the prefill worker computes
    RECEIVING = "receiving"    # its first token streamed; the KV lands in the reservation
    FALLBACK = "fallback"      # no token came (prefill worker lost, late or refusing): the
                               # engine prefills here, into the reservation
    DECODING = "decoding"      # KV landed (or given up after the token): the engine decodes


_NEXT = {Stage.RESERVING: {Stage.PREFILLING}, Stage.PREFILLING: {Stage.RECEIVING, Stage.FALLBACK},
         Stage.RECEIVING: {Stage.DECODING}, Stage.FALLBACK: set(), Stage.DECODING: set()}


@dataclass
class RemotePrefill:
    """One disaggregated request on its decode worker (`PDWorker.remote_prefills`), from the
    reservation to its last chunk, which carries the timings; then it is dropped."""

    request_id: str
    stage: Stage = Stage.RESERVING
    arrival: Optional[asyncio.Future] = None  # the receive's end: the agent's on_release
    landed: Optional[bool] = None             # the receive ended: with the KV in (True) or not
    first_at: Optional[float] = None          # when the first token was taken in
    prefill_s: Optional[float] = None         # prefill call -> first token back
    transfer_s: Optional[float] = None        # first token -> KV landed (or given up)
    kv_arrived: bool = False

    def to(self, stage: Stage) -> None:
        if stage not in _NEXT[self.stage]:
            raise RuntimeError(f"{self.request_id}: no way from {self.stage.value} to "
                               f"{stage.value}")
        self.stage = stage

    # -- on the engine thread -----------------------------------------------------------------
    def take_first_token(self, engine, token: int, logprob):
        """The first token goes into the engine; the KV may have landed already."""
        out = engine.remote.accept_first_token(self.request_id, token, logprob)
        self.first_at = time.monotonic()
        self.to(Stage.RECEIVING)
        self._land(engine)
        return out

    def receive_ended(self, engine, arrived: bool) -> None:
        """The agent ended the receive (PDWorker._on_release posts this to the engine loop the
        moment it does): decoding starts here, without a round trip through the event loop.
        Also the event loop's backstop when the agent never ended it (arrived False)."""
        if self.landed is None:
            self.landed = arrived
        self._land(engine)

    def _land(self, engine) -> None:
        """First token in and receive ended, in either order: to the engine's queue, with the
        KV (it landed) or to prefill here (it did not; the token stands). Once."""
        if self.stage is not Stage.RECEIVING or self.landed is None \
                or self.request_id not in engine.remote.waiting:  # (aborted meanwhile)
            return
        self.transfer_s, self.kv_arrived = time.monotonic() - self.first_at, self.landed
        self.to(Stage.DECODING)
        engine.remote.complete(self.request_id, kv_arrived=self.landed)


class ReservationQueue:
    """Decode side: remote prefills waiting for KV blocks, first come first served. The engine
    loop calls `tick` after every step and command (the only places blocks are freed), so a
    reservation is made the moment its blocks are free, in order; nothing polls. Every method
    runs on the engine thread; each waiter's future is resolved on its own event loop."""

    def __init__(self):
        self._waiting: collections.OrderedDict[str, tuple[Any, asyncio.Future]] = \
            collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._waiting)

    def add(self, request_id: str, make, future: asyncio.Future) -> None:
        """Queue `make(engine)` (a reservation, or None while no blocks are free)."""
        self._waiting[request_id] = (make, future)

    def withdraw(self, request_id: str) -> bool:
        """False when the reservation was made already (the future has it, or will)."""
        return self._waiting.pop(request_id, None) is not None

    def tick(self, engine) -> None:
        while self._waiting:
            request_id, (make, future) = next(iter(self._waiting.items()))
            try:
                result, error = make(engine), None
            except Exception as exc:  # invalid: the caller gets the error
                result, error = None, exc
            if result is None and error is None:
                return  # the head waits for blocks, and the rest behind it
            del self._waiting[request_id]
            future.get_loop().call_soon_threadsafe(_settle_reservation, future, result, error)


def _settle_reservation(future: asyncio.Future, result, error) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


async def _reserve(worker, request_id, prompt, params, priority, cache_salt):
    """Blocks for the prompt, reserved in the decode engine (ReservationQueue): at once when
    free, else as soon as they are, within `reservation_timeout_s`."""
    loop = worker._engine_loop()
    future = asyncio.get_running_loop().create_future()

    def make(engine):
        return engine.remote.reserve(request_id, prompt, params, priority, cache_salt)

    await loop.call(lambda e: worker.reservations.add(request_id, make, future))
    try:
        return await asyncio.wait_for(asyncio.shield(future), worker.reservation_timeout_s)
    except asyncio.TimeoutError:
        if await loop.call(lambda e: worker.reservations.withdraw(request_id)):
            raise EngineOverloadedError(
                f"decode worker {worker.worker_id} had no free KV blocks for "
                f"{worker.reservation_timeout_s:.0f}s", retry_after_s=1.0) from None
        return await future  # made as the deadline passed: ours after all
    except asyncio.CancelledError:  # the caller went away: leave nothing reserved
        if not await loop.call(lambda e: worker.reservations.withdraw(request_id)):
            with contextlib.suppress(Exception):
                await future
                await loop.call(lambda e: e.abort(request_id))
        raise


async def _await_transfer(worker, request_id: str) -> bool:
    """True once the KV is in our blocks; False (and our blocks no longer written) when the
    transfer failed: the prefill side refused or gave up the send (it tells us on the link,
    `KVTransferAgent.cancel_at_peer`), the link died (the agent's liveness check), or the
    deadline passed. The agent's own end of the transfer (`on_release`, which comes only once
    nothing more can be written) resolves the wait, and has already moved the request on in the
    engine (`RemotePrefill.receive_ended`); nothing polls."""
    from pd_runtime.kv_transfer.base import TransferState

    # The agent fails the transfer itself at its deadline; this bound is only a backstop.
    status = await _settled(worker, request_id, worker.agent.transfer_timeout_s + 5.0)
    if status is None:
        worker.agent.cancel(request_id)
        status = await _settled(worker, request_id, 5.0)
        if status is None:
            log.error("KV transfer for %s did not end after its cancel", request_id)
            return False
    if status.state is not TransferState.DONE:
        log.warning("KV transfer for %s failed (%s); prefilling locally", request_id,
                    status.reason)
    return status.state is TransferState.DONE


async def cancel_receive(worker, request_id: str) -> None:
    """Cancel our receive of request_id and wait until the agent has ended it (a chunk being
    read into the reserved blocks finishes first): only then may the blocks be written or
    freed here. No-op when no receive is awaited."""
    record = worker.remote_prefills.get(request_id)
    arrival = record.arrival if record is not None else None
    worker.agent.cancel(request_id)
    if arrival is not None and not arrival.done():
        if await _settled(worker, request_id, 5.0) is None:
            log.error("KV receive of %s did not end after its cancel", request_id)


async def _settled(worker, request_id: str, timeout_s: float):
    """The receive's final status once the agent ended it, or None after timeout_s."""
    try:
        arrival = worker.remote_prefills[request_id].arrival
        return await asyncio.wait_for(asyncio.shield(arrival), timeout_s)
    except asyncio.TimeoutError:
        return None


class PrefillRate:
    """Seconds per uncached prompt token of remote prefills, call to first token, as this
    decode worker measured them (queueing at the prefill worker included): the hedge's clock.
    """

    def __init__(self, prior_s_per_token: float = 1e-3, weight: float = 0.2):
        self.s_per_token = prior_s_per_token
        self.weight = weight

    def observe(self, tokens: int, seconds: float) -> None:
        sample = seconds / max(tokens, 1)
        self.s_per_token += self.weight * (sample - self.s_per_token)

    def hedge_after_s(self, tokens: int, min_s: float, factor: float, ceiling_s: float) -> float:
        return min(ceiling_s, min_s + factor * tokens * self.s_per_token)


# A prefill that has not answered by then is checked on: its worker must answer a ping (no
# engine step in the way) within _ALIVE_TIMEOUT_S, or it is taken for stopped and the prefill
# is hedged at once rather than at the hedge deadline.
_ALIVE_CHECK_AFTER_S = 0.4
_ALIVE_TIMEOUT_S = 0.3


async def _first_token(prefill_worker, call, hedge_s: float) -> StreamChunk:
    """The prefill call's answer; asyncio.TimeoutError at hedge_s, or sooner when the prefill
    worker stops answering (stopped, hung, or its node gone)."""
    task = asyncio.ensure_future(call)
    deadline = time.monotonic() + hedge_s
    try:
        done, _ = await asyncio.wait({task}, timeout=min(hedge_s, _ALIVE_CHECK_AFTER_S))
        while not done:
            left = deadline - time.monotonic()
            if left <= 0:
                raise asyncio.TimeoutError
            try:
                await asyncio.wait_for(prefill_worker.ping.remote(), _ALIVE_TIMEOUT_S)
            except asyncio.TimeoutError:
                if not task.done():
                    raise
            except Exception:  # dead: the call itself fails and says so
                pass
            done, _ = await asyncio.wait({task}, timeout=min(max(0.0, left), 0.5))
        return task.result()
    finally:
        if not task.done():
            task.cancel()


async def run_remote_prefill(worker, request: GenerationRequest,
                             prefill_worker) -> AsyncIterator[StreamChunk]:
    """Yields the first token's chunk (or an error chunk); the rest streams from the engine.
    The request's record (RemotePrefill, in worker.remote_prefills) is the caller's to drop
    once the stream ended."""
    request_id = request.request_id
    loop = worker._engine_loop()
    if request.deadline is not None and time.time() > request.deadline:
        yield StreamChunk.from_error(DeadlineExceededError(
            f"request {request_id} arrived after its deadline"))
        return
    record = worker.remote_prefills[request_id] = RemotePrefill(request_id)
    try:
        res = await _reserve(worker, request_id, request.prompt, request.params,
                             request.priority, request.cache_salt)
    except (InvalidRequestError, EngineOverloadedError) as exc:
        yield StreamChunk.from_error(exc)
        return
    loop.post(lambda e: worker._watch(request))  # reserved: the request is in the engine
    # Resolved by the agent's on_release when the receive ends (PDWorker._on_release).
    record.arrival = asyncio.get_running_loop().create_future()
    record.to(Stage.PREFILLING)
    async with contextlib.aclosing(_remote_prefill(worker, loop, record, request,
                                                   prefill_worker, res)) as gen:
        async for chunk in gen:
            yield chunk


async def _remote_prefill(worker, loop, record: RemotePrefill, request: GenerationRequest,
                          prefill_worker, res) -> AsyncIterator[StreamChunk]:
    request_id = record.request_id
    worker.agent.expect(request_id, res.missing_block_ids,
                        peer_degree=await worker.prefill_degree(prefill_worker))
    skip = res.num_cached_tokens // res.block_size
    uncached = res.num_prompt_tokens - res.num_cached_tokens
    hedge_s = worker.prefill_rate.hedge_after_s(
        uncached, worker.hedge_min_s, worker.hedge_factor, worker.remote_prefill_timeout_s)
    started = time.monotonic()
    # A call the prefill worker starts later than its liveness check gives it may have been
    # hedged already: it is refused there, never computed twice.
    start_by = min(hedge_s, _ALIVE_CHECK_AFTER_S + _ALIVE_TIMEOUT_S - 0.1)  # before any hedge
    try:
        first = await _first_token(prefill_worker, prefill_worker.prefill.remote(
            request, worker.agent.metadata(), res.missing_block_ids, skip,
            not_after=time.time() + start_by), hedge_s)
        if first.error is not None:
            raise RuntimeError(first.error.message)
    except Exception as exc:  # lost, late or refused: prefill here, into our reservation
        late = isinstance(exc, asyncio.TimeoutError)
        log.warning("remote prefill of %s %s; prefilling locally", request_id,
                    f"late after {hedge_s:.2f}s (hedged)" if late else
                    f"failed ({type(exc).__name__})")
        # Streamed layers may be landing in our blocks right now: they are ours again only
        # once the receive has ended (the agent ends it after the chunk being read).
        await cancel_receive(worker, request_id)
        if late:
            worker.hedged_prefills += 1
            try:  # so it is not computed twice; a stopped worker drops it when it wakes
                prefill_worker.abort.remote(request_id)
            except Exception:
                pass
        record.to(Stage.FALLBACK)
        await loop.call(lambda e: e.remote.fail(request_id))
        return
    record.prefill_s = time.monotonic() - started
    worker.prefill_rate.observe(uncached, record.prefill_s)
    token = first.token_ids[0]
    logprob = first.logprobs[0] if first.logprobs else None
    # Our engine decides what the token means (text, stop strings, the end of the request).
    out = await loop.call(lambda e: record.take_first_token(e, token, logprob))
    if out.finished:  # the token ends the request: free the reservation before telling
        # The sender's send fails on our cancel; our blocks are ours once the receive ended.
        await cancel_receive(worker, request_id)
        await loop.call(lambda e: record.receive_ended(e, False))
        yield StreamChunk.from_output(out, "disaggregated")
        return
    yield StreamChunk.from_output(out, "disaggregated")
    # The engine loop moves the request on when the receive ends (on_release); this wait is
    # for the log and a backstop for a receive the agent never ended.
    arrived = await _await_transfer(worker, request_id)
    await loop.call(lambda e: record.receive_ended(e, arrived))
