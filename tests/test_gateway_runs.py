"""Run records, idempotency keys and the usage ledger (pd_runtime/gateway/) on every store, the embedded
SQLite file and a real PostgreSQL server started for the session: the state machine, one run and
one ledger row under concurrent retries, a process killed mid-run marked failed at the next start
with no ledger row, and versioned migrations applied once even by processes starting together."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urlsplit

import psycopg
import pytest

from pd_runtime.gateway.stores.migrations import MIGRATIONS
from pd_runtime.gateway.open import open_store
from pd_runtime.gateway.stores.postgres import PostgresRunStore
from pd_runtime.gateway.run_state import IdempotencyConflict, InvalidTransition, Runs
from pd_runtime.gateway.stores.sqlite import SqliteRunStore, default_path

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture()
def runs(store_url):
    store = open_store(store_url)
    yield Runs(store)
    store.close()


def test_a_run_moves_through_its_states_and_is_billed_once(runs):
    run, created = runs.create("acme", {"prompt": "hi"})
    assert created and run["state"] == "queued"
    # Epoch seconds come back exact (PostgreSQL's REAL, 4 bytes, would round them to 128 s).
    assert runs.get(run["id"])["created_at"] == run["created_at"]
    runs.advance(run["id"], "prefilling", path="disaggregated", route_reason="slo_remote",
                 prompt_tokens=12, cached_tokens=4, workers=["decode-0", "prefill-0"])
    runs.advance(run["id"], "streaming")
    with pytest.raises(InvalidTransition, match="streaming -> prefilling"):
        runs.advance(run["id"], "prefilling")
    runs.advance(run["id"], "completed", output_tokens=30)
    with pytest.raises(InvalidTransition, match="completed -> streaming"):
        runs.advance(run["id"], "streaming")
    with pytest.raises(InvalidTransition):
        runs.advance(run["id"], "completed")  # and no second ledger row
    record = runs.get(run["id"], "acme")
    assert record["state"] == "completed" and record["workers"] == '["decode-0", "prefill-0"]'
    assert [s for s, _ in runs.store.transitions(run["id"])] == [
        "queued", "prefilling", "streaming", "completed"]
    usage = runs.usage("acme")
    assert usage["runs"] == 1 and (usage["input_tokens"], usage["cached_tokens"],
                                   usage["output_tokens"]) == (12, 4, 30)
    assert runs.get(run["id"], "other-tenant") is None  # another tenant's run is not there
    assert runs.usage("other-tenant")["runs"] == 0
    # A run that fails or is cancelled is not billed.
    failed, _ = runs.create("acme")
    runs.advance(failed["id"], "failed", error="worker lost")
    cancelled, _ = runs.create("acme")
    runs.advance(cancelled["id"], "prefilling")
    runs.advance(cancelled["id"], "cancelled")
    assert runs.usage("acme")["runs"] == 1
    with pytest.raises(InvalidTransition):
        runs.advance(failed["id"], "streaming")


def test_fifty_concurrent_retries_make_one_run_and_one_ledger_row(runs):
    body = {"model": "m", "prompt": "same", "max_tokens": 8}
    barrier = threading.Barrier(50)
    results, errors = [], []

    def retry():
        barrier.wait()
        try:
            run, created = runs.create("acme", body, idempotency_key="key-1")
            results.append((run["id"], created))
            if created:
                runs.advance(run["id"], "prefilling")
                runs.advance(run["id"], "streaming")
            # Every retry tries to finish it: only one completion (and one row) can happen.
            try:
                runs.advance(run["id"], "completed", prompt_tokens=3, output_tokens=8)
            except InvalidTransition:
                pass
        except Exception as exc:  # noqa: BLE001 (reported below)
            errors.append(exc)

    threads = [threading.Thread(target=retry) for _ in range(50)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:3]
    assert len({rid for rid, _ in results}) == 1 and sum(c for _, c in results) == 1
    assert runs.usage("acme")["runs"] == 1
    # The same key with another body: refused; in another tenant: its own run.
    with pytest.raises(IdempotencyConflict, match="different request body"):
        runs.create("acme", {**body, "max_tokens": 9}, idempotency_key="key-1")
    other, created = runs.create("globex", body, idempotency_key="key-1")
    assert created and other["id"] != results[0][0]


_CRASHING_ROUTER = """
import os, signal, sys
sys.path.insert(0, {repo!r})
from pd_runtime.gateway.open import open_store
from pd_runtime.gateway.run_state import Runs
runs = Runs(open_store({url!r}))
done, _ = runs.create("acme")
for state in ("prefilling", "streaming"):
    runs.advance(done["id"], state)
