"""Peer links of one agent: handshake (metadata checked on both ends), and per link a writer
thread (frames, KV regions, heartbeats) and a reader thread; a dead link fails its transfers.
The threads hand chunks and frames to a LinkHandler (the agent's Wire) and know nothing else
of the agent: the lock, the closing event and the local metadata are given to the table.
"""

from __future__ import annotations

import collections
import queue
import threading
import time
from typing import Optional, Protocol

from pd_runtime.kv_transfer.base import (Activity, AgentMetadata, FailureReason, Link, LinkError, LinkState,
                              LinkTimeoutError, MetadataMismatchError, PostedSend, Transport,
                              pack_frame, unpack_frame)
from pd_runtime.kv_transfer.flow import CreditWindow, SendableSignal, Transfer

_HEARTBEAT = pack_frame({"t": "hb"})
# How often the writer looks at posted chunks while some are in flight. Only bookkeeping
# waits on it (a transfer is done when the receiver acks it, and a later chunk of it is posted
# once the earlier ones were acked, not once the writer saw them leave), so it need not be
# fast; every look wakes a thread that would contend for a core with the transfer itself.
_SENT_POLL_S = 0.005


class PeerLink:
    """Agent-side state of the link to one peer; replaced by a new one on reconnect.

    Its out queue is the writer thread's work (frames, chunks to post, posted chunks to
    watch); a failed link stays in the table (sends to it answer PEER_UNAVAILABLE), so its
    queue must end empty: the failure closes it (closing takes what waits, and nothing is
    queued after), and the stop signal it leaves for a running writer is dropped when that
    writer exits, whichever thread saw the link die first."""

    def __init__(self, peer_id: str, credits: CreditWindow, peer_timeout_s: float):
        self.peer_id = peer_id
        self.state = LinkState.CONNECTING
        self.reason: Optional[str] = None
        self.link: Optional[Link] = None
        self.address: Optional[dict] = None
        self.credits = credits
        self.out_queue: "queue.Queue" = queue.Queue()
        self._queue_lock = threading.Lock()  # innermost: held only around the queue itself
        self._queue_closed = False
        self._writer_running = False
        self.peer_timeout_s = peer_timeout_s
        # Held for each group of messages that must stay together on the wire (a frame, or a
        # chunk's header and regions), so the reader may send acks itself between groups.
        self.send_lock = threading.Lock()
        # (transfer, layers, PostedSend): chunks posted on this link that the writer thread
        # watches until they have left, oldest first. Only that thread changes it.
        self.posted: collections.deque = collections.deque()

    def send_control(self, message: dict) -> None:
        """Send a control frame now from the calling thread when the wire is free (an ack then
        skips a hand-off to the writer thread), else queue it for the writer. Frames may thus
        overtake queued ones; receivers do not depend on the order of control frames."""
        if self.state is LinkState.READY and self.send_lock.acquire(blocking=False):
            try:
                self.link.send_frame(pack_frame(message), self.peer_timeout_s)
            finally:
                self.send_lock.release()
        else:
            self.enqueue(("ctl", message))

    def enqueue(self, item: tuple) -> bool:
        """Hand an item to the writer; False (nothing queued) once the link failed."""
        with self._queue_lock:
            if self._queue_closed:
                return False
            self.out_queue.put(item)
            return True

    def writer_started(self) -> None:
        with self._queue_lock:
            self._writer_running = True

    def close_queue(self) -> list:
        """Queue nothing more; returns what waited. A running writer is told to stop."""
        with self._queue_lock:
            self._queue_closed = True
            items = _drain(self.out_queue)
            if self._writer_running:
                self.out_queue.put(None)
        return items

    def writer_stopped(self) -> None:
        """The writer exited. On a closed queue only its stop signal can be left (a writer
        that saw the link die itself exits without reading it): dropped."""
        with self._queue_lock:
            self._writer_running = False
            if self._queue_closed:
                _drain(self.out_queue)


def _drain(items: "queue.Queue") -> list:
    out = []
    while True:
        try:
            out.append(items.get_nowait())
        except queue.Empty:
            return out


class LinkHandler(Protocol):
    """What a link's threads hand their work to; every method takes the agent lock itself."""

    def write_chunk(self, peer: PeerLink, transfer: Transfer) -> Optional[tuple]:
        """Writer: post the layers of a transfer that wait; (layers, PostedSend) or None."""

    def chunk_sent(self, transfer: Transfer, layers: list, posted: PostedSend) -> bool:
        """Writer: whether a posted chunk has left (ends it); raises LinkError when it failed."""

    def end_chunk(self, transfer: Transfer, layers: list, failure: Optional[FailureReason]) -> None:
        """A posted chunk given up (failure) or gone."""

    def handle_frame(self, peer: PeerLink, frame: dict) -> None:
        """Reader: a frame other than a heartbeat arrived (its regions follow on the link)."""

    def peer_lost(self, peer: PeerLink, reason: FailureReason) -> None:
        """The link died: every transfer on it fails."""


