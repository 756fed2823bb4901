"""Responses API runs under run records (pd_runtime/entrypoints/openai/generation.py,
pd_runtime/gateway/live_run.py): a retried POST with its Idempotency-Key and a Last-Event-ID resume
replay the typed events; a stream that fails or passes its deadline after its first event ends with
an error event and response.failed (never [DONE]), in the client's response and in what a replay
gives."""

from __future__ import annotations

import json
import time

import httpx

from pd_runtime.config import RouterConfig, TenantConfig
from pd_runtime.gateway.open import open_store
from pd_runtime.router.tenants import Tenants
from pd_runtime.tokenizer import Tokenizer
from tests.router_support.scripted_backend import ScriptedBackend, error, token_chunk
from tests.router_support.serving import APPS, serving

SCRIPT = [token_chunk(" a", 1), token_chunk(" b", 2), token_chunk(" c", 3, finished=True)]
STREAM = {"Accept": "text/event-stream"}


def _config(tmp_path, **router) -> RouterConfig:
    return RouterConfig(routing={"mode": "always_colocated"},
                        runs={"store": str(tmp_path / "runs.sqlite3")}, **router)


def _events(text: str) -> list[dict]:
    out = []
    for block in filter(None, text.split("\n\n")):
        fields = dict(line.split(": ", 1) for line in block.split("\n"))
        data = json.loads(fields["data"])
        assert fields["event"] == data["type"]
        out.append(data)
    return out


def _settled(recorder, timeout_s: float = 5.0) -> list:
    end = time.monotonic() + timeout_s
    while not all(live.done for live in recorder.live.values()) and time.monotonic() < end:
        time.sleep(0.02)
    return list(recorder.live.values())


def test_a_keyed_retry_and_a_resume_replay_the_same_events(llama_dir, tmp_path):
    backend = ScriptedBackend(Tokenizer(llama_dir), SCRIPT)
    with serving(backend, _config(tmp_path)) as (_, port):
        url = f"http://127.0.0.1:{port}/v1/responses"
        body = {"input": "x", "stream": True}
        key = {**STREAM, "Idempotency-Key": "k-1"}
        first = httpx.post(url, headers=key, json=body)
        again = httpx.post(url, headers=key, json=body)
        assert first.status_code == again.status_code == 200
        assert first.text == again.text  # the same run, not a second computation
        events = _events(first.text)
        assert events[-1]["type"] == "response.incomplete"  # the script ends at "length"
        assert events[-1]["response"]["output"][0]["content"][0]["text"] == " a b c"
        run_id = events[0]["response"]["id"]
        ids = [line[4:] for line in first.text.split("\n") if line.startswith("id: ")]
        resumed = httpx.post(url, headers={**STREAM, "Last-Event-ID": ids[3]}, json=body)
        assert _events(resumed.text) == events[4:]
        record = httpx.get(f"http://127.0.0.1:{port}/v1/runs/{run_id}").json()
        assert record["state"] == "completed" and record["output_tokens"] == 3
        plain = httpx.post(url, headers={"Idempotency-Key": "k-2"}, json={"input": "x"})
        assert plain.json()["output"][0]["content"][0]["text"] == " a b c"
        assert httpx.post(url, headers={"Idempotency-Key": "k-2"},
                          json={"input": "x"}).content == plain.content


def test_a_failure_mid_stream_ends_with_response_failed(llama_dir, tmp_path):
    script = [token_chunk(" a", 1), error(503, "the worker went away")]
    backend = ScriptedBackend(Tokenizer(llama_dir), script)
    with serving(backend, _config(tmp_path)) as (_, port):
        response = httpx.post(f"http://127.0.0.1:{port}/v1/responses", headers=STREAM,
                              json={"input": "x", "stream": True})
        events = _events(response.text)
        assert [e["type"] for e in events[-2:]] == ["error", "response.failed"]
        assert events[-2]["message"] == "the worker went away"
        failed = events[-1]["response"]
        assert failed["status"] == "failed" and failed["error"]["message"] == \
            "the worker went away"
        assert [e["sequence_number"] for e in events] == list(range(len(events)))
        (run,) = _settled(APPS[port].state.recorder)
        assert run.state == "failed"
        replay = httpx.get(f"http://127.0.0.1:{port}/v1/runs/{run.id}/events")
        assert _events(replay.text) == events


