"""The UCX worker layer under kv_transfer/ucx.py: ucxx's modules, how a worker progresses
(its own thread, or whichever agent thread waits) and can be retired, the polling wait every
operation goes through, buffers given up on, and host buffers as ucxx Arrays.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Optional

import numpy
import torch

from kv_transfer.base import Activity, KVTransferError, LinkError, LinkTimeoutError

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


def as_bytes(buf) -> numpy.ndarray:
    """A flat numpy uint8 view of a host tensor or numpy array."""
    if isinstance(buf, numpy.ndarray):
        return buf.reshape(-1).view(numpy.uint8)
    if buf.device.type != "cpu":
        raise KVTransferError("the ucx backend here moves host memory only")
    return buf.reshape(-1).view(torch.uint8).numpy()


def host_array(buf):
    """A ucxx Array over a host tensor's (or numpy array's) bytes."""
    _, Array = ucx_modules()
    return Array(as_bytes(buf))


def flat(bufs: list) -> list:
    """Flat numpy byte views of bufs: one wire message each."""
    return [as_bytes(buf) for buf in bufs]


class Worker:
    """A UCX worker and how it progresses: by its own thread (tcp), or by whichever agent
    thread waits (shm, caller_progress). A caller-driven worker can be retired: from then on
    nothing progresses it, so it writes no buffer again (ucx.UCXLink._drain_receives)."""

    def __init__(self, context, caller_progress: bool):
        ucx_api, _ = ucx_modules()
        self.handle = ucx_api.UCXWorker(context)
        self.caller_progress = caller_progress
        self.retired: Optional[str] = None
        self._lock = threading.Lock()
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

    def retire(self, why: str) -> None:
        with self._lock:
            if self.retired is None:
                self.retired = why
                logger.error("kv_transfer: UCX worker retired, links on it fail from now on: %s", why)
