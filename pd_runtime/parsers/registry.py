"""Every output parser by the name config and chat templates give it, and the functions that pick
one for a request: the tool-call readers (router.tool_call_parser, Tokenizer.tool_call_format)
and the reasoning splitters (router.reasoning_parser, Tokenizer.reasoning_format).

The serving code picks a parser here and nowhere else; a new format is one reader module and
one line in a table below.
"""

from __future__ import annotations

from typing import Optional, Union

from pd_runtime.parsers.harmony import HarmonyStream
from pd_runtime.parsers.reasoning import ThinkStream
from pd_runtime.parsers.tool_calls import CallReader
from pd_runtime.parsers.tool_calls_harmony import HarmonyCallReader
from pd_runtime.parsers.tool_calls_pythonic import PythonicCallReader
from pd_runtime.parsers.tool_calls_xml import XmlCallReader

HARMONY = "harmony"  # gpt-oss's format: its tool calls and its thinking alike

# router.tool_call_parser's names -> the reader of a tool_choice "auto" output in that format
# (tool_choice "required" always reads the JSON array its grammar holds the output to:
# CallReader's "required" form).
TOOL_CALL_READERS = {
    "hermes": CallReader,
    "mistral": CallReader,
    "llama3_json": CallReader,
    "deepseek_v3": CallReader,
    "qwen3_coder": XmlCallReader,
    "pythonic": PythonicCallReader,
    "granite": CallReader,
    HARMONY: HarmonyCallReader,
}
TOOL_CALL_PARSERS = tuple(TOOL_CALL_READERS)

# router.reasoning_parser's names -> the splitter of one choice's thinking from its answer.
REASONING_PARSERS = {"think": ThinkStream, HARMONY: HarmonyStream}


def reader(plan):
    """The reader of a plan's calls (pd_runtime/entrypoints/openai/request_parsing/tools.py ToolPlan: its
    `mode` and, under "auto", its `parser`), fed the output as it grows."""
    if plan.mode == "auto":
        return TOOL_CALL_READERS[plan.parser](plan)
    return CallReader(plan)


def read_calls(plan, text: str) -> tuple[Optional[str], list[dict]]:
    """(content, calls) of a finished output; no calls (and the whole text as content) when it
    holds none."""
    return reader(plan).whole(text)


def reasoning_splitter(split: Union[bool, str]) -> Union[ThinkStream, HarmonyStream]:
    """The splitter of one choice's output for a request's PreparedRequest.reasoning: "harmony"
    (gpt-oss's channels), else whether the prompt left a <think> block open."""
    if split == HARMONY:
        return REASONING_PARSERS[HARMONY]()
    return REASONING_PARSERS["think"](split)
