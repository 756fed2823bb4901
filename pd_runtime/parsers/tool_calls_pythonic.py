"""Tool calls written as a Python list of calls (router.tool_call_parser "pythonic": Llama 3.2
and Llama 4 under the pythonic prompt of Meta's guides, ToolACE, the models BFCL trains), read
as they are written:

    [get_weather(city="Paris", days=3), get_time(zone='UTC')]

The calls are the whole output, after an optional <|python_start|> or <|python_tag|> (the
Llama models' code markers); an output that does not open with a call of one of the tools is
content, all of it. A call outside a list (`get_weather(city="Paris")`, as Llama 3.2 sometimes
writes), or several separated by `;`, is read too. Arguments are keywords whose values are
Python literals (strings in either quote, triple or raw; numbers; True, False, None and JSON's
true, false, null; lists, tuples, sets and dicts, nested), given as one JSON object: a string
value streams as it is written, decoded; any other goes out once whole, as JSON (a tuple or
set as an array); a value that is no literal (a name, an expression) goes out as its text, a
JSON string. A positional argument breaks the format: no parameter is named to take it.

The rest is as pd_runtime/parsers/tool_calls.py reads its formats: a call goes out once its name is
read and its first argument (or its end) begins, output that breaks the format before a call has
begun is content after all, and after one has, what follows the last whole call is dropped
(<|python_end|> too); a call cut short (max_tokens) has the arguments read so far, its last
value as far as it was written.
"""

from __future__ import annotations

import json
import re
from typing import Any, Optional

from pd_runtime.parsers import tool_calls_base
from pd_runtime.parsers.python_literals import decode_string, literal_json, string_scan
from pd_runtime.parsers.tool_calls_base import FUNCTION_NAME, call_id
from pd_runtime.parsers.tool_calls_base import SPACE as _SPACE
from pd_runtime.parsers.tool_calls_xml import XmlCallReader, _Call

_PREFIXES = ("<|python_start|>", "<|python_tag|>")
_NAME_CHARS = re.compile(r"[A-Za-z0-9_.:-]*")
_NAME_START = re.compile(r"[A-Za-z_]")
_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_STRING_PREFIX = "rRuU"  # what may stand before a streamed string's quote (r: raw)
_VALUE_STOPS = re.compile(r"[\\'\"()\[\]{},]")  # what a value's scan looks at
_CLOSERS = {"(": ")", "[": "]", "{": "}"}
# Bounds on what is read again while undecided: a call's name (a tool's 64 characters after a
# `functions.`-like prefix), an argument's name, and the space between it and its `=`.
_LONGEST_NAME, _LONGEST_KEY, _LONGEST_GAP = 160, 256, 64


