"""In-process transport for unit tests of everything above the wire: links are pairs of
queues between agents of one process; bytes are copied, never shared.
"""

from __future__ import annotations

import itertools
import queue
import threading
from typing import Optional


from pd_runtime.kv_transfer.base import Link, LinkError, LinkTimeoutError, Transport, as_byte_tensor

_listeners: dict[str, "LocalTransport"] = {}
_names = itertools.count()
_registry_lock = threading.Lock()
_CLOSED = object()


class LocalLink(Link):
    posts_async = True  # a send is a queue put: it never waits, so any thread may post

    def __init__(self, inbox: "queue.Queue", outbox: "queue.Queue"):
        self._inbox, self._outbox = inbox, outbox
        self._closed = False

    def send_bytes(self, buf, timeout_s: float) -> None:
        if self._closed:
            raise LinkError("local link closed")
        self._outbox.put(as_byte_tensor(buf).detach().clone())

    def recv_bytes(self, buf, timeout_s: float) -> None:
        if self._closed:
            raise LinkError("local link closed")
        try:
            item = self._inbox.get(timeout=timeout_s)
        except queue.Empty:
            self.close()  # same rule as gloo: a timed-out link is dead
            raise LinkTimeoutError(f"local recv timed out after {timeout_s:.3f}s") from None
        if item is _CLOSED:
            self._closed = True
            raise LinkError("local peer closed the link")
        target = as_byte_tensor(buf)
        if item.numel() != target.numel():
            self.close()
            raise LinkError(f"message of {item.numel()} bytes for a {target.numel()}-byte buffer")
        target.copy_(item)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._outbox.put(_CLOSED)
            self._inbox.put(_CLOSED)


class LocalTransport(Transport):
    name = "local"

    def __init__(self) -> None:
        with _registry_lock:
            self._name = f"local-{next(_names)}"
            _listeners[self._name] = self
        self._incoming: "queue.Queue[LocalLink]" = queue.Queue()

    def address(self) -> dict:
        return {"name": self._name}

    def connect(self, peer_address: dict, timeout_s: float) -> Link:
        peer = _listeners.get(peer_address.get("name", ""))
        if peer is None:
            raise LinkError(f"no local agent named {peer_address!r}")
        a_to_b, b_to_a = queue.Queue(), queue.Queue()
        peer._incoming.put(LocalLink(a_to_b, b_to_a))
        return LocalLink(b_to_a, a_to_b)

    def accept(self, timeout_s: float) -> Optional[Link]:
        try:
            return self._incoming.get(timeout=timeout_s)
        except queue.Empty:
            return None

    def close(self) -> None:
        with _registry_lock:
            _listeners.pop(self._name, None)
