"""Fuzzes the whole request schema over real HTTP on 127.0.0.1 against a real tiny engine: every
field with valid, wrong-typed, out-of-range and extreme values, NaN and Infinity, lone
surrogates, deep nesting, broken and non-JSON bodies, any content type, both endpoints, streamed
or not. No answer may be a 5xx, and every 4xx must carry an OpenAI error body.
"""

from __future__ import annotations

import collections
import json
import math

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pd_runtime.entrypoints.openai.request_parsing.intake import INLINE_MAX_BYTES
from tests.router_support.serving import APPS, assert_error_body, local

CONTEXT = 32  # bounds the work of any request the fuzzer makes valid
EXAMPLES = 2500
BATCH = 10
SERVED = "$served"  # stands for the served model's name

# Pools of values, drawn with sampled_from: hypothesis draws those far faster than it builds
# recursive structures, and a few thousand requests must fit in about a minute.
_EXTREME_INTS = [1 << 63, (1 << 63) - 1, -(1 << 63) - 1, 1 << 64, 10 ** 30]
_ODD_FLOATS = [math.nan, math.inf, -math.inf, 1e308, -0.0, 5e-324]
_TEXTS = ["", "x", "hi there", "\ud800", "a\udfffb", "\ud83d", "ok \ud83d\ude00", "é",
          "e\u0301\u0302", "日本語", "\x00", "<|im_start|>", "word " * 400]  # the last: > CONTEXT
_JUNK = [None, True, False, 0, 1, -1, 2.5, "1", "true", "null", [], [1], [[1]], ["a"], [None],
         {}, {"a": 1}, {"type": "text"}, {"": {"": [[]]}}, [[[[[]]]]], *_EXTREME_INTS,
         *_ODD_FLOATS, *_TEXTS]


_JUNK_VALUES = st.sampled_from(_JUNK)


def _field(*valid) -> st.SearchStrategy:
    """Mostly the field's own values (valid or out of range), one draw in four any JSON value."""
    if not valid:
        return _JUNK_VALUES
    own = st.sampled_from(valid)
    return st.one_of(own, own, own, _JUNK_VALUES)


_IDS = [[], [1], [5, 6, 7], [0, 511], [512], [-1, 3], [1 << 63], [True, 2], [10] * 40]
_PROMPTS = _TEXTS + _IDS + [["a", "b"], ["x", [1, 2]], [[1, 2], [3]], [[]], [""], ["\ud800"],
                            ["x"] * 5]
_MESSAGE_LISTS = [
    [], [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "brief"}, {"role": "user", "content": "hello"}],
    [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
    [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
    [{"role": "user", "content": None}], [{"role": "user"}], [{"content": "no role"}],
    [{"role": "bogus", "content": "x"}], [{"role": "tool", "content": "x", "tool_call_id": "1"}],
    [{"role": "assistant", "content": "x", "tool_calls": []}], [{"role": 3, "content": "x"}],
    [{"role": "assistant", "content": None, "tool_calls": [{"id": "1", "type": "function",
                                                            "function": {"name": "f",
                                                                         "arguments": "{bad"}}]}],
    [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}]},
     {"role": "tool", "content": "ok", "tool_call_id": 7}],
    [{"role": "assistant", "tool_calls": "x"}], [{"role": "assistant", "tool_calls": [3]}],
    [{"role": "user", "content": "\ud800"}], [{"role": "user", "content": [{"type": "text"}]}],
    [{"role": "user", "content": "x", "name": "bob"}], ["not a message"], [None],
    [{"role": "user", "content": "word " * 400}]]
_LOGIT_BIASES = [None, {}, {"5": 10}, {"5": -100}, {"511": 100}, {"512": 1}, {"-1": 1},
                 {"x": 1}, {"5": 100.5}, {"5": "1"}, {"5": None}, {"5": math.nan},
                 {"05": 1, "5": 2}, {str(i): 1 for i in range(301)}, {"9" * 30: 1}]
