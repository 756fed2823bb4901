"""Background responses with the official `openai` client
(pd_runtime/entrypoints/openai/generation.py `_background`,
pd_runtime/entrypoints/openai/responses/stored.py): queued at once and polled to the answer the same
request gives in the foreground; a background stream its client leaves goes on and is streamed again
from where it was left; cancelled while it runs, it stops and says so."""

from __future__ import annotations

import time

import httpx
import openai
import pytest

from tests.router_support.served_model import client, server  # noqa: F401 (fixtures)

SAMPLING = {"temperature": 0.0, "extra_body": {"ignore_eos": True}}


def _poll(client, response_id: str, timeout_s: float = 60.0):
    deadline = time.monotonic() + timeout_s
    while True:
        response = client.responses.retrieve(response_id)
        if response.status not in ("queued", "in_progress") or time.monotonic() > deadline:
            return response
        time.sleep(0.05)


def test_a_background_response_is_polled_to_the_foreground_answer(client):  # noqa: F811
    model = client.models.list().data[0].id
    foreground = client.responses.create(model=model, input="Tell me a story.",
                                         max_output_tokens=24, **SAMPLING)
    queued = client.responses.create(model=model, input="Tell me a story.",
                                     max_output_tokens=24, background=True, **SAMPLING)
    assert queued.status == "queued" and queued.background is True and queued.output == []
    done = _poll(client, queued.id)
    assert done.status == "incomplete" and done.output_text == foreground.output_text
    assert done.usage.output_tokens == 24 and done.background is True
    # Stored as any response: its items listed.
    items = list(client.responses.input_items.list(queued.id))
    assert [i.content[0].text for i in items] == ["Tell me a story."]
    # Sent again with its Idempotency-Key: the same response as it stands, not a second run.
    keyed = dict(model=model, input="Tell me a story.", max_output_tokens=24, background=True,
                 **SAMPLING, extra_headers={"Idempotency-Key": "story-1"})
    first = client.responses.create(**keyed)
    again = client.responses.create(**keyed)
    assert again.id == first.id and again.status in ("queued", "in_progress", "incomplete")
    assert _poll(client, first.id).output_text == foreground.output_text


def test_a_background_stream_left_by_its_client_goes_on_and_streams_again(  # noqa: F811
        client, server):  # noqa: F811
    model = client.models.list().data[0].id
    body = {"model": model, "input": "Count to ten.", "max_output_tokens": 40,
            "temperature": 0.0, "ignore_eos": True, "stream": True}
    whole = list(client.responses.create(**{k: v for k, v in body.items() if k != "ignore_eos"},
                                         extra_body={"ignore_eos": True}))
    _, port = server
    seen = []
    with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/responses",
                      json={**body, "background": True}, timeout=60) as stream:
        for line in stream.iter_lines():  # the first few events, then the client is gone
            if line.startswith("data: "):
                seen.append(line)
            if len(seen) == 4:
                break
    response_id = _id_of(seen[0])
    done = _poll(client, response_id)
    assert done.status == "incomplete" and done.output_text == whole[-1].response.output_text
    rest = list(client.responses.retrieve(response_id, stream=True, starting_after=3))
    # Its events after the 4th (how tokens group into deltas depends on timing).
    assert [e.sequence_number for e in rest] == list(range(4, 4 + len(rest)))
    assert [e.type for e in whole[:4]] == ["response.created", "response.in_progress",
                                           "response.output_item.added",
                                           "response.content_part.added"]
    assert rest[-1].type == "response.incomplete"
    assert rest[-1].response.output_text == whole[-1].response.output_text
    assert "".join(e.delta for e in rest if e.type == "response.output_text.delta") == \
        done.output_text


def _id_of(data_line: str) -> str:
    import json

    return json.loads(data_line[len("data: "):])["response"]["id"]


def test_a_cancelled_background_response_stops_and_says_so(client):  # noqa: F811
    model = client.models.list().data[0].id
    long = client.responses.create(model=model, input="Go on forever.",
                                   max_output_tokens=2000, background=True, **SAMPLING)
    run_url = f"{str(client.base_url).rstrip('/')}/runs/{long.id}"
    while httpx.get(run_url).json()["state"] != "streaming":  # its first tokens are out
        time.sleep(0.02)
    assert client.responses.retrieve(long.id).status == "in_progress"
    cancelled = client.responses.cancel(long.id)
    assert cancelled.status == "cancelled" and cancelled.id == long.id
    assert client.responses.retrieve(long.id).status == "cancelled"
    assert client.responses.cancel(long.id).status == "cancelled"  # again: the same
    events = list(client.responses.retrieve(long.id, stream=True))
    assert events[0].type == "response.created" and events[-1].type != "response.completed"
    run = httpx.get(run_url).json()
    assert run["state"] == "cancelled" and 0 < run["output_tokens"] < 2000
    short = client.responses.create(model=model, input="hi", max_output_tokens=2,
                                    background=True, **SAMPLING)
    _poll(client, short.id)
    with pytest.raises(openai.ConflictError) as ended:  # it has ended: nothing to cancel
        client.responses.cancel(short.id)
    assert ended.value.body["code"] == "response_already_ended"
    foreground = client.responses.create(model=model, input="hi", max_output_tokens=2)
    with pytest.raises(openai.BadRequestError):  # only a background one can be
        client.responses.cancel(foreground.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.cancel("resp_nothing")


def test_background_needs_store(client):  # noqa: F811
    model = client.models.list().data[0].id
    with pytest.raises(openai.BadRequestError) as raised:
        client.responses.create(model=model, input="hi", background=True, store=False)
    assert raised.value.body["param"] == "background"


def test_background_needs_run_records(llama_dir):
    from pd_runtime.config import RouterConfig
    from tests.router_support.serving import local

    config = RouterConfig(routing={"mode": "always_colocated"}, runs={"enabled": False})
    with local(llama_dir, config) as (backend, port):
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x",
                               max_retries=0)
        with pytest.raises(openai.BadRequestError) as raised:
            client.responses.create(model=backend.model_name, input="hi", background=True)
        assert raised.value.body["param"] == "background"
        assert "run records" in raised.value.body["message"]
