"""Qwen3-Coder's XML tool calls (pd_runtime/parsers/tool_calls_xml.py): read whole and as streamed
in any chunking, typed from the tools' schemas (the template writes every value as text), fuzzed
against a renderer written as the template writes calls; and over HTTP with the official
`openai` client, the test model given a template in this format and made to call through a
regex."""

from __future__ import annotations

import json
import random

import jsonschema
import openai
import pytest

from pd_runtime.chat_template import tool_call_format
from pd_runtime.entrypoints.openai.request_parsing.tools import ToolPlan
from pd_runtime.parsers.registry import read_calls, reader
from tests.router_support.tool_serving import assembled, streamed, with_template

PARAMS = {"get_weather": {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "hot": {"type": "boolean"},
    "opts": {"type": "object"}, "tags": {"type": "array"}, "ratio": {"type": "number"},
    "note": {"type": ["string", "null"]}, "unit": {"enum": ["c", "f"]}, "any": {}}},
    "noop": {"type": "object", "properties": {}}}


def plan(parallel: bool = True) -> ToolPlan:
    return ToolPlan("auto", parser="qwen3_coder", parallel=parallel, names=tuple(PARAMS),
                    params=PARAMS)


def call(name: str, **params) -> str:
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


def parsed(arguments: str):
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments  # cut short: as written


@pytest.mark.parametrize("text, content, calls", [
    ("Let me check.\n\n" + call("get_weather", city='Paris "x"', days=3, hot=True,
                                opts='{"a": [1]}') + "\n" + call("noop"),
     "Let me check.\n\n", [("get_weather", {"city": 'Paris "x"', "days": 3, "hot": True,
                                             "opts": {"a": [1]}}), ("noop", {})]),
    # Typed by the schema: a string stays a string whatever it looks like; a number written as
    # a float fits an integer; None and True as the template's `string` writes them.
    (call("get_weather", city="123", days="3.0", note="None", tags="[1, 2]", ratio="0.5",
          unit="c", any='{"k": null}'), None,
     [("get_weather", {"city": "123", "days": 3, "note": None, "tags": [1, 2], "ratio": 0.5,
                       "unit": "c", "any": {"k": None}})]),
    # Text that is not what the schema says: as the text.
    (call("get_weather", note="12", any="free text", hot="maybe"), None,
     [("get_weather", {"note": "12", "any": "free text", "hot": "maybe"})]),
    # A multi-line value keeps its inner and extra newlines; only the format's are taken off.
    (call("get_weather", city="\ndef f():\n    return '<a>'\n"), None,
     [("get_weather", {"city": "\ndef f():\n    return '<a>'\n"})]),
    # Without <tool_call> around it, and with </parameter> left out.
    ("<function=get_weather>\n<parameter=city>\nOslo\n<parameter=days>\n2\n</function>", None,
     [("get_weather", {"city": "Oslo", "days": 2})]),
    # A tool no schema names: its values untyped (JSON where they parse).
    (call("other", a="1", b="x y"), None, [("other", {"a": 1, "b": "x y"})]),
    ("no call here <b>", "no call here <b>", []),
    ("<tool_call>\nnot a function</tool_call>", "<tool_call>\nnot a function</tool_call>", []),
    ("<tool_call>\n<function=bad name!>\n</function>", "<tool_call>\n<function=bad name!>\n"
     "</function>", []),
    # Cut short (max_tokens): the parameters read, the last as far as it was written.
    ("ok <tool_call>\n<function=get_weather>\n<parameter=city>\nPar", "ok ",
     [("get_weather", {"city": "Par"})]),
    ("<tool_call>\n<function=get_weather>\n<parameter=days>\n3", None,
     [("get_weather", {"days": 3})]),
    ("<tool_call>\n<function=get_weather>\n<parameter=opts>\n{\"a\": [1", None,
     [("get_weather", {"opts": '{"a": [1'})]),
    ("<tool_call>\n<function=get_weather>\n<parameter=city>", None,
     [("get_weather", {"city": ""})]),
    # A name alone is no call yet: cut there, or followed by prose, it is content.
    ("<tool_call>\n<function=noop>", "<tool_call>\n<function=noop>", []),
    ("Call it as <function=noop>, like this.", "Call it as <function=noop>, like this.", []),
    # After a whole call, a broken one is dropped.
    (call("noop") + "\n<tool_call>\n<junk>", None, [("noop", {})]),
    # </function> left out: </tool_call> ends the call, and the next one is read.
    ("<tool_call>\n<function=get_weather>\n<parameter=days>\n1\n</parameter>\n</tool_call>"
     "\n" + call("get_weather", days=2), None,
     [("get_weather", {"days": 1}), ("get_weather", {"days": 2})]),
    # </parameter> and </function> left out: </tool_call> ends the value too.
    ("<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</tool_call>\n" +
     call("get_weather", city="Rome"), None,
     [("get_weather", {"city": "Oslo"}), ("get_weather", {"city": "Rome"})]),
    # Stray text between parameters is dropped; a broken parameter ends the call whole.
    ("<function=get_weather>\n<parameter=days>\n1\n</parameter>\nhmm\n<parameter=hot>\n"
     "false\n</parameter>\n<parameter=>\n", None,
     [("get_weather", {"days": 1, "hot": False})]),
    # Past a float's range: no JSON number, the text; quoted text under string-or-null: a
    # string holding the quotes (the template writes strings as they are).
    (call("get_weather", ratio="1e400", any="-1e999", note='"hi"'), None,
     [("get_weather", {"ratio": "1e400", "any": "-1e999", "note": '"hi"'})]),
])
def test_calls_are_read_whole_and_streamed_alike(text, content, calls):
    got_content, got = read_calls(plan(), text)
    assert got_content == content
    assert [(c["function"]["name"], parsed(c["function"]["arguments"])) for c in got] == calls
    whole = [(c["function"]["name"], c["function"]["arguments"]) for c in got]
    shown, by_char = streamed(text, range(1, len(text)), plan())
    assert by_char == whole
    assert shown == ((content or "") if calls else text)


