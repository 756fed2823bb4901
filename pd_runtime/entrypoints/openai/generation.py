"""Generation requests (completions and chat): a run produced once, by its own response or
(with an Idempotency-Key) by a task of its own, and followed by the responses that want it;
with run records off, the response drives the backend streams itself. Served by
pd_runtime/entrypoints/openai/app.py.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from typing import Optional

from starlette.requests import Request
from starlette.responses import Response

from pd_runtime.api import StreamChunk
from pd_runtime.entrypoints.openai import beam_search
from pd_runtime.entrypoints.openai.chunk_events import collect, first_chunks, sse_events
from pd_runtime.entrypoints.openai.request_parsing.intake import INLINE_MAX_BYTES, Intake
from pd_runtime.entrypoints.openai.request_parsing.protocol import InvalidRequest, parse_json
from pd_runtime.entrypoints.openai.completion_bodies import ResponseBuilder
from pd_runtime.entrypoints.openai.responses.request import NeedsHistory
from pd_runtime.entrypoints.openai.responses.events import ResponsesBuilder
from pd_runtime.entrypoints.openai.responses.stored import as_it_stands, stored as stored_response
from pd_runtime.entrypoints.openai.streaming import (ClientDisconnected, SSEResponse, json_body,
                                                     merge_streams, until_disconnect)
from pd_runtime.gateway.live_run import LiveRun, end_as_cut, parse_event_id, stream_closed
from pd_runtime.gateway.recorder import RunRecorder
from pd_runtime.gateway.run_state import IdempotencyConflict, body_hash
from pd_runtime.router.backend import Backend, BackendError

log = logging.getLogger("router.http")

ANONYMOUS = "anonymous"  # the tenant of every request when no API keys are configured


_ID_PREFIX = {"completion": "cmpl-", "chat": "chatcmpl-", "responses": "resp_"}


async def generation(request: Request, backend: Backend, intake: Intake, kind: str,
                      timeout_s: float, recorder: Optional[RunRecorder]) -> Response:
    response_id = _name_request(request, _ID_PREFIX[kind])
    deadline = asyncio.get_running_loop().time() + timeout_s
    tenant = backend.authenticate(bearer_key(request))
    raw = await intake.read_body(request)
    if recorder is None:
        return await _unrecorded(request, backend, intake, kind, raw, response_id, tenant,
                                 timeout_s, deadline)
    tenant_id = tenant_name(tenant)
    last_event_id, key, accept = _run_headers(request)
    resume = parse_event_id(last_event_id)
    if resume is not None:  # a reconnecting stream: the same run, after the last event seen
        live = await recorder.find(resume[0], tenant_id)
        if live is None:
            raise no_run(resume[0])
        return await respond(recorder, live, request, resume[1], deadline)
    if key is not None and len(key) > MAX_KEY_CHARS:
        raise InvalidRequest(f"Idempotency-Key is {len(key)} characters; at most "
                             f"{MAX_KEY_CHARS}", param="Idempotency-Key")
    body = digest = None
    if key is not None:  # what the key stands for; a large body is parsed off the loop
        body, digest = (_parse_and_digest(raw) if len(raw) <= INLINE_MAX_BYTES
                        else await asyncio.to_thread(_parse_and_digest, raw))
    try:
        live, created = await recorder.open(response_id, tenant_id, bool(
            body and body.get("stream")), key, body, digest)
    except IdempotencyConflict as exc:
        raise BackendError(422, str(exc), type="invalid_request_error",
                           code="idempotency_key_reused") from None
    if not created:  # a retry: the run that has the key, not a second computation
        if kind == "responses" and body.get("background") is True and not body.get("stream"):
            now = await as_it_stands(recorder, tenant_id, live.id)
            if now is not None:  # a background request's answer: the response as it stands
                return json_body(now)
        return await respond(recorder, live, request, -1, deadline)
    live.event_ids = recorder.always_event_ids or key is not None or \
        "text/event-stream" in accept
    try:
        builder = await _builder(intake, backend, kind, raw, response_id, recorder, tenant_id)
        prepared = builder.prepared
        live.stream = prepared.stream
        live.unstored = kind == "responses" and not builder.stores
        merged = _backend_streams(backend, prepared, response_id, tenant, timeout_s)
    except BaseException as exc:
        live.error = exc if isinstance(exc, BackendError) else BackendError(500, "internal error")
        recorder.finish(live, "failed", error=live.error.message)
        raise
    if kind == "responses" and builder.request.background:
        return await _background(request, recorder, live, builder, merged, deadline)
    if key is not None:  # the run outlives its client for a while: a task of its own
        live.task = asyncio.create_task(_produce(recorder, live, builder, merged, deadline))
        return await respond(recorder, live, request, -1, deadline)
    # Without a key the run ends with its client: this response produces it, as with records
    # off (no task, no generator in between), and tells the recorder where it stands.
    if not prepared.stream:
        return await _recorded_body(request, recorder, live, builder, merged, deadline)
    try:
        recorder.advance(live, "prefilling")
        first = await until_disconnect(request.receive, first_chunks(
            merged, len(prepared.choices), _on_first_chunk(recorder, live)), deadline)
    except BaseException as exc:
        await merged.aclose()
        raise _end_cut(recorder, live, builder, exc) from None
    live.started = True
    outcome: dict = {}
    return SSEResponse(sse_events(builder, first, merged, outcome, _emitter(recorder, live)),
                       deadline=deadline, on_end=lambda cut: _end_stream(
                           recorder, live, builder, merged, outcome, cut),
                       cut_events=lambda exc: builder.failed(exc, len(live.events)))


async def _background(request: Request, recorder: RunRecorder, live: LiveRun,
                      builder: ResponsesBuilder, merged, deadline: float) -> Response:
    """A background response: produced by a task of its own that no client's leaving stops,
    its events kept as a stream's (what GET, a stream again and the record read). The request
    gets the queued response at once, or the stream when it asked for one."""
    asked_stream = builder.prepared.stream
    builder.prepared.stream = live.stream = live.event_ids = live.background = True
    emit = _emitter(recorder, live)
    opening = builder.opening()  # before the model's first token: polled, it is queued
    for payload in opening:
        emit(payload)
    live.started = True
    live.task = asyncio.create_task(_produce(recorder, live, builder, merged, deadline))
    if asked_stream:
        return await respond(recorder, live, request, -1, deadline)
    return json_body(opening[0]["response"])


async def _builder(intake: Intake, backend: Backend, kind: str, raw, response_id: str,
                   recorder: Optional[RunRecorder], tenant_id: str):
    """The request parsed and validated, and the builder of its response body or events."""
    if kind != "responses":
        return ResponseBuilder(await intake.prepare(kind, raw), response_id, backend.tokenizer)
    try:
        prepared = await intake.prepare(kind, raw)
    except NeedsHistory as need:  # it continues a stored response: with its conversation
        history = await _history(need.response_id, recorder, tenant_id)
        prepared = await intake.prepare(kind, raw, history)
    request = prepared.responses
    if request.background and recorder is None:
        raise InvalidRequest("background needs run records (router.runs.enabled: false here)",
                             param="background", code="unsupported_parameter")
    request.store = request.store and recorder is not None
    return ResponsesBuilder(prepared, response_id, backend.tokenizer, request)


async def _history(previous: str, recorder: Optional[RunRecorder], tenant_id: str) -> bytes:
    """The conversation of stored response `previous` (its input and output messages, JSON)."""
    if recorder is None:
        raise InvalidRequest("previous_response_id needs stored responses, which need run "
                             "records (router.runs.enabled: false here)",
                             param="previous_response_id", code="unsupported_parameter")
    stored = await stored_response(recorder, previous, tenant_id)
    if stored is None:
        raise BackendError(404, f"no stored response {previous!r} of yours (it was sent with "
                           f"store: false, has not finished, or is past router.runs."
                           f"keep_outputs_s)", param="previous_response_id",
                           code="previous_response_not_found")
    return stored[0]


async def _recorded_body(request: Request, recorder: RunRecorder, live: LiveRun,
                         builder: ResponseBuilder, merged, deadline: float) -> Response:
    """A keyless JSON run, produced by its response."""
    try:
        recorder.advance(live, "prefilling")
        await until_disconnect(request.receive,
                               collect(builder, merged, _on_first_chunk(recorder, live)), deadline)
        body = builder.final_body()
        live.body = json.dumps(body).encode()
    except BaseException as exc:
        await merged.aclose()
        raise _end_cut(recorder, live, builder, exc) from None
    _finish(recorder, live, "completed", None, builder)  # before a cancel can cut in
    await merged.aclose()
    return Response(live.body, media_type="application/json")


def _on_first_chunk(recorder: RunRecorder, live: LiveRun):
    def first_chunk(chunk: StreamChunk) -> None:
        workers = chunk.workers
        recorder.advance(live, "streaming", path=chunk.path,
                         route_reason=chunk.route_reason,
                         workers=list(workers) if workers else None)
    return first_chunk


def _emitter(recorder: RunRecorder, live: LiveRun):
    """payload -> its SSE event, with the run's next event id when its events carry ids, kept
    in the run's buffer (what retries, resumes and the record read)."""
    def emit(payload) -> bytes:
        event = live.next_event(payload)
        recorder.append(live, event)
        return event
    return emit


