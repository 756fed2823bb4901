"""The UCX worker layer under pd_runtime/kv_transfer/backends/ucx.py: ucxx's modules, the context settings of each
mode, how a worker progresses (its own thread, or whichever agent thread waits) and can be
retired, the polling wait every operation goes through, buffers given up on, and host and
device buffers as ucxx Arrays.
"""

from __future__ import annotations

import glob
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


# shm, cuda and rdma receive messages of at least this size in place (and every device
# message); their contexts send rendezvous messages with the receiver pulling (get), which
# keeps every write into a given-up receive inside this worker's own progress (ucx.UCXLink).
# shm and cuda also hold the rendezvous threshold to this size, so that every message received
# in place is pulled; rdma keeps UCX's own, tuned for the fabric (an eager message lands in
# UCX's own buffers and is copied out during progress, so a give-up is safe either way).
# The modes themselves are described in pd_runtime/kv_transfer/backends/ucx.py.
DIRECT_MIN_BYTES = 4096
_CONTEXT_CONFIG = {
    "tcp": {"TLS": "tcp,self"},
    "shm": {"TLS": "sm,self", "RNDV_SCHEME": "get_zcopy", "RNDV_THRESH": str(DIRECT_MIN_BYTES)},
    "cuda": {"TLS": "cuda_ipc,cuda_copy,sm,tcp,self", "RNDV_SCHEME": "get_zcopy",
             "RNDV_THRESH": str(DIRECT_MIN_BYTES)},
    # TLS comes from the environment (mode_environment), so that a site's own UCX_TLS wins.
    "rdma": {"RNDV_SCHEME": "get_zcopy"},
}


# What a mode puts in the process environment before its context is made; a variable the user
# set is kept (prepare_environment). These are read from the environment, not the context's
# settings: an interface setting (config_dict refuses it where its transport's module is not
# loaded), and rdma's UCX_TLS, which a site narrows or widens for its fabric.
# - UCX_CUDA_IPC_ENABLE_GET_ZCOPY=on (cuda, rdma with a CUDA cache): UCX turns get over
#   cuda_ipc off where it finds no NVLink (a single GPU has none), and with the scheme held to
#   get, device messages then went eagerly through host shared memory instead (0.75 GB/s on the
#   H200: the second device run, docs/BENCHMARKS.md). Put is not the way round it: the sender's
#   copy would write the receiver's blocks, which no give-up on the receiving side could stop.
# - UCX_TLS (rdma): RC between peers (rc: rc_mlx5 or rc_verbs, with UD for wireup) and DC where
#   the NIC has it (dc: dc_mlx5), shared memory and self for a peer in this process or on this
#   host, and for a CUDA cache UCX's CUDA transports (cuda: cuda_copy, cuda_ipc, gdr_copy):
#   with them UCX registers the KV blocks with the NIC itself (GPUDirect RDMA). No tcp: an
#   agent that asked for RDMA fails (check_rdma_transports) rather than quietly use sockets.
RDMA_TLS = "rc,dc,sm,self"
_CUDA_GET_OVER_IPC = {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "on"}


def mode_environment(mode: str, device: Optional[torch.device] = None) -> dict:
    """The UCX variables a mode sets in its process for a KV cache on `device` (None: host)."""
    if mode == "cuda":
        return dict(_CUDA_GET_OVER_IPC)
    if mode != "rdma":
        return {}
    if device is None or torch.device(device).type != "cuda":
        return {"UCX_TLS": RDMA_TLS}
    return {"UCX_TLS": RDMA_TLS + ",cuda", **_CUDA_GET_OVER_IPC}


def context_config(mode: str) -> dict:
    """The UCX settings (UCX_ prefix dropped) of a mode's context."""
    return dict(_CONTEXT_CONFIG[mode])


def prepare_environment(mode: str, device: Optional[torch.device] = None, environ=None) -> None:
    """Set the mode's UCX variables (mode_environment) in `environ`, this process's environment
    unless given, before its context and workers are made; the user's own values win."""
    environ = os.environ if environ is None else environ
    for name, value in mode_environment(mode, device).items():
        environ.setdefault(name, value)