def test_types_come_through_refs_and_odd_schemas_do_not_break_the_reader():
    params = {"f": {"type": "object", "$defs": {"Code": {"type": "string"}}, "properties": {
        "zip": {"$ref": "#/$defs/Code"}, "opt": {"anyOf": [{"type": "string"},
                                                            {"type": "null"}]},
        "odd": {"anyOf": 5}, "deep": {"allOf": [{"allOf": [{"type": "integer"}]}]},
        "free": {}}}}
    p = ToolPlan("auto", parser="qwen3_coder", names=("f",), params=params)
    text = call("f", zip="01234", opt="None", odd="7", deep="8", free="True")
    _, got = read_calls(p, text)
    assert json.loads(got[0]["function"]["arguments"]) == {
        "zip": "01234", "opt": None, "odd": 7, "deep": 8, "free": True}
    assert streamed(text, range(1, len(text)), p)[1] == [("f", got[0]["function"]["arguments"])]


def test_one_call_without_parallel_calls():
    text = call("noop") + "\n" + call("get_weather", days=1)
    _, calls = read_calls(plan(parallel=False), text)
    assert [c["function"]["name"] for c in calls] == ["noop"]


def test_a_string_parameter_streams_as_it_is_written():
    text = call("get_weather", city="x" * 400 + "\n", days=2)
    r, pieces = reader(plan()), []
    for end in range(8, len(text) + 8, 8):
        for delta in r.feed(text[:end], end >= len(text))[1]:
            pieces.append(delta["function"]["arguments"])
    middle = [p for p in pieces if p and set(p) == {"x"}]  # the city's pieces, in its midst
    assert len(middle) >= 45 and all(len(p) <= 8 for p in middle)
    assert json.loads("".join(pieces)) == {"city": "x" * 400 + "\n", "days": 2}


_CHARS = 'ab <>/="\\\n\té😀{}[]'


