"""Where run records live: one small interface (`RunStore`, the operations gateway/runs.py
needs, each one transaction) and the embedded default, SQLite in WAL mode in a file under the
user's data directory (no setup).

SQLite serializes writers; `busy_timeout` makes a writer wait its turn instead of failing, so
several threads (or processes on one machine) may share a file. Every method opens no
transaction the caller must close: each is atomic on its own.
"""

from __future__ import annotations

import os
import sqlite3
import threading
import time
from pathlib import Path
from typing import Optional, Protocol

from gateway.migrations import MIGRATIONS

RUN_FIELDS = ("id", "tenant", "state", "created_at", "updated_at", "idempotency_key",
              "body_hash", "path", "route_reason", "prompt_tokens", "cached_tokens",
              "output_tokens", "workers", "error")
UPDATABLE = set(RUN_FIELDS) - {"id", "tenant", "created_at", "idempotency_key", "body_hash"}


class RunStore(Protocol):
    def insert_run(self, run: dict) -> Optional[dict]:
        """Add the run; when (tenant, idempotency_key) is taken, add nothing and return the
        run that holds it."""

    def get_run(self, run_id: str) -> Optional[dict]: ...

    def transition(self, run_id: str, expect: tuple[str, ...], state: str, at: float,
                   fields: dict, usage: Optional[dict] = None) -> Optional[str]:
        """Move the run to `state` if it is in one of `expect` (with `fields` and, for a
        completion, its usage row, at most one per run); returns the state it was in, or None
        when it was not in `expect` (nothing changed)."""

    def transitions(self, run_id: str) -> list[tuple[str, float]]: ...

    def fail_in_flight(self, states: tuple[str, ...], error: str, at: float) -> int:
        """Every run in one of `states` to failed; how many."""

    def usage_totals(self, tenant: str, since: float, until: float) -> dict: ...

    def close(self) -> None: ...


def default_path() -> Path:
    """$PD_RUNTIME_DATA_DIR, else $XDG_DATA_HOME/pd-runtime, else ~/.local/share/pd-runtime."""
    base = os.environ.get("PD_RUNTIME_DATA_DIR")
    if base:
        return Path(base) / "runs.sqlite3"
    data = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local",
                                                           "share")
    return Path(data) / "pd-runtime" / "runs.sqlite3"


