"""What the router has sent each worker and not seen finish: the queues the SLO policy predicts
from. The router is the only way in, so its own ledger is current to the request (load reports
lag by up to a health interval, which a burst outruns).

Prefill work is kept as a queue of predicted finish times: a request joins at the end of its
worker's queue, and when its first token arrives the error (actual - predicted) shifts every
request behind it, so the queue stays honest without a model of the worker's scheduler.
"""

from __future__ import annotations

import bisect
import collections
from dataclasses import dataclass, field


_RECENT_S = 60.0               # how long done prefills are remembered
_SLOWDOWN_HALF_LIFE_S = 30.0


@dataclass
class _Prefill:
    seconds: float
    finish_at: float
    booked_at: float
    predicted_s: float  # booking to first token, as predicted then


@dataclass
class WorkerLedger:
    prefills: dict[str, _Prefill] = field(default_factory=dict)
    free_at: float = 0.0                     # predicted end of the prefill queue
    # Measured / predicted time to first token of this worker's prefills lately: what the cost
    # model misses (a busy neighbour, a misfit) scales its next predictions.
    slowdown: float = 1.0
    slowdown_at: float = 0.0  # when it was last measured; it decays toward 1 from then
    running: dict[str, int] = field(default_factory=dict)  # decode side: id -> context tokens
    context_tokens: int = 0
    # Prefills done here lately (running requests paid for them): when each ended, and the
    # seconds of all before it, so a window's sum is a lookup, not a walk over every request
    # of the last minute (at a thousand requests a second that walk was the router's largest
    # cost per decision).
    done_at: list = field(default_factory=list)
    done_before: list = field(default_factory=list)
    done_total: float = 0.0
    done_first: int = 0  # entries before it are forgotten

    def backlog_s(self, now: float) -> float:
        return max(0.0, self.free_at - now) if self.prefills else 0.0

    def add_prefill(self, request_id: str, seconds: float, now: float) -> float:
        """Queue a prefill; returns its predicted finish time."""
        start = max(now, self.free_at) if self.prefills else now
        self.free_at = start + seconds
        self.prefills[request_id] = _Prefill(seconds, self.free_at, now, self.free_at - now)
        return self.free_at

    def prefill_done(self, request_id: str, now: float, ran: bool = True,
                     measured: bool = True) -> None:
        """Its first token came (`ran`) or it ended before (refused, failed). `measured`: the
        first token measures this worker (not one that came after a lost decode worker's
        recovery, or from a decode worker that prefilled it after all: their delays are not
        this worker's, and learning them would refuse its next prompts as if it were slow)."""
        p = self.prefills.pop(request_id, None)
        if p is None:
            return
        # Ran: the ones behind it move by its error (unless the delay was not this worker's);
        # did not: they move up by what it had left.
        error = (now - p.finish_at if measured else 0.0) if ran else \
            -min(p.seconds, max(0.0, p.finish_at - now))
        for other in self.prefills.values():
            if other.finish_at > p.finish_at:
                other.finish_at += error
        self.free_at = max((o.finish_at for o in self.prefills.values()), default=now)
        if ran:
            self.done_at.append(now)
            self.done_before.append(self.done_total)
            self.done_total += p.seconds
            self._forget_old(now)
            if measured and p.predicted_s >= 0.05:  # short ones: mostly fixed costs
                # The prediction had the slowdown in it already: what is left scales it.
                ratio = (now - p.booked_at) / p.predicted_s
                self.slowdown = min(4.0, max(0.5, self.current_slowdown(now) * ratio ** 0.2))
                self.slowdown_at = now

    def current_slowdown(self, now: float) -> float:
        """The learned slowdown, halving its distance to 1 every _SLOWDOWN_HALF_LIFE_S without
        a new measurement (a worker predicted slow is chosen less, so it may measure rarely)."""
        age = max(0.0, now - self.slowdown_at)
        return 1.0 + (self.slowdown - 1.0) * 0.5 ** (age / _SLOWDOWN_HALF_LIFE_S)

    def recent_prefill_s(self, now: float, window_s: float) -> float:
        """Seconds of the prefills done here in the last `window_s` (at most _RECENT_S)."""
        self._forget_old(now)
        i = bisect.bisect_left(self.done_at, now - window_s, self.done_first)
        return self.done_total - self.done_before[i] if i < len(self.done_at) else 0.0

    def _forget_old(self, now: float) -> None:
        first = bisect.bisect_left(self.done_at, now - _RECENT_S, self.done_first)
        if first > 1024 and first * 2 > len(self.done_at):  # drop them, rebased on the rest
            base = self.done_before[first] if first < len(self.done_before) else self.done_total
            self.done_at = self.done_at[first:]
            self.done_before = [b - base for b in self.done_before[first:]]
            self.done_total -= base
            first = 0
        self.done_first = first

    def start(self, request_id: str, context: int) -> None:
        self.running[request_id] = context
        self.context_tokens += context

    def grow(self, request_id: str, tokens: int) -> None:
        if request_id in self.running:
            self.running[request_id] += tokens
            self.context_tokens += tokens

    def finish(self, request_id: str, now: float) -> None:
        self.prefill_done(request_id, now, ran=False)  # ended (refused, failed) before it
        self.context_tokens -= self.running.pop(request_id, 0)


class Ledgers(collections.defaultdict):
    """worker id -> WorkerLedger, made on first use."""

    def __init__(self):
        super().__init__(WorkerLedger)
