"""A model's chat template rendered as `transformers` renders it, so a checkpoint's template
gives the prompt its authors tested: the same Jinja environment and helpers, and the same ways to
end the prompt (a generation prompt, or the final message left open to be continued).

What transformers' environment adds to a sandboxed Jinja one, and so this one too: `{% break %}`
and `{% continue %}`, a `tojson` that keeps non-ASCII and HTML characters as they are and takes
indent/separators/sort_keys, `raise_exception(message)`, `strftime_now(format)`, and the
`{% generation %}` block (training-time bookkeeping there; here it renders its body).
"""

from __future__ import annotations

import json
import re
from datetime import datetime
from typing import Any, Optional

# Appended to the final message when it is to be continued, then cut off with everything after.
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


class ChatTemplateError(ValueError):
    """The template (or a request's options for it) cannot render these messages."""


class ChatTemplate:
    """Compiled once from the template's source; `render` may be called from several threads."""

    def __init__(self, source: str):
        from jinja2 import nodes
        from jinja2.ext import Extension, loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        class GenerationBlock(Extension):
            tags = {"generation"}

            def parse(self, parser):
                lineno = next(parser.stream).lineno
                body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
                return nodes.CallBlock(self.call_method("_body"), [], [], body
                                       ).set_lineno(lineno)

            def _body(self, caller):
                return caller()

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[GenerationBlock, loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = _strftime_now
        self.source = source
        self._template = env.from_string(source)

    def render(self, messages: list[dict], /, add_generation_prompt: bool = True, *,
               continue_final_message: bool = False, variables: Optional[dict] = None) -> str:
        """The prompt text. With `continue_final_message`, the text ends where the final
        message's content ends (no end-of-turn token after it), for the model to go on.
        `variables`: the template's other names (special tokens, its own options)."""
        if continue_final_message:
            if add_generation_prompt:
                raise ChatTemplateError("continue_final_message and add_generation_prompt "
                                        "cannot both be true")
            if not messages or not isinstance(messages[-1].get("content"), str):
                raise ChatTemplateError("continue_final_message needs a final message with "
                                        "text content")
            final = messages[-1]["content"]
            messages = [*messages[:-1], {**messages[-1], "content": final + _CONTINUE_TAG}]
        text = self._template.render({**(variables or {}), "messages": messages,
                                      "add_generation_prompt": add_generation_prompt})
        if not continue_final_message:
            return text
        tag = _CONTINUE_TAG.strip()
        if final.strip() not in text or tag not in text:
            raise ChatTemplateError("continue_final_message: the chat template does not keep "
                                    "the final message's text as it is, so it cannot be continued")
        at = text.rindex(tag)
        if text.startswith(_CONTINUE_TAG, at):
            return text[:at]
        return text[:at].rstrip()  # the template trimmed the content: so is its end here


# The instruction pythonic templates give their model (in their own words around it).
_PYTHONIC_PROMPT = re.compile(r"\[func_name1\(params?_name1=params?_value1")


def tool_call_format(template: Optional[str]) -> Optional[str]:
    """The tool-call format a chat template teaches its model
    (pd_runtime/entrypoints/openai/request_parsing/tools.py reads calls in it): "qwen3_coder"
    (<function=NAME><parameter=KEY> calls in <tool_call> blocks: Qwen3-Coder and the later Qwen
    models), "hermes" (JSON in <tool_call> blocks: Qwen2.5, Qwen3, Hermes), "mistral" ([TOOL_CALLS],
    in either form), "llama3_json" (Llama 3.1-3.3's JSON calls, and Llama 4's), "deepseek_v3"
    (<｜tool▁calls▁begin｜>: DeepSeek-V3, R1 and its distills), "pythonic" (the
    [func_name1(params_name1=params_value1, ...)] prompt: Llama 3.2 and Llama 4's pythonic
    templates, ToolACE), "granite" (<|tool_call|> and a JSON list: Granite 3.x), "harmony"
    (gpt-oss's messages to=functions.NAME), or None: also for another format that looks like one of
    these (a <function= call without <parameter= tags), so that tool_choice auto is a clear 400
    rather than calls returned as text."""
    if not template:
        return None
    if "<|channel|>" in template:
        return "harmony"
    if "<function=" in template:
        return "qwen3_coder" if "<parameter=" in template and "<tool_call>" in template \
            else None
    if "<｜tool▁calls▁begin｜>" in template:
        return "deepseek_v3"
    if _PYTHONIC_PROMPT.search(template):
        return "pythonic"
    if "<|tool_call|>" in template:
        return "granite"
    if "<tool_call>" in template:
        return "hermes"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|python_tag|>" in template or ('"parameters"' in template and "ipython" in template):
        return "llama3_json"
    return None


def reasoning_format(template: Optional[str]) -> Optional[str]:
    """"think" when a chat template knows <think>...</think> blocks (Qwen3, QwQ, DeepSeek-R1
    and its distills): its model's thinking is split from its answer
    (pd_runtime/parsers/reasoning.py); "harmony" when it writes harmony's channels (gpt-oss:
    pd_runtime/parsers/harmony.py)."""
    if template and "<|channel|>" in template:
        return "harmony"
    return "think" if template and ("</think>" in template or "<think>" in template) else None


def _tojson(value: Any, ensure_ascii: bool = False, indent=None, separators=None,
            sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _raise(message: str):
    raise ChatTemplateError(str(message))


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)
