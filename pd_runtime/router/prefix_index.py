"""Which worker caches which prompt prefixes, by the same chained block hashes the engine uses
(pd_runtime.engine.kv_cache.block_hash).

Exact where a worker publishes KV events (engine/kv_cache/kv_events.py; the router pulls them
with its health checks, `routing.kv_events`): its blocks as it stored them, in any tier (device,
host, disk), and gone when it evicts them. A router that starts, a worker that restarts, or a
reader that fell behind reads a snapshot instead: the index is resynced, never guessed. Between
the routing of a prompt and the events of its blocks (a health interval), the prompt's blocks
count as held there for up to PENDING_S unless an event says they went.

Without events (a worker that does not publish them, or kv_events off): an estimate. Every
prompt routed to a worker records its full-block hashes there, newest last, capped at the
blocks it can hold (device and tiers), oldest forgotten first; a worker may have evicted what
the router remembers.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import OrderedDict
from typing import Callable, Optional

log = logging.getLogger(__name__)

PENDING_S = 30.0  # how long a routed prompt's blocks count as held before an event confirms

from pd_runtime.engine.kv_cache.block_hash import block_hashes, root_hash


class PrefixIndex:
    def __init__(self, model_identity: str, block_size: int):
        self.model_identity = model_identity
        self.block_size = block_size
        self._by_worker: dict[str, OrderedDict[int, None]] = {}
        self._capacity: dict[str, int] = {}
        # Exact mode, per worker that publishes events: hash -> its tiers, the cursor
        # (epoch, seq) into the worker's event log, and hashes routed there lately -> when.
        self._held: dict[str, dict[int, set]] = {}
        self._cursor: dict[str, tuple[Optional[str], int]] = {}
        self._pending: dict[str, OrderedDict[int, float]] = {}
        # The health thread applies events while requests are routed on the event loop.
        self._lock = threading.Lock()

    def hashes(self, token_ids: list[int], cache_salt: Optional[str]) -> list[int]:
        return block_hashes(token_ids, self.block_size,
                            root_hash(self.model_identity, None, cache_salt))

    def set_capacity(self, worker_id: str, num_blocks: int) -> None:
        self._capacity[worker_id] = max(1, num_blocks)

    def expected_hit_tokens(self, worker_id: str, hashes: list[int], prompt_len: int) -> int:
        """Leading prompt tokens the worker likely has cached (whole blocks, as the engine
        counts them: at least one prompt token is always computed)."""
        with self._lock:
            return self._expected_hit_tokens(worker_id, hashes, prompt_len)

    def apply(self, worker_id: str, reply: dict) -> None:
        """A worker's kv_events reply: a snapshot replaces what the index held for it; events
        are applied in order."""
        with self._lock:
            self._apply(worker_id, reply)

    def record(self, worker_id: str, hashes: list[int]) -> None:
        """A prompt routed to the worker: its blocks will be there (estimate), or count as
        there until its events say (exact)."""
        with self._lock:
            self._record(worker_id, hashes)

    def forget(self, worker_id: str) -> None:
        """A restarted worker starts with an empty cache (with events: read a snapshot)."""
        with self._lock:
            self._forget(worker_id)

    def _expected_hit_tokens(self, worker_id: str, hashes: list[int], prompt_len: int) -> int:
        max_blocks = (prompt_len - 1) // self.block_size
        held = self._held.get(worker_id)
        if held is not None:
            pending = self._pending.get(worker_id, {})
            recent = time.monotonic() - PENDING_S
            hit = 0
            for h in hashes[:max_blocks]:
                if h not in held and pending.get(h, recent) <= recent:
                    break
                hit += 1
            return hit * self.block_size
        known = self._by_worker.get(worker_id)
        if not known:
            return 0
        hit = 0
        for h in hashes[:max_blocks]:
            if h not in known:
                break
            hit += 1
        return hit * self.block_size

    def tiers_of(self, worker_id: str, block_hash: int) -> set:
        """The tiers a worker holds a block in, by its events (empty: none, or no events)."""
        with self._lock:
            return set((self._held.get(worker_id) or {}).get(block_hash, ()))

    def exact(self, worker_id: str) -> bool:
        return worker_id in self._held

    def stop_following(self) -> None:
        """Back to the estimate for every worker (routing.kv_events turned off): what the
        events said is dropped, not left to go stale."""
        with self._lock:
            self._held.clear()
            self._cursor.clear()
            self._pending.clear()

    def tier_load_s(self, hashes: list[int], hits: dict[str, int],
                    block_s: Callable[[str], dict]) -> dict[str, float]:
        """Worker id -> the seconds it takes to load the blocks of its expected hit that only a
        lower tier (host, disk) holds, at `block_s(worker)[tier]` a block (exact mode only)."""
        out = {}
        for worker_id, tokens in hits.items():
            if not tokens or not self.exact(worker_id):
                continue
            per_block, seconds = block_s(worker_id), 0.0
            for h in hashes[:tokens // self.block_size]:
                tiers = self.tiers_of(worker_id, h)
                if tiers and "device" not in tiers:
                    seconds += per_block["host" if "host" in tiers else "disk"]
            if seconds:
                out[worker_id] = seconds
        return out

    # -- exact mode --------------------------------------------------------------------------
    def cursor(self, worker_id: str) -> tuple[Optional[str], int]:
        """Where to read the worker's events from: (None, 0) asks for a snapshot."""
        return self._cursor.get(worker_id, (None, 0))

    def _apply(self, worker_id: str, reply: dict) -> None:
        if "snapshot" in reply:
            self._held[worker_id] = {h: set(tiers) for h, tiers in reply["snapshot"]}
        held = self._held.setdefault(worker_id, {})
        pending = self._pending.setdefault(worker_id, OrderedDict())
        for op, h, tier in reply.get("events", ()):
            if op == "+":
                held.setdefault(h, set()).add(tier)
                pending.pop(h, None)
            elif op == "-":
                tiers = held.get(h)
                if tiers is not None:
                    tiers.discard(tier)
                    if not tiers:
                        del held[h]
                pending.pop(h, None)
            elif op == "*":
                held.clear()
                pending.clear()
        self._cursor[worker_id] = (reply["epoch"], reply["seq"])
        recent = time.monotonic() - PENDING_S
        while pending and next(iter(pending.values())) <= recent:
            pending.popitem(last=False)

    # -- both --------------------------------------------------------------------------------
    def _record(self, worker_id: str, hashes: list[int]) -> None:
        if worker_id in self._held:
            pending = self._pending.setdefault(worker_id, OrderedDict())
            now = time.monotonic()
            for h in hashes:
                pending[h] = now
                pending.move_to_end(h)
            return
        known = self._by_worker.setdefault(worker_id, OrderedDict())
        for h in hashes:
            known[h] = None
            known.move_to_end(h)
        cap = self._capacity.get(worker_id, 1 << 30)
        while len(known) > cap:
            known.popitem(last=False)

    def _forget(self, worker_id: str) -> None:
        self._by_worker.pop(worker_id, None)
        self._pending.pop(worker_id, None)
        if worker_id in self._held:
            self._held[worker_id] = {}
        self._cursor.pop(worker_id, None)


async def follow_kv_events(index: PrefixIndex, workers: list, timeout_s: float = 2.0) -> None:
    """Each healthy worker's KV events since the index last read them (a snapshot the first
    time, after the worker's restart, or when the index fell behind) into the index. A worker
    that does not answer is read from the same cursor at the next health check."""
    async def one(w) -> None:
        try:
            reply = await asyncio.wait_for(
                w.handle.kv_events.remote(*index.cursor(w.worker_id)), timeout_s)
        except Exception as exc:
            log.debug("kv events of %s not read: %s", w.worker_id, exc)
            return
        index.apply(w.worker_id, reply)

    await asyncio.gather(*(one(w) for w in workers if w.healthy))
