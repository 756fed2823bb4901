"""A tensor-parallel rank's transfer agent, driven from the worker's driver rank over one
loopback socket: the rank's process serves its agent (`RankAgentServer`), the driver holds a
proxy with the agent's methods (`RemoteRankAgent`, what GroupAgent fans out to).

Calls are synchronous (pickled request, pickled reply; a few hundred microseconds on
loopback). The agent's own events, a piece's end (`on_release`) and room on a link
(`sendable`), travel the other way on the same socket and are delivered on a thread of their
own, so a slow listener never holds up a reply. A closed socket is the other process gone:
the proxy fails its calls (the worker is lost with its rank, pd_runtime/workers/worker.py).
"""

from __future__ import annotations

import itertools
import logging
import pickle
import queue
import socket
import threading
from typing import Callable, Optional

from pd_runtime.kv_transfer.base import KVTransferError, LinkState, SendOutcome
from pd_runtime.model.parallel_comm import pickle_frame, read_pickle_frame

log = logging.getLogger(__name__)

_CALL_TIMEOUT_S = 30.0


class RankGoneError(KVTransferError):
    """The rank's process no longer answers."""


def _send_frame(conn: socket.socket, lock: threading.Lock, message) -> None:
    frame = pickle_frame(message)
    with lock:
        conn.sendall(frame)


class RankAgentServer:
    """In a follower rank's process: listens on `port`; the first `open(*args, **kwargs)` call
    builds the agent with `make_agent(on_release, *args, **kwargs)` (its settings and the
    worker's engine id come from the driver, once it is up); every later call runs that
    agent's method of the same name."""

    _METHODS = frozenset({"metadata", "connect", "peer_state", "send", "expect", "cancel",
                          "cancel_at_peer", "status", "metrics", "table_sizes",
                          "set_link_faults", "transfer_timeout_s"})

    def __init__(self, make_agent: Callable[..., object], host: str = "127.0.0.1"):
        self._make_agent = make_agent
        self.agent = None
        self._listener = socket.create_server((host, 0))
        self.port = self._listener.getsockname()[1]
        self._write_lock = threading.Lock()
        self._conn: Optional[socket.socket] = None
        self._thread = threading.Thread(target=self._serve, name="rank-agent-rpc", daemon=True)
        self._thread.start()

    def _event(self, *event) -> None:
        conn = self._conn
        if conn is not None:
            try:
                _send_frame(conn, self._write_lock, ("event",) + event)
            except OSError:
                pass  # the driver is gone; this process ends with its plan channel

    def _serve(self) -> None:
        conn, _ = self._listener.accept()
        self._listener.close()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._conn = conn
        while True:
            try:
                call_id, method, args, kwargs = read_pickle_frame(conn)
            except (OSError, EOFError):
                break
            try:
                result = self._run(method, args, kwargs)
                reply = ("reply", call_id, True, result)
            except Exception as exc:  # the caller gets it, as a local call would raise it
                reply = ("reply", call_id, False, exc)
            try:
                _send_frame(conn, self._write_lock, reply)
            except OSError:
                break
        if self.agent is not None:
            self.agent.close()

    def _run(self, method: str, args: tuple, kwargs: dict):
        if method == "open":
            if self.agent is None:
                self.agent = self._make_agent(lambda status: self._event("release", status),
                                              *args, **kwargs)
                self.agent.add_sendable_listener(lambda: self._event("sendable"))
            return None
        if method not in self._METHODS or self.agent is None:
            raise KVTransferError(f"rank agent: no method {method!r} (or not opened)")
        if method == "transfer_timeout_s":
            return self.agent.transfer_timeout_s
        return getattr(self.agent, method)(*args, **kwargs)


