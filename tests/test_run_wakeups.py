"""Run-record readers wake when a write of their run commits (pd_runtime/gateway/wakeups.py):
SQLite's in this process by the committing store, PostgreSQL's by the server's NOTIFY, heard on
a LISTEN connection that comes back when it is lost; a write between a read and its wait is not
missed."""

from __future__ import annotations

import asyncio
import time

import pytest

from pd_runtime.gateway.open import open_store
from pd_runtime.gateway.runs import Runs

WOKEN_WITHIN_S = 5.0  # far under the test's poll interval, far over a loaded machine's wake


def _quiet(store) -> None:
    """No fallback reads: only a notification wakes a watch (set back by `_restore`)."""
    store._poll_was = store.wakeups.poll_s
    store.wakeups.poll_s = 60.0


async def _listening(store) -> None:
    """PostgreSQL: until the store's LISTEN connection is up (SQLite: at once)."""
    deadline = time.monotonic() + 10
    while getattr(store, "_listener", None) is not None and store.wakeups.poll_s is not None:
        assert time.monotonic() < deadline, "the store never listened"
        await asyncio.sleep(0.02)


def test_a_reader_wakes_when_another_store_commits_its_run(store_url):
    reader, writer = open_store(store_url), open_store(store_url)

    async def scenario():
        with reader.watch("run-a") as watch:
            await _listening(reader)
            if reader.wakeups.poll_s is not None:
                _quiet(reader)
            assert await asyncio.to_thread(reader.get_run, "run-a") is None
            began = time.monotonic()
            await asyncio.to_thread(Runs(writer).create, "t", None, None, "run-a")
            await watch.wait(60.0)
            woken_s = time.monotonic() - began
            assert woken_s < WOKEN_WITHIN_S, woken_s
            assert (await asyncio.to_thread(reader.get_run, "run-a"))["state"] == "queued"
            # Another run's write does not wake this watch.
            await asyncio.to_thread(Runs(writer).create, "t", None, None, "run-b")
            began = time.monotonic()
            await watch.wait(0.3)
            assert time.monotonic() - began >= 0.25

    try:
        asyncio.run(scenario())
    finally:
        if hasattr(reader, "_poll_was"):
            reader.wakeups.poll_s = reader._poll_was
        reader.close()
        writer.close()


def test_a_write_between_the_read_and_the_wait_is_not_missed(tmp_path):
    store = open_store(str(tmp_path / "runs.sqlite3"))

    async def scenario():
        with store.watch("run-a") as watch:
            assert store.get_run("run-a") is None  # the read ...
            Runs(store).create("t", None, None, "run-a")  # ... a commit before the wait
            began = time.monotonic()
            await watch.wait(60.0)
            assert time.monotonic() - began < WOKEN_WITHIN_S

    try:
        asyncio.run(scenario())
    finally:
        store.close()


def test_a_round_of_the_record_writer_wakes_this_process_readers(tmp_path):
    """SQLite: the record writer's process commits a round; the router's store is told of it
    (RunStore.committed), which wakes the readers of those runs here."""
    url = str(tmp_path / "runs.sqlite3")
    store = open_store(url)

    async def scenario():
        with store.watch("run-x") as watch:
            loop = asyncio.get_running_loop()
            loop.call_later(0.05, store.committed, ["run-x"])
            began = time.monotonic()
            await watch.wait(60.0)
            assert time.monotonic() - began < WOKEN_WITHIN_S

    try:
        asyncio.run(scenario())
    finally:
        store.close()


@pytest.mark.parametrize("store_url", ["postgresql"], indirect=True)
def test_postgres_readers_poll_while_the_listener_is_lost_and_listen_again(store_url):
    """The LISTEN connection killed by the server: every watch reads again (writes may have
    gone unheard), readers poll until it is back, then a commit wakes them again."""
    reader, writer = open_store(store_url), open_store(store_url)

    async def scenario():
        with reader.watch("run-a") as watch:
            await _listening(reader)
            killed = await asyncio.to_thread(lambda: writer._db().execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE query LIKE "
                "'LISTEN%' AND pid <> pg_backend_pid()").fetchall())
            assert killed, "no LISTEN connection to kill"
            began = time.monotonic()
            await watch.wait(60.0)  # woken by the loss itself
            assert time.monotonic() - began < WOKEN_WITHIN_S
            await _listening(reader)  # back, and no poll
            assert reader.wakeups.poll_s is None
            await asyncio.sleep(0.1)
            await watch.wait(0.0)  # the wake of its return
            began = time.monotonic()
            await asyncio.to_thread(Runs(writer).create, "t", None, None, "run-a")
            await watch.wait(60.0)
            assert time.monotonic() - began < WOKEN_WITHIN_S

    try:
        asyncio.run(scenario())
    finally:
        reader.close()
        writer.close()