FIELDS = {
    "model": _field("$served", "$served", "other-model", ""),
    "max_tokens": _field(None, -1, 0, 1, 2, 3, 64),
    "max_completion_tokens": _field(None, -1, 0, 1, 2),
    "temperature": _field(None, -0.5, 0, 0, 0.7, 1, 2, 100.5),
    "top_p": _field(None, -0.1, 0, 0.3, 0.9, 1, 1.5),
    "top_k": _field(None, -3, -1, 0, 1, 5, 600),
    "min_p": _field(None, -0.1, 0, 0.2, 1, 1.5),
    "seed": _field(None, 0, 7, -7, (1 << 63) - 1),
    "stop": _field(None, "x", ["a", "b"], [""], ["\ud800"], ["s"] * 65, [1]),
    "stop_token_ids": _field(None, *_IDS, list(range(1100))),
    "n": _field(None, -1, 0, 1, 2, 3, 129),
    "stream": _field(True, False, True, False),
    "stream_options": _field(None, {"include_usage": True}, {"include_usage": False},
                             {"include_usage": 1}),
    "logprobs": _field(None, True, False, 0, 2, 5, 20, 21),
    "top_logprobs": _field(None, 0, 2, 20, 21, -1),
    "echo": _field(True, False),
    "priority": _field(0, -5, 5),
    "ignore_eos": _field(True, False),
    "skip_special_tokens": _field(True, False),
    "user": _field("u1", ""),
    "service_tier": _field(None, "auto", "default", "flex", "priority", "cheap"),
    "presence_penalty": _field(None, -2, -0.5, 0, 1.5, 2, 2.1, -3),
    "frequency_penalty": _field(None, -2, 0.5, 2, 2.5),
    "repetition_penalty": _field(None, 0, -1, 0.5, 1, 1.3, 3),
    "logit_bias": _field(*_LOGIT_BIASES),
    "best_of": _field(None, 1, 2, 3),
    "suffix": _field(None, "", "tail"),
    "response_format": _field(None, {"type": "text"}, {"type": "json_object"},
                              {"type": "json_schema", "json_schema": {"schema": {
                                  "type": "object", "properties": {"a": {"type": "integer"}}}}},
                              {"type": "json_schema", "json_schema": {"schema": "x"}},
                              {"type": "json_schema"}, {"type": "other"}),
    "guided_regex": _field(None, "[a-z]{1,3}", "a(b", "", "\\p{L}+"),
    "guided_choice": _field(None, ["a", "bc"], [], [""], ["\ud800"], "a"),
    "structured_outputs": _field(None, {"json": {"type": "string", "maxLength": 3}},
                                 {"grammar": "start: /[0-9]/"}, {"grammar": ""},
                                 {"json": {"type": {"x": 1}}}, {"regex": 1},
                                 {"json_object": True, "disable_any_whitespace": True}),
    "tools": _field(None, [], [{"type": "function"}], [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "integer"}},
                                    "required": ["a"]}}}],
        [{"type": "function", "function": {"name": "f", "parameters": {"type": "bogus"}}}],
        [{"type": "function", "function": {"name": "f"}}] * 2),
    "tool_choice": _field(None, "none", "auto", "required",
                          {"type": "function", "function": {"name": "f"}},
                          {"type": "function", "function": {"name": "g"}}, {"type": "function"}),
    "parallel_tool_calls": _field(None, True, False),
    "functions": _field(None, []),
    "function_call": _field(None, "none", "auto"),
    "modalities": _field(None, ["text"], ["audio"]),
}
_CONTENT_TYPES = st.sampled_from(["application/json", "application/json", "text/plain",
                                  "application/x-www-form-urlencoded", None,
                                  "application/json; charset=utf-16"])


def _with(raw: str, member: str) -> bytes:
    """The JSON object text `raw` (never empty: it always has max_tokens) with one more member."""
    return f"{raw[:-1]}, {member}}}".encode()


# How the JSON text of a body is spoiled (most bodies are left alone).
_SPOILERS = st.sampled_from(
    [None] * 72 + [("deep", 40), ("deep", 900), ("deep", 5000), ("deep", 200_000),
                   ("truncate", 0.0), ("truncate", 0.5), ("truncate", 0.95),
                   ("bytes", b"\x00\xff{"), ("bytes", b"prompt=hi&max_tokens=2"), ("bytes", b"{"),
                   ("literal", "NaN"), ("literal", "-Infinity"), ("literal", "1e999"),
                   ("literal", "1" * 5000), ("literal", '"\\ud800"'), ("literal", "[1,]"),
                   ("literal", "01"), ("literal", "tru"), "empty", "not-an-object", "bad-utf8",
                   "utf-16", "large", "large"])


def _spoil(raw: str, spoiler) -> bytes:
    if spoiler is None:
        return raw.encode()
    if spoiler == "empty":
        return b""
    if spoiler == "not-an-object":
        return b"[" + raw.encode() + b"]"
    if spoiler == "bad-utf8":
        return raw.replace('"', '"\xff\xfe', 1).encode("latin-1", "replace")
    if spoiler == "utf-16":
        return raw.encode("utf-16")
    if spoiler == "large":  # past the inline limit: prepared by the parser process
        return _with(raw, f'"padding": "{"p" * INLINE_MAX_BYTES}"')
    kind, value = spoiler
    if kind == "deep":
        return _with(raw, f'"deep": {"[" * value}{"]" * value}')
    if kind == "truncate":
        return raw.encode()[:int(len(raw) * value)]
    if kind == "bytes":
        return value
    return _with(raw, f'"odd": {value}')


