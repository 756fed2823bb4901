"""PostgreSQL as the run store: SqlRunStore's statements on psycopg 3, for router replicas on
several machines that share one database (the embedded SQLite file serves one machine).

Every transaction runs at READ COMMITTED; the rows a decision reads are locked (SELECT ... FOR
UPDATE) so that concurrent replicas serialize on the run or bucket they touch, not the database.
"""

from __future__ import annotations

import re
import threading
from contextlib import ExitStack, contextmanager
from functools import lru_cache
from typing import Iterator, Optional

import psycopg
from psycopg import errors
from psycopg.conninfo import conninfo_to_dict

from pd_runtime.gateway.stores import postgres_notify
from pd_runtime.gateway.stores.sql_store import SqlRunStore, _first_line
from pd_runtime.gateway.store import StoreUnavailable
from pd_runtime.gateway.wakeups import RECONNECT_POLL_S, Wakeups

# SQLSTATEs of a server that cannot answer now (a later try may succeed): connection
# exceptions, insufficient resources (disk full, too many connections), transaction rollbacks
# (deadlock, serialization), and: shutting down, crashed, starting up, a lock not available
# (lock_timeout), a statement cancelled (statement_timeout), a read-only server (a standby,
# or a primary in failover).
_NO_ANSWER_CLASSES = ("08", "53", "40")
_NO_ANSWER_STATES = ("57P01", "57P02", "57P03", "55P03", "57014", "25006")
# Any key no other application on the same database locks: "pd_runs" in ASCII.
_MIGRATION_LOCK_KEY = 0x70645F72756E73


class PostgresRunStore(SqlRunStore):
    """Opened by a libpq URL (`postgresql://user:pw@host:5432/db`, or a unix socket:
    `postgresql://user@/db?host=/run/postgresql`); applies the migrations it has not yet
    recorded. One connection per thread, in autocommit between transactions, so no reader
    holds a snapshot or a lock while idle."""

    def __init__(self, url: str, busy_timeout_s: float = 30.0, connect_timeout_s: float = 10.0):
        self._params = conninfo_to_dict(url)
        # Nothing waits forever: neither an unreachable host nor a row another session holds.
        self._params.setdefault("connect_timeout", max(1, int(connect_timeout_s)))
        self._lock_ms = int(busy_timeout_s * 1000)
        self._local = threading.local()
        self._all: list[psycopg.Connection] = []
        self._lock = threading.Lock()
        # Readers hear the server's NOTIFY of each commit on a connection of their own, opened
        # by the first watch (a store that is only written, the record writer's, opens none).
        self.wakeups = Wakeups(poll_s=RECONNECT_POLL_S, on_first_watch=self._listen)
        self._listener: Optional[postgres_notify.Listener] = None
        self.schema_version = self._migrate()

    def _listen(self) -> None:
        self._listener = postgres_notify.Listener(self._params, self.wakeups)
        self._listener.start()

    def _touched(self, db, run_ids) -> None:
        # NOTIFY in the writing transaction: heard by every process's listener if it commits.
        postgres_notify.notify(db, run_ids)

    def committed(self, run_ids) -> None:
        """Nothing: the server tells every listener, this process's included."""

    def close(self) -> None:
        if self._listener is not None:
            self._listener.stop()
        super().close()

    def _db(self) -> psycopg.Connection:
        db = getattr(self._local, "db", None)
        if db is None or db.closed:  # closed also when the server dropped it: reconnect
            db = None
            try:
                db = psycopg.connect(**self._params, autocommit=True, row_factory=_rows)
                # The locking here is reasoned at READ COMMITTED, whatever the server's default.
                db.isolation_level = psycopg.IsolationLevel.READ_COMMITTED
                db.execute(f"SET lock_timeout = {self._lock_ms}")
            except psycopg.Error as exc:
                if db is not None:
                    db.close()
                if self._unavailable(exc):
                    raise StoreUnavailable(_first_line(exc)) from exc
                raise
            self._local.db = db
            with self._lock:
                self._all.append(db)
        return db

    @contextmanager
    def _transaction(self) -> Iterator[psycopg.Connection]:
        for attempt in range(2):
            db = self._db()
            idle = db.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
            stack = ExitStack()
            try:
                # BEGIN (a savepoint inside a transaction); COMMIT, or ROLLBACK when the block
                # raises
                stack.enter_context(db.transaction())
                break
            except psycopg.OperationalError:
                if attempt or not idle or not db.closed:
                    raise
                # The server dropped the connection while it was idle (it restarted): BEGIN
                # did nothing, so once more on a new one.
        with stack:
            yield db

    def _exec(self, db, statement: str, params=()):
        idle = db.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
        try:
            return super()._exec(db, statement, params)
        except StoreUnavailable:
            if not idle or not db.closed:
                raise
            # A read on a connection the server dropped while it was idle: once more, anew.
            return super()._exec(self._db(), statement, params)

    def _unavailable(self, exc: BaseException) -> bool:
        """By SQLSTATE, not by class (OperationalError also holds errors that every retry
        meets again, such as a key too long for its index)."""
        if isinstance(exc, psycopg.InterfaceError):  # a connection already closed
            return True
        if not isinstance(exc, psycopg.Error):
            return False
        state = exc.sqlstate
        if state is None:  # no answer to carry one: connection refused, lost, timed out
            return isinstance(exc, psycopg.OperationalError)
        return state[:2] in _NO_ANSWER_CLASSES or state in _NO_ANSWER_STATES

    def _sql(self, statement: str) -> str:
        return _to_postgres(statement)

    def _migrate(self) -> int:
        # SqlRunStore creates its schema_migrations table before it first calls
        # _lock_migrations, and two sessions running CREATE TABLE IF NOT EXISTS at once can both
        # pass the check (the later one then fails on the catalog). So this session holds the
        # lock from before that statement to the end; the per-migration lock is reentrant.
        db = self._db()
        db.execute("SELECT pg_advisory_lock(%s)", (_MIGRATION_LOCK_KEY,))
        try:
            return super()._migrate()
        finally:
            if not db.closed:
                db.execute("SELECT pg_advisory_unlock(%s)", (_MIGRATION_LOCK_KEY,))

    def _lock_migrations(self, db) -> None:
        # Held until this migration's transaction ends: a second process waits, then finds
        # the version recorded and skips it.
        db.execute("SELECT pg_advisory_xact_lock(%s)", (_MIGRATION_LOCK_KEY,))

    def insert_run(self, run: dict) -> Optional[dict]:
        try:
            return super().insert_run(run)
        except errors.UniqueViolation:
            # At READ COMMITTED two retries with one key can both find no holder; the later
            # INSERT waits for the earlier one's commit and then fails here, so the holder is
            # committed and visible now.
            if run.get("idempotency_key") is None:
                raise
            held = self._exec(self._db(), "SELECT * FROM runs WHERE tenant = ? AND "
                              "idempotency_key = ?",
                              (run["tenant"], run["idempotency_key"])).fetchone()
            if held is None:
                raise
            return dict(held)



