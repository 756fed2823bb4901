"""What every tool-call reader shares (pd_runtime/parsers/tool_calls.py's and the XML, pythonic and
harmony readers beside it, which it chooses between): a tool's name, a new call's id, and the
half of the reader interface that is the same in every format.
"""

from __future__ import annotations

import re
import uuid
from typing import Optional

SPACE = " \t\r\n"  # JSON's whitespace: what the formats allow between their parts
FUNCTION_NAME = re.compile(r"[A-Za-z0-9_.:-]{1,64}")  # what a tool may be called


def call_id(short: bool = False) -> str:
    """A new call's id. `short`: 9 letters and digits, the only ids Mistral's templates take
    back (theirs raise on any other)."""
    return uuid.uuid4().hex[:9] if short else f"chatcmpl-tool-{uuid.uuid4().hex[:24]}"


# A reader class takes these two as its methods (`whole = tool_calls_base.whole`): `whole` reads
# through its `feed` and `calls`, `show` moves its `shown` (the characters sent as content).
def whole(reader, text: str) -> tuple[Optional[str], list[dict]]:
    """A finished output read at once: (content, calls), as a whole response gives them;
    the whole text as content when it holds no call."""
    content, deltas = reader.feed(text, True)
    if not reader.calls:
        return text, []
    calls = {}
    for delta in deltas:
        if "id" in delta:
            calls[delta["index"]] = {k: delta[k] for k in ("id", "type", "function")}
    return content or None, [calls[i] for i in range(len(calls))]


def show(reader, text: str, upto: int) -> str:
    """The content not yet sent, up to `upto`."""
    out = text[reader.shown:upto] if upto > reader.shown else ""
    reader.shown = max(reader.shown, upto)
    return out
