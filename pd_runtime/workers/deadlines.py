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

# A request waiting for its remote KV cannot be aborted under the receive; it is looked at
# again this much later (it lands or falls back within the transfer's own deadline).
_RECHECK_S = 0.05


class DeadlineWatch:
    """A tick hook of the engine loop. Everything here runs on the engine thread: `add` is
    called from an engine command (the one that admits the request, or one posted after), so
    the request is in the engine before the watch can look for it."""

    def __init__(self, end_stream: Callable[[str, Exception], None]):
        self._end_stream = end_stream
        self._heap: list[tuple[float, str]] = []  # (deadline as time.time(), request id)
        self.expired = 0

    def add(self, request_id: str, deadline: float) -> None:
        heapq.heappush(self._heap, (deadline, request_id))

    def __len__(self) -> int:
        return len(self._heap)

    def tick(self, engine) -> None:
        now = time.time()
        while self._heap and self._heap[0][0] <= now:
            deadline, request_id = heapq.heappop(self._heap)
            if request_id not in engine.requests:  # finished (or aborted) in time
                continue
            if request_id in engine.remote.waiting:
                heapq.heappush(self._heap, (now + _RECHECK_S, request_id))
                continue
            engine.abort(request_id)
            self.expired += 1
            late = now - deadline
            log.info("request %s aborted: its deadline passed %.2fs ago", request_id, late)
            self._end_stream(request_id, DeadlineExceededError(
                f"request {request_id} did not finish by its deadline "
                f"({late:.1f}s ago); aborted"))
