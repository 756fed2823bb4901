"""Run-record readers wake when a write of their run commits (pd_runtime/gateway/wakeups.py):
SQLite's in this process by the committing store and in other processes by its datagram to their
socket beside the file (falling back to a poll where there can be none), PostgreSQL's by the
server's NOTIFY, heard on a LISTEN connection that comes back when it is lost; a write between a
read and its wait is not missed."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict

from pd_runtime.gateway.open import open_store
from pd_runtime.gateway.run_state import Runs
from pd_runtime.gateway.wakeups import OTHER_PROCESS_POLL_S, RECONNECT_POLL_S, SAFETY_POLL_S

WOKEN_WITHIN_S = 5.0  # far under the test's poll interval, far over a loaded machine's wake


async def waited(watch, timeout_s: float = 60.0) -> float:
    """Seconds until `watch` wakes (or `timeout_s`)."""
    began = time.monotonic()
    await watch.wait(timeout_s)
    return time.monotonic() - began


def _quiet(store) -> None:
    """No fallback reads: only a notification wakes a watch (set back by `_restore`)."""
    store._poll_was = store.wakeups.poll_s
    store.wakeups.poll_s = 60.0


async def _listening(store, watch=None, times: int = 1) -> None:
    """PostgreSQL: until the store's LISTEN connection has come up `times` times (and is up),
    then `watch`'s wake by its coming up (every watch reads again) taken (SQLite: at once)."""
    deadline = time.monotonic() + 10
    listener = getattr(store, "_listener", None)
    if listener is None:
        return
    while listener.num_listens < times or store.wakeups.poll_s is not None:
        assert time.monotonic() < deadline, "the store never listened"
        await asyncio.sleep(0.02)
    if watch is not None:
        await asyncio.sleep(0)  # the wake, sent before the count, is set on this loop first
        await watch.wait(0.0)


def test_a_reader_wakes_when_another_store_commits_its_run(store_url):
    reader, writer = open_store(store_url), open_store(store_url)

    async def scenario():
        with reader.watch("run-a") as watch:
            await _listening(reader, watch)
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
            assert await waited(watch, 0.3) >= 0.25

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
            assert await waited(watch) < WOKEN_WITHIN_S

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
            assert await waited(watch) < WOKEN_WITHIN_S

    try:
        asyncio.run(scenario())
    finally:
        store.close()


@pytest.mark.parametrize("store_url", ["postgresql"], indirect=True)
def test_postgres_readers_poll_while_the_listener_is_lost_and_listen_again(store_url,
                                                                          postgres_server):
    """The LISTEN connection killed by the server, and refused while the database takes no
    connections: every watch reads again (writes may have gone unheard) and readers poll until
    it is back; then it stays up, and a commit wakes them again."""
    reader, writer = open_store(store_url), open_store(store_url)
    database = conninfo_to_dict(store_url)["dbname"]
    # From another database: a connection cannot close its own to new ones.
    admin = psycopg.connect(postgres_server.url("postgres"), autocommit=True)

    def take_connections(allowed: bool) -> None:
        admin.execute(f"ALTER DATABASE {database} ALLOW_CONNECTIONS {allowed}")

    def kill_listener() -> list:
        return admin.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE query LIKE "
            "'LISTEN%%' AND datname = %s", (database,)).fetchall()

    async def scenario():
        with reader.watch("run-a") as watch:
            await _listening(reader, watch)
            await asyncio.to_thread(take_connections, False)
            try:
                assert await asyncio.to_thread(kill_listener), "no LISTEN connection to kill"
                assert await waited(watch) < WOKEN_WITHIN_S  # woken by the loss itself
                # It cannot reconnect yet: readers poll.
                assert reader.wakeups.poll_s == RECONNECT_POLL_S
                assert RECONNECT_POLL_S / 2 < await waited(watch) < WOKEN_WITHIN_S
            finally:
                await asyncio.to_thread(take_connections, True)
            await _listening(reader, watch, times=2)  # back, no poll, its wake taken
            # And it stays up: neither lost again (the poll back) nor reconnected meanwhile.
            await asyncio.sleep(1.0)
            assert reader.wakeups.poll_s is None
            assert reader._listener.num_listens == 2
            began = time.monotonic()
            await asyncio.to_thread(Runs(writer).create, "t", None, None, "run-a")
            await watch.wait(60.0)
            assert time.monotonic() - began < WOKEN_WITHIN_S

    try:
        asyncio.run(scenario())
    finally:
        admin.close()
        reader.close()
        writer.close()


# Another router replica: a process of its own on the same SQLite file, creating the runs it is
# sent on stdin and answering with the monotonic time of each commit (system-wide on Linux).
_OTHER_REPLICA = """
import sys, time
from pd_runtime.gateway.open import open_store
from pd_runtime.gateway.run_state import Runs
store = open_store(sys.argv[1])
print("ready", flush=True)
for line in sys.stdin:
    Runs(store).create("t", None, None, line.strip())
    print(time.monotonic(), flush=True)
store.close()
"""


