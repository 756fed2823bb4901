"""Tool calls in Qwen3-Coder's XML form (router.tool_call_parser "qwen3_coder"; the later Qwen
models whose templates write calls the same way), read as they are written:

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>
    </tool_call>

A parameter's value is text (the template writes a string as it is, an object or array as
JSON, anything else through Jinja's `string`: True, None), so its JSON type comes from the
tool's schema. A "string" parameter becomes a JSON string and streams as it is written; any
other is read once whole: JSON where it parses and fits the schema's types (True/False for a
boolean, None for null too), else the text as a string. The newline after the opening tag and
the one before the closing tag are the format's, not the value's. A value ends at
</parameter>, or where a model leaves that out, at the next <parameter=, </function> or
</tool_call> (which also ends a call whose </function> is left out).

The rest is as pd_runtime/parsers/tool_calls.py reads its formats: content before the first call
streams, a call goes out once its name is read and its first parameter (or its end) begins, what
lies between calls is dropped, output that breaks the format before a call has begun is content
after all. The arguments are always a JSON object: a call broken off, or cut short
(max_tokens), has the parameters read so far, its last value as far as it was written. The
<tool_call> around a call may be left out, as these models sometimes do.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Optional

from pd_runtime.parsers import tool_calls_base
from pd_runtime.parsers.text import partial_tag_len, refuse_json_constant
from pd_runtime.parsers.tool_calls_base import FUNCTION_NAME, call_id
from pd_runtime.parsers.tool_calls_base import SPACE as _SPACE

_OPENERS = ("<tool_call>", "<function=")
_FUNCTION = "<function="
_PARAM, _PARAM_END, _FUNCTION_END, _CALL_END = \
    "<parameter=", "</parameter>", "</function>", "</tool_call>"
_VALUE_ENDS = (_PARAM_END, _PARAM, _FUNCTION_END, _CALL_END)
_PARAMS_NEXT = (_PARAM, _FUNCTION_END, _CALL_END)
_LONGEST_END = max(map(len, _VALUE_ENDS))
_VALUE_END = re.compile("|".join(map(re.escape, _VALUE_ENDS)))
_ESCAPED = re.compile(r'["\\\x00-\x1f]')  # what JSON escapes in a string (non-ASCII kept)
_NAME_SO_FAR = re.compile(r"[A-Za-z0-9_.:-]{0,64}")
_PARAM_NAME = re.compile(r"[^<>\n]{1,128}")
_PARAM_SO_FAR = re.compile(r"[^<>\n]{0,128}")
_PY_TYPES = {"object": dict, "array": list, "string": str, "null": type(None)}
_MAX_SCHEMA_DEPTH = 8


@dataclass
class _Call:
    id: str
    name: str
    schema: dict  # its tool's parameters schema (for their types, and $refs into it)
    parts: list[str] = field(default_factory=list)  # its arguments as JSON, as built
    given: int = 0  # parts given out
    params: int = 0  # parameters begun
    header_sent: bool = False
    done: bool = False


class XmlCallReader:
    """A choice's calls under "auto", fed its output as it grows (CallReader's interface)."""

    whole = tool_calls_base.whole
    _show = tool_calls_base.show

    def __init__(self, plan):
        self.tools = plan.params or {}
        self.short_ids = plan.short_ids
        self.parallel = plan.parallel
        self.shown = 0  # characters of the output sent as content
        self.visible = 0  # content may be sent up to here (unless it turns out plain)
        self.plain = False  # it holds no call: all of it is content
        self.opened = False  # a call's opener was seen (content ends there)
        self.pos = 0  # how far the output is read
        self.state = "gap"  # gap, open, name, params, param_name, value_start, value
        self.pending: Optional[_Call] = None  # its name read, not yet begun
        self.calls: list[_Call] = []
        self.settled = 0  # the calls before this one are sent whole
        self.over = False  # no more calls are read
        self.value_start = self.value_sent = self.scan = 0  # the value being read
        self.value_schema: Any = None
        self.streams = False  # it is a string, streamed as written

    def feed(self, text: str, finished: bool = False) -> tuple[str, list[dict]]:
        """The output so far -> (content to send now, tool_calls deltas to send now)."""
        if not (self.plain or self.over):
            self._read(text)
            if finished and not (self.plain or self.over):
                self._cut(text)
        if finished and not self.calls:
            self.plain = True  # no call began: it was content after all
        if self.plain:
            return self._show(text, len(text)), []
        return self._show(text, self.visible), self._deltas()

    # -- reading -------------------------------------------------------------------------------
    def _read(self, text: str) -> None:
        i = self.pos
        while i < len(text) and not (self.over or self.plain):
            step = getattr(self, "_" + self.state)(text, i)
            if step is None:  # undecided until more is written
                break
            i = step
        self.pos = max(i, self.pos)

    def _gap(self, text: str, i: int) -> Optional[int]:
        found = [(at, opener) for opener in _OPENERS if (at := text.find(opener, i)) >= 0]
        if not found:
            hold = max(partial_tag_len(text, opener) for opener in _OPENERS)
            if not self.opened:
                self.visible = max(self.visible, len(text) - hold)
            self.pos = max(i, len(text) - hold)  # what is between calls is dropped
            return None
        at, opener = min(found)
        if not self.opened:
            self.opened, self.visible = True, at
        self.state = "open" if opener == "<tool_call>" else "name"
        return at + len(opener)

    def _open(self, text: str, i: int) -> Optional[int]:
        """After <tool_call>: space, then <function=."""
        while i < len(text) and text[i] in _SPACE:
            i += 1
        if text.startswith(_FUNCTION, i):
            self.state = "name"
            return i + len(_FUNCTION)
        if _FUNCTION.startswith(text[i:]):
            self.pos = i
            return None
        return self._broken()

    def _name(self, text: str, i: int) -> Optional[int]:
        at = text.find(">", i)
        if at < 0:
            self.pos = i
            return None if _NAME_SO_FAR.fullmatch(text, i) else self._broken()
        if not FUNCTION_NAME.fullmatch(text, i, at):
            return self._broken()
        name = text[i:at]
        schema = self.tools.get(name)
        self.pending = _Call(call_id(self.short_ids), name,
                             schema if isinstance(schema, dict) else {})
        self.state = "params"
        return at + 1

    def _params(self, text: str, i: int) -> Optional[int]:
        """Within a function: space, then a parameter, or its end (</function>, or
        </tool_call> where that is left out); other text between parameters is dropped."""
        while i < len(text) and text[i] in _SPACE:
            i += 1
        if text.startswith(_PARAM, i):
            self._begin_call()
            self.state = "param_name"
            return i + len(_PARAM)
        for end in (_FUNCTION_END, _CALL_END):
            if text.startswith(end, i):
                self._begin_call()
                self._close()
                self.state = "gap"
                self.over = not self.parallel
                return i + len(end)
        rest = text[i:]
        if any(tag.startswith(rest) for tag in _PARAMS_NEXT):
            self.pos = i
            return None
        if self.pending is not None:  # nothing of it yet: not a call after all
            return self._broken()
        at = text.find("<", i + 1)
        if at < 0:
            self.pos = len(text)
            return None
        return at

    def _param_name(self, text: str, i: int) -> Optional[int]:
        at = text.find(">", i)
        if at < 0:
            self.pos = i
            return None if _PARAM_SO_FAR.fullmatch(text, i) else self._broken()
        if not _PARAM_NAME.fullmatch(text, i, at):
            return self._broken()
        call, name = self.calls[-1], text[i:at]
        properties = call.schema.get("properties")
        self.value_schema = properties.get(name) if isinstance(properties, dict) else None
        self.streams = _types(self.value_schema, call.schema) == {"string"}
        call.parts.append(("{" if not call.params else ", ") + _json(name) + ": " +
                          ('"' if self.streams else ""))
        call.params += 1
        self.state = "value_start"
        return at + 1

    def _value_start(self, text: str, i: int) -> int:
        if text[i] == "\n":  # the format's, not the value's
            i += 1
        self.value_start = self.value_sent = self.scan = i
        self.state = "value"
        return i

    def _value(self, text: str, i: int) -> Optional[int]:
        found = _VALUE_END.search(text, self.scan) if "<" in text[self.scan:] else None
        if found is None:
            if self.streams:
                self._stream(text, _held(text, self.value_sent))
            self.scan = max(self.value_start, len(text) - _LONGEST_END + 1)
            self.pos = len(text)
            return None
        at, end = found.start(), found.group()
        self._end_value(text, at - 1 if at > self.value_start and text[at - 1] == "\n" else at)
        self.state = "params"
        return at + len(end) if end == _PARAM_END else at

    def _stream(self, text: str, upto: int) -> None:
        if upto > self.value_sent:
            piece = text[self.value_sent:upto]
            self.calls[-1].parts.append(_json(piece)[1:-1] if _ESCAPED.search(piece) else piece)
            self.value_sent = upto

    def _end_value(self, text: str, stop: int) -> None:
        if self.streams:
            self._stream(text, stop)
            self.calls[-1].parts.append('"')
        else:
            self.calls[-1].parts.append(_typed(text[self.value_start:stop], self.value_schema,
                                               self.calls[-1].schema))

    def _begin_call(self) -> None:
        if self.pending is not None:
            self.calls.append(self.pending)
            self.pending = None

    def _close(self) -> None:
        """The call being read ends here: its arguments made a whole object."""
        call = self.calls[-1] if self.calls else None
        if call is None or call.done:
            return
        call.parts.append("}" if call.params else "{}")
        call.done = True

    def _cut(self, text: str) -> None:
        """The output ended inside a call: it has what was read, its last value as far as it
        was written."""
        self.pending = None
        if not self.calls or self.calls[-1].done:
            return
        if self.state == "value_start":  # its key is out, its value not begun
            self.value_start = self.value_sent = len(text)
            self.state = "value"
        if self.state == "value":
            self._end_value(text, len(text))
        self._close()
        self.over = True

    def _broken(self) -> None:
        self.pending = None
        if self.calls:
            self._close()  # (broken only between parameters: its last one is whole)
            self.over = True  # what follows the last whole call is dropped
        else:
            self.plain = True

    # -- what goes out -------------------------------------------------------------------------
    def _deltas(self) -> list[dict]:
        out = []
        for index in range(self.settled, len(self.calls)):
            call = self.calls[index]
            piece = "".join(call.parts[call.given:])
            call.given = len(call.parts)
            if not call.header_sent:
                call.header_sent = True
                out.append({"index": index, "id": call.id, "type": "function",
                            "function": {"name": call.name, "arguments": piece}})
            elif piece:
                out.append({"index": index, "function": {"arguments": piece}})
            if call.done and index == self.settled:
                self.settled += 1
        return out


def _held(text: str, start: int) -> int:
    """Where the end of `text` that could begin a value's end ("\n</parameter>", ...) starts:
    a streamed value is given up to there (len(text): none of it could)."""
    k = max(start, len(text) - _LONGEST_END)
    if "<" not in text[k:] and "\n" not in text[k:]:
        return len(text)
    while True:
        found = [at for at in (text.find("\n", k), text.find("<", k)) if at >= 0]
        if not found:
            return len(text)
        k = min(found)
        rest = text[k:]
        if any(end.startswith(rest) or ("\n" + end).startswith(rest) for end in _VALUE_ENDS):
            return k
        k += 1


def _types(schema: Any, root: dict, depth: int = 0) -> set:
    """The JSON types a parameter's schema allows (empty: not said), through its anyOf /
    oneOf / allOf and $refs into its tool's $defs."""
    if not isinstance(schema, dict) or depth > _MAX_SCHEMA_DEPTH:
        return set()
    kind = schema.get("type")
    if isinstance(kind, str):
        return {kind}
    if isinstance(kind, list):
        return {k for k in kind if isinstance(k, str)}
    ref = schema.get("$ref")
    if isinstance(ref, str):
        for prefix in ("#/$defs/", "#/definitions/"):
            defs = root.get(prefix[2:-1])
            if ref.startswith(prefix) and isinstance(defs, dict):
                return _types(defs.get(ref[len(prefix):]), root, depth + 1)
    out: set = set()
    for key in ("anyOf", "oneOf", "allOf"):
        options = schema.get(key)
        for option in options if isinstance(options, list) else ():
            out |= _types(option, root, depth + 1)
    enum = schema.get("enum")
    if not out and isinstance(enum, list) and enum and all(isinstance(v, str) for v in enum):
        out = {"string"}
    return out


