"""The embedded run store: SQLite in WAL mode in a file under the user's data directory (no
setup), for the router replicas of one machine.

SQLite serializes writers; `busy_timeout` makes a writer wait its turn instead of failing, so
several threads (or processes on one machine) may share a file.
"""

from __future__ import annotations

import os
import sqlite3
import threading
from pathlib import Path

from pd_runtime.gateway.stores import sqlite_notify
from pd_runtime.gateway.stores.sql_store import SqlRunStore


def default_path() -> Path:
    """$PD_RUNTIME_DATA_DIR, else $XDG_DATA_HOME/pd-runtime, else ~/.local/share/pd-runtime."""
    base = os.environ.get("PD_RUNTIME_DATA_DIR")
    if base:
        return Path(base) / "runs.sqlite3"
    data = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local",
                                                           "share")
    return Path(data) / "pd-runtime" / "runs.sqlite3"


class SqliteRunStore(SqlRunStore):
    def __init__(self, path: str | os.PathLike | None = None, busy_timeout_s: float = 30.0):
        self.path = Path(path) if path is not None else default_path()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # One connection per thread (sqlite3 connections are not shared across threads).
        self._local = threading.local()
        self._busy_ms = int(busy_timeout_s * 1000)
        self._all: list[sqlite3.Connection] = []
        self._lock = threading.Lock()
        # Readers of the file in this process, and the other processes' told of our commits
        # (pd_runtime/gateway/stores/sqlite_notify.py): one of each per file in a process, shared by
        # every store opened on it (router replicas of one process, the router's store and its
        # record writer's notice of a round).
        self.bell = sqlite_notify.bell_of(self.path)
        self.wakeups = self.bell.wakeups
        self._bell_held = True
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

    def _after_commit(self, run_ids) -> None:
        super()._after_commit(run_ids)
        self.bell.ring(run_ids)

    def close(self) -> None:
        if self._bell_held:  # a store used after close() rings no other process
            self._bell_held = False
            sqlite_notify.release(self.bell)
        super().close()

    def _transaction(self):
        return _Transaction(self._db())

    def _unavailable(self, exc: BaseException) -> bool:
        # sqlite3 reports wrong SQL as OperationalError too: only these mean no answer.
        return isinstance(exc, sqlite3.OperationalError) and str(exc).startswith(_NO_ANSWER)

    def cache_pages(self, pages: int) -> None:
        """A larger page cache for this thread's connection (the default is 2 MiB)."""
        self._db().execute(f"PRAGMA cache_size = {int(pages)}")

    def _sql(self, statement: str) -> str:
        # BEGIN IMMEDIATE already holds the database's one write lock: no row locks to take.
        return statement.replace(" FOR UPDATE_IF_SUPPORTED", "").replace("MIN_OF(", "MIN(")


_NO_ANSWER = ("database is locked", "database table is locked", "disk I/O error",
              "unable to open database file", "database or disk is full")


class _Transaction:
    """BEGIN IMMEDIATE (the write lock taken up front: no upgrade deadlock), COMMIT or ROLLBACK;
    inside a transaction already open (a batch), a savepoint, released or rolled back to."""

    def __init__(self, db: sqlite3.Connection):
        self.db = db
        self.nested = False

    def __enter__(self) -> sqlite3.Connection:
        self.nested = self.db.in_transaction
        self.db.execute("SAVEPOINT op" if self.nested else "BEGIN IMMEDIATE")
        return self.db

    def __exit__(self, kind, exc, tb) -> None:
        if not self.nested:
            self.db.execute("COMMIT" if kind is None else "ROLLBACK")
        elif kind is None:
            self.db.execute("RELEASE op")
        else:
            self.db.execute("ROLLBACK TO op")
            self.db.execute("RELEASE op")
