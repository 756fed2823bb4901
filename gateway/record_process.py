"""The child process that writes run records for the router (router/run_records.py RunWriter):
it opens the run store once, then records each round of runs' changes it is sent over its pipe
and answers with what could not be recorded.

A thread of the router's own would do the same work, but the sqlite3 module lets go of the
interpreter lock on every row it steps, and with the serving loop busy each handover waits: a
round of records then cost the router several times its own CPU (measured). Here it costs the
router one pickling of the round and one pipe round trip.
"""

from __future__ import annotations

import pickle
from typing import Optional


def serve(conn, store_url: Optional[str]) -> None:
    """Until the pipe closes or an empty message comes: a pickled list of runs' rows in
    (gateway/runs.py `record_item`), the pickled list of problems (one line each) out."""
    from gateway.open import open_store
    from gateway.runs import Runs

    store = open_store(store_url)
    if hasattr(store, "cache_pages"):
        store.cache_pages(16384)  # index pages of a large store stay in memory
    runs = Runs(store)
    try:
        while True:
            try:
                message = conn.recv_bytes()
            except (EOFError, OSError):  # the router is gone
                return
            if not message:
                return
            try:
                problems = runs.record_items(pickle.loads(message))
            except Exception as exc:  # the round failed as a whole: say so, keep serving
                problems = [f"the round of records failed: {type(exc).__name__}: {exc}"]
            conn.send_bytes(pickle.dumps(problems))
    finally:
        store.close()
