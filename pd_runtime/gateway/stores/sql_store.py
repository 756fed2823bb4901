"""The RunStore operations (pd_runtime/gateway/store.py) in SQL, written once for every database: the
embedded SQLite file (pd_runtime/gateway/stores/sqlite.py) and PostgreSQL (pd_runtime/gateway/stores/postgres.py) supply a connection,
a transaction, their placeholder style and which of their driver's errors mean no answer.
"""

from __future__ import annotations

import logging
import threading
import time
from contextlib import contextmanager
from typing import Optional

from pd_runtime.gateway.stores.migrations import MIGRATIONS
from pd_runtime.gateway.store import (DAY_S, ENDED, IN_FLIGHT, RUN_FIELDS, STATE_TIME, UPDATABLE,
                           StoreUnavailable)
from pd_runtime.gateway.wakeups import ASK_CANCEL, ASK_FOLLOW

log = logging.getLogger(__name__)

DELETED = "deleted"  # run_outputs.kind of an output deleted by its client


class SqlRunStore:
    """The RunStore operations in SQL, written once for every database: a subclass supplies a
    connection per thread (`_db`), a write transaction (`_transaction`), which of its driver's
    errors mean no answer (`_unavailable`), its placeholder style (`_sql`, from the `?`
    written here) and the `wakeups` its readers wait on (pd_runtime/gateway/wakeups.py):
    each write below names the runs it wrote (`_touched`)."""

    schema_version = 0

    def _db(self):
        raise NotImplementedError

    def _transaction(self):
        """The database's own transaction (a context manager giving the connection)."""
        raise NotImplementedError

    def _unavailable(self, exc: BaseException) -> bool:
        """Whether a driver's error means the store did not answer (StoreUnavailable)."""
        return False

    def _sql(self, statement: str) -> str:
        return statement

    def _exec(self, db, statement: str, params=()):
        try:
            return db.execute(self._sql(statement), params)
        except Exception as exc:
            if self._unavailable(exc):
                raise StoreUnavailable(_first_line(exc)) from exc
            raise

    @contextmanager
    def _tx(self):
        """A write transaction (a savepoint inside one already open); the driver's errors that
        mean the store did not answer, at BEGIN or COMMIT too, raised as StoreUnavailable.
        Once the outermost one commits, the readers of the runs it wrote are woken."""
        outermost = getattr(self._local, "touched", None) is None
        if outermost:
            self._local.touched = set()
        touched = None
        try:
            with self._transaction() as db:
                yield db
        except StoreUnavailable:
            raise
        except Exception as exc:
            if self._unavailable(exc):
                raise StoreUnavailable(_first_line(exc)) from exc
            raise
        finally:
            if outermost:
                touched, self._local.touched = self._local.touched, None
        if touched:
            self._after_commit(touched)

    def _touched(self, db, run_ids) -> None:
        """The transaction open on `db` wrote these runs (their readers wait for it)."""
        self._local.touched.update(run_ids)

    def _after_commit(self, run_ids) -> None:
        """A transaction of this store that wrote these runs committed: their readers are
        woken (here; a subclass tells other processes' too, where its database does not)."""
        self.committed(run_ids)

    def committed(self, run_ids) -> None:
        """Writes of these runs committed, in this process or in one whose commits this one
        hears of: their readers here are woken."""
        self.wakeups.notify(run_ids)

    def watch(self, run_id: str):
        """What a reader of the run waits on (pd_runtime/gateway/wakeups.py Wakeups.watch)."""
        return self.wakeups.watch(run_id)

    def _migrate(self) -> int:
        with self._tx() as db:
            self._exec(db, "CREATE TABLE IF NOT EXISTS schema_migrations (version INTEGER "
                       "PRIMARY KEY, name TEXT NOT NULL, applied_at REAL NOT NULL)")
            # An upgrade says what it applies (it may take a while on a large store).
            upgrade = self._exec(db, "SELECT 1 FROM schema_migrations").fetchone() is not None
        for version, name, statements in MIGRATIONS:
            with self._tx() as db:
                # Another process may be applying it too: whoever commits the claim first wins,
                # the other finds the row inside its own write transaction and skips it.
                self._lock_migrations(db)
                if self._exec(db, "SELECT 1 FROM schema_migrations WHERE version = ?",
                              (version,)).fetchone():
                    continue
                if upgrade:
                    log.info("run store: applying migration %d (%s)", version, name)
                for statement in statements:
                    self._exec(db, statement)
                self._exec(db, "INSERT INTO schema_migrations VALUES (?, ?, ?)",
                           (version, name, time.time()))
        return max(version for version, _, _ in MIGRATIONS)

    def _lock_migrations(self, db) -> None:
        """Serialize migrating processes (SQLite's BEGIN IMMEDIATE already does)."""

    def close(self) -> None:
        """Every thread's connection (a subclass keeps them in `_all`, under `_lock`)."""
        with self._lock:
            for db in self._all:
                db.close()
            self._all.clear()
        self._local = threading.local()

    # -- RunStore ----------------------------------------------------------------------------
    def insert_run(self, run: dict) -> Optional[dict]:
        columns = [f for f in RUN_FIELDS if f in run]
        with self._tx() as db:
            if run.get("idempotency_key") is not None:
                held = self._exec(db, "SELECT * FROM runs WHERE tenant = ? AND "
                                  "idempotency_key = ? FOR UPDATE_IF_SUPPORTED",
                                  (run["tenant"], run["idempotency_key"])).fetchone()
                if held is not None:
                    return dict(held)
            self._exec(db, f"INSERT INTO runs ({', '.join(columns)}) VALUES "
                       f"({', '.join('?' for _ in columns)})", [run[c] for c in columns])
            self._touched(db, [run["id"]])
        return None

    def get_run(self, run_id: str) -> Optional[dict]:
        row = self._exec(self._db(), "SELECT * FROM runs WHERE id = ?", (run_id,)).fetchone()
        return dict(row) if row is not None else None

    def transition(self, run_id: str, expect: tuple[str, ...], state: str, at: float,
                   fields: dict, usage: Optional[dict] = None) -> Optional[str]:
        bad = set(fields) - UPDATABLE
        if bad:
            raise ValueError(f"run fields {sorted(bad)} cannot be updated")
        with self._tx() as db:
            row = self._exec(db, "SELECT state FROM runs WHERE id = ? FOR UPDATE_IF_SUPPORTED",
                             (run_id,)).fetchone()
            if row is None:
                raise KeyError(run_id)
            was = _first(row)
            if was not in expect:
                return None
            sets = {**fields, "state": state, "updated_at": at, STATE_TIME[state]: at}
            self._exec(db, f"UPDATE runs SET {', '.join(f'{k} = ?' for k in sets)} "
                       "WHERE id = ?", [*sets.values(), run_id])
            if usage is not None:  # the primary key makes a second row impossible
                self._exec(db, "INSERT INTO usage VALUES (?, ?, ?, ?, ?, ?, ?) "
                           "ON CONFLICT (run_id) DO NOTHING",
                           (run_id, usage["tenant"], usage["input_tokens"],
                            usage["cached_tokens"], usage["output_tokens"],
                            usage["duration_s"], at))
            self._touched(db, [run_id])
            return was

    def record(self, items: list[dict], events: list[tuple[str, int, bytes]] = ()
               ) -> list[bool]:
        for item in items:
            if not item["insert"]:
                bad = set(item["row"]) - UPDATABLE
                if bad:
                    raise ValueError(f"run fields {sorted(bad)} cannot be updated")
        with self._tx() as db:
            new = [item for item in items if item["insert"]]
            try:
                with self._tx():  # runs new in this round (most): a few statements for all
                    self._record_new(db, new)
                done = {id(item) for item in new}
            except StoreUnavailable:  # the round fails as a whole: it goes again later
                raise
            except Exception:
                log.exception("run records: %d new runs failed together; recording them one "
                              "by one", len(new))
                done = set()
            results = []
            for item in items:  # the others each in a savepoint: one failing is undone alone
                if id(item) in done:
                    results.append(True)
                    continue
                try:
                    results.append(self._record_one(db, item))
                except StoreUnavailable:
                    raise
                except Exception:
                    log.exception("run record of %s failed", item["run_id"])
                    results.append(False)
            self._add_events(db, events)
            self._touched(db, [item["run_id"] for item in items] +
                          [run_id for run_id, _, _ in events])
            return results

    def _record_new(self, db, items: list[dict]) -> None:
        if not items:
            return
        db.cursor().executemany(self._sql(
            f"INSERT INTO runs ({', '.join(RUN_FIELDS)}) VALUES "
            f"({', '.join('?' for _ in RUN_FIELDS)})"),
            [[item["row"].get(c) for c in RUN_FIELDS] for item in items])
        self._record_rows(db, items)

    def _record_one(self, db, item: dict) -> bool:
        row = item["row"]
        with self._tx():
            found = self._exec(db, "SELECT state FROM runs WHERE id = ? FOR UPDATE_IF_SUPPORTED",
                               (item["run_id"],)).fetchone()
            if found is None:
                if not item["insert"]:
                    return False
                columns = [f for f in RUN_FIELDS if f in row]
                self._exec(db, f"INSERT INTO runs ({', '.join(columns)}) VALUES "
                           f"({', '.join('?' for _ in columns)})", [row[c] for c in columns])
            elif _first(found) != row.get("state"):
                # (Already in this state: a round committed whose answer was lost, sent again;
                # nothing to change. A row to insert that is there already, for the same
                # reason, is moved on like any other.)
                if _first(found) not in item["expect"]:
                    return False
                changes = {k: v for k, v in row.items() if k in UPDATABLE}
                self._exec(db, f"UPDATE runs SET {', '.join(f'{k} = ?' for k in changes)} "
                           "WHERE id = ?", [*changes.values(), item["run_id"]])
            self._record_rows(db, [item])  # usage and output at most once (ON CONFLICT)
            return True

    def _record_rows(self, db, items: list[dict]) -> None:
        """The usage and output rows of runs just inserted or moved."""
        cursor = db.cursor()
        usage = [(item["run_id"], u["tenant"], u["input_tokens"], u["cached_tokens"],
                  u["output_tokens"], u["duration_s"], item["row"]["updated_at"])
                 for item in items if (u := item["usage"]) is not None]
        if usage:  # the primary key makes a second row for a run impossible
            cursor.executemany(self._sql("INSERT INTO usage VALUES (?, ?, ?, ?, ?, ?, ?) "
                                         "ON CONFLICT (run_id) DO NOTHING"), usage)
        published = [(item["run_id"],) for item in items if item.get("drop_events")]
        if published:  # the run's end: its output holds them now
            cursor.executemany(self._sql("DELETE FROM run_events WHERE run_id = ?"), published)
        outputs = [(item["run_id"], *item["output"], item.get("conversation"),
                    item["created_at"]) for item in items if item["output"] is not None]
        if outputs:
            cursor.executemany(self._sql("INSERT INTO run_outputs (run_id, kind, body, "
                                         "conversation, created_at) VALUES (?, ?, ?, ?, ?) "
                                         "ON CONFLICT (run_id) DO NOTHING"), outputs)
        openings = [(item["run_id"], item["opening"]) for item in items
                    if item.get("opening") is not None]
        if openings:
            cursor.executemany(self._sql("INSERT INTO run_openings (run_id, body) VALUES (?, ?) "
                                         "ON CONFLICT (run_id) DO NOTHING"), openings)

    def transitions(self, run_id: str) -> list[tuple[str, float]]:
        row = self._exec(self._db(), "SELECT state, created_at, prefilling_at, streaming_at, "
                         "ended_at FROM runs WHERE id = ?", (run_id,)).fetchone()
        if row is None:
            return []
        state, *times = _values(row)
        ended = state if state in ENDED else None
        return [(name, at) for name, at in zip(("queued", "prefilling", "streaming", ended),
                                               times) if name is not None and at is not None]

    def fail_in_flight(self, states: tuple[str, ...], error: str, at: float,
                       owner: Optional[str] = None) -> int:
        where = _in_states(states)
        params: list = []
        if owner is not None:
            where, params = where + " AND owner = ?", [owner]
        return self._fail_where(where, params, error, at)

    def owner_seen(self, owner: str, at: float) -> None:
        with self._tx() as db:
            self._exec(db, "INSERT INTO run_owners VALUES (?, ?) ON CONFLICT (name) "
                       "DO UPDATE SET seen_at = excluded.seen_at", (owner, at))

    def fail_lapsed(self, states: tuple[str, ...], error: str, at: float, seen_before: float,
                    alive: str) -> int:
        return self._fail_where(f"{_in_states(states)} AND owner IN (SELECT name FROM "
                                "run_owners WHERE seen_at < ? AND name <> ?)",
                                [seen_before, alive], error, at)

    def _fail_where(self, where: str, params: list, error: str, at: float) -> int:
        """Every run matching `where` to failed with `error` at `at`; how many."""
        with self._tx() as db:
            # Events published for followers go with the run's end, as at a final row.
            self._exec(db, f"DELETE FROM run_events WHERE run_id IN (SELECT id FROM runs WHERE "
                       f"{where})", params)
            failed = [_first(row) for row in self._exec(
                db, f"UPDATE runs SET state = 'failed', error = ?, updated_at = ?, ended_at = ? "
                f"WHERE {where} RETURNING id", [error, at, at, *params]).fetchall()]
            self._touched(db, failed)
            return len(failed)

    def save_output(self, run_id: str, kind: str, body: bytes) -> None:
        with self._tx() as db:
            self._exec(db, "INSERT INTO run_outputs (run_id, kind, body, created_at) "
                       "SELECT ?, ?, ?, created_at FROM runs WHERE id = ? "
                       "ON CONFLICT (run_id) DO NOTHING", (run_id, kind, body, run_id))
            self._touched(db, [run_id])

    def mark_followed(self, run_id: str, at: float) -> None:
        with self._tx() as db:
            self._exec(db, "UPDATE runs SET followed_at = ? WHERE id = ?", (at, run_id))
            self._touched(db, [ASK_FOLLOW + run_id])  # its producer hears it at once

    def get_output(self, run_id: str) -> Optional[tuple[str, bytes]]:
        row = self._exec(self._db(), "SELECT kind, body FROM run_outputs WHERE run_id = ?",
                         (run_id,)).fetchone()
        if row is None:
            return None
        kind, body = _values(row)
        return (kind, bytes(body)) if kind != DELETED else None

    def get_opening(self, run_id: str) -> Optional[bytes]:
        row = self._exec(self._db(), "SELECT body FROM run_openings WHERE run_id = ?",
                         (run_id,)).fetchone()
        return bytes(_first(row)) if row is not None else None

    def get_conversation(self, run_id: str) -> Optional[bytes]:
        row = self._exec(self._db(), "SELECT conversation FROM run_outputs WHERE run_id = ?",
                         (run_id,)).fetchone()
        value = _first(row) if row is not None else None
        return bytes(value) if value is not None else None

    def delete_output(self, run_id: str, at: float) -> None:
        with self._tx() as db:
            self._exec(db, "DELETE FROM run_events WHERE run_id = ?", (run_id,))
            self._exec(db, "DELETE FROM run_openings WHERE run_id = ?", (run_id,))
            # A tombstone, not no row: a replica holding the output in memory asks for it
            # (output_deleted), and the owner's write of a final row that was still on its way
            # (ON CONFLICT DO NOTHING) cannot bring the output back.
            self._exec(db, "INSERT INTO run_outputs (run_id, kind, body, conversation, "
                       "created_at) VALUES (?, ?, ?, NULL, ?) ON CONFLICT (run_id) DO UPDATE "
                       "SET kind = excluded.kind, body = excluded.body, conversation = NULL",
                       (run_id, DELETED, b"", at))
            self._touched(db, [run_id])

    def output_deleted(self, run_id: str) -> bool:
        row = self._exec(self._db(), "SELECT kind FROM run_outputs WHERE run_id = ?",
                         (run_id,)).fetchone()
        return row is not None and _first(row) == DELETED

    def take(self, bucket: str, capacity: float, per_s: float, amount: float,
             now: float) -> float:
        with self._tx() as db:
            self._exec(db, "INSERT INTO rate_buckets VALUES (?, ?, ?) "
                       "ON CONFLICT (name) DO NOTHING", (bucket, capacity, now))
            level, stamp = _values(self._exec(
                db, "SELECT level, stamp FROM rate_buckets WHERE name = ? "
                "FOR UPDATE_IF_SUPPORTED", (bucket,)).fetchone())
            # Another replica's clock may be a little behind ours: never refill backwards.
            level = min(capacity, level + max(0.0, now - stamp) * per_s)
            wait = 0.0
            if amount > capacity:
                wait = float("inf")
            elif amount > level:
                wait = (amount - level) / per_s
            else:
                level -= amount
            self._exec(db, "UPDATE rate_buckets SET level = ?, stamp = ? WHERE name = ?",
                       (level, max(now, stamp), bucket))
            return wait

    def give_back(self, bucket: str, capacity: float, amount: float) -> None:
        with self._tx() as db:
            self._exec(db, "UPDATE rate_buckets SET level = MIN_OF(level + ?, ?) "
                       "WHERE name = ?", (amount, capacity, bucket))

    def usage_totals(self, tenant: str, since: float, until: float) -> dict:
        rows = _values(self._exec(
            self._db(), "SELECT COUNT(*), COALESCE(SUM(input_tokens), 0), "
            "COALESCE(SUM(cached_tokens), 0), COALESCE(SUM(output_tokens), 0), "
            "COALESCE(SUM(duration_s), 0) FROM usage WHERE tenant = ? AND finished_at >= ? "
            "AND finished_at < ?", (tenant, since, until)).fetchone())
        days = _values(self._exec(  # the connection anew: the first read may have replaced it
            self._db(), "SELECT COALESCE(SUM(runs), 0), COALESCE(SUM(input_tokens), 0), "
            "COALESCE(SUM(cached_tokens), 0), COALESCE(SUM(output_tokens), 0), "
            "COALESCE(SUM(duration_s), 0) FROM usage_days WHERE tenant = ? AND day >= ? "
            "AND day < ?", (tenant, since, until)).fetchone())
        runs, input_tokens, cached, output, duration = (a + b for a, b in zip(rows, days))
        return {"runs": int(runs), "input_tokens": int(input_tokens),
                "cached_tokens": int(cached), "output_tokens": int(output),
                "duration_s": float(duration)}

    def add_events(self, events: list[tuple[str, int, bytes]]) -> None:
        with self._tx() as db:
            self._add_events(db, events)
            self._touched(db, [run_id for run_id, _, _ in events])

    def _add_events(self, db, events) -> None:
        """Each event once, and none of a run no longer there (deleted or never written: its
        events would fail the whole round on the foreign key, every time it is sent)."""
        if events:
            db.cursor().executemany(self._sql(
                "INSERT INTO run_events SELECT ?, ?, ? WHERE EXISTS (SELECT 1 FROM runs WHERE "
                "id = ?) ON CONFLICT (run_id, seq) DO NOTHING"),
                [(run_id, seq, data, run_id) for run_id, seq, data in events])

    def events_after(self, run_id: str, after: int) -> list[bytes]:
        rows = self._exec(self._db(), "SELECT data FROM run_events WHERE run_id = ? AND "
                          "seq > ? ORDER BY seq", (run_id, after)).fetchall()
        return [bytes(_first(row)) for row in rows]

    def followed(self, owner: str, since: float) -> list[str]:
        rows = self._exec(self._db(), f"SELECT id FROM runs WHERE {_in_states(IN_FLIGHT)} AND "
                          "owner = ? AND followed_at >= ?", (owner, since)).fetchall()
        return [_first(row) for row in rows]

    def ask_cancel(self, run_id: str, at: float) -> bool:
        with self._tx() as db:
            asked = self._exec(db, f"UPDATE runs SET cancel_asked_at = ? WHERE id = ? AND "
                               f"{_in_states(IN_FLIGHT)}", (at, run_id)).rowcount > 0
            if asked:
                self._touched(db, [ASK_CANCEL + run_id])
            return asked

    def cancels_asked(self, owner: str) -> list[str]:
        rows = self._exec(self._db(), f"SELECT id FROM runs WHERE {_in_states(IN_FLIGHT)} AND "
                          "owner = ? AND cancel_asked_at IS NOT NULL", (owner,)).fetchall()
        return [_first(row) for row in rows]

    def delete_outputs(self, before: float, limit: int) -> int:
        with self._tx() as db:
            # Events published for a follower and left by a final row that was refused (few:
            # the table holds followed runs' only): outputs, in effect.
            self._exec(db, "DELETE FROM run_events WHERE run_id IN (SELECT e.run_id FROM "
                       "run_events e JOIN runs r ON r.id = e.run_id WHERE r.created_at < ? "
                       f"AND r.{_in_states(ENDED)})", (before,))
            return self._exec(db, "DELETE FROM run_outputs WHERE run_id IN (SELECT run_id FROM "
                              "run_outputs WHERE created_at < ? ORDER BY created_at LIMIT ?)",
                              (before, limit)).rowcount

    def delete_runs(self, before: float, limit: int) -> int:
        with self._tx() as db:
            ids = [_first(row) for row in self._exec(
                db, f"SELECT id FROM runs WHERE created_at < ? AND {_in_states(ENDED)} "
                "ORDER BY created_at LIMIT ?", (before, limit)).fetchall()]
            if not ids:
                return 0
            marks = ", ".join("?" for _ in ids)
            # A second process deleting the same runs finds their usage rows gone (its DELETE
            # waits for ours to commit): each row is added to its day once.
            used = self._exec(db, f"DELETE FROM usage WHERE run_id IN ({marks}) RETURNING "
                              "tenant, finished_at, input_tokens, cached_tokens, "
                              "output_tokens, duration_s", ids).fetchall()
            days: dict[tuple[str, float], list] = {}
            for tenant, finished_at, *counts in map(_values, used):
                totals = days.setdefault((tenant, finished_at // DAY_S * DAY_S),
                                         [0, 0, 0, 0, 0.0])
                for i, value in enumerate([1, *counts]):
                    totals[i] += value
            if days:
                db.cursor().executemany(self._sql(
                    "INSERT INTO usage_days VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT (tenant, "
                    "day) DO UPDATE SET runs = usage_days.runs + excluded.runs, input_tokens = "
                    "usage_days.input_tokens + excluded.input_tokens, cached_tokens = "
                    "usage_days.cached_tokens + excluded.cached_tokens, output_tokens = "
                    "usage_days.output_tokens + excluded.output_tokens, duration_s = "
                    "usage_days.duration_s + excluded.duration_s"),
                    [(*key, *totals) for key, totals in days.items()])
            self._exec(db, f"DELETE FROM run_outputs WHERE run_id IN ({marks})", ids)
            self._exec(db, f"DELETE FROM run_events WHERE run_id IN ({marks})", ids)
            self._exec(db, f"DELETE FROM run_openings WHERE run_id IN ({marks})", ids)
            return self._exec(db, f"DELETE FROM runs WHERE id IN ({marks})", ids).rowcount


def _in_states(states: tuple[str, ...]) -> str:
    """`state IN (...)` with the states as literals (they are the state machine's own names):
    the query then matches the partial index of runs in flight."""
    if not all(state.isidentifier() for state in states):
        raise ValueError(f"not state names: {states}")
    return "state IN (" + ", ".join(f"'{state}'" for state in states) + ")"


def _values(row) -> list:
    return list(row.values()) if isinstance(row, dict) else list(row)


def _first(row):
    return _values(row)[0]


def _first_line(exc: BaseException) -> str:
    """A driver error for a client: its type and first line (no URL, no password)."""
    return f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
