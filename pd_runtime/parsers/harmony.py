"""gpt-oss's output (OpenAI's harmony format) split into thinking and answer on chat
completions and Responses: the analysis channel (and commentary the model addresses to no tool,
its preambles; messages joined by a newline) goes to `message.reasoning`, the final channel to
`content`. A message addressed to a function (`to=functions.NAME`) is a tool call, which the
tool-call reader for this format takes from the same parse (tool_calls_harmony.py); a message
to another recipient (a built-in tool) is in neither.

The generation prompt ends with `<|start|>assistant`; the output is then messages of the form
`<|channel|>NAME[ to=RECIPIENT][ <|constrain|>FORMAT]<|message|>BODY<|end|>`, each after the
first opened by `<|start|>assistant` again (the recipient may come before the channel, the
first message's too: ` to=functions.NAME<|channel|>commentary json<|message|>...`); the last
one ends with a stop token (`<|return|>`, `<|call|>`), whose text is left out. The markers are
special tokens, which such a request keeps in its text (skip_special_tokens false,
pd_runtime/entrypoints/openai/request_parsing/protocol.py). An output that does not start with a header is all
answer, as without this format.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

from pd_runtime.parsers.text import partial_tag_len

START, END, MESSAGE, CHANNEL = "<|start|>", "<|end|>", "<|message|>", "<|channel|>"
_CHANNEL = re.compile(r"<\|channel\|>\s*([^\s<]+)")
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")
_LEADING_RECIPIENT = re.compile(r"\s*to=")  # a first header's recipient, before its channel
SEPARATOR = "\n"  # between two messages of the thinking (or of the answer)


@dataclass
class Message:
    channel: str
    recipient: Optional[str]
    body: str
    start: int  # where the body begins in the output text
    head: int  # where its header begins

    @property
    def function(self) -> Optional[str]:
        """The function it calls (to=functions.NAME), or None."""
        prefix = "functions."
        return self.recipient[len(prefix):] if self.recipient and \
            self.recipient.startswith(prefix) else None


def parse(text: str, final: bool = True) -> Optional[list[Message]]:
    """The messages of the output so far (the last one's body may still grow), or None when
    the output is not in the format. Not `final`: what could still be the start of a marker
    is held back (the markers are whole tokens, so this is for text fed in pieces)."""
    if not final and len(text) < len(CHANNEL) and (
            CHANNEL.startswith(text) or START.startswith(text) or "to=".startswith(text.lstrip())):
        return []  # undecided yet
    if not text.startswith((CHANNEL, START)) and not _LEADING_RECIPIENT.match(text):
        return None
    messages, pos = [], 0
    while pos < len(text):
        head_end = text.find(MESSAGE, pos)
        if head_end < 0:
            break  # a header not yet complete
        header = text[pos:head_end]
        channel, recipient = _CHANNEL.search(header), _RECIPIENT.search(header)
        start = head_end + len(MESSAGE)
        end = text.find(END, start)
        body = text[start:end] if end >= 0 else text[start:]
        if end < 0 and not final:
            body = body[:len(body) - partial_tag_len(body, END)]
        messages.append(Message(channel.group(1) if channel else "", recipient and
                                recipient.group(1), body, start, pos))
        if end < 0:
            break
        pos = end + len(END)
    return messages


def is_thinking(message: Message) -> bool:
    return message.channel != "final" and message.recipient is None


def is_answer(message: Message) -> bool:
    return message.channel == "final" and message.recipient is None


def split(text: str, final: bool = True) -> tuple[Optional[str], str]:
    """(reasoning, content) of the output so far; reasoning None when it is not in the format
    (then all of it is content)."""
    messages = parse(text, final)
    if messages is None:
        return None, text
    return (SEPARATOR.join(m.body for m in messages if is_thinking(m)),
            SEPARATOR.join(m.body for m in messages if is_answer(m)))


def content_start(text: str) -> Optional[int]:
    """Where the answer begins in the output so far (0 when it is not in the format), or None
    while the model has not begun it."""
    messages = parse(text)
    if messages is None:
        return 0
    return next((m.start for m in messages if is_answer(m)), None)



class HarmonyStream:
    """One choice's thinking and answer, as pd_runtime/entrypoints/openai/completion_bodies.py asks
    them of a reasoning format."""

    def __init__(self):
        self.reasoning_sent = 0

    def split(self, text: str) -> tuple[Optional[str], str]:
        return split(text)

    def content_start(self, text: str) -> Optional[int]:
        return content_start(text)

    def feed(self, text: str, final: bool) -> tuple[str, Optional[str]]:
        """The output so far -> (the reasoning to send now, the content so far)."""
        reasoning, content = split(text, final)
        if reasoning is None:
            return "", content
        new = reasoning[self.reasoning_sent:]
        self.reasoning_sent = max(self.reasoning_sent, len(reasoning))
        return new, content
