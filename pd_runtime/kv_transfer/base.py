"""The kv_transfer contract: transfer states and failure reasons, handshake metadata, errors,
and the two interfaces a backend implements (Transport opens Links; a Link moves bytes).

Ownership, written once here and honoured by agent.py:
- Sender (prefill side): when `send()` returns ACCEPTED for a new request id, the source
  blocks are leased to the transfer. The lease ends exactly once, when the transfer is
  reported finished (done or failed, by `poll()` and the optional `on_release` callback):
  completion, failure, lease/transfer deadline, peer lost, or cancellation on either side.
  Until then the engine must neither free nor overwrite those blocks.
- Receiver (decode side): the engine reserves destination block ids and announces them with
  `expect()`. The transport writes only those blocks. When the transfer is reported finished
  the agent never touches them again: done -> they hold the KV; failed -> the engine frees them.
"""

from __future__ import annotations

import enum
import threading
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Callable, Optional

import msgpack
import numpy
import torch

# Layout tag written into the handshake: kv_caches[layer][k_or_v, block, token, head, dim].
KV_LAYOUT = "layer_kv_block_head_token_dim"
PROTOCOL_VERSION = 1


class TransferState(str, enum.Enum):
    PENDING = "pending"
    TRANSFERRING = "transferring"
    DONE = "done"
    FAILED = "failed"


class FailureReason(str, enum.Enum):
    PEER_LOST = "peer_lost"
    TIMEOUT = "timeout"
    CHECKSUM_MISMATCH = "checksum_mismatch"
    CANCELLED = "cancelled"
    METADATA_MISMATCH = "metadata_mismatch"
    # The receiver had no matching reservation (unknown request or other block ids).
    REJECTED = "rejected"
    SHUTDOWN = "shutdown"


class SendOutcome(str, enum.Enum):
    ACCEPTED = "accepted"  # queued; for a new request the lease starts now
    WOULD_BLOCK = "would_block"  # queue or credit window full; nothing leased, retry or reroute
    PEER_UNAVAILABLE = "peer_unavailable"  # link failed or closed; nothing leased, reconnect


class Role(str, enum.Enum):
    SEND = "send"
    RECV = "recv"


class LinkState(str, enum.Enum):
    CONNECTING = "connecting"
    READY = "ready"
    FAILED = "failed"


@dataclass(frozen=True)
class TransferStatus:
    """What `poll()` and `status()` report; picklable, no tensors."""

    request_id: str
    peer_id: str
    role: Role
    state: TransferState
    reason: Optional[FailureReason] = None
    num_bytes: int = 0
    layers_done: int = 0

    @property
    def finished(self) -> bool:
        return self.state in (TransferState.DONE, TransferState.FAILED)


class KVTransferError(Exception):
    """Base of every error kv_transfer raises."""


class MetadataMismatchError(KVTransferError):
    def __init__(self, field_name: str, ours, theirs):
        super().__init__(f"KV metadata mismatch on {field_name!r}: ours={ours!r} peer={theirs!r}")
        self.field_name = field_name


class LayoutError(KVTransferError):
    """The registered KV cache does not have the layout kv_transfer moves."""


class BlockIdError(KVTransferError):
    """Block id lists that are malformed, out of range or of different lengths."""


class UnknownPeerError(KVTransferError):
    pass


class DuplicateRequestError(KVTransferError):
    pass


class LinkError(KVTransferError):
    """The link to a peer is unusable (closed, reset, aborted)."""


class LinkTimeoutError(LinkError):
    """A wire operation passed its deadline; the link is closed afterwards."""


# Fields that must agree between peers before any byte of KV moves.
_MATCHED_FIELDS = ("protocol", "model_id", "dtype", "block_size", "num_layers", "num_kv_heads",
                   "head_dim", "layout", "backend")


