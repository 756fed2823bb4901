"""What moves a transfer's bytes: the agent's Wire, which the peer links' writer and reader
threads (and, for a chunk it posts itself, the sending thread) call. Taking waiting layers as
one chunk, posting it, handing posted chunks to the writer to watch, ending wire operations,
reading arriving chunks into reserved blocks, and the transitions that must tell the wire
(fail, finish). Every method here that changes a transfer holds the book's lock.
"""

from __future__ import annotations

import time
from typing import Optional

import torch

from pd_runtime.kv_transfer.base import (FailedPost, FailureReason, LinkError, LinkState, LinkTimeoutError,
                              PostedSend, Role, TransferState, frame_buffers, pack_frame)
from pd_runtime.kv_transfer.flow import Transfer
from pd_runtime.kv_transfer.layout import KVLayout, region_checksum, runs_from_wire, runs_to_wire
from pd_runtime.kv_transfer.peer import PeerLink, PeerTable
from pd_runtime.kv_transfer.transfers import TransferBook


class ScratchBuffer:
    """Where bytes for a transfer that is no longer ours are read, off the ordered stream, and
    never into a block. On the cache's device: a link picks its group by the buffer's device
    (NCCL for CUDA), and the sender posted them from the cache, so a host scratch would wait
    on the wrong group. Grows to the largest region discarded; one reader thread uses it."""

    def __init__(self, layout: KVLayout):
        self.device = layout.device
        self._buffer = torch.empty(0, dtype=torch.uint8, device=self.device)

    def region(self, num_bytes: int) -> torch.Tensor:
        if self._buffer.numel() < num_bytes or self._buffer.device != self.device:
            self._buffer = torch.empty(num_bytes, dtype=torch.uint8, device=self.device)
        return self._buffer[:num_bytes]


