"""Python's literals as models write them in tool calls (pd_runtime/parsers/tool_calls_pythonic.py),
read as JSON: a string scanned and decoded as it is written, escape by escape, and any other value
read once whole through Python's own parser, never evaluated.
"""

from __future__ import annotations

import ast
import json
import re
import unicodedata
from typing import Any, Optional

_STOPS = {"'": re.compile(r"[\\']"), '"': re.compile(r'[\\"]')}  # what ends a string's run
_HEX = {"x": 2, "u": 4, "U": 8}
# A \uXXXX pair's second half (which JSON, and a model borrowing its escapes, joins to the
# first), whole and as far as it may be written.
_LOW_SURROGATE = re.compile(r"\\u[dD][c-fC-F][0-9a-fA-F]{2}")
_LOW_SURROGATE_SO_FAR = re.compile(r"(\\(u([dD]([c-fC-F][0-9a-fA-F]?)?)?)?)?")
_SIMPLE_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\", "'": "'", '"': '"', "a": "\a",
                   "b": "\b", "f": "\f", "v": "\v", "\n": ""}
_OCTAL = "01234567"
_NAMED_ESCAPE = re.compile(r"\{[A-Za-z0-9 -]{1,100}\}")  # (Unicode's longest name: 88)
_NAMED_SO_FAR = re.compile(r"\{[A-Za-z0-9 -]{0,100}")
_JSON_NAMES = {"true": True, "false": False, "null": None}
_SURROGATE = re.compile("[\ud800-\udfff]")


def string_scan(text: str, i: int, quote: str) -> tuple[int, Optional[int]]:
    """From `i` inside a string (at a character's or escape's start): (safe, end), `safe`
    the end of the whole characters and escapes written so far, `end` where the closing
    quote stands (None: not written yet)."""
    stops = _STOPS[quote[0]]
    while True:
        found = stops.search(text, i)
        if found is None:
            return len(text), None
        at = found.start()
        if text[at] == "\\":
            size = _escape_len(text, at, False)
            if size is None:
                return at, None
            i = at + size
            continue
        if len(quote) == 1 or text.startswith(quote, at):
            return at, at
        if len(text) - at < 3 and text[at:] == quote[0] * (len(text) - at):
            return at, None  # the closing triple quote's start, maybe
        i = at + 1


def _escape_len(text: str, at: int, final: bool) -> Optional[int]:
    """The length of the backslash escape at `at` (None: the text ends before it is known;
    `final`: no more is coming, so it is the characters there are)."""
    if at + 1 >= len(text):
        return 1 if final else None
    kind = text[at + 1]
    if kind in _HEX:
        digits = text[at + 2:at + 2 + _HEX[kind]]
        whole = len(digits) == _HEX[kind]
        if not _is_hex(digits):
            return 2
        if not whole:
            return len(text) - at if final else None
        if kind == "u" and 0xD800 <= int(digits, 16) < 0xDC00:  # a pair's first half?
            low = text[at + 6:at + 12]
            if _LOW_SURROGATE.fullmatch(low):
                return 12
            if not final and len(low) < 6 and _LOW_SURROGATE_SO_FAR.fullmatch(low):
                return None
        return 2 + len(digits)
    if kind in _OCTAL:
        end = at + 2
        while end < len(text) and end < at + 4 and text[end] in _OCTAL:
            end += 1
        return None if end == len(text) and end < at + 4 and not final else end - at
    if kind == "N":  # \N{NAME}: anything else after \N is no named escape
        if at + 2 == len(text):
            return 2 if final else None
        name = _NAMED_ESCAPE.match(text, at + 2)
        if name is not None:
            return name.end() - at
        so_far = _NAMED_SO_FAR.match(text, at + 2)
        return None if so_far and so_far.end() == len(text) and not final else 2
    return 2


def _is_hex(digits: str) -> bool:
    return all(c in "0123456789abcdefABCDEF" for c in digits)


def decode_string(text: str, start: int, stop: int, final: bool) -> str:
    """A string's characters from start to stop (whole escapes), Python's escapes decoded
    (one it does not know stays as written, as Python keeps it)."""
    out, i = [], start
    while True:
        at = text.find("\\", i, stop)
        if at < 0:
            out.append(text[i:stop])
            return "".join(out)
        out.append(text[i:at])
        size = min(_escape_len(text, at, final) or stop - at, stop - at)
        out.append(_escaped(text[at:at + size]))
        i = at + size


def _escaped(escape: str) -> str:
    kind, body = escape[1:2], escape[2:]
    try:
        if kind == "u" and len(body) == 10:  # a surrogate pair: one character
            high, low = int(body[:4], 16), int(body[6:], 16)
            return chr(0x10000 + ((high - 0xD800) << 10) + (low - 0xDC00))
        if kind in _HEX and len(body) == _HEX[kind]:
            return chr(int(body, 16))
        if kind in _OCTAL:
            return chr(int(escape[1:], 8))
        if kind == "N" and len(body) > 2:
            return unicodedata.lookup(body[1:-1])
    except (ValueError, KeyError):
        return escape
    return _SIMPLE_ESCAPES.get(kind, escape)


def literal_json(written: str) -> str:
    """A value read whole, as JSON: the Python literal it is, else its text as a string."""
    text = written.strip()
    try:
        return json.dumps(_literal(ast.parse(text, mode="eval").body), ensure_ascii=False,
                          allow_nan=False)
    except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError):
        return _json(text)


def _literal(node: ast.AST) -> Any:
    if isinstance(node, ast.Constant):
        if isinstance(node.value, str) and _SURROGATE.search(node.value):
            return _paired(node.value)
        if node.value is None or isinstance(node.value, (str, int, float)):
            return node.value  # (bool is an int)
    elif isinstance(node, (ast.List, ast.Tuple, ast.Set)):
        return [_literal(item) for item in node.elts]
    elif isinstance(node, ast.Dict):
        if all(key is not None for key in node.keys):
            return {_literal(key): _literal(value) for key, value in zip(node.keys, node.values)}
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _literal(node.operand)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return -value if isinstance(node.op, ast.USub) else value
    elif isinstance(node, ast.Name) and node.id in _JSON_NAMES:
        return _JSON_NAMES[node.id]
    raise ValueError("not a literal")


def _paired(text: str) -> str:
    """Surrogate pairs written as two escapes joined into their character, as JSON reads them
    (Python keeps two halves, which no UTF-8 can carry); a lone half stays."""
    return text.encode("utf-16", "surrogatepass").decode("utf-16", "surrogatepass")


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)