def test_a_deadline_mid_stream_ends_with_response_failed(llama_dir, tmp_path):
    backend = ScriptedBackend(Tokenizer(llama_dir), SCRIPT * 4, step_s=0.3)
    with serving(backend, _config(tmp_path, request_timeout_s=1.0)) as (_, port):
        response = httpx.post(f"http://127.0.0.1:{port}/v1/responses", headers=STREAM,
                              json={"input": "x", "stream": True})
        events = _events(response.text)
        assert [e["type"] for e in events[-2:]] == ["error", "response.failed"]
        assert events[-2]["code"] == "request_timeout"
        (run,) = _settled(APPS[port].state.recorder)
        assert run.state == "failed"
        replay = _events(httpx.get(f"http://127.0.0.1:{port}/v1/runs/{run.id}/events").text)
        assert [e["type"] for e in replay[-2:]] == ["error", "response.failed"]


class _Tenants(ScriptedBackend):
    def __init__(self, tokenizer):
        super().__init__(tokenizer, SCRIPT)
        self.tenants = Tenants(TENANTS)
        self.prompts: list[list[int]] = []

    def authenticate(self, api_key):
        return self.tenants.authenticate(api_key)

    async def generate(self, request_id, prompt_ids, *args, **kwargs):
        self.prompts.append(list(prompt_ids))
        async for chunk in super().generate(request_id, prompt_ids, *args, **kwargs):
            yield chunk


TENANTS = [TenantConfig(tenant_id="acme", api_key="sk-acme"),
           TenantConfig(tenant_id="other", api_key="sk-other")]
ACME, OTHER = {"Authorization": "Bearer sk-acme"}, {"Authorization": "Bearer sk-other"}


def test_stored_responses_are_the_tenants_own_and_outlive_the_router(llama_dir, tmp_path):
    """Stored in the run store with their conversation: a restarted router (the same store)
    still gives them back and continues them; another tenant gets 404s."""
    config = RouterConfig(tenants=TENANTS, routing={"mode": "always_colocated"},
                          runs={"store": str(tmp_path / "runs.sqlite3")})
    tokenizer = Tokenizer(llama_dir)
    with serving(_Tenants(tokenizer), config) as (_, port):
        url = f"http://127.0.0.1:{port}/v1/responses"
        first = httpx.post(url, headers=ACME, json={"input": "remember this"}).json()
        streamed = _events(httpx.post(url, headers=ACME, json={
            "input": "and this", "stream": True, "previous_response_id": first["id"]}).text)
        second = streamed[-1]["response"]
        assert httpx.get(f"{url}/{first['id']}", headers=OTHER).status_code == 404
        refused = httpx.post(url, headers=OTHER, json={"input": "x",
                                                       "previous_response_id": first["id"]})
        assert refused.status_code == 404
        assert refused.json()["error"]["code"] == "previous_response_not_found"
    backend = _Tenants(tokenizer)
    with serving(backend, config) as (_, port):  # a new router over the same store
        url = f"http://127.0.0.1:{port}/v1/responses"
        assert httpx.get(f"{url}/{first['id']}", headers=ACME).json() == first
        assert httpx.get(f"{url}/{second['id']}", headers=ACME).json() == second
        # A stored stream keeps its events (a follower on another replica reads them) and
        # its conversation.
        store = open_store(str(tmp_path / "runs.sqlite3"))
        kind, events = store.get_output(second["id"])
        conversation = json.loads(store.get_conversation(second["id"]))
        store.close()
        assert kind == "sse" and _events(events.decode())[-1]["response"] == second
        assert [m["role"] for m in conversation] == ["user", "assistant", "user", "assistant"]
        # An unknown id or a bad body is answered at once, not after the wait for a run
        # another replica has not recorded yet.
        start = time.monotonic()
        assert httpx.post(url, headers=ACME, json={"input": 5, "previous_response_id":
                                                   "resp_unknown"}).status_code == 400
        assert httpx.get(f"{url}/chatcmpl-unknown", headers=ACME).status_code == 404
        assert time.monotonic() - start < 1.5
        third = httpx.post(url, headers=ACME, json={"input": "go on",
                                                    "previous_response_id": second["id"]})
        assert third.status_code == 200
        # The whole conversation reached the model: both inputs and both answers.
        prompt = tokenizer.decode(backend.prompts[-1])
        for text in ("remember this", "and this", "go on"):
            assert text in prompt
        assert prompt.count(" a b c") == 2


