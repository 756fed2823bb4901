"""The UCX worker layer under pd_runtime/kv_transfer/ucx.py: ucxx's modules, the context settings of each
mode, how a worker progresses (its own thread, or whichever agent thread waits) and can be
retired, the polling wait every operation goes through, buffers given up on, and host and
device buffers as ucxx Arrays.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import threading
import time
from typing import Optional

import numpy
import torch

from pd_runtime.kv_transfer.base import Activity, KVTransferError, LinkError, LinkTimeoutError

logger = logging.getLogger("kv_transfer.ucx")

_modules: tuple = ()


def ucx_modules():
    """(ucxx's core module, its Array type), imported on first use and kept: importing them in
    every call cost ~16 us, paid per message."""
    global _modules
    if not _modules:
        import ucxx._lib.libucxx as ucx_api
        from ucxx._lib.arr import Array
        _modules = (ucx_api, Array)
    return _modules


# shm and cuda receive messages of at least this size in place (and every device message);
# their contexts send them by rendezvous with the receiver pulling (get), smaller ones eagerly.
# The modes themselves are described in pd_runtime/kv_transfer/ucx.py.
DIRECT_MIN_BYTES = 4096
_CONTEXT_CONFIG = {
    "tcp": {"TLS": "tcp,self"},
    "shm": {"TLS": "sm,self", "RNDV_SCHEME": "get_zcopy", "RNDV_THRESH": str(DIRECT_MIN_BYTES)},
    "cuda": {"TLS": "cuda_ipc,cuda_copy,sm,tcp,self", "RNDV_SCHEME": "get_zcopy",
             "RNDV_THRESH": str(DIRECT_MIN_BYTES)},
}


# ... and, for cuda, cuda_ipc's own switch for get: UCX turns get over cuda_ipc off where it
# finds no NVLink (a single GPU has none), and with the scheme held to get, device messages
# then went eagerly through host shared memory instead (0.75 GB/s on the H200: the second
# device run, docs/BENCHMARKS.md). Put is not the way round it: the sender's copy would write
# the receiver's blocks, which no give-up on the receiving side could stop. An interface
# setting, read from the environment when UCX opens the interface (a context's config_dict
# refuses it where UCX's CUDA module is not loaded); a value the user set is kept.
_MODE_ENVIRONMENT = {"cuda": {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "on"}}


def context_config(mode: str) -> dict:
    """The UCX settings (UCX_ prefix dropped) of a mode's context."""
    return dict(_CONTEXT_CONFIG[mode])


def prepare_environment(mode: str) -> None:
    """Set the mode's UCX interface settings in this process's environment, before its context
    and workers are made (the user's own values win)."""
    for name, value in _MODE_ENVIRONMENT.get(mode, {}).items():
        os.environ.setdefault(name, value)


def resolve_mode(requested: str, host: str, device: Optional[torch.device] = None) -> str:
    """The mode an agent's context gets, from the configured ucx_mode, the host it listens on
    and its KV cache's device."""
    if device is not None and torch.device(device).type == "cuda":
        if requested not in ("auto", "cuda"):
            raise KVTransferError(f"kv_transfer.ucx_mode {requested!r} moves host memory only, and "
                                  f"this KV cache is on {device}; use 'auto' (a CUDA cache gets UCX's "
                                  "CUDA transports)")
        return "cuda"
    if requested != "auto":
        return requested
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = host == "localhost"
    return "shm" if loopback else "tcp"


def cuda_device(device: Optional[torch.device]) -> Optional[torch.device]:
    """The CUDA device a context moves memory of, with its index; None for host memory."""
    if device is None or torch.device(device).type != "cuda":
        return None
    device = torch.device(device)
    return device if device.index is not None else torch.device("cuda", torch.cuda.current_device())


def context_transports(context) -> set:
    """Names of the transports a UCX context found usable on this machine, from its resource
    list (lines such as "resource 6 : md 5 dev 3 flags -- cuda_copy/cuda"). Listing a
    transport in UCX_TLS does not make it usable: without a CUDA driver UCX only warns."""
    return {line.rsplit(None, 1)[-1].split("/")[0] for line in context.info.splitlines()
            if "resource" in line and "flags" in line}


def check_cuda_transports(context, device: torch.device) -> None:
    """Refuse a context that cannot move device memory: UCX would take a device pointer for a
    host one. Without cuda_ipc, device KV is staged through host memory: slow, but it works."""
    found = context_transports(context)
    if "cuda_copy" not in found:
        raise KVTransferError(f"UCX found no CUDA transport here (usable: {', '.join(sorted(found))}), "
                              f"so it cannot move a KV cache on {device}; kv_transfer.backend "
                              "'torch_dist' moves it with NCCL")
    if "cuda_ipc" not in found:
        logger.warning("kv_transfer: UCX has no cuda_ipc here; KV on %s is staged through host memory", device)


# Buffers of operations given up on, with their requests: UCX may still read or write them
# (a matched receive cannot be cancelled), so they stay allocated until UCX is done with them.
_abandoned: list = []
_abandoned_lock = threading.Lock()


def abandon(buffers, requests) -> None:
    with _abandoned_lock:
        _abandoned[:] = [(b, r) for b, r in _abandoned if not all(x.completed for x in r)]
        _abandoned.append((buffers, requests))


# Poll interval while transfers are in flight (see _wait): from 30 us right after a transfer
# started up to 100 us, a twentieth of the time waited so far. Every poll costs the CPU that
# the receiving thread needs for the pull itself on a small machine.
_SPIN_S = 0.000005
_BUSY_POLL_S = 0.00003
_BUSY_POLL_MAX_S = 0.0001
_thread_state = threading.local()


def _precise_sleeps() -> None:
    """Linux rounds a thread's sleeps up by its timer slack (50 us by default), which doubles
    a 50 us poll; set this thread's slack to 1 us, once."""
    if getattr(_thread_state, "precise", False):
        return
    _thread_state.precise = True
    try:
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(29, 1000, 0, 0, 0)  # PR_SET_TIMERSLACK, ns
    except (OSError, AttributeError):
        pass


def no_progress() -> None:
    """Progress of a worker whose own thread drives it (tcp)."""


def wait(requests: list, deadline: float, what: str, progress=no_progress,
          active: Optional[Activity] = None) -> None:
    """Poll until every request completed or the deadline passes, calling progress (the
    worker's, where no progress thread runs) on every poll. ucxx's synchronous API has no
    blocking wait; the sleep grows with the time already waited (an idle reader ends up at
    1 ms), so polling adds at most a few percent of latency and little CPU. One wait covers a
    whole batch: a sender waiting on its regions one by one would restart the fast spin at
    each, and spin a core for the whole transfer while the receiver does the work. While
    `active` is set (transfers in flight on the agent) the poll interval starts at
    _BUSY_POLL_S when a transfer starts, so a header is seen within tens of microseconds, and
    grows to _BUSY_POLL_MAX_S (an ack comes a twentieth late at most); an idle wait sleeps on
    `active` itself, so the first header of a transfer does not wait out an idle sleep."""
    _precise_sleeps()
    started = time.monotonic()
    spins = 0
    pending = [r for r in requests if not r.completed]
    while pending:
        progress()
        still = [r for r in pending if not r.completed]
        if not still:
            break
        now = time.monotonic()
        if now > deadline:
            raise LinkTimeoutError(f"UCX {what} timed out after {now - started:.2f}s")
        # A poll that completed something is followed by a fast one: the next message of a
        # batch is likely there already (an shm pull completes inside one progress call).
        spins = 0 if len(still) < len(pending) else spins + 1
        pending = still
        # spins only while a transfer is pending, or for a send (done within microseconds)
        busy = active is None or active.is_set()
        if spins < 50 and (busy or "send" in what):
            # a real (if short) sleep: sleep(0) re-takes the GIL before a woken thread of this
            # process can, which starved the thread waiting for a transfer's end by ~1 ms
            time.sleep(_SPIN_S)
        elif busy:
            # fast right after a transfer started, then backing off with the time it has run
            busy_for = now - max(started, active.since if active is not None else 0.0)
            time.sleep(min(_BUSY_POLL_MAX_S, max(_BUSY_POLL_S, busy_for / 20)))
        else:
            idle = min(0.001, max(0.0001, (now - started) / 40))
            active.wait(idle) if active is not None else time.sleep(idle)
    for request in requests:
        try:
            request.check_error()
        except Exception as exc:  # ucxx raises its own exception family
            raise LinkError(f"UCX {what} failed: {exc}") from exc


class DeviceBytes:
    """A contiguous device tensor's bytes as the CUDA array interface, which a ucxx Array reads
    (its `cuda` flag set, UCX then finds the memory type itself). Built from data_ptr: torch's
    own __cuda_array_interface__ costs a few microseconds more per message. Holds the tensor,
    so an Array over it keeps the memory alive."""

    __slots__ = ("__cuda_array_interface__", "tensor", "nbytes")

    def __init__(self, tensor: torch.Tensor):
        if not tensor.is_contiguous():
            raise KVTransferError("a device message must be contiguous")
        self.tensor, self.nbytes = tensor, tensor.nbytes
        self.__cuda_array_interface__ = {"data": (tensor.data_ptr(), False), "shape": (self.nbytes,),
                                         "typestr": "|u1", "strides": None, "version": 2}


def as_bytes(buf, device_ok: bool = False):
    """A flat numpy uint8 view of a host tensor or numpy array; a device tensor's bytes as
    DeviceBytes where the context moves device memory (device_ok)."""
    if isinstance(buf, numpy.ndarray):
        return buf.reshape(-1).view(numpy.uint8)
    if buf.device.type != "cpu":
        if not device_ok:
            raise KVTransferError("this UCX context moves host memory only (its KV cache is on the host)")
        return DeviceBytes(buf)
    return buf.reshape(-1).view(torch.uint8).numpy()


def host_array(buf):
    """A ucxx Array over a host tensor's (or numpy array's) bytes."""
    _, Array = ucx_modules()
    return Array(as_bytes(buf))


def device_array(buf: DeviceBytes):
    _, Array = ucx_modules()
    return Array(buf)


def flat(bufs: list, device_ok: bool = False) -> list:
    """Flat byte views of bufs (numpy for host memory, DeviceBytes for device memory where
    device_ok): one wire message each."""
    return [as_bytes(buf, device_ok) for buf in bufs]


class Worker:
    """A UCX worker and how it progresses: by its own thread (tcp), or by whichever agent
    thread waits (shm, cuda: caller_progress). A caller-driven worker can be retired: from then
    on nothing progresses it, so it writes no buffer again (ucx.UCXLink._drain_receives).

    With a CUDA `device` (the KV cache's), every thread that calls into UCX first makes the
    device's primary CUDA context current (bind_thread): UCX's CUDA transports work in the
    calling thread's context, and an agent thread that never touched CUDA has none."""

    def __init__(self, context, caller_progress: bool, device: Optional[torch.device] = None):
        ucx_api, _ = ucx_modules()
        self.handle = ucx_api.UCXWorker(context)
        self.caller_progress = caller_progress
        self.device = device
        self.retired: Optional[str] = None
        self._lock = threading.Lock()
        if device is not None:
            self.progress = self._progress_on_device
        if not caller_progress:
            self.handle.start_progress_thread(polling_mode=False)

    def progress(self) -> None:
        if not self.caller_progress:
            return
        with self._lock:  # a retire waits for a progress call already running
            if self.retired is not None:
                raise LinkError(f"UCX worker retired: {self.retired}")
            try:
                self.handle.progress()
            except Exception as exc:  # ucxx's own exception family
                raise LinkError(f"UCX progress failed: {exc}") from exc

    def _progress_on_device(self) -> None:
        self.bind_thread()
        Worker.progress(self)

    def bind_thread(self) -> None:
        """Make the device's primary context current on this thread, once per thread (a no-op
        for a host worker). set_device alone may skip the CUDA call when the thread's device
        already matches; the synchronize that follows is a runtime call that needs a context,
        so the runtime makes the device's primary context current on this thread."""
        if self.device is None or getattr(_thread_state, "cuda_device", None) == self.device:
            return
        torch.cuda.set_device(self.device)
        torch.cuda.synchronize()
        _thread_state.cuda_device = self.device

    def sources_ready(self, views: list) -> None:
        """Device memory is read by UCX's own CUDA streams, which do not wait for the work
        torch queued: before device sources are posted, what wrote them must have finished.
        Device-wide, as the writes may come from any stream of this process."""
        if self.device is not None and any(type(view) is DeviceBytes for view in views):
            torch.cuda.synchronize(self.device)

    def retire(self, why: str) -> None:
        with self._lock:
            if self.retired is None:
                self.retired = why
                logger.error("kv_transfer: UCX worker retired, links on it fail from now on: %s", why)
        if self.device is not None:
            # A device copy UCX already started runs to its end without progress: wait for it,
            # so nothing lands in a given-up buffer after this returns.
            torch.cuda.synchronize(self.device)
