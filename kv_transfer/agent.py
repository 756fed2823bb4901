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
from typing import Optional, Sequence

import torch

from kv_transfer.base import (Activity, AgentMetadata, DuplicateRequestError, FailedPost, FailureReason, LinkError,
                              LinkState, LinkTimeoutError, ReleaseCallback, Role, SendOutcome,
                              Transport, TransferState, TransferStatus, UnknownPeerError,
                              frame_buffers, pack_frame)
from kv_transfer.flow import Transfer, TransferMetrics
from kv_transfer.layout import KVLayout, merge_runs, region_checksum, runs_from_wire, runs_to_wire
from kv_transfer.peer import PeerLink, PeerTable


class KVTransferAgent:
    """One per worker. Thread-safe; every public method returns without waiting on the wire.

    on_release(status) is called on an agent thread exactly once per transfer when it finishes
    (the same statuses poll() returns): for a sender that is the end of the source-block lease,
    for a receiver the moment the destination blocks are no longer written. Keep it short."""

    def __init__(self, transport: Transport, kv_caches: Sequence[torch.Tensor], *, engine_id: str,
                 model_id: str, handshake_timeout_s: float, transfer_timeout_s: float,
                 lease_timeout_s: float, credit_window_bytes: int, max_queued_sends: int,
                 checksums: bool, on_release: Optional[ReleaseCallback] = None,
                 heartbeat_interval_s: float = 0.5, peer_timeout_s: float = 5.0):
        self.layout = KVLayout(kv_caches)
        self.transport = transport
        self.engine_id = engine_id
        self.transfer_timeout_s = transfer_timeout_s
        self.lease_timeout_s = lease_timeout_s
        self.checksums = checksums
        self.on_release = on_release
        self._lock = threading.RLock()
        self._closing = threading.Event()
        self._sending: dict[str, Transfer] = {}
        self._receiving: dict[str, Transfer] = {}
        self._reserved: dict[str, list[int]] = {}
        self._finished: list[TransferStatus] = []
        self._recent: dict[tuple, TransferStatus] = {}
        self.metrics_data = TransferMetrics()
        # Set while any transfer is pending here: link readers poll fast then, and an idle
        # reader wakes on it (Link.set_activity).
        self.active = Activity()
        self._scratch = torch.empty(0, dtype=torch.uint8)
        self._metadata = AgentMetadata(
            engine_id=engine_id, backend=transport.name, address=transport.address(),
            model_id=model_id, dtype=str(self.layout.dtype).replace("torch.", ""),
            block_size=self.layout.block_size, num_layers=self.layout.num_layers,
            num_kv_heads=self.layout.num_kv_heads, head_dim=self.layout.head_dim,
            num_blocks=self.layout.num_blocks)
        self.peers = PeerTable(self, handshake_timeout_s, heartbeat_interval_s, peer_timeout_s,
                               credit_window_bytes, max_queued_sends)
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
    def send(self, peer_id: str, request_id: str, src_block_ids: Sequence[int],
             dst_block_ids: Sequence[int], layers: Optional[Sequence[int]] = None) -> SendOutcome:
        """Queue layers (default: all) of a request's blocks for the peer. The first ACCEPTED call
        for a request id starts the lease on src_block_ids; later calls add layers (same ids)."""
        layers = list(range(self.layout.num_layers)) if layers is None else [int(x) for x in layers]
        self.layout.check_layers(layers)
        with self._lock:
            peer = self.peers.get(peer_id)
            if peer is None:
                raise UnknownPeerError(f"no link to peer {peer_id!r}; connect() first")
            if peer.state is LinkState.FAILED:
                return SendOutcome.PEER_UNAVAILABLE
            transfer = self._sending.get(request_id)
            block_ids = (tuple(src_block_ids), tuple(dst_block_ids))
            if transfer is None:
                self.layout.check_block_ids(src_block_ids, "source")
                runs = merge_runs(src_block_ids, dst_block_ids)
                now = time.monotonic()
                transfer = Transfer(request_id, peer_id, Role.SEND, runs, self.layout.num_layers,
                                    self.layout.bytes_for(len(src_block_ids), 1),
                                    now + min(self.transfer_timeout_s, self.lease_timeout_s),
                                    block_ids=block_ids)
            elif transfer.peer_id != peer_id or transfer.block_ids != block_ids:
                raise DuplicateRequestError(f"request {request_id!r} already sending other blocks")
            if transfer.layers_submitted.intersection(layers):
                raise DuplicateRequestError(f"request {request_id!r}: layers sent twice")
            num_bytes = transfer.bytes_per_layer * len(layers)
            outcome = peer.credits.admit(num_bytes, new_chunk=not transfer.queued_layers)
            if outcome is not SendOutcome.ACCEPTED:
                self.metrics_data.would_block += 1
                return outcome
            self._sending[request_id] = transfer
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
                layers = self._take_queued(peer, transfer)
            else:
                if not (asynchronous and waiting_ack) or last:
                    self._kick_writer(peer, transfer)
                if not self.active.is_set():  # (set by an earlier chunk of it: keep its pace)
                    self.active.mark()
                return SendOutcome.ACCEPTED
        self._post_taken(peer, transfer, layers)
        with self._lock:
            # Marked only now: marking wakes this agent's link readers into fast polling (for
            # the ack), and while the chunk is posted they would only contend for the GIL and
            # the CPU with this thread. A transfer that already finished is not marked again.
            if not transfer.finished:
                self.active.mark()
        return SendOutcome.ACCEPTED

    def _take_queued(self, peer: PeerLink, transfer: Transfer) -> list[int]:
        """The layers of a transfer waiting to be posted, taken as one chunk (caller holds the
        agent lock, and for a chunk it posts itself the peer's send lock); their sends leave
        the link's queue bound and count as a wire operation until the chunk has left."""
        layers, transfer.queued_layers = transfer.queued_layers, []
        transfer.credits.dequeued(transfer.queued_sends)
        transfer.queued_sends = 0
        if layers:
            transfer.wire_ops += 1
            transfer.state = TransferState.TRANSFERRING
            self.metrics_data.chunks_sent += 1
        return layers

    def _kick_writer(self, peer: PeerLink, transfer: Transfer) -> None:
        if not transfer.kicked:
            transfer.kicked = True
            peer.out_queue.put(("kv", transfer))

    def _post_taken(self, peer: PeerLink, transfer: Transfer, layers: list[int]) -> None:
        """Post taken layers from this thread, which holds the peer's send lock (not the agent
        lock); the writer watches the chunk until it has left."""
        try:
            posted = self._post_chunk(peer, transfer, layers)
        except Exception as exc:  # any failure to post is the link's: the writer fails it
            posted = FailedPost(exc if isinstance(exc, LinkError) else LinkError(f"post failed: {exc!r}"))
        finally:
            peer.send_lock.release()
        with self._lock:
            # The writer is told of the chunk only when the transfer is acked or fails (_watch):
            # waking it now would take a core from the transfer on a small machine, and nothing
            # waits on the chunk's end meanwhile (an ack ends the lease; the receiver acks once
            # every byte arrived).
            transfer.unwatched.append((peer, layers, posted))
            if (transfer.finished or transfer.pending_failure or peer.state is LinkState.FAILED
                    or isinstance(posted, FailedPost)):  # no ack will come for a failed post
                self._watch(transfer)

    def _watch(self, transfer: Transfer) -> None:
        """Hand the chunks other threads posted for a transfer to their link's writer, which
        ends each once it has left (caller holds the agent lock). Under the lock, so a link
        failing meanwhile (PeerTable._fail drains the queue and stops the writer under it)
        cannot leave a chunk unwatched: on a failed link it is given up here."""
        chunks, transfer.unwatched = transfer.unwatched, []
        for peer, layers, posted in chunks:
            if peer.state is not LinkState.FAILED:
                peer.out_queue.put(("posted", transfer, layers, posted))
                continue
            try:  # a chunk that left before the link failed ends as sent
                left = posted.done()
            except Exception:
                left = False
            if not left:
                posted.abandon()
            # a failure already pending (shutdown, cancel, timeout) keeps its reason
            self.end_chunk(transfer, layers, None if left else transfer.pending_failure or FailureReason.PEER_LOST)

    # ----- receiver side -----
    def expect(self, request_id: str, dst_block_ids: Sequence[int], peer_id: Optional[str] = None) -> None:
        """Announce reserved destination blocks; only a transfer naming exactly these blocks may
        write them. Fails with TIMEOUT if nothing completes within transfer_timeout_s."""
        self.layout.check_block_ids(dst_block_ids, "destination")
        with self._lock:
            if request_id in self._receiving:
                raise DuplicateRequestError(f"request {request_id!r} already expected")
            transfer = Transfer(request_id, peer_id or "", Role.RECV, [], self.layout.num_layers,
                                self.layout.bytes_for(len(dst_block_ids), 1),
                                time.monotonic() + self.transfer_timeout_s)
            self._receiving[request_id] = transfer
            self._reserved[request_id] = sorted(int(b) for b in dst_block_ids)
            self.active.mark()

    # ----- both sides -----
    def cancel(self, request_id: str) -> None:
        """Cancel on this side; the peer is told and fails its side with CANCELLED."""
        with self._lock:
            for table in (self._sending, self._receiving):
                transfer = table.get(request_id)
                if transfer is not None:
                    self._fail(transfer, FailureReason.CANCELLED, notify_peer=True)

    def status(self, request_id: str, role: Role) -> Optional[TransferStatus]:
        with self._lock:
            table = self._sending if role is Role.SEND else self._receiving
            if request_id in table:
                return table[request_id].status()
            return self._recent.get((role, request_id))

    def poll(self) -> list[TransferStatus]:
        """Transfers finished since the last poll; each ends its lease/reservation (see class doc)."""
        with self._lock:
            finished, self._finished = self._finished, []
            return finished

    def metrics(self) -> dict:
        with self._lock:
            in_flight = sum(p.credits.unacked_bytes for p in self.peers.all())
            return self.metrics_data.snapshot(in_flight)

    def close(self) -> None:
        self._closing.set()
        self.peers.close_all()
        with self._lock:
            for transfer in list(self._sending.values()) + list(self._receiving.values()):
                self._fail(transfer, FailureReason.SHUTDOWN, notify_peer=False)
        self.transport.close()

    # ----- state transitions (caller holds the lock) -----
    def _finalize(self, transfer: Transfer, state: TransferState, reason: Optional[FailureReason]) -> None:
        if transfer.finished:
            return
        transfer.state, transfer.reason = state, reason
        table = self._sending if transfer.role is Role.SEND else self._receiving
        table.pop(transfer.request_id, None)
        if transfer.role is Role.RECV:
            self._reserved.pop(transfer.request_id, None)
        if not self._sending and not self._receiving:
            self.active.clear()
        if transfer.credits is not None:  # the window it was admitted on (a link may be replaced since)
            transfer.credits.returned(transfer.unacked_bytes)
            transfer.credits.dequeued(transfer.queued_sends)  # layers that never left
        transfer.unacked_bytes, transfer.queued_sends, transfer.queued_layers = 0, 0, []
        self.metrics_data.observe_finish(transfer, time.monotonic())
        status = transfer.status()
        self._finished.append(status)
        self._recent[(transfer.role, transfer.request_id)] = status
        if len(self._recent) > 4096:
            self._recent.pop(next(iter(self._recent)))
        if self.on_release is not None:
            self.on_release(status)
        self._watch(transfer)

    def _fail(self, transfer: Transfer, reason: FailureReason, notify_peer: bool) -> None:
        """Fail now, or, while a wire thread is moving its bytes, as soon as that thread is done."""
        if transfer.finished:
            return
        if transfer.wire_ops:
            transfer.pending_failure = transfer.pending_failure or reason
            self._watch(transfer)
            return
        self._finalize(transfer, TransferState.FAILED, reason)
        peer = self.peers.get(transfer.peer_id)
        if notify_peer and peer is not None and peer.state is not LinkState.FAILED:
            kind = "abort" if transfer.role is Role.SEND else "nack"
            peer.out_queue.put(("ctl", {"t": kind, "rid": transfer.request_id, "reason": reason.value}))

    def _monitor_loop(self) -> None:
        while not self._closing.wait(0.05):
            now = time.monotonic()
            with self._lock:
                for transfer in list(self._sending.values()) + list(self._receiving.values()):
                    if now > transfer.deadline:
                        self._fail(transfer, FailureReason.TIMEOUT, notify_peer=True)

    def peer_lost(self, peer: PeerLink, reason: FailureReason) -> None:
        """Called by the peer table when a link dies: every transfer on it fails."""
        with self._lock:
            for transfer in list(self._sending.values()) + list(self._receiving.values()):
                if transfer.peer_id == peer.peer_id:
                    self._fail(transfer, reason, notify_peer=False)

    # ----- wire work, called from the peer's writer and reader threads -----
    def _remaining(self, transfer: Transfer) -> float:
        return max(0.01, transfer.deadline - time.monotonic())

    def _post_chunk(self, peer: PeerLink, transfer: Transfer, layers: list[int]):
        """Post a chunk's header and regions together (the caller holds peer.send_lock): the
        receiver parses the header while the first region is already on its way."""
        regions = list(self.layout.regions(transfer.runs, layers, "src"))
        sums = [region_checksum(r) for r in regions] if self.checksums else None
        header = {"t": "kv", "rid": transfer.request_id, "layers": layers,
                  "runs": runs_to_wire(transfer.runs), "sums": sums}
        return peer.link.post_many(frame_buffers(pack_frame(header)) + regions, self._remaining(transfer))

    def write_chunk(self, peer: PeerLink, transfer: Transfer):
        """Writer thread: post the layers of a transfer that wait as one chunk; returns
        (layers, PostedSend), or None when there is nothing to post: the transfer ended, or
        another thread posted them already."""
        with self._lock:
            transfer.kicked = False
            if transfer.finished or transfer.pending_failure:
                return None
            layers = self._take_queued(peer, transfer)
            if not layers:
                return None
        try:
            with peer.send_lock:
                return layers, self._post_chunk(peer, transfer, layers)
        except Exception as exc:  # any failure to post is the link's
            return layers, FailedPost(exc if isinstance(exc, LinkError) else LinkError(f"post failed: {exc!r}"))

    def chunk_sent(self, transfer: Transfer, layers: list[int], posted) -> bool:
        """Writer thread: whether a posted chunk has left; ends its wire operation when it has,
        or failed (LinkError; also once the transfer's deadline passed: the link is given up)."""
        try:
            if not posted.done():
                if time.monotonic() <= transfer.deadline:
                    return False
                posted.abandon()
                raise LinkTimeoutError(f"send of {transfer.request_id!r} passed its deadline")
        except LinkTimeoutError:
            self.end_chunk(transfer, layers, FailureReason.TIMEOUT)
            raise
        except LinkError:
            posted.abandon()  # keeps its buffers alive while UCX may still read them
            self.end_chunk(transfer, layers, FailureReason.PEER_LOST)
            raise
        except Exception as exc:  # a backend error of another family: the link is gone too
            posted.abandon()
            self.end_chunk(transfer, layers, FailureReason.PEER_LOST)
            raise LinkError(f"send failed: {exc!r}") from exc
        self.end_chunk(transfer, layers, None)
        return True

    def end_chunk(self, transfer: Transfer, layers: list[int], failure: Optional[FailureReason]) -> None:
        with self._lock:
            transfer.wire_ops -= 1
            if failure is not None:  # the wire's own failure names the reason (as it came first)
                transfer.pending_failure = failure
            elif transfer.state is not TransferState.FAILED:  # (done may come first, by the ack)
                self.metrics_data.bytes_sent += transfer.bytes_per_layer * len(layers)
            if not transfer.wire_ops and transfer.pending_failure:
                self._fail(transfer, transfer.pending_failure, notify_peer=failure is None)

    def handle_frame(self, peer: PeerLink, frame: dict) -> None:
        kind = frame["t"]
        if kind == "kv":
            self._read_chunk(peer, frame)
            return
        with self._lock:
            if kind == "ack":
                transfer = self._sending.get(frame["rid"])
                if transfer is None or transfer.peer_id != peer.peer_id:
                    return
                acked = transfer.bytes_per_layer * len(frame["layers"])
                transfer.credits.returned(acked)
                transfer.unacked_bytes -= acked
                transfer.layers_done.update(frame["layers"])
                # Acks may overtake each other (see PeerLink.send_control); "done" is final.
                if frame["done"]:
                    transfer.layers_done.update(range(transfer.num_layers))
                    self._finalize(transfer, TransferState.DONE, None)
                    return
                self._watch(transfer)
                if not transfer.queued_layers or transfer.pending_failure or transfer.kicked:
                    return
                # Layers that waited for this ack go now, from this thread when the wire is free.
                if peer.state is not LinkState.READY:
                    return  # the link is failing: the transfer fails with it
                if not (peer.link.posts_async and peer.send_lock.acquire(blocking=False)):
                    self._kick_writer(peer, transfer)
                    return
                layers = self._take_queued(peer, transfer)
            elif kind in ("nack", "abort"):
                table = self._sending if kind == "nack" else self._receiving
                transfer = table.get(frame["rid"])
                if transfer is not None and transfer.peer_id in (peer.peer_id, ""):
                    transfer.peer_id = peer.peer_id
                    self._fail(transfer, FailureReason(frame["reason"]), notify_peer=False)
                return
            else:
                return
        self._post_taken(peer, transfer, layers)

    def _scratch_region(self, num_bytes: int) -> torch.Tensor:
        # Bytes for a transfer that is no longer ours still have to be read off the ordered
        # stream; they land here, never in a block.
        if self._scratch.numel() < num_bytes:
            self._scratch = torch.empty(num_bytes, dtype=torch.uint8)
        return self._scratch[:num_bytes]

    def _read_chunk(self, peer: PeerLink, frame: dict) -> None:
        request_id, layers = frame["rid"], [int(x) for x in frame["layers"]]
        runs = runs_from_wire(frame["runs"])
        dst_ids = sorted(r.dst_start + i for r in runs for i in range(r.length))
        with self._lock:
            transfer = self._receiving.get(request_id)
            usable = (transfer is not None and not transfer.pending_failure
                      and transfer.peer_id in ("", peer.peer_id)
                      and self._reserved.get(request_id) == dst_ids
                      and not transfer.layers_done.intersection(layers)
                      and all(0 <= x < self.layout.num_layers for x in layers))
            if usable:
                transfer.peer_id, transfer.runs = peer.peer_id, runs
                transfer.wire_ops += 1
                transfer.state = TransferState.TRANSFERRING
        failure: Optional[FailureReason] = None
        bad_sum = False
        try:
            sums = frame.get("sums")
            if usable:
                targets = list(self.layout.regions(runs, layers, "dst"))
                peer.link.recv_many(targets, self._remaining(transfer))
                bad_sum = sums is not None and [region_checksum(t) for t in targets] != sums
            else:
                for _ in layers:
                    for _kv in (0, 1):
                        for run in runs:
                            size = run.length * self.layout.block_bytes
                            peer.link.recv_bytes(self._scratch_region(size), peer.peer_timeout_s)
        except LinkTimeoutError:
            failure = FailureReason.TIMEOUT
            raise
        except LinkError:
            failure = FailureReason.PEER_LOST
            raise
        finally:
            with self._lock:
                ack = self._after_read(peer, transfer if usable else None, request_id, layers, failure, bad_sum)
        if ack is not None:  # sent outside the agent lock: the wire may be slow
            peer.send_control(ack)

    def _after_read(self, peer: PeerLink, transfer: Optional[Transfer], request_id: str,
                    layers: list[int], failure: Optional[FailureReason], bad_sum: bool) -> Optional[dict]:
        if transfer is None:
            if failure is None:
                # Not ours to write: tell the sender so it stops and releases its lease.
                recent = self._recent.get((Role.RECV, request_id))
                stale = self._receiving.get(request_id)
                if stale is not None:  # expected, but with other blocks or a duplicate layer
                    self._fail(stale, FailureReason.REJECTED, notify_peer=False)
                reason = recent.reason if recent and recent.reason else FailureReason.REJECTED
                peer.out_queue.put(("ctl", {"t": "nack", "rid": request_id, "reason": reason.value}))
            return None
        transfer.wire_ops -= 1
        reason = failure or (FailureReason.CHECKSUM_MISMATCH if bad_sum else None) or transfer.pending_failure
        if reason is not None:
            self._fail(transfer, reason, notify_peer=failure is None)
            return None
        transfer.layers_done.update(layers)
        self.metrics_data.bytes_received += transfer.bytes_per_layer * len(layers)
        done = len(transfer.layers_done) == transfer.num_layers
        if done:
            self._finalize(transfer, TransferState.DONE, None)
        return {"t": "ack", "rid": request_id, "layers": layers, "done": done}
