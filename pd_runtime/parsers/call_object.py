"""One tool call's JSON object read a character at a time, as a model writes it (the readers
of pd_runtime/parsers/tool_calls.py feed it): its name once read, and where its arguments lie in the
text, so they can be sent as they are written and known whole once the object closes.
"""

from __future__ import annotations

import json
from typing import Optional

from pd_runtime.parsers.tool_calls_base import SPACE

_ARGUMENTS = ("arguments", "parameters")


class CallObject:
    """One call's JSON object, read a character at a time: its name once read, and where its
    arguments lie (`args`: their first index; `args_end` once whole)."""

    def __init__(self, name: Optional[str] = None):
        """`name`: a call whose name was written before its arguments (Mistral's
        name[ARGS]{...}, DeepSeek's): its arguments value alone is read, and the call is whole
        once it is."""
        self.bare = name is not None
        self.state = "value" if self.bare else "key"
        self.key: Optional[str] = "arguments" if self.bare else None
        self.start = 0  # the current key's or value's first index
        self.kind = ""  # the value being read: "{", "[", '"' or a primitive's first character
        self.depth = 0
        self.in_string = self.escape = False
        self.name: Optional[str] = name
        self.args: Optional[int] = None
        self.args_end: Optional[int] = None
        self.args_kind = ""
        self.done = self.broken = False

    def push(self, text: str, i: int) -> bool:
        """Read text[i]; False when it is not the value's (a primitive ended before it)."""
        ch, state = text[i], self.state
        if state == "key":
            if ch == '"':
                self.state, self.start, self.in_string = "key_string", i, True
            elif ch == "}":
                self.done = True
            elif ch not in SPACE:
                self.broken = True
        elif state == "key_string":
            if self._string_ends(ch):
                try:
                    self.key = json.loads(text[self.start:i + 1])
                except ValueError:  # a bad escape
                    self.broken = True
                self.state = "colon"
        elif state == "colon":
            if ch == ":":
                self.state = "value"
            elif ch not in SPACE:
                self.broken = True
        elif state == "value":
            if ch not in SPACE:
                self.state, self.start, self.kind = "in_value", i, ch
                self.depth = 1 if ch in "{[" else 0
                self.in_string = ch == '"'
                if self.key in _ARGUMENTS and self.args is None:
                    self.args, self.args_kind = i, ch
        elif state == "in_value":
            return self._in_value(text, i)
        elif ch == ",":  # "after": a value was read
            self.state = "key"
        elif ch == "}":
            self.done = True
        elif ch not in SPACE:
            self.broken = True
        return True

    def _string_ends(self, ch: str) -> bool:
        if self.escape:
            self.escape = False
        elif ch == "\\":
            self.escape = True
        elif ch == '"':
            self.in_string = False
            return True
        return False

    def _in_value(self, text: str, i: int) -> bool:
        ch = text[i]
        if self.in_string:
            if not self._string_ends(ch) or self.kind != '"':
                return True
        elif self.kind in "{[":
            if ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
            if self.depth:
                return True
        elif ch not in SPACE + ",}]":  # a primitive goes on
            return True
        else:  # the primitive ended before this character
            self._value_read(text, i)
            return False
        self._value_read(text, i + 1)
        return True

    def _value_read(self, text: str, end: int) -> None:
        self.state = "after"
        if self.key == "name" and self.name is None:
            try:
                name = json.loads(text[self.start:end])
            except ValueError:
                name = None
            if not isinstance(name, str) or not name:
                self.broken = True
                return
            self.name = name
        elif self.args == self.start:
            self.args_end = end
            self.done = self.bare
