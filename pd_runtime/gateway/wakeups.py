"""Readers of run records woken when a write they wait for commits, not by a sleep loop: each
store has one `Wakeups` in a process, told the run ids of every commit it learns of.

A reader opens `watch(run_id)` before it reads, then reads, then waits on the watch: a write that
commits between its read and its wait has already marked the watch, so none is missed. Who tells
the store of a commit: with SQLite, the process that committed: its own readers directly (its
router's too, for a record writer process's round, once that process has answered:
pd_runtime/gateway/record_writer.py), every other process's by a datagram to the socket that
process keeps beside the file (pd_runtime/gateway/stores/sqlite_notify.py); a watch of SQLite still
reads every `SAFETY_POLL_S`, for a datagram that never came, or every `OTHER_PROCESS_POLL_S`
where its process cannot keep a socket there. With PostgreSQL, the server: every
writing transaction NOTIFYs the ids it wrote and one LISTEN connection per store hears them
(pd_runtime/gateway/stores/postgres.py); no poll, except while that connection is down (lost, or not
yet listening), when watches read every `RECONNECT_POLL_S` and all read again once it is back.
"""

from __future__ import annotations

import asyncio
import threading
from contextlib import contextmanager
from typing import Awaitable, Callable, Iterable, Iterator, Optional, TypeVar

# SQLite, where this process cannot listen for other processes' writes: how often a watch reads
# again for them (it is not told of them).
OTHER_PROCESS_POLL_S = 0.5
# SQLite, listening: how often a watch reads again anyway. A safety net only, for a write whose
# datagram never came (its process could not reach the wake directory, or died between its
# commit and its datagram); every write that is heard wakes its readers at once.
SAFETY_POLL_S = 1.0
# PostgreSQL: how often a watch reads again while the store's LISTEN connection is down.
RECONNECT_POLL_S = 0.5
# Not a write of a run but a request to its producer, told the same way (the notification's
# id is the run's behind one of these): another replica follows the run (its producer starts
# publishing the run's events to the store) or asks for its cancel.
ASK_FOLLOW = "?follow:"
ASK_CANCEL = "?cancel:"

T = TypeVar("T")


class Watch:
    """One reader's wait for a run's writes, on the reader's event loop; marked from any
    thread."""

    def __init__(self, wakeups: "Wakeups", run_id: str):
        self.wakeups = wakeups
        self.run_id = run_id
        self._loop = asyncio.get_running_loop()
        self._marked = asyncio.Event()

    def mark(self) -> None:
        """A write of the run committed (any thread)."""
        try:
            self._loop.call_soon_threadsafe(self._marked.set)
        except RuntimeError:  # the reader's loop has closed: nobody waits any more
            pass

    async def wait(self, timeout_s: float) -> None:
        """Until a write of the run commits since the last wait (at once if one did), the
        store's poll interval passes (where it cannot be told of every write), or
        `timeout_s`; then the reader reads again."""
        poll_s = self.wakeups.poll_s
        limit = timeout_s if poll_s is None else min(timeout_s, poll_s)
        if limit > 0 and not self._marked.is_set():
            try:
                await asyncio.wait_for(self._marked.wait(), limit)
            except TimeoutError:
                pass
        self._marked.clear()


class Wakeups:
    """The watches of one store in this process, by run id. `poll_s`: how often a watch reads
    again regardless (None: never; it is told of every write)."""

    def __init__(self, poll_s: Optional[float] = None,
                 on_first_watch: Optional[Callable[[], None]] = None):
        self.poll_s = poll_s
        self._on_first_watch = on_first_watch  # PostgreSQL's listener starts with it
        self._watches: dict[str, set[Watch]] = {}
        self._askers: list[Callable[[list[str]], None]] = []  # producers told of asks
        self._lock = threading.Lock()

    @contextmanager
    def watch(self, run_id: str) -> Iterator[Watch]:
        """A watch of `run_id`, to open before the read it follows (on the reader's loop)."""
        watch = Watch(self, run_id)
        with self._lock:
            self._watches.setdefault(run_id, set()).add(watch)
        self._hear()
        try:
            yield watch
        finally:
            with self._lock:
                watches = self._watches.get(run_id)
                if watches is not None:
                    watches.discard(watch)
                    if not watches:
                        del self._watches[run_id]

    def _hear(self) -> None:
        """From the first watch or asker on: what other processes commit is heard here."""
        with self._lock:
            first, self._on_first_watch = self._on_first_watch, None
        if first is not None:
            first()

    def add_asker(self, asked: Callable[[list[str]], None]) -> None:
        """`asked` (a record writer's, on the thread that hears) is given the asks committed
        from now on (ids behind ASK_FOLLOW or ASK_CANCEL), every run's: it picks its own."""
        with self._lock:
            self._askers.append(asked)
        self._hear()

    def remove_asker(self, asked: Callable[[list[str]], None]) -> None:
        with self._lock:
            if asked in self._askers:
                self._askers.remove(asked)

    def notify(self, run_ids: Iterable[str]) -> None:
        """Writes of these runs committed, or asks of their producers (any thread)."""
        ids = set(run_ids)
        asks = [i for i in ids if i.startswith("?")]
        with self._lock:
            marked = [w for run_id in ids for w in self._watches.get(run_id, ())]
            askers = list(self._askers) if asks else []
        for watch in marked:
            watch.mark()
        for asked in askers:
            asked(asks)

    def notify_all(self) -> None:
        """Any run may have been written (writes may have gone unheard): every watch reads
        again."""
        with self._lock:
            marked = [w for watches in self._watches.values() for w in watches]
        for watch in marked:
            watch.mark()


def id_payloads(run_ids: Iterable[str], max_bytes: int) -> list[str]:
    """Run ids joined by newlines, as few payloads as hold them in `max_bytes` each (a NOTIFY's,
    a datagram's)."""
    payloads, batch, size = [], [], 0
    for run_id in sorted(set(run_ids)):
        if batch and size + len(run_id.encode()) + 1 > max_bytes:
            payloads.append("\n".join(batch))
            batch, size = [], 0
        batch.append(run_id)
        size += len(run_id.encode()) + 1
    if batch:
        payloads.append("\n".join(batch))
    return payloads


async def read_until(store, run_id: str, read: Callable[[], Awaitable[T]],
                     ready: Callable[[T], bool], timeout_s: float) -> T:
    """`read()` until `ready` of what it gives, again after each write of `run_id` to `store`
    (a RunStore), for at most `timeout_s`: the last value read (ready or not)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    with store.watch(run_id) as watch:
        while True:
            value = await read()
            if ready(value) or loop.time() >= deadline:
                return value
            await watch.wait(deadline - loop.time())
