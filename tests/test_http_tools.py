"""Tool calling over HTTP with the official `openai` client
(pd_runtime/entrypoints/openai/request_parsing/tools.py), against the test model given a chat template in the Hermes
tool format (tools in the system turn, calls as <tool_call> blocks): a named function, "required",
"auto" read back by the template's format (the random model made to call through a regex), streamed
(each call's arguments as they are written: pd_runtime/parsers/tool_calls.py) or not; earlier calls
and their results rendered into the prompt; bad tools and choices 400s naming the field."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from pd_runtime.entrypoints.openai.request_parsing.tools import ToolPlan
from pd_runtime.parsers.registry import read_calls
from pd_runtime.parsers.text import refuse_json_constant
from pd_runtime.parsers.tool_calls import CallReader
from tests.router_support.serving import local
from tests.router_support.tool_serving import assembled, with_template

TEMPLATE = """{%- if tools %}<|im_start|>system
Functions you may call:
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>
To call one, answer <tool_call>{"name": <name>, "arguments": <object>}</tool_call>.<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == "assistant" and message.tool_calls %}<|im_start|>assistant
{{ message.content or "" }}
{%- for call in message.tool_calls %}
<tool_call>
{{ {"name": call.function.name, "arguments": call.function.arguments} | tojson }}
</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role == "tool" %}<|im_start|>user
<tool_response id="{{ message.tool_call_id }}">
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "days"],
           "properties": {"city": {"type": "string", "enum": ["paris", "oslo", "lima"]},
                          "days": {"type": "integer", "minimum": 1, "maximum": 7}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER,
                                           "description": "The forecast"}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "additionalProperties": False, "required": ["zone"],
             "properties": {"zone": {"type": "string", "enum": ["utc", "cet"]}}}}}]
USER = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def served(llama_dir, tmp_path_factory):
    yield from with_template(llama_dir, tmp_path_factory, "hermes", TEMPLATE)


def create(client, backend, **kw):
    return client.chat.completions.create(model=backend.model_name, messages=kw.pop(
        "messages", USER), tools=kw.pop("tools", TOOLS), max_tokens=kw.pop("max_tokens", 120),
        temperature=0.7,
        seed=kw.pop("seed", 1), **kw)


def streamed(client, backend, **kw):
    """(content, {index: call}, finish_reason) put together from the stream's deltas."""
    return assembled(create(client, backend, stream=True, **kw))


def test_a_named_function_is_always_called(served):
    backend, client = served
    choice = {"type": "function", "function": {"name": "get_weather"}}
    for seed in range(3):
        done = create(client, backend, tool_choice=choice, seed=seed)
        message = done.choices[0].message
        assert done.choices[0].finish_reason == "stop" and message.content is None
        (call,) = message.tool_calls
        assert call.function.name == "get_weather" and call.id.startswith("chatcmpl-tool-")
        jsonschema.validate(json.loads(call.function.arguments), WEATHER)
        content, calls, finish = streamed(client, backend, tool_choice=choice, seed=seed)
        assert content == "" and finish == "stop" and len(calls) == 1
        assert calls[0]["name"] == "get_weather" and calls[0]["id"].startswith("chatcmpl-tool")
        assert calls[0]["arguments"] == call.function.arguments  # the same tokens streamed


def test_required_calls_one_or_more_of_the_tools(served):
    backend, client = served
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for parallel in (True, False):
        done = create(client, backend, tool_choice="required", parallel_tool_calls=parallel,
                      max_tokens=200)
        calls = done.choices[0].message.tool_calls
        assert done.choices[0].finish_reason == "tool_calls" and calls
        assert parallel or len(calls) == 1
        for call in calls:
            jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
        content, streamed_calls, finish = streamed(client, backend, tool_choice="required",
                                                   parallel_tool_calls=parallel, max_tokens=200)
        assert finish == "tool_calls" and not content
        assert [(c["name"], c["arguments"]) for c in streamed_calls.values()] == \
            [(c.function.name, c.function.arguments) for c in calls]


CALLING = (r'Let me check\. <tool_call>\n\{"name": "get_weather", "arguments": '
           r'\{"city": "(paris|oslo)", "days": [1-7]\}\}\n</tool_call>')


