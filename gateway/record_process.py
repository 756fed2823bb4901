"""The child process that writes run records for the router (router/run_records.py RunWriter):
it opens the run store once and records each round of runs' changes it is sent.

A thread of the router's own would do the same work, but the sqlite3 module lets go of the
interpreter lock on every row it steps, and with the serving loop busy each handover waits: a
round of records then cost the router several times its own CPU (measured). Here it costs the
router one pickling of the round.
"""

from __future__ import annotations

from typing import Optional

_runs = None


def init(store_url: Optional[str]) -> None:
    global _runs
    from gateway.open import open_store
    from gateway.runs import Runs

    store = open_store(store_url)
    if hasattr(store, "cache_pages"):
        store.cache_pages(16384)  # index pages of a large store stay in memory
    _runs = Runs(store)


def record(changes: list) -> list[str]:
    """Runs.record of the round: what could not be recorded, one line each."""
    return _runs.record(changes)
