"""A PostgreSQL run store when its server does not answer: calls raise StoreUnavailable (the
router's 503) while it is down, the first read and the first write after a restart go through
on a new connection, and an error every retry meets again is not taken for an outage."""

from __future__ import annotations

import pytest

from pd_runtime.gateway.open import open_store
from pd_runtime.gateway.run_state import Runs


def test_a_postgres_store_answers_the_first_call_after_its_server_restarts():
    """A restart breaks every idle connection; the next read and the next write each find
    theirs dropped and go once more on a new one, instead of failing once per thread. While the
    server is down, calls raise StoreUnavailable (the router answers 503)."""
    from pd_runtime.gateway.store import StoreUnavailable
    from tests.postgres_server import running_server

    with running_server() as server:
        store = open_store(server.create_database())
        try:
            runs = Runs(store)
            run, _ = runs.create("acme")
            assert runs.get(run["id"])["state"] == "queued"
            server.pause()
            with pytest.raises(StoreUnavailable):
                runs.get(run["id"])
            with pytest.raises(StoreUnavailable):
                runs.create("acme")
            server.resume()
            assert runs.get(run["id"])["state"] == "queued"
            server.pause()
            server.resume()
            runs.advance(run["id"], "prefilling")  # a write first: BEGIN on a new connection
            server.pause()
            server.resume()
            assert runs.get(run["id"])["state"] == "prefilling"  # a read first
        finally:
            store.close()


def test_a_postgres_error_every_retry_meets_is_not_taken_for_an_outage(postgres_server):
    """Errors are told apart by SQLSTATE: a key too long for its index is an OperationalError
    too, but no later try succeeds (the router answers 500, not 503 with Retry-After)."""
    import secrets

    import psycopg

    store = open_store(postgres_server.create_database())
    try:
        with pytest.raises(psycopg.errors.ProgramLimitExceeded):  # raised as it is
            Runs(store).create("acme", {"a": 1}, idempotency_key=secrets.token_hex(4000))
        with pytest.raises(psycopg.errors.UndefinedTable):
            store._exec(store._db(), "SELECT * FROM no_such_table")
        assert store._unavailable(psycopg.errors.lookup("55P03")("lock timeout"))
        assert store._unavailable(psycopg.errors.lookup("25006")("read-only transaction"))
        assert not store._unavailable(psycopg.errors.lookup("54000")("too long"))
    finally:
        store.close()
