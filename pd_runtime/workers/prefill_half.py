"""The prefill half of a disaggregated request, on the prefill worker: compute the prompt and
its first token (serve_prefill, PDWorker.prefill's body), ship the prompt's KV blocks to the
decode worker's reservation, layer by layer as the prompt's last step computes
them (LayerStreamer, the request's record here: computing -> shipping -> ended) and the rest
after it (ship_kv), under the link's backpressure; and how much of each transfer the compute
hid (TransferOverlap). The decode half is decode_half.py.
"""

from __future__ import annotations

import asyncio
import collections
import enum
import logging
import time
from typing import Optional

from pd_runtime.api import (EngineOverloadedError, GenerationRequest, InvalidRequestError,
                            StreamChunk)

log = logging.getLogger(__name__)


class ShipStage(enum.Enum):
    """Where a disaggregated request stands on its prefill worker."""

    COMPUTING = "computing"  # the prompt's last step runs (or waits); no byte queued yet
    SHIPPING = "shipping"    # a transfer holds the blocks: layers queued, the rest to follow
    ENDED = "ended"          # the transfer's lease ended (done or failed): blocks released


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

    @property
    def stage(self) -> ShipStage:
        """From the fields each thread sets once (the engine's or ship_kv's first accepted send,
        the agent's on_release), so no thread can move it backwards."""
        if self.ended is not None:
            return ShipStage.ENDED
        return ShipStage.COMPUTING if self.first_sent_at is None else ShipStage.SHIPPING

    def layer_done(self, layer: int, block_ids: list[int]) -> None:
        from pd_runtime.kv_transfer.base import LinkState, SendOutcome

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


async def ship_kv(worker, request_id: str, peer_id: str, dst_block_ids: list[int],
                  skip_blocks: int, streamer: Optional["LayerStreamer"] = None) -> str:
    """Send the held blocks; returns the send outcome. Anything but 'accepted' releases them
    now; after 'accepted' the lease's end releases them."""
    from pd_runtime.kv_transfer.base import LinkState, SendOutcome

    loop = worker._engine_loop()
    # Layers the prompt's last step already queued (LayerStreamer): the transfer exists and
    # holds a lease on the blocks, which its end (on_release) frees, whatever happens here;
    # it may have ended already (every layer acked, or failed) before this task ran.
    streamed = streamer is not None and streamer.stage is not ShipStage.COMPUTING
    layers = sorted(streamer.pending) if streamer is not None and streamer.send else None
    if streamed and streamer.stage is ShipStage.ENDED:
        worker.shipments.pop(request_id, None)
        return SendOutcome.ACCEPTED.value if not layers else f"ended:{streamer.ended}"
    if worker.fault_delay_kv_send_s:
        await asyncio.sleep(worker.fault_delay_kv_send_s)
    if request_id in worker.cancelled:  # the decode side gave up while we prefilled
        worker.cancelled.pop(request_id, None)
        worker.shipments.pop(request_id, None)
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
        worker.shipments.pop(request_id, None)
        if streamed:  # the layers already queued hold a lease: end it, and it frees them
            worker.agent.cancel(request_id)
        else:  # no transfer here to fail: tell the decode side on the link, free the blocks
            worker.agent.cancel_at_peer(peer_id, request_id)
            await loop.call(lambda e: e.remote.release_held(request_id))
    return outcome.value


def _peer_for(worker, metadata: bytes) -> str:
    """The agent's link to the decode worker that sent `metadata`: made once, again if failed."""
    from pd_runtime.kv_transfer.base import LinkState
    from pd_runtime.kv_transfer.group import peer_engine_id

    engine_id = peer_engine_id(metadata)
    peer_id = worker._peers.get(engine_id)
    if peer_id is None or worker.agent.peer_state(peer_id)[0] is LinkState.FAILED:
        peer_id = worker.agent.connect(metadata)
        worker._peers[engine_id] = peer_id
    return peer_id


async def serve_prefill(worker, request: GenerationRequest, decode_metadata: bytes,
                        dst_block_ids: list[int], skip_blocks: int,
                        not_after: Optional[float]) -> StreamChunk:
    """PDWorker.prefill: the first token's chunk (or an error chunk); ship_kv runs on."""
    request_id = request.request_id
    loop = worker._engine_loop()
    late = not_after is not None and time.time() > not_after
    if worker.cancelled.pop(request_id, None) is not None or late:
        return StreamChunk.from_error(RuntimeError(
            f"request {request_id} was cancelled" + (" (started after its hedge)" if late else "")),
            499)
    peer_id = _peer_for(worker, decode_metadata)
    first_params = request.params.first_token_only()
    streamer = LayerStreamer(worker, request_id, peer_id, dst_block_ids, skip_blocks,
                             worker.stream_layers)
    now = time.monotonic()  # a record whose transfer never started cannot outlive this
    worker.shipments = {r: s for r, s in worker.shipments.items() if now - s.created < 600}
    worker.shipments[request_id] = streamer
    q = loop.open_stream(request_id)
    try:
        await loop.call(lambda e: (e.add_request(request_id, request.prompt, first_params,
                                                 cache_salt=request.cache_salt,
                                                 hold_blocks=True,
                                                 layer_sink=streamer.layer_done),
                                   worker._watch(request)))
    except (InvalidRequestError, EngineOverloadedError) as exc:
        loop.close_stream(request_id)
        worker.shipments.pop(request_id, None)
        return StreamChunk.from_error(exc)
    out = await q.get()
    if out is None or isinstance(out, Exception):  # aborted while prefilling (abort() already
        worker.cancelled.pop(request_id, None)      # freed its blocks), or past its deadline
        worker.shipments.pop(request_id, None)
        return StreamChunk.from_error(out) if out is not None else \
            StreamChunk.from_error(RuntimeError(f"request {request_id} was cancelled"), 499)
    task = asyncio.ensure_future(ship_kv(worker, request_id, peer_id, dst_block_ids,
                                         skip_blocks, streamer))
    worker.ship_tasks[request_id] = task  # the decode side learns the outcome on the link
    task.add_done_callback(lambda _: worker.ship_tasks.pop(request_id, None))
    return StreamChunk.from_output(out, "disaggregated")