_REQUIRED = {"messages": _field(*_MESSAGE_LISTS), "prompt": _field(*_PROMPTS)}
_FIELD_NAMES = st.lists(st.sampled_from(sorted(FIELDS)), max_size=4, unique=True)
_UNKNOWN_NAMES = st.sampled_from(["x", "metadata", "store", "\ud800"])
_ANY = _field()


@st.composite
def requests(draw):
    chat = draw(st.booleans())
    body = {"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"}
    body["max_tokens"] = 2
    required = "messages" if chat else "prompt"
    roll = draw(st.integers(0, 19))
    if roll == 0:
        del body[required]
    elif roll < 6:
        body[required] = draw(_REQUIRED[required])
    for name in draw(_FIELD_NAMES):
        body[name] = draw(FIELDS[name])
    if roll == 19:  # unknown fields are ignored, whatever they hold
        body[draw(_UNKNOWN_NAMES)] = draw(_ANY)
    return chat, body, draw(_SPOILERS), draw(_CONTENT_TYPES)


@pytest.fixture(scope="module")
def fuzz_server(llama_dir):
    with local(llama_dir, max_model_len=CONTEXT) as (backend, port), \
            httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as http:
        yield backend, port, http


def _broken(spoiler) -> bool:
    """Whether the spoiler surely leaves no valid request (others may: UTF-16 is JSON too)."""
    if spoiler in ("empty", "not-an-object", "bad-utf8"):
        return True
    return isinstance(spoiler, tuple) and (spoiler[0] == "bytes" or (
        spoiler[0] == "truncate" and spoiler[1] < 1.0))


def _check(response: httpx.Response, body: dict, spoiled: bool) -> None:
    assert response.status_code < 500, (body, response.status_code, response.text[:500])
    assert response.headers.get("x-request-id")
    if response.status_code >= 400:
        assert_error_body(response, response.status_code)
        return
    assert response.status_code == 200 and not spoiled, (body, response.text[:300])
    if body.get("stream") is True:
        events = [line[len("data: "):] for line in response.text.splitlines()
                  if line.startswith("data: ")]
        assert events and events[-1] == "[DONE]", response.text[-300:]
        for event in map(json.loads, events[:-1]):
            assert "error" not in event, event  # nothing fails once the stream has begun
    else:
        answer = response.json()
        assert answer["choices"] and answer["usage"]["completion_tokens"] >= 0, answer


