"""The Responses API's stream events (router/responses_events.py) fed through the official
`openai` client's own accumulator (ResponseStreamState, what `client.responses.stream` uses):
whatever the chunking, the snapshot it builds from the deltas and the response.completed event
hold the JSON body's output: a reasoning item, the message, the function calls."""

from __future__ import annotations

import json

import pytest
from openai import omit
from openai._models import construct_type
from openai.lib.streaming.responses._responses import ResponseStreamState
from openai.types.responses import ResponseStreamEvent

from pd_runtime.api import SamplingParams
from pd_runtime.tokenizer import Tokenizer
from router.schema import ChoiceSpec, PreparedRequest
from router.responses_api import chat_body
from router.responses_events import ResponsesBuilder
from router.tools import ToolPlan


@pytest.fixture(scope="module")
def tokenizer(llama_dir):
    return Tokenizer(llama_dir)


def _builder(tokenizer, tools=None, reasoning=None, max_tokens=100):
    prepared = PreparedRequest("chat", "m", [[1]], [ChoiceSpec(0, 0, SamplingParams(
        max_tokens=max_tokens))], True, False, 0, None, tools=tools, reasoning=reasoning)
    return ResponsesBuilder(prepared, "resp_x", tokenizer, chat_body({"input": "hi"})[1])


def _run(tokenizer, text: str, pieces: int, reason="stop", **kw):
    """(the stream's events, the JSON body) of an output `text` arriving in pieces."""
    streamed, whole = _builder(tokenizer, **kw), _builder(tokenizer, **kw)
    cuts = sorted({0, len(text), *range(0, len(text), pieces)}) if text else [0, 0]
    events = []
    for a, b in zip(cuts, cuts[1:]):
        chunk = {"text": text[a:b], "token_ids": [7], "finished": b == len(text),
                 "finish_reason": reason}
        events += streamed.events(0, chunk)
        whole.add(0, chunk)
    return events + streamed.closing(), whole.final_body()


def _accumulated(events: list[dict]):
    state = ResponseStreamState(input_tools=omit, text_format=omit)
    for payload in events:
        state.handle_event(construct_type(type_=ResponseStreamEvent,
                                          value=json.loads(json.dumps(payload))))
    return state


def _shape(output) -> list:
    """Output items without their ids (each body draws its own) and what the client parsed."""
    out = []
    for item in output:
        item = dict(item if isinstance(item, dict) else item.to_dict())
        for key in ("id", "call_id", "parsed_arguments"):
            item.pop(key, None)
        if item["type"] == "message":
            item["content"] = [{k: v for k, v in part.items() if k != "parsed"}
                               for part in item["content"]]
        out.append(item)
    return out


ANSWER = ('<think>\nweigh it\n</think>\nCalling now. <tool_call>\n{"name": "get_time", '
          '"arguments": {"zone": "utc"}}\n</tool_call>')


@pytest.mark.parametrize("pieces", [1, 3, 7])
def test_the_clients_accumulator_arrives_at_the_json_body(tokenizer, pieces):
    events, body = _run(tokenizer, ANSWER, pieces, tools=ToolPlan("auto", parser="hermes"),
                        reasoning=False)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    state = _accumulated(events)
    final = state._completed_response
    assert events[-1]["type"] == "response.completed" and final.status == "completed"
    assert [item.type for item in final.output] == ["reasoning", "message", "function_call"]
    assert _shape(final.output) == _shape(body["output"])
    reasoning, message, call = body["output"]
    assert reasoning["content"][0]["text"] == "\nweigh it\n"
    assert message["content"][0]["text"] == "\nCalling now. "
    assert (call["name"], json.loads(call["arguments"])) == ("get_time", {"zone": "utc"})
    # Every item was added, then done, with the same id; the final one lists them in order.
    added = [e["item"]["id"] for e in events if e["type"] == "response.output_item.added"]
    done = [e["item"]["id"] for e in events if e["type"] == "response.output_item.done"]
    assert added == done == [item.id for item in final.output]


def test_a_named_calls_arguments_stream_as_deltas(tokenizer):
    args = '{"zone": "cet"}'
    events, body = _run(tokenizer, args, 2, tools=ToolPlan("named", name="get_time"))
    deltas = [e["delta"] for e in events
              if e["type"] == "response.function_call_arguments.delta"]
    assert "".join(deltas) == args and len(deltas) > 1
    final = _accumulated(events)._completed_response
    assert [(item.type, item.name, item.arguments) for item in final.output] == \
        [("function_call", "get_time", args)]
    assert _shape(final.output) == _shape(body["output"])


def test_the_limit_ends_it_incomplete(tokenizer):
    events, body = _run(tokenizer, "some words here", 4, reason="length")
    assert events[-1]["type"] == "response.incomplete"
    assert body["status"] == "incomplete"
    assert body["incomplete_details"] == {"reason": "max_output_tokens"}
    assert events[-1]["response"]["output"][0]["content"][0]["text"] == "some words here"
    assert _shape(events[-1]["response"]["output"]) == _shape(body["output"])


def test_an_empty_output_is_an_empty_message(tokenizer):
    events, body = _run(tokenizer, "", 1)
    assert [item["type"] for item in body["output"]] == ["message"]
    assert _shape(events[-1]["response"]["output"]) == _shape(body["output"])
    assert _accumulated(events)._completed_response.output_text == ""