runs.advance(done["id"], "completed", prompt_tokens=5, output_tokens=2)
mid, _ = runs.create("acme")
runs.advance(mid["id"], "prefilling")
runs.advance(mid["id"], "streaming", prompt_tokens=5)
print(mid["id"], flush=True)
os.kill(os.getpid(), signal.SIGKILL)  # the router dies mid-stream
"""


def test_a_run_left_in_flight_by_a_killed_process_is_failed_at_the_next_start(store_url):
    proc = subprocess.run([sys.executable, "-c", _CRASHING_ROUTER.format(repo=str(REPO),
                                                                         url=store_url)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == -9, proc.stderr
    mid = proc.stdout.strip()
    store = open_store(store_url)
    try:
        runs = Runs(store)
        assert runs.get(mid)["state"] == "streaming"  # as the crash left it
        assert runs.recover() == 1
        record = runs.get(mid)
        assert record["state"] == "failed" and "stopped" in record["error"]
        assert [s for s, _ in store.transitions(mid)][-1] == "failed"
        assert runs.usage("acme")["runs"] == 1  # the finished run only
        assert runs.recover() == 0
    finally:
        store.close()


def test_migrations_are_versioned_and_applied_once(store_url):
    first = open_store(store_url)
    assert first.schema_version == MIGRATIONS[-1][0]
    first.close()
    again = open_store(store_url)
    try:
        assert _applied_versions(again) == [v for v, _, _ in MIGRATIONS]
    finally:
        again.close()



def test_a_store_of_schema_4_keeps_its_runs_transition_times(store_url, monkeypatch):
    """Migration 5 moves run_transitions into columns of runs: a store written by the code of
    schema 4 reads the same states and times after it."""
    from pd_runtime.gateway.stores import sql_store

    monkeypatch.setattr(sql_store, "MIGRATIONS", MIGRATIONS[:4])
    old = open_store(store_url)
    with old._tx() as db:
        for run_id, state, steps in [("run-done", "completed", [("queued", 10.0),
                                      ("prefilling", 11.0), ("streaming", 12.0),
                                      ("completed", 13.0)]),
                                     ("run-cut", "streaming", [("queued", 20.0),
                                      ("prefilling", 21.0), ("streaming", 22.0)])]:
            old._exec(db, "INSERT INTO runs (id, tenant, state, created_at, updated_at) "
                      "VALUES (?, 'acme', ?, ?, ?)", (run_id, state, steps[0][1], steps[-1][1]))
            for step_state, at in steps:
                old._exec(db, "INSERT INTO run_transitions VALUES (?, ?, ?)",
                          (run_id, step_state, at))
    old.close()
    monkeypatch.undo()
    store = open_store(store_url)
    try:
        assert store.schema_version == MIGRATIONS[-1][0]
        assert store.transitions("run-done") == [("queued", 10.0), ("prefilling", 11.0),
                                                 ("streaming", 12.0), ("completed", 13.0)]
        assert store.transitions("run-cut") == [("queued", 20.0), ("prefilling", 21.0),
                                                ("streaming", 22.0)]
        assert Runs(store).recover() == 1  # still in flight: failed, with its time
        assert store.transitions("run-cut")[-1][0] == "failed"
        assert store.get_run("run-done")["ended_at"] == 13.0
    finally:
        store.close()


_MIGRATING_ROUTER = """
import sys
sys.path.insert(0, {repo!r})
from pd_runtime.gateway.open import open_store
print("opening", flush=True)
store = open_store({url!r})
print(store.schema_version, flush=True)
store.close()
"""


def test_processes_starting_together_apply_each_migration_once(store_url):
    # Router replicas restarted together migrate one empty store at the same moment: the store
    # is held shut until every one of them waits at it, then they are all let in.
    code = _MIGRATING_ROUTER.format(repo=str(REPO), url=store_url)
    procs = []
    try:
        with _held_shut(store_url) as wait_for_waiters:
            procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True) for _ in range(6)]
            assert [p.stdout.readline().strip() for p in procs] == ["opening"] * 6
            wait_for_waiters(len(procs))
        outs = [p.communicate(timeout=60) for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0] * 6, [err for _, err in outs]
    assert [out.strip() for out, _ in outs] == [str(MIGRATIONS[-1][0])] * 6
    store = open_store(store_url)
    try:
        assert _applied_versions(store) == [v for v, _, _ in MIGRATIONS]
    finally:
        store.close()


@contextmanager
def _held_shut(store_url: str):
    """The store locked from here to the end of the block; yields a function that returns
    once n other sessions wait (SQLite cannot list its waiters: it gives them a moment)."""
    if store_url.startswith("sqlite://"):
        db = sqlite3.connect(urlsplit(store_url).path, isolation_level=None)
        db.execute("PRAGMA journal_mode = WAL")  # as the store leaves it
        db.execute("BEGIN IMMEDIATE")  # the one write lock
        try:
            yield lambda n: time.sleep(0.5)
        finally:
            db.execute("ROLLBACK")
            db.close()
        return
    db = psycopg.connect(store_url)  # not autocommit: this stays one open transaction
    # Every opener's CREATE TABLE IF NOT EXISTS schema_migrations waits for this uncommitted
    # one; rolled back, they all go at once (the race that fails without a lock held there).
    db.execute("CREATE TABLE schema_migrations (version INTEGER)")

    def wait_for_waiters(n: int) -> None:
        deadline = time.monotonic() + 60
        # Its own connection: a transaction sees one snapshot of pg_stat_activity.
        with psycopg.connect(store_url, autocommit=True) as watch:
            while watch.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = "
                                "current_database() AND wait_event_type = 'Lock'"
                                ).fetchone()[0] < n:
                assert time.monotonic() < deadline, f"{n} sessions never waited for the store"
                time.sleep(0.02)

    try:
        yield wait_for_waiters
    finally:
        db.rollback()
        db.close()


def _applied_versions(store) -> list[int]:
    rows = store._exec(store._db(), "SELECT version FROM schema_migrations ORDER BY version")
    return [row["version"] for row in rows.fetchall()]  # both stores' rows read by name


def test_the_sqlite_file_is_in_wal_mode(tmp_path):
    store = SqliteRunStore(tmp_path / "runs.sqlite3")
    try:  # readers never wait for the writer
        assert store._db().execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    finally:
        store.close()


def test_postgres_columns_hold_epoch_seconds_and_bytes(postgres_server):
    # SQLite's type names in the migrations, PostgreSQL's in the database: REAL is 4 bytes
    # there, and BLOB no type at all.
    store = PostgresRunStore(postgres_server.create_database())
    try:
        types = {(r["table_name"], r["column_name"]): r["data_type"] for r in store._db().execute(
            "SELECT table_name, column_name, data_type FROM information_schema.columns "
            "WHERE table_schema = current_schema()").fetchall()}
    finally:
        store.close()
    assert types[("runs", "created_at")] == types[("usage", "finished_at")] == "double precision"
    assert types[("rate_buckets", "level")] == "double precision"
    assert types[("run_outputs", "body")] == "bytea"
    assert "real" not in types.values()


def test_the_default_file_is_under_the_users_data_directory(tmp_path, monkeypatch):
    monkeypatch.delenv("PD_RUNTIME_DATA_DIR", raising=False)
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    assert default_path() == tmp_path / "data" / "pd-runtime" / "runs.sqlite3"
    monkeypatch.setenv("PD_RUNTIME_DATA_DIR", str(tmp_path / "here"))
    store = SqliteRunStore()
    try:
        assert store.path == tmp_path / "here" / "runs.sqlite3" and store.path.exists()
    finally:
        store.close()
    assert os.path.exists(tmp_path / "here")


def test_open_store_chooses_the_store_by_the_urls_scheme(tmp_path, monkeypatch,
                                                         postgres_server):
    monkeypatch.setenv("PD_RUNTIME_DATA_DIR", str(tmp_path / "default"))
    for url, path in [(None, tmp_path / "default" / "runs.sqlite3"),
                      (str(tmp_path / "bare.sqlite3"), tmp_path / "bare.sqlite3"),
                      (f"sqlite://{tmp_path / 'url.sqlite3'}", tmp_path / "url.sqlite3")]:
        store = open_store(url)
        try:
            assert isinstance(store, SqliteRunStore) and store.path == path and path.exists()
        finally:
            store.close()
    url = postgres_server.create_database()
    for spelling in (url, url.replace("postgresql://", "postgres://", 1)):
        store = open_store(spelling)
        try:
            assert isinstance(store, PostgresRunStore)
        finally:
            store.close()
    with pytest.raises(ValueError, match="'mysql'") as refused:
        open_store("mysql://app:s3cret@db/runs")
    assert "s3cret" not in str(refused.value)
    with pytest.raises(ValueError, match="names a file"):
        open_store("sqlite://host/runs.sqlite3")


def test_recorded_outputs_owners_and_shared_rate_buckets(runs):
    store = runs.store
    mine, _ = runs.create("acme", owner="router-0")
    theirs, _ = runs.create("acme", owner="router-1")
    runs.advance(mine["id"], "prefilling")
    runs.advance(theirs["id"], "prefilling")
    # A replica's restart fails its own runs only; the other replica's stay in flight.
    assert runs.recover("router-0") == 1
    assert runs.get(mine["id"])["state"] == "failed"
    assert runs.get(theirs["id"])["state"] == "prefilling"
    # Outputs are kept byte for byte, once.
    events = b"id: r:0\ndata: {\"a\":1}\n\nid: r:1\ndata: [DONE]\n\n"
    store.save_output(theirs["id"], "sse", events)
    store.save_output(theirs["id"], "sse", b"a second write is ignored")
    assert store.get_output(theirs["id"]) == ("sse", events)
    assert store.get_output(mine["id"]) is None
    # A shared bucket: full at first, drained, refilled by time, never above capacity.
    assert store.take("acme/requests", 3, 1.0, 2, now=100.0) == 0.0
    assert store.take("acme/requests", 3, 1.0, 2, now=100.0) == pytest.approx(1.0)
    assert store.take("acme/requests", 3, 1.0, 2, now=101.0) == 0.0
    assert store.take("acme/requests", 3, 1.0, 4, now=101.0) == float("inf")
    store.give_back("acme/requests", 3, 10)
    assert store.take("acme/requests", 3, 1.0, 3, now=101.0) == 0.0
    assert store.take("acme/requests", 3, 1.0, 1, now=101.0) == pytest.approx(1.0)


def test_a_round_records_every_run_it_can_and_names_the_others(runs):
    from pd_runtime.gateway.run_state import IN_FLIGHT, record_item

    def row(run_id: str, state: str, **fields) -> dict:
        return {**Runs.new_run("acme", run_id, "router-0", now=100.0), "state": state,
                "updated_at": 103.0, **fields}

    done = row("run-good", "completed", prefilling_at=101.0, streaming_at=102.0,
               ended_at=103.0, path="colocated", prompt_tokens=3, output_tokens=2)
    good = record_item("run-good", "acme", 100.0, done, True, IN_FLIGHT, ("json", b"{}"))
    runs.store.insert_run(row("run-ended", "failed"))
    late = record_item("run-ended", "acme", 100.0, {"state": "streaming", "updated_at": 104.0,
                                                   "streaming_at": 104.0}, False)
    refused = record_item("run-refused", "acme", 100.0, row("run-refused", "queued",
                                                            tenant=None), True)
    problems = runs.record_items([good, late, refused])
    assert len(problems) == 2
    assert "run-ended: failed -> streaming could not be recorded" in problems[0]
    assert "run-refused" in problems[1]
    record = runs.get("run-good")
    assert record["state"] == "completed" and runs.store.get_output("run-good") == ("json", b"{}")
    assert [s for s, _ in runs.store.transitions("run-good")] == [
        "queued", "prefilling", "streaming", "completed"]
    assert runs.get("run-ended")["state"] == "failed" and runs.get("run-refused") is None
    assert runs.usage("acme")["runs"] == 1


def test_a_background_responses_opening_is_kept_apart_from_its_output(runs):
    """A background response's created event goes to the store with its first rows (what a
    poll reads should its router stop): once, apart from its output (which routers of an older
    version read), kept past its output's retention, deleted with its run."""
    from pd_runtime.gateway.run_state import IN_FLIGHT, record_item

    def write(run_id: str, state: str, output=None, opening=None, insert=False) -> None:
        row = {**Runs.new_run("acme", run_id, "router-0", now=100.0), "state": state,
               "updated_at": 101.0} if insert else {"state": state, "updated_at": 101.0}
        item = record_item(run_id, "acme", 100.0, row, insert, IN_FLIGHT, output)
        item["opening"] = opening
        assert runs.record_items([item]) == []

    opening = b'event: response.created\ndata: {"status": "queued"}\n\n'
    write("resp_a", "queued", opening=opening, insert=True)
    write("resp_b", "queued", insert=True)
    assert runs.store.get_opening("resp_a") == opening and runs.store.get_output("resp_a") is None
    assert runs.store.get_opening("resp_b") is None
    write("resp_a", "prefilling", opening=b"a second write is ignored")
    write("resp_a", "completed", output=("sse", b"the whole stream"))
    assert runs.store.get_output("resp_a") == ("sse", b"the whole stream")
    assert runs.store.get_opening("resp_a") == opening
    assert runs.store.delete_outputs(200.0, 10) == 1  # its output's retention: not the opening
    assert runs.store.get_opening("resp_a") == opening
    assert runs.store.delete_runs(200.0, 10) == 1
    assert runs.store.get_opening("resp_a") is None
    write("resp_c", "queued", opening=opening, insert=True)
    runs.store.delete_output("resp_c", 102.0)  # deleted by its client: the opening too
    assert runs.store.get_opening("resp_c") is None