def test_another_replica_continues_a_response_at_once(llama_dir, tmp_path):
    """Two routers over one store: a response made on one is continued and read on the
    other as soon as its client has it (the other waits out the writer's round), streamed
    or not."""
    tokenizer = Tokenizer(llama_dir)
    config = _config(tmp_path)
    with serving(ScriptedBackend(tokenizer, SCRIPT), config) as (_, a), \
            serving(ScriptedBackend(tokenizer, SCRIPT), config) as (_, b):
        one, other = (f"http://127.0.0.1:{port}/v1/responses" for port in (a, b))
        for i in range(6):
            stream = i % 2 == 1
            made = httpx.post(one, json={"input": "q", "stream": stream})
            response = _events(made.text)[-1]["response"] if stream else made.json()
            more = httpx.post(other, json={"input": "more",
                                           "previous_response_id": response["id"]})
            assert more.status_code == 200, more.text
            assert httpx.get(f"{other}/{response['id']}").json() == response


def test_a_follower_on_another_replica_gets_the_whole_stream(llama_dir, tmp_path):
    """A stored keyless stream (the openai client's default: no key, no event ids) followed
    from another replica while it runs: every event, ending with its last, as its client got
    them; read again after its end, the same."""
    import threading

    tokenizer = Tokenizer(llama_dir)
    script = [token_chunk(f" t{i}", 1 + i % 20) for i in range(30)] + \
        [token_chunk(" end", 3, finished=True)]
    config = _config(tmp_path)
    with serving(ScriptedBackend(tokenizer, script, step_s=0.05), config) as (_, a), \
            serving(ScriptedBackend(tokenizer, script), config) as (_, b):
        got = {}
        producer = threading.Thread(target=lambda: got.setdefault("a", httpx.post(
            f"http://127.0.0.1:{a}/v1/responses", json={"input": "x", "stream": True},
            timeout=60).text))
        producer.start()
        deadline = time.monotonic() + 10
        while not APPS[a].state.recorder.live and time.monotonic() < deadline:
            time.sleep(0.02)
        (run_id,) = list(APPS[a].state.recorder.live)
        while httpx.get(f"http://127.0.0.1:{b}/v1/runs/{run_id}").status_code != 200 and \
                time.monotonic() < deadline:
            time.sleep(0.05)
        followed = httpx.get(f"http://127.0.0.1:{b}/v1/runs/{run_id}/events", timeout=60).text
        producer.join()
        assert _events(followed) == _events(got["a"])
        assert _events(followed)[-1]["type"] == "response.incomplete"
        again = httpx.get(f"http://127.0.0.1:{b}/v1/runs/{run_id}/events", timeout=60).text
        assert _events(again) == _events(got["a"])


def test_a_run_ending_before_its_waiter_starts_still_wakes_it():
    """GET /v1/responses/{id} right after a stream's last event waits for the run's end with
    asyncio.wait_for, which starts the wait a loop turn later (Python 3.11): an end notified
    in between must still wake it (it was lost: a 404 after 2 s, 1 in 60 in CI)."""
    import asyncio

    from pd_runtime.gateway.live_run import LiveRun

    async def main() -> float:
        live = LiveRun("resp_x", "t", True)
        start = asyncio.get_running_loop().time()
        waiting = asyncio.ensure_future(asyncio.wait_for(live.changed(), 5.0))
        live.done = True
        live.notify()  # before the waiter's task has run at all
        await asyncio.wait_for(waiting, 2.0)
        return asyncio.get_running_loop().time() - start

    assert asyncio.run(main()) < 1.0