class PythonicCallReader:
    """A choice's calls under "auto", fed its output as it grows (CallReader's interface).
    The bookkeeping (calls as JSON parts, their deltas, a broken or closed call) is
    XmlCallReader's; the states are this format's."""

    whole = tool_calls_base.whole
    _show = tool_calls_base.show
    feed = XmlCallReader.feed
    _read = XmlCallReader._read
    _begin_call = XmlCallReader._begin_call
    _close = XmlCallReader._close
    _broken = XmlCallReader._broken
    _deltas = XmlCallReader._deltas

    def __init__(self, plan):
        self.names = frozenset(plan.names)
        self.short_ids = plan.short_ids
        self.parallel = plan.parallel
        self.shown = 0
        self.visible = 0  # nothing comes before the calls: content only when it is plain
        self.plain = False
        self.pos = 0
        self.state = "start"  # start, open, between, call_name, args, value_start, string,
        #                       after_value, value
        self.listed = False  # the calls are in a [...] list
        self.pending: Optional[_Call] = None
        self.calls: list[_Call] = []
        self.settled = 0
        self.over = False
        self.scan = self.value_start = self.value_sent = 0  # the value being read
        self.quote = ""  # a string's quote (', ", ''' or \"\"\")
        self.raw = False  # a raw string: its backslashes are its own
        self.nested: list[str] = []  # a whole-read value's open brackets' closers
        self.inner = ""  # the quote of a string inside it being read

    def _wait(self, i: int) -> None:
        """Undecided until more is written: reading resumes at `i`."""
        self.pos = i
        return None

    # -- around the calls ----------------------------------------------------------------------
    def _start(self, text: str, i: int) -> Optional[int]:
        i = _skip(text, i)
        rest = text[i:]
        for prefix in _PREFIXES:
            if rest.startswith(prefix):
                self.state = "open"
                return i + len(prefix)
        if not rest or any(prefix.startswith(rest) for prefix in _PREFIXES):
            return self._wait(i)
        self.state = "open"
        return i

    def _open(self, text: str, i: int) -> Optional[int]:
        i = _skip(text, i)
        if i == len(text):
            return self._wait(i)
        if text[i] == "[":
            self.listed, self.state = True, "between"
            return i + 1
        if _NAME_START.match(text, i):
            self.state = "call_name"
            return i
        return self._broken()

    def _between(self, text: str, i: int) -> Optional[int]:
        """Before a call, or after one: the list's commas, or outside a list `;`, then the
        next call's name; `]` ends the list."""
        while i < len(text) and (text[i] in _SPACE or text[i] == "," or
                                 (text[i] == ";" and not self.listed)):
            i += 1
        if i == len(text):
            return self._wait(i)
        if text[i] == "]" and self.listed:
            self.over = True  # (what follows, <|python_end|> too, is not the calls')
            return i + 1
        if _NAME_START.match(text, i):
            self.state = "call_name"
            return i
        return self._broken()

    def _call_name(self, text: str, i: int) -> Optional[int]:
        end = _NAME_CHARS.match(text, i).end()
        if end == len(text) and end - i <= _LONGEST_NAME:
            return self._wait(i)
        name = _tool_name(text[i:end], self.names)
        if end == len(text) or text[end] != "(" or name is None:
            return self._broken()
        self.pending = _Call(call_id(self.short_ids), name, {})
        self.state = "args"
        return end + 1

    # -- a call's arguments --------------------------------------------------------------------
    def _args(self, text: str, i: int) -> Optional[int]:
        """Inside a call's parentheses, before an argument: `key=`, or the call's end."""
        i = _skip(text, i)
        if i == len(text):
            return self._wait(i)
        if text[i] == ")":
            self._end_call()
            return i + 1
        key = _KEY.match(text, i)
        if key is None:
            return self._broken()  # a positional argument, or no argument at all
        at = _skip(text, key.end())
        if key.end() - i > _LONGEST_KEY or at - key.end() > _LONGEST_GAP:
            return self._broken()  # (no model's; and a wait here reads it all again)
        if at == len(text):
            return self._wait(i)
        if text[at] != "=":
            return self._broken()
        self._begin_call()
        call = self.calls[-1]
        call.parts.append(("{" if not call.params else ", ") + _json(key.group()) + ": ")
        call.params += 1
        self.state = "value_start"
        return at + 1

    def _value_start(self, text: str, i: int) -> Optional[int]:
        i = _skip(text, i)
        raw = i < len(text) and text[i] in _STRING_PREFIX
        at = i + raw
        if at >= len(text) or (text[at] in "'\"" and len(text) - at < 3 and
                               text[at:] == text[at] * (len(text) - at)):
            return self._wait(i)  # (one or two quotes: "", or a triple quote's start)
        if text[at] not in "'\"":
            self.state, self.value_start, self.scan = "value", i, i
            self.nested, self.inner = [], ""
            return i
        self.quote = text[at] * 3 if text.startswith(text[at] * 3, at) else text[at]
        self.raw = raw and text[i] in "rR"
        self.calls[-1].parts.append('"')
        self.state = "string"
        self.scan = self.value_sent = at + len(self.quote)
        return self.scan

    def _string(self, text: str, i: int) -> Optional[int]:
        """A string value, given out decoded as it is written."""
        safe, end = string_scan(text, self.scan, self.quote)
        self.scan = safe
        self._stream(text, safe)
        if end is None:
            return self._wait(safe)
        self.calls[-1].parts.append('"')
        self.state = "after_value"
        return end + len(self.quote)

    def _stream(self, text: str, upto: int, final: bool = False) -> None:
        if upto > self.value_sent:
            piece = text[self.value_sent:upto] if self.raw else \
                decode_string(text, self.value_sent, upto, final)
            self.calls[-1].parts.append(_json(piece)[1:-1])
            self.value_sent = upto

    def _after_value(self, text: str, i: int) -> Optional[int]:
        i = _skip(text, i)
        if i == len(text):
            return self._wait(i)
        if text[i] == ",":
            self.state = "args"
            return i + 1
        if text[i] == ")":
            self._end_call()
            return i + 1
        return self._broken()

    def _value(self, text: str, i: int) -> Optional[int]:
        """Any other value, read whole: to the `,` or `)` that ends it, past its brackets
        and strings."""
        j = self.scan
        while True:
            if self.inner:  # inside a string in the value
                safe, end = string_scan(text, j, self.inner)
                if end is None:
                    self.scan = self.pos = safe
                    return None
                j, self.inner = end + len(self.inner), ""
                continue
            found = _VALUE_STOPS.search(text, j)
            if found is None:
                self.scan = self.pos = len(text)
                return None
            j, ch = found.start(), found.group()
            if ch in "'\"":
                if len(text) - j < 3 and text[j:] == ch * (len(text) - j):
                    self.scan = self.pos = j  # its quote's length is not known yet
                    return None
                self.inner = ch * 3 if text.startswith(ch * 3, j) else ch
                j += len(self.inner)
            elif ch == "\\":  # (outside a string: no literal; passed over)
                j += 1
            elif ch in _CLOSERS:
                self.nested.append(_CLOSERS[ch])
                j += 1
            elif self.nested and ch != ",":
                if self.nested.pop() != ch:
                    return self._broken_value(text, j + 1)
                j += 1
            elif self.nested:
                j += 1
            else:  # a `,` or closer outside brackets: the value's end
                self.calls[-1].parts.append(literal_json(text[self.value_start:j]))
                self.state = "after_value"
                return j

    def _broken_value(self, text: str, end: int) -> None:
        self.calls[-1].parts.append(literal_json(text[self.value_start:end]))
        return self._broken()

    def _end_call(self) -> None:
        self._begin_call()
        self._close()
        self.state = "between"
        self.over = not self.parallel

    def _cut(self, text: str) -> None:
        """The output ended inside a call: it has what was read, its last value as far as it
        was written (a key with no value yet: null)."""
        self.pending = None
        if not self.calls or self.calls[-1].done:
            return
        if self.state == "value_start":  # nothing of it, or an empty string's quotes
            rest = text[self.pos:].strip().lstrip(_STRING_PREFIX)
            self.calls[-1].parts.append('""' if rest in ('""', "''") else "null")
        elif self.state == "string":
            self._stream(text, len(text), final=True)
            self.calls[-1].parts.append('"')
        elif self.state == "value":
            self.calls[-1].parts.append(literal_json(text[self.value_start:]))
        self._close()
        self.over = True


def _skip(text: str, i: int) -> int:
    while i < len(text) and text[i] in _SPACE:
        i += 1
    return i


def _tool_name(written: str, names: frozenset) -> Optional[str]:
    """The tool a call names: as written, or the last part of a dotted name
    (`functions.get_weather`, `default_api.get_weather`); None for no tool of the request's."""
    if FUNCTION_NAME.fullmatch(written) and (not names or written in names):
        return written
    last = written.rsplit(".", 1)[-1]
    return last if last in names else None


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)
