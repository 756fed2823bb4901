"""A run in this router's memory (`LiveRun`): one this process produces, or a stub for one another
replica produces, followed through the store; its SSE events with their ids, and the iterator a
response follows them with.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable, Optional

from pd_runtime.router.backend import BackendError


@dataclass(slots=True)
class LiveRun:
    """A run this process is producing (or produced recently). `events`: the SSE events as
    sent, each with its id (streams); `body`: the JSON response (otherwise); `error`: the
    failure answered with its own HTTP status (nothing was sent before it)."""

    id: str
    tenant: str
    stream: bool
    key: Optional[str] = None
    digest: Optional[str] = None
    state: str = "queued"
    created_at: float = field(default_factory=time.time)
    events: list[bytes] = field(default_factory=list)
    body: Optional[bytes] = None
    error: Optional[BackendError] = None
    started: bool = False  # every choice has its first chunk: the response may begin
    done: bool = False
    remote: bool = False  # a stub for a run of another process, read from the store
    event_ids: bool = True  # its SSE events carry `id:` lines
    followers: int = 0
    task: Optional[asyncio.Task] = None
    settling: Optional[asyncio.Task] = None  # a stub's: following the run through the store
    detach_timer: Optional[asyncio.TimerHandle] = None  # the grace of its last follower
    # Its record's columns as they stand: path, route_reason, workers, token counts, error,
    # the time it entered each state (pd_runtime/gateway/store.py STATE_TIME).
    info: dict = field(default_factory=dict)
    stored: Optional[str] = None  # the state its store row has (None: no row yet)
    kept_output: Optional[tuple[str, bytes]] = None  # written with its end: a client may ask
    conversation: Optional[bytes] = None  # a stored response's messages (JSON), kept with it
    unstored: bool = False  # a response sent with store: false: not read back by its id
    background: bool = False  # a background response's: no follower leaving cancels it
    cancelled: bool = False  # a background response cancelled by its client's request
    opening_kept: bool = False  # a background response's: its created event went to the store
    _changed: Optional[asyncio.Event] = None  # made when someone first waits

    def notify(self) -> None:
        if self._changed is not None:
            self._changed.set()
            self._changed = None

    def changed(self) -> Awaitable[bool]:
        """What to await for the run's next change. The event is made here, when called, not
        when the awaitable first runs: asyncio.wait_for runs it as a task a loop turn later,
        and a notify() in between would find nothing to set (and the waiter wait in vain)."""
        if self._changed is None:
            self._changed = asyncio.Event()
        return self._changed.wait()

    def event_id(self, seq: int) -> str:
        return f"{self.id}:{seq}"

    def next_event(self, payload) -> bytes:
        """`payload` as this run's next SSE event, with its id when its events carry ids."""
        return sse(payload, self.event_id(len(self.events)) if self.event_ids else None)


def end_as_cut(live: LiveRun, reason: BackendError, emit: Callable[[object], object],
               cut: Optional[Callable[[BackendError, int], list]] = None) -> None:
    """A stream cut short ends as a finished one does, saying why: what a retry, a resume or
    a follower on another replica replays. `emit` keeps a payload as the run's next event;
    `cut(reason, its number)`: the producer's closing events (its builder's `failed`)."""
    if not live.events or stream_closed(live):
        return
    if cut is not None:
        for payload in cut(reason, len(live.events)):
            emit(payload)
        return
    if not _typed(live):
        emit(reason.body())
        emit("[DONE]")
        return
    created = event_data(live.events[0])
    response = created.get("response") if isinstance(created, dict) else None
    for payload in failed_events(len(live.events), response or {"id": live.id}, reason):
        emit(payload)


def failed_events(seq: int, response: dict, error: BackendError) -> list[dict]:
    """A Responses stream's close when it fails: an error event, then response.failed
    (`response` as it stood), numbered from `seq`. Here, below
    pd_runtime/entrypoints/openai/responses/events.py (whose builder closes its own streams
    with it), so that end_as_cut can close any run's."""
    # The response's error code is one of OpenAI's (the event's says which error it was).
    code = "rate_limit_exceeded" if error.status == 429 else "server_error"
    response = dict(response, status="failed", error={"code": code, "message": error.message})
    return [{"type": "error", "sequence_number": seq, "code": error.code or error.type,
             "message": error.message, "param": error.param},
            {"type": "response.failed", "sequence_number": seq + 1, "response": response}]


def stream_closed(live: LiveRun) -> bool:
    """Whether the run's stream has its last event: [DONE], or a Responses stream's
    response.completed, .incomplete or .failed."""
    if not live.events:
        return False
    if not _typed(live):
        return live.events[-1].endswith(b"data: [DONE]\n\n")
    last = event_data(live.events[-1])
    return isinstance(last, dict) and last.get("type") in (
        "response.completed", "response.incomplete", "response.failed")


def _typed(live: LiveRun) -> bool:
    """A Responses API run (its events are typed, with no [DONE])."""
    return is_response_id(live.id)


def is_response_id(run_id: str) -> bool:
    return run_id.startswith("resp_")


def sse(data: Any, event_id: Optional[str] = None) -> bytes:
    """One SSE event; a typed payload (the Responses API's) names its type in an `event:`
    line too, as OpenAI sends them."""
    text = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    kind = data.get("type") if type(data) is dict else None
    if event_id is None and kind is None:
        return f"data: {text}\n\n".encode()
    head = f"id: {event_id}\n" if event_id is not None else ""
    if isinstance(kind, str):
        head += f"event: {kind}\n"
    return f"{head}data: {text}\n\n".encode()


def event_data(event: bytes):
    """An SSE event's data, as JSON (None for [DONE] or anything else)."""
    for line in event.split(b"\n"):
        if line.startswith(b"data: "):
            try:
                return json.loads(line[6:])
            except ValueError:
                return None
    return None


def parse_event_id(value: Optional[str]) -> Optional[tuple[str, int]]:
    """`<run id>:<seq>` -> (run id, seq); None for anything else."""
    if not value:
        return None
    run_id, sep, seq = value.strip().rpartition(":")
    if not sep or not run_id or not seq.isdigit():
        return None
    return run_id, int(seq)


def split_events(recorded: bytes) -> list[bytes]:
    """A recorded SSE stream back into its events (JSON data never holds a raw blank line)."""
    return [part + b"\n\n" for part in recorded.split(b"\n\n") if part]


class Following:
    """An event iterator that calls `on_close` once when closed, even if never started (an
    async generator's own `finally` does not run then)."""

    def __init__(self, events: AsyncIterator[bytes], on_close: Callable[[], None]):
        self._events = events
        self._on_close: Optional[Callable[[], None]] = on_close

    def __aiter__(self) -> "Following":
        return self

    async def __anext__(self) -> bytes:
        return await self._events.__anext__()

    async def aclose(self) -> None:
        try:
            await self._events.aclose()
        finally:
            on_close, self._on_close = self._on_close, None
            if on_close is not None:
                on_close()
