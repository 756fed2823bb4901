"""KV between two processes on one GPU for the torch_dist backend: NCCL refuses two ranks on
one device, so device memory is shared instead (CUDA IPC) and only small descriptors travel,
over the link's gloo group with its host frames, in one ordered stream.

Every message is preceded by (or is) a record of four int64s, so the receiver reads each the
way it was sent whatever its own buffer is (a block of its cache, or the scratch a discarded
chunk is read into):
- `inline` (host frames): the message's bytes follow as the next message;
- `map`: a storage exported to this link (torch's CUDA IPC handle), its description follows;
  once per storage (the KV cache is one), before its first range;
- `copy` (device messages): storage number, byte offset, length; no bytes follow, the
  receiver copies the range from the mapped storage;
- `batch`: a run of copy records sent as one message (a chunk's regions: 64 for a whole
  request of 32 layers), its count and byte length; the records follow as the next message and
  are taken one by one by the buffers received next, as if sent singly. A gloo message costs
  a round of its own on each side, which one per region made the link's main cost.
  Limit: the sender reads acknowledgements only once every message of its send has been
  taken, and a receiver's acknowledgement waits for the sender to read it. A send is
  therefore taken by one receive (wire.py reads a chunk's regions with one recv_many, acked
  once), or region by region (its discard path) only where nothing follows the batch. A
  chunk whose copies a `map` splits, read region by region, waits until its deadline and the
  link fails: never with the engine's cache (one storage, mapped before the first batch), but
  with caches of a storage each, or a fault that sends a chunk's messages twice.
Before posting, the sender waits for its device's queued work (the bytes must be written
before the peer reads them). The receiver waits for its copies, also when it gives up (no byte
lands after a receive raised), and then acknowledges them on a second tag; the sender's send is
over only when every range it sent has been acknowledged: until then the peer may still read
them, so the transfer keeps its lease on the source blocks (a cancel or failure waits for the
send, wire.py). Left open: a send that times out waiting (a receiver stalled past the transfer's
deadline, records in hand) ends the lease while that receiver could still copy; its own
acknowledgement then fails on the closed link, but a copy that lands first is not undone.

The CPU twin (tests): host tensors in shared memory registered with the link, exported as
shared-memory files and moved by the same records and copies.
"""

from __future__ import annotations

from typing import Optional

import msgpack
import numpy
import torch

from pd_runtime.kv_transfer.base import LinkError

INLINE, MAP, COPY, BATCH = 0, 1, 2, 3
RECORD_INT64S = 4  # kind, storage number (a batch: its count), byte offset, length in bytes
RECORD_BYTES = RECORD_INT64S * 8


def record(kind: int, number: int, offset: int, length: int) -> numpy.ndarray:
    return numpy.array([kind, number, offset, length], dtype=numpy.int64).view(numpy.uint8)


def empty_record() -> numpy.ndarray:
    return numpy.empty(RECORD_BYTES, dtype=numpy.uint8)


def read_record(buf: numpy.ndarray) -> tuple[int, int, int, int]:
    kind, number, offset, length = (int(x) for x in buf.view(numpy.int64))
    return kind, number, offset, length


def _export(storage: torch.UntypedStorage) -> bytes:
    if storage.device.type == "cuda":
        device, handle, size, offset, counter, counter_offset, event, sync = storage._share_cuda_()
        fields = ["cuda", device, handle, size, offset, counter, counter_offset, event, sync]
    elif storage.is_shared():
        manager, name, size = storage._share_filename_cpu_()
        fields = ["cpu", manager, name, size]
    else:
        raise LinkError("an IPC link moves device memory, or host memory in shared memory "
                        "(the CPU twin); this buffer is in neither")
    return msgpack.packb(fields, use_bin_type=True)


def _open(exported: bytes, device: torch.device) -> torch.Tensor:
    """The exported storage as a flat uint8 tensor in this process. A CUDA storage is opened on
    `device`, this side's cache device: the same GPU (the link was chosen by its UUID), whose
    index may differ from the sender's where the two see other devices."""
    fields = msgpack.unpackb(exported, raw=False)
    if fields[0] == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        storage = torch.UntypedStorage._new_shared_cuda(index, *fields[2:])
        device = torch.device("cuda", index)
    else:
        storage = torch.UntypedStorage._new_shared_filename_cpu(*fields[1:])
        device = torch.device("cpu")
    flat = torch.empty(0, dtype=torch.uint8, device=device)
    return flat.set_(storage, 0, (storage.nbytes(),), (1,))


