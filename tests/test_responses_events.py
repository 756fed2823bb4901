"""The Responses API's stream events (pd_runtime/entrypoints/openai/responses/events.py) fed through
the official `openai` client's own accumulator (ResponseStreamState, what `client.responses.stream`
uses): whatever the chunking, the snapshot it builds from the deltas and the response.completed
event hold the JSON body's output: a reasoning item, the message, the function calls."""

from __future__ import annotations

import json

import pytest
from openai import omit
from openai._models import construct_type
from openai.lib.streaming.responses._responses import ResponseStreamState
from openai.types.responses import ResponseStreamEvent

from pd_runtime.api import SamplingParams, StreamChunk
from pd_runtime.entrypoints.openai.responses.request import chat_body
from pd_runtime.entrypoints.openai.responses.events import ResponsesBuilder
from pd_runtime.entrypoints.openai.request_parsing.schema import ChoiceSpec, PreparedRequest
from pd_runtime.entrypoints.openai.request_parsing.tools import ToolPlan
from pd_runtime.tokenizer import Tokenizer


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
        chunk = StreamChunk(text=text[a:b], token_ids=[7], finished=b == len(text),
                            finish_reason=reason)
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


def _logprob_run(tokenizer, pieces: list[str], stream: bool):
    """(events, body) of an output arriving one piece per chunk, piece i's token scored -i-1,
    with logprobs included."""
    prepared = PreparedRequest("chat", "m", [[1]], [ChoiceSpec(0, 0, SamplingParams())], stream,
                               False, 0, 0, reasoning=False)
    request = chat_body({"input": "hi", "include": ["message.output_text.logprobs"]})[1]
    builder = ResponsesBuilder(prepared, "resp_x", tokenizer, request)
    events = []
    for i, piece in enumerate(pieces):
        events += builder.events(0, StreamChunk(text=piece, token_ids=[10 + i],
                                                logprobs=[(-(i + 1.0), {})],
                                                finished=i == len(pieces) - 1,
                                                finish_reason="stop"))
    events += builder.closing()
    return events, builder.final_body()


@pytest.mark.parametrize("pieces, scored", [
    (["<think>", "abc", "</think>", "Ans", "wer"], [-4.0, -5.0]),
    (["<think>", "abc", "</think>An", "swer"], [-3.0, -4.0]),  # a chunk across the tag
    (["plain ", "answer"], [-1.0, -2.0]),
])
def test_logprobs_are_the_output_texts_tokens(tokenizer, pieces, scored):
    """The thinking's tokens (and its end tag's alone) are not the text's: left out, streamed
    or not, and the deltas' logprobs add up to the text's."""
    events, body = _logprob_run(tokenizer, pieces, True)
    message = [item for item in body["output"] if item["type"] == "message"][0]
    assert [e["logprob"] for e in message["content"][0]["logprobs"]] == scored
    streamed = [e["logprob"] for ev in events if ev["type"] == "response.output_text.delta"
                for e in ev["logprobs"]]
    assert streamed == scored
    _, whole = _logprob_run(tokenizer, pieces, False)
    assert _shape(whole["output"]) == _shape(body["output"])


def test_reasoning_has_its_content_part_events(tokenizer):
    events, body = _run(tokenizer, "<think>hm</think>ok", 2, reasoning=False)
    kinds = [e["type"] for e in events]
    first = kinds.index("response.reasoning_text.delta")
    assert kinds[first - 2:first] == ["response.output_item.added",
                                      "response.content_part.added"]
    assert events[first - 1]["part"] == {"type": "reasoning_text", "text": ""}
    done = kinds.index("response.reasoning_text.done")
    assert kinds[done:done + 3] == ["response.reasoning_text.done",
                                    "response.content_part.done", "response.output_item.done"]


def test_a_stream_with_no_chunk_still_opens_and_a_failure_keeps_the_items(tokenizer):
    builder = _builder(tokenizer)
    assert [e["type"] for e in builder.closing()] == [
        "response.created", "response.in_progress", "response.completed"]
    builder = _builder(tokenizer)
    events = builder.events(0, StreamChunk(text="so far", token_ids=[7]))
    from pd_runtime.router.backend import BackendError
    failed = builder.failed(BackendError(503, "gone"))
    assert [e["type"] for e in failed] == ["error", "response.failed"]
    assert [e["sequence_number"] for e in events + failed] == list(range(len(events) + 2))
    output = failed[-1]["response"]["output"]
    assert failed[-1]["response"]["status"] == "failed"
    assert output[0]["content"][0]["text"] == "so far"


@pytest.mark.parametrize("pieces", [1, 4])
def test_a_named_call_after_the_thinking(tokenizer, pieces):
    """A reasoning model under a named tool choice: its call starts when its answer does (not
    in the first chunk, while it thinks), so the reasoning item comes first and the call's
    arguments are the answer."""
    args = '{"tz": "UTC"}'
    events, body = _run(tokenizer, "<think>hm, let me see</think>" + args, pieces,
                        tools=ToolPlan("named", name="get_time"), reasoning=False)
    final = _accumulated(events)._completed_response
    assert [item.type for item in final.output] == ["reasoning", "function_call"]
    assert final.output[1].arguments == args and final.output[0].content[0].text == \
        "hm, let me see"
    assert _shape(final.output) == _shape(body["output"])
