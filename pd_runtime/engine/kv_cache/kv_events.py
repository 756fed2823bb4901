"""What an engine's prefix cache holds, as events a router follows: a block (by its chained
hash) stored in a tier, removed from one, or everything cleared.

Readers pull: `since(epoch, seq)` returns the events after `seq`, or None when the reader must
start over from a snapshot (it has never read, the engine restarted: another epoch, or it fell
more than `limit` events behind). The snapshot (`snapshot`, called on the engine thread, where
events are made, so nothing changes under it) is every block held and the sequence number it is
current to. Any number of readers (router replicas) each keep their own cursor. Appends come
from the engine thread, reads from the worker's event loop: one lock between them.
"""

from __future__ import annotations

import threading
import uuid
from collections import deque
from typing import Optional

TIERS = ("device", "host", "disk")


class KVEventLog:
    def __init__(self, limit: int = 200_000):
        self.epoch = uuid.uuid4().hex[:16]  # a new engine: readers resync
        self.limit = limit
        self._lock = threading.Lock()
        self._seq = 0
        self._events: deque[tuple[int, str, int, str]] = deque()  # seq, op, hash, tier

    def stored(self, block_hash: int, tier: str) -> None:
        self._add("+", block_hash, tier)

    def removed(self, block_hash: int, tier: str) -> None:
        self._add("-", block_hash, tier)

    def cleared(self) -> None:
        self._add("*", 0, "")

    def _add(self, op: str, block_hash: int, tier: str) -> None:
        with self._lock:
            self._seq += 1
            self._events.append((self._seq, op, block_hash, tier))
            if len(self._events) > self.limit:
                self._events.popleft()

    def since(self, epoch: Optional[str], seq: int) -> Optional[dict]:
        """The events after `seq` of `epoch`; None: read a snapshot instead."""
        with self._lock:
            first = self._events[0][0] if self._events else self._seq + 1
            if epoch != self.epoch or seq > self._seq or seq < first - 1:
                return None
            events = [(op, h, tier) for s, op, h, tier in self._events if s > seq] \
                if seq < self._seq else []
            return {"epoch": self.epoch, "seq": self._seq, "events": events}

    def snapshot(self, held: dict) -> dict:
        """`held`: block hash -> the tiers holding it (block_manager.held_blocks()), taken on
        the engine thread; current to the latest event."""
        with self._lock:
            return {"epoch": self.epoch, "seq": self._seq,
                    "snapshot": [(h, sorted(tiers)) for h, tiers in held.items()]}
