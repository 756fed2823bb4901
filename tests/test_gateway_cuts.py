"""How a run without an Idempotency-Key ends when its response is cut at an awkward moment:
each cut recorded once, in the state it deserves (failed for the backend, a defect or the
deadline; cancelled for a client that left), and the backend stream closed in every case."""

from __future__ import annotations

import asyncio
import gc
import json
import time
from contextlib import aclosing

import httpx
import pytest

from pd_runtime.config import RouterConfig, TenantConfig
from pd_runtime.entrypoints.openai.app import create_app
from pd_runtime.router.tenants import Tenants
from pd_runtime.tokenizer import Tokenizer
from tests.router_support.scripted_backend import ScriptedBackend, token_chunk
from tests.router_support.serving import APPS, serving

TENANTS = [TenantConfig(tenant_id="acme", api_key="sk-acme")]
ACME = {"Authorization": "Bearer sk-acme"}
SCRIPT = [token_chunk(" a", 1), token_chunk(" b", 2), token_chunk(" c", 3, finished=True)]


class _Failing(ScriptedBackend):
    """The script, with `fault` raised in place of chunk number `at` (None: never)."""

    def __init__(self, tokenizer, at=None, fault=None, step_s: float = 0.0):
        super().__init__(tokenizer, SCRIPT, step_s=step_s)
        self.tenants = Tenants(TENANTS)
        self.at, self.fault = at, fault

    def authenticate(self, api_key):
        return self.tenants.authenticate(api_key)

    async def generate(self, *args, **kwargs):
        async with aclosing(super().generate(*args, **kwargs)) as chunks:
            number = 0
            async for chunk in chunks:
                if number == self.at:
                    raise self.fault
                number += 1
                yield chunk


def _config(tmp_path, **router) -> RouterConfig:
    return RouterConfig(tenants=TENANTS, routing={"mode": "always_colocated"},
                        runs={"store": str(tmp_path / "runs.sqlite3")}, **router)


def _settled(recorder, timeout_s: float = 5.0) -> list:
    end = time.monotonic() + timeout_s
    while not all(live.done for live in recorder.live.values()) and time.monotonic() < end:
        time.sleep(0.02)
    return list(recorder.live.values())


@pytest.mark.parametrize("stream", [False, True])
def test_a_backend_connection_error_before_any_token_is_a_failed_run(llama_dir, tmp_path,
                                                                      stream):
    """Nothing was sent yet, so an OSError is the backend's (a worker's connection reset),
    not a client that left."""
    backend = _Failing(Tokenizer(llama_dir), at=0, fault=ConnectionResetError("reset"))
    with serving(backend, _config(tmp_path)) as (_, port):
        response = httpx.post(f"http://127.0.0.1:{port}/v1/completions", headers=ACME,
                              json={"prompt": "x", "stream": stream})
        assert response.status_code == 500
        runs = _settled(APPS[port].state.recorder)
        assert [(r.state, r.info.get("error")) for r in runs] == [("failed", "internal error")]


def test_a_defect_mid_stream_is_a_failed_run_and_its_replay_says_so(llama_dir, tmp_path,
                                                                     monkeypatch):
    from pd_runtime.entrypoints.openai import completion_bodies

    def broken(self):
        raise RuntimeError("a defect in the usage event")

    monkeypatch.setattr(completion_bodies.ResponseBuilder, "usage_event", broken)
    backend = _Failing(Tokenizer(llama_dir))
    with serving(backend, _config(tmp_path)) as (_, port):
        with pytest.raises(httpx.HTTPError):  # the stream breaks off, as with records off
            httpx.post(f"http://127.0.0.1:{port}/v1/completions",
                       headers={**ACME, "Accept": "text/event-stream"},
                       json={"prompt": "x", "stream": True,
                             "stream_options": {"include_usage": True}}).read()
        (run,) = _settled(APPS[port].state.recorder)
        assert run.state == "failed" and run.info["error"] == "internal error while streaming"
        assert b"internal error while streaming" in run.events[-2]
        assert run.events[-1].endswith(b"data: [DONE]\n\n")


def _drive(app, body: dict, send_hook, receive_hook=None, after=None) -> list[dict]:
    """One POST /v1/completions straight into the ASGI app; `send_hook(message)` runs before
    each message is taken, `receive_hook()` answers every receive after the body, `after()`
    runs as the app returns (before the loop closes what was left open)."""
    raw = json.dumps(body).encode()
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": "/v1/completions",
             "raw_path": b"/v1/completions", "query_string": b"", "root_path": "",
             "headers": [(b"content-type", b"application/json"),
                         (b"authorization", b"Bearer sk-acme"),
                         (b"accept", b"text/event-stream")],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80)}
    sent: list[dict] = []

    async def main() -> None:
        delivered = False

        async def receive():
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": raw, "more_body": False}
            if receive_hook is not None:
                return await receive_hook()
            await asyncio.get_running_loop().create_future()  # the client stays

        async def send(message):
            await send_hook(message)
            sent.append(message)

        gc.disable()  # nothing closed by a collection meanwhile
        try:
            await app(scope, receive, send)
            if after is not None:
                after()
        finally:
            gc.enable()

    asyncio.run(main())
    return sent


def test_a_deadline_while_the_last_event_waits_to_be_sent_is_a_failed_run(llama_dir,
                                                                         tmp_path):
    """Every event was produced, but the client (a slow reader) got a 504 in place of [DONE]:
    not billed as completed."""
    app = create_app(_Failing(Tokenizer(llama_dir)), _config(tmp_path, request_timeout_s=0.5),
                     owner="cuts-deadline")

    async def slow_reader(message):
        if b"[DONE]" in message.get("body", b""):
            await asyncio.sleep(1.0)

    try:
        sent = _drive(app, {"prompt": "x", "stream": True}, slow_reader)
        client = b"".join(m.get("body", b"") for m in sent)
        assert b"request_timeout" in client
        (run,) = list(app.state.recorder.live.values())
        assert run.state == "failed" and "request_timeout_s" in run.info["error"]
    finally:
        app.state.recorder.close()


def test_a_response_cut_before_it_sends_anything_closes_the_backend_stream(llama_dir,
                                                                           tmp_path):
    """The response start stalls (a paused transport) and the client leaves meanwhile: the
    backend request is aborted and the run cancelled when the response returns."""
    backend = _Failing(Tokenizer(llama_dir), step_s=0.05)
    app = create_app(backend, _config(tmp_path), owner="cuts-start")
    started = asyncio.Event()

    async def stall_start(message):
        if message["type"] == "http.response.start":
            started.set()
            await asyncio.sleep(10)

    async def leave_once_started():
        await started.wait()
        return {"type": "http.disconnect"}

    closed_on_return = []
    try:
        _drive(app, {"prompt": "x", "stream": True}, stall_start, leave_once_started,
               after=lambda: closed_on_return.extend(backend.closed))
        assert len(closed_on_return) == 1
        (run,) = list(app.state.recorder.live.values())
        assert run.state == "cancelled"
    finally:
        app.state.recorder.close()