def _typed(raw: str, schema: Any, root: dict) -> str:
    """A value read whole, as the JSON its schema's types say it is: the text as a string
    where it is no JSON of those types (the template writes a string as it is, so text in
    quotes is a string holding them)."""
    types, text = _types(schema, root), raw.strip()
    if text in ("null", "None") and (not types or "null" in types):
        return "null"
    if text in ("true", "false", "True", "False") and (not types or "boolean" in types):
        return "true" if text.lower() == "true" else "false"
    try:
        value = json.loads(text, parse_constant=refuse_json_constant)
    except (ValueError, RecursionError):
        return _json(raw)
    if isinstance(value, str):
        return _json(raw)
    if types and not any(_fits(value, kind) for kind in types):
        if "integer" in types and isinstance(value, float) and value.is_integer():
            value = int(value)
        elif "string" in types:
            return _json(raw)
    try:
        return json.dumps(value, ensure_ascii=False, allow_nan=False)
    except ValueError:  # a number past a float's range (1e400): no JSON number
        return _json(raw)


def _fits(value: Any, kind: str) -> bool:
    if kind in ("integer", "number", "boolean"):
        if isinstance(value, bool):
            return kind == "boolean"
        return isinstance(value, int) or (kind == "number" and isinstance(value, float))
    return isinstance(value, _PY_TYPES.get(kind, ()))


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)
