"""Router replicas sharing one run store: a retry landing on another replica keeps the run going
and gets it whole; a stream resumed there flows as it is produced (its events published to the
store while it is followed); one whose producer stops ends saying so."""

from __future__ import annotations

import asyncio
import contextlib

import httpx

from pd_runtime.tokenizer import Tokenizer
from tests.router_support.gateway_clients import ACME, SSE
from tests.router_support.gateway_clients import TenantScripted as _TenantScripted
from tests.router_support.gateway_clients import config as _config
from tests.router_support.gateway_clients import events as _events
from tests.router_support.gateway_clients import recorder as _recorder
from tests.router_support.gateway_clients import words as _words
from tests.router_support.serving import serving


@contextlib.contextmanager
def _two_replicas(llama_dir, tmp_path, words: int, detach_grace_s: float):
    """Two routers on one store (replicas A and B), each over a backend pacing `words` words
    10 a second: (A's backend, A's port, B's backend, B's port)."""
    script = _words(words, then_end=True)
    config = _config(store=str(tmp_path / "runs.sqlite3"), detach_grace_s=detach_grace_s)
    a_backend = _TenantScripted(Tokenizer(llama_dir), script, step_s=0.1)
    b_backend = _TenantScripted(Tokenizer(llama_dir), script, step_s=0.1)
    with serving(a_backend, config) as (_, a_port), serving(b_backend, config) as (_, b_port):
        yield a_backend, a_port, b_backend, b_port


def test_a_retry_that_lands_on_another_replica_keeps_the_run_going(llama_dir, tmp_path):
    """Two routers on one store (replicas): the client leaves replica A's keyed stream and
    retries on replica B. B follows the run through the store and marks it followed, so A does
    not cancel it when the grace runs out; B answers with the whole stream."""
    with _two_replicas(llama_dir, tmp_path, 24, 0.3) as (a_backend, a_port, b_backend, b_port):
        body = {"model": "scripted", "prompt": "x", "max_tokens": 40, "stream": True}
        headers = {**ACME, "Idempotency-Key": "across"}
        with httpx.stream("POST", f"http://127.0.0.1:{a_port}/v1/completions", json=body,
                          headers=headers, timeout=30) as response:
            next(line for line in response.iter_lines() if line.startswith("data: {"))
        retried = httpx.post(f"http://127.0.0.1:{b_port}/v1/completions", json=body,
                             headers=headers, timeout=60)
        events = _events(retried.content)
        assert retried.status_code == 200 and len(events) == 26, retried.content[-500:]
        assert events[-1].endswith(b"data: [DONE]\n\n") and b"run_cancelled" not in \
            retried.content
        assert a_backend.calls == 1 and b_backend.calls == 0


def test_a_stream_resumed_on_another_replica_flows_while_the_run_goes_on(llama_dir, tmp_path):
    """A client cut from replica A's stream resumes on replica B (Last-Event-ID): B marks the
    run followed, A publishes its events to the store from then on, and B passes them on as
    they come, not at the run's end; the whole is byte for byte the uncut stream."""
    with _two_replicas(llama_dir, tmp_path, 30, 5.0) as (a_backend, a_port, b_backend, b_port):
        body = {"model": "scripted", "prompt": "x", "max_tokens": 40, "stream": True}
        headers = {**ACME, **SSE, "Idempotency-Key": "flows"}
        with httpx.stream("POST", f"http://127.0.0.1:{a_port}/v1/completions", json=body,
                          headers=headers, timeout=30) as response:
            first = next(line for line in response.iter_lines() if line.startswith("id: "))
        run_id, seq = first[len("id: "):].rsplit(":", 1)
        producer = _recorder(a_port).live[run_id]
        resumed, done_when_seen = [], []
        with httpx.stream("POST", f"http://127.0.0.1:{b_port}/v1/completions", json=body,
                          headers={**headers, "Last-Event-ID": f"{run_id}:{seq}"},
                          timeout=60) as response:
            assert response.status_code == 200
            for chunk in response.iter_bytes():
                resumed.append(chunk)
                done_when_seen.append(producer.done)
        assert done_when_seen[0] is False, "B's first bytes came only after A's run ended"
        _recorder(a_port).writer.flush()
        whole = httpx.get(f"http://127.0.0.1:{b_port}/v1/runs/{run_id}/events",
                          headers=ACME).content
        events = _events(whole)
        assert len(events) == 32 and events[-1].endswith(b"data: [DONE]\n\n")
        assert b"".join(resumed) == b"".join(events[int(seq) + 1:])
        assert a_backend.calls == 1 and b_backend.calls == 0
        store = _recorder(a_port).store
        assert store.events_after(run_id, -1) == [], "published events go with the run's end"


