"""SQLite's side of waking run-record readers (pd_runtime/gateway/wakeups.py) in other processes:
a directory beside the database file (`<file>.wake/`) holds one unix datagram socket per process
whose readers wait, and a process that commits a write sends the run ids to every socket there.

SQLite has no NOTIFY, and router replicas that are processes of their own share the file and
nothing else: the directory is where they find each other. A process binds its socket
(`<pid>-<random>.sock`) with its first watch of the file and removes it when its last store of
the file closes, or at exit; the socket of one that died is removed by the first sender it
refuses. Readers still read every SAFETY_POLL_S, for a ring that never came (a sender that could
not reach the directory, or died between its commit and its ring); where this process cannot
bind there (the directory not writable, no unix sockets) they read every OTHER_PROCESS_POLL_S.
"""

from __future__ import annotations

import atexit
import errno
import logging
import os
import secrets
import socket
import threading
from typing import Iterable, Optional

from pd_runtime.gateway.wakeups import (OTHER_PROCESS_POLL_S, SAFETY_POLL_S, Wakeups,
                                        id_payloads)

log = logging.getLogger(__name__)

SUFFIX = ".sock"
# Run ids per datagram, joined by newlines: a record writer's largest round in a few.
PAYLOAD_MAX_BYTES = 60_000
# A socket's path must fit sun_path (108 bytes); a longer one is reached through the directory's
# descriptor (/proc/self/fd/N/name, Linux).
_SUN_PATH_MAX = 100
# Datagrams a socket holds before senders are refused (EAGAIN): Linux's net.unix.max_dgram_qlen.
_QUEUE_LEN_FILE = "/proc/sys/net/unix/max_dgram_qlen"

_BELLS: dict[tuple[int, str], "Bell"] = {}  # (pid: not a forked parent's, file) -> its Bell
_BELLS_LOCK = threading.Lock()
_WARNED: set[str] = set()  # directories already said to be unusable


def bell_of(path: os.PathLike) -> "Bell":
    """This process's Bell of a SQLite file (its readers' Wakeups with it), shared by every
    store opened on the file here; each store gives it back with `release`."""
    key = (os.getpid(), os.path.realpath(path))
    with _BELLS_LOCK:
        bell = _BELLS.get(key)
        if bell is None:
            bell = _BELLS[key] = Bell(key[1])
        bell.stores += 1
    return bell


def release(bell: "Bell") -> None:
    """A store of the file closed; with the last one the socket goes."""
    with _BELLS_LOCK:
        bell.stores -= 1
        if bell.stores > 0:
            return
        _BELLS.pop((os.getpid(), bell.db_path), None)
    bell.close()


@atexit.register
def _close_all() -> None:
    with _BELLS_LOCK:
        bells = [bell for (pid, _), bell in _BELLS.items() if pid == os.getpid()]
        _BELLS.clear()
    for bell in bells:
        bell.close()