@dataclass(frozen=True)
class AgentMetadata:
    engine_id: str
    backend: str
    address: dict
    model_id: str
    dtype: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    num_blocks: int
    layout: str = KV_LAYOUT
    protocol: int = PROTOCOL_VERSION
    extra: dict = field(default_factory=dict)

    def encode(self) -> bytes:
        return msgpack.packb(self.__dict__, use_bin_type=True)

    @classmethod
    def decode(cls, data: bytes) -> "AgentMetadata":
        return cls(**msgpack.unpackb(data, raw=False))

    def check_compatible(self, peer: "AgentMetadata") -> None:
        """Raise MetadataMismatchError naming the first field that differs. Ranks of
        tensor-parallel workers (`extra["model_kv_heads"]`: the model's KV heads, of which the
        cache holds num_kv_heads) may hold different numbers of them; the model's must agree."""
        for name in _MATCHED_FIELDS:
            ours, theirs = getattr(self, name), getattr(peer, name)
            if name == "num_kv_heads" and ("model_kv_heads" in self.extra
                                           or "model_kv_heads" in peer.extra):
                name = "model_kv_heads"
                ours = self.extra.get(name, self.num_kv_heads)
                theirs = peer.extra.get(name, peer.num_kv_heads)
            if ours != theirs:
                raise MetadataMismatchError(name, ours, theirs)


def pack_frame(message: dict) -> bytes:
    return msgpack.packb(message, use_bin_type=True)


def unpack_frame(data: bytes) -> dict:
    return msgpack.unpackb(data, raw=False)


# Control frames travel as one fixed-size message (most fit) plus a tail for long ones, so a
# receiver can always post a recv of known size: gloo and UCX tag recv both need that.
FRAME_BYTES = 1024
_LEN_BYTES = 4


def frame_buffers(payload: bytes) -> list:
    """The messages that carry one control frame: a FRAME_BYTES head (length + start of the
    payload) and, for long payloads only, a tail. A writer may post them together with the
    KV regions that follow, so the header costs no round of its own."""
    head = numpy.zeros(FRAME_BYTES, dtype=numpy.uint8)
    head[:_LEN_BYTES] = numpy.frombuffer(len(payload).to_bytes(_LEN_BYTES, "little"), dtype=numpy.uint8)
    first = payload[: FRAME_BYTES - _LEN_BYTES]
    head[_LEN_BYTES:_LEN_BYTES + len(first)] = numpy.frombuffer(first, dtype=numpy.uint8)
    tail = payload[FRAME_BYTES - _LEN_BYTES:]
    return [head, numpy.frombuffer(bytearray(tail), dtype=numpy.uint8)] if tail else [head]


def frame_message_count(head) -> int:
    """How many messages carry the frame whose FRAME_BYTES head this is: 1, or 2 with a tail."""
    length = int.from_bytes(as_byte_tensor(head)[:_LEN_BYTES].numpy().tobytes(), "little")
    return 1 if length <= FRAME_BYTES - _LEN_BYTES else 2


def as_byte_tensor(buf) -> torch.Tensor:
    """A message buffer as a flat uint8 tensor sharing its memory. Links take either a tensor
    (host or device) or a flat numpy uint8 array (host; kv_transfer builds host regions and
    frames as numpy views, which cost a fraction of a microsecond where a torch view costs
    several)."""
    if isinstance(buf, numpy.ndarray):
        return torch.from_numpy(buf)
    return buf.reshape(-1).view(torch.uint8)


class Activity:
    """Whether transfers are in flight on an agent, and since when a new one last started.
    Set by the agent on send/expect, cleared when none is left; polling links read it to poll
    fast right after a transfer starts and to sleep on it while idle (Link.set_activity)."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.since = 0.0  # time.monotonic() of the latest mark()

    def mark(self) -> None:
        self.since = time.monotonic()
        self.event.set()

    def clear(self) -> None:
        self.event.clear()

    def is_set(self) -> bool:
        return self.event.is_set()

    def wait(self, timeout_s: float) -> bool:
        return self.event.wait(timeout_s)


class PostedSend:
    """Messages a link has started sending (Link.post_many). The peer's writer thread calls
    done() until it is True; done() raises LinkError when the send failed. abandon() gives
    it up with the link: buffers stay alive as long as the backend may still read them."""

    def done(self) -> bool:
        return True

    def abandon(self) -> None:
        pass


class FailedPost(PostedSend):
    """A post that raised: the writer thread surfaces the error as the link's failure."""

    def __init__(self, error: Exception):
        self.error = error

    def done(self) -> bool:
        raise self.error