def _value(rng: random.Random, kind: str):
    if kind == "string":
        while True:
            text = "".join(rng.choice(_CHARS) for _ in range(rng.randint(0, 12)))
            if not any(tag in text for tag in ("</parameter>", "<parameter=", "</function>")) \
                    and text.strip() not in ("null", "None"):
                return text
    return {"integer": lambda: rng.randint(-10**6, 10**6),
            "number": lambda: rng.choice([rng.uniform(-1e3, 1e3), 1e-7, 2.5e20]),
            "boolean": lambda: rng.random() < 0.5,
            "object": lambda: {"k": [rng.randint(0, 9), "v\n\"<"], "n": None},
            "array": lambda: [rng.random() < 0.5, "é", {"x": 1}],
            "null": lambda: None}[kind]()


def _written(value) -> str:
    """A value as the template writes it: JSON for an object or array, else Jinja's string."""
    return json.dumps(value, ensure_ascii=False) if isinstance(value, (dict, list)) \
        else str(value)


def test_fuzzed_calls_round_trip_in_any_chunking():
    """Random calls written as the template writes them, with the tags these models sometimes
    leave out, read whole and streamed in random chunkings: the same content and calls, and
    the arguments the template was given."""
    rng = random.Random(0)
    kinds = ["string", "integer", "number", "boolean", "object", "array", "null"]
    for trial in range(600):
        params, calls, text = {}, [], ""
        content = rng.choice(["", "Sure.", "a < b"])
        for n in range(rng.randint(1, 3)):
            name, props, args, body = f"tool{n}", {}, {}, ""
            for k in range(rng.randint(0, 4)):
                kind = rng.choice(kinds)
                props[f"p{k}"] = {"type": ["string", "null"] if kind == "null" else kind}
                args[f"p{k}"] = _value(rng, kind)
                end = "</parameter>\n" if rng.random() < 0.9 else ""
                body += f"<parameter=p{k}>\n{_written(args[f'p{k}'])}\n{end}"
            params[name] = {"type": "object", "properties": props}
            wrap = rng.random() < 0.9
            text += ("\n\n" if content or calls else "") + ("<tool_call>\n" if wrap else "") + \
                f"<function={name}>\n{body}</function>" + ("\n</tool_call>" if wrap else "")
            calls.append((name, args))
        p = ToolPlan("auto", parser="qwen3_coder", params=params, names=tuple(params))
        got_content, got = read_calls(p, content + text)
        assert got_content == ((content + "\n\n") if content else None), trial
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                for c in got] == calls, (trial, content + text)
        full = content + text
        cuts = sorted(rng.sample(range(1, len(full)), min(len(full) - 1, rng.randint(1, 30))))
        shown, pieces = streamed(full, cuts, p)
        assert pieces == [(c["function"]["name"], c["function"]["arguments"]) for c in got]
        assert shown == (got_content or ""), trial


def test_the_format_is_known_from_the_template():
    coder = ("{% for m in messages %}{{ m.content }}{% endfor %}<tool_call>\n"
             "<function={{ name }}>\n<parameter=x>\n</parameter>\n</function>\n</tool_call>")
    assert tool_call_format(coder) == "qwen3_coder"
    # A <function= call with JSON inside (no <parameter= tags) is no format read here.
    assert tool_call_format('<function={{ name }}>{{ args | tojson }}</function>') is None


