"""UCX backend through ucxx's synchronous core API: worker-address endpoints and tag messages,
one worker per agent.

Modes (KVTransferConfig.ucx_mode), chosen once per agent because a UCX context is fixed at birth:
- tcp: UCX_TLS=tcp,self, event-driven progress thread, endpoint error handling on (UCX itself
  reports a dead peer). Receives land in a staging buffer first (see UCXLink.recv_many).
- shm: UCX_TLS=sm,self, no progress thread: whichever agent thread waits on a request drives
  the worker (ucxx workers are thread-safe). Shared-memory transports have no wakeup event, so
  a progress thread would have to poll and keep a core busy even when idle; here an idle link
  costs the reader's backed-off polls, and the receiving thread pulls the bytes itself.
  Rendezvous is forced to the get scheme above 4 KiB (the receiver pulls the bytes with CMA),
  so every write into a receive buffer happens inside this worker's own progress calls; that
  is what lets shm receive straight into the KV blocks (see UCXLink._drain_receives).
  Endpoint error handling is off, because on this UCX shared memory refuses endpoints with it.
  Peer death is then found by kv_transfer's own heartbeats and deadlines (peer.py).
- cuda: chosen whenever the KV cache is on a CUDA device (a host mode cannot carry device
  memory). UCX_TLS=cuda_ipc,cuda_copy,sm,tcp,self: cuda_ipc moves KV between processes on one
  GPU, or GPUs of one node with peer access; cuda_copy lets UCX detect device memory (ucxx
  refuses a device buffer without it) and stage it where no direct path exists (tcp between
  nodes); sm/tcp carry control frames. As shm otherwise: caller-driven progress (no transport
  here has a wakeup event), error handling off, receives in place. The get scheme matters
  more here: UCX's default for device-to-device over cuda_ipc is put (the sender's copy
  writes the receiver's blocks); with get the receiver's progress issues the copy out of the
  sender's mapped memory (UCX turns get over cuda_ipc off without NVLink; the mode turns it
  back on: ucx_worker.prepare_environment). UCX_MEMTYPE_CACHE stays n, as importing ucxx
  sets it (a global option a context cannot change): the cache can mistake device memory for
  host memory.
- rdma: only when configured, for host or CUDA caches on machines with InfiniBand or RoCE
  NICs. UCX_TLS=rc,dc,sm,self (+cuda for a CUDA cache, so UCX registers the KV blocks with the
  NIC: GPUDirect RDMA), set only where the user has not (ucx_worker.mode_environment). As cuda
  otherwise (caller-driven progress, receives in place, the get scheme: the receiver's NIC
  reads), but endpoint error handling on: without it UCX aborts the process on a transport
  error, which is what a dead peer gives over RC. A machine without an RDMA device, or a UCX
  that cannot use it, fails at agent start; never a fallback to tcp.
- auto: cuda for a CUDA cache; else shm when the agent listens on a loopback host (all peers
  share the machine) and a shared-memory context can be created; tcp otherwise. Never rdma.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from typing import Optional

import msgpack
import numpy
import torch

from pd_runtime.kv_transfer.base import Activity, Link, LinkError, PostedSend, Transport
from pd_runtime.kv_transfer.backends.ucx_worker import (DIRECT_MIN_BYTES, DeviceBytes, Worker, abandon,
                                    check_cuda_transports, check_rdma_transports, context_config,
                                    cuda_device, device_array, flat, host_array,
                                    prepare_environment, require_rdma_devices, resolve_mode,
                                    ucx_modules, wait)

logger = logging.getLogger(__name__)

_ACCEPT_TAG = 1
_HELLO_BYTES = 4096
# How long a given-up receive is driven to its end (cancelled, or pulled whole) before the
# worker is retired instead (see UCXLink._drain_receives). rdma: a read from a dead peer ends
# when RC gives up, after UCX_RC_TIMEOUT x (UCX_RC_RETRY_COUNT + 1), ~8.6 s by default.
_DRAIN_S = 2.0
_RDMA_DRAIN_S = 15.0


# tcp receives land in a link-owned staging buffer and are copied into the KV blocks only once
# complete (see UCXLink.recv_many); batches larger than this reuse it in turn.
_STAGING_CAP_BYTES = 64 << 20
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
    posts_async = True

    def __init__(self, endpoint, send_tag: int, recv_tag: int, worker: "Worker",
                 drain_s: float = _DRAIN_S):
        self._ep = endpoint
        self._worker = worker
        self._drain_s = drain_s
        self._device_ok = worker.device is not None  # device tensors travel as they are
        self.progress = worker.progress  # called while waiting: the worker's own, where no thread drives it
        self._active: Optional[Activity] = None
        ucx_api, _ = ucx_modules()
        self._send_tag, self._recv_tag = send_tag, recv_tag
        self._tags = {"send": ucx_api.UCXXTag(send_tag), "recv": ucx_api.UCXXTag(recv_tag)}
        self._closed = False
        self._close_lock = threading.Lock()
        self._staging = numpy.empty(0, dtype=numpy.uint8)
        self._slots: dict = {}  # (offset, size) -> ucxx Array over that part of _staging

    def set_activity(self, active: Activity) -> None:
        self._active = active

    def send_bytes(self, buf: torch.Tensor, timeout_s: float) -> None:
        self.send_many([buf], timeout_s)

    def recv_bytes(self, buf: torch.Tensor, timeout_s: float) -> None:
        self.recv_many([buf], timeout_s)

    def _post_into(self, bufs: list, what: str, arrays: list, requests: list) -> None:
        """Post an operation per buffer, appending to arrays and requests (which the caller
        hands to its give-up path on failure, together with any posted before)."""
        post, tag = (self._ep.tag_send if what == "send" else self._ep.tag_recv), self._tags[what]
        # Under the close lock: an operation posted on an endpoint that another thread is
        # closing would escape the close's cancellation and stay pending for good.
        with self._close_lock:
            if self._closed:
                raise LinkError("link closed")
            try:
                if self._device_ok:
                    self._worker.bind_thread()
                for buf in bufs:
                    # a numpy byte view, device bytes, or a ucxx Array made already (a staging slot)
                    arrays.append(host_array(buf) if isinstance(buf, numpy.ndarray) else
                                  device_array(buf) if type(buf) is DeviceBytes else buf)
                    requests.append(post(arrays[-1], tag=tag))
            except Exception as exc:
                raise LinkError(f"UCX {what} failed: {exc}") from exc

    def send_many(self, bufs: list, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        arrays, requests = [], []
        try:
            views = flat(bufs, self._device_ok)
            if self._device_ok:
                self._worker.sources_ready(views)
            self._post_into(views, "send", arrays, requests)  # all at once, so they pipeline
            wait(requests, deadline, "send", self.progress, self._active)
        except LinkError:
            # UCX may still read the sources (a rendezvous get): keep the arrays alive. A late
            # read of a source only ever feeds a receive that was given up on as well.
            abandon(arrays, requests)
            self.close()
            raise

    def post_many(self, bufs: list, timeout_s: float) -> PostedSend:
        arrays, requests = [], []
        try:
            views = flat(bufs, self._device_ok)
            if self._device_ok:
                self._worker.sources_ready(views)
            self._post_into(views, "send", arrays, requests)
        except LinkError:
            abandon(arrays, requests)
            self.close()
            raise
        return _UCXPosted(self, arrays, requests)

    def recv_many(self, bufs: list, timeout_s: float) -> None:
        """Contract (base.Link): once this raised, no byte lands in bufs later.

        shm, cuda, rdma (caller-driven worker): every message of 4 KiB or more, and every device
        message, is received in place, all posted at once; smaller host ones (eager) go through
        staging. A give-up drives the receives to their end before raising (_drain_receives).
        tcp (progress thread): every message is received into staging, all posted at once so
        the progress thread keeps the socket busy, and copied out once its request completed.
        A give-up parks the staging buffer with its requests; late bytes land there."""
        deadline = time.monotonic() + timeout_s
        if self._worker.caller_progress:
            self._recv_in_place(flat(bufs, self._device_ok), deadline)
            return
        for batch in _batches(flat(bufs), _STAGING_CAP_BYTES):
            self._recv_staged(batch, deadline)

    def _recv_in_place(self, views: list, deadline: float) -> None:
        self._ensure_staging(sum(v.nbytes for v in views if v.nbytes < DIRECT_MIN_BYTES))
        targets, staged, offset = [], [], 0
        for view in views:
            if view.nbytes >= DIRECT_MIN_BYTES or type(view) is DeviceBytes:
                targets.append(view)
            else:
                targets.append(self._slot(offset, view.nbytes))
                staged.append((view, offset))
                offset += view.nbytes
        arrays, requests = [], []
        try:
            self._post_into(targets, "recv", arrays, requests)
            wait(requests, deadline, "recv", self.progress, self._active)
        except LinkError:
            self._drain_receives(arrays, requests)
            raise
        for view, at in staged:
            numpy.copyto(view, self._staging[at:at + view.nbytes])

    def _drain_receives(self, arrays: list, requests: list) -> None:
        """shm, cuda, rdma give-up. Closing the endpoint cancels the receives no message
        matched yet; a matched one is a rendezvous this worker pulls itself (get scheme) or an
        eager message copied out of UCX's own buffers, both started only inside this worker's
        progress. So driving progress until every request has ended leaves nothing that could
        write the buffers afterwards. If that takes longer than the link's drain limit (not
        seen: a pull needs no help from the sender), the worker is retired: nothing progresses
        it again, so nothing it was asked to receive is written later (a device copy already
        started is waited for; an RDMA read the NIC already runs cannot be, hence rdma's
        longer limit, past which RC has failed a read from a dead peer)."""
        self.close()
        limit = time.monotonic() + self._drain_s
        while not all(r.completed for r in requests):
            if time.monotonic() > limit:
                self._worker.retire(f"{sum(not r.completed for r in requests)} receive(s) still "
                                    f"pending {self._drain_s}s after their link was given up")
                abandon(arrays, requests)
                return
            try:
                self.progress()
            except LinkError:  # retired meanwhile by another link: nothing progresses it now
                abandon(arrays, requests)
                return
            time.sleep(0.0001)

    def _recv_staged(self, batch: list, deadline: float) -> None:
        self._ensure_staging(sum(piece.nbytes for piece in batch))
        staging, arrays, requests, offsets, offset = self._staging, [], [], [], 0
        try:
            for piece in batch:
                self._post_into([self._slot(offset, piece.nbytes)], "recv", arrays, requests)
                offsets.append(offset)
                offset += piece.nbytes
            for piece, request, at in zip(batch, requests, offsets):
                wait([request], deadline, "recv", self.progress, self._active)
                # numpy's copy runs on this thread alone: torch's would wake its OpenMP
                # pool, which spins against the threads driving UCX on a small box.
                numpy.copyto(piece, staging[at:at + piece.nbytes])
        except LinkError:
            # never reuse what UCX may still write
            self._staging, self._slots = numpy.empty(0, dtype=numpy.uint8), {}
            abandon((staging, arrays), requests)
            self.close()
            raise

    def _ensure_staging(self, num_bytes: int) -> None:
        if self._staging.nbytes < num_bytes:
            self._staging, self._slots = numpy.empty(num_bytes, dtype=numpy.uint8), {}

    def _slot(self, offset: int, size: int):
        """The ucxx Array over staging[offset:offset + size], made once per staging buffer."""
        array = self._slots.get((offset, size))
        if array is None:
            if len(self._slots) > 4096:  # one per region shape seen; keep it bounded
                self._slots.clear()
            array = self._slots[offset, size] = host_array(self._staging[offset:offset + size])
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


class _UCXPosted(PostedSend):
    def __init__(self, link: UCXLink, arrays: list, requests: list):
        self._link, self._arrays, self._requests = link, arrays, requests

    def done(self) -> bool:
        self._link.progress()  # shm: the writer drives the worker too while it watches
        if not all(r.completed for r in self._requests):
            return False
        for request in self._requests:
            try:
                request.check_error()
            except Exception as exc:  # ucxx raises its own exception family
                self.abandon()
                raise LinkError(f"UCX send failed: {exc}") from exc
        return True

    def abandon(self) -> None:
        # UCX may still read the sources (a rendezvous get): keep the arrays alive.
        abandon(self._arrays, self._requests)
        self._link.close()


class UCXTransport(Transport):
    name = "ucx"

    def __init__(self, host: str, port: int, ucx_mode: str = "auto",
                 device: Optional[torch.device] = None):
        ucx_api, _ = ucx_modules()
        self.mode = resolve_mode(ucx_mode, host, device)
        device = cuda_device(device)
        rdma_devices = require_rdma_devices() if self.mode == "rdma" else []
        prepare_environment(self.mode, device)
        try:
            self._context = ucx_api.UCXContext(config_dict=context_config(self.mode))
        except Exception:
            if ucx_mode != "auto" or self.mode == "cuda":
                raise
            self.mode = "tcp"  # no shared-memory transport here; auto falls back to TCP
            self._context = ucx_api.UCXContext(config_dict=context_config(self.mode))
        if self.mode == "rdma":
            check_rdma_transports(self._context, rdma_devices)
        if device is not None:
            check_cuda_transports(self._context, device)
        # shm, cuda, rdma: no progress thread; the thread waiting on a request drives the worker.
        self._ucx_worker = Worker(self._context, caller_progress=self.mode != "tcp", device=device)
        self._worker = self._ucx_worker.handle
        self._progress = self._ucx_worker.progress
        # shm, cuda: peer death is left to heartbeats (see the modes in the module docstring)
        self._error_handling = self.mode in ("tcp", "rdma")
        self._drain_s = _RDMA_DRAIN_S if self.mode == "rdma" else _DRAIN_S
        self._hello = torch.empty(_HELLO_BYTES, dtype=torch.uint8)
        self._hello_request = None
        self._links: list[UCXLink] = []
        self._closed = False

    def address(self) -> dict:
        return {"worker": bytes(self._worker.address.tobytes() if hasattr(self._worker.address, "tobytes")
                                else self._worker.address), "mode": self.mode}

    def _endpoint_to(self, worker_address: bytes):
        ucx_api, _ = ucx_modules()
        self._ucx_worker.bind_thread()  # wireup of a CUDA lane runs in this thread's context
        address = ucx_api.UCXAddress.create_from_buffer(worker_address)
        return ucx_api.UCXEndpoint.create_from_worker_address(self._worker, address, self._error_handling)

    def connect(self, peer_address: dict, timeout_s: float) -> Link:
        if peer_address.get("mode") != self.mode:
            raise LinkError(f"peer uses UCX mode {peer_address.get('mode')!r}, this agent {self.mode!r}")
        ucx_api, _ = ucx_modules()
        # Random tags name the two directions of this link; the acceptor learns both from hello.
        to_acceptor, to_us = (secrets.randbits(62) | (1 << 62) for _ in range(2))
        hello = msgpack.packb({"worker": self.address()["worker"], "to_acceptor": to_acceptor, "to_connector": to_us})
        try:
            endpoint = self._endpoint_to(peer_address["worker"])
            payload = torch.zeros(_HELLO_BYTES, dtype=torch.uint8)
            payload[:4] = torch.tensor(list(len(hello).to_bytes(4, "little")), dtype=torch.uint8)
            payload[4:4 + len(hello)] = torch.frombuffer(bytearray(hello), dtype=torch.uint8)
            array = host_array(payload)
            request = endpoint.tag_send(array, tag=ucx_api.UCXXTag(_ACCEPT_TAG))
            try:
                wait([request], time.monotonic() + timeout_s, "hello", self._progress)
            except LinkError:
                abandon(array, [request])
                raise
        except LinkError:
            raise
        except Exception as exc:
            raise LinkError(f"cannot reach UCX peer: {exc}") from exc
        return self._track(self._link(endpoint, to_acceptor, to_us))

    def accept(self, timeout_s: float) -> Optional[Link]:
        ucx_api, _ = ucx_modules()
        if self._closed or self.retired:
            time.sleep(timeout_s)
            return None
        if self._hello_request is None:
            self._hello_array = host_array(self._hello)
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
        return UCXLink(endpoint, send_tag, recv_tag, self._ucx_worker, self._drain_s)

    @property
    def retired(self) -> Optional[str]:
        """Why this transport's worker was retired (then no link on it works), or None."""
        return self._ucx_worker.retired

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
        with self._ucx_worker._lock:  # not while another thread progresses, never once retired
            if self._ucx_worker.retired is None:
                try:
                    self._worker.cancel_inflight_requests()
                except Exception:
                    pass
        self._worker.stop_progress_thread()
