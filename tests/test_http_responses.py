"""OpenAI's Responses API (`POST /v1/responses`, pd_runtime/entrypoints/openai/responses/request.py and
pd_runtime/entrypoints/openai/responses/events.py) with the official `openai` client: the same
tokens as the chat endpoint for the same conversation, streamed events the client's own stream
helper accumulates into the JSON body's response, max_output_tokens ending incomplete, function
calls and their results as items, text.format held by the grammar, logprobs, and what the
server cannot do refused naming the field."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from pydantic import BaseModel

from tests.router_support.served_model import client, server  # noqa: F401 (fixtures)

SAMPLING = {"temperature": 0.0, "extra_body": {"ignore_eos": True}}


def chat_text(client, messages, **kw) -> str:
    return client.chat.completions.create(model=client.models.list().data[0].id,
                                          messages=messages, **kw).choices[0].message.content


def test_text_equals_the_chat_endpoints(client):  # noqa: F811
    model = client.models.list().data[0].id
    response = client.responses.create(model=model, input="Tell me a story",
                                       instructions="Be brief.", max_output_tokens=12,
                                       **SAMPLING)
    expected = chat_text(client, [{"role": "system", "content": "Be brief."},
                                  {"role": "user", "content": "Tell me a story"}],
                         max_tokens=12, **SAMPLING)
    assert response.object == "response" and response.id.startswith("resp_")
    assert response.output_text == expected and expected
    assert response.status == "incomplete"  # it ran to max_output_tokens
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == 12
    assert response.usage.total_tokens == response.usage.input_tokens + 12
    assert response.instructions == "Be brief." and response.max_output_tokens == 12
    [message] = response.output
    assert message.type == "message" and message.role == "assistant"
    assert message.id.startswith("msg_") and message.status == "completed"


def test_a_stream_accumulates_to_the_same_response(client):  # noqa: F811
    model = client.models.list().data[0].id
    whole = client.responses.create(model=model, input="Count with me", max_output_tokens=10,
                                    **SAMPLING)
    with client.responses.stream(model=model, input="Count with me", max_output_tokens=10,
                                 **SAMPLING) as stream:
        events = list(stream)
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.incomplete"  # as OpenAI: not .completed at the limit
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == whole.output_text
    done = [e for e in events if e.type == "response.output_text.done"]
    assert len(done) == 1 and done[0].text == whole.output_text
    last = events[-1].response
    assert last.output_text == whole.output_text and last.usage.output_tokens == 10
    assert last.incomplete_details.reason == "max_output_tokens"
    assert [item.id for item in last.output] == [done[0].item_id]


def test_a_completed_stream_gives_the_final_response(client):  # noqa: F811
    """The client's stream helper: deltas into a snapshot, response.completed into the final
    response, its text parsed into the pydantic model."""
    model = client.models.list().data[0].id
    kw = {"model": model, "input": "Is it ok?", "text_format": Answer,
          "max_output_tokens": 200, "temperature": 0.0}
    with client.responses.stream(**kw) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert events[-1].type == "response.completed" and final.status == "completed"
    assert isinstance(final.output_parsed, Answer)
    assert final.output_text == client.responses.parse(**kw).output_text


def test_raw_events_name_their_type(server):  # noqa: F811
    backend, port = server
    with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/responses", json={
            "model": backend.model_name, "input": "hi", "max_output_tokens": 3,
            "stream": True}) as response:
        text = response.read().decode()
    events = [block for block in text.split("\n\n") if block]
    for block in events:
        lines = dict(line.split(": ", 1) for line in block.split("\n"))
        assert json.loads(lines["data"])["type"] == lines["event"]
    assert "[DONE]" not in text
    assert json.loads(events[-1].split("data: ", 1)[1])["type"] in (
        "response.completed", "response.incomplete")


def test_calls_and_their_outputs_as_items(client):  # noqa: F811
    """A conversation with a function call and its output in the input gives the chat
    endpoint's tokens for the same messages (the template renders the same prompt)."""
    model = client.models.list().data[0].id
    items = [{"role": "user", "content": "What is the weather?"},
             {"type": "function_call", "call_id": "call_1", "name": "weather",
              "arguments": '{"city": "Oslo"}'},
             {"type": "function_call_output", "call_id": "call_1", "output": "rain"}]
    response = client.responses.create(model=model, input=items, max_output_tokens=8,
                                       **SAMPLING)
    messages = [{"role": "user", "content": "What is the weather?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "rain"}]
    assert response.output_text == chat_text(client, messages, max_tokens=8, **SAMPLING)


class Answer(BaseModel):
    ok: bool


def test_text_format_is_held_by_the_grammar(client):  # noqa: F811
    model = client.models.list().data[0].id
    parsed = client.responses.parse(model=model, input="Is it ok?", text_format=Answer,
                                    max_output_tokens=200, temperature=0.0)
    assert isinstance(parsed.output_parsed, Answer)
    assert parsed.text.format.type == "json_schema"


def test_logprobs_when_included(client):  # noqa: F811
    model = client.models.list().data[0].id
    response = client.responses.create(model=model, input="hi", max_output_tokens=5,
                                       include=["message.output_text.logprobs"],
                                       top_logprobs=2, **SAMPLING)
    logprobs = response.output[0].content[0].logprobs
    assert len(logprobs) == 5
    assert "".join(entry.token for entry in logprobs) == response.output_text
    assert all(len(entry.top_logprobs) == 2 for entry in logprobs)


@pytest.mark.parametrize("kw, param", [
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input[0].content[0].type"),
    ({"background": "yes"}, "background"),
    ({"reasoning": {"effort": "high"}}, "reasoning.effort"),
    ({"max_output_tokens": -1}, "max_output_tokens"),
    ({"include": ["file_search_call.results"]}, "include"),
    ({"input": []}, "input"),
    ({"top_logprobs": 3}, "top_logprobs"),
])
def test_what_it_cannot_do_is_a_400_naming_the_field(client, kw, param):  # noqa: F811
    model = client.models.list().data[0].id
    kw.setdefault("input", "hi")
    with pytest.raises(openai.BadRequestError) as raised:
        client.responses.create(model=model, **kw)
    assert raised.value.body["param"] == param


def test_previous_response_id_continues_the_conversation(client):  # noqa: F811
    """A stored response (store defaults to true) is fetched whole by its id, and a request
    naming it as previous_response_id is the chat endpoint's request for the whole
    conversation: the same tokens."""
    model = client.models.list().data[0].id
    first = client.responses.create(model=model, input="My name is Ada.", max_output_tokens=6,
                                    instructions="Answer briefly.", **SAMPLING)
    assert first.store is True
    assert client.responses.retrieve(first.id).model_dump() == first.model_dump()
    second = client.responses.create(model=model, input="What is my name?",
                                     previous_response_id=first.id, max_output_tokens=6,
                                     **SAMPLING)
    assert second.previous_response_id == first.id
    # Instructions are not carried over (as OpenAI's): the second request named none.
    assert second.output_text == chat_text(client, [
        {"role": "user", "content": "My name is Ada."},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "What is my name?"}], max_tokens=6, **SAMPLING)
    with client.responses.stream(model=model, input="And again?", max_output_tokens=4,
                                 previous_response_id=second.id, **SAMPLING) as stream:
        third = list(stream)[-1].response
    assert client.responses.retrieve(third.id).output_text == third.output_text
    assert third.usage.input_tokens > second.usage.input_tokens


def test_a_response_not_stored_cannot_be_continued(client):  # noqa: F811
    model = client.models.list().data[0].id
    loose = client.responses.create(model=model, input="hi", max_output_tokens=2, store=False)
    assert loose.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(loose.id)
    with pytest.raises(openai.NotFoundError) as raised:
        client.responses.create(model=model, input="hi", previous_response_id=loose.id)
    assert raised.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve("resp_nothing")


def test_a_large_body_is_prepared_by_the_parser_process_with_its_history(  # noqa: F811
        server, client):  # noqa: F811
    """Past the inline limit the parser process prepares the body; a previous_response_id
    found there comes back for its conversation, and the answer is the small body's."""
    from pd_runtime.entrypoints.openai.request_parsing.intake import INLINE_MAX_BYTES
    from tests.router_support.serving import APPS

    _, port = server
    intake = APPS[port].state.intake
    model = client.models.list().data[0].id
    first = client.responses.create(model=model, input="Remember 7.", max_output_tokens=4,
                                    **SAMPLING)
    kw = {"model": model, "input": "What number?", "previous_response_id": first.id,
          "max_output_tokens": 5, "temperature": 0.0}
    small = client.responses.create(**kw, extra_body={"ignore_eos": True})
    before = intake.prepared_in_child
    large = client.responses.create(**kw, extra_body={"ignore_eos": True,
                                                      "padding": "p" * INLINE_MAX_BYTES})
    assert intake.prepared_in_child == before + 2  # once to find it continues, once with it
    assert large.output_text == small.output_text and large.usage.input_tokens == \
        small.usage.input_tokens


def test_chat_errors_are_named_as_the_responses_fields(client):  # noqa: F811
    model = client.models.list().data[0].id
    with pytest.raises(openai.BadRequestError) as raised:
        client.responses.create(model=model, input="hi", max_output_tokens=0)
    assert raised.value.body["param"] == "max_output_tokens"
    assert "max_tokens" not in raised.value.body["message"]
    with pytest.raises(openai.BadRequestError) as raised:
        client.responses.create(model=model, input="hi", tool_choice="required")
    assert raised.value.body["param"] == "tool_choice"
    # "auto" is the default: fine without tools; so is top_logprobs 0 without include; a
    # stateless client's ask for encrypted reasoning has nothing to encrypt (its text is there).
    assert client.responses.create(model=model, input="hi", max_output_tokens=1,
                                   tool_choice="auto", top_logprobs=0, store=False,
                                   include=["reasoning.encrypted_content"]).output
