"""Run records, idempotency keys and the usage ledger on the embedded SQLite store
(gateway/): the state machine, one run and one ledger row under concurrent retries, a process
killed mid-run marked failed at the next start with no ledger row, and versioned migrations."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from gateway.migrations import MIGRATIONS
from gateway.runs import IdempotencyConflict, InvalidTransition, Runs
from gateway.store import SqliteRunStore, default_path

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture()
def runs(tmp_path):
    store = SqliteRunStore(tmp_path / "runs.sqlite3")
    yield Runs(store)
    store.close()


def test_a_run_moves_through_its_states_and_is_billed_once(runs):
    run, created = runs.create("acme", {"prompt": "hi"})
    assert created and run["state"] == "queued"
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
from gateway.runs import Runs
from gateway.store import SqliteRunStore
runs = Runs(SqliteRunStore({path!r}))
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


def test_a_run_left_in_flight_by_a_killed_process_is_failed_at_the_next_start(tmp_path):
    path = tmp_path / "runs.sqlite3"
    proc = subprocess.run([sys.executable, "-c", _CRASHING_ROUTER.format(repo=str(REPO),
                                                                         path=str(path))],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == -9, proc.stderr
    mid = proc.stdout.strip()
    store = SqliteRunStore(path)
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


def test_migrations_are_versioned_and_applied_once(tmp_path):
    path = tmp_path / "runs.sqlite3"
    first = SqliteRunStore(path)
    assert first.schema_version == MIGRATIONS[-1][0]
    first.close()
    again = SqliteRunStore(path)
    rows = again._db().execute("SELECT version FROM schema_migrations").fetchall()
    assert [r[0] for r in rows] == [v for v, _, _ in MIGRATIONS]
    assert again._db().execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    again.close()


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
