"""Tool calling on chat completions, as OpenAI's API and vLLM's serve it: `tools` (functions
with JSON-schema parameters) go to the chat template, earlier calls and their results go back
to it in the messages, and the answer's calls come out as `message.tool_calls`.

`tool_choice` says how the calls are made:
  a named function   the output is held to that function's parameters (structured outputs):
                     always one call, whatever the model; finish_reason "stop" (as OpenAI)
  "required"         the output is held to a JSON array of {"name", "parameters"} calls of
                     the given tools (at least one; one with parallel_tool_calls false)
  "auto"             the model decides, in the format its chat template teaches it, read back
                     by that format's reader (pd_runtime/parsers/tool_calls.py: the one the template
                     shows, or router.tool_call_parser); finish_reason "tool_calls" when it
                     called
  "none"             plain text (the tools still go to the template, as vLLM passes them)
The default is "auto" with tools, "none" without.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Optional

from pd_runtime import structured
from pd_runtime.api import InvalidRequestError
from pd_runtime.entrypoints.openai.request_parsing.schema import InvalidRequest
from pd_runtime.parsers.registry import TOOL_CALL_PARSERS
from pd_runtime.parsers.text import refuse_json_constant
from pd_runtime.parsers.tool_calls_base import FUNCTION_NAME

MAX_TOOLS = 128


@dataclass(frozen=True)
class ToolPlan:
    """What the response side needs: how to read the output into calls."""
    mode: str                   # "named", "required" or "auto"
    name: Optional[str] = None  # the named function
    parser: Optional[str] = None  # auto: a TOOL_CALL_PARSERS name
    parallel: bool = True
    short_ids: bool = False     # the model's format takes 9-character call ids (mistral)
    names: tuple = ()           # auto: the tools' names (a bare JSON object calls one of them)
    params: Optional[dict] = field(default=None, compare=False)  # auto: name -> parameters


def prepare(data: dict, tool_format: Optional[str]
            ) -> tuple[Optional[list], Optional[dict], Optional[ToolPlan]]:
    """(the tools for the template, the structured-outputs spec, the plan) of a chat body;
    (None, None, None) without tools. `tool_format`: the model's tool-call format, a
    TOOL_CALL_PARSERS name (Tokenizer.tool_call_format: its chat template's, or
    router.tool_call_parser), or None."""
    tools, choice = data.get("tools"), data.get("tool_choice")
    parallel = data.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool) and parallel is not None:
        raise InvalidRequest("parallel_tool_calls must be a boolean", param="parallel_tool_calls")
    if not tools:
        if choice not in (None, "none"):
            raise InvalidRequest("tool_choice needs tools", param="tool_choice")
        return None, None, None
    functions = _functions(tools)
    short = tool_format == "mistral"
    if choice is None:
        choice = "auto"
    if choice == "none":
        return list(tools), None, None
    if choice == "required":
        defs: dict = {}
        calls = [{"type": "object", "additionalProperties": False,
                  "required": ["name", "parameters"],
                  "properties": {"name": {"type": "string", "enum": [name]},
                                 "parameters": _hoist_defs(params, defs, name)}}
                 for name, params in functions.items()]
        schema = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
        if defs:
            schema["$defs"] = defs
        if parallel is False:
            schema["maxItems"] = 1
        return list(tools), _checked({"json": schema}), \
            ToolPlan("required", parallel=parallel is not False, short_ids=short)
    if choice == "auto":
        parser = tool_format if tool_format in TOOL_CALL_PARSERS else None
        if parser is None:
            raise InvalidRequest("tool_choice auto needs the model's tool-call format, and its "
                                 "chat template shows none (set router.tool_call_parser, or "
                                 "send tool_choice required or a named function)",
                                 param="tool_choice")
        return list(tools), None, ToolPlan("auto", parser=parser,
                                           parallel=parallel is not False, short_ids=short,
                                           names=tuple(functions), params=functions)
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) and \
        choice.get("type") == "function" and isinstance(choice.get("function"), dict) else None
    if not isinstance(name, str):
        raise InvalidRequest('tool_choice must be "none", "auto", "required" or {"type": '
                             '"function", "function": {"name": ...}}', param="tool_choice")
    if name not in functions:
        raise InvalidRequest(f"tool_choice names {name!r}, which is not among the tools",
                             param="tool_choice")
    return list(tools), _checked({"json": functions[name]}), \
        ToolPlan("named", name=name, short_ids=short)


def _checked(spec: dict) -> dict:
    """A grammar from the tools' parameter schemas: one that cannot be enforced is a 400
    naming `tools`, the field it came from."""
    try:
        structured.check(spec, "tools")
    except InvalidRequestError as exc:
        raise InvalidRequest(str(exc), param="tools") from None
    return spec


def _hoist_defs(params: dict, defs: dict, name: str) -> dict:
    """A tool's parameters with its $defs (and definitions) moved to `defs`, the root of the
    "required" schema, where its "#/$defs/..." references now resolve (they would point into
    the array schema otherwise). Two tools that define one name differently are refused."""
    params = dict(params)
    for key in ("$defs", "definitions"):
        found = params.pop(key, None)
        if not isinstance(found, dict):
            continue
        for def_name, definition in found.items():
            if def_name in defs and defs[def_name] != definition:
                raise InvalidRequest(f"tools: {name!r} defines {def_name!r} differently from "
                                     f"another tool (tool_choice required puts every tool's "
                                     f"$defs in one schema)", param="tools")
            defs[def_name] = definition
        if key == "definitions":  # one place for both: "#/definitions/X" -> "#/$defs/X"
            params = json.loads(json.dumps(params).replace('"#/definitions/', '"#/$defs/'))
    return params


def _functions(tools: Any) -> dict[str, Any]:
    """name -> parameters schema, checking the tools' shape."""
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise InvalidRequest(f"tools must be a list of at most {MAX_TOOLS} tools",
                             param="tools")
    out: dict[str, Any] = {}
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or \
                not isinstance(fn, dict):
            raise InvalidRequest(f'tools[{i}] must be {{"type": "function", "function": '
                                 f'{{...}}}}', param="tools")
        name = fn.get("name")
        if not isinstance(name, str) or not FUNCTION_NAME.fullmatch(name):
            raise InvalidRequest(f"tools[{i}].function.name must be 1-64 letters, digits, "
                                 f"_ . : or -", param="tools")
        if name in out:
            raise InvalidRequest(f"tools: {name!r} is named twice", param="tools")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise InvalidRequest(f"tools[{i}].function.parameters must be a JSON schema "
                                 f"object", param="tools")
        out[name] = params
    return out


