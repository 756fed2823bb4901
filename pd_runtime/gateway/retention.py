"""How long the run store keeps what it records (router.runs.keep_outputs_s, keep_runs_s): the
record writer's process (pd_runtime/gateway/record_process.py) calls `Retention.step` between its rounds,
one small batch a call, so a pass over a large store never holds up the records for long.

Outputs (what a retry or a resumed stream replays) go first, `keep_outputs_s` after their run
began; the runs themselves (records, idempotency keys) `keep_runs_s` after, their usage rows
added to per-tenant, per-UTC-day totals in the same transaction, so the ledger's totals outlive
them. Several replicas' processes may purge one store at once: each row is removed once.
"""

from __future__ import annotations

import logging
import time
from typing import Optional

from pd_runtime.gateway.store import RunStore

log = logging.getLogger(__name__)

BATCH = 500           # runs (or outputs) a step deletes, in one transaction
PASS_EVERY_S = 60.0   # between passes, at most (a short keep passes more often)
REPORT_EVERY_S = 10.0  # a long pass says how far it got this often


class Retention:
    def __init__(self, store: RunStore, keep_outputs_s: Optional[float],
                 keep_runs_s: Optional[float], batch: int = BATCH):
        """None keeps that kind for good."""
        self.store = store
        self.keep_outputs_s = keep_outputs_s
        self.keep_runs_s = keep_runs_s
        self.batch = batch
        keeps = [k for k in (keep_outputs_s, keep_runs_s) if k is not None]
        # Nothing outlives its keep by more than a quarter of it (or a minute).
        self.interval_s = min(PASS_EVERY_S, max(0.5, min(keeps) / 4)) if keeps else None
        self._pass: Optional[dict] = None  # the pass under way: its cutoffs and counts

    def step(self, now: Optional[float] = None) -> bool:
        """One batch of the current pass (a new pass starts when none is under way); True
        when the pass has more to delete (call again soon), False when it is done."""
        if self.interval_s is None:
            return False
        if self._pass is None:
            now = time.time() if now is None else now
            self._pass = {"outputs_before": self._cutoff(self.keep_outputs_s, now),
                          "runs_before": self._cutoff(self.keep_runs_s, now),
                          "outputs": 0, "runs": 0, "began": time.monotonic(),
                          "reported": time.monotonic()}
        p = self._pass
        if p["outputs_before"] is not None:
            deleted = self.store.delete_outputs(p["outputs_before"], self.batch)
            p["outputs"] += deleted
            if deleted < self.batch:
                p["outputs_before"] = None  # this pass's outputs are all gone
        elif p["runs_before"] is not None:
            deleted = self.store.delete_runs(p["runs_before"], self.batch)
            p["runs"] += deleted
            if deleted < self.batch:
                p["runs_before"] = None
        more = p["outputs_before"] is not None or p["runs_before"] is not None
        if not more:
            self._pass = None
        if p["outputs"] or p["runs"]:
            elapsed = time.monotonic() - p["began"]
            if not more:
                log.info("run store: deleted %d kept outputs and %d runs past their keep "
                         "(router.runs.keep_outputs_s, keep_runs_s) in %.1f s", p["outputs"],
                         p["runs"], elapsed)
            elif time.monotonic() - p["reported"] >= REPORT_EVERY_S:
                p["reported"] = time.monotonic()
                log.info("run store: %d kept outputs and %d runs deleted so far (%.0f s); "
                         "going on", p["outputs"], p["runs"], elapsed)
        return more

    def run_pass(self, now: Optional[float] = None) -> None:
        """A whole pass at once (tests and bench/store_retention.py)."""
        while self.step(now):
            pass

    @staticmethod
    def _cutoff(keep_s: Optional[float], now: float) -> Optional[float]:
        return None if keep_s is None else now - keep_s
