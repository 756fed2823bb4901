"""What every output parser shares about text: how much of a stream's tail could be the start of
a tag (held back until the next characters say), and JSON read strictly (no NaN or Infinity).
"""

from __future__ import annotations


def refuse_json_constant(name: str):
    """json's parse_constant: NaN and Infinity are Python's extension, not JSON values."""
    raise ValueError(f"{name} is not a JSON value")


def partial_tag_len(text: str, tag: str) -> int:
    """How many characters at the end of `text` could be the start of `tag`: what a stream
    holds back until the next characters say whether the tag comes."""
    return next((k for k in range(min(len(tag) - 1, len(text)), 0, -1)
                 if tag.startswith(text[-k:])), 0)
