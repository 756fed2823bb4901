"""A worker's transfer agent over all its tensor-parallel ranks: the agent interface the worker
uses (send, expect, cancel, connect, ...), fanned out to one agent per rank, each over that
rank's own cache, each rank pair linked directly (no rank gathers another's KV).

Between a group of degree p and one of degree d, kv_transfer/reshard.py's plan says which heads
each rank pair moves. Equal degrees move whole caches rank r -> rank r under the request's own
id (at degree 1 this is exactly one agent); otherwise each piece is a transfer of its own, a
range of heads under a sub-id both sides derive from the plan (`request/<dst rank>.<first
head>`). A request's transfer ends, for the worker (`on_release`, once), when every piece on
every rank of this side has ended: done when all are, else failed with the first failure,
the others cancelled at once. The receiving side must know the sender's degree when it
expects (`expect(..., peer_degree=)`); the sender learns the receiver's from its metadata.

Ownership: a piece's lease (sender) or reservation (receiver) is its rank agent's, as for any
transfer; the group only counts them, and the worker frees its blocks when the group ends.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import msgpack

from pd_runtime.kv_transfer.base import (AgentMetadata, DuplicateRequestError, FailureReason,
                                         LinkState, Role,
                                         SendOutcome, TransferState, TransferStatus)
from pd_runtime.kv_transfer.reshard import plan_reshard

log = logging.getLogger(__name__)


def group_metadata(rank_metadata: Sequence[bytes]) -> bytes:
    return msgpack.packb({"group": list(rank_metadata)}, use_bin_type=True)


def rank_metadata(metadata: bytes) -> list[bytes]:
    """The ranks' metadata of a group's (a plain agent's metadata is a group of one)."""
    decoded = msgpack.unpackb(metadata, raw=False)
    if isinstance(decoded, dict) and "group" in decoded:
        return list(decoded["group"])
    return [metadata]


def peer_engine_id(metadata: bytes) -> str:
    """The engine id a group's metadata names (its driver rank's): a link cache key."""
    return AgentMetadata.decode(rank_metadata(metadata)[0]).engine_id


@dataclass
class _Piece:
    rank: int            # this side's rank that moves it
    sub_id: str          # its transfer id at that rank
    heads: Optional[tuple]  # (source heads, destination heads), None: whole caches
    peer_rank: int
    started: bool = False   # sender: a send of it was accepted (its agent will release it)
    in_flight: bool = False  # sender: a send of it is being handed to its rank right now
    layers: set = field(default_factory=set)   # sender: layers accepted
    backlog: set = field(default_factory=set)  # sender: layers asked for, not yet accepted
    status: Optional[TransferStatus] = None


@dataclass
class _Request:
    request_id: str
    role: Role
    peer_id: str
    pieces: dict          # sub_id@rank -> _Piece
    failure: Optional[FailureReason] = None
    reported: bool = False
    blocks: tuple = ()    # sender: (source ids, destination ids)
    created: float = field(default_factory=time.monotonic)


@dataclass
class _PeerGroup:
    degree: int
    links: dict  # (our rank, their rank) -> that rank agent's peer id


class GroupAgent:
    """The agent of a worker of len(ranks) ranks; `ranks[r]` is rank r's agent (the driver's
    own KVTransferAgent at 0, proxies of the others' beyond, kv_transfer/rank_rpc.py).

    The worker's contract is a plain agent's: a send that is not ACCEPTED holds nothing here
    (no piece started: no record kept), one that is ACCEPTED ends once in `on_release`. When
    some pieces are accepted and others wait for room on their links, the send is ACCEPTED
    and the waiting layers are handed on by a thread of this agent as room comes (or the
    request fails at its deadline); a piece refused outright fails the request, the started
    pieces cancelled."""

    def __init__(self, ranks: Sequence, model_kv_heads: int,
                 on_release: Optional[Callable[[TransferStatus], None]] = None):
        self.ranks = list(ranks)
        self.degree = len(self.ranks)
        self.model_kv_heads = model_kv_heads
        self.on_release = on_release
        self._lock = threading.RLock()
        self._requests: dict[tuple[str, Role], _Request] = {}
        self._by_sub: dict[tuple[int, str, Role], tuple[str, Role]] = {}
        self._peers: dict[str, _PeerGroup] = {}
        self._room = threading.Event()  # a rank's link has room: retry waiting layers
        self._closing = threading.Event()
        self._retrier: Optional[threading.Thread] = None

    # -- plumbing ---------------------------------------------------------------------------
    def rank_released(self, rank: int, status: TransferStatus) -> None:
        """A rank agent's on_release (any thread): one piece ended."""
        with self._lock:
            key = self._by_sub.get((rank, status.request_id, status.role))
            request = self._requests.get(key) if key else None
            if request is None:
                return
            request.pieces[f"{status.request_id}@{rank}"].status = status
            if status.state is not TransferState.DONE and request.failure is None:
                request.failure = status.reason or FailureReason.CANCELLED
        self._end_if_failed_or_done(request)

    def _end_if_failed_or_done(self, request: _Request) -> None:
        """Cancel what still runs of a failed request; report the request once it ended."""
        with self._lock:
            cancel = [p for p in request.pieces.values() if p.status is None and (
                p.started or request.role is Role.RECV)] if request.failure else []
            report = self._settle(request)
        for piece in cancel:  # failed: end its other pieces now, not at their deadlines
            self.ranks[piece.rank].cancel(piece.sub_id)
        if report is not None and self.on_release is not None:
            self.on_release(report)

    def _settle(self, request: _Request) -> Optional[TransferStatus]:
        """The request's end once no piece this side holds can still move (caller holds the
        lock): a sender's pieces never started end with the request's failure."""
        if request.reported:
            return None
        for piece in request.pieces.values():
            if piece.status is None and (piece.started or piece.in_flight
                                         or request.role is Role.RECV
                                         or request.failure is None):
                return None
        request.reported = True
        self._unregister(request)
        done = [p.status for p in request.pieces.values() if p.status is not None]
        state = TransferState.DONE if request.failure is None else TransferState.FAILED
        return TransferStatus(request.request_id, request.peer_id, request.role, state,
                              request.failure, sum(s.num_bytes for s in done),
                              min((s.layers_done for s in done), default=0))

    def _register(self, request: _Request) -> None:
        self._requests[(request.request_id, request.role)] = request
        for piece in request.pieces.values():
            self._by_sub[(piece.rank, piece.sub_id, request.role)] = \
                (request.request_id, request.role)

    def _unregister(self, request: _Request) -> None:
        self._requests.pop((request.request_id, request.role), None)
        for piece in request.pieces.values():
            self._by_sub.pop((piece.rank, piece.sub_id, request.role), None)

    def _pieces(self, request_id: str, senders: int, receivers: int, side: str) -> dict:
        """This side's pieces of a request between a group of `senders` ranks and one of
        `receivers` (`side` "send" or "recv"), by sub_id@rank."""
        plan = plan_reshard(self.model_kv_heads, senders, receivers)
        whole = senders == receivers
        out = {}
        for dst_rank, pieces in enumerate(plan.pieces):
            for piece in pieces:
                sub_id = request_id if whole else \
                    f"{request_id}/{dst_rank}.{piece.dst_heads.start}"
                heads = None if whole else (piece.src_heads, piece.dst_heads)
                rank, peer_rank = (piece.src_rank, dst_rank) if side == "send" \
                    else (dst_rank, piece.src_rank)
                out[f"{sub_id}@{rank}"] = _Piece(rank, sub_id, heads, peer_rank)
        return out

    # -- handshake --------------------------------------------------------------------------
    def metadata(self) -> bytes:
        return group_metadata([rank.metadata() for rank in self.ranks])

    @property
    def transfer_timeout_s(self) -> float:
        return self.ranks[0].transfer_timeout_s

    def connect(self, peer_metadata: bytes) -> str:
        """Links from each of our ranks to each peer rank our sends reach; returns the group's
        peer id at once (its state is the links' together)."""
        metas = rank_metadata(peer_metadata)
        degree = len(metas)
        plan = plan_reshard(self.model_kv_heads, self.degree, degree)
        links = {}
        for dst_rank, pieces in enumerate(plan.pieces):
            for piece in pieces:
                key = (piece.src_rank, dst_rank)
                if key not in links:
                    links[key] = self.ranks[piece.src_rank].connect(metas[dst_rank])
        peer_id = links[(0, 0)] if degree == self.degree == 1 else \
            f"group:{AgentMetadata.decode(metas[0]).engine_id}"
        with self._lock:
            self._peers[peer_id] = _PeerGroup(degree, links)
        return peer_id

    def peer_state(self, peer_id: str) -> tuple[LinkState, Optional[str]]:
        peer = self._peers.get(peer_id)
        if peer is None:
            return self.ranks[0].peer_state(peer_id)
        states = [self.ranks[rank].peer_state(link) for (rank, _), link in peer.links.items()]
        failed = next((s for s in states if s[0] is LinkState.FAILED), None)
        if failed is not None:
            return failed
        if all(s[0] is LinkState.READY for s in states):
            return LinkState.READY, None
        return next(s for s in states if s[0] is not LinkState.READY)

    def add_sendable_listener(self, listener: Callable[[], None]) -> None:
        for rank in self.ranks:
            rank.add_sendable_listener(listener)

    # -- sender side ------------------------------------------------------------------------
    def send(self, peer_id: str, request_id: str, src_block_ids: Sequence[int],
             dst_block_ids: Sequence[int], layers: Optional[Sequence[int]] = None) -> SendOutcome:
        """Every piece of our ranks' is asked for `layers` (default all; those it has taken
        already are skipped). See the class doc for what the outcome promises."""
        peer = self._peers[peer_id]
        wanted = set(range(self._num_layers())) if layers is None else {int(x) for x in layers}
        with self._lock:
            request = self._requests.get((request_id, Role.SEND))
            if request is None:
                request = _Request(request_id, Role.SEND, peer_id, self._pieces(
                    request_id, self.degree, peer.degree, "send"),
                    blocks=(list(src_block_ids), list(dst_block_ids)))
                self._register(request)
            for piece in request.pieces.values():
                piece.backlog |= wanted - piece.layers
        refusal = self._push(request)
        with self._lock:
            if not any(p.started or p.in_flight for p in request.pieces.values()) \
                    and request.failure is None:
                self._unregister(request)  # nothing leased: nothing kept, as a plain agent
                return refusal or SendOutcome.PEER_UNAVAILABLE
            if refusal is not None and refusal is not SendOutcome.WOULD_BLOCK \
                    and request.failure is None:
                request.failure = FailureReason.PEER_LOST
            waiting = request.failure is None and any(p.backlog for p in request.pieces.values())
        if waiting:
            self._wake_retrier()
        self._end_if_failed_or_done(request)
        return SendOutcome.ACCEPTED

    def _push(self, request: _Request) -> Optional[SendOutcome]:
        """Hand each piece's waiting layers to its rank; the first refusal, or None. A piece
        refused outright (not for room) dooms the request: no further piece is started."""
        refusal = None
        src, dst = request.blocks
        links = self._peers[request.peer_id].links
        for piece in list(request.pieces.values()):
            with self._lock:
                if not piece.backlog or piece.in_flight or piece.status is not None \
                        or request.failure is not None:
                    continue
                piece.in_flight = True
                todo = sorted(piece.backlog)
            try:
                outcome = self.ranks[piece.rank].send(
                    links[(piece.rank, piece.peer_rank)], piece.sub_id, src, dst, todo,
                    heads=piece.heads)
            except Exception as exc:  # a refused send, as the plain agent's caller sees it
                log.warning("KV send of %s on rank %d refused: %s", piece.sub_id, piece.rank,
                            exc)
                outcome = SendOutcome.PEER_UNAVAILABLE
            with self._lock:
                piece.in_flight = False
                if outcome is SendOutcome.ACCEPTED:
                    piece.started = True
                    piece.layers.update(todo)
                    piece.backlog.difference_update(todo)
                elif refusal is None:
                    refusal = outcome
                late = outcome is SendOutcome.ACCEPTED and request.failure is not None
            if late:  # the request failed while this piece was being handed over
                self.ranks[piece.rank].cancel(piece.sub_id)
            if refusal not in (None, SendOutcome.WOULD_BLOCK):
                break
        return refusal

    def _num_layers(self) -> int:
        return self.ranks[0].layout.num_layers

    def _wake_retrier(self) -> None:
        with self._lock:
            if self._retrier is None:
                for rank in self.ranks:
                    rank.add_sendable_listener(self._room.set)
                self._retrier = threading.Thread(target=self._retry_loop,
                                                 name="kvt-group-retry", daemon=True)
                self._retrier.start()
        self._room.set()

    def _retry_loop(self) -> None:
        """Layers of accepted requests that waited for room, handed on as room comes; a
        request still waiting at its deadline fails."""
        while not self._closing.is_set():
            self._room.wait(0.05)
            self._room.clear()
            with self._lock:
                waiting = [r for r in self._requests.values() if r.role is Role.SEND
                           and r.failure is None and any(p.backlog for p in r.pieces.values())]
            for request in waiting:
                if time.monotonic() - request.created > self.transfer_timeout_s:
                    refusal = SendOutcome.WOULD_BLOCK
                    reason = FailureReason.TIMEOUT
                else:
                    refusal = self._push(request)
                    reason = FailureReason.PEER_LOST
                if refusal is None or (refusal is SendOutcome.WOULD_BLOCK
                                       and reason is not FailureReason.TIMEOUT):
                    continue
                with self._lock:
                    request.failure = request.failure or reason
                self._end_if_failed_or_done(request)

    def cancel_at_peer(self, peer_id: str, request_id: str) -> bool:
        """A send that never started here: each peer rank's receive of its pieces ends now."""
        peer = self._peers.get(peer_id)
        if peer is None:
            return self.ranks[0].cancel_at_peer(peer_id, request_id)
        told = True
        for piece in self._pieces(request_id, self.degree, peer.degree, "send").values():
            told &= self.ranks[piece.rank].cancel_at_peer(
                peer.links[(piece.rank, piece.peer_rank)], piece.sub_id)
        return told

    # -- receiver side ----------------------------------------------------------------------
    def expect(self, request_id: str, dst_block_ids: Sequence[int],
               peer_id: Optional[str] = None, peer_degree: int = 1) -> None:
        """Each of our ranks expects its pieces from a group of `peer_degree` ranks. Raises as
        a plain agent does (nothing expected then: the ranks that did are cancelled)."""
        request = _Request(request_id, Role.RECV, peer_id or "",
                           self._pieces(request_id, peer_degree, self.degree, "recv"))
        with self._lock:
            if (request_id, Role.RECV) in self._requests:
                raise DuplicateRequestError(f"request {request_id!r} already expected")
            self._register(request)
        expected = []
        try:
            for piece in request.pieces.values():
                self.ranks[piece.rank].expect(
                    piece.sub_id, dst_block_ids,
                    heads=None if piece.heads is None else piece.heads[1])
                expected.append(piece)
        except Exception:
            with self._lock:
                request.reported = True  # never reported: the caller gets the exception
                self._unregister(request)
            for piece in expected:
                self.ranks[piece.rank].cancel(piece.sub_id)
            raise

    # -- both sides -------------------------------------------------------------------------
    def cancel(self, request_id: str) -> None:
        """Cancel the request's pieces on every rank; a sender's pieces that never started end
        with it here (no rank agent holds them)."""
        with self._lock:
            requests = [r for (rid, _), r in self._requests.items() if rid == request_id]
            for request in requests:
                request.failure = request.failure or FailureReason.CANCELLED
        for request in requests:
            self._end_if_failed_or_done(request)
        if not requests:  # unknown here (ended already): as a plain agent would
            for rank in self.ranks:
                rank.cancel(request_id)

    def status(self, request_id: str, role: Role) -> Optional[TransferStatus]:
        return self.ranks[0].status(request_id, role)

    def metrics(self) -> dict:
        """Rank 0's figures with the byte and transfer counts summed over the ranks, and each
        rank's bytes (`ranks`)."""
        each = [rank.metrics() for rank in self.ranks]
        out = dict(each[0])
        for name in ("bytes_sent", "bytes_received", "chunks_sent", "transfers_done",
                     "would_block"):
            if name in out:
                out[name] = sum(m.get(name, 0) for m in each)
        out["ranks"] = [{"bytes_sent": m.get("bytes_sent", 0),
                         "bytes_received": m.get("bytes_received", 0)} for m in each]
        return out

    def table_sizes(self) -> dict[str, int]:
        total: dict[str, int] = {}
        for rank in self.ranks:
            for name, value in rank.table_sizes().items():
                total[name] = total.get(name, 0) + value
        with self._lock:
            total["group_requests"] = len(self._requests)
        return total

    def set_link_faults(self, **faults) -> None:
        for rank in self.ranks:
            rank.set_link_faults(**faults)

    def close(self) -> None:
        self._closing.set()
        for rank in self.ranks:
            try:
                rank.close()
            except Exception:  # a rank already gone
                log.debug("closing a rank's agent failed", exc_info=True)


def released_by(group: GroupAgent, rank: int) -> Callable[[TransferStatus], None]:
    """The on_release callback of rank `rank`'s agent."""
    return lambda status: group.rank_released(rank, status)

