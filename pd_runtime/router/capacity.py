"""What wakes the requests the SLO queue holds (`overload: queue`): a signal that capacity may
have freed (a first token, a request's end, a worker's load report), raised on any thread and
delivered to each waiter on its own event loop. A held request re-decides when woken, or when
the time its decision said it would have to wait has passed, not on a fixed tick.
"""

from __future__ import annotations

import asyncio
import threading


class CapacityChanged:
    def __init__(self):
        self._lock = threading.Lock()
        self._waiters: set[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = set()

    async def wait(self, timeout_s: float) -> bool:
        """Until the next `notify` or `timeout_s`; whether it was a notify."""
        loop = asyncio.get_running_loop()
        entry = (loop, loop.create_future())
        with self._lock:
            self._waiters.add(entry)
        try:
            await asyncio.wait_for(asyncio.shield(entry[1]), max(0.0, timeout_s))
            return True
        except asyncio.TimeoutError:
            return False
        finally:
            with self._lock:
                self._waiters.discard(entry)

    def notify(self) -> None:
        """Wake every waiter (callable from any thread)."""
        with self._lock:
            waiters, self._waiters = self._waiters, set()
        for loop, future in waiters:
            try:
                loop.call_soon_threadsafe(_settle, future)
            except RuntimeError:  # its loop has closed: nobody waits there any more
                pass

    @property
    def waiting(self) -> int:
        return len(self._waiters)


def _settle(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)
