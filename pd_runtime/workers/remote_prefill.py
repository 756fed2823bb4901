"""The two halves of a disaggregated prefill: the decode side's request flow with its
fallbacks, and the prefill side's shipping of KV blocks under backpressure.

Decode side, in order: reserve blocks (wait while none are free, up to a deadline) -> expect
them in the transfer agent -> ask the prefill worker -> stream its first token -> wait for the
KV -> continue decoding. Prefill worker lost or its call failed before a token: prefill here.
Transfer failed after the token: prefill here too, keeping the token.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from typing import Any, AsyncIterator, Optional

from pd_runtime.api import (EngineOverloadedError, InvalidRequestError, SamplingParams,
                            error_chunk, output_chunk)

log = logging.getLogger(__name__)



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
    nothing more can be written) resolves the wait; nothing polls."""
    from kv_transfer.base import TransferState

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
    arrival = worker.arrivals.get(request_id)
    worker.agent.cancel(request_id)
    if arrival is not None and not arrival.done():
        if await _settled(worker, request_id, 5.0) is None:
            log.error("KV receive of %s did not end after its cancel", request_id)


async def _settled(worker, request_id: str, timeout_s: float):
    """The receive's final status once the agent ended it, or None after timeout_s."""
    try:
        return await asyncio.wait_for(asyncio.shield(worker.arrivals[request_id]), timeout_s)
    except asyncio.TimeoutError:
        return None


class LayerStreamer:
    """Prefill side: ships each layer of a prompt's KV as the prompt's last step computes it
    (the engine calls `layer_done` from its thread, in layer order), so the transfer runs
    under the remaining layers instead of after them. A layer the link cannot take now (credit
    window full, link not up yet) is left for `ship_kv` after the step; nothing is sent once
    the request is cancelled. With `send` off it only times the step (the unstreamed baseline).
    Also what the transfer's overlap is measured from: when the last layer's K/V were ready,
    when the first byte was queued, and (`finished`) when the lease ended."""

    def __init__(self, worker, request_id: str, peer_id: str, dst_block_ids: list[int],
                 skip_blocks: int, send: bool):
        self.worker, self.request_id, self.peer_id = worker, request_id, peer_id
        self.dst_block_ids, self.skip_blocks, self.send = dst_block_ids, skip_blocks, send
        self.pending: list[int] = []    # layers left for ship_kv
        self.refused: Optional[str] = None  # a send outcome that ends the transfer here
        self.first_sent_at: Optional[float] = None
        self.kv_ready_at: Optional[float] = None
        self.ended: Optional[str] = None  # the transfer's end, once on_release reported it
        self.created = time.monotonic()

    def layer_done(self, layer: int, block_ids: list[int]) -> None:
        from kv_transfer.base import LinkState, SendOutcome

        agent = self.worker.agent
        if layer == self.worker.engine.model_config.num_layers - 1:
            self.kv_ready_at = time.monotonic()
        # (A fault-injected send delay holds every layer for ship_kv, as it holds the send.)
        if not self.send or self.refused or self.request_id in self.worker.cancelled \
                or self.worker.fault_delay_kv_send_s:
            self.pending.append(layer)
            return
        if agent.peer_state(self.peer_id)[0] is not LinkState.READY:
            self.pending.append(layer)
            return
        src = block_ids[self.skip_blocks:self.skip_blocks + len(self.dst_block_ids)]
        try:
            outcome = agent.send(self.peer_id, self.request_id, src, self.dst_block_ids, [layer])
        except Exception as exc:  # on the engine thread: refuse the send, never the step
            log.warning("KV layer send of %s refused: %s", self.request_id, exc)
            self.refused = SendOutcome.PEER_UNAVAILABLE.value
            self.pending.append(layer)
            return
        if outcome is SendOutcome.ACCEPTED:
            if self.first_sent_at is None:
                self.first_sent_at = time.monotonic()
        elif outcome is SendOutcome.WOULD_BLOCK:
            self.pending.append(layer)
        else:
            self.refused = outcome.value
            self.pending.append(layer)

    def finished(self, ok: bool) -> Optional[tuple[float, float]]:
        """(seconds of transfer after the KV was ready, seconds of the whole transfer) of a
        completed transfer, or None when there is nothing to measure. A send that started
        only after the KV was ready (unstreamed) is all exposed."""
        now = time.monotonic()
        self.ended = "done" if ok else "failed"
        if not ok or self.first_sent_at is None or self.kv_ready_at is None:
            return None
        whole = max(1e-9, now - self.first_sent_at)
        return min(whole, max(0.0, now - self.kv_ready_at)), whole


class TransferOverlap:
    """How much of each KV transfer ran under the prefill's compute, over recent transfers:
    exposed = transfer time after the prompt's last layer was ready, whole = first byte queued
    to the lease's end; hidden share = 1 - exposed / whole."""

    def __init__(self, keep: int = 256):
        self.recent: collections.deque = collections.deque(maxlen=keep)
        self.count = 0
        self.exposed_s_total = 0.0
        self.whole_s_total = 0.0

    def observe(self, exposed_s: float, whole_s: float) -> None:
        self.recent.append((exposed_s, whole_s))
        self.count += 1
        self.exposed_s_total += exposed_s
        self.whole_s_total += whole_s

    def report(self) -> dict:
        totals = {"transfers": self.count, "exposed_s_total": self.exposed_s_total,
                  "whole_s_total": self.whole_s_total}
        if not self.recent:
            return totals
        exposed = [e for e, _ in self.recent]
        whole = [w for _, w in self.recent]
        return {**totals,
                "hidden_share": 1.0 - sum(exposed) / sum(whole),
                "exposed_s_mean": sum(exposed) / len(exposed),
                "whole_s_mean": sum(whole) / len(whole)}


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


