"""A stored response after its request (pd_runtime/entrypoints/openai/app.py's /v1/responses/{id}
routes): retrieve it whole or stream its events again (`stream=true&starting_after=N`), list the
input items it was made from, delete it. A response is stored when sent with `store: true` (the
default); its output and conversation live in its run's record (pd_runtime/gateway/recorder.py)
for router.runs.keep_outputs_s.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Optional

from starlette.requests import Request
from starlette.responses import Response

from pd_runtime.entrypoints.openai.request_parsing.intake import int_param
from pd_runtime.entrypoints.openai.responses.events import latest_response, stored_body
from pd_runtime.entrypoints.openai.request_parsing.schema import InvalidRequest
from pd_runtime.entrypoints.openai.streaming import SSEResponse, json_body, until_disconnect
from pd_runtime.gateway.live_run import is_response_id, stream_closed
from pd_runtime.gateway.recorder import RunRecorder, output_of
from pd_runtime.gateway.run_state import TRANSITIONS
from pd_runtime.gateway.wakeups import read_until
from pd_runtime.router.backend import BackendError

# How long a stored response is waited for when its run has sent everything but its end is
# not recorded yet (here, or by another replica's writer, whose rounds are 50 ms apart).
STORED_WAIT_S = 2.0
# How long one with no record at all is waited for (another replica writes a new run's row in
# its next round, 50 ms apart): an unknown id is a 404 after this, not after STORED_WAIT_S.
UNKNOWN_WAIT_S = 0.5
# How long a cancel waits for the replica running the response to end it (it hears the ask as
# it commits, or at worst looks asks up each second, then writes the end in its next round).
CANCEL_WAIT_S = 5.0
FOLLOW_WAIT_S = 2.0  # for another replica's running response to publish its events
MAX_ITEMS_PAGE = 100  # OpenAI's limit on one page of input items
_ITEM_INCLUDES = ("message.output_text.logprobs", "reasoning.encrypted_content")  # no effect


def not_found(response_id: str) -> BackendError:
    return BackendError(404, f"no stored response {response_id!r} of yours (sent with store: "
                        "false, deleted, not ended yet, or past router.runs.keep_outputs_s)",
                        param="response_id", code="response_not_found")


async def retrieve(request: Request, recorder: RunRecorder, tenant: str, response_id: str,
                   deadline: float):
    """The response object once it has ended; with `stream=true`, its events after
    `starting_after` (a sequence number), from memory or its record once over, as they come
    while it runs."""
    stream = request.query_params.get("stream", "false").lower()
    if stream not in ("true", "false"):
        raise InvalidRequest("stream must be true or false", param="stream")
    if stream == "false":
        if "starting_after" in request.query_params:
            raise InvalidRequest("starting_after needs stream=true", param="starting_after")
        body = await _current(recorder, tenant, response_id)
        if body is None:
            raise not_found(response_id)
        return json_body(body)
    after = int_param(request, "starting_after", -1)
    if after < -1:
        raise InvalidRequest("starting_after must be a sequence number (0 or more)",
                             param="starting_after")
    live = await _find(recorder, tenant, response_id, UNKNOWN_WAIT_S)
    if live is None:
        raise not_found(response_id)
    recorder.join(live)
    try:
        await until_disconnect(request.receive, recorder.wait_ready(live), deadline)
        if live.error is not None and not live.events:
            raise live.error
        made = latest_response(live.events[:1]) if live.stream else \
            stored_body(("json", live.body)) if live.body is not None else None
        if made is None or made.get("store") is False:  # sent with store: false
            raise not_found(response_id)
        if not live.stream:
            raise InvalidRequest(f"response {response_id!r} was made without stream: true; "
                                 "it has no events (GET it without stream)", param="stream")
    except BaseException:
        recorder.leave(live)
        raise
    return SSEResponse(recorder.follow(live, after))


async def input_items(request: Request, recorder: RunRecorder, tenant: str,
                      response_id: str) -> Response:
    """The items the response was made from (earlier turns of a previous_response_id chain
    included, instructions not), newest first unless `order=asc`, a page of `limit` (1 to 100,
    default 20) after the item `after`."""
    order = request.query_params.get("order", "desc")
    if order not in ("asc", "desc"):
        raise InvalidRequest("order must be asc or desc", param="order")
    limit = int_param(request, "limit", 20)
    if not 1 <= limit <= MAX_ITEMS_PAGE:
        raise InvalidRequest(f"limit must be between 1 and {MAX_ITEMS_PAGE}", param="limit")
    for name in ("include", "include[]"):
        for value in request.query_params.getlist(name):
            if value not in _ITEM_INCLUDES:
                raise InvalidRequest(f"include: {value!r} is not supported by this server "
                                     f"({', '.join(_ITEM_INCLUDES)})", param="include",
                                     code="unsupported_parameter")
    kept = await stored(recorder, response_id, tenant)
    if kept is None:
        raise not_found(response_id)
    items = conversation_items(json.loads(kept[0])[:-1], response_id)  # less its answer
    if order == "desc":
        items.reverse()
    after = request.query_params.get("after")
    if after is not None:
        ids = [item["id"] for item in items]
        if after not in ids:
            raise InvalidRequest(f"after: no item {after!r} in response {response_id!r}",
                                 param="after")
        items = items[ids.index(after) + 1:]
    page = items[:limit]
    return json_body({"object": "list", "data": page,
                      "first_id": page[0]["id"] if page else None,
                      "last_id": page[-1]["id"] if page else None,
                      "has_more": len(items) > limit})


async def delete(recorder: RunRecorder, tenant: str, response_id: str) -> dict:
    """The response's output and conversation deleted, on every replica (a tombstone in the
    store: one that keeps it in memory looks there before serving it); its run's record, which
    its usage is billed from, stays. 409 while it runs."""
    await stored(recorder, response_id, tenant)  # a run whose end is being recorded: its end
    live = await _find(recorder, tenant, response_id)
    if live is None:
        raise not_found(response_id)
    if not _ended(live):
        raise _running(response_id)
    body = await _ended_body(recorder, live)
    if body is None or body.get("store") is False:
        raise not_found(response_id)
    # This process's rows for it written first (its writer goes in rounds), then gone.
    await asyncio.to_thread(recorder.writer.flush, 2.0)
    await asyncio.to_thread(recorder.store.delete_output, response_id, time.time())
    if not live.remote:
        recorder.forget(live)
    return {"id": response_id, "object": "response", "deleted": True}


async def cancel(recorder: RunRecorder, tenant: str, response_id: str) -> Response:
    """A background response stopped where it is (its stream ends there; GET says
    `cancelled`), here or, asked through the store, by the replica running it. Cancelling a
    cancelled one gives it again; an ended one is a 409 (a foreground one a 400)."""
    live = await _find(recorder, tenant, response_id, UNKNOWN_WAIT_S)
    if live is None:
        raise not_found(response_id)
    if not _ended(live):
        if live.remote:
            live = await _cancel_elsewhere(recorder, tenant, live)
        else:
            if not live.background:
                raise _foreground()
            recorder.cancel(live)
            while not live.done:
                await live.changed()
    body = await _ended_body(recorder, live)
    if body is None or body.get("store") is False:
        raise not_found(response_id)
    if not body.get("background"):
        raise _foreground()
    if body["status"] != "cancelled":
        raise BackendError(409, f"response {response_id!r} has already ended (status "
                           f"{body['status']})", param="response_id",
                           code="response_already_ended")
    return json_body(body)


async def _cancel_elsewhere(recorder: RunRecorder, tenant: str, live):
    """Ask the replica running a background response to cancel it (it reads the store's asks
    every quarter second), and wait for its end to be written: the run as it ended. Which
    runs are background ones the store says (their opening event, written with their first
    rows: waited for up to UNKNOWN_WAIT_S); for another run, 409 response_elsewhere as before
    (a foreground response, or one of a replica too old to be asked)."""
    store = recorder.store
    opening = await read_until(store, live.id,
                               lambda: asyncio.to_thread(store.get_opening, live.id),
                               lambda opening: opening is not None, UNKNOWN_WAIT_S)
    if opening is None:
        raise BackendError(409, f"response {live.id!r} runs on another router replica, "
                           "which cannot be asked to cancel it (a foreground response, "
                           "or a replica of an older version)", param="response_id",
                           code="response_elsewhere")
    await asyncio.to_thread(store.ask_cancel, live.id, time.time())
    now = await read_until(store, live.id, lambda: recorder.find(live.id, tenant),
                           lambda now: now is None or _ended(now), CANCEL_WAIT_S)
    if now is None or _ended(now):
        return now or live
    raise BackendError(409, f"response {live.id!r} runs on another router replica, "
                       "asked to cancel it; it has not ended yet (GET it to see)",
                       param="response_id", code="response_elsewhere")


async def as_it_stands(recorder: RunRecorder, tenant: str, response_id: str
                       ) -> Optional[dict]:
    """The response object: a running one's latest snapshot (queued or in progress; one
    running on another replica followed up to FOLLOW_WAIT_S for its events), or as it ended
    (failed and cancelled ones too, which store no conversation); None when there is none or
    it was sent with store: false."""
    live = await _find(recorder, tenant, response_id)
    return await _as_it_stands(recorder, live) if live is not None else None


async def _as_it_stands(recorder: RunRecorder, live) -> Optional[dict]:
    body = await (_ended_body if _ended(live) else _running_body)(recorder, live)
    return body if body is not None and body.get("store") is not False else None


async def _current(recorder: RunRecorder, tenant: str, response_id: str) -> Optional[dict]:
    """GET's response object: a stored one whole (an end being recorded is waited for), else
    as it stands. A background response running on another replica is its snapshot at once
    (a poll), not after the wait for a foreground one's end to be written. One not found
    (after the rounds in which another replica writes a new run's row) is none."""
    live = await _find(recorder, tenant, response_id, UNKNOWN_WAIT_S)
    if live is None:
        return None
    if live.remote and not _ended(live):
        now = await _as_it_stands(recorder, live)
        if now is not None and now.get("background") and \
                now["status"] in ("queued", "in_progress"):
            return now
    kept = await stored(recorder, response_id, tenant, with_output=True)
    body = stored_body(kept[1]) if kept is not None and kept[1] else None
    if body is not None:
        return body
    if not live.remote:  # this process's: as it is now
        return await _as_it_stands(recorder, live)
    return await as_it_stands(recorder, tenant, response_id)  # read again: it may have ended


async def _find(recorder: RunRecorder, tenant: str, response_id: str, wait_s: float = 0.0):
    """The caller's Responses run (this process's, or a stub read from the store); None for
    another tenant's, a store: false one known here, and one deleted. One not found is looked
    for again up to `wait_s` (another replica writes a new run's row in its next round)."""
    if not response_id.startswith("resp_"):
        return None
    live = await read_until(recorder.store, response_id,
                            lambda: recorder.find(response_id, tenant),
                            lambda live: live is not None, wait_s)
    if live is None or live.unstored:
        return None
    if not live.remote and live.done and await deleted(recorder, live):
        return None
    return live


def _ended(live) -> bool:
    return live.done if not live.remote else not TRANSITIONS.get(live.state)


async def _ended_body(recorder: RunRecorder, live) -> Optional[dict]:
    """An ended response as its output holds it, with the status its run ended in (a
    cancelled one's events stop where it was)."""
    if live.remote:
        output = await asyncio.to_thread(recorder.store.get_output, live.id)
        if output is None and live.state in ("failed", "cancelled"):
            return await _cut_short(recorder, live)  # its router stopped before the end?
        body = stored_body(output) if output is not None else None
    else:  # its events as they are (not joined to be split again)
        body = latest_response(live.events) if live.stream else \
            stored_body(("json", live.body)) if live.body is not None else None
    if body is not None and live.state == "cancelled" and \
            body["status"] in ("queued", "in_progress"):
        body = dict(body, status="cancelled")
    return body


async def _cut_short(recorder: RunRecorder, live) -> Optional[dict]:
    """A background response that ended failed or cancelled with no output kept (its router
    stopped before the end: its run was marked failed at the next start, or when its replica
    was not seen): the response it opened with, failed with the reason its record gives.
    None for any other run."""
    opening = await asyncio.to_thread(recorder.store.get_opening, live.id)
    if opening is None or await asyncio.to_thread(recorder.store.output_deleted, live.id):
        return None  # (deleted by a replica of an older version, which left its opening)
    record = await asyncio.to_thread(recorder.runs.get, live.id, live.tenant)
    body = stored_body(("sse", opening)) if record is not None else None
    if body is None:
        return None
    if record["state"] != "failed":  # cancelled before its first token
        return dict(body, status=record["state"])
    return dict(body, status="failed", error={
        "code": "server_error", "message": "the response did not finish: " +
        (record.get("error") or "its run failed")})


async def _running_body(recorder: RunRecorder, live) -> Optional[dict]:
    """A running response's latest snapshot from its events (another replica's: those it
    publishes once followed, waited for up to FOLLOW_WAIT_S)."""
    if live.remote:
        recorder.join(live)
        try:
            await asyncio.wait_for(recorder.wait_ready(live), FOLLOW_WAIT_S)
        except TimeoutError:
            pass
        finally:
            recorder.leave(live)
        if live.done:  # it ended meanwhile
            return await _ended_body(recorder, live)
    return latest_response(live.events)


def _foreground() -> InvalidRequest:
    return InvalidRequest("only a background response can be cancelled (a streamed one stops "
                          "when its client closes the stream)", param="response_id")


async def stored(recorder: RunRecorder, run_id: str, tenant: str, with_output: bool = False,
                 wait_s: float = STORED_WAIT_S
                 ) -> Optional[tuple[bytes, Optional[tuple[str, bytes]]]]:
    """A stored response's conversation, and its kept output when asked (previous_response_id,
    GET, input_items): from memory while its run is kept there, else from the store. A run
    that sent its last event but is not yet marked ended, and one whose end another replica
    has not yet written (its rows go in rounds), are waited for up to `wait_s` (one with no
    row yet up to UNKNOWN_WAIT_S), the store read again after each write of the run. None when
    the caller has no such run, it was not stored (or was deleted), or it still runs."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + (wait_s if is_response_id(run_id) else 0.0)
    unknown_deadline = loop.time() + min(wait_s, UNKNOWN_WAIT_S)
    with recorder.store.watch(run_id) as watch:  # before the first read: no write missed
        while True:
            live = recorder.live.get(run_id)
            if live is not None and not live.remote:
                if live.tenant != tenant:
                    return None
                if live.done:
                    if live.conversation is None or await deleted(recorder, live):
                        return None
                    return live.conversation, output_of(live) if with_output else None
                if not (stream_closed(live) or live.body is not None):
                    return None  # it is still producing its output
                try:  # its end is being recorded
                    await asyncio.wait_for(live.changed(), max(0.0, deadline - loop.time()))
                except TimeoutError:
                    if not live.done:
                        return None
                continue
            record = await asyncio.to_thread(recorder.runs.get, run_id, tenant)
            if record is not None and not TRANSITIONS.get(record["state"]):
                conversation = await asyncio.to_thread(recorder.store.get_conversation, run_id)
                if conversation is None or not with_output:
                    return None if conversation is None else (conversation, None)
                return conversation, await asyncio.to_thread(recorder.store.get_output, run_id)
            until = deadline if record is not None else min(deadline, unknown_deadline)
            if loop.time() >= until:
                return None
            await watch.wait(until - loop.time())


async def deleted(recorder: RunRecorder, live) -> bool:
    """Whether a run this process keeps had its output deleted (by a client of any replica):
    then it is forgotten here too."""
    if not await asyncio.to_thread(recorder.store.output_deleted, live.id):
        return False
    recorder.forget(live)
    return True


def conversation_items(messages: list[dict], response_id: str) -> list[dict]:
    """Chat messages (a stored conversation) as Responses items, each with an id that stays the
    same on every read (the response's, and its place)."""
    base = response_id.removeprefix("resp_")
    items: list[dict] = []

    def add(prefix: str, item: dict) -> None:
        items.append({"id": f"{prefix}_{base}_{len(items)}", **item})

    for message in messages:
        role = message.get("role")
        if role == "tool":
            add("fco", {"type": "function_call_output", "call_id": message.get("tool_call_id"),
                        "output": message.get("content"), "status": "completed"})
            continue
        if role != "assistant":
            add("msg", {"type": "message", "role": role, "status": "completed",
                        "content": [{"type": "input_text", "text": message.get("content")}]})
            continue
        if message.get("reasoning") is not None:
            add("rs", {"type": "reasoning", "summary": [],
                       "content": [{"type": "reasoning_text", "text": message["reasoning"]}]})
        if message.get("content") is not None:
            add("msg", {"type": "message", "role": "assistant", "status": "completed",
                        "content": [{"type": "output_text", "text": message["content"],
                                     "annotations": []}]})
        for call in message.get("tool_calls") or ():
            add("fc", {"type": "function_call", "call_id": call["id"],
                       "name": call["function"]["name"],
                       "arguments": call["function"]["arguments"], "status": "completed"})
    return items


def _running(response_id: str) -> BackendError:
    return BackendError(409, f"response {response_id!r} is still running",
                        param="response_id", code="response_in_progress")
