"""The router's run record writer: each run's changes gathered in memory and, every
`linger_s`, one round of them sent over a pipe to a child process that records it in one
transaction (gateway/record_process.py). Nothing here waits on the store.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import pickle
import threading
import time
from typing import TYPE_CHECKING, Optional

from gateway import record_process
from gateway.runs import RunChange

if TYPE_CHECKING:
    from router.run_records import LiveRun

log = logging.getLogger(__name__)

# How long the record writer lets a run's changes gather before it writes them.
LINGER_S = 0.05


class RunWriter:
    """Record writes off the token path: a run's changes are gathered and written together, all
    runs' of a round in one transaction, at most `linger_s` after they happen, so a short run's
    creation, transitions, output and usage cost one round of statements instead of five
    commits; the writing is done by a child process (gateway/record_process.py). A change
    that cannot be recorded is logged and counted, not fatal."""

    def __init__(self, store_url: Optional[str], linger_s: float = LINGER_S):
        self.store_url = store_url
        self.linger_s = linger_s
        self.failures = 0
        self._pending: dict[str, RunChange] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._idle = threading.Condition(self._lock)
        self._writing = False
        self._closing = False
        self._process = None
        self._conn = None
        self._start_process()  # now, at start-up: not in the middle of serving
        self._thread = threading.Thread(target=self._loop, name="run-writer", daemon=True)
        self._thread.start()

    def _start_process(self) -> None:
        context = multiprocessing.get_context("spawn")
        ours, theirs = context.Pipe()
        self._process = context.Process(target=record_process.serve, name="pd-run-records",
                                        args=(theirs, self.store_url), daemon=True)
        self._process.start()
        theirs.close()
        self._conn = ours

    def _stop_process(self, timeout_s: float = 10.0) -> None:
        conn, process, self._conn, self._process = self._conn, self._process, None, None
        if conn is not None:
            try:
                conn.send_bytes(b"")  # finish: the process closes its store and exits
            except OSError:
                pass
            conn.close()
        if process is not None:
            process.join(timeout_s)
            if process.is_alive():
                process.kill()
                process.join()

    def _change(self, live: "LiveRun") -> RunChange:
        """The run's pending change, to add to under the lock: the writer takes the whole dict
        under it (a swap), so an addition lands in this round or the next, never in neither."""
        change = self._pending.get(live.id)
        if change is None:
            if not self._pending:
                self._wake.set()  # the round's first change: start the linger
            change = self._pending[live.id] = RunChange(live.id, live.tenant, live.created_at)
        return change

    def create(self, live: "LiveRun", row: dict) -> None:
        with self._lock:
            self._change(live).created = row

    def step(self, live: "LiveRun", state: str, fields: dict) -> None:
        with self._lock:
            self._change(live).steps.append((state, time.time(), fields))

    def output(self, live: "LiveRun", kind: str, body: bytes) -> None:
        with self._lock:
            self._change(live).output = (kind, body)

    def _loop(self) -> None:
        while True:
            self._wake.wait()
            if not self._closing and self.linger_s > 0:
                time.sleep(self.linger_s)  # let the runs' next changes join this round
            with self._lock:
                changes, self._pending = list(self._pending.values()), {}
                self._wake.clear()
                self._writing = True
                closing = self._closing
            try:
                if changes:
                    for problem in self._record(changes):
                        self.failures += 1
                        log.warning("run record: %s", problem)
            except Exception:
                self.failures += len(changes)
                log.exception("run records: a round of %d runs failed", len(changes))
            finally:
                with self._lock:
                    self._writing = False
                    self._idle.notify_all()
            if closing and not self._pending:
                return

    def _record(self, changes: list[RunChange]) -> list[str]:
        if self._conn is None:
            self._start_process()
        try:
            self._conn.send_bytes(pickle.dumps(changes, protocol=pickle.HIGHEST_PROTOCOL))
            return pickle.loads(self._conn.recv_bytes())
        except (EOFError, OSError):
            self._stop_process(timeout_s=1.0)  # it died: the next round starts a new one
            raise

    def process_cpu_s(self) -> float:
        """CPU seconds the writer process has used (Linux; 0 before its first round)."""
        process = self._process
        try:
            fields = open(f"/proc/{process.pid}/stat").read().rsplit(")", 1)[1].split()
        except (AttributeError, OSError):
            return 0.0
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def flush(self, timeout_s: float = 30.0) -> None:
        """Wait until every change made so far is written."""
        self._wake.set()
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while self._pending or self._writing:
                self._wake.set()
                if not self._idle.wait(max(0.0, deadline - time.monotonic())):
                    break

    def close(self, timeout_s: float = 10.0) -> None:
        with self._lock:
            self._closing = True
        self._wake.set()
        self._thread.join(timeout_s)
        self._stop_process(timeout_s)
