"""UCX backend through ucxx's synchronous core API: worker-address endpoints and tag messages,
one worker per agent with its own progress thread.

Modes (KVTransferConfig.ucx_mode), chosen once per agent because a UCX context is fixed at birth:
- tcp: UCX_TLS=tcp,self, event-driven progress thread, endpoint error handling on (UCX itself
  reports a dead peer).
- shm: UCX_TLS=sm,self, polling progress thread (shared-memory transports have no wakeup
  event; it keeps one core busy), endpoint error handling off, because on this UCX shared
  memory refuses endpoints with error handling. Peer death is then found by kv_transfer's own
  heartbeats and deadlines (peer.py), never by UCX.
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
# complete (see UCXLink.recv_many); batches of regions larger than this reuse it in turn.
_STAGING_CAP_BYTES = 64 << 20
# Buffers of operations given up on, with their requests: UCX may still read or write them
# (a matched receive cannot be cancelled), so they stay allocated until UCX is done with them.
_abandoned: list = []
_abandoned_lock = threading.Lock()


def _abandon(buffers, requests) -> None:
    with _abandoned_lock:
        _abandoned[:] = [(b, r) for b, r in _abandoned if not all(x.completed for x in r)]
        _abandoned.append((buffers, requests))


def _wait(request, deadline: float, what: str) -> None:
    """Poll one request until it completes or the deadline passes. ucxx's synchronous API has
    no blocking wait; the sleep grows with the time already waited (an idle reader ends up
    at 1 ms), so polling adds at most a few percent of latency and little CPU."""
    started = time.monotonic()
    spins = 0
    while not request.completed:
        now = time.monotonic()
        if now > deadline:
            raise LinkTimeoutError(f"UCX {what} timed out after {now - started:.2f}s")
        spins += 1
        time.sleep(0 if spins < 50 else min(0.001, max(0.0001, (now - started) / 40)))
    try:
        request.check_error()
    except Exception as exc:  # ucxx raises its own exception family
        raise LinkError(f"UCX {what} failed: {exc}") from exc


def _as_bytes(buf: torch.Tensor) -> torch.Tensor:
    if buf.device.type != "cpu":
        raise KVTransferError("the ucx backend here moves host memory only")
    return buf.reshape(-1).view(torch.uint8)


def _host_array(buf: torch.Tensor):
    _, Array = _ucx()
    return Array(_as_bytes(buf).numpy())


def _batches(bufs: list, cap: int) -> list:
    """Split bufs into runs of at most cap bytes (a larger buffer forms a batch of its own)."""
    batches, current, size = [], [], 0
    for buf in bufs:
        n = buf.numel() * buf.element_size()
        if current and size + n > cap:
            batches.append(current)
            current, size = [], 0
        current.append(buf)
        size += n
    if current:
        batches.append(current)
    return batches


class UCXLink(Link):
    def __init__(self, endpoint, send_tag: int, recv_tag: int):
        self._ep = endpoint
        self._send_tag, self._recv_tag = send_tag, recv_tag
        self._closed = False
        self._close_lock = threading.Lock()
        self._staging = torch.empty(0, dtype=torch.uint8)

    def send_bytes(self, buf: torch.Tensor, timeout_s: float) -> None:
        self.send_many([buf], timeout_s)

    def recv_bytes(self, buf: torch.Tensor, timeout_s: float) -> None:
        self.recv_many([buf], timeout_s)

    def _post(self, bufs: list, what: str):
        """Post every operation at once, so regions pipeline; returns (arrays, requests)."""
        if self._closed:
            raise LinkError("link closed")
        ucx_api, _ = _ucx()
        arrays = [_host_array(b) for b in bufs]
        requests = []
        try:
            for array in arrays:
                if what == "send":
                    requests.append(self._ep.tag_send(array, tag=ucx_api.UCXXTag(self._send_tag)))
                else:
                    requests.append(self._ep.tag_recv(array, tag=ucx_api.UCXXTag(self._recv_tag)))
        except Exception as exc:
            self._give_up(arrays, requests)
            raise LinkError(f"UCX {what} failed: {exc}") from exc
        return arrays, requests

    def _give_up(self, buffers, requests) -> None:
        _abandon(buffers, requests)
        self.close()

    def send_many(self, bufs: list, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        arrays, requests = self._post(bufs, "send")
        try:
            for request in requests:
                _wait(request, deadline, "send")
        except LinkError:
            # UCX may still read the sources (a rendezvous get); keep them alive.
            self._give_up(arrays, requests)
            raise

    def recv_many(self, bufs: list, timeout_s: float) -> None:
        """Receive into the staging buffer, copying each region out once its request completed.
        A receive given up on (deadline, reset) may still be written by UCX later: a matched
        receive is not cancellable, and a sender frozen mid-message can resume. Such late bytes
        land in the abandoned staging buffer, never in KV blocks the engine has freed."""
        deadline = time.monotonic() + timeout_s
        for batch in _batches(bufs, _STAGING_CAP_BYTES):
            sizes = [b.numel() * b.element_size() for b in batch]
            if self._staging.numel() < sum(sizes):
                self._staging = torch.empty(sum(sizes), dtype=torch.uint8)
            staging, views, offset = self._staging, [], 0
            for n in sizes:
                views.append(staging[offset:offset + n])
                offset += n
            arrays, requests = self._post(views, "recv")
            try:
                for request, view, buf in zip(requests, views, batch):
                    _wait(request, deadline, "recv")
                    # numpy's copy runs on this thread alone: torch's would wake its OpenMP
                    # pool, which spins against the progress threads on a small box.
                    numpy.copyto(_as_bytes(buf).numpy(), view.numpy())
            except LinkError:
                self._staging = torch.empty(0, dtype=torch.uint8)  # never reuse what UCX may write
                self._give_up((staging, arrays), requests)
                raise

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
        self._worker.start_progress_thread(polling_mode=self.mode == "shm")
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
                _wait(request, time.monotonic() + timeout_s, "hello")
            except LinkError:
                _abandon(array, [request])
                raise
        except LinkError:
            raise
        except Exception as exc:
            raise LinkError(f"cannot reach UCX peer: {exc}") from exc
        return self._track(UCXLink(endpoint, to_acceptor, to_us))

    def accept(self, timeout_s: float) -> Optional[Link]:
        ucx_api, _ = _ucx()
        if self._closed:
            return None
        if self._hello_request is None:
            self._hello_array = _host_array(self._hello)
            self._hello_request = self._worker.tag_recv(self._hello_array, tag=ucx_api.UCXXTag(_ACCEPT_TAG))
        deadline = time.monotonic() + timeout_s
        while not self._hello_request.completed:
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
        return self._track(UCXLink(endpoint, hello["to_connector"], hello["to_acceptor"]))

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