def test_fuzzed_requests_never_get_a_5xx(fuzz_server):
    backend, port, http = fuzz_server
    outcomes: collections.Counter = collections.Counter()
    refused: collections.Counter = collections.Counter()  # the param each 400 named

    # Requests come in batches per example: hypothesis's own cost per example would otherwise
    # be most of the run.
    @settings(max_examples=EXAMPLES // BATCH, derandomize=True, database=None, deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(st.lists(requests(), min_size=BATCH, max_size=BATCH))
    def send(batch):
        for chat, body, spoiler, content_type in batch:
            raw = json.dumps(body).replace(f'"{SERVED}"', json.dumps(backend.model_name))
            headers = {"content-type": content_type} if content_type else {}
            path = "/v1/chat/completions" if chat else "/v1/completions"
            response = http.post(path, content=_spoil(raw, spoiler), headers=headers)
            _check(response, body, _broken(spoiler))
            outcomes[response.status_code] += 1
            if response.status_code == 400:
                refused[response.json()["error"]["param"]] += 1

    send()
    total = sum(outcomes.values())
    in_child = APPS[port].state.intake.prepared_in_child
    print(f"fuzz: {total} requests, statuses {dict(sorted(outcomes.items()))}, {in_child} "
          f"prepared by the parser process; 400s by param: {refused.most_common(8)}")
    assert total == EXAMPLES
    # The fuzzer reaches both sides: valid requests served, invalid ones refused.
    assert outcomes[200] >= total * 0.15 and outcomes[400] >= total * 0.3, outcomes
    assert in_child >= 20


# -- the Responses API ----------------------------------------------------------------------------
_INPUTS = _TEXTS + [
    [], [{"role": "user", "content": "hi"}], [{"type": "message", "role": "developer",
                                              "content": [{"type": "input_text", "text": "a"}]}],
    [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}],
    [{"role": "user", "content": [{"type": "input_text"}]}], [{"role": "bogus", "content": "x"}],
    [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
     {"type": "function_call_output", "call_id": "c", "output": "ok"}],
    [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{bad"}],
    [{"type": "function_call", "name": "f"}], [{"type": "function_call_output", "output": 3}],
    [{"type": "function_call_output", "call_id": "c",
      "output": [{"type": "input_text", "text": "x"}]}],
    [{"type": "reasoning", "summary": []}, {"role": "user", "content": "x"}],
    [{"type": "item_reference", "id": "x"}], [None], ["x"], [{"role": "user", "content": None}],
    [{"role": "user", "content": "\ud800"}], [{"role": "user", "content": "word " * 400}]]
RESPONSES_FIELDS = {
    "model": FIELDS["model"],
    "instructions": _field(None, "be brief", "", "\ud800", "word " * 400),
    "max_output_tokens": _field(None, -1, 0, 1, 2, 3),
    "temperature": FIELDS["temperature"], "top_p": FIELDS["top_p"],
    "stream": FIELDS["stream"], "user": FIELDS["user"], "service_tier": FIELDS["service_tier"],
    "seed": FIELDS["seed"], "stop": FIELDS["stop"],
    "text": _field(None, {}, {"format": {"type": "text"}}, {"format": {"type": "json_object"}},
                   {"format": {"type": "json_schema", "name": "a", "schema": {
                       "type": "object", "properties": {"a": {"type": "integer"}}}}},
                   {"format": {"type": "json_schema", "schema": "x"}}, {"format": "x"},
                   {"verbosity": "low"}, {"format": {"type": "other"}}),
    "tools": _field(None, [], [{"type": "function", "name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}],
        [{"type": "function"}], [{"type": "web_search"}], [{"type": "function", "name": 3}],
        [{"type": "function", "name": "f", "parameters": {"type": "bogus"}}]),
    "tool_choice": _field(None, "none", "auto", "required", {"type": "function", "name": "f"},
                          {"type": "function", "name": "g"}, {"type": "function"},
                          {"type": "web_search"}),
    "parallel_tool_calls": FIELDS["parallel_tool_calls"],
    "include": _field(None, [], ["message.output_text.logprobs"], ["x"], "x", [1]),
    "top_logprobs": _field(None, 0, 2, 20, 21, -1),
    "reasoning": _field(None, {}, {"effort": None}, {"effort": "low"}, {"summary": "auto"}),
    "store": _field(None, True, False),
    "previous_response_id": _field(None, "resp_none", ""),
    "metadata": _field(None, {}, {"k": "v"}, {"k": 1}, {str(i): "v" for i in range(17)}),
    "background": _field(None, False, True),
    "truncation": _field(None, "disabled", "auto"),
    "stream_options": _field(None, {}, {"include_obfuscation": False}),
}
_RESPONSES_NAMES = st.lists(st.sampled_from(sorted(RESPONSES_FIELDS)), max_size=4, unique=True)


@st.composite
def responses_requests(draw):
    body = {"input": "hi", "max_output_tokens": 2}
    roll = draw(st.integers(0, 19))
    if roll == 0:
        del body["input"]
    elif roll < 8:
        body["input"] = draw(_field(*_INPUTS))
    for name in draw(_RESPONSES_NAMES):
        body[name] = draw(RESPONSES_FIELDS[name])
    return body, draw(_SPOILERS), draw(_CONTENT_TYPES)


def test_fuzzed_responses_requests_never_get_a_5xx(fuzz_server):
    backend, port, http = fuzz_server
    outcomes: collections.Counter = collections.Counter()

    @settings(max_examples=60, derandomize=True, database=None, deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(st.lists(responses_requests(), min_size=BATCH, max_size=BATCH))
    def send(batch):
        for body, spoiler, content_type in batch:
            raw = json.dumps(body).replace(f'"{SERVED}"', json.dumps(backend.model_name))
            headers = {"content-type": content_type} if content_type else {}
            response = http.post("/v1/responses", content=_spoil(raw, spoiler), headers=headers)
            assert response.status_code < 500, (body, response.status_code, response.text[:500])
            outcomes[response.status_code] += 1
            if response.status_code >= 400:
                assert_error_body(response, response.status_code)
                continue
            assert response.status_code == 200 and not _broken(spoiler), (body, response.text)
            if body.get("stream") is True:
                events = [json.loads(line[len("data: "):]) for line in
                          response.text.splitlines() if line.startswith("data: ")]
                assert events[0]["type"] == "response.created", events[:1]
                assert events[-1]["type"] in ("response.completed", "response.incomplete"), \
                    events[-1]
            else:
                answer = response.json()
                assert answer["object"] == "response" and answer["output"], answer

    send()
    total = sum(outcomes.values())
    print(f"responses fuzz: {total} requests, statuses {dict(sorted(outcomes.items()))}")
    assert total == 600
    assert outcomes[200] >= total * 0.15 and outcomes[400] >= total * 0.3, outcomes