class _Row(tuple):
    """A row as sqlite3.Row gives it: a tuple, so "COUNT(*), COALESCE(..), COALESCE(..)" stays
    one value per column (a dict would keep a single "coalesce"), that also reads by column
    name, so `dict(row)` is the record."""

    def __new__(cls, names: tuple[str, ...], values) -> "_Row":
        row = super().__new__(cls, values)
        row.names = names
        return row

    def keys(self) -> tuple[str, ...]:
        return self.names

    def __getitem__(self, key):
        if isinstance(key, str):
            return tuple.__getitem__(self, self.names.index(key))
        return tuple.__getitem__(self, key)


def _rows(cursor):
    """psycopg's row factory protocol: given the cursor, a function from values to a row."""
    names = tuple(column.name for column in cursor.description or ())
    return lambda values: _Row(names, values)


@lru_cache(maxsize=256)
def _to_postgres(statement: str) -> str:
    """SqlRunStore's portable SQL in PostgreSQL's dialect."""
    # psycopg reads % as the start of a placeholder: a literal one is written %%.
    statement = statement.replace("%", "%%").replace("?", "%s")
    statement = statement.replace(" FOR UPDATE_IF_SUPPORTED", " FOR UPDATE")
    statement = statement.replace("MIN_OF(", "LEAST(")
    if statement.lstrip().upper().startswith(("CREATE", "ALTER")):
        # SQLite's REAL is 8 bytes, PostgreSQL's 4: epoch seconds would be rounded to 128 s.
        statement = re.sub(r"\bREAL\b", "DOUBLE PRECISION", statement)
        statement = re.sub(r"\bBLOB\b", "BYTEA", statement)
    return statement
