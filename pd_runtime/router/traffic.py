"""What the router was asked lately: each request's arrival, prompt length and the most output
it asked for, for the autoscaler (pd_runtime/planner/autoscale.py plans the pools for it). The
output is the request's max_tokens, not what it produced: known at arrival, and an upper bound
(a benchmark that ignores EOS gets exactly it)."""

from __future__ import annotations

import bisect
import threading
import time
from collections import deque

_KEEP = 200_000  # requests at most (at 1,000 req/s: the last 200 s)


class TrafficLog:
    def __init__(self):
        self._arrivals: deque = deque(maxlen=_KEEP)  # (monotonic time, prompt, output)
        self._lock = threading.Lock()  # appended on the serving loop, read on the controller's

    def record(self, prompt_tokens: int, max_tokens: int, now: float | None = None) -> None:
        with self._lock:
            self._arrivals.append((time.monotonic() if now is None else now, prompt_tokens,
                                   max_tokens))

    def recent(self, window_s: float, now: float | None = None) -> list[tuple[float, int, int]]:
        """The requests of the last `window_s`: (seconds since the window began, prompt
        tokens, output tokens), oldest first."""
        now = time.monotonic() if now is None else now
        start = now - window_s
        with self._lock:
            arrivals = list(self._arrivals)
        first = bisect.bisect_left(arrivals, (start,))
        return [(t - start, prompt, output) for t, prompt, output in arrivals[first:]]
