"""A request's backend chunks as its response: every choice's first chunks (held so that an
error before any token gets its own HTTP status), the SSE events built from them (a failure
after the first event said in the stream), or the whole body collected. Used by
pd_runtime/entrypoints/openai/generation.py for every path (recorded or not, keyed, background).
"""

from __future__ import annotations

import logging

from pd_runtime.api import StreamChunk
from pd_runtime.entrypoints.openai.completion_bodies import ResponseBuilder
from pd_runtime.gateway.live_run import sse
from pd_runtime.router.backend import BackendError

log = logging.getLogger("router.http")


async def collect(builder: ResponseBuilder, merged, on_first=None) -> None:
    async for index, chunk in merged:
        raise_for_error(chunk)
        if on_first is not None:
            on_first(chunk)
            on_first = None
        builder.add(index, chunk)


async def first_chunks(merged, num_choices: int,
                       on_first=None) -> list[tuple[int, StreamChunk]]:
    seen: set[int] = set()
    first: list[tuple[int, dict]] = []
    while len(seen) < num_choices:
        try:
            index, chunk = await merged.__anext__()
        except StopAsyncIteration:
            break
        raise_for_error(chunk)
        if on_first is not None:
            on_first(chunk)
            on_first = None
        first.append((index, chunk))
        seen.add(index)
    return first


async def sse_events(builder: ResponseBuilder, first: list, merged, outcome: dict,
                     event=sse):
    """The SSE events of a stream, each encoded by `event(payload)` (a run's emitter keeps
    them); a failure after the first event is said in the stream and noted in
    `outcome["error"]`; `outcome["sent"]` counts the events given out."""
    outcome["sent"] = 0
    try:
        for index, chunk in first:
            for payload in builder.events(index, chunk):
                outcome["sent"] += 1
                yield event(payload)
        try:
            async for index, chunk in merged:
                raise_for_error(chunk)
                for payload in builder.events(index, chunk):
                    outcome["sent"] += 1
                    yield event(payload)
        except BackendError as exc:  # after the first token the status is already 200
            log.warning("%s: error mid-stream: %s", builder.id, exc.message)
            outcome["error"] = exc.message
            for payload in builder.failed(exc):
                yield event(payload)
            return
        except Exception:
            log.exception("%s: backend failed mid-stream", builder.id)
            outcome["error"] = "internal error while streaming"
            for payload in builder.failed(BackendError(500, outcome["error"])):
                yield event(payload)
            return
        for payload in builder.closing():
            yield event(payload)
    finally:
        await merged.aclose()


def raise_for_error(chunk: StreamChunk) -> None:
    if chunk.error is not None:
        raise BackendError.from_chunk_error(chunk.error)