def _end_cut(recorder: RunRecorder, live: LiveRun, builder: ResponseBuilder,
             cut: BaseException) -> BaseException:
    """A keyless run whose response stopped before its output was whole: by the deadline or a
    backend error (failed), its client leaving or the server stopping (cancelled), or a defect
    (failed, logged; an OSError here is the backend's: nothing was sent yet). What to raise:
    `cut`, or for a defect the 500 its client gets."""
    if isinstance(cut, BackendError):
        live.error = cut
        _finish(recorder, live, "failed", cut.message, builder)
    elif isinstance(cut, ClientDisconnected) or not isinstance(cut, Exception):
        _finish(recorder, live, "cancelled", None, builder)
    else:
        log.error("%s: backend failed", live.id, exc_info=cut)
        live.error = BackendError(500, "internal error")
        _finish(recorder, live, "failed", live.error.message, builder)
        return live.error
    return cut


async def _end_stream(recorder: RunRecorder, live: LiveRun, builder: ResponseBuilder, merged,
                      outcome: dict, cut: Optional[BaseException]) -> None:
    """A keyless stream's response is over (SSEResponse's on_end): `cut` None when its events
    ran out, else why it stopped. Recorded first (a cancel may cut the close short), with the
    events a replay needs to end as the cut stream did; then the backend streams are closed
    (they are already, unless the response never pulled an event)."""
    whole = stream_closed(live)
    if cut is None or (whole and not isinstance(cut, BackendError)):
        # Every event was produced (a client gone while the last ones were on their way still
        # got the run computed whole; a replay has all of it).
        error = outcome.get("error")
        _finish(recorder, live, "failed" if error else "completed", error, builder)
    else:
        if isinstance(cut, BackendError):  # the deadline: the client was told so
            state, reason = "failed", cut
        elif isinstance(cut, (ClientDisconnected, OSError)) or not isinstance(cut, Exception):
            state, reason = "cancelled", _client_left()
        else:
            log.error("%s: failed mid-stream", live.id, exc_info=cut)
            state, reason = "failed", BackendError(500, "internal error while streaming")
        end_as_cut(live, reason, _emitter(recorder, live), builder.failed)
        _finish(recorder, live, state, reason.message if state == "failed" else None,
                builder)
    await merged.aclose()