def test_a_cancel_asked_of_another_replica_is_read_by_its_owner_only(runs):
    for run_id, owner in [("resp_1", "a:8000/0"), ("resp_2", "a:8000/0"), ("resp_3", "b:8000/0")]:
        runs.create("acme", run_id=run_id, owner=owner)
    assert runs.store.cancels_asked("a:8000/0") == []
    assert runs.store.ask_cancel("resp_2", 100.0) and runs.store.ask_cancel("resp_3", 100.0)
    assert runs.store.cancels_asked("a:8000/0") == ["resp_2"]
    assert runs.get("resp_2")["cancel_asked_at"] == 100.0
    runs.advance("resp_2", "cancelled")
    assert runs.store.cancels_asked("a:8000/0") == []  # ended: asked no more
    assert not runs.store.ask_cancel("resp_2", 101.0)  # nor can it be


def test_runs_of_a_replica_not_seen_for_its_lease_are_failed(runs):
    """A replica that stopped for good (not restarted on its port, so no start-up recovery)
    leaves runs in flight; another replica's keep-alive fails them once the lapsed one has not
    been seen for the lease, and leaves its own runs, live replicas' runs and finished runs."""
    for run_id, owner in [("run-lapsed", "host:8000/1"), ("run-live", "host:8000/0"),
                          ("run-mine", "host:8000/2"), ("run-done", "host:8000/1")]:
        runs.create("acme", run_id=run_id, owner=owner)
        runs.advance(run_id, "prefilling")
    runs.advance("run-done", "streaming")
    runs.advance("run-done", "completed", output_tokens=3)
    runs.store.owner_seen("host:8000/1", 100.0)
    runs.store.owner_seen("host:8000/0", 125.0)
    assert runs.keep_alive("host:8000/2", lease_s=30.0, now=120.0) == 0  # 20 s: not lapsed
    assert runs.keep_alive("host:8000/2", lease_s=30.0, now=140.0) == 1
    lapsed = runs.get("run-lapsed")
    assert lapsed["state"] == "failed" and "not seen for 30 s" in lapsed["error"]
    assert lapsed["ended_at"] == 140.0
    assert [runs.get(r)["state"] for r in ("run-live", "run-mine", "run-done")] == [
        "prefilling", "prefilling", "completed"]
    assert runs.usage("acme")["runs"] == 1  # the failed run is not billed


