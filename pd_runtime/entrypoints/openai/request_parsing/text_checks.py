"""Cheap checks on request text before it reaches the tokenizer: strings that are not Unicode
text, and a lower bound on a text's token count from its length alone.
"""

from __future__ import annotations

import json
import re
import weakref
from typing import Any, Optional

_SURROGATE = re.compile("[\ud800-\udfff]")
# A \uXXXX escape of a UTF-16 surrogate in JSON text (unless its backslash is itself escaped).
_SURROGATE_ESCAPE = re.compile(rb"\\u([dD][89a-fA-F][0-9a-fA-F]{2})")

# Normalizers may fold several code points into one before tokenizing (NFC composes a Greek
# letter with up to three marks into one character): a token covers at most this many times
# the characters of its own text.
NORMALIZER_FOLD = 4

_MAX_TOKEN_CHARS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def lone_surrogate_field(raw: bytes, data: dict) -> Optional[str]:
    """The first top-level field of `data` (parsed from `raw`) holding a lone UTF-16 surrogate,
    or None. JSON's "\\ud800" escape yields one: no character, and nothing downstream (the
    tokenizer, UTF-8, msgpack) can encode it. A scan of the raw text clears almost every body
    at C speed; walking the parsed values (a Python loop per value) is left for the rest."""
    if json.detect_encoding(raw) == "utf-8" and not _has_lone_escape(raw):
        return None
    for key, value in data.items():
        if _holds_surrogate(key, value):
            return key
    return None


def _has_lone_escape(raw: bytes) -> bool:
    expect_low_at = -1
    for match in _SURROGATE_ESCAPE.finditer(raw):
        start = before = match.start()
        while before > 0 and raw[before - 1] == 0x5C:
            before -= 1
        if (start - before) % 2:
            continue  # "\\ud800": an escaped backslash, then plain text
        code = int(match.group(1), 16)
        if code >= 0xDC00 and start == expect_low_at:
            expect_low_at = -1  # the low half of a pair
            continue
        if expect_low_at >= 0 or code >= 0xDC00:
            return True  # a high half with no low after it, or a low half alone
        expect_low_at = match.end()
    return expect_low_at >= 0


def _holds_surrogate(key: str, value: Any) -> bool:
    stack = [key, value]
    while stack:  # a loop, not recursion: the body may nest as deep as the JSON parser allows
        item = stack.pop()
        if isinstance(item, str):
            if not item.isascii() and _SURROGATE.search(item):
                return True
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return False


def max_token_chars(tokenizer) -> int:
    """The most characters one token's text has (vocabulary scan, once per tokenizer)."""
    cached = _MAX_TOKEN_CHARS.get(tokenizer)
    if cached is None:
        cached = max((len(tokenizer.decode([token], skip_special_tokens=False))
                      for token in range(tokenizer.vocab_size)), default=1)
        _MAX_TOKEN_CHARS[tokenizer] = cached
    return cached


def min_tokens(text: str, tokenizer, limit: int) -> int:
    """A lower bound on the number of tokens of `text`, exact enough to refuse a text of
    megabytes without tokenizing it; 0 when the text is too short for the bound to reach
    `limit` (then the vocabulary is not even scanned).

    It assumes every character ends up in some token, as with byte-level BPE or byte fallback
    (the Llama, Qwen and Mistral tokenizers); the +1 is a decoder dropping a leading space."""
    if len(text) < limit * NORMALIZER_FOLD * 2:  # a token covers at least one character
        return 0
    return len(text) // (NORMALIZER_FOLD * (max_token_chars(tokenizer) + 1))