def _recorders(tmp_path):
    """owner -> a run recorder of that replica, all on one SQLite store."""
    from pd_runtime.gateway.stores.sqlite import SqliteRunStore
    from pd_runtime.gateway.recorder import RunRecorder

    path = tmp_path / "runs.sqlite3"
    return lambda owner: RunRecorder(SqliteRunStore(path), f"sqlite://{path}", owner)


async def _streaming(recorder, run_id: str, body: dict):
    """A keyed run of `recorder`'s replica, streaming."""
    live, _ = await recorder.open(run_id, "acme", True, "k", body)
    recorder.advance(live, "prefilling")
    recorder.advance(live, "streaming")
    return live


def test_a_followed_stream_whose_producer_stops_ends_saying_so(tmp_path):
    """Replica B passes on the events replica A published; A stops mid-run (its restart fails
    the run). B's client gets the error and [DONE] after the events it had, not a stream
    that ends as if whole; the published events are gone with the run's end."""
    from pd_runtime.gateway.live_run import sse

    recorder = _recorders(tmp_path)

    async def scenario():
        a, b = recorder("a:1/0"), recorder("b:1/0")
        body = {"prompt": "x", "stream": True}
        live = await _streaming(a, "run-x", body)
        stub, created = await b.open("run-y", "acme", True, "k", body)
        assert not created and stub.remote
        b.join(stub)
        got = []

        async def produce_then_stop():
            for i in range(4):
                a.append(live, sse({"i": i}, live.event_id(len(live.events))))
                await asyncio.sleep(0.3)
            while len(got) < 4:
                await asyncio.sleep(0.05)
            await asyncio.to_thread(a.writer.close)  # A's process is gone ...
            again = recorder("a:1/0")  # ... and back on its port: its run in flight failed
            assert again.recovered == 1
            await asyncio.to_thread(again.close)

        producer = asyncio.ensure_future(produce_then_stop())
        await asyncio.wait_for(b.wait_ready(stub), 10)
        events = b.follow(stub, -1)
        async for event in events:
            got.append(event)
        await events.aclose()
        await producer
        assert got[:4] == live.events[:4]
        assert b'"code":"run_failed"' in got[4] and got[5].endswith(b"data: [DONE]\n\n")
        assert got[4].startswith(b"id: run-x:4\n") and len(got) == 6
        assert b.store.events_after("run-x", -1) == []
        await asyncio.to_thread(b.close)
        a.store.close()

    asyncio.run(scenario())


def test_a_stub_left_by_its_only_follower_is_followed_again_by_the_next(tmp_path):
    """Two requests of replica B with one key share the stub of A's run (the one claim's
    outcome). The first follower leaving before the second joins stops B's polling of the
    store; the second has it followed again and gets the run's end, not a wait that never
    ends."""
    from pd_runtime.gateway.live_run import sse

    recorder = _recorders(tmp_path)

    async def scenario():
        a, b = recorder("a:1/0"), recorder("b:1/0")
        body = {"prompt": "x", "stream": True}
        live = await _streaming(a, "run-x", body)
        (stub, created), (again, again_created) = await asyncio.gather(
            b.open("run-y", "acme", True, "k", body), b.open("run-z", "acme", True, "k", body))
        assert not created and not again_created and stub.remote and again is stub
        b.join(stub)
        first = asyncio.ensure_future(b.wait_ready(stub))
        await asyncio.sleep(0.3)  # B polls the store for it
        first.cancel()
        b.leave(stub)  # its client is gone
        b.join(again)
        a.append(live, sse({"i": 0}, live.event_id(0)))
        a.finish(live, "completed")
        await asyncio.wait_for(b.wait_ready(again), 10)
        assert again.done and again.state == "completed"
        b.leave(again)
        await asyncio.to_thread(b.close)
        await asyncio.to_thread(a.close)

    asyncio.run(scenario())
