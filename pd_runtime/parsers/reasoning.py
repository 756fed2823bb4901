"""A reasoning model's thinking, split from its answer on chat completions: the text of a
<think>...</think> block goes to `message.reasoning` (`delta.reasoning` when streamed), the
rest to `content`, as vLLM's reasoning parsers return them (Qwen3, QwQ, DeepSeek-R1 and its
distills).

The block may open in the output (Qwen3 writes "<think>" first) or in the prompt: a template
whose generation prompt ends inside an open block (DeepSeek-R1's) leaves the output starting in
the thinking. An output that ends before "</think>" is all reasoning; one that does not start
with a block (Qwen3 with enable_thinking false: its template closes an empty block in the
prompt) is all content. Tool calls are read from the content alone
(pd_runtime/entrypoints/openai/request_parsing/tools.py).
"""

from __future__ import annotations

from typing import Optional

from pd_runtime.parsers.text import partial_tag_len

OPEN, CLOSE = "<think>", "</think>"


def opens_in_prompt(prompt: str) -> bool:
    """Whether the generation prompt opens a think block for the output to go on in: the
    prompt ends with the tag (a "<think>" left open earlier, say in a user's message that
    asks for such tags, is text, not the template's doing)."""
    return prompt.rstrip().endswith(OPEN)


def split(text: str, open_at_start: bool, final: bool = True
          ) -> tuple[Optional[str], str]:
    """(reasoning, content) of the output so far; reasoning None when it holds no thinking.
    Not `final`: what could still be the start of a tag is held back from both."""
    start = 0
    body = text.lstrip()
    if not final and len(body) < len(OPEN) and OPEN.startswith(body):
        return "", ""  # undecided yet: the tag may be coming
    if open_at_start and body.startswith(OPEN):  # the model wrote the tag again
        open_at_start = False
    if not open_at_start:
        if not body.startswith(OPEN):
            return None, text
        start = len(text) - len(body) + len(OPEN)
    end = text.find(CLOSE, start)
    if end < 0:
        reasoning = text[start:]
        if not final:
            reasoning = reasoning[:len(reasoning) - partial_tag_len(reasoning, CLOSE)]
        return reasoning, ""
    return text[start:end], text[end + len(CLOSE):]


def content_start(text: str, open_at_start: bool) -> Optional[int]:
    """Where the answer begins in the output so far (0 when it opens no block), or None while
    it is still thinking: the place `split` cuts its content from."""
    body = text.lstrip()
    start = 0
    if open_at_start and body.startswith(OPEN):
        open_at_start = False
    if not open_at_start:
        if not body.startswith(OPEN):
            return 0
        start = len(text) - len(body) + len(OPEN)
    end = text.find(CLOSE, start)
    return None if end < 0 else end + len(CLOSE)


class ThinkStream:
    """One streamed choice: the reasoning and the content each delta adds."""

    def __init__(self, open_at_start: bool):
        self.open_at_start = open_at_start
        self.reasoning_sent = 0

    def split(self, text: str) -> tuple[Optional[str], str]:
        return split(text, self.open_at_start)

    def content_start(self, text: str) -> Optional[int]:
        return content_start(text, self.open_at_start)

    def feed(self, text: str, final: bool) -> tuple[str, Optional[str]]:
        """The output so far -> (the reasoning to send now, the content so far, or None while
        the output is still thinking)."""
        reasoning, content = split(text, self.open_at_start, final)
        if reasoning is None:
            return "", content
        new = reasoning[self.reasoning_sent:]
        self.reasoning_sent = max(self.reasoning_sent, len(reasoning))
        return new, content