class SqliteRunStore:
    def __init__(self, path: str | os.PathLike | None = None, busy_timeout_s: float = 30.0):
        self.path = Path(path) if path is not None else default_path()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # One connection per thread (sqlite3 connections are not shared across threads).
        self._local = threading.local()
        self._busy_ms = int(busy_timeout_s * 1000)
        self._all: list[sqlite3.Connection] = []
        self._lock = threading.Lock()
        self.schema_version = self._migrate()

    def _db(self) -> sqlite3.Connection:
        db = getattr(self._local, "db", None)
        if db is None:
            db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
            db.row_factory = sqlite3.Row
            db.execute(f"PRAGMA busy_timeout = {self._busy_ms}")
            db.execute("PRAGMA journal_mode = WAL")
            db.execute("PRAGMA synchronous = NORMAL")
            db.execute("PRAGMA foreign_keys = ON")
            self._local.db = db
            with self._lock:
                self._all.append(db)
        return db

    def _tx(self):
        return _Transaction(self._db())

    def _migrate(self) -> int:
        with self._tx() as db:
            db.execute("CREATE TABLE IF NOT EXISTS schema_migrations (version INTEGER PRIMARY "
                       "KEY, name TEXT NOT NULL, applied_at REAL NOT NULL)")
        applied = {row[0] for row in self._db().execute("SELECT version FROM schema_migrations")}
        for version, name, statements in MIGRATIONS:
            if version in applied:
                continue
            with self._tx() as db:
                # Another process may have applied it meanwhile: the insert is the claim.
                if db.execute("SELECT 1 FROM schema_migrations WHERE version = ?",
                              (version,)).fetchone():
                    continue
                for statement in statements:
                    db.execute(statement)
                db.execute("INSERT INTO schema_migrations VALUES (?, ?, ?)",
                           (version, name, time.time()))
        return max(version for version, _, _ in MIGRATIONS)

    # -- RunStore ----------------------------------------------------------------------------
    def insert_run(self, run: dict) -> Optional[dict]:
        columns = [f for f in RUN_FIELDS if f in run]
        with self._tx() as db:
            if run.get("idempotency_key") is not None:
                held = db.execute("SELECT * FROM runs WHERE tenant = ? AND idempotency_key = ?",
                                  (run["tenant"], run["idempotency_key"])).fetchone()
                if held is not None:
                    return dict(held)
            db.execute(f"INSERT INTO runs ({', '.join(columns)}) VALUES "
                       f"({', '.join('?' for _ in columns)})", [run[c] for c in columns])
            db.execute("INSERT INTO run_transitions VALUES (?, ?, ?)",
                       (run["id"], run["state"], run["created_at"]))
        return None

    def get_run(self, run_id: str) -> Optional[dict]:
        row = self._db().execute("SELECT * FROM runs WHERE id = ?", (run_id,)).fetchone()
        return dict(row) if row is not None else None

    def transition(self, run_id: str, expect: tuple[str, ...], state: str, at: float,
                   fields: dict, usage: Optional[dict] = None) -> Optional[str]:
        bad = set(fields) - UPDATABLE
        if bad:
            raise ValueError(f"run fields {sorted(bad)} cannot be updated")
        with self._tx() as db:
            row = db.execute("SELECT state FROM runs WHERE id = ?", (run_id,)).fetchone()
            if row is None:
                raise KeyError(run_id)
            if row[0] not in expect:
                return None
            sets = {**fields, "state": state, "updated_at": at}
            db.execute(f"UPDATE runs SET {', '.join(f'{k} = ?' for k in sets)} WHERE id = ?",
                       [*sets.values(), run_id])
            db.execute("INSERT INTO run_transitions VALUES (?, ?, ?)", (run_id, state, at))
            if usage is not None:  # the primary key makes a second row impossible
                db.execute("INSERT INTO usage VALUES (?, ?, ?, ?, ?, ?, ?) "
                           "ON CONFLICT (run_id) DO NOTHING",
                           (run_id, usage["tenant"], usage["input_tokens"],
                            usage["cached_tokens"], usage["output_tokens"],
                            usage["duration_s"], at))
            return row[0]

    def transitions(self, run_id: str) -> list[tuple[str, float]]:
        return [(r[0], r[1]) for r in self._db().execute(
            "SELECT state, at FROM run_transitions WHERE run_id = ? ORDER BY rowid", (run_id,))]

    def fail_in_flight(self, states: tuple[str, ...], error: str, at: float) -> int:
        marks = ", ".join("?" for _ in states)
        with self._tx() as db:
            ids = [r[0] for r in db.execute(f"SELECT id FROM runs WHERE state IN ({marks})",
                                            states)]
            for run_id in ids:
                db.execute("UPDATE runs SET state = 'failed', error = ?, updated_at = ? "
                           "WHERE id = ?", (error, at, run_id))
                db.execute("INSERT INTO run_transitions VALUES (?, 'failed', ?)", (run_id, at))
        return len(ids)

    def usage_totals(self, tenant: str, since: float, until: float) -> dict:
        row = self._db().execute(
            "SELECT COUNT(*), COALESCE(SUM(input_tokens), 0), COALESCE(SUM(cached_tokens), 0), "
            "COALESCE(SUM(output_tokens), 0), COALESCE(SUM(duration_s), 0) FROM usage "
            "WHERE tenant = ? AND finished_at >= ? AND finished_at < ?",
            (tenant, since, until)).fetchone()
        return {"runs": row[0], "input_tokens": row[1], "cached_tokens": row[2],
                "output_tokens": row[3], "duration_s": row[4]}

    def close(self) -> None:
        with self._lock:
            for db in self._all:
                db.close()
            self._all.clear()
        self._local = threading.local()


class _Transaction:
    """BEGIN IMMEDIATE (the write lock taken up front: no upgrade deadlock), COMMIT or ROLLBACK."""

    def __init__(self, db: sqlite3.Connection):
        self.db = db

    def __enter__(self) -> sqlite3.Connection:
        self.db.execute("BEGIN IMMEDIATE")
        return self.db

    def __exit__(self, kind, exc, tb) -> None:
        self.db.execute("COMMIT" if kind is None else "ROLLBACK")
