"""The gateway through the router's HTTP API on 127.0.0.1: run records, Idempotency-Key (50
concurrent retries -> one run, one computation, one ledger row; another body -> 422), streams
resumed with Last-Event-ID byte for byte (while running and after), runs and usage per tenant.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest

from pd_runtime.config import RouterConfig
from pd_runtime.tokenizer import Tokenizer
from tests.router_support.gateway_clients import ACME, BETA, SSE, TENANTS
from tests.router_support.gateway_clients import TenantScripted as _TenantScripted
from tests.router_support.gateway_clients import config as _config
from tests.router_support.gateway_clients import events as _events
from tests.router_support.gateway_clients import recorder as _recorder
from tests.router_support.gateway_clients import words as _words
from tests.router_support.scripted_backend import token_chunk
from tests.router_support.serving import assert_error_body, local, serving

@pytest.fixture(scope="module")
def server(llama_dir, tmp_path_factory):
    store = str(tmp_path_factory.mktemp("runs") / "runs.sqlite3")
    with local(llama_dir, _config(store=store)) as served:
        yield served


def test_fifty_concurrent_retries_are_one_run_one_computation_one_ledger_row(server):
    backend, port = server
    base = f"http://127.0.0.1:{port}"
    body = {"model": backend.model_name, "prompt": "the same request, sent again",
            "max_tokens": 24, "temperature": 0}
    headers = {**ACME, "Idempotency-Key": "retry-1"}
    served_before = backend.served["requests"]

    async def retries():
        async with httpx.AsyncClient(timeout=60) as http:
            return await asyncio.gather(*(http.post(f"{base}/v1/completions", json=body,
                                                    headers=headers) for _ in range(50)))

    responses = asyncio.run(retries())
    assert {r.status_code for r in responses} == {200}
    bodies = {r.content for r in responses}
    assert len(bodies) == 1, "every retry gets the one run's response, byte for byte"
    run = json.loads(next(iter(bodies)))
    assert run["usage"]["completion_tokens"] == 24
    assert backend.served["requests"] - served_before == 1, "one computation"
    _recorder(port).writer.flush()
    record = httpx.get(f"{base}/v1/runs/{run['id']}", headers=ACME).json()
    assert record["state"] == "completed" and record["output_tokens"] == 24
    assert record["path"] == "colocated" and record["workers"] == ["decode-0"]
    usage = httpx.get(f"{base}/v1/usage", headers=ACME).json()
    assert usage["runs"] == 1 and usage["output_tokens"] == 24
    # A later retry replays it too; the same key with another body is a 422.
    again = httpx.post(f"{base}/v1/completions", json=body, headers=headers)
    assert again.content == next(iter(bodies))
    error = assert_error_body(httpx.post(f"{base}/v1/completions",
                                         json={**body, "max_tokens": 25}, headers=headers), 422)
    assert "different request body" in error["message"] and error["code"] == \
        "idempotency_key_reused"
    assert backend.served["requests"] - served_before == 1
    assert httpx.get(f"{base}/v1/usage", headers=ACME).json()["runs"] == 1
    # The key is the tenant's own: another tenant's same key is a run of its own.
    other = httpx.post(f"{base}/v1/completions", json=body,
                       headers={**BETA, "Idempotency-Key": "retry-1"})
    assert other.status_code == 200 and other.json()["id"] != run["id"]


def test_streamed_retries_follow_the_one_run_with_the_openai_client(server):
    backend, port = server
    served_before = backend.served["requests"]
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="sk-acme",
                           max_retries=0)

    def stream() -> list:
        chunks = client.completions.create(
            model=backend.model_name, prompt="stream me once", max_tokens=16, temperature=0,
            stream=True, extra_headers={"Idempotency-Key": "stream-1"})
        return [(c.id, c.choices[0].text) for c in chunks if c.choices]

    async def together():
        return await asyncio.gather(*(asyncio.to_thread(stream) for _ in range(8)))

    streams = asyncio.run(together())
    # Tokens a slow reader has not taken yet share an event (a loaded box sent 16 tokens in 3):
    # the same events for every retry, with the run's text in them.
    assert all(s == streams[0] for s in streams) and "".join(t for _, t in streams[0])
    assert backend.served["requests"] - served_before == 1


def test_a_stream_cut_after_k_events_resumes_byte_identical_after_it_ends(server):
    backend, port = server
    base = f"http://127.0.0.1:{port}"
    body = {"model": backend.model_name, "prompt": "resume after the end", "max_tokens": 12,
            "temperature": 0, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{base}/v1/completions", json=body, headers={**ACME, **SSE},
                      timeout=60) as response:
        uncut = response.read()
    events = _events(uncut)
    # Tokens the client has not read yet may share an event: at least one event and [DONE].
    assert len(events) >= 2 and events[-1].endswith(b"data: [DONE]\n\n"), uncut[-2000:]
    run_id = events[0].split(b"\n")[0][len(b"id: "):].rsplit(b":", 1)[0].decode()
    assert all(e.startswith(f"id: {run_id}:{i}\n".encode()) for i, e in enumerate(events))
    _recorder(port).writer.flush()
    assert httpx.get(f"{base}/v1/runs/{run_id}/events", headers=ACME).content == uncut
    for k in sorted({1, len(events) // 2, len(events) - 1, len(events)}):
        last = f"{run_id}:{k - 1}"
        resumed = httpx.post(f"{base}/v1/completions", json=body,
                             headers={**ACME, "Last-Event-ID": last}).content
        assert resumed == b"".join(events[k:])
        via_get = httpx.get(f"{base}/v1/runs/{run_id}/events",
                            headers={**ACME, "Last-Event-ID": last}).content
        assert via_get == b"".join(events[k:])
    # From the store alone (this process's buffer dropped), the same bytes.
    recorder = _recorder(port)
    recorder.forget(recorder.live[run_id])
    assert httpx.get(f"{base}/v1/runs/{run_id}/events?after=0",
                     headers=ACME).content == b"".join(events[1:])
    # Another tenant's run id is not there.
    assert_error_body(httpx.get(f"{base}/v1/runs/{run_id}", headers=BETA), 404)
    assert_error_body(httpx.get(f"{base}/v1/runs/{run_id}/events", headers=BETA), 404)
    assert_error_body(httpx.post(f"{base}/v1/completions", json=body,
                                 headers={**BETA, "Last-Event-ID": f"{run_id}:3"}), 404)


def test_a_stream_cut_while_running_resumes_with_the_remaining_events(llama_dir, tmp_path):
    script = _words(39, then_end=True)
    backend = _TenantScripted(Tokenizer(llama_dir), script, step_s=0.05)
    config = _config(store=str(tmp_path / "runs.sqlite3"), detach_grace_s=30)
    with serving(backend, config) as (_, port):
        base = f"http://127.0.0.1:{port}"
        body = {"model": "scripted", "prompt": "x", "max_tokens": 40, "stream": True}
        headers = {**ACME, "Idempotency-Key": "cut-1"}
        whole: list[bytes] = []

        def follow_uncut():
            with httpx.stream("POST", f"{base}/v1/completions", json=body, headers=headers,
                              timeout=60) as response:
                whole.append(response.read())

        stored: dict = {}

        async def scenario():
            uncut = asyncio.create_task(asyncio.to_thread(follow_uncut))
            cut: list[bytes] = []
            async with httpx.AsyncClient(timeout=60) as http:
                async with http.stream("POST", f"{base}/v1/completions", json=body,
                                       headers=headers) as response:
                    buffer = b""
                    async for part in response.aiter_bytes():
                        buffer += part
                        if buffer.count(b"\n\n") >= 7:
                            break  # the connection is cut here
                cut = _events(buffer)[:7]
                state = (await http.get(f"{base}/v1/runs/{_run_id(cut[0])}",
                                        headers=ACME)).json()["state"]
                # The record follows a run in flight, not only its end.
                await asyncio.to_thread(_recorder(port).writer.flush)
                stored.update(_recorder(port).store.get_run(_run_id(cut[0])))
                last = cut[-1].split(b"\n")[0][len(b"id: "):].decode()
                async with http.stream("POST", f"{base}/v1/completions", json=body,
                                       headers={**headers, "Last-Event-ID": last}) as response:
                    rest = await response.aread()
            await uncut
            return cut, state, rest

        cut, state, rest = asyncio.run(scenario())
        assert state == "streaming", "the cut and the resume happened while the run ran"
        assert b"".join(cut) + rest == whole[0]
        assert len(_events(whole[0])) == 41 and backend.calls == 1
        recorder = _recorder(port)
        recorder.writer.flush()  # written to the store too, though its chunks name no workers
        assert stored["state"] == "streaming" and stored["ended_at"] is None
        assert recorder.store.get_run(_run_id(cut[0]))["state"] == "completed"
        steps = recorder.store.transitions(_run_id(cut[0]))
        assert [s for s, _ in steps] == ["queued", "prefilling", "streaming", "completed"]
        assert [t for _, t in steps] == sorted(t for _, t in steps)
        assert steps[2][1] == stored["streaming_at"]
        assert recorder.writer.failures == 0


def test_a_client_gone_without_a_key_cancels_its_run(llama_dir, tmp_path):
    script = _words(1000)
    backend = _TenantScripted(Tokenizer(llama_dir), script, step_s=0.01)
    with serving(backend, _config(store=str(tmp_path / "runs.sqlite3"))) as (_, port):
        base = f"http://127.0.0.1:{port}"
        with httpx.stream("POST", f"{base}/v1/completions", headers={**ACME, **SSE}, timeout=10,
                          json={"prompt": "x", "stream": True, "max_tokens": 100}) as response:
            first = next(line for line in response.iter_lines() if line.startswith("id:"))
        run_id = first[len("id: "):].rsplit(":", 1)[0]
        end = time.monotonic() + 5
        while not backend.closed and time.monotonic() < end:
            time.sleep(0.01)
        assert backend.closed, "the backend stream was closed (the request aborted)"
        _recorder(port).writer.flush()
        record = httpx.get(f"{base}/v1/runs/{run_id}", headers=ACME).json()
        assert record["state"] == "cancelled"
        assert httpx.get(f"{base}/v1/usage", headers=ACME).json()["runs"] == 0


def test_a_run_cut_before_its_production_began_is_recorded_ended(llama_dir, tmp_path):
    """A request timeout so short that the response gives up before the run's producer takes
    its first step (or just after): the run still ends, failed by the deadline (not taken for
    a client that left, though a clock read in the run may not yet show the deadline passed),
    in memory and in the store, and the writer holds no run open."""
    script = [token_chunk(" a", 1), token_chunk(" b", 2, finished=True)]
    backend = _TenantScripted(Tokenizer(llama_dir), script, step_s=0)
    config = RouterConfig(tenants=TENANTS, routing={"mode": "always_colocated"},
                          request_timeout_s=1e-9, runs={"store": str(tmp_path / "r.sqlite3")})
    with serving(backend, config) as (_, port):
        for _ in range(2):
            response = httpx.post(f"http://127.0.0.1:{port}/v1/completions", headers=ACME,
                                  json={"prompt": "x"})
            assert_error_body(response, 504)
        recorder = _recorder(port)
        recorder.writer.flush()
        ended = [live for live in recorder.live.values()]
        assert len(ended) == 2 and all(live.done and live.state == "failed" for live in ended), [
            (live.state, str(live.error)) for live in ended]
        assert not recorder.writer._open
        for live in ended:
            assert recorder.store.get_run(live.id)["state"] == "failed"


def test_records_off_serves_as_before_and_says_runs_are_off(llama_dir):
    script = [token_chunk(" a", 1), token_chunk(" b", 2, finished=True)]
    backend = _TenantScripted(Tokenizer(llama_dir), script, step_s=0)
    with serving(backend, _config(enabled=False)) as (_, port):
        base = f"http://127.0.0.1:{port}"
        raw = httpx.post(f"{base}/v1/completions", headers=ACME,
                         json={"prompt": "x", "stream": True}).content
        assert b"id: " not in raw and raw.endswith(b"data: [DONE]\n\n")
        assert_error_body(httpx.get(f"{base}/v1/usage", headers=ACME), 404)


def test_a_plain_client_gets_data_lines_only_and_can_still_resume_by_count(server):
    """Clients written for the OpenAI API often parse each line as `data: ...`: without an
    Idempotency-Key or Accept: text/event-stream there are no `id:` lines; the run can still be
    replayed after the n-th event by GET /v1/runs/{id}/events?after=n."""
    backend, port = server
    base = f"http://127.0.0.1:{port}"
    raw = httpx.post(f"{base}/v1/completions", headers=ACME, timeout=60,
                     json={"model": backend.model_name, "prompt": "plain", "max_tokens": 6,
                           "temperature": 0, "stream": True, "ignore_eos": True}).content
    events = _events(raw)
    assert all(e.startswith(b"data: ") for e in events) and b"\nid: " not in raw
    run_id = json.loads(events[0][len(b"data: "):])["id"]
    _recorder(port).writer.flush()
    assert httpx.get(f"{base}/v1/runs/{run_id}/events?after=0",
                     headers=ACME).content == b"".join(events[1:])


def _run_id(event: bytes) -> str:
    return event.split(b"\n")[0][len(b"id: "):].rsplit(b":", 1)[0].decode()


def test_a_keyed_run_cut_by_its_grace_replays_as_cut_and_one_cut_before_output_runs_anew(
        llama_dir, tmp_path):
    """A keyed client gone for longer than detach_grace_s: a run cancelled mid-stream replays
    with an error event and [DONE] (not a clean-looking partial 200); one cancelled before any
    output frees its key, so the retry computes it (not an empty 200)."""
    script = _words(30, then_end=True)
    backend = _TenantScripted(Tokenizer(llama_dir), script, step_s=0.1)
    config = _config(store=str(tmp_path / "runs.sqlite3"), detach_grace_s=0.3)
    with serving(backend, config) as (_, port):
        base = f"http://127.0.0.1:{port}"
        body = {"model": "scripted", "prompt": "x", "max_tokens": 40, "stream": True}
        mid = {**ACME, "Idempotency-Key": "cut-mid"}
        with httpx.stream("POST", f"{base}/v1/completions", json=body, headers=mid,
                          timeout=30) as response:
            next(line for line in response.iter_lines() if line.startswith("data: {"))
        time.sleep(1.0)  # past the grace: cancelled
        replay = httpx.post(f"{base}/v1/completions", json=body, headers=mid).content
        events = _events(replay)
        assert b'"code":"run_cancelled"' in events[-2] and events[-1].endswith(
            b"data: [DONE]\n\n")
        assert backend.calls == 1
        early = {**ACME, "Idempotency-Key": "cut-early"}
        backend.script = [token_chunk(" late", 1, finished=True)]
        backend.step_s = 1.5  # the first chunk comes after the client and its grace are gone
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{base}/v1/completions", json=body, headers=early, timeout=0.2)
        time.sleep(1.0)
        backend.step_s = 0.0
        again = httpx.post(f"{base}/v1/completions", json=body, headers=early, timeout=30)
        assert again.status_code == 200 and b" late" in again.content and backend.calls == 3
        assert_error_body(httpx.get(f"{base}/v1/runs/{_run_id(events[0])}/events?after=-3",
                                    headers=ACME), 400, param="after")


def test_runs_still_going_at_shutdown_are_recorded_cancelled(llama_dir, tmp_path):
    from pd_runtime.gateway.stores.sqlite import SqliteRunStore

    store = tmp_path / "runs.sqlite3"
    script = _words(100)
    backend = _TenantScripted(Tokenizer(llama_dir), script, step_s=0.05)
    with serving(backend, _config(store=str(store), detach_grace_s=60)) as (_, port):
        with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", timeout=30,
                          json={"prompt": "x", "max_tokens": 100, "stream": True},
                          headers={**ACME, "Idempotency-Key": "at-shutdown"}) as response:
            first = next(line for line in response.iter_lines() if line.startswith("id: "))
    # The client left (a 60 s grace: still running) and then the server stopped.
    reader = SqliteRunStore(store)
    try:
        record = reader.get_run(first[len("id: "):].rsplit(":", 1)[0])
        assert record["state"] == "cancelled", record
    finally:
        reader.close()
    assert backend.closed, "the backend request was aborted"


def test_a_claim_cancelled_during_its_store_write_frees_the_key(tmp_path):
    from pd_runtime.gateway.stores.sqlite import SqliteRunStore
    from pd_runtime.gateway.recorder import RunRecorder

    path = tmp_path / "runs.sqlite3"
    recorder = RunRecorder(SqliteRunStore(path), str(path), "owner-0")
    insert = recorder.store.insert_run

    def slow_insert(run):  # the write is under way when the request is cancelled
        time.sleep(0.3)
        return insert(run)

    recorder.store.insert_run = slow_insert

    async def scenario():
        claim = asyncio.ensure_future(recorder.open("run-abandoned", "acme", True, "k-1",
                                                    {"prompt": "x"}))
        await asyncio.sleep(0.05)
        claim.cancel()
        with pytest.raises(asyncio.CancelledError):
            await claim
        await asyncio.sleep(0.6)  # the write finishes in its thread; the run is let go

    try:
        asyncio.run(scenario())
        recorder.writer.flush()
        record = recorder.store.get_run("run-abandoned")
        assert record["state"] == "cancelled" and record["idempotency_key"] is None
    finally:
        recorder.close()


def test_the_record_writers_health_is_in_the_metrics(server):
    backend, port = server
    httpx.post(f"http://127.0.0.1:{port}/v1/completions", headers=ACME, timeout=60,
               json={"model": backend.model_name, "prompt": "metrics", "max_tokens": 2})
    _recorder(port).writer.flush()
    text = httpx.get(f"http://127.0.0.1:{port}/metrics").text
    for line in ("pd_run_records_failures_total 0.0", "pd_run_records_waiting 0.0",
                 'pd_run_records_dropped_total{what="runs"} 0.0',
                 'pd_run_records_dropped_total{what="outputs"} 0.0'):
        assert line in text.splitlines(), line
    assert "pd_requests_total" in text, "the router's own metrics are still there"


def test_an_idempotency_key_longer_than_an_id_is_a_400(server):
    backend, port = server
    body = {"model": backend.model_name, "prompt": "k", "max_tokens": 1}
    error = assert_error_body(httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body,
                                         headers={**ACME, "Idempotency-Key": "k" * 256}), 400)
    assert error["param"] == "Idempotency-Key" and "at most 255" in error["message"]
    ok = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body,
                    headers={**ACME, "Idempotency-Key": "k" * 255}, timeout=60)
    assert ok.status_code == 200


def test_usage_asked_right_after_a_request_counts_it(server):
    """The ledger is written by the record writer's next round; /v1/usage waits for it, so a
    client reading its usage the moment its response ended sees the request."""
    backend, port = server
    base = f"http://127.0.0.1:{port}"
    before = httpx.get(f"{base}/v1/usage", headers=BETA).json()["runs"]
    with httpx.Client(base_url=base, headers=BETA, timeout=60) as http:
        for i in range(3):
            done = http.post("/v1/completions", json={"model": backend.model_name,
                                                      "prompt": f"count me {i}", "max_tokens": 2})
            assert done.status_code == 200
            assert http.get("/v1/usage").json()["runs"] == before + i + 1