def _finish(recorder: RunRecorder, live: LiveRun, state: str, error: Optional[str],
            builder) -> None:
    """The run's end recorded, with a stored response's conversation."""
    usage = builder.usage()
    if state == "completed" and builder.stores:
        live.conversation = json.dumps(builder.conversation()).encode()
    recorder.finish(live, state, error=error, prompt_tokens=usage["prompt_tokens"],
                    cached_tokens=usage["prompt_tokens_details"]["cached_tokens"],
                    output_tokens=usage["completion_tokens"])


def _parse_and_digest(raw) -> tuple[dict, str]:
    body = parse_json(raw)
    return body, body_hash(body)


_RUN_HEADERS = {b"last-event-id": 0, b"idempotency-key": 1, b"accept": 2}
MAX_KEY_CHARS = 255  # an Idempotency-Key is an id (a UUID is 36), stored and indexed


def _run_headers(request: Request) -> tuple[Optional[str], Optional[str], str]:
    """(Last-Event-ID, Idempotency-Key, Accept) in one pass over the raw headers."""
    found: list = [None, None, ""]
    for name, value in request.scope["headers"]:
        slot = _RUN_HEADERS.get(name)
        if slot is not None:
            found[slot] = value.decode("latin-1")
    return found[0], found[1] or None, found[2]


def _backend_streams(backend: Backend, prepared, response_id: str, tenant, timeout_s: float):
    if prepared.beam is not None:
        return merge_streams(beam_search.streams(backend, prepared, response_id, tenant,
                                                 timeout_s))
    return merge_streams([
        backend.generate(f"{response_id}-{choice.index}", prepared.prompts[choice.prompt_index],
                         choice.params, priority=prepared.priority, tenant=tenant,
                         deadline=time.time() + timeout_s, cache_salt=prepared.cache_salt,
                         flex=prepared.service_tier == "flex")
        for choice in prepared.choices])


async def _unrecorded(request: Request, backend: Backend, intake: Intake, kind: str, raw,
                      response_id: str, tenant, timeout_s: float, deadline: float) -> Response:
    """With run records off: the response drives the backend streams itself (the client
    leaving cancels the request at once)."""
    builder = await _builder(intake, backend, kind, raw, response_id, None, tenant_name(tenant))
    prepared = builder.prepared
    merged = _backend_streams(backend, prepared, response_id, tenant, timeout_s)
    try:
        if not prepared.stream:
            await until_disconnect(request.receive, collect(builder, merged), deadline)
            return json_body(builder.final_body())
        # Hold the headers until every choice has its first chunk: an error before any token
        # gets its own HTTP status (429, 503, ...) rather than a 200 stream with an error in it.
        first = await until_disconnect(request.receive,
                                       first_chunks(merged, len(prepared.choices)), deadline)
    except BaseException:
        await merged.aclose()
        raise
    outcome: dict = {}
    return SSEResponse(sse_events(builder, first, merged, outcome), deadline=deadline,
                       on_end=lambda _: merged.aclose(),  # also when no event was pulled
                       cut_events=lambda exc: builder.failed(exc, outcome.get("sent")))


