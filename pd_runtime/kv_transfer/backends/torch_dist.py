"""torch.distributed backend: one pairwise process group per link, built from the acceptor's
TCPStore (gloo for CPU caches; NCCL carries the KV bytes when the cache is on CUDA, except
between two processes on one GPU, which NCCL refuses: there the KV moves through CUDA IPC
and gloo carries its descriptors, pd_runtime/kv_transfer/backends/ipc.py).

No global process group: workers die and come back, so each link is its own two-rank group
under a fresh store prefix, and a dead link is simply replaced by a new one.
"""

from __future__ import annotations

import collections
import datetime
import time
from typing import Optional

import numpy
import torch
import torch.distributed as dist

from pd_runtime.kv_transfer.backends import ipc
from pd_runtime.kv_transfer.base import Link, LinkError, LinkTimeoutError, Transport, as_byte_tensor

_COUNTER_KEY = "kvt/links"
_TAG = 0  # one ordered stream per direction; direction is given by the two ranks
_ACK_TAG = 1  # IPC links: the receiver's count of ranges copied, back to the sender
# IPC links: the most a map or batch record may announce (an exported handle is ~100 bytes, a
# batch 32 bytes per region); a length past it, or a batch's not 32 per record, is refused
# before its payload is allocated
_MAX_RECORD_PAYLOAD = 1 << 30


def _gloo_group(store, name: str, rank: int, host: str, timeout_s: float):
    options = dist.ProcessGroupGloo._Options()
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    options._timeout = datetime.timedelta(seconds=timeout_s)
    return dist.ProcessGroupGloo(dist.PrefixStore(name, store), rank, 2, options)