def test_a_followed_runs_events_are_published_until_its_end(runs):
    """What a replica's client following another's run reads: the runs of an owner in flight
    and followed lately, their events after a sequence number (each written once however
    often sent), gone with the run's final row, and with the run when retention deletes it."""
    from pd_runtime.gateway.retention import Retention
    from pd_runtime.gateway.run_state import IN_FLIGHT, record_item

    store = runs.store
    run, _ = runs.create("acme", owner="a:8000/0")
    quiet, _ = runs.create("acme", owner="a:8000/0")
    assert store.followed("a:8000/0", 0.0) == []
    store.mark_followed(run["id"], 100.0)
    assert store.followed("a:8000/0", 99.0) == [run["id"]]
    assert store.followed("a:8000/0", 101.0) == [] and store.followed("b:8000/0", 0.0) == []
    store.add_events([(run["id"], 0, b"data: 0\n\n"), (run["id"], 1, b"data: 1\n\n")])
    store.add_events([(run["id"], 1, b"data: 1\n\n"), (run["id"], 2, b"data: 2\n\n")])
    assert store.events_after(run["id"], -1) == [b"data: 0\n\n", b"data: 1\n\n", b"data: 2\n\n"]
    assert store.events_after(run["id"], 1) == [b"data: 2\n\n"]
    # A run no longer there (deleted elsewhere) has no events: its events do not fail a round.
    store.add_events([("run-gone", 0, b"data: x\n\n")])
    assert store.events_after("run-gone", -1) == []
    end = {"state": "completed", "updated_at": 103.0, "ended_at": 103.0}
    item = record_item(run["id"], "acme", run["created_at"], end, False, IN_FLIGHT,
                       ("sse", b"data: 0\n\ndata: 1\n\ndata: 2\n\n"))
    assert store.record([{**item, "drop_events": True}]) == [True]
    assert store.events_after(run["id"], -1) == [] and store.followed("a:8000/0", 0.0) == []
    # The round sent again (its answer lost): the final row is already there, no problem.
    assert store.record([{**item, "drop_events": True}], [(run["id"], 3, b"late")]) == [True]
    assert store.get_run(run["id"])["state"] == "completed"
    # Events an ended run was left with go at the outputs' keep.
    assert store.events_after(run["id"], -1) == [b"late"]
    Retention(store, 1.0, None).run_pass(time.time() + 10)
    assert store.events_after(run["id"], -1) == []
    store.add_events([(quiet["id"], 0, b"data: q\n\n")])  # a run a crash left in flight
    runs.recover("a:8000/0")  # failed at the next start: its events go with it
    assert store.events_after(quiet["id"], -1) == []