class PeerTable:
    """The links of one agent, by peer id. `lock` is the agent's transfer lock (peer state
    changes and a dead link's clean-up happen under it, as the transfers they touch do);
    `closing` is set when the agent closes. Links are accepted once start() named the handler."""

    def __init__(self, transport: Transport, local: AgentMetadata, *, lock, closing: threading.Event,
                 active: Activity, handshake_timeout_s: float, heartbeat_interval_s: float,
                 peer_timeout_s: float, credit_window_bytes: int, max_queued_sends: int,
                 sendable: Optional[SendableSignal] = None):
        self.transport = transport
        self.local = local
        self._lock = lock
        self._closing = closing
        self._active = active
        self._handler: Optional[LinkHandler] = None
        self.handshake_timeout_s = handshake_timeout_s
        self.heartbeat_interval_s = heartbeat_interval_s
        self.peer_timeout_s = peer_timeout_s
        self.credit_window_bytes = credit_window_bytes
        self.max_queued_sends = max_queued_sends
        self.sendable = sendable or SendableSignal()  # fired on credits back and state changes
        self._peers: dict[str, PeerLink] = {}
        self._accepter = threading.Thread(target=self._accept_loop, name="kvt-accept", daemon=True)

    def start(self, handler: LinkHandler) -> None:
        """Accept links from now on (and allow connect()); their threads call handler."""
        self._handler = handler
        self._accepter.start()

    def get(self, peer_id: str) -> Optional[PeerLink]:
        return self._peers.get(peer_id)

    def all(self) -> list[PeerLink]:
        return list(self._peers.values())

    def state(self, peer_id: str) -> tuple[LinkState, Optional[str]]:
        peer = self._peers.get(peer_id)
        return (peer.state, peer.reason) if peer else (LinkState.FAILED, "unknown peer")

    def _new_peer(self, peer_id: str) -> PeerLink:
        credits = CreditWindow(self.credit_window_bytes, self.max_queued_sends, self.sendable)
        peer = PeerLink(peer_id, credits, self.peer_timeout_s)
        with self._lock:
            old = self._peers.get(peer_id)
            self._peers[peer_id] = peer
        if old is not None:
            self._fail(old, LinkError("replaced by a new link"))
        return peer

    # ----- outgoing -----
    def connect(self, peer_meta: AgentMetadata) -> str:
        self.local.check_compatible(peer_meta)
        with self._lock:
            current = self._peers.get(peer_meta.engine_id)
            # Same peer, same address: keep the live link. A new address means the peer
            # restarted; its old link may not have noticed yet, so it is replaced.
            if (current is not None and current.state is not LinkState.FAILED
                    and current.address == peer_meta.address):
                return peer_meta.engine_id
        peer = self._new_peer(peer_meta.engine_id)
        peer.address = peer_meta.address
        threading.Thread(target=self._connect, args=(peer, peer_meta), daemon=True,
                         name=f"kvt-connect-{peer.peer_id}").start()
        return peer.peer_id

    def _connect(self, peer: PeerLink, peer_meta: AgentMetadata) -> None:
        try:
            link = self.transport.connect(peer_meta.address, self.handshake_timeout_s)
            peer.link = link
            link.send_frame(pack_frame({"t": "hello", "meta": self.local.encode()}), self.handshake_timeout_s)
            reply = unpack_frame(link.recv_frame(self.handshake_timeout_s))
            if reply["t"] != "welcome":
                self._fail(peer, LinkError(reply.get("error", "refused")), FailureReason.METADATA_MISMATCH)
                return
            self._start(peer, link)
        except LinkError as exc:
            self._fail(peer, exc, FailureReason.PEER_LOST)

    # ----- incoming -----
    def _accept_loop(self) -> None:
        while not self._closing.is_set():
            try:
                link = self.transport.accept(0.1)
            except LinkError:
                continue
            if link is not None:
                threading.Thread(target=self._answer, args=(link,), daemon=True, name="kvt-handshake").start()

    def _answer(self, link: Link) -> None:
        try:
            hello = unpack_frame(link.recv_frame(self.handshake_timeout_s))
            peer_meta = AgentMetadata.decode(hello["meta"])
            try:
                self.local.check_compatible(peer_meta)
            except MetadataMismatchError as exc:
                link.send_frame(pack_frame({"t": "refuse", "error": str(exc)}), self.handshake_timeout_s)
                time.sleep(0.1)  # let the refusal reach the peer before the link goes away
                link.close()
                return
            peer = self._new_peer(peer_meta.engine_id)
            peer.address, peer.link = peer_meta.address, link
            link.send_frame(pack_frame({"t": "welcome", "meta": self.local.encode()}), self.handshake_timeout_s)
            self._start(peer, link)
        except (LinkError, KeyError, TypeError, ValueError):
            link.close()

    # ----- running link -----
    def _start(self, peer: PeerLink, link: Link) -> None:
        with self._lock:
            if peer.state is LinkState.FAILED:
                return
            peer.state = LinkState.READY
            peer.writer_started()
            self.sendable.fire()
        link.set_activity(self._active)
        threading.Thread(target=self._write_loop, args=(peer, link), daemon=True, name=f"kvt-w-{peer.peer_id}").start()
        threading.Thread(target=self._read_loop, args=(peer, link), daemon=True, name=f"kvt-r-{peer.peer_id}").start()

    def _write_loop(self, peer: PeerLink, link: Link) -> None:
        """Posts queued chunks and control frames, and watches posted chunks until they have
        left (oldest first) without waiting on them: a chunk can go while earlier ones are
        still being read by the peer."""
        inflight = peer.posted  # (transfer, layers, PostedSend)
        next_watch = 0.0
        try:
            while True:
                try:  # new work first: watching what left already can wait (up to _SENT_POLL_S)
                    if inflight and time.monotonic() >= next_watch:
                        raise queue.Empty
                    item = peer.out_queue.get_nowait()
                except queue.Empty:
                    next_watch = time.monotonic() + _SENT_POLL_S
                    while inflight:
                        head = inflight.popleft()  # chunk_sent ends it, also when it raises
                        if not self._handler.chunk_sent(*head):
                            inflight.appendleft(head)
                            break
                    try:
                        item = peer.out_queue.get(timeout=_SENT_POLL_S if inflight else self.heartbeat_interval_s)
                    except queue.Empty:
                        if not inflight:
                            with peer.send_lock:
                                link.send_frame(_HEARTBEAT, self.peer_timeout_s)
                        continue
                if item is None:
                    return
                if item[0] == "ctl":
                    with peer.send_lock:
                        link.send_frame(pack_frame(item[1]), self.peer_timeout_s)
                    continue
                if item[0] == "posted":  # posted by another thread (send(), or the reader on an ack)
                    inflight.append(item[1:])
                    continue
                written = self._handler.write_chunk(peer, item[1])  # every layer of it that waits
                if written is not None:
                    inflight.append((item[1], *written))
        except LinkError as exc:
            self._fail(peer, exc)
        finally:
            peer.writer_stopped()
            # The link is gone: what is still posted is given up with it. A chunk whose own
            # post failed (or that left meanwhile) ends as its wire says: a send that timed
            # out is the transfer's timeout, not a lost peer.
            while inflight:
                transfer, layers, posted = inflight.popleft()
                try:
                    if self._handler.chunk_sent(transfer, layers, posted):
                        continue
                except Exception:  # chunk_sent ended it with the wire's reason
                    continue
                posted.abandon()
                self._handler.end_chunk(transfer, layers, FailureReason.PEER_LOST)

    def _read_loop(self, peer: PeerLink, link: Link) -> None:
        try:
            while peer.state is LinkState.READY:
                frame = unpack_frame(link.recv_frame(self.peer_timeout_s))
                if frame["t"] == "bye":
                    raise LinkError("peer closed the link")
                if frame["t"] != "hb":
                    self._handler.handle_frame(peer, frame)
        except LinkError as exc:
            self._fail(peer, exc)

    def _fail(self, peer: PeerLink, exc: Exception, reason: FailureReason = FailureReason.PEER_LOST) -> None:
        with self._lock:
            first = peer.state is not LinkState.FAILED
            peer.state, peer.reason = LinkState.FAILED, peer.reason or str(exc)
            if first:
                self.sendable.fire()
                # Closed as the state flips: from here on nothing is queued for this link.
                waiting = peer.close_queue()
                if isinstance(exc, LinkTimeoutError):
                    reason = FailureReason.PEER_LOST
                self._handler.peer_lost(peer, reason)
                for item in waiting:  # queued chunks hold no lease any more
                    self._drop_queued(peer, item)
        if first and peer.link is not None:
            peer.link.close()

    def _drop_queued(self, peer: PeerLink, item: tuple) -> None:
        """A queued item of a failed link: chunks hold no lease any more, posted ones are
        given up (their transfers fail once nothing of them is on the wire)."""
        with self._lock:
            if item[0] == "kv":  # its waiting layers hold queue credits until it finalizes
                item[1].kicked = False
            elif item[0] == "posted":
                item[3].abandon()
                self._handler.end_chunk(item[1], item[2], FailureReason.PEER_LOST)

    def close_all(self) -> None:
        for peer in self.all():
            if peer.state is LinkState.READY:
                peer.enqueue(("ctl", {"t": "bye"}))
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline and any(not p.out_queue.empty() for p in self.all() if p.state is LinkState.READY):
            time.sleep(0.01)
        for peer in self.all():
            self._fail(peer, LinkError("agent closed"), FailureReason.SHUTDOWN)
