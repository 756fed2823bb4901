"""Link fault injection for chaos tests (KVTransferConfig.fault_injection): a Transport wrapper
whose links drop, delay, corrupt or duplicate the KV chunks this agent sends, set at run time.

What a fault does, per KV chunk (one `Link.post_many`: a chunk's header frame and its regions;
control frames, i.e. acks, nacks, aborts, heartbeats and the handshake, are never touched):
- drop: the chunk's messages, header and regions, are never sent; the sender sees the post
  succeed, as with a transport that lost them. Only whole chunks vanish: a part of one would
  desynchronize the ordered message stream, which no real transport does silently (it resets
  the link, as a killed peer does). The link stays up; no ack comes, so both sides fail the
  transfer `timeout` at their deadlines.
- delay: the chunk leaves delay_s late. The link is ordered, so whatever is sent on it after
  the chunk (later chunks, acks, heartbeats) queues behind it and the send calls return: a
  stalled stream whose send buffer still takes bytes. A chunk still held at its transfer's
  deadline is not sent; its post fails with LinkTimeoutError and the agent gives the link up,
  as it does for any send past its deadline. A queued control frame still held past its own
  timeout closes the link (a blocking send would have timed out and killed it).
- corrupt: one byte of one region is flipped in a copy (the source blocks stay intact); the
  receiver's checksum catches it and both sides fail `checksum_mismatch`. Without checksums
  the data would land wrong, so the agent refuses corrupt > 0 unless `checksums: true`.
- duplicate: a second copy of the chunk follows right behind it. The receiver never writes a
  layer twice: the copy is read into scratch and nacked `rejected`; a transfer still waiting
  for other layers fails `rejected` on both sides, a complete one stays done.
Each chunk draws one of drop / corrupt / duplicate / intact with the given probabilities and,
when it is sent, whether it is delayed; draws come from one generator seeded by `seed`.
"""

from __future__ import annotations

import collections
import random
import threading
import time
from dataclasses import dataclass
from typing import Optional

import numpy

from pd_runtime.kv_transfer.base import (KVTransferError, Link, LinkError, LinkTimeoutError, PostedSend,
                              Transport, as_byte_tensor, frame_message_count)


class FaultSettingsError(KVTransferError):
    """Fault settings out of range, or faults asked of an agent built without fault injection."""


