"""The HTTP front door: OpenAI completions and chat (streaming and not), models, health, readiness,
metrics, the active router config and vLLM's tokenizer endpoints
(pd_runtime/entrypoints/openai/tokenize_api.py), served through a Backend
(pd_runtime/router/backend.py).

Every response carries X-Request-Id and every error an OpenAI error body
(pd_runtime/entrypoints/openai/middleware.py); user input never yields a 500. Request flow: auth -> read (size limit) -> parse and validate
(pd_runtime/entrypoints/openai/request_parsing/intake.py, off the event loop for large bodies) -> n backend streams
-> SSE or JSON (pd_runtime/entrypoints/openai/generation.py); the run endpoints read
pd_runtime/gateway/recorder.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import time
from typing import Optional

from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import Response

from pd_runtime.config import RouterConfig
from pd_runtime.entrypoints.openai import tokenize_api
from pd_runtime.entrypoints.openai.responses import stored as responses_stored
from pd_runtime.entrypoints.openai.generation import (bearer_key, generation, no_run, respond,
                                                      tenant_name)
from pd_runtime.entrypoints.openai.request_parsing.intake import Intake, int_param
from pd_runtime.entrypoints.openai.middleware import add_middleware, install_error_handlers
from pd_runtime.entrypoints.openai.request_parsing.protocol import InvalidRequest
from pd_runtime.gateway.live_run import parse_event_id
from pd_runtime.gateway.record_writer import RunRecordMetrics
from pd_runtime.gateway.recorder import RunRecorder, owner_name
from pd_runtime.router.backend import Backend, BackendError

log = logging.getLogger("router.http")


def open_recorder(router_config: RouterConfig, owner: Optional[str] = None
                  ) -> Optional[RunRecorder]:
    """The run recorder `router.runs` asks for (None when records are off)."""
    runs = router_config.runs
    if not runs.enabled:
        return None
    from pd_runtime.gateway.open import open_store

    return RunRecorder(open_store(runs.store), runs.store,
                       owner or owner_name(router_config.host, router_config.port),
                       runs.detach_grace_s, runs.keep_finished, runs.event_ids,
                       runs.owner_lease_s, runs.keep_outputs_s, runs.keep_runs_s)


def create_app(backend: Backend, router_config: RouterConfig,
               recorder: Optional[RunRecorder] = None, owner: Optional[str] = None) -> FastAPI:
    """`recorder`: run records (default: the store router.runs names, owned by `owner`: this
    router's name as the next start of it will know it, by default host:port)."""
    intake = Intake(backend, router_config.max_request_body_bytes)
    owner = owner or owner_name(router_config.host, router_config.port)
    if recorder is None:
        recorder = open_recorder(router_config, owner)
    app = _new_app(intake, recorder)
    add_middleware(app, backend, router_config)
    install_error_handlers(app)
    timeout_s = router_config.request_timeout_s
    _add_generation_routes(app, backend, intake, recorder, timeout_s)
    _add_stored_response_routes(app, backend, recorder, timeout_s)
    _add_run_routes(app, backend, recorder, timeout_s)
    _add_model_routes(app, backend, intake)
    _add_router_routes(app, backend, router_config)
    _add_health_routes(app, backend, recorder, owner)
    return app


def _new_app(intake: Intake, recorder: Optional[RunRecorder]) -> FastAPI:
    """The app, whose shutdown closes the body parser and drains the run records."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        try:
            yield
        finally:
            intake.close()
            if recorder is not None:
                await recorder.shutdown()

    app = FastAPI(title="pd-runtime", docs_url=None, redoc_url=None, openapi_url=None,
                  lifespan=lifespan)
    app.state.intake = intake  # for servers that run the app without its lifespan
    app.state.recorder = recorder
    return app


def _add_generation_routes(app: FastAPI, backend: Backend, intake: Intake,
                           recorder: Optional[RunRecorder], timeout_s: float) -> None:
    """OpenAI completions, chat completions and responses: each request a run."""

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await generation(request, backend, intake, "completion", timeout_s, recorder)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await generation(request, backend, intake, "chat", timeout_s, recorder)

    @app.post("/v1/responses")
    async def responses(request: Request):
        return await generation(request, backend, intake, "responses", timeout_s, recorder)


def _add_stored_response_routes(app: FastAPI, backend: Backend,
                                recorder: Optional[RunRecorder], timeout_s: float) -> None:
    """A stored response after its request (pd_runtime/entrypoints/openai/responses/stored.py)."""

    @app.get("/v1/responses/{response_id}")
    async def stored_response(request: Request, response_id: str):
        """A stored response (sent with store: true, the default) once it has ended, or its
        events again (stream=true, after starting_after)."""
        tenant = tenant_name(backend.authenticate(bearer_key(request)))
        deadline = asyncio.get_running_loop().time() + timeout_s
        return await responses_stored.retrieve(request, _records(recorder), tenant,
                                               response_id, deadline)

    @app.get("/v1/responses/{response_id}/input_items")
    async def response_input_items(request: Request, response_id: str):
        tenant = tenant_name(backend.authenticate(bearer_key(request)))
        return await responses_stored.input_items(request, _records(recorder), tenant,
                                                  response_id)

    @app.post("/v1/responses/{response_id}/cancel")
    async def cancel_response(request: Request, response_id: str):
        tenant = tenant_name(backend.authenticate(bearer_key(request)))
        return await responses_stored.cancel(_records(recorder), tenant, response_id)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(request: Request, response_id: str):
        tenant = tenant_name(backend.authenticate(bearer_key(request)))
        return await responses_stored.delete(_records(recorder), tenant, response_id)


def _add_run_routes(app: FastAPI, backend: Backend, recorder: Optional[RunRecorder],
                    timeout_s: float) -> None:
    """The caller's runs (their records and streams again) and usage ledger."""

    @app.get("/v1/runs/{run_id}")
    async def run_record(request: Request, run_id: str):
        """The caller's own run: its state, routing, token counts, workers, error."""
        tenant = tenant_name(backend.authenticate(bearer_key(request)))
        record = await _records(recorder).record(run_id, tenant)
        if record is None:
            raise no_run(run_id)
        return {"object": "run", **record}

    @app.get("/v1/runs/{run_id}/events")
    async def run_events(request: Request, run_id: str):
        """The run's stream again, after `Last-Event-ID` (or ?after=<seq>): from its buffer
        while it runs, from its record once it is over; a non-streamed run's JSON body."""
        tenant = tenant_name(backend.authenticate(bearer_key(request)))
        live = await _records(recorder).find(run_id, tenant)
        if live is None:
            raise no_run(run_id)
        after = parse_event_id(request.headers.get("last-event-id"))
        seq = after[1] if after and after[0] == run_id else int_param(request, "after", -1)
        if seq < -1:
            raise InvalidRequest("after must be -1 (the whole stream) or an event's number",
                                 param="after")
        deadline = asyncio.get_running_loop().time() + timeout_s
        return await respond(recorder, live, request, seq, deadline)

    @app.get("/v1/usage")
    async def usage(request: Request):
        """The caller's own usage ledger totals over [start_time, end_time) (unix seconds)."""
        tenant = tenant_name(backend.authenticate(bearer_key(request)))
        start = _float_param(request, "start_time", 0.0)
        end = _float_param(request, "end_time", time.time() + 1)
        records = _records(recorder)
        # What this router served so far is in the ledger first (its writer's next round, a
        # few ms; bounded when the store is slow): a client counts the request it just made.
        await asyncio.to_thread(records.writer.flush, 2.0)
        totals = await asyncio.to_thread(records.runs.usage, tenant, start, end)
        return {"object": "usage", "tenant": tenant, "start_time": start, "end_time": end,
                **totals}


def _add_model_routes(app: FastAPI, backend: Backend, intake: Intake) -> None:
    """The served model (OpenAI's /v1/models) and vLLM's tokenizer endpoints."""

    @app.get("/v1/models")
    async def models(request: Request):
        backend.authenticate(bearer_key(request))
        return {"object": "list", "data": [_model_card(backend)]}

    @app.get("/v1/models/{model:path}")
    async def model(request: Request, model: str):
        backend.authenticate(bearer_key(request))
        if model != backend.model_name:
            raise BackendError(404, f"the model {model!r} does not exist", param="model",
                               code="model_not_found")
        return _model_card(backend)

    @app.post("/tokenize")
    async def tokenize(request: Request):
        backend.authenticate(bearer_key(request))
        return await tokenize_api.tokenize(await intake.read_body(request), backend)

    @app.post("/detokenize")
    async def detokenize(request: Request):
        backend.authenticate(bearer_key(request))
        return tokenize_api.detokenize(await intake.read_body(request), backend)

    @app.get("/tokenizer_info")
    async def tokenizer_info(request: Request):
        backend.authenticate(bearer_key(request))
        return tokenize_api.tokenizer_info(backend)


def _add_router_routes(app: FastAPI, backend: Backend, router_config: RouterConfig) -> None:
    """The router's active config and its workers' reports; the development endpoints when
    asked for."""

    @app.get("/v1/router/config")
    async def router_config_view(request: Request):
        backend.authenticate(bearer_key(request))
        return backend.active_config()

    @app.get("/v1/router/workers")
    async def router_workers(request: Request):
        """Each worker's latest load report as the router's live cost model reads it (what
        `pd-runtime profile --url` calibrates the planner from)."""
        backend.authenticate(bearer_key(request))
        return {"workers": backend.worker_reports(), "router": backend.host_report()}

    if router_config.dev_endpoints or os.environ.get("VLLM_SERVER_DEV_MODE") == "1":
        _add_dev_routes(app, backend)


def _add_dev_routes(app: FastAPI, backend: Backend) -> None:
    log.warning("development endpoints are on: any client the router admits can empty "
                "every worker's prefix cache (POST /reset_prefix_cache)")

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache(request: Request):
        """vLLM's development endpoint (load generators' cold start): every worker's prefix
        cache emptied; answers each worker's forgotten blocks (null: it did not answer)."""
        backend.authenticate(bearer_key(request))
        workers = await backend.reset_prefix_cache()
        if not any(n is not None for n in workers.values()):
            raise BackendError(503, "no worker answered", code="not_ready")
        return {"workers": workers}


def _add_health_routes(app: FastAPI, backend: Backend, recorder: Optional[RunRecorder],
                       owner: str) -> None:
    """Health, version, readiness and Prometheus metrics (the router's, the run records')."""

    @app.get("/health")
    async def health():
        return {"status": "ok", **backend.health(), "router": owner}

    @app.get("/version")
    async def version():
        return {"version": _VERSION}  # as vLLM's /version: the server's package version

    @app.get("/ready")
    async def ready():
        if not backend.ready():
            raise BackendError(503, "no worker can serve requests yet", code="not_ready")
        return {"status": "ready"}

    records = RunRecordMetrics(recorder.writer) if recorder is not None else None

    @app.get("/metrics")
    async def metrics():
        from prometheus_client import CONTENT_TYPE_LATEST

        text = backend.metrics_text() + (records.text() if records is not None else b"")
        return Response(text, media_type=CONTENT_TYPE_LATEST)


def _model_card(backend: Backend) -> dict:
    return {"id": backend.model_name, "object": "model", "created": 0, "owned_by": "pd-runtime",
            "max_model_len": backend.max_model_len}


# ---------------------------------------------------------------------------------- plumbing
def _records(recorder: Optional[RunRecorder]) -> RunRecorder:
    if recorder is None:
        raise BackendError(404, "run records are off (router.runs.enabled: false)",
                           code="runs_disabled")
    return recorder


def _float_param(request: Request, name: str, default: float) -> float:
    value = request.query_params.get(name)
    if value is None:
        return default
    try:
        number = float(value)
    except ValueError:
        number = math.nan
    if not math.isfinite(number):
        raise InvalidRequest(f"{name} must be a number (unix seconds)", param=name)
    return number


def _package_version() -> str:
    from importlib import metadata

    try:
        return metadata.version("pd-runtime")
    except metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown"


_VERSION = _package_version()
