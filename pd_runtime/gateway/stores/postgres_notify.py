"""PostgreSQL's side of waking run-record readers (pd_runtime/gateway/wakeups.py): a writing
transaction NOTIFYs the run ids it wrote (delivered only if it commits), and one LISTEN
connection per store, on a thread of its own, hands what it hears to the store's `Wakeups`.

The listener's connection is the one thing the readers rely on: while it is down (not yet
connected, or lost with the server) they read every RECONNECT_POLL_S, and every watch reads
again when it is back, since what was sent meanwhile went unheard.
"""

from __future__ import annotations

import logging
import threading
from typing import Iterable

import psycopg

from pd_runtime.gateway.wakeups import RECONNECT_POLL_S, Wakeups, id_payloads

log = logging.getLogger(__name__)

CHANNEL = "pd_runs"
# Run ids per NOTIFY joined by newlines, under the server's 8000-byte limit on a payload.
PAYLOAD_MAX_BYTES = 7000
# How often the listening thread looks up from its connection (to stop when the store closes).
LOOK_UP_S = 0.25
RECONNECT_MAX_S = 5.0


def notify(db, run_ids: Iterable[str]) -> None:
    """Inside the writing transaction: its listeners hear `run_ids` when (and if) it commits."""
    for payload in id_payloads(run_ids, PAYLOAD_MAX_BYTES):
        db.execute("SELECT pg_notify(%s, %s)", (CHANNEL, payload))


class Listener:
    """LISTENs on CHANNEL for one store (`params`: its connection's), started by the store's
    first watch; reconnects with a back-off when the connection is lost."""

    def __init__(self, params: dict, wakeups: Wakeups):
        self.params = params
        self.wakeups = wakeups
        # Times its connection has come up listening (1 + reconnects), counted once the
        # readers have been told: a change of it is a loss the readers have heard of.
        self.num_listens = 0
        self._up = False  # the store's readers start polling (Wakeups.poll_s)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="run-store-listen", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 2 * LOOK_UP_S) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    def _run(self) -> None:
        backoff_s = 0.1
        while not self._stop.is_set():
            try:
                with psycopg.connect(**self.params, autocommit=True) as db:
                    db.execute(f"LISTEN {CHANNEL}")
                    self._listening(True)
                    self.num_listens += 1
                    backoff_s = 0.1
                    while not self._stop.is_set():
                        for note in db.notifies(timeout=LOOK_UP_S):
                            self.wakeups.notify(note.payload.split("\n"))
            except psycopg.Error as exc:
                if not self._stop.is_set():
                    log.warning("run store: listening for run writes failed (%s); readers poll "
                                "every %g s until it is back", type(exc).__name__,
                                RECONNECT_POLL_S)
            self._listening(False)
            self._stop.wait(backoff_s)
            backoff_s = min(RECONNECT_MAX_S, backoff_s * 2)

    def _listening(self, up: bool) -> None:
        """Poll while down; either way every watch reads again (writes may have gone
        unheard while it changed). A failed reconnect changes nothing: they already poll."""
        if up == self._up:
            return
        self._up = up
        self.wakeups.poll_s = None if up else RECONNECT_POLL_S
        self.wakeups.notify_all()
