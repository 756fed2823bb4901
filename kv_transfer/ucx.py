"""UCX backend through ucxx's synchronous core API: worker-address endpoints and tag messages,
one worker per agent.

Modes (KVTransferConfig.ucx_mode), chosen once per agent because a UCX context is fixed at birth:
- tcp: UCX_TLS=tcp,self, event-driven progress thread, endpoint error handling on (UCX itself
  reports a dead peer).
- shm: UCX_TLS=sm,self, no progress thread: whichever agent thread waits on a request drives
  the worker (ucxx workers are thread-safe). Shared-memory transports have no wakeup event, so
  a progress thread would have to poll and keep a core busy even when idle; here an idle link
  costs the reader's backed-off polls, and the receiving thread pulls the bytes itself.
  Endpoint error handling is off, because on this UCX shared memory refuses endpoints with it.
  Peer death is then found by kv_transfer's own heartbeats and deadlines (peer.py).
- auto: shm when the agent listens on a loopback host (all peers share the machine) and a
  shared-memory context can be created; tcp otherwise.
RDMA (rc/dc/ud) would be picked by UCX's own TLS=all on hardware that has it; not on this box.
"""

from __future__ import annotations

import ipaddress
import secrets
import threading
import time
from typing import Optional

import msgpack
import numpy
import torch

from kv_transfer.base import KVTransferError, Link, LinkError, LinkTimeoutError, Transport

_ACCEPT_TAG = 1
_HELLO_BYTES = 4096
_TLS = {"tcp": "tcp,self", "shm": "sm,self"}
_CALLER_PROGRESS_MODES = ("shm",)  # modes whose waiting threads drive the worker themselves


def _ucx():
    import ucxx._lib.libucxx as ucx_api
    from ucxx._lib.arr import Array
    return ucx_api, Array


def resolve_mode(requested: str, host: str) -> str:
    if requested != "auto":
        return requested
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = host == "localhost"
    return "shm" if loopback else "tcp"


# Receives land in a link-owned staging buffer and are copied into the KV blocks only once
# complete (see UCXLink.recv_many); tcp batches larger than this reuse it in turn.
_STAGING_CAP_BYTES = 64 << 20
# In shm mode regions travel as messages of at most this size, so that a received piece is
# still in this core's cache when it is copied out of staging (see UCXLink.recv_many). Over
# tcp a region is one message (splitting measured no gain there).
_PIECE_BYTES = 512 << 10
# Buffers of operations given up on, with their requests: UCX may still read or write them
# (a matched receive cannot be cancelled), so they stay allocated until UCX is done with them.
_abandoned: list = []
_abandoned_lock = threading.Lock()


def _abandon(buffers, requests) -> None:
    with _abandoned_lock:
        _abandoned[:] = [(b, r) for b, r in _abandoned if not all(x.completed for x in r)]
        _abandoned.append((buffers, requests))


def _no_progress() -> None:
    """Progress of a worker whose own thread drives it (tcp)."""


def _idle() -> bool:
    return False


def _wait(requests: list, deadline: float, what: str, progress=_no_progress, expecting=_idle) -> None:
    """Poll until every request completed or the deadline passes, calling progress (the
    worker's, where no progress thread runs) on every poll. ucxx's synchronous API has no
    blocking wait; the sleep grows with the time already waited (an idle reader ends up at
    1 ms), so polling adds at most a few percent of latency and little CPU. One wait covers a
    whole batch: a sender waiting on its regions one by one would restart the fast spin at
    each, and spin a core for the whole transfer while the receiver does the work. While
    expecting() (transfers in flight on the agent) the sleep stays at 0.1 ms, so a header or
    ack is seen within ~0.1 ms rather than up to 1 ms after it landed."""
    started = time.monotonic()
    spins = 0
    pending = [r for r in requests if not r.completed]
    while pending:
        progress()
        pending = [r for r in pending if not r.completed]
        if not pending:
            break
        now = time.monotonic()
        if now > deadline:
            raise LinkTimeoutError(f"UCX {what} timed out after {now - started:.2f}s")
        spins += 1
        if spins < 50:
            time.sleep(0)
        else:
            time.sleep(0.0001 if expecting() else min(0.001, max(0.0001, (now - started) / 40)))
    for request in requests:
        try:
            request.check_error()
        except Exception as exc:  # ucxx raises its own exception family
            raise LinkError(f"UCX {what} failed: {exc}") from exc


