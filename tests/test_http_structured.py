"""Structured outputs over HTTP as clients ask for them, with the official `openai` client:
OpenAI's response_format (json_schema through the client's own `parse` with a pydantic
model, json_object), vLLM's structured_outputs and guided_* fields; streamed or not, the same
text as the offline engine; bad specs are 400s naming the client's field."""

from __future__ import annotations

import json
import re

import openai
import pydantic
import pytest

from pd_runtime import SamplingParams
from tests.router_support.served_model import client, offline, server  # noqa: F401


class Pet(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=6)
    kind: str = pydantic.Field(json_schema_extra={"enum": ["cat", "dog"]})
    legs: int = pydantic.Field(ge=0, le=8)


COMPACT = {"disable_any_whitespace": True}  # the random test model rambles in whitespace


def test_parse_with_a_pydantic_model(server, client):
    """The client's `parse` sends a strict json_schema response_format and validates the
    answer into the model."""
    backend, _ = server
    done = client.chat.completions.parse(
        model=backend.model_name, messages=[{"role": "user", "content": "a pet"}],
        response_format=Pet, max_tokens=200, temperature=0.0)
    message = done.choices[0].message
    assert done.choices[0].finish_reason == "stop"
    assert isinstance(message.parsed, Pet) and message.parsed.kind in ("cat", "dog")
    assert json.loads(message.content) == message.parsed.model_dump()


def test_completions_match_the_offline_engine(server, client, offline):
    backend, _ = server
    cases = [({"guided_regex": r"[a-z]{2,5}-[0-9]{1,3}"}, {"regex": r"[a-z]{2,5}-[0-9]{1,3}"}),
             ({"guided_choice": ["red", "green", "blue"]}, {"choice": ["red", "green", "blue"]}),
             ({"structured_outputs": {"json": Pet.model_json_schema(), **COMPACT}},
              {"json": Pet.model_json_schema(), **COMPACT}),
             ({"guided_grammar": 'start: "x" /[0-9]{2}/'}, {"grammar": 'start: "x" /[0-9]{2}/'}),
             ({"response_format": {"type": "json_schema", "json_schema": {
                 "name": "pet", "schema": Pet.model_json_schema(), "strict": True}}},
              {"json": Pet.model_json_schema()})]
    for i, (extra, spec) in enumerate(cases):
        want = offline.generate(["My favourite"], SamplingParams(
            max_tokens=60, temperature=0.9, seed=i, structured_outputs=spec))[0]
        got = client.completions.create(model=backend.model_name, prompt="My favourite",
                                        max_tokens=60, temperature=0.9, seed=i,
                                        extra_body=extra)
        assert got.choices[0].text == want.text, extra
        streamed = client.completions.create(model=backend.model_name, prompt="My favourite",
                                             max_tokens=60, temperature=0.9, seed=i,
                                             extra_body=extra, stream=True)
        assert "".join(c.choices[0].text for c in streamed if c.choices) == want.text
    assert re.fullmatch(r"[a-z]{2,5}-[0-9]{1,3}", client.completions.create(
        model=backend.model_name, prompt="id:", max_tokens=20, temperature=0,
        extra_body=cases[0][0]).choices[0].text)


def test_json_object_and_chat_json_schema(server, client):
    backend, _ = server
    chat = client.chat.completions.create(
        model=backend.model_name, messages=[{"role": "user", "content": "JSON please"}],
        max_tokens=30, temperature=0, response_format={"type": "json_object"})
    assert chat.choices[0].message.content.startswith("{")
    chat = client.chat.completions.create(
        model=backend.model_name, messages=[{"role": "user", "content": "a pet"}],
        max_tokens=80, temperature=0, extra_body={"structured_outputs": {"choice": ["yes", "no"]}},
        logprobs=True, top_logprobs=3)
    assert chat.choices[0].message.content in ("yes", "no")
    for entry in chat.choices[0].logprobs.content:  # ruled-out tokens at the floor, not -inf
        assert all(t.logprob >= -9999.0 for t in entry.top_logprobs)


@pytest.mark.parametrize("extra, param, says", [
    ({"guided_regex": "a(b"}, "guided_regex", "unclosed group"),
    ({"guided_json": {"type": "nonsense"}}, "guided_json", "nonsense"),
    ({"guided_choice": "red"}, "guided_choice", "list"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs",
     "exactly one"),
    ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs", "structural_tag"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice", "one structured output"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema"),
    ({"response_format": {"type": "grammar"}}, "response_format", "grammar"),
    ({"guided_regex": "[a-z]+", "min_tokens": 2}, "min_tokens", "structured"),
    ({"guided_whitespace_pattern": " "}, "guided_whitespace_pattern", "not supported"),
])
def test_bad_specs_are_400s_naming_the_field(server, client, extra, param, says):
    backend, _ = server
    for call in (lambda: client.completions.create(model=backend.model_name, prompt="x",
                                                   max_tokens=4, extra_body=extra),
                 lambda: client.chat.completions.create(
                     model=backend.model_name, max_tokens=4, extra_body=extra,
                     messages=[{"role": "user", "content": "x"}])):
        with pytest.raises(openai.BadRequestError) as caught:
            call()
        error = caught.value.body
        assert error["param"] == param and says in error["message"], error