def test_auto_reads_the_templates_format(served):
    """The random model is made to answer in the Hermes format by a regex; "auto" reads the
    call out of it, and the content before it is content, streamed without the marker."""
    backend, client = served
    done = create(client, backend, extra_body={"guided_regex": CALLING})
    message = done.choices[0].message
    assert done.choices[0].finish_reason == "tool_calls"
    assert message.content == "Let me check. "
    (call,) = message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    content, calls, finish = streamed(client, backend, extra_body={"guided_regex": CALLING})
    assert content == "Let me check. " and finish == "tool_calls"
    assert calls[0]["name"] == "get_weather" and calls[0]["arguments"] == call.function.arguments
    assert calls[0]["pieces"] > 3  # the arguments streamed as they were written
    plain = create(client, backend, extra_body={"guided_regex": "[a-z <]{5,20}"})
    assert plain.choices[0].message.tool_calls is None
    assert plain.choices[0].finish_reason == "stop" and plain.choices[0].message.content
    content, calls, finish = streamed(client, backend, extra_body={"guided_regex": "[a-z <]{5,20}"})
    assert content == plain.choices[0].message.content and not calls and finish == "stop"


def test_earlier_calls_and_results_reach_the_template(served):
    backend, client = served
    history = USER + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "paris", "days": 2}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21C"}]
    done = create(client, backend, messages=history, max_tokens=2, tool_choice="none")
    text = backend.tokenizer.apply_chat_template(
        [USER[0], {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": {"city": "paris", "days": 2}}}]},
         {"role": "tool", "content": "sunny, 21C", "tool_call_id": "call_1"}], tools=TOOLS)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "paris", "days": 2}}' \
        in text and '<tool_response id="call_1">\nsunny, 21C' in text and '"get_time"' in text
    want = len(backend.tokenizer.encode(text, add_special_tokens=False))
    assert done.usage.prompt_tokens == want


@pytest.mark.parametrize("kw, param, says", [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "not among the tools"),
    ({"tool_choice": "sometimes"}, "tool_choice", "must be"),
    ({"tool_choice": {"type": "function", "function": {"name": ["get_time"]}}}, "tool_choice",
     "must be"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools", "name"),
    ({"tools": [{"type": "retrieval"}]}, "tools", "function"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "bogus"}}}], "tool_choice": "required"}, "tools", "bogus"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice",
     "one structured output"),
    ({"tool_choice": "required", "extra_body": {"min_tokens": 3}}, "min_tokens", "structured"),
    ({"tool_choice": "required", "parallel_tool_calls": "yes"}, "parallel_tool_calls",
     "boolean"),
])
def test_bad_tools_are_400s(served, kw, param, says):
    backend, client = served
    with pytest.raises(openai.BadRequestError) as caught:
        create(client, backend, **kw)
    assert caught.value.body["param"] == param and says in caught.value.body["message"]


def test_auto_needs_a_format_the_template_shows(llama_dir):
    """The test model's own template teaches no tool format: "auto" is refused, not guessed;
    a named function still works (structured outputs need no format)."""
    with local(llama_dir) as (backend, port):
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x",
                               max_retries=0)
        with pytest.raises(openai.BadRequestError) as caught:
            create(client, backend)
        assert caught.value.body["param"] == "tool_choice"
        done = create(client, backend, tool_choice={"type": "function",
                                                    "function": {"name": "get_time"}})
        assert done.choices[0].message.tool_calls[0].function.name == "get_time"
        with pytest.raises(openai.BadRequestError) as caught:  # completions have no tools
            client.completions.create(model=backend.model_name, prompt="x", max_tokens=2,
                                      extra_body={"tools": TOOLS})
        assert caught.value.body["param"] == "tools"