class Link(ABC):
    """One established, bidirectional, ordered connection to one peer. Blocking calls, each
    bounded by a timeout, used by exactly one writer thread and one reader thread."""

    @abstractmethod
    def send_bytes(self, buf, timeout_s: float) -> None:
        """Send a contiguous tensor's (or flat numpy uint8 array's) bytes as one message."""

    @abstractmethod
    def recv_bytes(self, buf, timeout_s: float) -> None:
        """Receive exactly one message into a contiguous buffer of the message's size."""

    def send_many(self, bufs: list, timeout_s: float) -> None:
        """Send several messages in order; backends that can post them all at once do, so a
        request's regions pipeline instead of paying one round trip each."""
        for buf in bufs:
            self.send_bytes(buf, timeout_s)

    def recv_many(self, bufs: list, timeout_s: float) -> None:
        """Receive several messages in order. Once this raises (timeout, reset), the link is
        dead and no byte lands in bufs afterwards, even if the peer resumes sending: the caller
        hands those blocks back to its engine."""
        for buf in bufs:
            self.recv_bytes(buf, timeout_s)

    # Whether post_many returns at once (then any thread may post; the writer watches the
    # sends); where it does not, only the peer's writer thread sends.
    posts_async = False

    def post_many(self, bufs: list, timeout_s: float) -> PostedSend:
        """Start sending several messages in order and return without waiting for them where
        the backend can (posts_async); the caller holds the peer's send lock while posting, so
        a group stays contiguous on the wire. The default sends them now."""
        self.send_many(bufs, timeout_s)
        return PostedSend()

    @abstractmethod
    def close(self) -> None:
        """Abort the link: pending operations fail, nothing is written afterwards."""

    def set_activity(self, active: "Activity") -> None:
        """active is set while transfers are in flight on the agent (a message may arrive any
        moment) and clear otherwise; a backend that polls may then poll fast, and an idle
        poller may sleep on it so that it wakes as soon as a transfer starts. Blocking
        backends ignore it."""

    def send_frame(self, payload: bytes, timeout_s: float) -> None:
        self.send_many(frame_buffers(payload), timeout_s)

    def recv_frame(self, timeout_s: float) -> bytes:
        head = numpy.empty(FRAME_BYTES, dtype=numpy.uint8)
        self.recv_bytes(head, timeout_s)
        raw = head.tobytes()
        length = int.from_bytes(raw[:_LEN_BYTES], "little")
        first = raw[_LEN_BYTES:_LEN_BYTES + min(length, FRAME_BYTES - _LEN_BYTES)]
        rest = length - len(first)
        if rest <= 0:
            return first
        tail = numpy.empty(rest, dtype=numpy.uint8)
        self.recv_bytes(tail, timeout_s)
        return first + tail.tobytes()


class Transport(ABC):
    """A backend: listens for peers and opens Links. Blocking calls run on agent threads."""

    name: str

    @abstractmethod
    def address(self) -> dict:
        """Where peers reach this transport; goes into the handshake metadata."""

    @abstractmethod
    def connect(self, peer_address: dict, timeout_s: float) -> Link:
        """Open a link to a peer's transport; raise LinkError on failure or timeout."""

    @abstractmethod
    def accept(self, timeout_s: float) -> Optional[Link]:
        """Return the next incoming link, or None when none arrived within timeout_s."""

    @abstractmethod
    def close(self) -> None: ...


ReleaseCallback = Callable[[TransferStatus], None]
