"""The child process that writes run records for the router (pd_runtime/gateway/record_writer.py
RunWriter): it opens the run store once, then records each round of runs' changes it is sent over
its pipe and answers with what could not be recorded; between rounds it keeps the replica's lease
alive and deletes what is past its keep (pd_runtime/gateway/retention.py).

A thread of the router's own would do the same work, but the sqlite3 module lets go of the
interpreter lock on every row it steps, and with the serving loop busy each handover waits: a
round of records then cost the router several times its own CPU (measured). Here it costs the
router one pickling of the round and one pipe round trip.
"""

from __future__ import annotations

import logging
import pickle
import signal
import time
from typing import Optional

log = logging.getLogger(__name__)


# A run counts as followed from another replica when a follower marked it this recently (they
# mark it every second: pd_runtime/gateway/recorder.py FOLLOW_MARK_S); generous, as the mark is
# the follower's clock and the look-up this one's.
FOLLOWED_S = 30.0


def serve(conn, store_url: Optional[str], owner: Optional[str] = None,
          lease_s: float = 30.0, keep_outputs_s: Optional[float] = None,
          keep_runs_s: Optional[float] = None) -> None:
    """Until the pipe closes or an empty message comes: a round in, pickled (its runs' rows as
    pd_runtime/gateway/run_state.py `record_item` makes them, the new events of runs followed
    from other replicas, whether to say which runs are followed), and pickled out (the
    problems, one line each; this owner's runs in flight followed from elsewhere, and those
    whose cancel another replica asked for), or one string when nothing of the round could be
    written. With an `owner`, every lease_s / 3 between rounds: the owner is alive, and runs of
    replicas not seen for `lease_s` are failed (a replica that stopped for good leaves none in
    flight). Outputs and runs past `keep_outputs_s` / `keep_runs_s` are deleted a batch at a
    time, a round that comes in meanwhile served first."""
    from pd_runtime.gateway.open import open_store
    from pd_runtime.gateway.retention import Retention
    from pd_runtime.gateway.run_state import Runs

    # Ctrl-C reaches the terminal's whole process group: the router drains, sends its last
    # round, then closes the pipe, which ends this process. (SIGTERM still ends it at once: a
    # process that outlived its router would hold multiprocessing's exit join.)
    signal.signal(signal.SIGINT, signal.SIG_IGN)

    store = open_store(store_url)
    if hasattr(store, "cache_pages"):
        store.cache_pages(16384)  # index pages of a large store stay in memory
    runs = Runs(store)
    retention = Retention(store, keep_outputs_s, keep_runs_s)
    beat_s = lease_s / 3
    next_beat = 0.0 if owner is not None else None
    # Since when this replica's own beats have reached the store (None: the last one did not).
    # After a failed beat it judges no other replica until it has been seen for a whole lease
    # itself: the others could not renew theirs through the same outage.
    seen_since: Optional[float] = float("-inf")
    next_trim = 0.0 if retention.interval_s is not None else None
    try:
        while True:
            if next_beat is not None and time.monotonic() >= next_beat:
                next_beat = time.monotonic() + beat_s
                try:
                    judge = seen_since is not None and time.monotonic() - seen_since >= lease_s
                    lapsed = runs.keep_alive(owner, lease_s, judge=judge)
                    if seen_since is None:
                        seen_since = time.monotonic()
                    if lapsed:
                        log.warning("%d runs of router replicas not seen for %g s marked "
                                    "failed", lapsed, lease_s)
                except Exception:
                    seen_since = None
                    log.exception("run records: the replica's lease could not be renewed")
            if next_trim is not None and time.monotonic() >= next_trim:
                began = time.monotonic()
                try:
                    more = retention.step()
                except Exception:
                    log.exception("run store: deleting runs past their keep failed; trying "
                                  "again in %g s", retention.interval_s)
                    more = False
                # Between batches, the store's write lock free as long as a batch held it:
                # another process's writer (an Idempotency-Key claim) waiting in SQLite's
                # busy back-off finds it free when it looks (measured: claims waited up to
                # 0.6 s during a long pass without the pause).
                took = time.monotonic() - began
                next_trim = time.monotonic() + (max(0.005, took) if more
                                                 else retention.interval_s)
            wakes = [t for t in (next_beat, next_trim) if t is not None]
            try:
                if wakes and not conn.poll(max(0.0, min(wakes) - time.monotonic())):
                    continue
                message = conn.recv_bytes()
            except (EOFError, OSError):  # the router is gone
                return
            if not message:
                return
            try:
                items, events, ask_followed = pickle.loads(message)
                problems = runs.record_items(items, events)
            except Exception as exc:  # nothing of the round was written: say so (a str), so
                # the router sends it again with the next one; keep serving
                answer = f"the round of records failed: {type(exc).__name__}: {exc}"
            else:
                # None: not asked, or the look-up failed (the round stands)
                followed = cancels = None
                if ask_followed and owner is not None:
                    try:
                        followed = store.followed(owner, time.time() - FOLLOWED_S)
                        cancels = store.cancels_asked(owner)
                    except Exception as exc:
                        log.warning("run records: which runs are followed: %s", exc)
                answer = (problems, followed, cancels)
            conn.send_bytes(pickle.dumps(answer))
    finally:
        store.close()