async def _produce(recorder: RunRecorder, live: LiveRun, builder: ResponseBuilder, merged,
                   deadline: float) -> None:
    """A keyed run's one computation, in a task of its own (it outlives its clients for a
    while): its SSE events into the run's buffer, or its JSON body; every state it passes
    through recorded; its request timeout enforced here."""
    outcome: dict = {}
    state = "failed"
    emit = _emitter(recorder, live)
    try:
        recorder.advance(live, "prefilling")
        async with asyncio.timeout_at(deadline):
            if builder.prepared.stream:
                first = await first_chunks(merged, len(builder.prepared.choices),
                                            _on_first_chunk(recorder, live))
                live.started = True
                async for _ in sse_events(builder, first, merged, outcome, emit):
                    pass
            else:
                await collect(builder, merged, _on_first_chunk(recorder, live))
                live.body = json.dumps(builder.final_body()).encode()
        state = "failed" if outcome.get("error") else "completed"
    except BackendError as exc:
        live.error, outcome["error"] = exc, exc.message
        end_as_cut(live, exc, emit, builder.failed)  # a background response's stream is begun
    except TimeoutError:
        exc = _timeout_error()
        outcome["error"] = exc.message
        if live.events:  # the stream is under way: say so in it, then end it
            end_as_cut(live, exc, emit, builder.failed)
        else:
            live.error = exc
    except asyncio.CancelledError:  # its last follower left it (after the grace), or shutdown
        late = asyncio.get_running_loop().time() >= deadline  # its timeout was due anyway
        cut = _timeout_error() if late else _stopped() if live.background else _client_left()
        if late or (live.background and not live.cancelled):  # it failed: its record says so
            outcome["error"] = cut.message
        else:
            state = "cancelled"
        if not live.cancelled:  # one its client cancelled stops where it was (GET: cancelled)
            end_as_cut(live, cut, emit, builder.failed)
        raise
    except Exception:
        log.exception("%s: backend failed", live.id)
        live.error = BackendError(500, "internal error")
        outcome["error"] = live.error.message
    finally:
        await merged.aclose()
        _finish(recorder, live, state, outcome.get("error"), builder)


def _timeout_error() -> BackendError:
    return BackendError(504, "the request did not finish within request_timeout_s",
                        type="timeout_error", code="request_timeout")


def _stopped() -> BackendError:  # a background response cut short, not by a cancel: shutdown
    return BackendError(503, "the router stopped while the response ran; send it again",
                        code="server_stopping")


def _client_left() -> BackendError:
    return BackendError(499, "the run was cancelled: its client left", code="run_cancelled")


async def respond(recorder: RunRecorder, live: LiveRun, request: Request, after: int,
                   deadline: float) -> Response:
    """One client's response from a run: its stream after event `after`, or its JSON body."""
    recorder.join(live)
    try:
        await until_disconnect(request.receive, recorder.wait_ready(live), deadline)
        if live.error is not None and not live.events:
            raise live.error
    except BaseException:
        recorder.leave(live)
        raise
    if not live.stream:
        recorder.leave(live)
        if live.body is None:  # over without a body and without an error: say so
            raise live.error or BackendError(409, f"run {live.id} has no output",
                                             code="run_without_output")
        return Response(live.body, media_type="application/json")
    return SSEResponse(recorder.follow(live, after))


def _name_request(request: Request, prefix: str) -> str:
    """The response id ("cmpl-<hex>", "resp_<hex>"); it replaces the generic id in X-Request-Id
    and logs."""
    state = request.scope.setdefault("state", {})
    state["request_id"] = f"{prefix}{state.get('request_hex') or uuid.uuid4().hex}"
    return state["request_id"]


def tenant_name(tenant) -> str:
    return tenant.tenant_id if tenant is not None else ANONYMOUS


def no_run(run_id: str) -> BackendError:
    return BackendError(404, f"no run {run_id!r} of yours", param="run_id", code="run_not_found")


def bearer_key(request: Request) -> Optional[str]:
    header = request.headers.get("authorization")
    if not header:
        return None
    scheme, _, key = header.partition(" ")
    if scheme.lower() != "bearer":
        return None  # a key in another scheme is no key: 401 when keys are configured
    return key.strip() or None
