"""Requests' deadlines (GenerationRequest.deadline), enforced by the worker's engine loop: a
request still in the engine when its deadline passes is aborted there and its stream ends with
a DeadlineExceededError, so a worker stops computing for a client nobody serves any more even
when the router's abort never comes (the router gone, the message lost).
"""

from __future__ import annotations

import heapq
import logging
import time
from typing import Callable

from pd_runtime.api import DeadlineExceededError

log = logging.getLogger(__name__)


class DeadlineWatch:
    """A tick hook of the engine loop. Everything here runs on the engine thread: `add` is
    called from an engine command (the one that admits the request, or one posted after), so
    the request is in the engine before the watch can look for it."""

    def __init__(self, end_stream: Callable[[str, Exception], None]):
        self._end_stream = end_stream
        self._heap: list[tuple[float, str]] = []  # (deadline as time.time(), request id)
        # Past their deadline while waiting for remote KV, which the receive may still be
        # writing: aborted at the first tick after they leave engine.remote.waiting (landed
        # or fallen back), before any step of theirs.
        self._overdue: dict[str, float] = {}
        self.expired = 0

    def add(self, request_id: str, deadline: float) -> None:
        heapq.heappush(self._heap, (deadline, request_id))

    def __len__(self) -> int:
        return len(self._heap) + len(self._overdue)

    def tick(self, engine) -> None:
        # Entries of requests that finished in time go when they come due, or sooner when they
        # outnumber the live requests (a deadline is minutes away, requests take seconds).
        if self._heap and (len(self._heap) > 2 * len(engine.requests) + 64 or not engine.requests):
            self._heap = [item for item in self._heap if item[1] in engine.requests]
            heapq.heapify(self._heap)
        now = time.time()
        if not self._overdue and (not self._heap or self._heap[0][0] > now):
            return  # the common tick: nothing due
        due = list(self._overdue.items())
        self._overdue.clear()
        while self._heap and self._heap[0][0] <= now:
            deadline, request_id = heapq.heappop(self._heap)
            due.append((request_id, deadline))
        for request_id, deadline in due:
            if request_id not in engine.requests:  # finished (or aborted) in time
                continue
            if request_id in engine.remote.waiting:
                self._overdue[request_id] = deadline
                continue
            engine.abort(request_id)
            self.expired += 1
            late = now - deadline
            log.info("request %s aborted: its deadline passed %.2fs ago", request_id, late)
            self._end_stream(request_id, DeadlineExceededError(
                f"request {request_id} did not finish by its deadline "
                f"({late:.1f}s ago); aborted"))