def test_sqlite_readers_hear_another_process_commit_before_the_safety_poll(tmp_path):
    """Router replicas as processes of their own on one SQLite file: a commit in one wakes the
    readers of the other at once (its datagram to their socket in `<file>.wake/`), not at the
    safety poll; the socket goes when the last store of the file here closes."""
    path = tmp_path / "runs.sqlite3"
    reader = open_store(str(path))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH", "")])}
    other = subprocess.Popen([sys.executable, "-c", _OTHER_REPLICA, str(path)], text=True,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)

    def create(run_id: str) -> float:
        other.stdin.write(run_id + "\n")
        other.stdin.flush()
        return float(other.stdout.readline())

    async def scenario() -> list[float]:
        woken = []
        for n in range(7):
            run_id = f"run-{n}"
            with reader.watch(run_id) as watch:
                assert await asyncio.to_thread(reader.get_run, run_id) is None
                assert reader.wakeups.poll_s == SAFETY_POLL_S  # listening
                committed = asyncio.ensure_future(asyncio.to_thread(create, run_id))
                await watch.wait(WOKEN_WITHIN_S)
                seen = time.monotonic()
                woken.append(seen - await committed)
                assert (await asyncio.to_thread(reader.get_run, run_id))["state"] == "queued"
        return woken

    try:
        assert other.stdout.readline().strip() == "ready"
        woken = asyncio.run(scenario())
        # Each wait would last the whole safety poll if the commit went unheard.
        assert statistics.median(woken) < SAFETY_POLL_S / 3, woken
    finally:
        other.stdin.close()
        other.wait(30)
        reader.close()
    assert not list((tmp_path / "runs.sqlite3.wake").glob(f"{os.getpid()}-*"))


def test_a_dead_process_socket_is_removed_by_the_next_commit(tmp_path, monkeypatch):
    store = open_store(str(tmp_path / "runs.sqlite3"))
    wake = tmp_path / "runs.sqlite3.wake"
    wake.mkdir()
    monkeypatch.chdir(wake)  # a short path to bind (tmp_path may not fit a socket's)
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    dead.bind("999999-gone.sock")
    dead.close()  # bound by nobody now: as a killed process leaves it
    try:
        Runs(store).create("t", None, None, "run-a")
        assert not (wake / "999999-gone.sock").exists()
    finally:
        store.close()


def test_readers_poll_where_no_socket_can_be_bound_beside_the_file(tmp_path, caplog):
    """`<file>.wake` not a directory we can use (read-only, or as here, a file): readers read
    every OTHER_PROCESS_POLL_S for other processes' writes, said once; commits go on."""
    (tmp_path / "runs.sqlite3.wake").write_text("")
    store = open_store(str(tmp_path / "runs.sqlite3"))

    async def scenario():
        with store.watch("run-a"):
            assert store.wakeups.poll_s == OTHER_PROCESS_POLL_S
        with store.watch("run-a") as watch:
            Runs(store).create("t", None, None, "run-a")
            # this process's own commits still wake at once
            assert await waited(watch) < WOKEN_WITHIN_S

    try:
        with caplog.at_level(logging.WARNING, logger="pd_runtime.gateway.stores.sqlite_notify"):
            asyncio.run(scenario())
    finally:
        store.close()
    assert len([r for r in caplog.records if "cannot listen" in r.getMessage()]) == 1


def test_a_producer_hears_another_replica_follow_and_cancel_its_run(store_url, monkeypatch):
    """Another replica's follow (mark_followed) and cancel ask (ask_cancel) of a run this
    router produces are heard as they commit (wakeups.py ASK_FOLLOW / ASK_CANCEL): its record
    writer looks them up then, not on its next poll (set here to a minute)."""
    from pd_runtime.gateway import record_writer
    from pd_runtime.gateway.recorder import RunRecorder

    monkeypatch.setattr(record_writer, "ASK_SAFETY_S", 60.0)
    recorder = RunRecorder(open_store(store_url), store_url, "owner-a")
    recorder.writer.ask_poll_s = lambda: None  # no poll at all: only a heard ask looks up
    other = open_store(store_url)
    cancel_asked = threading.Event()
    recorder.writer.on_cancel_asked = lambda live: cancel_asked.set()

    async def scenario():
        live, _ = await recorder.open("run-heard", "t", True, None, None)
        deadline = time.monotonic() + 30
        while await asyncio.to_thread(other.get_run, "run-heard") is None:
            assert time.monotonic() < deadline, "the run was never recorded"
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.2)  # past the first round's look-up (the poll is a minute now)
        await _listening(recorder.store)
        began = time.monotonic()
        await asyncio.to_thread(other.mark_followed, "run-heard", time.time())
        while "run-heard" not in recorder.writer._followed:
            assert time.monotonic() - began < WOKEN_WITHIN_S, "the follow was not heard"
            await asyncio.sleep(0.01)
        began = time.monotonic()
        assert await asyncio.to_thread(other.ask_cancel, "run-heard", time.time())
        assert await asyncio.to_thread(cancel_asked.wait, WOKEN_WITHIN_S), \
            "the cancel ask was not heard"
        recorder.writer.ended(live)

    try:
        asyncio.run(scenario())
    finally:
        other.close()
        recorder.close()