@pytest.mark.parametrize("parser, text, content, calls", [
    ("hermes", 'ok <tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>\n'
     '<tool_call>{"name": "g", "arguments": {}}</tool_call>', "ok ", [("f", {"a": 1}), ("g", {})]),
    ("hermes", "<tool_call>{not json</tool_call>", "<tool_call>{not json</tool_call>", []),
    ("hermes", "no call here", "no call here", []),
    ("mistral", 'x[TOOL_CALLS] [{"name": "f", "arguments": {"b": "é"}}]', "x",
     [("f", {"b": "é"})]),
    # Mistral's newer form (Mistral Small 3.2, Magistral, Devstral): name[ARGS]{...}, repeated.
    ("mistral", 'x[TOOL_CALLS]f[ARGS]{"b": "[ARGS]"}[TOOL_CALLS]g[ARGS]{}', "x",
     [("f", {"b": "[ARGS]"}), ("g", {})]),
    ("mistral", '[TOOL_CALLS]f[ARGS]{"b": [1, 2', None, [("f", '{"b": [1, 2')]),  # cut short
    ("mistral", "[TOOL_CALLS]not a call", "[TOOL_CALLS]not a call", []),
    # Granite 3.x: a JSON list after <|tool_call|>, the content before it.
    ("granite", 'Let me check.<|tool_call|>[{"name": "f", "arguments": {"b": 1}}, '
     '{"name": "g", "arguments": {}}]', "Let me check.", [("f", {"b": 1}), ("g", {})]),
    ("granite", "<|tool_call|>nonsense", "<|tool_call|>nonsense", []),
    ("llama3_json", '<|python_tag|>{"name": "f", "parameters": {"c": 2}}; '
     '{"name": "g", "parameters": {}}', None, [("f", {"c": 2}), ("g", {})]),
    # Llama 4's template: the calls after <|python_start|> (and an empty <|python_end|>).
    ("llama3_json", '<|python_start|><|python_end|>{"name": "f", "parameters": {"c": 2}}', None,
     [("f", {"c": 2})]),
    ("llama3_json", '<|python_start|>{"name": "g", "parameters": {}}<|python_end|>', None,
     [("g", {})]),
    ("llama3_json", "{plain text in braces", "{plain text in braces", []),
    ("llama3_json", "  Plain text, no call at all.", "  Plain text, no call at all.", []),
    # An answer in JSON with a "name" that is no tool's: content, not a call.
    ("llama3_json", '{"name": "Alice", "age": 30}', '{"name": "Alice", "age": 30}', []),
    ("llama3_json", '{"name": "f", "parameters": null}', None, [("f", {})]),  # none: {}
    # Arguments as written, once a call has begun (streamed before they are whole).
    ("llama3_json", '{"name": "f", "parameters": {"x": NaN}}', None, [("f", '{"x": NaN}')]),
    ("hermes", '<tool_call>{"arguments": {"z": "}"}, "name": "h"}</tool_call>', None,
     [("h", {"z": "}"})]),
    ("hermes", '<tool_call>{"name": "s", "arguments": "{\\"q\\": 1}"}</tool_call>', None,
     [("s", {"q": 1})]),  # a JSON string: decoded
    ("hermes", 'a <tool_call>{"name": "cut", "arguments": {"q": "ab', "a ",
     [("cut", '{"q": "ab')]),  # cut short by max_tokens
    ("hermes", '<tool_call>{"name": "n"}</tool_call>', None, [("n", {})]),
    ("hermes", '<tool_call>{"name": "f", "arguments": {}}</tool_call> then <tool_call>{bad',
     None, [("f", {})]),  # after a call, a broken one is dropped
    ("hermes", '<tool_call>{"name": 7, "arguments": {}}</tool_call>',
     '<tool_call>{"name": 7, "arguments": {}}</tool_call>', []),
    # DeepSeek-V3 / R1 (a fenced object after the name), and V3.1 (the object after the sep).
    ("deepseek_v3", "Checking.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n"
     '```json\n{"a": "`}"}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>g\n'
     "```json\n{}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>", "Checking.",
     [("f", {"a": "`}"}), ("g", {})]),
    ("deepseek_v3", '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>h<｜tool▁sep｜>{"x": [1]}'
     "<｜tool▁call▁end｜><｜tool▁calls▁end｜>", None, [("h", {"x": [1]})]),
    ("deepseek_v3", "<｜tool▁calls▁begin｜>nonsense", "<｜tool▁calls▁begin｜>nonsense", []),
    ("deepseek_v3", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>cut\n```json"
     '\n{"q": "ab', None, [("cut", '{"q": "ab')]),
])
def test_formats_parse_what_their_models_write(parser, text, content, calls):
    plan = ToolPlan("auto", parser=parser, names=("f", "g", "h", "s", "n", "cut"))
    got_content, got = read_calls(plan, text)
    assert got_content == content
    assert [(c["function"]["name"], _arguments(c)) for c in got] == calls
    reader, shown, streamed = CallReader(plan), "", {}
    for end in range(1, len(text) + 1):  # a character at a time
        more, deltas = reader.feed(text[:end], end == len(text))
        shown += more
        assert not calls or all(tag not in shown for tag in (
            "<tool_call>", "[TOOL_CALLS]", "<｜tool▁calls▁begin｜>", "<|tool_call|>"))
        if not calls and parser == "llama3_json" and not text.lstrip().startswith("{"):
            assert shown == text[:end] or not text[:end].strip()  # plain text streams on
        for delta in deltas:
            if "id" in delta:  # a call's first delta: its id, type and name
                assert delta["index"] == len(streamed) and delta["type"] == "function"
                streamed[delta["index"]] = dict(delta["function"])
            else:
                streamed[delta["index"]]["arguments"] += delta["function"]["arguments"]
    assert shown == ((content or "") if calls else text)
    assert list(streamed.values()) == [c["function"] for c in got]


def _arguments(call: dict):
    """A call's arguments as JSON (strictly: no NaN), else as written."""
    text = call["function"]["arguments"]
    try:
        return json.loads(text, parse_constant=refuse_json_constant)
    except ValueError:
        return text


def test_arguments_stream_as_they_are_written():
    """A long call's arguments go out in pieces as the output grows, not whole at its end."""
    text = ('<tool_call>\n{"name": "write", "arguments": {"body": "' + "x" * 400 + '"}}\n'
            '</tool_call>')
    reader, pieces = CallReader(ToolPlan("auto", parser="hermes")), []
    for end in range(8, len(text) + 8, 8):
        for delta in reader.feed(text[:end], end >= len(text))[1]:
            pieces.append(delta["function"]["arguments"])
    assert len(pieces) > 40 and all(len(p) <= 8 for p in pieces[1:])
    assert json.loads("".join(pieces)) == {"body": "x" * 400}


def test_required_with_nested_models_and_mistral_ids(served):
    """A tool whose parameters refer to their own $defs (every nested pydantic model, as the
    client's pydantic_function_tool writes it) under "required", where all tools share one
    schema; and Mistral's format, whose templates take back only 9-character ids."""
    import pydantic

    from pd_runtime.entrypoints.openai.request_parsing.tools import prepare

    class City(pydantic.BaseModel):
        name: str = pydantic.Field(json_schema_extra={"enum": ["paris", "oslo"]})

    class Trip(pydantic.BaseModel):
        origin: City
        stops: int = pydantic.Field(ge=0, le=3)

    backend, client = served
    tool = openai.pydantic_function_tool(Trip)
    assert "$defs" in tool["function"]["parameters"]
    done = create(client, backend, tools=[tool, TOOLS[1]], tool_choice="required",
                  max_tokens=600, parallel_tool_calls=False)
    assert done.choices[0].finish_reason == "tool_calls", done.choices[0].message.content
    for call in done.choices[0].message.tool_calls:
        if call.function.name == "Trip":
            Trip.model_validate_json(call.function.arguments)
    named = create(client, backend, tools=[tool], max_tokens=600,
                   tool_choice={"type": "function", "function": {"name": "Trip"}})
    Trip.model_validate_json(named.choices[0].message.tool_calls[0].function.arguments)
    _, _, plan = prepare({"tools": TOOLS, "tool_choice": "required"}, "mistral")
    _, calls = read_calls(plan, '[{"name": "get_time", "parameters": {"zone": "utc"}}]')
    assert len(calls[0]["id"]) == 9 and calls[0]["id"].isalnum()
    clash = dict(tool, function={**tool["function"], "name": "Other", "parameters": {
        **tool["function"]["parameters"], "$defs": {"City": {"type": "integer"}}}})
    with pytest.raises(openai.BadRequestError) as caught:
        create(client, backend, tools=[tool, clash], tool_choice="required")
    assert caught.value.body["param"] == "tools" and "City" in caught.value.body["message"]



# -- the Responses API: flat function tools, calls and their outputs as items -------------------
FLAT_TOOLS = [{"type": "function", **t["function"]} for t in TOOLS]


def test_responses_calls_as_items_and_takes_their_outputs(served):
    backend, client = served
    schemas = {t["name"]: t["parameters"] for t in FLAT_TOOLS}
    kw = {"model": backend.model_name, "input": "Weather in Paris?", "tools": FLAT_TOOLS,
          "max_output_tokens": 200, "temperature": 0.7, "extra_body": {"seed": 1}}
    for choice, chat_choice in (({"type": "function", "name": "get_weather"},
                                 {"type": "function", "function": {"name": "get_weather"}}),
                                ("required", "required")):
        done = client.responses.create(tool_choice=choice, **kw)
        calls = [item for item in done.output if item.type == "function_call"]
        assert done.status == "completed" and calls
        chat = create(client, backend, tool_choice=chat_choice, max_tokens=200)
        assert [(c.name, c.arguments) for c in calls] == [
            (c.function.name, c.function.arguments) for c in chat.choices[0].message.tool_calls]
        for call in calls:
            assert call.id.startswith("fc_") and call.call_id
            jsonschema.validate(json.loads(call.arguments), schemas[call.name])
        with client.responses.stream(tool_choice=choice, **kw) as stream:
            events = list(stream)
        streamed_calls = [e.item for e in events if e.type == "response.output_item.done"
                          and e.item.type == "function_call"]
        assert [(c.name, c.arguments) for c in streamed_calls] == \
            [(c.name, c.arguments) for c in calls]  # the same tokens streamed
        # The next turn carries the calls and their outputs back.
        follow = client.responses.create(**{**kw, "max_output_tokens": 8, "input": [
            {"role": "user", "content": "Weather in Paris?"},
            *[{"type": "function_call", "call_id": c.call_id, "name": c.name,
               "arguments": c.arguments} for c in calls],
            *[{"type": "function_call_output", "call_id": c.call_id, "output": "sunny"}
              for c in calls]]})
        assert follow.output and follow.usage.input_tokens > done.usage.input_tokens + 10


def test_each_format_is_known_from_its_template():
    """Qwen3-Coder's XML calls inside <tool_call> are not hermes (read as hermes they came back
    as text): tests/test_tool_calls_xml.py reads them. Mistral's newer name[ARGS] form is read
    as mistral."""
    from pd_runtime.chat_template import tool_call_format

    qwen3_coder = ("{% for m in messages %}{{ m.content }}{% endfor %}<tool_call>\n"
                   "<function={{ name }}>\n<parameter=x>\n</parameter>\n</function>\n</tool_call>")
    mistral_v11 = "[TOOL_CALLS]{{ call.name }}[ARGS]{{ call.arguments | tojson }}"
    assert tool_call_format(qwen3_coder) == "qwen3_coder"
    assert tool_call_format(mistral_v11) == "mistral"
    assert tool_call_format("<tool_call>{{ x | tojson }}</tool_call>") == "hermes"
    assert tool_call_format("[TOOL_CALLS][{{ calls | tojson }}]") == "mistral"
    assert tool_call_format("{{- '<|tool_call|>' + message.tool_calls | tojson }}") == "granite"
    assert tool_call_format("{{'<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + t['type']}}") == \
        "deepseek_v3"


def test_a_lone_surrogate_in_a_call_is_escaped_not_a_500():
    """A JSON-string argument decoded with a lone \\ud83d escape in it: the body is ASCII JSON
    (UTF-8 cannot encode the character), the client reads the escape back."""
    from pd_runtime.entrypoints.openai.streaming import json_body

    content, calls = read_calls(ToolPlan("auto", parser="hermes"),
                                '<tool_call>{"name": "f", "arguments": "{\\"q\\": \\"\\ud83d\\"}"}'
                                '</tool_call>')
    arguments = calls[0]["function"]["arguments"]
    assert "\ud83d" in arguments  # the character itself
    body = json_body({"calls": calls}).body
    assert b"\\ud83d" in body and json.loads(body)["calls"][0]["function"]["arguments"] == \
        arguments


def test_earlier_calls_reach_a_template_that_joins_their_arguments_as_text(llama_dir):
    """DeepSeek-R1's templates (and its distills') write an earlier call's arguments with
    `'...' + tool['function']['arguments']`: the JSON text the client sent, while a template
    that writes them with tojson or walks them with |items gets the object."""
    from pd_runtime.tokenizer import Tokenizer
    from pd_runtime.entrypoints.openai.request_parsing.protocol import prepare_chat

    tokenizer = Tokenizer(llama_dir)
    tokenizer.chat_template = (
        "{% for m in messages %}{% if m.tool_calls %}{% for tool in m.tool_calls %}"
        "{{ '<call>' + tool['type'] + ':' + tool['function']['name'] + '\\n' + "
        "tool['function']['arguments'] + '</call>' }}"
        "{{ tool.function.arguments | tojson }}"
        "{% for k, v in tool.function.arguments | items %}[{{ k }}={{ v }}]{% endfor %}"
        "<{{ tool.function.arguments.text }}>{% endfor %}{% else %}{{ m.role }}: {{ m.content }}\n{% endif %}{% endfor %}")
    tokenizer._template = None
    sent = '{"city":  "paris", "text": "hi"}'
    prepared = prepare_chat({"messages": USER + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": sent}}]},
        {"role": "user", "content": "And?"}], "max_tokens": 2}, tokenizer, "m", 4096)
    text = tokenizer.decode(prepared.prompts[0])
    assert f"<call>function:get_weather\n{sent}</call>" in text
    # (an argument named "text" is that argument, not the JSON text)
    assert '{"city": "paris", "text": "hi"}[city=paris][text=hi]<hi>' in text
