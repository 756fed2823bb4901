"""The HTTP front door: OpenAI completions and chat (streaming and not), models, health, readiness,
metrics and the active router config, served through a Backend (router/backend.py).

Every response carries X-Request-Id and every error an OpenAI error body; user input never
yields a 500. Request flow: auth -> read (size limit) -> parse and validate (router/intake.py,
off the event loop for large bodies) -> n backend streams -> SSE or JSON.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import time
import uuid
from typing import Optional

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pd_runtime.config import RouterConfig
from router.backend import Backend, BackendError
from router.intake import Intake
from router.protocol import InvalidRequest
from router.responses import ResponseBuilder
from router.streaming import SSE_DONE, ClientDisconnected, SSEResponse, merge_streams, sse, \
    until_disconnect

log = logging.getLogger("router.http")

CLIENT_CLOSED_REQUEST = 499  # nginx's status for "the client went away"; only logs see it


def create_app(backend: Backend, router_config: RouterConfig) -> FastAPI:
    intake = Intake(backend, router_config.max_request_body_bytes)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        try:
            yield
        finally:
            intake.close()

    app = FastAPI(title="pd-runtime", docs_url=None, redoc_url=None, openapi_url=None,
                  lifespan=lifespan)
    app.state.intake = intake  # for servers that run the app without its lifespan
    app.add_middleware(RequestLogMiddleware, backend=backend)
    _install_error_handlers(app)
    timeout_s = router_config.request_timeout_s

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _generation(request, backend, intake, "completion", timeout_s)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await _generation(request, backend, intake, "chat", timeout_s)

    @app.get("/v1/models")
    async def models(request: Request):
        backend.authenticate(_api_key(request))
        return {"object": "list", "data": [_model_card(backend)]}

    @app.get("/v1/models/{model:path}")
    async def model(request: Request, model: str):
        backend.authenticate(_api_key(request))
        if model != backend.model_name:
            raise BackendError(404, f"the model {model!r} does not exist", param="model",
                               code="model_not_found")
        return _model_card(backend)

    @app.get("/v1/router/config")
    async def router_config_view(request: Request):
        backend.authenticate(_api_key(request))
        return backend.active_config()

    @app.get("/v1/router/workers")
    async def router_workers(request: Request):
        """Each worker's latest load report as the router's live cost model reads it (what
        `pd-runtime profile --url` calibrates the planner from)."""
        backend.authenticate(_api_key(request))
        return {"workers": backend.worker_reports(), "router": backend.host_report()}

    @app.get("/health")
    async def health():
        return {"status": "ok", **backend.health()}

    @app.get("/ready")
    async def ready():
        if not backend.ready():
            raise BackendError(503, "no worker can serve requests yet", code="not_ready")
        return {"status": "ready"}

    @app.get("/metrics")
    async def metrics():
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(backend.metrics_text(), media_type=CONTENT_TYPE_LATEST)

    return app


def _model_card(backend: Backend) -> dict:
    return {"id": backend.model_name, "object": "model", "created": 0, "owned_by": "pd-runtime",
            "max_model_len": backend.max_model_len}


# ---------------------------------------------------------------------------------- generation
_ID_PREFIX = {"completion": "cmpl", "chat": "chatcmpl"}


async def _generation(request: Request, backend: Backend, intake: Intake, kind: str,
                      timeout_s: float) -> Response:
    response_id = _name_request(request, _ID_PREFIX[kind])
    deadline = asyncio.get_running_loop().time() + timeout_s
    tenant = backend.authenticate(_api_key(request))
    prepared = await intake.prepare(kind, await intake.read_body(request))
    builder = ResponseBuilder(prepared, response_id, backend.tokenizer)
    merged = merge_streams([
        backend.generate(f"{response_id}-{choice.index}", prepared.prompts[choice.prompt_index],
                         choice.params, priority=prepared.priority, tenant=tenant,
                         deadline=time.time() + timeout_s)
        for choice in prepared.choices])
    try:
        if not prepared.stream:
            await until_disconnect(request.receive, _collect(builder, merged), deadline)
            return JSONResponse(builder.final_body())
        # Hold the headers until every choice has its first chunk: an error before any token
        # gets its own HTTP status (429, 503, ...) rather than a 200 stream with an error in it.
        first = await until_disconnect(request.receive,
                                       _first_chunks(merged, len(prepared.choices)), deadline)
    except BaseException:
        await merged.aclose()
        raise
    return SSEResponse(_sse_events(builder, first, merged), deadline=deadline)


async def _collect(builder: ResponseBuilder, merged) -> None:
    async for index, chunk in merged:
        _raise_for_error(chunk)
        builder.add(index, chunk)


async def _first_chunks(merged, num_choices: int) -> list[tuple[int, dict]]:
    seen: set[int] = set()
    first: list[tuple[int, dict]] = []
    while len(seen) < num_choices:
        try:
            index, chunk = await merged.__anext__()
        except StopAsyncIteration:
            break
        _raise_for_error(chunk)
        first.append((index, chunk))
        seen.add(index)
    return first


async def _sse_events(builder: ResponseBuilder, first: list, merged):
    try:
        for index, chunk in first:
            event = builder.add(index, chunk)
            if event is not None:
                yield sse(event)
        try:
            async for index, chunk in merged:
                _raise_for_error(chunk)
                event = builder.add(index, chunk)
                if event is not None:
                    yield sse(event)
        except BackendError as exc:  # after the first token the status is already 200
            log.warning("%s: error mid-stream: %s", builder.id, exc.message)
            yield sse(exc.body()) + SSE_DONE
            return
        except Exception:
            log.exception("%s: backend failed mid-stream", builder.id)
            yield sse(BackendError(500, "internal error while streaming").body()) + SSE_DONE
            return
        if builder.prepared.include_usage:
            yield sse(builder.usage_event())
        yield SSE_DONE
    finally:
        await merged.aclose()


def _raise_for_error(chunk: dict) -> None:
    error = chunk.get("error")
    if error is not None:
        raise BackendError.from_chunk_error(error if isinstance(error, dict) else
                                            {"message": str(error)})


# ---------------------------------------------------------------------------------- plumbing
def _name_request(request: Request, prefix: str) -> str:
    """The response id ("cmpl-<hex>"); it replaces the generic id in X-Request-Id and logs."""
    state = request.scope.setdefault("state", {})
    state["request_id"] = f"{prefix}-{state.get('request_hex') or uuid.uuid4().hex}"
    return state["request_id"]


def _api_key(request: Request) -> Optional[str]:
    header = request.headers.get("authorization")
    if not header:
        return None
    scheme, _, key = header.partition(" ")
    if scheme.lower() != "bearer":
        return None  # a key in another scheme is no key: 401 when keys are configured
    return key.strip() or None


def error_response(error: BackendError) -> Response:
    headers = {}
    if error.retry_after_s is not None:  # Retry-After takes whole seconds
        headers["Retry-After"] = str(max(1, math.ceil(error.retry_after_s)))
    # ASCII-escaped JSON: a message quoting client text can never fail to encode.
    return Response(json.dumps(error.body()), status_code=error.status, headers=headers,
                    media_type="application/json")


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(BackendError)
    async def backend_error(request: Request, exc: BackendError):
        return error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        message = {404: f"no route {request.method} {request.url.path}",
                   405: f"{request.method} is not allowed on {request.url.path}"}.get(
            exc.status_code, str(exc.detail))
        response = error_response(BackendError(exc.status_code, message))
        response.headers.update(exc.headers or {})
        return response

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError):
        errors = exc.errors()
        loc = [str(p) for p in errors[0].get("loc", ())[1:]] if errors else []
        return error_response(InvalidRequest(errors[0]["msg"] if errors else "invalid request",
                                             param=loc[0] if loc else None))

    @app.exception_handler(ClientDisconnected)
    async def disconnected(request: Request, exc: ClientDisconnected):
        return Response(status_code=CLIENT_CLOSED_REQUEST)


class RequestLogMiddleware:
    """Gives every request an id (X-Request-Id), logs one line per request (id, method, path,
    status, latency), reports it to the backend's metrics, and turns a crash into an OpenAI 500
    body (pure ASGI: it neither buffers streams nor hides disconnects)."""

    def __init__(self, app: ASGIApp, backend: Backend):
        self.app = app
        self.backend = backend

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start = time.perf_counter()
        hex_id = uuid.uuid4().hex
        state = scope.setdefault("state", {})
        state.update(request_hex=hex_id, request_id=f"req-{hex_id}")
        status = 500
        started = False

        async def send_with_id(message: Message) -> None:
            nonlocal status, started
            if message["type"] == "http.response.start":
                started, status = True, message["status"]
                message["headers"] = list(message.get("headers", [])) + [
                    (b"x-request-id", state["request_id"].encode())]
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        except Exception:
            log.exception("%s: unhandled error", state["request_id"])
            if not started:
                await error_response(BackendError(500, "internal error"))(scope, receive,
                                                                          send_with_id)
        finally:
            latency = time.perf_counter() - start
            route = scope.get("route")
            path = getattr(route, "path", None) or "unmatched"
            log.info("%s %s %s %d %.1fms", state["request_id"], scope.get("method"),
                     scope.get("path"), status, latency * 1e3)
            observe = getattr(self.backend, "observe", None)  # optional in the interface
            try:
                if observe is not None:
                    observe("http_request", path=path, method=scope.get("method"),
                            status=status, latency_s=latency, request_id=state["request_id"])
            except Exception:  # metrics must never break serving
                log.exception("backend.observe failed")