def share_host(tensors) -> tuple:
    """(The CPU twin) export host tensors' storages as shared-memory files now, before anything
    takes a raw view of their memory: the first such export may move a storage into a new file
    (torch views follow, a numpy view taken before would not)."""
    for tensor in tensors:
        if not tensor.is_shared():
            raise LinkError("an IPC link's host memory must be in shared memory "
                            "(tensor.share_memory_())")
        tensor.untyped_storage()._share_filename_cpu_()
    return tuple(tensors)


class Exports:
    """The sender's half: which storages this link has exported, and the messages that carry
    a send's buffers."""

    def __init__(self, host_shared=()) -> None:
        self._numbers: dict[int, int] = {}  # storage data_ptr -> number on this link
        self._kept: list = []  # the exported storages, alive as long as the link
        self.copies = 0  # copy records made so far
        # (the CPU twin) host storages whose ranges go by copy: (start, end, storage)
        self._host = [(t.untyped_storage().data_ptr(),
                       t.untyped_storage().data_ptr() + t.untyped_storage().nbytes(),
                       t.untyped_storage()) for t in host_shared]

    def _storage(self, buf: torch.Tensor) -> Optional[torch.UntypedStorage]:
        if buf.device.type != "cpu":
            return buf.untyped_storage()
        for start, end, storage in self._host:
            if start <= buf.data_ptr() < end:
                return storage
        return None

    def messages(self, bufs: list) -> list:
        """What carries bufs (flat byte tensors), in order: for each, its `inline` record and
        itself; or a `map` record and its payload the first time its storage is sent, then its
        `copy` record; each run of two or more copy records goes as one `batch`."""
        out, copies = [], []
        for buf in bufs:
            before, copy = self._parts(buf)
            if before:  # (copies before it go first: the receiver reads in order)
                out += _as_batch(copies) + before
                copies = []
            if copy is not None:
                copies.append(copy)
        return out + _as_batch(copies)

    def _parts(self, buf: torch.Tensor) -> tuple[list, Optional[numpy.ndarray]]:
        """(the messages before buf's copy record, that record or None: buf goes inline)."""
        length = buf.numel()
        storage = self._storage(buf)
        if storage is None:
            return [record(INLINE, 0, 0, length), buf], None
        before = []
        number = self._numbers.get(storage.data_ptr())
        if number is None:
            try:
                payload = numpy.frombuffer(bytearray(_export(storage)), dtype=numpy.uint8)
            except RuntimeError as exc:  # (e.g. CUDA memory torch cannot share)
                raise LinkError(f"cannot share this memory with the peer: {exc}") from exc
            number = len(self._kept)
            before = [record(MAP, number, 0, payload.size), payload]
            self._numbers[storage.data_ptr()] = number
            self._kept.append(storage)
        self.copies += 1
        return before, record(COPY, number, buf.data_ptr() - storage.data_ptr(), length)


def _as_batch(copies: list) -> list:
    if len(copies) < 2:
        return copies
    return [record(BATCH, len(copies), 0, len(copies) * RECORD_BYTES), numpy.concatenate(copies)]


def batch_records(head: tuple[int, int, int, int], payload: numpy.ndarray) -> list:
    """The copy records a `batch` record announced, read from the message that followed it."""
    _, count, _, length = head
    if count < 1 or length != count * RECORD_BYTES or payload.size != length:
        raise LinkError(f"a batch of {count} records in {length} bytes")
    rows = payload.view(numpy.int64).reshape(count, RECORD_INT64S)
    if (rows[:, 0] != COPY).any():
        raise LinkError("a batch holds copy records only")
    return [tuple(int(x) for x in row) for row in rows]


class Mappings:
    """The receiver's half: the peer's storages mapped here, by number."""

    def __init__(self) -> None:
        self._mapped: dict[int, torch.Tensor] = {}

    def add(self, number: int, exported: bytes, device: torch.device) -> None:
        try:
            self._mapped[number] = _open(exported, torch.device(device))
        except RuntimeError as exc:
            raise LinkError(f"cannot map the peer's memory: {exc}") from exc

    def source(self, number: int, offset: int, length: int) -> torch.Tensor:
        flat = self._mapped.get(number)
        if flat is None or offset < 0 or offset + length > flat.numel():
            raise LinkError(f"IPC record out of range: storage {number}, bytes {offset}+{length}")
        return flat[offset:offset + length]

    def clear(self) -> None:
        self._mapped.clear()


def wait_for_device(bufs: list) -> None:
    """Wait for the device work queued before these messages (the writes of their bytes)."""
    for buf in bufs:
        if isinstance(buf, torch.Tensor) and buf.device.type == "cuda":
            torch.cuda.synchronize(buf.device)
            return