def _as_bytes(buf: torch.Tensor) -> torch.Tensor:
    if buf.device.type != "cpu":
        raise KVTransferError("the ucx backend here moves host memory only")
    return buf.reshape(-1).view(torch.uint8)


def _host_array(buf):
    """A ucxx Array over a host tensor's (or numpy array's) bytes."""
    _, Array = _ucx()
    return Array(buf if isinstance(buf, numpy.ndarray) else _as_bytes(buf).numpy())


def _pieces(bufs: list, piece_bytes: int) -> list:
    """The wire messages of bufs: each split into flat numpy byte views of at most piece_bytes.
    Both ends of a link split alike, so a receive always matches a message of its size."""
    pieces = []
    for buf in bufs:
        flat = _as_bytes(buf).numpy()
        pieces.extend(flat[i:i + piece_bytes] for i in range(0, flat.size, piece_bytes))
    return pieces


def _batches(bufs: list, cap: int) -> list:
    """Split bufs into runs of at most cap bytes (a larger buffer forms a batch of its own)."""
    batches, current, size = [], [], 0
    for buf in bufs:
        n = buf.nbytes
        if current and size + n > cap:
            batches.append(current)
            current, size = [], 0
        current.append(buf)
        size += n
    if current:
        batches.append(current)
    return batches