class Wire:
    """The byte-moving half of one agent (see the module docstring); implements the peer
    table's LinkHandler. The book owns the transfer state and its lock; peers are looked up
    to tell one that a transfer failed."""

    def __init__(self, layout: KVLayout, book: TransferBook, peers: PeerTable, *, checksums: bool):
        self.layout = layout
        self.book = book
        self.peers = peers
        self.checksums = checksums
        self._lock = book.lock
        self._metrics = book.metrics
        self._scratch = ScratchBuffer(layout)

    # ----- ending transfers (caller holds the lock) -----
    def finish(self, transfer: Transfer, state: TransferState, reason: Optional[FailureReason]) -> None:
        if self.book.finish(transfer, state, reason):
            self.watch(transfer)

    def fail(self, transfer: Transfer, reason: FailureReason, notify_peer: bool) -> None:
        """Fail now, or, while a wire thread is moving its bytes, as soon as that thread is done."""
        if transfer.finished:
            return
        if transfer.wire_ops:
            transfer.pending_failure = transfer.pending_failure or reason
            self.watch(transfer)
            return
        self.finish(transfer, TransferState.FAILED, reason)
        peer = self.peers.get(transfer.peer_id)
        if notify_peer and peer is not None:  # (a failed link queues nothing)
            kind = "abort" if transfer.role is Role.SEND else "nack"
            peer.enqueue(("ctl", {"t": kind, "rid": transfer.request_id, "reason": reason.value}))

    def peer_lost(self, peer: PeerLink, reason: FailureReason) -> None:
        """Called by the peer table when a link dies: every transfer on it fails."""
        with self._lock:
            for transfer in self.book.pending():
                if transfer.peer_id == peer.peer_id:
                    self.fail(transfer, reason, notify_peer=False)

    # ----- sending: waiting layers -> chunks on the wire -----
    def take_queued(self, peer: PeerLink, transfer: Transfer) -> list[int]:
        """The layers of a transfer waiting to be posted, taken as one chunk (caller holds the
        agent lock, and for a chunk it posts itself the peer's send lock); their sends leave
        the link's queue bound and count as a wire operation until the chunk has left."""
        layers, transfer.queued_layers = transfer.queued_layers, []
        transfer.credits.dequeued(transfer.queued_sends)
        transfer.queued_sends = 0
        if layers:
            transfer.wire_ops += 1
            transfer.state = TransferState.TRANSFERRING
            self._metrics.chunks_sent += 1
        return layers

    def kick_writer(self, peer: PeerLink, transfer: Transfer) -> None:
        if not transfer.kicked:
            transfer.kicked = peer.enqueue(("kv", transfer))

    def post_taken(self, peer: PeerLink, transfer: Transfer, layers: list[int]) -> None:
        """Post taken layers from this thread, which holds the peer's send lock (not the agent
        lock); the writer watches the chunk until it has left."""
        try:
            posted = self._post_chunk(peer, transfer, layers)
        finally:
            peer.send_lock.release()
        with self._lock:
            # The writer is told of the chunk only when the transfer is acked or fails (watch):
            # waking it now would take a core from the transfer on a small machine, and nothing
            # waits on the chunk's end meanwhile (an ack ends the lease; the receiver acks once
            # every byte arrived).
            transfer.unwatched.append((peer, layers, posted))
            if (transfer.finished or transfer.pending_failure or peer.state is LinkState.FAILED
                    or isinstance(posted, FailedPost)):  # no ack will come for a failed post
                self.watch(transfer)

    def watch(self, transfer: Transfer) -> None:
        """Hand the chunks other threads posted for a transfer to their link's writer, which
        ends each once it has left (caller holds the agent lock). Under the lock, so a link
        failing meanwhile (PeerTable._fail drains the queue and stops the writer under it)
        cannot leave a chunk unwatched: on a failed link it is given up here."""
        chunks, transfer.unwatched = transfer.unwatched, []
        for peer, layers, posted in chunks:
            if peer.enqueue(("posted", transfer, layers, posted)):
                continue
            try:  # a chunk that left before the link failed ends as sent
                left = posted.done()
            except Exception:
                left = False
            if not left:
                posted.abandon()
            # a failure already pending (shutdown, cancel, timeout) keeps its reason
            self.end_chunk(transfer, layers, None if left else transfer.pending_failure or FailureReason.PEER_LOST)

    # ----- called from the peer's writer and reader threads -----
    def _remaining(self, transfer: Transfer) -> float:
        return max(0.01, transfer.deadline - time.monotonic())

    def _post_chunk(self, peer: PeerLink, transfer: Transfer, layers: list[int]) -> PostedSend:
        """Post a chunk's header and regions together (the caller holds peer.send_lock): the
        receiver parses the header while the first region is already on its way. A post that
        raised comes back as a FailedPost."""
        try:
            src_heads, dst_heads = transfer.heads or (None, None)
            regions = list(self.layout.regions(transfer.runs, layers, "src", src_heads))
            sums = [region_checksum(r) for r in regions] if self.checksums else None
            header = {"t": "kv", "rid": transfer.request_id, "layers": layers,
                      "runs": runs_to_wire(transfer.runs), "sums": sums,
                      "heads": None if dst_heads is None else [dst_heads.start, dst_heads.stop]}
            return peer.link.post_many(frame_buffers(pack_frame(header)) + regions, self._remaining(transfer))
        except Exception as exc:  # any failure to post is the link's: the writer fails it
            return FailedPost(exc if isinstance(exc, LinkError) else LinkError(f"post failed: {exc!r}"))

    def write_chunk(self, peer: PeerLink, transfer: Transfer):
        """Writer thread: post the layers of a transfer that wait as one chunk; returns
        (layers, PostedSend), or None when there is nothing to post: the transfer ended, or
        another thread posted them already."""
        with self._lock:
            transfer.kicked = False
            if transfer.finished or transfer.pending_failure:
                return None
            layers = self.take_queued(peer, transfer)
            if not layers:
                return None
        with peer.send_lock:
            return layers, self._post_chunk(peer, transfer, layers)

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
                self._metrics.bytes_sent += transfer.bytes_per_layer * len(layers)
            if not transfer.wire_ops and transfer.pending_failure:
                self.fail(transfer, transfer.pending_failure, notify_peer=failure is None)

    def handle_frame(self, peer: PeerLink, frame: dict) -> None:
        kind = frame["t"]
        if kind == "kv":
            self._read_chunk(peer, frame)
            return
        with self._lock:
            if kind == "ack":
                transfer = self.book.sending.get(frame["rid"])
                if transfer is None or transfer.peer_id != peer.peer_id:
                    return
                acked = transfer.bytes_per_layer * len(frame["layers"])
                transfer.credits.returned(acked)
                transfer.unacked_bytes -= acked
                transfer.layers_done.update(frame["layers"])
                # Acks may overtake each other (see PeerLink.send_control); "done" is final.
                if frame["done"]:
                    transfer.layers_done.update(range(transfer.num_layers))
                    self.finish(transfer, TransferState.DONE, None)
                    return
                self.watch(transfer)
                if not transfer.queued_layers or transfer.pending_failure or transfer.kicked:
                    return
                # Layers that waited for this ack go now, from this thread when the wire is free.
                if peer.state is not LinkState.READY:
                    return  # the link is failing: the transfer fails with it
                if not (peer.link.posts_async and peer.send_lock.acquire(blocking=False)):
                    self.kick_writer(peer, transfer)
                    return
                layers = self.take_queued(peer, transfer)
            elif kind in ("nack", "abort"):
                table = self.book.sending if kind == "nack" else self.book.receiving
                transfer = table.get(frame["rid"])
                if transfer is not None and transfer.peer_id in (peer.peer_id, ""):
                    transfer.peer_id = peer.peer_id
                    self.fail(transfer, FailureReason(frame["reason"]), notify_peer=False)
                return
            else:
                return
        self.post_taken(peer, transfer, layers)

    def _read_chunk(self, peer: PeerLink, frame: dict) -> None:
        request_id, layers = frame["rid"], [int(x) for x in frame["layers"]]
        runs = runs_from_wire(frame["runs"])
        dst_ids = sorted(r.dst_start + i for r in runs for i in range(r.length))
        named = frame.get("heads")  # the destination heads a resharding sender moves
        heads = None if named is None else range(int(named[0]), int(named[1]))
        with self._lock:
            transfer = self.book.receiving.get(request_id)
            expected = transfer.heads[1] if transfer is not None and transfer.heads else None
            usable = (transfer is not None and not transfer.pending_failure
                      and transfer.peer_id in ("", peer.peer_id)
                      and heads == expected
                      and self.book.reserved.get(request_id) == dst_ids
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
                targets = list(self.layout.regions(runs, layers, "dst", heads))
                peer.link.recv_many(targets, self._remaining(transfer))
                bad_sum = sums is not None and [region_checksum(t) for t in targets] != sums
            else:  # drained: the sender's regions, sized by what its header names
                sizes = self.layout.region_sizes(runs, None if heads is None else len(heads))
                for _ in layers:
                    for _kv in (0, 1):
                        for size in sizes:
                            peer.link.recv_bytes(self._scratch.region(size), peer.peer_timeout_s)
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
                recent = self.book.ended(request_id, Role.RECV)
                stale = self.book.receiving.get(request_id)
                if stale is not None:  # expected, but with other blocks or a duplicate layer
                    self.fail(stale, FailureReason.REJECTED, notify_peer=False)
                reason = recent.reason if recent and recent.reason else FailureReason.REJECTED
                peer.enqueue(("ctl", {"t": "nack", "rid": request_id, "reason": reason.value}))
            return None
        transfer.wire_ops -= 1
        reason = failure or (FailureReason.CHECKSUM_MISMATCH if bad_sum else None) or transfer.pending_failure
        if reason is not None:
            self.fail(transfer, reason, notify_peer=failure is None)
            return None
        transfer.layers_done.update(layers)
        self._metrics.bytes_received += transfer.bytes_per_layer * len(layers)
        done = len(transfer.layers_done) == transfer.num_layers
        if done:
            self.finish(transfer, TransferState.DONE, None)
        return {"t": "ack", "rid": request_id, "layers": layers, "done": done}