class RemoteRankAgent:
    """The driver's handle on a follower rank's agent: the agent's methods, as calls."""

    def __init__(self, host: str, port: int, on_release: Callable, *open_args,
                 timeout_s: float = 30.0, **open_kwargs):
        self._conn = socket.create_connection((host, port), timeout=timeout_s)
        self._conn.settimeout(None)
        self._conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._write_lock = threading.Lock()
        self._ids = itertools.count()
        self._waiting: dict[int, queue.SimpleQueue] = {}
        self._waiting_lock = threading.Lock()
        self._events: queue.SimpleQueue = queue.SimpleQueue()
        self._on_release = on_release
        self._sendable: list[Callable[[], None]] = []
        self._gone = False
        threading.Thread(target=self._read, name=f"rank-rpc-r-{port}", daemon=True).start()
        threading.Thread(target=self._deliver, name=f"rank-rpc-e-{port}", daemon=True).start()
        self._call("open", *open_args, **open_kwargs)
        self.transfer_timeout_s = self._call("transfer_timeout_s")

    def _read(self) -> None:
        while True:
            try:
                message = read_pickle_frame(self._conn)
            except (OSError, EOFError, pickle.UnpicklingError):
                break
            if message[0] == "event":
                self._events.put(message[1:])
                continue
            _, call_id, ok, value = message
            with self._waiting_lock:
                waiter = self._waiting.pop(call_id, None)
            if waiter is not None:
                waiter.put((ok, value))
        self._gone = True
        with self._waiting_lock:
            waiters, self._waiting = list(self._waiting.values()), {}
        for waiter in waiters:
            waiter.put((False, RankGoneError("the rank's process is gone")))
        self._events.put(None)

    def _deliver(self) -> None:
        while (event := self._events.get()) is not None:
            try:
                if event[0] == "release":
                    self._on_release(event[1])
                elif event[0] == "sendable":
                    for listener in list(self._sendable):
                        listener()
            except Exception:
                log.exception("rank agent event %s failed", event[0])

    def _call(self, method: str, *args, **kwargs):
        if self._gone:
            raise RankGoneError("the rank's process is gone")
        call_id = next(self._ids)
        waiter: queue.SimpleQueue = queue.SimpleQueue()
        with self._waiting_lock:
            self._waiting[call_id] = waiter
        try:
            _send_frame(self._conn, self._write_lock, (call_id, method, args, kwargs))
            ok, value = waiter.get(timeout=_CALL_TIMEOUT_S)
        except (OSError, queue.Empty) as exc:
            with self._waiting_lock:
                self._waiting.pop(call_id, None)
            raise RankGoneError(f"rank agent call {method}: {exc!r}") from exc
        if not ok:
            raise value
        return value

    # -- the agent's interface ---------------------------------------------------------------
    def metadata(self) -> bytes:
        return self._call("metadata")

    def connect(self, peer_metadata: bytes) -> str:
        return self._call("connect", peer_metadata)

    def peer_state(self, peer_id: str):
        try:
            return self._call("peer_state", peer_id)
        except RankGoneError as exc:
            return LinkState.FAILED, str(exc)

    def add_sendable_listener(self, listener: Callable[[], None]) -> None:
        self._sendable.append(listener)

    def send(self, *args, **kwargs) -> SendOutcome:
        try:
            return self._call("send", *args, **kwargs)
        except RankGoneError:
            return SendOutcome.PEER_UNAVAILABLE

    def expect(self, *args, **kwargs) -> None:
        self._call("expect", *args, **kwargs)

    def cancel(self, request_id: str) -> None:
        try:
            self._call("cancel", request_id)
        except RankGoneError:
            pass  # its transfers ended with it

    def cancel_at_peer(self, peer_id: str, request_id: str) -> bool:
        try:
            return self._call("cancel_at_peer", peer_id, request_id)
        except RankGoneError:
            return False

    def status(self, request_id: str, role):
        return self._call("status", request_id, role)

    def metrics(self) -> dict:
        try:
            return self._call("metrics")
        except RankGoneError:
            return {}

    def table_sizes(self) -> dict:
        try:
            return self._call("table_sizes")
        except RankGoneError:
            return {}

    def set_link_faults(self, **faults) -> None:
        self._call("set_link_faults", **faults)

    def close(self) -> None:
        try:
            self._conn.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._conn.close()
