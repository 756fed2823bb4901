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


def _wait(request, timeout_s: float, what: str, on_timeout) -> None:
    deadline = time.monotonic() + timeout_s
    spins = 0
    while not request.completed:
        if time.monotonic() > deadline:
            on_timeout()
            raise LinkTimeoutError(f"UCX {what} timed out after {timeout_s:.2f}s")
        # Spin briefly for small frames, then back off so two processes on two cores still breathe.
        spins += 1
        time.sleep(0 if spins < 200 else 0.0002)
    try:
        request.check_error()
    except Exception as exc:  # ucxx raises its own exception family
        raise LinkError(f"UCX {what} failed: {exc}") from exc


def _host_array(buf: torch.Tensor):
    if buf.device.type != "cpu":
        raise KVTransferError("the ucx backend here moves host memory only")
    _, Array = _ucx()
    return Array(buf.reshape(-1).view(torch.uint8).numpy())


class UCXLink(Link):
    def __init__(self, endpoint, send_tag: int, recv_tag: int):
        self._ep = endpoint
        self._send_tag, self._recv_tag = send_tag, recv_tag
        self._closed = False
        self._close_lock = threading.Lock()

    def send_bytes(self, buf: torch.Tensor, timeout_s: float) -> None:
        self._op(buf, timeout_s, "send")

    def recv_bytes(self, buf: torch.Tensor, timeout_s: float) -> None:
        self._op(buf, timeout_s, "recv")

    def send_many(self, bufs: list, timeout_s: float) -> None:
        self._post_all(bufs, timeout_s, "send")

    def recv_many(self, bufs: list, timeout_s: float) -> None:
        self._post_all(bufs, timeout_s, "recv")

    def _op(self, buf: torch.Tensor, timeout_s: float, what: str) -> None:
        self._post_all([buf], timeout_s, what)

    def _post_all(self, bufs: list, timeout_s: float, what: str) -> None:
        if self._closed:
            raise LinkError("link closed")
        ucx_api, _ = _ucx()
        deadline = time.monotonic() + timeout_s
        arrays = [_host_array(b) for b in bufs]  # kept alive until every request completed
        try:
            if what == "send":
                requests = [self._ep.tag_send(a, tag=ucx_api.UCXXTag(self._send_tag)) for a in arrays]
            else:
                # Endpoint-owned recvs: closing the endpoint cancels them, so a timed-out recv
                # can never land in a block after its transfer was released.
                requests = [self._ep.tag_recv(a, tag=ucx_api.UCXXTag(self._recv_tag)) for a in arrays]
        except Exception as exc:
            self.close()
            raise LinkError(f"UCX {what} failed: {exc}") from exc
        try:
            for request in requests:
                _wait(request, deadline - time.monotonic(), what, self.close)
        except LinkError:
            self.close()
            raise
        del arrays

    def close(self) -> None:
        with self._close_lock:  # reader and writer may both give up on the link at once
            if self._closed:
                return
            self._closed = True
            # An endpoint UCX already failed is torn down by ucxx itself (closing it again
            # crashes); a live one is closed here, which cancels its pending recvs.
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
            _wait(endpoint.tag_send(array, tag=ucx_api.UCXXTag(_ACCEPT_TAG)), timeout_s, "hello", lambda: None)
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
            time.sleep(0.002)
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
