"""Backpressure and failure bookkeeping: per-link credit window and queue bound, transfer
records with deadlines and leases, and metrics. Callers hold the agent lock; no I/O here.
"""

from __future__ import annotations

import bisect
import logging
import time
from dataclasses import dataclass, field
from typing import Optional

from pd_runtime.kv_transfer.base import FailureReason, Role, SendOutcome, TransferState, TransferStatus
from pd_runtime.kv_transfer.layout import BlockRun


@dataclass
class Transfer:
    """One request's KV moving over one link, seen from one side."""

    request_id: str
    peer_id: str
    role: Role
    runs: list[BlockRun]
    num_layers: int
    bytes_per_layer: int
    deadline: float  # monotonic; transfer deadline, capped by the lease deadline on senders
    state: TransferState = TransferState.PENDING
    reason: Optional[FailureReason] = None
    layers_submitted: set = field(default_factory=set)  # sender: layers handed to send()
    layers_done: set = field(default_factory=set)  # acked (sender) or landed (receiver)
    unacked_bytes: int = 0  # sender: bytes counted against the link's credit window
    # Wire operations on this transfer's blocks not finished yet (a receive under way, sends
    # posted): its blocks may not be released until the last one ends; the thread ending it
    # applies a failure that came meanwhile (pending_failure).
    wire_ops: int = 0
    queued_layers: list = field(default_factory=list)  # sender: accepted, not posted yet
    queued_sends: int = 0  # sender: 1 while layers wait (one chunk against the link's queue bound)
    credits: Optional["CreditWindow"] = None  # sender: the window of the link it was admitted on
    kicked: bool = False  # sender: an item of it waits in the writer's queue
    unwatched: list = field(default_factory=list)  # sender: (peer, layers, posted) not yet handed to the writer
    pending_failure: Optional[FailureReason] = None
    started_at: float = field(default_factory=time.monotonic)
    block_ids: tuple = ()  # sender: (src ids, dst ids) as first sent, to check later layers
    # A range of the KV heads only (tensor-parallel resharding): (source heads, destination
    # heads) of the two caches, each a range; None: whole blocks. A receiver knows its own.
    heads: Optional[tuple] = None

    @property
    def finished(self) -> bool:
        return self.state in (TransferState.DONE, TransferState.FAILED)

    @property
    def num_bytes(self) -> int:
        return self.bytes_per_layer * self.num_layers

    def status(self) -> TransferStatus:
        return TransferStatus(self.request_id, self.peer_id, self.role, self.state, self.reason,
                              self.num_bytes, len(self.layers_done))


class SendableSignal:
    """Tells listeners whenever a send refused before may now be accepted: credits came back
    on a link, or a link changed state (up, or failed: the refusal is final then). Listeners
    run on a link thread under the agent lock, so they must only hand the news on (e.g.
    `loop.call_soon_threadsafe`); a caller that waits registers before it tries, so no news
    between its try and its wait is lost."""

    def __init__(self):
        self._listeners: list = []

    def add(self, listener) -> None:
        self._listeners.append(listener)

    def fire(self) -> None:
        for listener in self._listeners:
            try:
                listener()
            except Exception:  # a listener's bug must not break the link thread
                logging.getLogger(__name__).exception("sendable listener failed")


class CreditWindow:
    """Bounded unacknowledged bytes and queued sends on one link. A send that does not fit is
    refused with WOULD_BLOCK instead of waiting, so the engine loop never blocks; one send is
    always admitted on an idle link so a transfer larger than the window still moves. Room
    coming back is told to `signal`."""

    def __init__(self, window_bytes: int, max_queued_sends: int,
                 signal: Optional[SendableSignal] = None):
        self.window_bytes = window_bytes
        self.max_queued_sends = max_queued_sends
        self.unacked_bytes = 0
        self.queued_sends = 0
        self.signal = signal or SendableSignal()

    def admit(self, num_bytes: int, new_chunk: bool = True) -> SendOutcome:
        """new_chunk: False when the send joins layers of its request that wait already (they
        leave as one chunk, so the queue does not grow)."""
        if new_chunk and self.queued_sends >= self.max_queued_sends:
            return SendOutcome.WOULD_BLOCK
        if self.unacked_bytes > 0 and self.unacked_bytes + num_bytes > self.window_bytes:
            return SendOutcome.WOULD_BLOCK
        self.unacked_bytes += num_bytes
        self.queued_sends += int(new_chunk)
        return SendOutcome.ACCEPTED

    def dequeued(self, count: int = 1) -> None:
        self.queued_sends -= count
        if count:
            self.signal.fire()

    def returned(self, num_bytes: int) -> None:
        self.unacked_bytes = max(0, self.unacked_bytes - num_bytes)
        if num_bytes:
            self.signal.fire()


_LATENCY_BUCKETS_S = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0)


@dataclass
class TransferMetrics:
    bytes_sent: int = 0
    bytes_received: int = 0
    chunks_sent: int = 0  # headers posted: one per send() when the wire keeps up, fewer when not
    transfers_done: int = 0
    would_block: int = 0
    failures: dict = field(default_factory=dict)  # reason value -> count
    latency_buckets: list = field(default_factory=lambda: [0] * (len(_LATENCY_BUCKETS_S) + 1))

    send_gbps: float = 0.0  # sent transfers' bytes / their time, averaged (routing's cost model)

    def observe_finish(self, transfer: Transfer, now: float) -> None:
        if transfer.state is TransferState.DONE:
            self.transfers_done += 1
            took = now - transfer.started_at
            if transfer.role is Role.SEND and took > 0:
                gbps = transfer.bytes_per_layer * transfer.num_layers / took / 1e9
                self.send_gbps = gbps if not self.send_gbps else 0.8 * self.send_gbps + 0.2 * gbps
            index = bisect.bisect_left(_LATENCY_BUCKETS_S, now - transfer.started_at)
            self.latency_buckets[index] += 1
        else:
            key = transfer.reason.value if transfer.reason else "unknown"
            self.failures[key] = self.failures.get(key, 0) + 1

    def snapshot(self, in_flight_bytes: int) -> dict:
        return {
            "bytes_sent": self.bytes_sent,
            "bytes_received": self.bytes_received,
            "chunks_sent": self.chunks_sent,
            "transfers_done": self.transfers_done,
            "send_gbps": self.send_gbps,
            "would_block": self.would_block,
            "failures": dict(self.failures),
            "in_flight_bytes": in_flight_bytes,
            "latency_buckets_s": list(_LATENCY_BUCKETS_S),
            "latency_counts": list(self.latency_buckets),
        }
