"""The engine-facing KV transfer agent: non-blocking send/expect/cancel/poll over any Transport.
Background threads per peer link do the wire work; every wait has a deadline.

Queue lifecycle, sender side: send() admits a (request, layers) chunk against the link's credit
window and queue bound (else WOULD_BLOCK) -> the link's writer ships header + regions -> the
receiver acks each chunk, returning credits -> the last ack makes the transfer DONE and ends the
lease. Receiver side: expect() records the reservation -> the link's reader writes arriving
regions straight into the reserved blocks -> checksums verified -> DONE once all layers landed.
Either side may fail a transfer (deadline, cancel, checksum, peer lost); the other side is told
with a nack/abort frame, and a lost link fails every transfer on it.
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Optional, Sequence

import torch

from pd_runtime.kv_transfer.base import (AgentMetadata, BlockIdError, DuplicateRequestError, FailureReason, LinkState,
                              ReleaseCallback, Role, SendOutcome, Transport, TransferStatus,
                              UnknownPeerError)
from pd_runtime.kv_transfer.faults import FaultInjectingTransport, FaultSettingsError, LinkFaults
from pd_runtime.kv_transfer.flow import SendableSignal, Transfer
from pd_runtime.kv_transfer.layout import KVLayout, merge_runs
from pd_runtime.kv_transfer.peer import PeerTable
from pd_runtime.kv_transfer.transfers import TransferBook
from pd_runtime.kv_transfer.wire import Wire


class KVTransferAgent:
    """One per worker. Thread-safe; every public method returns without waiting on the wire.

    Finished transfers are reported once each, one of two ways. With on_release, the agent
    calls on_release(status) on an agent thread exactly once per transfer when it finishes,
    and keeps nothing for poll() (which then returns []): for a sender that is the end of the
    source-block lease, for a receiver the moment the destination blocks are no longer
    written. Keep it short. Without on_release, poll() returns those statuses, and each waits
    for it. Either way no per-request entry outlives its transfer (table_sizes() shows them);
    status() also answers for the latest transfers that finished.

    Composed of: a TransferBook (transfer state and the lock), a PeerTable (links and their
    threads) and a Wire (what those threads, and send(), do with a transfer's bytes)."""

    def __init__(self, transport: Transport, kv_caches: Sequence[torch.Tensor], *, engine_id: str,
                 model_id: str, handshake_timeout_s: float, transfer_timeout_s: float,
                 lease_timeout_s: float, credit_window_bytes: int, max_queued_sends: int,
                 checksums: bool, on_release: Optional[ReleaseCallback] = None,
                 heartbeat_interval_s: float = 0.5, peer_timeout_s: float = 5.0,
                 extra: Optional[dict] = None):
        self.layout = KVLayout(kv_caches)
        self.transport = transport
        self.engine_id = engine_id
        self.transfer_timeout_s = transfer_timeout_s
        self.lease_timeout_s = lease_timeout_s
        self.checksums = checksums
        self.on_release = on_release
        self.book = TransferBook(on_release)
        self._lock = self.book.lock
        # The book's tables, by the names the tests count them with.
        self._sending, self._receiving, self._reserved = self.book.sending, self.book.receiving, self.book.reserved
        self.metrics_data = self.book.metrics
        self.active = self.book.active
        self._closing = threading.Event()
        self._metadata = AgentMetadata(
            engine_id=engine_id, backend=transport.name, address=transport.address(),
            model_id=model_id, dtype=str(self.layout.dtype).replace("torch.", ""),
            block_size=self.layout.block_size, num_layers=self.layout.num_layers,
            num_kv_heads=self.layout.num_kv_heads, head_dim=self.layout.head_dim,
            num_blocks=self.layout.num_blocks, extra=dict(extra or {}))
        self.peers = PeerTable(transport, self._metadata, lock=self._lock, closing=self._closing,
                               active=self.active, handshake_timeout_s=handshake_timeout_s,
                               heartbeat_interval_s=heartbeat_interval_s, peer_timeout_s=peer_timeout_s,
                               credit_window_bytes=credit_window_bytes, max_queued_sends=max_queued_sends,
                               sendable=SendableSignal())
        self.wire = Wire(self.layout, self.book, self.peers, checksums=checksums)
        self.peers.start(self.wire)
        self._monitor = threading.Thread(target=self._monitor_loop, name=f"kvt-monitor-{engine_id}", daemon=True)
        self._monitor.start()

    # ----- handshake -----
    def metadata(self) -> bytes:
        """msgpack handshake metadata to publish to peers."""
        return self._metadata.encode()

    @property
    def agent_metadata(self) -> AgentMetadata:
        return self._metadata

    def connect(self, peer_metadata: bytes) -> str:
        """Start (or restart after a failure) a link to a peer; returns its peer id at once.
        Raises MetadataMismatchError when the peer's KV layout differs from ours."""
        return self.peers.connect(AgentMetadata.decode(peer_metadata))

    def peer_state(self, peer_id: str) -> tuple[LinkState, Optional[str]]:
        return self.peers.state(peer_id)

    # ----- sender side -----
    def add_sendable_listener(self, listener: Callable[[], None]) -> None:
        """`listener()` is called (on a link thread, under the agent lock: it must not block)
        whenever a send refused with WOULD_BLOCK, or refused for a link not up yet, may now be
        accepted. A sender waits for it instead of polling."""
        self.peers.sendable.add(listener)

    def send(self, peer_id: str, request_id: str, src_block_ids: Sequence[int],
             dst_block_ids: Sequence[int], layers: Optional[Sequence[int]] = None,
             heads: Optional[tuple[range, range]] = None) -> SendOutcome:
        """Queue layers (default: all) of a request's blocks for the peer. The first ACCEPTED call
        for a request id starts the lease on src_block_ids; later calls add layers (same ids).
        `heads` (source range of this cache's KV heads, destination range of the peer's, of one
        width): only those heads move (between tensor-parallel ranks, kv_transfer/reshard.py);
        the receiver must expect the same destination range."""
        layers = list(range(self.layout.num_layers)) if layers is None else [int(x) for x in layers]
        self.layout.check_layers(layers)
        if heads is not None:
            self.layout.check_heads(heads[0])
            if len(heads[0]) != len(heads[1]):
                raise BlockIdError(f"{len(heads[0])} source heads but {len(heads[1])} "
                                   "destination heads")
        with self._lock:
            peer = self.peers.get(peer_id)
            if peer is None:
                raise UnknownPeerError(f"no link to peer {peer_id!r}; connect() first")
            if peer.state is LinkState.FAILED:
                return SendOutcome.PEER_UNAVAILABLE
            transfer = self.book.sending.get(request_id)
            block_ids = (tuple(src_block_ids), tuple(dst_block_ids))
            if transfer is None:
                self.layout.check_block_ids(src_block_ids, "source")
                runs = merge_runs(src_block_ids, dst_block_ids)
                now = time.monotonic()
                transfer = Transfer(request_id, peer_id, Role.SEND, runs, self.layout.num_layers,
                                    self.layout.bytes_for(len(src_block_ids), 1,
                                                          len(heads[0]) if heads else None),
                                    now + min(self.transfer_timeout_s, self.lease_timeout_s),
                                    block_ids=block_ids, heads=heads)
            elif transfer.peer_id != peer_id or transfer.block_ids != block_ids \
                    or transfer.heads != heads:
                raise DuplicateRequestError(f"request {request_id!r} already sending other blocks")
            if transfer.layers_submitted.intersection(layers):
                raise DuplicateRequestError(f"request {request_id!r}: layers sent twice")
            num_bytes = transfer.bytes_per_layer * len(layers)
            outcome = peer.credits.admit(num_bytes, new_chunk=not transfer.queued_layers)
            if outcome is not SendOutcome.ACCEPTED:
                self.metrics_data.would_block += 1
                return outcome
            self.book.sending[request_id] = transfer
            transfer.credits = peer.credits
            transfer.layers_submitted.update(layers)
            transfer.queued_sends = 1
            transfer.queued_layers.extend(layers)
            waiting_ack = transfer.unacked_bytes > 0
            transfer.unacked_bytes += num_bytes
            # Post from this thread when nothing of the request is unacked, and for the request's
            # last layers (with any still waiting): the writer thread then only watches for
            # completion, its wake-up off the critical path. Layers sent behind an unacked chunk
            # wait, and leave together as one chunk when its ack comes (the reader posts them)
            # or with the last layers: a prefill that outran the wire pays one header and ack
            # for its backlog, not one per layer, and wakes no thread meanwhile.
            asynchronous = peer.state is LinkState.READY and peer.link.posts_async
            last = len(transfer.layers_submitted) == transfer.num_layers
            if (asynchronous and not transfer.pending_failure and (not waiting_ack or last)
                    and peer.send_lock.acquire(blocking=False)):
                layers = self.wire.take_queued(peer, transfer)
            else:
                if not (asynchronous and waiting_ack) or last:
                    self.wire.kick_writer(peer, transfer)
                if not self.active.is_set():  # (set by an earlier chunk of it: keep its pace)
                    self.active.mark()
                return SendOutcome.ACCEPTED
        self.wire.post_taken(peer, transfer, layers)
        with self._lock:
            # Marked only now: marking wakes this agent's link readers into fast polling (for
            # the ack), and while the chunk is posted they would only contend for the GIL and
            # the CPU with this thread. A transfer that already finished is not marked again.
            if not transfer.finished:
                self.active.mark()
        return SendOutcome.ACCEPTED

    # ----- receiver side -----
    def expect(self, request_id: str, dst_block_ids: Sequence[int], peer_id: Optional[str] = None,
               heads: Optional[range] = None) -> None:
        """Announce reserved destination blocks; only a transfer naming exactly these blocks may
        write them. Fails with TIMEOUT if nothing completes within transfer_timeout_s.
        `heads`: only this range of the cache's KV heads arrives (from the sender that names
        it; tensor-parallel resharding)."""
        self.layout.check_block_ids(dst_block_ids, "destination")
        self.layout.check_heads(heads)
        with self._lock:
            if request_id in self.book.receiving:
                raise DuplicateRequestError(f"request {request_id!r} already expected")
            transfer = Transfer(request_id, peer_id or "", Role.RECV, [], self.layout.num_layers,
                                self.layout.bytes_for(len(dst_block_ids), 1,
                                                      len(heads) if heads else None),
                                time.monotonic() + self.transfer_timeout_s,
                                heads=None if heads is None else (None, heads))
            self.book.receiving[request_id] = transfer
            self.book.reserved[request_id] = sorted(int(b) for b in dst_block_ids)
            self.active.mark()

    # ----- both sides -----
    def cancel(self, request_id: str) -> None:
        """Cancel on this side; the peer is told and fails its side with CANCELLED."""
        with self._lock:
            for table in (self.book.sending, self.book.receiving):
                transfer = table.get(request_id)
                if transfer is not None:
                    self.wire.fail(transfer, FailureReason.CANCELLED, notify_peer=True)

    def cancel_at_peer(self, peer_id: str, request_id: str) -> bool:
        """For a send that never started here (refused, or given up before it began): tell
        the peer, whose receive of request_id then fails with CANCELLED at once instead of at
        its deadline. False when there is no live link (the peer's own liveness check ends
        its receive then)."""
        with self._lock:
            peer = self.peers.get(peer_id)
            return peer is not None and peer.enqueue(("ctl", {
                "t": "abort", "rid": request_id, "reason": FailureReason.CANCELLED.value}))

    def status(self, request_id: str, role: Role) -> Optional[TransferStatus]:
        """The transfer's status while it is pending, and for a while after it finished (the
        latest transfers.RECENT_STATUSES finished ones are remembered); None when unknown."""
        with self._lock:
            return self.book.status(request_id, role)

    def poll(self) -> list[TransferStatus]:
        """Transfers finished since the last poll; each ends its lease/reservation (see class
        doc). Always [] for an agent built with on_release: those statuses went to it."""
        with self._lock:
            return self.book.drain()

    def table_sizes(self) -> dict[str, int]:
        """Entries in every structure that holds something per request or per chunk: the
        transfers pending on each side, reserved destinations, statuses waiting for poll(),
        remembered statuses (bounded), and per link the frames and chunks waiting for its
        writer and the posted chunks it watches. All but `recent` are 0 once nothing moves."""
        with self._lock:
            sizes = self.book.sizes()
            peers = self.peers.all()
        sizes["link_queues"] = sum(p.out_queue.qsize() for p in peers)
        sizes["posted_chunks"] = sum(len(p.posted) for p in peers)
        return sizes

    def metrics(self) -> dict:
        with self._lock:
            in_flight = sum(p.credits.unacked_bytes for p in self.peers.all())
            snapshot = self.metrics_data.snapshot(in_flight)
        if isinstance(self.transport, FaultInjectingTransport):
            snapshot["link_faults"] = self.transport.counts()
        return snapshot

    def set_link_faults(self, *, drop: float = 0.0, corrupt: float = 0.0, duplicate: float = 0.0,
                        delay: float = 1.0, delay_s: float = 0.0, seed: int = 0,
                        max_faults: Optional[int] = None) -> None:
        """Testing only (KVTransferConfig.fault_injection). From now on each KV chunk this agent
        sends, on every link, is dropped, corrupted or duplicated with these probabilities, and
        held delay_s seconds with probability delay; after max_faults faulty chunks the links
        are clean again. No arguments: clean links. pd_runtime/kv_transfer/faults.py says what each fault
        leads to. Raises FaultSettingsError for values out of range, corrupt without checksums,
        or an agent built without fault injection."""
        if not isinstance(self.transport, FaultInjectingTransport):
            raise FaultSettingsError("link faults need an agent built with kv_transfer.fault_injection: true")
        faults = LinkFaults(drop=drop, corrupt=corrupt, duplicate=duplicate, delay=delay,
                            delay_s=delay_s, seed=seed, max_faults=max_faults)
        if faults.corrupt and not self.checksums:
            raise FaultSettingsError("link fault 'corrupt' needs kv_transfer.checksums: true "
                                     "(without them the flipped byte would land unnoticed)")
        self.transport.set_faults(faults)

    def close(self) -> None:
        self._closing.set()
        self.peers.close_all()
        with self._lock:
            for transfer in self.book.pending():
                self.wire.fail(transfer, FailureReason.SHUTDOWN, notify_peer=False)
        self.transport.close()

    def _monitor_loop(self) -> None:
        while not self._closing.wait(0.05):
            now = time.monotonic()
            with self._lock:
                for transfer in self.book.pending():
                    if now > transfer.deadline:
                        self.wire.fail(transfer, FailureReason.TIMEOUT, notify_peer=True)