def template_messages(dicts: list[dict], messages: list) -> list[dict]:
    """The messages' tool fields for the template: an assistant's `tool_calls` with their
    arguments as objects (templates write them with tojson, as vLLM passes them) and a tool
    result's `tool_call_id`."""
    for i, (out, message) in enumerate(zip(dicts, messages)):
        extra = message.model_extra or {}
        if extra.get("tool_call_id") is not None:
            out["tool_call_id"] = str(extra["tool_call_id"])
        calls = extra.get("tool_calls")
        if not calls:
            continue
        if not isinstance(calls, list):
            raise InvalidRequest(f"messages[{i}].tool_calls must be a list", param="messages")
        out["tool_calls"] = [_history_call(call, i) for call in calls]
    return dicts


def _history_call(call: Any, i: int) -> dict:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise InvalidRequest(f"messages[{i}].tool_calls: each needs function.name",
                             param="messages")
    arguments = fn.get("arguments", "{}")
    text = arguments if isinstance(arguments, str) else None
    if text is not None:
        try:
            arguments = _loads(text) if text.strip() else {}
        except (ValueError, RecursionError):
            raise InvalidRequest(f"messages[{i}].tool_calls: function.arguments is not JSON",
                                 param="messages") from None
    if isinstance(arguments, dict):
        arguments = Arguments(arguments, text)
    return {"id": call.get("id"), "type": "function",
            "function": {"name": fn["name"], "arguments": arguments}}


class Arguments(dict):
    """A call's arguments as templates take them: an object (`tojson`, `|items`, as vLLM passes
    them), which is also its JSON text where a template joins it to a string (DeepSeek-R1's
    and its distills' templates write `'...' + tool['function']['arguments']`)."""

    # An underscore name: a template's `arguments.text` is the "text" argument, and the
    # sandbox keeps templates off it.
    __slots__ = ("_json_text",)

    def __init__(self, value: dict, text: Optional[str] = None):
        super().__init__(value)
        self._json_text = text if text and text.strip() else \
            json.dumps(value, ensure_ascii=False)

    def __str__(self) -> str:
        return self._json_text

    def __add__(self, other):
        return self._json_text + other if isinstance(other, str) else NotImplemented

    def __radd__(self, other):
        return other + self._json_text if isinstance(other, str) else NotImplemented

    def __reduce__(self):  # pickled as what it is (to the tokenizer's process)
        return Arguments, (dict(self), self._json_text)


def _loads(text: str) -> Any:
    """JSON as a strict parser reads it: NaN and Infinity are not JSON values."""
    return json.loads(text, parse_constant=refuse_json_constant)
