"""Streams and disconnects: merging the n chunk streams of one request, racing work against the
client going away, and the SSE response that cancels its request when the client leaves.

Cancellation is ownership: whoever stops consuming a backend stream closes it (aclose), and the
backend's contract (pd_runtime/router/backend.py) turns that into an abort everywhere.
"""

from __future__ import annotations

import asyncio
import json
import logging
from contextlib import aclosing
from typing import Any, AsyncIterator, Awaitable, Callable, Optional

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from pd_runtime.api import StreamChunk
from pd_runtime.gateway.live_run import sse
from pd_runtime.router.backend import BackendError

log = logging.getLogger(__name__)


class ClientDisconnected(Exception):
    """The client went away before its response was complete."""


async def merge_streams(streams: list[AsyncIterator[StreamChunk]]
                        ) -> AsyncIterator[tuple[int, StreamChunk]]:
    """(index, chunk) from every stream as chunks arrive; closing this closes them all."""
    if len(streams) == 1:  # the common case, without a task per token
        async with aclosing(streams[0]) as stream:
            async for chunk in stream:
                yield 0, chunk
        return
    pending: dict[asyncio.Future, int] = {}
    try:
        for index, stream in enumerate(streams):
            pending[asyncio.ensure_future(stream.__anext__())] = index
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for future in done:
                index = pending.pop(future)
                try:
                    chunk = future.result()
                except StopAsyncIteration:
                    continue
                if not chunk.finished:
                    pending[asyncio.ensure_future(streams[index].__anext__())] = index
                yield index, chunk
    finally:
        for future in pending:
            future.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for stream in streams:
            await stream.aclose()


async def _wait_disconnect(receive: Receive) -> None:
    # Once the body is read, the server answers receive() only when the client disconnects.
    while (await receive())["type"] != "http.disconnect":
        pass


async def until_disconnect(receive: Receive, work: Awaitable, deadline: Optional[float] = None):
    """The result of `work`, unless the client disconnects first (ClientDisconnected) or the
    loop time passes `deadline` (BackendError 504); either way `work` is cancelled."""
    loop = asyncio.get_running_loop()
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_wait_disconnect(receive))
    timeout = None if deadline is None else max(0.0, deadline - loop.time())
    try:
        await asyncio.wait({task, watch}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:  # also when we are cancelled ourselves: nothing may outlive the request
        task.cancel()
        watch.cancel()
        await asyncio.gather(task, watch, return_exceptions=True)
    if not task.cancelled():
        return task.result()
    if watch.cancelled():
        raise BackendError(504, "the request did not finish within request_timeout_s",
                           type="timeout_error", code="request_timeout")
    raise ClientDisconnected()


def json_body(data: Any) -> Response:
    """A JSON response in ASCII-escaped JSON: model text may hold a lone surrogate (an escape
    it wrote, decoded), which UTF-8 cannot encode (a plain JSONResponse failed with a 500)."""
    return Response(json.dumps(data), media_type="application/json")


class SSEResponse(Response):
    """Server-sent events from an async iterator of encoded events. The client leaving (or the
    deadline passing) cancels the iteration, and the iterator is closed in every case, so the
    request behind it is aborted within one engine step. `on_end(cut)` is awaited once the
    events are closed (or failed to close): `cut` None when they ran out, else what stopped
    them (ClientDisconnected, the deadline's BackendError, OSError, CancelledError, a defect)."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[bytes], headers: Optional[dict] = None,
                 deadline: Optional[float] = None,
                 on_end: Optional[Callable[[Optional[BaseException]], Awaitable]] = None,
                 cut_events: Optional[Callable[[BackendError], list]] = None):
        self.events = events
        self.cut_events = cut_events or (lambda exc: [exc.body(), "[DONE]"])
        self.deadline = deadline
        self.on_end = on_end
        self.status_code = 200
        self.background = None
        self.init_headers({"Cache-Control": "no-cache", "X-Accel-Buffering": "no",
                           **(headers or {})})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def pump():
            await send({"type": "http.response.start", "status": self.status_code,
                        "headers": self.raw_headers})
            async for event in self.events:
                await send({"type": "http.response.body", "body": event, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        cut: Optional[BaseException] = None
        try:
            await until_disconnect(receive, pump(), self.deadline)
        except ClientDisconnected as exc:
            cut = exc
            log.info("client disconnected mid-stream; request cancelled")
        except BackendError as exc:  # the deadline passed mid-stream: say so, then end
            cut = exc
            log.warning("stream cut at request_timeout_s")
            try:
                await send({"type": "http.response.body", "more_body": False,
                            "body": b"".join(map(sse, self.cut_events(exc)))})
            except OSError:
                pass
        except OSError as exc:  # the socket broke while sending: the client is gone too
            cut = exc
            log.info("client connection lost mid-stream; request cancelled")
        except BaseException as exc:
            cut = exc
            raise
        finally:
            try:
                await self.events.aclose()
            finally:
                if self.on_end is not None:
                    await self.on_end(cut)