class Bell:
    """One SQLite file's wake directory as this process uses it: `ring` after a commit here
    tells the other processes' readers; `listen` (the first watch's) binds a socket of its own
    and a thread that hands what it hears to `wakeups`."""

    def __init__(self, db_path: str):
        self.db_path = db_path
        self.directory = db_path + ".wake"
        self.wakeups = Wakeups(poll_s=OTHER_PROCESS_POLL_S, on_first_watch=self.listen)
        self.stores = 0
        self._name: Optional[str] = None  # our socket's, once bound
        self._dir_fd: Optional[int] = None  # for paths too long to bind or send to
        self._hearing: Optional[socket.socket] = None
        self._sending: Optional[socket.socket] = None
        self._closing = False
        self._lock = threading.Lock()
        self._thread: Optional[threading.Thread] = None

    # -- the writer's side ---------------------------------------------------------------------
    def ring(self, run_ids: Iterable[str]) -> None:
        """After a commit that wrote these runs: every other process listening on the file is
        told (a refused ring is left to the receiver's safety poll)."""
        if self._closing or not hasattr(socket, "AF_UNIX"):
            return
        try:
            names = [e.name for e in os.scandir(self.directory) if e.name.endswith(SUFFIX)]
        except OSError:  # no directory: nobody listens
            return
        ours = f"{os.getpid()}-"  # this process's readers are woken directly
        names = [n for n in names if not n.startswith(ours)]
        if not names:
            return
        payloads = [p.encode() for p in id_payloads(run_ids, PAYLOAD_MAX_BYTES)]
        sending = self._sender()
        for name in names:
            for payload in payloads:
                try:
                    sending.sendto(payload, self._address(name))
                except OSError as exc:
                    if exc.errno == errno.ECONNREFUSED:  # bound by a process that died
                        _unlink(os.path.join(self.directory, name))
                    # ENOENT: gone meanwhile; EAGAIN: its queue is full (it reads everything
                    # again when it drains it, below); EACCES: not ours to ring
                    break

    def _sender(self) -> socket.socket:
        with self._lock:
            if self._sending is None:
                self._sending = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
                self._sending.setblocking(False)
            return self._sending

    # -- the readers' side ---------------------------------------------------------------------
    def listen(self) -> None:
        """Bind this process's socket in the directory, before the first watch's read (a
        commit after the bind is rung here; one before it, that read sees). Not possible: the
        readers keep the OTHER_PROCESS_POLL_S poll, said once."""
        name = f"{os.getpid()}-{secrets.token_hex(4)}{SUFFIX}"
        hearing = None
        try:
            os.makedirs(self.directory, exist_ok=True)
            hearing = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            address = self._address(name)
            with self._lock:
                if self._closing:
                    hearing.close()
                    return
                self._name = name
                hearing.bind(address)
                self._hearing = hearing
        except (OSError, AttributeError) as exc:  # AttributeError: no AF_UNIX here
            if hearing is not None:
                hearing.close()
            self._name = None
            if self.directory not in _WARNED:
                _WARNED.add(self.directory)
                log.warning("run store: cannot listen for other processes' writes in %s (%s); "
                            "readers read every %g s instead", self.directory, exc,
                            OTHER_PROCESS_POLL_S)
            return
        self.wakeups.poll_s = SAFETY_POLL_S
        self._thread = threading.Thread(target=self._hear, args=(hearing, _queue_len()),
                                        name="run-store-hear", daemon=True)
        self._thread.start()

    def _hear(self, hearing: socket.socket, queue_len: int) -> None:
        while True:
            try:
                payloads = [hearing.recv(PAYLOAD_MAX_BYTES)]
                while payloads[-1] and len(payloads) <= queue_len:  # the rest, at once
                    payloads.append(hearing.recv(PAYLOAD_MAX_BYTES, socket.MSG_DONTWAIT))
            except BlockingIOError:
                pass
            except OSError:
                return
            if self._closing:
                return
            if len(payloads) > queue_len:
                # The queue was full: a sender may have been refused, its runs unheard.
                self.wakeups.notify_all()
            else:
                self.wakeups.notify(run_id for p in payloads if p
                                    for run_id in p.decode().split("\n"))

    def close(self, timeout_s: float = 1.0) -> None:
        """The socket removed (its thread stopped) and the sending one closed."""
        with self._lock:
            self._closing = True
            hearing, self._hearing = self._hearing, None
            sending, self._sending = self._sending, None
        if hearing is not None:
            try:  # wakes the thread's recv
                hearing.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            if self._thread is not None:
                self._thread.join(timeout_s)
            hearing.close()
            _unlink(os.path.join(self.directory, self._name))
        if sending is not None:
            sending.close()
        if self._dir_fd is not None:
            os.close(self._dir_fd)
            self._dir_fd = None

    def _address(self, name: str) -> str:
        path = os.path.join(self.directory, name)
        if len(os.fsencode(path)) <= _SUN_PATH_MAX:
            return path
        with self._lock:
            if self._dir_fd is None:
                self._dir_fd = os.open(self.directory,
                                       os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        return f"/proc/self/fd/{self._dir_fd}/{name}"


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _queue_len() -> int:
    try:
        with open(_QUEUE_LEN_FILE) as f:
            return max(1, int(f.read()))
    except (OSError, ValueError):
        return 10  # Linux's default