class TorchDistLink(Link):
    def __init__(self, store, name: str, rank: int, host: str, timeout_s: float, device: torch.device,
                 use_ipc: bool = False, host_shared=()):
        try:
            self._control = _gloo_group(store, name, rank, host, timeout_s)
            # NCCL moves device tensors; control frames always stay on gloo (host memory).
            self._data = (dist.ProcessGroupNCCL(dist.PrefixStore(name + "/nccl", store), rank, 2)
                          if device.type == "cuda" and not use_ipc else self._control)
        except RuntimeError as exc:
            raise LinkError(f"could not build link group {name}: {exc}") from exc
        self._peer = 1 - rank
        self._closed = False
        # Through IPC every message goes on gloo as ipc.py's records (host_shared: the CPU twin).
        self._exports = ipc.Exports(host_shared) if use_ipc else None
        self._mappings = ipc.Mappings() if use_ipc else None
        self._device = device
        self._copies_acked = 0  # (IPC) ranges the peer says it has copied
        self._queued: collections.deque = collections.deque()  # (IPC) a batch's records to take

    def _group_for(self, buf: torch.Tensor):
        """Device memory goes over the data group (NCCL for CUDA), host memory over gloo."""
        return self._control if buf.device.type == "cpu" else self._data

    def _wait(self, work, timeout_s: float, what: str) -> None:
        try:
            work.wait(datetime.timedelta(seconds=max(timeout_s, 0.001)))
        except RuntimeError as exc:
            # A timed-out gloo recv stays posted: a sender that resumes would still write
            # into its buffer. Aborting the group closes the pair, so nothing lands late.
            self.close()
            if "Timed out" in str(exc) or "timed out" in str(exc):
                raise LinkTimeoutError(f"{what} timed out after {timeout_s:.2f}s") from exc
            raise LinkError(f"{what} failed: {exc}") from exc

    def send_bytes(self, buf, timeout_s: float) -> None:
        if self._exports is not None:
            return self.send_many([buf], timeout_s)
        if self._closed:
            raise LinkError("link closed")
        buf = as_byte_tensor(buf)
        try:
            work = self._group_for(buf).send([buf], self._peer, _TAG)
        except RuntimeError as exc:
            raise LinkError(f"send failed: {exc}") from exc
        self._wait(work, timeout_s, "send")

    def recv_bytes(self, buf, timeout_s: float) -> None:
        if self._mappings is not None:
            return self.recv_many([buf], timeout_s)
        if self._closed:
            raise LinkError("link closed")
        buf = as_byte_tensor(buf)
        try:
            work = self._group_for(buf).recv([buf], self._peer, _TAG)
        except RuntimeError as exc:
            raise LinkError(f"recv failed: {exc}") from exc
        self._wait(work, timeout_s, "recv")

    def send_many(self, bufs: list, timeout_s: float) -> None:
        if self._exports is not None:
            return self._ipc_send(bufs, timeout_s)
        self._post_all(bufs, timeout_s, "send")

    def recv_many(self, bufs: list, timeout_s: float) -> None:
        if self._mappings is not None:
            return self._ipc_recv(bufs, timeout_s)
        self._post_all(bufs, timeout_s, "recv")

    def _post_all(self, bufs: list, timeout_s: float, what: str, tag: int = _TAG) -> None:
        if self._closed:
            raise LinkError("link closed")
        deadline = time.monotonic() + timeout_s
        bufs = [as_byte_tensor(b) for b in bufs]
        try:
            works = [getattr(self._group_for(b), what)([b], self._peer, tag) for b in bufs]
        except RuntimeError as exc:
            raise LinkError(f"{what} failed: {exc}") from exc
        for work in works:
            self._wait(work, deadline - time.monotonic(), what)

    # ----- IPC (pd_runtime/kv_transfer/backends/ipc.py): records on gloo, copies acknowledged on _ACK_TAG
    def _ipc_send(self, bufs: list, timeout_s: float) -> None:
        """Post the messages' records, then wait until the peer has copied every range sent so
        far: until then it may still read them, so the send is not over (nor the lease)."""
        if self._closed:
            raise LinkError("link closed")
        deadline = time.monotonic() + timeout_s
        ipc.wait_for_device(bufs)
        try:
            messages = self._exports.messages([as_byte_tensor(b) for b in bufs])
        except LinkError:  # (copies already counted for the buffers before it: the link goes)
            self.close()
            raise
        self._post_all(messages, timeout_s, "send")
        while self._copies_acked < self._exports.copies:
            ack = numpy.zeros(1, dtype=numpy.int64)
            self._post_all([ack.view(numpy.uint8)], deadline - time.monotonic(), "recv", _ACK_TAG)
            self._copies_acked += int(ack[0])

    def _ipc_recv(self, bufs: list, timeout_s: float) -> None:
        """Read each message as its record says; copies are waited for (also when this raises:
        no byte lands after it) and acknowledged once they are done."""
        deadline = time.monotonic() + timeout_s
        device, copies = None, 0
        try:
            for buf in bufs:
                target = as_byte_tensor(buf)
                kind, number, offset, length = self._next_record(deadline)
                if length != target.numel():  # (the link is closed below)
                    raise LinkError(f"a message of {length} bytes for a {target.numel()}-byte buffer")
                if kind == ipc.INLINE:
                    self._post_all([target], deadline - time.monotonic(), "recv")
                    continue
                source = self._mappings.source(number, offset, length)
                target.copy_(source, non_blocking=target.device.type == "cuda")
                device = target.device if target.device.type == "cuda" else device
                copies += 1
        except LinkError:
            self.close()
            raise
        finally:
            if device is not None:
                torch.cuda.current_stream(device).synchronize()
        if copies:
            done = numpy.array([copies], dtype=numpy.int64)
            self._post_all([done.view(numpy.uint8)], deadline - time.monotonic(), "send", _ACK_TAG)

    def _next_record(self, deadline: float) -> tuple[int, int, int, int]:
        """The next inline or copy record (a batch's copy records are taken in turn, also by
        the next receive), mapping the storages announced before it."""
        while True:
            if self._closed:  # (close() may come from another thread: take nothing after it)
                raise LinkError("link closed")
            if self._queued:
                return self._queued.popleft()
            head = ipc.empty_record()
            self._post_all([head], deadline - time.monotonic(), "recv")
            kind, number, offset, length = ipc.read_record(head)
            if kind not in (ipc.MAP, ipc.BATCH):
                return kind, number, offset, length
            if not 0 < length <= _MAX_RECORD_PAYLOAD or (
                    kind == ipc.BATCH and length != number * ipc.RECORD_BYTES):
                raise LinkError(f"an IPC record announcing {length} bytes"
                                + (f" for {number} records" if kind == ipc.BATCH else ""))
            payload = numpy.empty(length, dtype=numpy.uint8)
            self._post_all([payload], deadline - time.monotonic(), "recv")
            if kind == ipc.BATCH:
                self._queued.extend(ipc.batch_records((kind, number, offset, length), payload))
            else:
                self._mappings.add(number, payload.tobytes(), self._device)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._queued.clear()
        for group in {id(self._control): self._control, id(self._data): self._data}.values():
            try:
                # abort() fails pending work on both ends, so no thread stays blocked on a
                # half-finished message and nothing is written after the link is gone.
                group.abort()
            except RuntimeError:
                pass
        if self._mappings is not None:
            self._mappings.clear()