def resolve_mode(requested: str, host: str, device: Optional[torch.device] = None) -> str:
    """The mode an agent's context gets, from the configured ucx_mode, the host it listens on
    and its KV cache's device. auto never picks rdma (see docs/kv_transfer.md)."""
    if requested == "rdma":
        return requested
    if device is not None and torch.device(device).type == "cuda":
        if requested not in ("auto", "cuda"):
            raise KVTransferError(f"kv_transfer.ucx_mode {requested!r} moves host memory only, and "
                                  f"this KV cache is on {device}; use 'auto' (a CUDA cache gets UCX's "
                                  "CUDA transports) or 'rdma'")
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
    host one. Without cuda_ipc, KV for another process on this node takes a slower path."""
    found = context_transports(context)
    if "cuda_copy" not in found:
        raise KVTransferError(f"UCX found no CUDA transport here (usable: {', '.join(sorted(found))}), "
                              f"so it cannot move a KV cache on {device}; kv_transfer.backend "
                              "'torch_dist' moves it with NCCL")
    if "cuda_ipc" not in found:
        logger.warning("kv_transfer: UCX has no cuda_ipc here; KV on %s goes to other processes of "
                       "this node through host memory (cuda mode) or the NIC (rdma)", device)


# rdma: where the kernel lists RDMA devices (InfiniBand and RoCE NICs alike); libibverbs, and
# through it UCX, finds them there. And what UCX lists for the rc and dc of RDMA_TLS.
RDMA_SYSFS = "/sys/class/infiniband"
_RDMA_TRANSPORTS = ("rc_mlx5", "rc_verbs", "dc_mlx5")


def require_rdma_devices(sysfs: str = RDMA_SYSFS) -> list:
    """This machine's RDMA devices (mlx5_0, ...), checked before any UCX context is made: rdma
    is refused where there is none."""
    try:
        devices = sorted(os.listdir(sysfs))
    except OSError:  # absent: no RDMA driver loaded at all
        devices = []
    if not devices:
        raise KVTransferError(f"kv_transfer.ucx_mode 'rdma' needs an RDMA NIC (InfiniBand or RoCE), "
                              f"and this machine has none: {sysfs} is absent or empty (no such NIC, "
                              "or its driver is not loaded); use 'auto' (tcp between nodes)")
    return devices


def check_rdma_transports(context, devices: list) -> None:
    """Refuse an rdma context in which UCX found no rc or dc transport: the devices exist, but
    this UCX cannot use them (built without verbs, no active port, or UCX_TLS / UCX_NET_DEVICES
    leave them out)."""
    found = context_transports(context)
    if found & set(_RDMA_TRANSPORTS):
        return
    settings = context.config
    modules = _ucx_module_dir()
    if modules is not None and not glob.glob(os.path.join(modules, "libuct_ib.so*")):
        why = (f"The UCX this process loaded ({os.path.dirname(modules)}) has no InfiniBand module "
               "(libuct_ib.so): the pip libucx wheel is built without verbs; load a UCX built "
               "with them (RAPIDS_LIBUCX_PREFER_SYSTEM_LIBRARY=true, docs/kv_transfer.md)")
    else:
        why = (f"Check that a port is active (ibv_devinfo) and that UCX_TLS ({settings.get('TLS')}) "
               f"and UCX_NET_DEVICES ({settings.get('NET_DEVICES')}) let UCX use them")
    raise KVTransferError(f"kv_transfer.ucx_mode 'rdma': UCX found no rc or dc transport "
                          f"({', '.join(_RDMA_TRANSPORTS)}) on this machine's RDMA devices "
                          f"({', '.join(devices)}); usable: {', '.join(sorted(found))}. {why}")


def _ucx_module_dir() -> Optional[str]:
    """Where the UCX this process loaded keeps its transport modules: ucx/ beside libucs."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.rsplit(None, 1)[-1]
                if os.path.basename(path).startswith("libucs.so"):
                    return os.path.join(os.path.dirname(path), "ucx")
    except OSError:
        pass
    return None


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
    thread waits (shm, cuda, rdma: caller_progress). A caller-driven worker can be retired:
    from then on nothing progresses it, so it starts no write into a buffer again
    (ucx.UCXLink._drain_receives).

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