@dataclass(frozen=True)
class LinkFaults:
    """Per-chunk fault probabilities (see the module docstring); all zero: a clean link."""

    drop: float = 0.0
    corrupt: float = 0.0
    duplicate: float = 0.0
    delay: float = 1.0  # probability that a sent chunk is held delay_s (no effect at delay_s 0)
    delay_s: float = 0.0
    seed: int = 0
    max_faults: Optional[int] = None  # after this many faulty chunks the link is clean again

    def __post_init__(self) -> None:
        for name in ("drop", "corrupt", "duplicate", "delay"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise FaultSettingsError(f"link fault {name!r} is a probability in [0, 1], got {value!r}")
        if self.drop + self.corrupt + self.duplicate > 1.0:
            raise FaultSettingsError("link faults 'drop' + 'corrupt' + 'duplicate' exceed 1: a chunk "
                                     "has at most one of them")
        if self.delay_s < 0:
            raise FaultSettingsError(f"link fault 'delay_s' must be >= 0, got {self.delay_s!r}")
        if self.max_faults is not None and self.max_faults < 0:
            raise FaultSettingsError(f"link fault 'max_faults' must be >= 0, got {self.max_faults!r}")


@dataclass(frozen=True)
class _Plan:
    """What happens to one chunk."""

    drop: bool = False
    duplicate: bool = False
    corrupt_at: Optional[tuple] = None  # (region fraction, byte fraction) in [0, 1)
    delay_s: float = 0.0


_CLEAN = _Plan()


class FaultInjectingTransport(Transport):
    """Wraps a backend; its links apply the current LinkFaults to every chunk they send."""

    def __init__(self, inner: Transport):
        self.inner = inner
        self.name = inner.name  # peers check the backend name in the handshake
        self._lock = threading.Lock()
        self._faults = LinkFaults()
        self._rng = random.Random(0)
        self._faulty_left: Optional[int] = None
        self._counts = {"chunks": 0, "drop": 0, "corrupt": 0, "duplicate": 0, "delay": 0}

    def set_faults(self, faults: LinkFaults) -> None:
        with self._lock:
            self._faults, self._rng, self._faulty_left = faults, random.Random(faults.seed), faults.max_faults

    def counts(self) -> dict:
        """Chunks seen and faults applied since the transport was built."""
        with self._lock:
            return dict(self._counts)

    def draw(self) -> _Plan:
        with self._lock:
            self._counts["chunks"] += 1
            faults, rng = self._faults, self._rng
            if self._faulty_left == 0:
                return _CLEAN
            pick, delayed = rng.random(), rng.random() < faults.delay and faults.delay_s > 0
            if pick < faults.drop:
                plan = _Plan(drop=True)
            elif pick < faults.drop + faults.corrupt:
                plan = _Plan(corrupt_at=(rng.random(), rng.random()), delay_s=faults.delay_s if delayed else 0.0)
            elif pick < faults.drop + faults.corrupt + faults.duplicate:
                plan = _Plan(duplicate=True, delay_s=faults.delay_s if delayed else 0.0)
            else:
                plan = _Plan(delay_s=faults.delay_s) if delayed else _CLEAN
            if plan is not _CLEAN:
                for name in ("drop", "duplicate"):
                    self._counts[name] += getattr(plan, name)
                self._counts["corrupt"] += plan.corrupt_at is not None
                self._counts["delay"] += plan.delay_s > 0
                if self._faulty_left is not None:
                    self._faulty_left -= 1
            return plan

    def address(self) -> dict:
        return self.inner.address()

    def connect(self, peer_address: dict, timeout_s: float) -> Link:
        return FaultInjectingLink(self.inner.connect(peer_address, timeout_s), self)

    def accept(self, timeout_s: float) -> Optional[Link]:
        link = self.inner.accept(timeout_s)
        return FaultInjectingLink(link, self) if link is not None else None

    def close(self) -> None:
        self.inner.close()

    def __getattr__(self, name):  # backend specifics (e.g. UCXTransport.retired, mode)
        if name == "inner":  # not set yet (a half-built object): no recursion
            raise AttributeError(name)
        return getattr(self.inner, name)


def _corrupted(buf, at: tuple):
    """A copy of buf with one byte flipped at fraction at[1] of its length."""
    copy = as_byte_tensor(buf).clone()
    copy[min(int(at[1] * copy.numel()), copy.numel() - 1)] ^= 0xFF
    return copy.numpy() if isinstance(buf, numpy.ndarray) else copy


class _Held(PostedSend):
    """Messages waiting on a link behind a delay: a chunk held delay_s, or anything sent after
    it (which may not overtake it). The link's release thread sends them when their time comes."""

    def __init__(self, bufs: list, release_at: float, deadline: float, chunk: bool):
        self.bufs, self.release_at, self.deadline, self.chunk = bufs, release_at, deadline, chunk
        self.posted: Optional[PostedSend] = None
        self.error: Optional[Exception] = None
        self.abandoned = False

    def done(self) -> bool:
        if self.error is not None:
            raise self.error
        return self.posted is not None and self.posted.done()

    def abandon(self) -> None:
        self.abandoned = True  # not sent yet: it never will be (the link is given up with it)
        if self.posted is not None:
            self.posted.abandon()


class FaultInjectingLink(Link):
    """A link of FaultInjectingTransport. Sends go out in the order they were made: once a
    chunk is held, what follows queues behind it and the call returns, as a stream's send
    buffer takes bytes while the stream is stalled."""

    def __init__(self, inner: Link, owner: FaultInjectingTransport):
        self.inner, self.owner = inner, owner
        self.posts_async = inner.posts_async
        self._cond = threading.Condition(threading.RLock())
        self._held: collections.deque = collections.deque()
        self._releasing = False
        self._closed = False

    # ----- KV chunks -----
    def post_many(self, bufs: list, timeout_s: float) -> PostedSend:
        plan = self.owner.draw()
        if plan.drop:
            return PostedSend()
        bufs = list(bufs)
        regions = len(bufs) - frame_message_count(bufs[0])
        if plan.corrupt_at is not None and regions > 0:
            index = len(bufs) - regions + min(int(plan.corrupt_at[0] * regions), regions - 1)
            bufs[index] = _corrupted(bufs[index], plan.corrupt_at)
        if plan.duplicate:
            bufs = bufs + bufs
        with self._cond:
            if self._closed:
                raise LinkError("link closed")
            if plan.delay_s <= 0 and not self._held:
                return self.inner.post_many(bufs, timeout_s)
            return self._hold(bufs, plan.delay_s, timeout_s, chunk=True)

    # ----- control frames (and anything else sent with send_*) -----
    def send_many(self, bufs: list, timeout_s: float) -> None:
        with self._cond:
            if self._closed:
                raise LinkError("link closed")
            if not self._held:
                self.inner.send_many(bufs, timeout_s)
                return
            # the caller may reuse its buffers once this returns
            self._hold([as_byte_tensor(b).clone() for b in bufs], 0.0, timeout_s, chunk=False)

    def send_bytes(self, buf, timeout_s: float) -> None:
        self.send_many([buf], timeout_s)

    def _hold(self, bufs: list, delay_s: float, timeout_s: float, chunk: bool) -> _Held:
        now = time.monotonic()
        held = _Held(bufs, now + delay_s, now + timeout_s, chunk)
        self._held.append(held)
        if not self._releasing:
            self._releasing = True
            threading.Thread(target=self._release_loop, daemon=True, name="kvt-fault-release").start()
        self._cond.notify_all()
        return held

    def _release_loop(self) -> None:
        with self._cond:
            while self._held and not self._closed:
                head, now = self._held[0], time.monotonic()
                # A send that cannot leave by its deadline: a chunk fails (the agent then gives
                # the link up); a control frame would have timed out in a blocking send, which
                # kills the link.
                if any(not h.chunk and now > h.deadline for h in self._held):
                    self.close()
                    break
                if now < head.release_at:
                    waits = [head.release_at] + [h.deadline for h in self._held if not h.chunk]
                    self._cond.wait(max(0.0, min(waits) - now))
                    continue
                self._held.popleft()
                if head.abandoned:
                    continue
                if now > head.deadline:
                    head.error = LinkTimeoutError("chunk held by an injected delay past its deadline")
                    continue
                try:
                    if head.chunk:
                        head.posted = self.inner.post_many(head.bufs, head.deadline - now)
                    else:
                        self.inner.send_many(head.bufs, head.deadline - now)
                except Exception as exc:
                    head.error = exc if isinstance(exc, LinkError) else LinkError(f"post failed: {exc!r}")
                    if not head.chunk:
                        self.close()
            for held in self._held:  # closed: what is still held never leaves
                held.error = LinkError("link closed")
            self._held.clear()
            self._releasing = False

    # ----- receiving is untouched -----
    def recv_bytes(self, buf, timeout_s: float) -> None:
        self.inner.recv_bytes(buf, timeout_s)

    def recv_many(self, bufs: list, timeout_s: float) -> None:
        self.inner.recv_many(bufs, timeout_s)

    def set_activity(self, active) -> None:
        self.inner.set_activity(active)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self.inner.close()