async def _first_token(prefill_worker, call, hedge_s: float) -> dict:
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


async def run_remote_prefill(worker, request_id: str, prompt: Any, params: dict, prefill_worker,
                             priority: int, cache_salt: Optional[str]) -> AsyncIterator[dict]:
    """Yields the first token's chunk (or an error chunk); the rest streams from the engine."""
    loop = worker._engine_loop()
    sampling = SamplingParams(**params)
    try:
        res = await _reserve(worker, request_id, prompt, sampling, priority, cache_salt)
    except (InvalidRequestError, EngineOverloadedError) as exc:
        yield error_chunk(exc)
        return
    # Resolved by the agent's on_release when the receive ends (PDWorker._on_release).
    worker.arrivals[request_id] = asyncio.get_running_loop().create_future()
    try:
        async with contextlib.aclosing(_remote_prefill(worker, loop, request_id, prompt, params,
                                                       prefill_worker, cache_salt, res)) as gen:
            async for chunk in gen:
                yield chunk
    finally:
        worker.arrivals.pop(request_id, None)


async def _remote_prefill(worker, loop, request_id, prompt, params, prefill_worker, cache_salt,
                          res) -> AsyncIterator[dict]:
    worker.agent.expect(request_id, res.missing_block_ids)
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
            request_id, prompt, params, worker.agent.metadata(), res.missing_block_ids, skip,
            cache_salt, not_after=time.time() + start_by), hedge_s)
        if first.get("error"):
            raise RuntimeError(first["error"]["message"])
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
        await loop.call(lambda e: e.remote.fail(request_id))
        return
    first_at = time.monotonic()
    worker.prefill_rate.observe(uncached, first_at - started)
    worker.remote_prefill_s[request_id] = first_at - started
    token = first["token_ids"][0]
    logprob = first["logprobs"][0] if first.get("logprobs") else None
    # Our engine decides what the token means (text, stop strings, the end of the request).
    out = await loop.call(lambda e: e.remote.accept_first_token(request_id, token, logprob))
    yield output_chunk(out, "disaggregated")
    arrived = False
    if not out.finished:
        arrived = await _await_transfer(worker, request_id)
    else:  # the sender's send fails on our cancel; our blocks are ours once the receive ended
        await cancel_receive(worker, request_id)
    # After the first token: how long the decode side waited for the KV to land.
    worker.kv_transfer_s[request_id] = time.monotonic() - first_at
    worker.kv_arrived[request_id] = arrived
    await loop.call(lambda e: e.remote.complete(request_id, kv_arrived=arrived))


async def ship_kv(worker, request_id: str, peer_id: str, dst_block_ids: list[int],
                  skip_blocks: int, streamer: Optional["LayerStreamer"] = None) -> str:
    """Send the held blocks; returns the send outcome. Anything but 'accepted' releases them
    now; after 'accepted' the lease's end releases them."""
    from kv_transfer.base import LinkState, SendOutcome

    loop = worker._engine_loop()
    # Layers the prompt's last step already queued (LayerStreamer): the transfer exists and
    # holds a lease on the blocks, which its end (on_release) frees, whatever happens here;
    # it may have ended already (every layer acked, or failed) before this task ran.
    streamed = streamer is not None and streamer.first_sent_at is not None
    layers = sorted(streamer.pending) if streamer is not None and streamer.send else None
    if streamed and streamer.ended is not None:
        worker.streamers.pop(request_id, None)
        return SendOutcome.ACCEPTED.value if not layers else f"ended:{streamer.ended}"
    if worker.fault_delay_kv_send_s:
        await asyncio.sleep(worker.fault_delay_kv_send_s)
    if request_id in worker.cancelled:  # the decode side gave up while we prefilled
        worker.cancelled.pop(request_id, None)
        worker.streamers.pop(request_id, None)
        if streamed:
            worker.agent.cancel(request_id)
        else:
            await loop.call(lambda e: e.remote.release_held(request_id))
        return "cancelled"
    if streamed and not layers:
        return SendOutcome.ACCEPTED.value
    if streamer is not None and streamer.refused and not streamed:
        outcome = SendOutcome(streamer.refused)
    else:
        held = await loop.call(lambda e: e.remote.held_block_ids(request_id))
        src = held[skip_blocks:skip_blocks + len(dst_block_ids)]
        deadline = time.monotonic() + worker.agent.transfer_timeout_s
        outcome = SendOutcome.PEER_UNAVAILABLE
        while True:
            # Registered before the try: room that comes back after it wakes this wait.
            room = asyncio.get_running_loop().create_future()
            worker.send_waiters.add(room)
            try:
                state, _ = worker.agent.peer_state(peer_id)
                if state is LinkState.FAILED:
                    break
                if state is LinkState.READY:
                    outcome = worker.agent.send(peer_id, request_id, src, dst_block_ids, layers)
                    if outcome is not SendOutcome.WOULD_BLOCK:
                        break
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                await asyncio.wait({room}, timeout=left)  # the link is up, or has room
            finally:
                worker.send_waiters.discard(room)
        if outcome is SendOutcome.ACCEPTED and streamer is not None \
                and streamer.first_sent_at is None:
            streamer.first_sent_at = time.monotonic()
    if outcome is not SendOutcome.ACCEPTED:
        log.warning("KV send of %s not accepted (%s)", request_id, outcome.value)
        worker.streamers.pop(request_id, None)
        if streamed:  # the layers already queued hold a lease: end it, and it frees them
            worker.agent.cancel(request_id)
        else:  # no transfer here to fail: tell the decode side on the link, free the blocks
            worker.agent.cancel_at_peer(peer_id, request_id)
            await loop.call(lambda e: e.remote.release_held(request_id))
    return outcome.value
