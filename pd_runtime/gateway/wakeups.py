"""Readers of run records woken when a write they wait for commits, not by a sleep loop: each
store has one `Wakeups` in a process, told the run ids of every commit it learns of.

A reader opens `watch(run_id)` before it reads, then reads, then waits on the watch: a write that
commits between its read and its wait has already marked the watch, so none is missed. Who tells
the store of a commit: with SQLite, the process that committed (its own transactions, and its
record writer process's rounds once that process has answered, pd_runtime/gateway/record_writer.py);
a write by another process on the same file (another router replica) is not heard, so a watch
of SQLite reads again every `OTHER_PROCESS_POLL_S` for those alone. With PostgreSQL, the server:
every writing transaction NOTIFYs the ids it wrote and one LISTEN connection per store hears
them (pd_runtime/gateway/postgres.py); no poll, except while that connection is down (lost, or
not yet listening), when watches read every `RECONNECT_POLL_S` and all read again once it is
back.
"""

from __future__ import annotations

import asyncio
import threading
from contextlib import contextmanager
from typing import Awaitable, Callable, Iterable, Iterator, Optional, TypeVar

# SQLite: how often a watch reads again for a write by another process (it is not told of it).
OTHER_PROCESS_POLL_S = 0.5
# PostgreSQL: how often a watch reads again while the store's LISTEN connection is down.
RECONNECT_POLL_S = 0.5

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
        self._lock = threading.Lock()

    @contextmanager
    def watch(self, run_id: str) -> Iterator[Watch]:
        """A watch of `run_id`, to open before the read it follows (on the reader's loop)."""
        watch = Watch(self, run_id)
        with self._lock:
            self._watches.setdefault(run_id, set()).add(watch)
            first, self._on_first_watch = self._on_first_watch, None
        if first is not None:
            first()
        try:
            yield watch
        finally:
            with self._lock:
                watches = self._watches.get(run_id)
                if watches is not None:
                    watches.discard(watch)
                    if not watches:
                        del self._watches[run_id]

    def notify(self, run_ids: Iterable[str]) -> None:
        """Writes of these runs committed (any thread)."""
        with self._lock:
            marked = [w for run_id in set(run_ids) for w in self._watches.get(run_id, ())]
        for watch in marked:
            watch.mark()

    def notify_all(self) -> None:
        """Any run may have been written (writes may have gone unheard): every watch reads
        again."""
        with self._lock:
            marked = [w for watches in self._watches.values() for w in watches]
        for watch in marked:
            watch.mark()


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
