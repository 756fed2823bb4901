"""Tool calls as a Python list of calls (pd_runtime/parsers/tool_calls_pythonic.py): read whole and
as streamed in any chunking, values decoded from Python's literals, fuzzed against calls written
with Python's own repr; and over HTTP with the official `openai` client, the test model given a
pythonic template and made to call through a regex."""

from __future__ import annotations

import json
import random

import pytest

from pd_runtime.chat_template import tool_call_format
from pd_runtime.entrypoints.openai.request_parsing.tools import ToolPlan
from pd_runtime.parsers.registry import read_calls, reader
from tests.router_support.tool_serving import assembled, streamed, with_template

NAMES = ("get_weather", "get_time", "noop")


def plan(parallel: bool = True, names=NAMES) -> ToolPlan:
    return ToolPlan("auto", parser="pythonic", parallel=parallel, names=tuple(names))


@pytest.mark.parametrize("text, content, calls", [
    ('[get_weather(city="Paris", days=3), get_time(zone=\'utc\')]', None,
     [("get_weather", {"city": "Paris", "days": 3}), ("get_time", {"zone": "utc"})]),
    # Llama 4's code markers around the list; Python's escapes, numbers, tuples, JSON's names.
    ('<|python_start|>[get_weather(city="Pa\\nris\\u00e9\\x21\\101", days=-3.5, '
     'opts={"a": (1, 2), 3: None}, hot=True, cold=false, note=null, s={"x"})]<|python_end|>',
     None, [("get_weather", {"city": "Pa\nrisé!A", "days": -3.5, "opts": {"a": [1, 2], "3": None},
                             "hot": True, "cold": False, "note": None, "s": ["x"]})]),
    ('<|python_tag|>get_weather(city="Oslo"); get_time()', None,
     [("get_weather", {"city": "Oslo"}), ("get_time", {})]),
    # Triple quotes, raw strings, a nested string holding brackets and quotes, a name as value.
    ("[get_weather(city='''a\n\"b\" ''', path=r'C:\\new\\d', tags=['x)', \"y]'\"], unit=celsius)]",
     None, [("get_weather", {"city": 'a\n"b" ', "path": "C:\\new\\d", "tags": ["x)", "y]'"],
                             "unit": "celsius"})]),
    ("[functions.get_time(zone='cet'), default_api.noop()]", None,
     [("get_time", {"zone": "cet"}), ("noop", {})]),
    # Not calls: content, all of it.
    ("[1, 2, 3] are the numbers.", "[1, 2, 3] are the numbers.", []),
    ("Paris is sunny.", "Paris is sunny.", []),
    ("[unknown_tool(a=1)]", "[unknown_tool(a=1)]", []),
    ('[get_weather("Paris")]', '[get_weather("Paris")]', []),  # positional: no parameter
    ("get_weather is a tool", "get_weather is a tool", []),
    ("[get_weather(", "[get_weather(", []),  # cut before any argument began
    # After a call: what follows is dropped; a cut call has its arguments so far.
    ("[get_time(zone='utc')]\n\nThe time is", None, [("get_time", {"zone": "utc"})]),
    ("[get_time(zone='utc'), bogus]", None, [("get_time", {"zone": "utc"})]),
    ('[get_weather(city="Par', None, [("get_weather", {"city": "Par"})]),
    ('[get_weather(city="Paris", days=', None, [("get_weather", {"city": "Paris", "days": None})]),
    ("[get_weather(opts={'a': [1, 2", None, [("get_weather", {"opts": "{'a': [1, 2"})]),
    ('[get_weather(city="a\\', None, [("get_weather", {"city": "a\\"})]),
    ('[get_weather(city=""', None, [("get_weather", {"city": ""})]),  # cut after ""
    # A surrogate pair's halves (JSON's way to write it) are one character, whichever chunk
    # each half arrives in; a raw string's \N is no named escape (a Windows path).
    ('[noop(x="\\ud83d\\ude00")]', None, [("noop", {"x": "\U0001f600"})]),
    ('[get_weather(city=r"C:\\New", days=3, tags=[r"C:\\New"])]', None,
     [("get_weather", {"city": "C:\\New", "days": 3, "tags": ["C:\\New"]})]),
    ('[get_weather(city="\\N{LATIN SMALL LETTER E WITH ACUTE}")]', None,
     [("get_weather", {"city": "\u00e9"})]),
    # An argument's name padded past any model's habit is no call (and not read again each
    # time the output grows).
    ("[get_weather(city" + " " * 100 + "='x')]", "[get_weather(city" + " " * 100 + "='x')]", []),
    ('[get_weather(days=1e999, big=123456789012345678901234567890)]', None,
     [("get_weather", {"days": "1e999", "big": 123456789012345678901234567890})]),
])
def test_calls_are_read_whole_and_streamed_alike(text, content, calls):
    got_content, got = read_calls(plan(), text)
    assert got_content == content
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got] == calls
    whole = [(c["function"]["name"], c["function"]["arguments"]) for c in got]
    for cuts in (range(1, len(text)), (), range(1, len(text), 7)):  # a character at a time, ...
        shown, pieces = streamed(text, cuts, plan())
        assert pieces == whole and shown == (content or "")