class UCXLink(Link):
    def __init__(self, endpoint, send_tag: int, recv_tag: int, progress=_no_progress):
        self._ep = endpoint
        self.progress = progress  # called while waiting: the worker's own, where no thread drives it
        # With a progress thread, receives are posted all at once and complete one by one.
        self._post_ahead = progress is _no_progress
        self._piece_bytes = 1 << 62 if self._post_ahead else _PIECE_BYTES
        self._expecting = _idle
        ucx_api, _ = _ucx()
        self._send_tag, self._recv_tag = send_tag, recv_tag
        self._tags = {"send": ucx_api.UCXXTag(send_tag), "recv": ucx_api.UCXXTag(recv_tag)}
        self._closed = False
        self._close_lock = threading.Lock()
        self._staging = numpy.empty(0, dtype=numpy.uint8)
        self._slots: dict = {}  # (offset, size) -> ucxx Array over that part of _staging

    def set_expecting(self, expecting) -> None:
        self._expecting = expecting

    def send_bytes(self, buf: torch.Tensor, timeout_s: float) -> None:
        self.send_many([buf], timeout_s)

    def recv_bytes(self, buf: torch.Tensor, timeout_s: float) -> None:
        self.recv_many([buf], timeout_s)

    def _post_into(self, bufs: list, what: str, arrays: list, requests: list) -> None:
        """Post an operation per buffer, appending to arrays and requests (which a failure
        hands to _give_up, together with any posted before)."""
        if self._closed:
            raise LinkError("link closed")
        post, tag = (self._ep.tag_send if what == "send" else self._ep.tag_recv), self._tags[what]
        try:
            for buf in bufs:
                # a numpy byte view, or a ucxx Array made already (a staging slot)
                arrays.append(_host_array(buf) if isinstance(buf, numpy.ndarray) else buf)
                requests.append(post(arrays[-1], tag=tag))
        except Exception as exc:
            self._give_up(arrays, requests)
            raise LinkError(f"UCX {what} failed: {exc}") from exc

    def _give_up(self, buffers, requests) -> None:
        _abandon(buffers, requests)
        self.close()

    def send_many(self, bufs: list, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        arrays, requests = [], []
        self._post_into(_pieces(bufs, self._piece_bytes), "send", arrays, requests)  # all at once, so they pipeline
        try:
            _wait(requests, deadline, "send", self.progress, self._expecting)
        except LinkError:
            # UCX may still read the sources (a rendezvous get); keep them alive.
            self._give_up(arrays, requests)
            raise

    def recv_many(self, bufs: list, timeout_s: float) -> None:
        """Receive into staging, copying each piece out once its request completed.
        A receive given up on (deadline, reset) may still be written by UCX later: a matched
        receive is not cancellable, and a sender frozen mid-message can resume. Such late bytes
        land in the abandoned staging buffer, never in KV blocks the engine has freed.

        shm: this thread pulls each piece itself (inside progress) into one reused slot and
        copies it out at once, while it is still in cache: the copy costs little memory
        traffic beyond the pull's, and no second thread (or GIL hand-off) is involved.
        tcp: every piece is posted at once into a staging area of the batch's size, so the
        progress thread keeps the socket busy while this one copies finished pieces out."""
        deadline = time.monotonic() + timeout_s
        for batch in _batches(_pieces(bufs, self._piece_bytes), _STAGING_CAP_BYTES):
            window = len(batch) if self._post_ahead else 1
            slot = max(piece.nbytes for piece in batch)
            if self._staging.nbytes < window * slot:
                self._staging, self._slots = numpy.empty(window * slot, dtype=numpy.uint8), {}
            staging, arrays, requests = self._staging, [], []
            try:
                for index, piece in enumerate(batch):
                    while len(requests) < min(len(batch), index + window):
                        self._post_into([self._slot(len(requests) % window * slot, batch[len(requests)].nbytes)],
                                        "recv", arrays, requests)
                    _wait([requests[index]], deadline, "recv", self.progress, self._expecting)
                    at = index % window * slot
                    # numpy's copy runs on this thread alone: torch's would wake its OpenMP
                    # pool, which spins against the threads driving UCX on a small box.
                    numpy.copyto(piece, staging[at:at + piece.nbytes])
            except LinkError:
                # never reuse what UCX may still write
                self._staging, self._slots = numpy.empty(0, dtype=numpy.uint8), {}
                self._give_up((staging, arrays), requests)
                raise

    def _slot(self, offset: int, size: int):
        """The ucxx Array over staging[offset:offset + size], made once per staging buffer."""
        array = self._slots.get((offset, size))
        if array is None:
            if len(self._slots) > 4096:  # tcp: one per region shape seen; keep it bounded
                self._slots.clear()
            array = self._slots[offset, size] = _host_array(self._staging[offset:offset + size])
        return array

    def close(self) -> None:
        with self._close_lock:  # reader and writer may both give up on the link at once
            if self._closed:
                return
            self._closed = True
            # An endpoint UCX already failed is torn down by ucxx itself (closing it again
            # crashes); a live one is closed here, which cancels its unmatched recvs.
            if self._ep.alive:
                try:
                    self._ep.close()
                except Exception:
                    pass


class UCXTransport(Transport):
    name = "ucx"

    def __init__(self, host: str, port: int, ucx_mode: str = "auto"):
        ucx_api, _ = _ucx()
        self.mode = resolve_mode(ucx_mode, host)
        try:
            self._context = ucx_api.UCXContext(config_dict={"TLS": _TLS[self.mode]})
        except Exception:
            if ucx_mode != "auto":
                raise
            self.mode = "tcp"  # no shared-memory transport here; auto falls back to TCP
            self._context = ucx_api.UCXContext(config_dict={"TLS": _TLS[self.mode]})
        self._worker = ucx_api.UCXWorker(self._context)
        # shm: no progress thread; the thread waiting on a request drives the worker itself.
        if self.mode in _CALLER_PROGRESS_MODES:
            self._progress = self._worker.progress
        else:
            self._worker.start_progress_thread(polling_mode=False)
            self._progress = _no_progress
        self._error_handling = self.mode == "tcp"
        self._hello = torch.empty(_HELLO_BYTES, dtype=torch.uint8)
        self._hello_request = None
        self._links: list[UCXLink] = []
        self._closed = False

    def address(self) -> dict:
        return {"worker": bytes(self._worker.address.tobytes() if hasattr(self._worker.address, "tobytes")
                                else self._worker.address), "mode": self.mode}

    def _endpoint_to(self, worker_address: bytes):
        ucx_api, _ = _ucx()
        address = ucx_api.UCXAddress.create_from_buffer(worker_address)
        return ucx_api.UCXEndpoint.create_from_worker_address(self._worker, address, self._error_handling)

    def connect(self, peer_address: dict, timeout_s: float) -> Link:
        if peer_address.get("mode") != self.mode:
            raise LinkError(f"peer uses UCX mode {peer_address.get('mode')!r}, this agent {self.mode!r}")
        ucx_api, _ = _ucx()
        # Random tags name the two directions of this link; the acceptor learns both from hello.
        to_acceptor, to_us = (secrets.randbits(62) | (1 << 62) for _ in range(2))
        hello = msgpack.packb({"worker": self.address()["worker"], "to_acceptor": to_acceptor, "to_connector": to_us})
        try:
            endpoint = self._endpoint_to(peer_address["worker"])
            payload = torch.zeros(_HELLO_BYTES, dtype=torch.uint8)
            payload[:4] = torch.tensor(list(len(hello).to_bytes(4, "little")), dtype=torch.uint8)
            payload[4:4 + len(hello)] = torch.frombuffer(bytearray(hello), dtype=torch.uint8)
            array = _host_array(payload)
            request = endpoint.tag_send(array, tag=ucx_api.UCXXTag(_ACCEPT_TAG))
            try:
                _wait([request], time.monotonic() + timeout_s, "hello", self._progress)
            except LinkError:
                _abandon(array, [request])
                raise
        except LinkError:
            raise
        except Exception as exc:
            raise LinkError(f"cannot reach UCX peer: {exc}") from exc
        return self._track(self._link(endpoint, to_acceptor, to_us))

    def accept(self, timeout_s: float) -> Optional[Link]:
        ucx_api, _ = _ucx()
        if self._closed:
            return None
        if self._hello_request is None:
            self._hello_array = _host_array(self._hello)
            self._hello_request = self._worker.tag_recv(self._hello_array, tag=ucx_api.UCXXTag(_ACCEPT_TAG))
        deadline = time.monotonic() + timeout_s
        while not self._hello_request.completed:
            self._progress()  # shm: with no link yet, the accept loop is what drives the worker
            if self._hello_request.completed:
                break
            if time.monotonic() > deadline:
                return None
            time.sleep(0.01)  # handshakes are rare; an idle agent should not spin
        request, self._hello_request = self._hello_request, None
        try:
            request.check_error()
            raw = self._hello.numpy().tobytes()
            hello = msgpack.unpackb(raw[4:4 + int.from_bytes(raw[:4], "little")])
            endpoint = self._endpoint_to(hello["worker"])
        except Exception as exc:
            raise LinkError(f"bad UCX hello: {exc}") from exc
        return self._track(self._link(endpoint, hello["to_connector"], hello["to_acceptor"]))

    def _link(self, endpoint, send_tag: int, recv_tag: int) -> UCXLink:
        return UCXLink(endpoint, send_tag, recv_tag, self._progress)

    def _track(self, link: UCXLink) -> UCXLink:
        # Links close their endpoint once; closing an endpoint twice crashes ucxx.
        self._links = [x for x in self._links if not x._closed] + [link]
        return link

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for link in self._links:
            link.close()
        try:
            self._worker.cancel_inflight_requests()
        except Exception:
            pass
        self._worker.stop_progress_thread()
