"""Which run store a URL names: the registry of stores, by scheme, so config carries one string
(`sqlite:///path`, a bare path, or `postgresql://...`) and nothing else picks a class."""

from __future__ import annotations

from typing import Optional
from urllib.parse import unquote, urlsplit

from pd_runtime.gateway.stores.sqlite import SqliteRunStore
from pd_runtime.gateway.store import RunStore

POSTGRES_SCHEMES = ("postgresql", "postgres")  # libpq accepts both


def open_store(url: Optional[str]) -> RunStore:
    """None: the SQLite file under the user's data directory. `sqlite:///abs/path` (a file
    URL: three slashes before an absolute path) or a bare path: that SQLite file.
    `postgresql://` / `postgres://` (libpq's URL, unix sockets by `?host=/dir`): PostgreSQL."""
    if url is None:
        return SqliteRunStore()
    if "://" not in url:
        return SqliteRunStore(url)
    scheme = url.split("://", 1)[0].lower()
    if scheme == "sqlite":
        parts = urlsplit(url)
        if parts.netloc or not parts.path:
            raise ValueError("a sqlite run store URL names a file: sqlite:///path/to/runs.sqlite3"
                             " (or give the bare path)")
        return SqliteRunStore(unquote(parts.path))
    if scheme in POSTGRES_SCHEMES:
        # Imported here: psycopg loads libpq, which the embedded default never needs.
        from pd_runtime.gateway.stores.postgres import PostgresRunStore
        return PostgresRunStore(url)
    # The scheme only: the rest of a URL may hold a password.
    raise ValueError(f"unknown run store scheme {scheme!r}: use sqlite:///path, a bare path, "
                     "or postgresql://user@host/db")