def test_a_long_tool_name_behind_a_prefix_streams_as_it_reads_whole():
    name = "t" * 64  # the longest a tool may be called
    text = f"[functions.{name}(city='a')]"
    content, calls = read_calls(plan(names=(name,)), text)
    assert content is None and calls[0]["function"]["name"] == name
    assert streamed(text, range(1, len(text)), plan(names=(name,))) == \
        ("", [(name, '{"city": "a"}')])


def test_one_call_without_parallel_calls():
    _, calls = read_calls(plan(parallel=False), "[get_time(zone='utc'), noop()]")
    assert [c["function"]["name"] for c in calls] == ["get_time"]


def test_a_string_argument_streams_as_it_is_written():
    """A long string goes out decoded in pieces as it is written, escapes never split."""
    body = "line\\n\\t\\u00e9\\\\" * 40
    text = f'[get_weather(code="{body}", n=2)]'
    r, pieces = reader(plan()), []
    for end in range(3, len(text) + 3, 3):
        for delta in r.feed(text[:end], end >= len(text))[1]:
            pieces.append(delta["function"]["arguments"])
    assert len(pieces) > 60
    assert json.loads("".join(pieces)) == {"code": "line\n\té\\" * 40, "n": 2}


_CHARS = "ab é\"'\\\n\t{}[](),=;#\u4e2d\U0001f600\x00"


def _value(rng: random.Random, depth: int = 0):
    kind = rng.choice(["str", "int", "float", "bool", "none", "list", "dict", "tuple"]
                      if depth < 2 else ["str", "int", "bool", "none"])
    if kind == "str":
        return "".join(rng.choice(_CHARS) for _ in range(rng.randint(0, 12)))
    if kind in ("list", "tuple"):
        items = [_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
        return tuple(items) if kind == "tuple" else items
    if kind == "dict":
        return {f"k{n}": _value(rng, depth + 1) for n in range(rng.randint(0, 3))}
    return {"int": lambda: rng.randint(-10**12, 10**12), "float": lambda: rng.uniform(-1e3, 1e3),
            "bool": lambda: rng.random() < 0.5, "none": lambda: None}[kind]()


def _written(rng: random.Random, value) -> str:
    """A value as a model writes it: Python's repr, or JSON (which these models borrow), or a
    string in triple or double quotes."""
    if isinstance(value, str) and rng.random() < 0.3:
        return json.dumps(value, ensure_ascii=rng.random() < 0.5)
    if isinstance(value, str) and rng.random() < 0.2 and "'" not in value and \
            not value.endswith("\\"):
        return "'''" + value.replace("\\", "\\\\") + "'''"
    if not isinstance(value, (tuple, str)) and rng.random() < 0.3:
        return json.dumps(value)
    return repr(value)


def _jsonable(value):
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    return value


def test_fuzzed_calls_round_trip_in_any_chunking():
    """Random calls written as a model writes them, read whole and streamed in random
    chunkings: the same calls, and the arguments that were written."""
    rng = random.Random(0)
    for trial in range(600):
        calls, written = [], []
        for _ in range(rng.randint(1, 3)):
            name = rng.choice(NAMES)
            args = {f"p{k}": _value(rng) for k in range(rng.randint(0, 4))}
            sep = rng.choice([", ", ",", ",\n  "])
            written.append(f"{name}(" + sep.join(f"{k}={_written(rng, v)}"
                                                 for k, v in args.items()) + ")")
            calls.append((name, _jsonable(args)))
        listed = rng.random() < 0.8
        text = rng.choice(["", "<|python_start|>", " "]) + \
            ("[" + ", ".join(written) + "]" if listed else "; ".join(written))
        content, got = read_calls(plan(), text)
        assert content is None, (trial, text)
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                for c in got] == calls, (trial, text)
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 40))))
        shown, pieces = streamed(text, cuts, plan())
        assert pieces == [(c["function"]["name"], c["function"]["arguments"]) for c in got]
        assert shown == "", trial


