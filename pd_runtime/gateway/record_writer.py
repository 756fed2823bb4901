"""The router's run record writer: a thread that, every `linger_s` while runs come and go, reads
the runs this process is producing (pd_runtime/gateway/live_run.py LiveRun) and sends the rows that
changed over a pipe to a child process that writes them in one transaction
(pd_runtime/gateway/record_process.py). Nothing here waits on the store, and the serving loop does not
call in per transition: it hands a run over when it begins and when it ends (a list append
each), and the thread reads the run's state and times itself.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import pickle
import threading
import time
from typing import TYPE_CHECKING, Callable, Optional

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from pd_runtime.cpu_time import cpu_s, read_stat
from pd_runtime.gateway import record_process
from pd_runtime.gateway.run_state import IN_FLIGHT, record_item
from pd_runtime.gateway.store import ENDED, RUN_FIELDS
from pd_runtime.gateway.wakeups import ASK_CANCEL

if TYPE_CHECKING:
    from pd_runtime.gateway.live_run import LiveRun

log = logging.getLogger(__name__)

# How long the record writer lets runs' changes gather before it writes them.
LINGER_S = 0.05
_COLUMNS = frozenset(RUN_FIELDS)
# While the store cannot be written, ended runs' final rows wait in memory, bounded: past
# WAITING_OUTPUT_BYTES the oldest waiting outputs are let go (their runs are still recorded; a
# retry of one is told its output is not kept), past WAITING_RUNS the oldest rows too (their
# usage is lost: counted and logged). A backlog is written ROUND_MAX rows a round.
WAITING_RUNS = 100_000
WAITING_OUTPUT_BYTES = 64 << 20
ROUND_MAX = 5_000
BACKOFF_MAX_S = 5.0  # after failed rounds, the next waits longer, up to this
# While runs are open, which of them are followed from elsewhere or asked to cancel: looked up
# when such an ask is heard (`asked`), and every ASK_SAFETY_S for one that was not (its process
# could not tell this one), every `ask_poll_s()` where asks are not heard at all.
ASK_SAFETY_S = 1.0


class RunWriter:
    """Record writes off the token path, all runs' of a round in one transaction: a run that
    begins and ends within a round is one row (its state, times, routing and token counts)
    and its usage row; one still going at a round's end is written in flight (what start-up
    recovery finds after a crash) and again whenever its state has moved. A round that cannot
    be recorded is logged and counted, not fatal: its ended runs' rows wait for the next
    (bounded), its runs in flight are read again."""

    def __init__(self, store_url: Optional[str], owner: Optional[str] = None,
                 linger_s: float = LINGER_S, owner_lease_s: float = 30.0,
                 keep_outputs_s: Optional[float] = None, keep_runs_s: Optional[float] = None):
        """`owner`: this replica's name on its runs, kept alive in the store every
        owner_lease_s / 3 by the writer process, which also deletes outputs and runs past
        their keep (None: kept for good)."""
        self.store_url = store_url
        self.owner = owner
        self.owner_lease_s = owner_lease_s
        self.keeps = (keep_outputs_s, keep_runs_s)
        self.linger_s = linger_s
        self.failures = 0  # rounds (or rows of one) that could not be written
        self.outputs_dropped = 0  # waiting outputs let go while the store failed
        self.runs_dropped = 0  # waiting rows let go: runs never recorded
        self._waiting: list[dict] = []  # the writer thread's: ended runs' rows not yet written
        # Open runs a client of another replica has followed (the process says which, when
        # asked), and how many of their events are in the store for it.
        self._followed: set[str] = set()
        self._published: dict[str, int] = {}
        self._next_ask = 0.0
        # An ask of one of this writer's open runs was heard: the next round looks asks up,
        # and it cuts that round's linger short.
        self._ask_heard = threading.Event()
        # How often to look asks up unheard: the store's readers' poll (None: every ask is
        # heard), set by the owner of the store that hears them.
        self.ask_poll_s: Callable[[], Optional[float]] = lambda: None
        # Called (on the writer thread) with an open run whose cancel another replica asked
        # for, at each look-up until it ends.
        self.on_cancel_asked: Optional[Callable[["LiveRun"], None]] = None
        # Called (on the writer thread) with the ids of the runs a round wrote, once it has
        # committed: their readers in this process wake (RunStore.committed). With SQLite the
        # writer process rings this one as well (pd_runtime/gateway/stores/sqlite_notify.py): this
        # still wakes them where this process cannot listen for it.
        self.on_recorded: Optional[Callable[[list[str]], None]] = None
        # Filled by the serving loop (an append is atomic), swapped out by the writer thread.
        self._begun: list["LiveRun"] = []
        self._ended: list["LiveRun"] = []
        self._open: dict[str, "LiveRun"] = {}  # the writer thread's: runs begun, not ended
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._rounds = threading.Condition(self._lock)
        self._started = self._done = 0  # rounds
        self._closing = False
        self._process = None
        self._conn = None
        self._start_process()  # now, at start-up: not in the middle of serving
        self._thread = threading.Thread(target=self._loop, name="run-writer", daemon=True)
        self._thread.start()

    @property
    def waiting(self) -> int:
        """Ended runs' rows not yet written (the store failed lately)."""
        return len(self._waiting)

    # -- the serving loop's side ---------------------------------------------------------------
    def begun(self, live: "LiveRun") -> None:
        self._begun.append(live)
        if len(self._begun) == 1:  # the first of a round: start the linger
            self._wake.set()

    def ended(self, live: "LiveRun") -> None:
        self._ended.append(live)
        if len(self._ended) == 1:
            self._wake.set()

    def asked(self, asks: list[str]) -> None:
        """Asks committed to the store (any thread; wakeups.py ASK_FOLLOW / ASK_CANCEL + run
        id): one of this writer's open runs followed anew or asked to cancel has the next round
        look them up."""
        for ask in asks:
            run_id = ask.partition(":")[2]
            if run_id in self._open and (ask.startswith(ASK_CANCEL)
                                         or run_id not in self._followed):
                self._ask_heard.set()
                self._wake.set()
                return

    # -- the writer thread ---------------------------------------------------------------------
    def _loop(self) -> None:
        failed = 0  # rounds in a row that could not be written: the next waits longer
        while True:
            if not self._open and not self._waiting:  # else a round every linger
                self._wake.wait()
            if not self._closing and self.linger_s > 0:
                # Let the runs' next changes join this round (an ask heard cuts it short);
                # after failures, give the store time rather than retrying it every round.
                if failed:
                    time.sleep(min(BACKOFF_MAX_S, self.linger_s * 2 ** min(failed, 30)))
                else:
                    self._ask_heard.wait(self.linger_s)
            with self._lock:
                self._wake.clear()  # before the swap: an append after it wakes the next round
                self._started += 1
                closing = self._closing
            begun, self._begun = self._begun, []
            ended, self._ended = self._ended, []
            waiting = self._waiting[:ROUND_MAX]
            items: Optional[list[tuple["LiveRun", Optional[str], dict]]] = None
            try:
                items = self._items(begun, ended)
                rows = waiting + [item for _, _, item in items]
                events, published = self._events()
                ask = bool(self._open) and (self._ask_heard.is_set()
                                            or time.monotonic() >= self._next_ask)
                if rows or events or ask:
                    if ask:  # cleared before the look-up: an ask heard after it is in the store
                        self._ask_heard.clear()
                        poll_s = self.ask_poll_s()
                        self._next_ask = time.monotonic() + (
                            ASK_SAFETY_S if poll_s is None else min(ASK_SAFETY_S, poll_s))
                    problems, followed, cancels = self._record(rows, events, ask)
                    if self.on_recorded is not None and (rows or events):
                        self.on_recorded([row["run_id"] for row in rows] +
                                         [run_id for run_id, _, _ in events])
                    for problem in problems:
                        self.failures += 1
                        log.warning("run record: %s", problem)
                    self._published.update(published)
                    if followed is not None:  # followed once: published until its end
                        self._followed.update(r for r in followed if r in self._open)
                    for run_id in cancels or ():
                        if run_id in self._open and self.on_cancel_asked is not None:
                            self.on_cancel_asked(self._open[run_id])
                del self._waiting[:len(waiting)]
                if self._waiting:
                    self._wake.set()  # the rest of a backlog: the next round
                failed = 0
            except Exception:
                # Nothing of the round was written: ended runs' rows wait for the next one (a
                # row is the run's whole state, so writing it later is writing it right); runs
                # in flight are read again then. Closing, one more round is tried (a writer
                # process killed with the router's own process group is started anew), not
                # more if the store was failing before.
                self.failures += 1
                if failed == 0 or failed % 20 == 0:
                    log.exception("run records: a round of %d runs failed (%d in a row); "
                                  "retrying it", len(waiting) + len(items or ended), failed + 1)
                failed += 1
                if items is None:  # it failed before its rows were made: make them again
                    self._ended[:0] = ended
                for live, before, item in items or ():
                    if item.get("opening") is not None and item["row"]["state"] not in ENDED:
                        live.opening_kept = False
                    if item["row"]["state"] in ENDED:
                        self._waiting.append(item)
                    else:
                        live.stored = before
                if closing and failed > 1:  # no next round to take them
                    log.error("run records: %d runs' last changes not recorded at shutdown",
                              len(self._waiting) + len(self._ended))
                    self._waiting.clear()
                    self._ended.clear()
                else:
                    self._bound_waiting()
                    self._wake.set()  # a next round, even if no run comes or goes
            finally:
                with self._lock:
                    self._done += 1
                    self._rounds.notify_all()
            if closing and not self._begun and not self._ended and not self._waiting:
                return

    def _bound_waiting(self) -> None:
        """Rows waiting for the store held to WAITING_RUNS and their outputs to
        WAITING_OUTPUT_BYTES, the oldest let go first."""
        extra = len(self._waiting) - WAITING_RUNS
        if extra > 0:
            del self._waiting[:extra]
            self.runs_dropped += extra
            log.error("run records: the store has not been written for a while; %d more runs "
                      "let go unrecorded (%d in all, their usage lost); %d wait", extra,
                      self.runs_dropped, len(self._waiting))
        size = sum(map(_output_bytes, self._waiting))
        for item in self._waiting:
            if size <= WAITING_OUTPUT_BYTES:
                break
            if item["output"]:
                size -= _output_bytes(item)
                item["output"] = item["conversation"] = None
                self.outputs_dropped += 1

    def _items(self, begun: list["LiveRun"], ended: list["LiveRun"]
               ) -> list[tuple["LiveRun", Optional[str], dict]]:
        """(run, the state its row had, its write) for the round."""
        for live in begun:
            # Its end may have come in the round before (the loop ran between the two swaps):
            # then its final row is written and it is not open.
            if live.stored not in ENDED:
                self._open[live.id] = live
        items = []
        for live in ended:
            self._open.pop(live.id, None)
            item = self._item(live, live.state, live.kept_output)
            self._followed.discard(live.id)
            if self._published.pop(live.id, None) is not None:
                item["drop_events"] = True
            items.append((live, live.stored, item))
        for live in self._open.values():
            # Read once: a run that reached its end (finish() is on its way: it sets the
            # state before the run is handed over as ended) is written by the ended round,
            # with its output, never here.
            state = live.state
            if state not in ENDED and state != live.stored:
                items.append((live, live.stored, self._item(live, state, None)))
        return items

    def _events(self) -> tuple[list[tuple[str, int, bytes]], dict[str, int]]:
        """The events of open runs followed from another replica that are not yet in the
        store, and how many each run will have there once they are."""
        events, published = [], {}
        for run_id in self._followed:
            live = self._open.get(run_id)
            if live is None or not live.stream:
                continue
            done, upto = self._published.get(run_id, 0), len(live.events)
            events += [(run_id, seq, live.events[seq]) for seq in range(done, upto)]
            published[run_id] = upto
        return events, published

    def _item(self, live: "LiveRun", state: str, output) -> dict:
        """The row of `live` in `state` (read before its fields, which may be newer, never
        older)."""
        row = {k: v for k, v in live.info.copy().items() if k in _COLUMNS}
        if isinstance(row.get("workers"), (list, tuple)):
            row["workers"] = json.dumps(list(row["workers"]))
        row["state"] = state
        row["updated_at"] = max(live.created_at, row.get("prefilling_at") or 0.0,
                                row.get("streaming_at") or 0.0, row.get("ended_at") or 0.0)
        insert = live.stored is None
        if insert:
            row.update(id=live.id, tenant=live.tenant, created_at=live.created_at,
                       owner=self.owner)
        live.stored = state
        item = record_item(live.id, live.tenant, live.created_at, row, insert, IN_FLIGHT,
                           output)
        item["conversation"] = live.conversation if output is not None else None
        if live.background and not live.opening_kept and live.events:
            # Its created event, read back should this process stop before the end (a round
            # that fails sets opening_kept back: the next one carries it).
            item["opening"], live.opening_kept = live.events[0], True
        return item

    # -- the writer process --------------------------------------------------------------------
    def _start_process(self) -> None:
        context = multiprocessing.get_context("spawn")
        ours, theirs = context.Pipe()
        self._process = context.Process(target=record_process.serve, name="pd-run-records",
                                        args=(theirs, self.store_url, self.owner,
                                              self.owner_lease_s, *self.keeps), daemon=True)
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

    def _record(self, items: list[dict], events: list = (), ask_followed: bool = False
                ) -> tuple[list[str], Optional[list[str]], Optional[list[str]]]:
        """(problems, runs followed from other replicas, runs whose cancel another replica
        asked for) of a round written by the process."""
        if self._conn is None:
            self._start_process()
        try:
            self._conn.send_bytes(pickle.dumps((items, list(events), ask_followed),
                                               protocol=pickle.HIGHEST_PROTOCOL))
            answer = pickle.loads(self._conn.recv_bytes())
        except (EOFError, OSError):
            self._stop_process(timeout_s=1.0)  # it died: the next round starts a new one
            raise
        if isinstance(answer, str):  # the round as a whole could not be written
            raise RuntimeError(answer)
        return answer

    def process_cpu_s(self) -> float:
        """CPU seconds the writer process has used (Linux; 0 before its first round)."""
        process = self._process
        fields = read_stat(f"/proc/{process.pid}/stat") if process is not None else None
        return cpu_s(fields) if fields is not None else 0.0

    def flush(self, timeout_s: float = 30.0) -> None:
        """Wait until everything the runs did so far is written: a round that starts after
        this call has done."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            target = self._started + 1
            while self._done < target and self._thread.is_alive():
                self._wake.set()
                if not self._rounds.wait(max(0.0, min(0.5, deadline - time.monotonic()))) \
                        and time.monotonic() >= deadline:
                    break

    def close(self, timeout_s: float = 10.0) -> None:
        with self._lock:
            self._closing = True
        self._wake.set()
        self._thread.join(timeout_s)
        self._stop_process(timeout_s)


def _output_bytes(item: dict) -> int:
    """The bytes a waiting row's output holds (a stored response's conversation included)."""
    if not item["output"]:
        return 0
    return len(item["output"][1]) + len(item.get("conversation") or b"")


class RunRecordMetrics:
    """The run record writer's health (RunWriter, above), read when scraped: rounds the
    store refused, ended runs' rows waiting for it, and what was let go while it failed."""

    def __init__(self, writer):
        self.writer = writer
        self.registry = CollectorRegistry()
        self.registry.register(self)

    def collect(self):
        w = self.writer
        yield CounterMetricFamily("pd_run_records_failures", "Rounds (or rows of one) of run "
                                  "records the store did not take", value=w.failures)
        yield GaugeMetricFamily("pd_run_records_waiting", "Ended runs' rows waiting for the "
                                "store", value=w.waiting)
        dropped = CounterMetricFamily("pd_run_records_dropped", "Waiting run records let go "
                                      "while the store failed (runs: unrecorded; outputs: not "
                                      "kept for replay)", labels=["what"])
        dropped.add_metric(["runs"], w.runs_dropped)
        dropped.add_metric(["outputs"], w.outputs_dropped)
        yield dropped

    def text(self) -> bytes:
        return generate_latest(self.registry)
