"""What every HTTP request passes through around its route: the request id (X-Request-Id) and
log line, a crash turned into an OpenAI 500, CORS for browsers, and the error handlers that answer
every error (BackendError, an unknown route, a bad body, a store that does not answer) with an
OpenAI error body. Installed by pd_runtime/entrypoints/openai/app.py: create_app.
"""

from __future__ import annotations

import json
import logging
import math
import secrets
import time

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pd_runtime.config import RouterConfig
from pd_runtime.entrypoints.openai.request_parsing.protocol import InvalidRequest
from pd_runtime.entrypoints.openai.streaming import ClientDisconnected
from pd_runtime.gateway.store import StoreUnavailable
from pd_runtime.router.backend import Backend, BackendError

log = logging.getLogger("router.http")

CLIENT_CLOSED_REQUEST = 499  # nginx's status for "the client went away"; only logs see it


def add_middleware(app: FastAPI, backend: Backend, router_config: RouterConfig) -> None:
    """Request ids and logs around every request; CORS, when configured, around that."""
    app.add_middleware(RequestLogMiddleware, backend=backend,
                       log_requests=router_config.log_requests)
    cors = router_config.cors
    if cors.allowed_origins:  # outermost: a preflight is answered before anything else runs
        app.add_middleware(CrossOrigin, allow_origins=cors.allowed_origins,
                           allow_credentials=cors.allow_credentials,
                           allow_methods=cors.allowed_methods,
                           allow_headers=cors.allowed_headers)


def error_response(error: BackendError) -> Response:
    headers = {}
    if error.retry_after_s is not None:  # Retry-After takes whole seconds
        headers["Retry-After"] = str(max(1, math.ceil(error.retry_after_s)))
    # ASCII-escaped JSON: a message quoting client text can never fail to encode.
    return Response(json.dumps(error.body()), status_code=error.status, headers=headers,
                    media_type="application/json")


def install_error_handlers(app: FastAPI) -> None:
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

    logged = [0.0]

    @app.exception_handler(StoreUnavailable)
    async def store_unavailable(request: Request, exc: StoreUnavailable):
        # An idempotency claim, a run's record or the usage ledger could not be read or
        # written: the client may send it again shortly (nothing was computed for it). The
        # driver's words (hosts, ports, index names) go to the log, not to clients.
        if time.monotonic() - logged[0] >= 10.0:
            logged[0] = time.monotonic()
            log.warning("the run store did not answer (%s): 503 to clients that need it", exc)
        return error_response(BackendError(
            503, "the run store is unavailable; send the request again shortly",
            code="store_unavailable", retry_after_s=2.0))

    @app.exception_handler(ClientDisconnected)
    async def disconnected(request: Request, exc: ClientDisconnected):
        return Response(status_code=CLIENT_CLOSED_REQUEST)


def _time_ordered_hex() -> str:
    """32 hex digits: the time in ns, then 64 random bits. Request ids (and so run ids) sort by
    time, which keeps the run store's inserts at the end of its indexes (random ids made every
    insert touch a random page: several times the writer's work once the store is large)."""
    return f"{time.time_ns():016x}{secrets.token_hex(8)}"


class CrossOrigin:
    """Starlette's CORS answers for requests that carry an Origin header (a browser's call);
    the others, every API client's, pass straight on: a scan of the raw header names, lost
    in the noise, where the CORS middleware's own parsing cost them 6-8 us of the router's
    ~270 us per completion (bench/router_overhead.py)."""

    def __init__(self, app: ASGIApp, **options):
        self.app = app
        self.cors = CORSMiddleware(app, **options)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and any(name == b"origin" for name, _ in scope["headers"]):
            return await self.cors(scope, receive, send)
        return await self.app(scope, receive, send)


class RequestLogMiddleware:
    """Gives every request an id (X-Request-Id), logs one line per request (id, method, path,
    status, latency) unless `log_requests` is off, reports it to the backend's metrics, and
    turns a crash into an OpenAI 500 body (pure ASGI: it neither buffers streams nor hides
    disconnects)."""

    def __init__(self, app: ASGIApp, backend: Backend, log_requests: bool = True):
        self.app = app
        self.backend = backend
        self.log_requests = log_requests

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start = time.perf_counter()
        hex_id = _time_ordered_hex()
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
            if self.log_requests:
                log.info("%s %s %s %d %.1fms", state["request_id"], scope.get("method"),
                         scope.get("path"), status, latency * 1e3)
            observe = getattr(self.backend, "observe", None)  # optional in the interface
            try:
                if observe is not None:
                    observe("http_request", path=path, method=scope.get("method"),
                            status=status, latency_s=latency, request_id=state["request_id"])
            except Exception:  # metrics must never break serving
                log.exception("backend.observe failed")