def _gpu_uuid(device: torch.device) -> Optional[str]:
    if device.type != "cuda":
        return None
    return str(torch.cuda.get_device_properties(device.index if device.index is not None
                                                else torch.cuda.current_device()).uuid)


class TorchDistTransport(Transport):
    """Listens with a TCPStore; a peer connects by bumping a counter in that store, and both
    sides then build the group for link number n under the prefix kvt/link/<n>. The connecting
    side decides whether the link moves device memory by IPC (its GPU is the acceptor's, by
    UUID) and leaves the decision in the store for the acceptor. `use_ipc` and `host_shared`
    (host tensors in shared memory, moved by IPC records) force it: the CPU twin's tests."""

    name = "torch_dist"

    def __init__(self, host: str, port: int, device: torch.device,
                 use_ipc: Optional[bool] = None, host_shared=()):
        self.host = host
        self.device = torch.device(device)
        self._gpu = _gpu_uuid(self.device)
        self._use_ipc, self._host_shared = use_ipc, ipc.share_host(host_shared)
        self._store = dist.TCPStore(host, port, None, True, timeout=datetime.timedelta(seconds=30),
                                    wait_for_workers=False)
        self._accepted = 0
        self._clients: list = []

    def address(self) -> dict:
        return {"host": self.host, "port": self._store.port, "gpu": self._gpu}

    def connect(self, peer_address: dict, timeout_s: float) -> Link:
        use_ipc = self._use_ipc
        if use_ipc is None:
            use_ipc = self._gpu is not None and peer_address.get("gpu") == self._gpu
        try:
            store = dist.TCPStore(peer_address["host"], int(peer_address["port"]), None, False,
                                  timeout=datetime.timedelta(seconds=timeout_s))
            number = store.add(_COUNTER_KEY, 1)
            store.set(f"kvt/link/{number}/ipc", "1" if use_ipc else "0")
        except (RuntimeError, KeyError, ValueError) as exc:
            raise LinkError(f"cannot reach peer store {peer_address}: {exc}") from exc
        self._clients.append(store)  # the group keeps using the store; keep the client alive
        return TorchDistLink(store, f"kvt/link/{number}", 1, self.host, timeout_s, self.device,
                             use_ipc, self._host_shared)

    def accept(self, timeout_s: float) -> Optional[Link]:
        deadline = time.monotonic() + timeout_s
        while True:
            if self._store.add(_COUNTER_KEY, 0) > self._accepted:
                self._accepted += 1
                name = f"kvt/link/{self._accepted}"
                try:
                    self._store.wait([name + "/ipc"], datetime.timedelta(seconds=5))
                    use_ipc = self._store.get(name + "/ipc") == b"1"
                except RuntimeError as exc:  # the connecting side died before deciding
                    raise LinkError(f"link {name}: {exc}") from exc
                return TorchDistLink(self._store, name, 0, self.host, 30.0, self.device,
                                     use_ipc, self._host_shared)
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.02)

    def close(self) -> None:
        self._clients.clear()