# -- over HTTP ---------------------------------------------------------------------------------
TEMPLATE = """{%- if tools %}<|im_start|>system
You may call these functions:
<tools>
{%- for tool in tools %}
<function><name>{{ tool.function.name }}</name>
{%- for pname, p in tool.function.parameters.properties | items %}
<parameter><name>{{ pname }}</name><type>{{ p.type }}</type></parameter>
{%- endfor %}
</function>
{%- endfor %}
</tools>
Call one as <tool_call>
<function=NAME>
<parameter=KEY>
value
</parameter>
</function>
</tool_call><|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == "assistant" and message.tool_calls %}<|im_start|>assistant
{{ message.content or "" }}
{%- for tc in message.tool_calls %}
{%- set fn = tc.function %}
<tool_call>
<function={{ fn.name }}>
{% for key, value in fn.arguments | items %}<parameter={{ key }}>
{{ value | tojson | safe if value is mapping or (value is sequence and value is not string)
   else value | string }}
</parameter>
{% endfor %}</function>
</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role == "tool" %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

WEATHER = {"type": "object", "required": ["city", "days"],
           "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
CALLING = (r"Checking\.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\n"
           r"(paris|oslo|new york)\n</parameter>\n<parameter=days>\n[1-7]\n</parameter>\n"
           r"</function>\n</tool_call>")


@pytest.fixture(scope="module")
def served(llama_dir, tmp_path_factory):
    yield from with_template(llama_dir, tmp_path_factory, "coder", TEMPLATE)


def test_auto_reads_xml_calls_over_http(served):
    backend, client = served
    kw = dict(model=backend.model_name, tools=TOOLS, max_tokens=120, temperature=0.7, seed=3,
              messages=[{"role": "user", "content": "Weather in Paris?"}],
              extra_body={"guided_regex": CALLING})
    done = client.chat.completions.create(**kw)
    message = done.choices[0].message
    assert done.choices[0].finish_reason == "tool_calls" and message.content == "Checking.\n\n"
    (tc,) = message.tool_calls
    args = json.loads(tc.function.arguments)
    assert tc.function.name == "get_weather" and isinstance(args["days"], int)
    jsonschema.validate(args, WEATHER)
    content, calls, finish = assembled(client.chat.completions.create(stream=True, **kw))
    assert content == "Checking.\n\n" and finish == "tool_calls"
    assert calls[0]["name"] == "get_weather" and calls[0]["arguments"] == tc.function.arguments
    # (How many pieces depends on how many tokens each streamed chunk carried, which a busy
    # box coalesces; test_a_string_parameter_streams_as_it_is_written pins the streaming.)
    assert calls[0]["pieces"] >= 1
    # The Responses API reads the same call as an item (vLLM's guided_regex taken there too).
    response = client.responses.create(
        model=backend.model_name, input="Weather in Paris?", max_output_tokens=120,
        temperature=0.7, tools=[{"type": "function", **TOOLS[0]["function"]}],
        extra_body={"seed": 3, "guided_regex": CALLING})
    (item,) = [o for o in response.output if o.type == "function_call"]
    assert item.name == "get_weather" and json.loads(item.arguments) == args
    with pytest.raises(openai.BadRequestError) as raised:  # one structured output at a time
        client.responses.create(model=backend.model_name, input="x", max_output_tokens=4,
                                text={"format": {"type": "json_object"}},
                                extra_body={"guided_regex": "a+"})
    assert raised.value.body["param"] == "guided_regex"


def test_earlier_xml_calls_reach_the_template(served):
    """A call sent back in the history is rendered by the template from its arguments as an
    object (values written as the model would write them)."""
    backend, client = served
    history = [{"role": "user", "content": "Weather?"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "c1", "type": "function", "function": {
                       "name": "get_weather",
                       "arguments": '{"city": "oslo", "days": 2, "hot": true}'}}]},
               {"role": "tool", "tool_call_id": "c1", "content": "cold"}]
    done = client.chat.completions.create(model=backend.model_name, tools=TOOLS,
                                          messages=history, max_tokens=2, tool_choice="none")
    text = backend.tokenizer.apply_chat_template(
        [history[0], {**history[1], "content": "", "tool_calls": [{**history[1]["tool_calls"][0],
         "function": {"name": "get_weather",
                      "arguments": {"city": "oslo", "days": 2, "hot": True}}}]}, history[2]],
        tools=TOOLS)
    assert "<function=get_weather>\n<parameter=city>\noslo\n</parameter>\n<parameter=days>\n2" \
        "\n</parameter>\n<parameter=hot>\nTrue\n</parameter>\n</function>" in text
    assert done.usage.prompt_tokens == len(backend.tokenizer.encode(text,
                                                                    add_special_tokens=False))
