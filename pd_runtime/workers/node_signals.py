"""Which prefill workers on this machine are computing now, for the decode workers beside them
(engine.min_step_interval_s, pd_runtime/workers/engine_loop.py).

Each CPU prefill worker keeps one byte in a file of its own under a per-user directory in
/dev/shm (`prefill-<pid>-<start time>`): 1 while its engine has work, 0 when idle, written
through a shared mapping. A decode worker lists the directory every `rescan_s` and reads the
bytes before a step: a page of shared memory, no call and no lock. A worker that is stopped
(SIGSTOP), dead or gone is not counted: its process state is read from /proc at each listing,
and a file whose process is gone (or whose pid now names another process: the start time in
its name differs) is removed.
"""

from __future__ import annotations

import logging
import mmap
import os
import tempfile
import time
from pathlib import Path
from typing import Optional

log = logging.getLogger(__name__)

_PREFIX = "prefill-"


def default_directory() -> Path:
    base = Path("/dev/shm") if os.path.isdir("/dev/shm") else Path(tempfile.gettempdir())
    return base / f"pd-runtime-{os.getuid()}"


def _stat(pid: int) -> Optional[tuple[str, str]]:
    """(state, start time) of a process from /proc/<pid>/stat; None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read().decode(errors="replace")
    except OSError:
        return None
    fields = raw[raw.rindex(")") + 2:].split()  # after the command name, which may hold spaces
    return fields[0], fields[19]  # state; starttime (field 22 of the whole line)


class BusyFlag:
    """A prefill worker's byte: `set(busy)` on every turn of its engine loop (a write only on
    a change)."""

    def __init__(self, directory: Optional[Path] = None):
        self.directory = Path(directory or default_directory())
        self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        pid = os.getpid()
        self.path = self.directory / f"{_PREFIX}{pid}-{_stat(pid)[1]}"
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.ftruncate(fd, mmap.PAGESIZE)
            self._map = mmap.mmap(fd, mmap.PAGESIZE)
        finally:
            os.close(fd)
        self._busy = False

    def set(self, busy: bool) -> None:
        if busy != self._busy and not self._map.closed:
            self._map[0] = 1 if busy else 0
            self._busy = busy

    def close(self) -> None:
        try:
            self._map[0] = 0
            self._map.close()
            self.path.unlink()
        except (OSError, ValueError):
            pass
        self._busy = False


class PrefillWatch:
    """A decode worker's view of the prefill workers on its machine: `busy()` is whether any
    running one has work now."""

    def __init__(self, directory: Optional[Path] = None, rescan_s: float = 1.0):
        self.directory = Path(directory or default_directory())
        self.rescan_s = rescan_s
        self._maps: dict[str, mmap.mmap] = {}  # file name -> its mapping (running processes)
        self._scanned_at = -float("inf")

    def busy(self, now: Optional[float] = None) -> bool:
        now = time.monotonic() if now is None else now
        if now - self._scanned_at >= self.rescan_s:
            self._scanned_at = now
            self._rescan()
        return any(m[0] for m in self._maps.values())

    def watched(self) -> int:
        """How many prefill workers it reads (running ones)."""
        return len(self._maps)

    def _rescan(self) -> None:
        try:
            names = [n for n in os.listdir(self.directory) if n.startswith(_PREFIX)]
        except OSError:
            names = []
        for name in set(self._maps) - set(names):
            self._maps.pop(name).close()
        for name in names:
            try:
                pid, start = name[len(_PREFIX):].split("-", 1)
                stat = _stat(int(pid))
            except ValueError:
                continue
            if stat is None or stat[1] != start:  # gone, or the pid is another process's now
                if name in self._maps:
                    self._maps.pop(name).close()
                try:
                    (self.directory / name).unlink()
                except OSError:
                    pass
                continue
            if stat[0] not in "RSD":  # stopped, traced or a zombie: computing nothing
                if name in self._maps:
                    self._maps.pop(name).close()
                continue
            if name not in self._maps:
                try:
                    fd = os.open(self.directory / name, os.O_RDONLY)
                    try:
                        self._maps[name] = mmap.mmap(fd, mmap.PAGESIZE, prot=mmap.PROT_READ)
                    finally:
                        os.close(fd)
                except (OSError, ValueError) as exc:  # removed meanwhile, or not yet sized
                    log.debug("cannot read prefill flag %s: %s", name, exc)

    def close(self) -> None:
        for m in self._maps.values():
            m.close()
        self._maps.clear()


def for_worker(role: str, config) -> tuple[Optional[BusyFlag], Optional[PrefillWatch]]:
    """What a worker of this role and EngineConfig keeps: a CPU prefill worker its flag, a CPU
    decode worker whose steps may be paced (min_step_interval_s > 0) its watch; else none.
    Without a writable directory for the flags a worker goes without (never paced)."""
    if config.device != "cpu":
        return None, None
    try:
        if role == "prefill":
            return BusyFlag(), None
        if role == "decode" and (config.min_step_interval_s or 0.0) > 0.0:
            return None, PrefillWatch()
    except OSError as exc:
        log.warning("no prefill flags on this machine (%s): decode steps are not paced", exc)
    return None, None