def test_the_format_is_known_from_the_template():
    pythonic = ("{{- 'If you decide to invoke any of the function(s), you MUST put it in the "
                "format of [func_name1(params_name1=params_value1, params_name2=params_value2"
                "...), func_name2(params)]' }}{% for m in messages %}{{ m.content }}{% endfor %}")
    assert tool_call_format(pythonic) == "pythonic"
    # Llama 4's own template: JSON calls after <|python_start|>...<|python_end|>.
    llama4 = ("{%- elif message.role == 'ipython' %}{{- '<|python_start|>' }}{{ content }}"
              "{{- '<|python_end|>' }}{{- '{\"name\": \"' + tool_call.function.name + '\", ' }}"
              "{{- '\"parameters\": ' }}{{- tool_call.function.arguments | tojson }}")
    assert tool_call_format(llama4) == "llama3_json"
    for text in ('<|python_start|><|python_end|>{"name": "get_time", "parameters": {"zone": 1}}',
                 '<|python_start|>{"name": "get_time", "parameters": {"zone": 1}}<|python_end|>'):
        content, calls = read_calls(ToolPlan("auto", parser="llama3_json", names=NAMES), text)
        assert content is None and json.loads(calls[0]["function"]["arguments"]) == {"zone": 1}


# -- over HTTP ---------------------------------------------------------------------------------
TEMPLATE = """{%- if tools %}<|im_start|>system
You can call functions. To call any, answer with nothing else than a list in the format of
[func_name1(params_name1=params_value1, params_name2=params_value2...), func_name2(params)]
The functions, in JSON:
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == "assistant" and message.tool_calls %}<|im_start|>assistant
[{%- for tc in message.tool_calls %}{{ tc.function.name }}(
{%- for key, value in tc.function.arguments | items %}{{ key }}={{ value | tojson }}
{%- if not loop.last %}, {% endif %}{% endfor %})
{%- if not loop.last %}, {% endif %}{% endfor %}]<|im_end|>
{% elif message.role == "tool" %}<|im_start|>user
{{ message.content }}<|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

WEATHER = {"type": "object", "required": ["city", "days"],
           "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
CALLING = r'\[get_weather\(city="(paris|oslo|new york)", days=[1-7]\)\]'


@pytest.fixture(scope="module")
def served(llama_dir, tmp_path_factory):
    yield from with_template(llama_dir, tmp_path_factory, "pythonic", TEMPLATE)


def test_auto_reads_pythonic_calls_over_http(served):
    backend, client = served
    kw = dict(model=backend.model_name, tools=TOOLS, max_tokens=120, temperature=0.7, seed=5,
              messages=[{"role": "user", "content": "Weather in Paris?"}],
              extra_body={"guided_regex": CALLING})
    done = client.chat.completions.create(**kw)
    message = done.choices[0].message
    assert done.choices[0].finish_reason == "tool_calls" and message.content is None
    (tc,) = message.tool_calls
    args = json.loads(tc.function.arguments)
    assert tc.function.name == "get_weather" and args["city"] in ("paris", "oslo", "new york")
    assert isinstance(args["days"], int) and 1 <= args["days"] <= 7
    content, calls, finish = assembled(client.chat.completions.create(stream=True, **kw))
    assert content == "" and finish == "tool_calls"
    assert calls[0]["name"] == "get_weather" and calls[0]["arguments"] == tc.function.arguments
    # (How many pieces depends on how many tokens each streamed chunk carried, which a busy
    # box coalesces; test_a_string_argument_streams_as_it_is_written pins the streaming.)
    assert calls[0]["pieces"] >= 1
    # The call goes back in the history as the template writes it, and the model goes on.
    history = [kw["messages"][0], {"role": "assistant", "content": None, "tool_calls": [
        {"id": tc.id, "type": "function", "function": {"name": tc.function.name,
                                                      "arguments": tc.function.arguments}}]},
               {"role": "tool", "tool_call_id": tc.id, "content": "sunny"}]
    follow = client.chat.completions.create(model=backend.model_name, tools=TOOLS,
                                            messages=history, max_tokens=4, tool_choice="none")
    rendered = backend.tokenizer.apply_chat_template(
        [history[0], {**history[1], "content": "", "tool_calls": [{**history[1]["tool_calls"][0],
         "function": {"name": "get_weather", "arguments": args}}]}, history[2]], tools=TOOLS)
    assert f'[get_weather(city="{args["city"]}", days={args["days"]})]' in rendered
    assert follow.usage.prompt_tokens == len(backend.tokenizer.encode(
        rendered, add_special_tokens=False))
