"""The SLO queue's wake-up: a notify from another thread wakes every waiter on its own loop at
once; without one a waiter returns at its timeout; a notify before anyone waits wakes nobody
later (each waiter waits for the next change)."""

from __future__ import annotations

import asyncio
import threading
import time

from pd_runtime.router.capacity import CapacityChanged


def test_a_notify_from_another_thread_wakes_every_waiter_at_once():
    capacity = CapacityChanged()

    async def main():
        waiters = [asyncio.create_task(capacity.wait(5.0)) for _ in range(3)]
        while capacity.waiting < 3:
            await asyncio.sleep(0.001)
        started = time.monotonic()
        threading.Thread(target=capacity.notify).start()
        woken = await asyncio.gather(*waiters)
        return woken, time.monotonic() - started

    woken, elapsed = asyncio.run(main())
    assert woken == [True, True, True] and elapsed < 1.0
    assert capacity.waiting == 0


def test_without_a_notify_a_waiter_returns_at_its_timeout():
    capacity = CapacityChanged()
    capacity.notify()  # before anyone waits: wakes nobody later

    async def main():
        started = time.monotonic()
        woken = await capacity.wait(0.2)
        return woken, time.monotonic() - started

    woken, elapsed = asyncio.run(main())
    assert woken is False and 0.19 <= elapsed < 1.0
    assert capacity.waiting == 0
