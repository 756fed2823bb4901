"""A chat request's messages into the prompt text, through the model's chat template, with the
options vLLM's chat API takes: `add_generation_prompt` (default true), `continue_final_message`
(the prompt ends inside the last message, for the model to go on with it) and
`chat_template_kwargs` (the template's own variables, such as Qwen3's `enable_thinking`), and
OpenAI's `reasoning_effort` on a reasoning model.

A message's text parts are joined with newlines, as vLLM joins them for text-only templates; an
assistant message's earlier thinking goes to the template too.
"""

from __future__ import annotations

from typing import Optional

from pd_runtime.api import InvalidRequestError
from pd_runtime.chat_template import ChatTemplateError, reasoning_format
from pd_runtime.entrypoints.openai.request_parsing.schema import ChatCompletionRequest, ChatMessage, InvalidRequest
from pd_runtime.entrypoints.openai.request_parsing.tools import template_messages

# Names the renderer sets itself: a chat_template_kwargs entry may not replace them.
_RESERVED = frozenset({"messages", "add_generation_prompt", "continue_final_message",
                       "bos_token", "eos_token", "tools", "documents"})


def _message_dict(message: ChatMessage, index: int, harmony: bool = False) -> dict:
    content = message.content
    if isinstance(content, list):
        texts = []
        for part in content:
            if part.type != "text" or part.text is None:
                raise InvalidRequest(f"messages[{index}].content: only text parts are supported "
                                     f"(got type {part.type!r})", param="messages")
            texts.append(part.text)
        content = "\n".join(texts)
    out = {"role": message.role, "content": content or ""}
    if message.name is not None:
        out["name"] = message.name
    if message.role == "assistant" and message.model_extra:
        thinking = _thinking(message.model_extra, index)
        if thinking is not None:  # under both names: templates read one or the other
            out["reasoning_content"] = out["reasoning"] = thinking
            if harmony:  # (gpt-oss's template reads it as `thinking`)
                out["thinking"] = thinking
    return out


def _thinking(extra: dict, index: int) -> Optional[str]:
    """An assistant message's earlier thinking, as a client sends it back: `reasoning` (what
    this server returns) or `reasoning_content` (DeepSeek's name). Qwen3's template writes it
    back into the turns after the last user message (a tool loop), as the model wrote them."""
    given = {k: extra[k] for k in ("reasoning", "reasoning_content") if extra.get(k) is not None}
    for name, value in given.items():
        if not isinstance(value, str):
            raise InvalidRequest(f"messages[{index}].{name} must be a string",
                                 param=f"messages[{index}].{name}")
    if len(set(given.values())) > 1:
        raise InvalidRequest(f"messages[{index}]: reasoning and reasoning_content differ",
                             param=f"messages[{index}].reasoning")
    return next(iter(given.values()), None)


def chat_text(body: ChatCompletionRequest, tokenizer, tools: Optional[list] = None) -> str:
    """The rendered prompt; a 400 naming the field for anything the template or options refuse.
    `tools`: the request's tools, for the template (pd_runtime/entrypoints/openai/request_parsing/tools.py)."""
    if not body.messages:
        raise InvalidRequest("messages must not be empty", param="messages")
    variables = dict(body.chat_template_kwargs or {})
    taken = sorted(_RESERVED & variables.keys())
    if taken:
        raise InvalidRequest(f"chat_template_kwargs may not set {', '.join(taken)}",
                             param="chat_template_kwargs")
    if body.continue_final_message and body.add_generation_prompt:
        raise InvalidRequest("continue_final_message needs add_generation_prompt: false",
                             param="continue_final_message")
    fmt = getattr(tokenizer, "reasoning_format", None) or \
        reasoning_format(tokenizer.chat_template)
    _effort_variables(body.reasoning_effort, variables, tokenizer.chat_template or "",
                      thinks=bool(fmt))
    dicts = template_messages([_message_dict(m, i, fmt == "harmony")
                               for i, m in enumerate(body.messages)], body.messages)
    if tools is not None:
        variables["tools"] = tools
    try:
        return tokenizer.apply_chat_template(
            dicts, add_generation_prompt=body.add_generation_prompt,
            continue_final_message=body.continue_final_message, **variables)
    except (ChatTemplateError, InvalidRequestError) as exc:
        raise InvalidRequest(f"chat template: {exc}", param="messages") from None
    except Exception as exc:  # the template is user-influenced code: any failure is a bad request
        raise InvalidRequest(f"the chat template failed on these messages: {exc}",
                             param="messages") from None


# The reasoning efforts the OpenAI API takes, least first.
EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")


def _effort_variables(effort, variables: dict, template: str, thinks: bool) -> None:
    """`reasoning_effort` as the template's variables: given to it under that name (a template
    that reads it acts on it), and as `enable_thinking` (off for "none", on for a level) where
    the template has that switch (Qwen3, and templates whose thinking is opt-in); elsewhere a
    level changes nothing (the model thinks as it does), as under vLLM. A model that neither
    thinks (`thinks`: its output is split into thinking and answer) nor reads an effort
    refuses it (as OpenAI's non-reasoning models do), and so does one that cannot stop
    thinking for "none"."""
    if effort is None:
        return
    if effort not in EFFORTS:
        raise InvalidRequest(f"reasoning_effort must be one of {', '.join(EFFORTS)} (got "
                             f"{effort!r})", param="reasoning_effort")
    reads_effort = "reasoning_effort" in template
    if not reads_effort and not thinks:
        raise InvalidRequest("reasoning_effort is not supported with this model (its chat "
                             "template has no thinking)", param="reasoning_effort",
                             code="unsupported_parameter")
    if variables.setdefault("reasoning_effort", effort) != effort:
        raise InvalidRequest(f"reasoning_effort {effort!r} and chat_template_kwargs."
                             f"reasoning_effort {variables['reasoning_effort']!r} differ",
                             param="reasoning_effort")
    if "enable_thinking" in template:
        wanted = effort != "none"
        given = variables.setdefault("enable_thinking", wanted)
        if not isinstance(given, bool):  # templates test it `is false`: 0 would think
            raise InvalidRequest("chat_template_kwargs.enable_thinking must be true or false",
                                 param="chat_template_kwargs")
        if given is not wanted:
            raise InvalidRequest(f"reasoning_effort {effort!r} and chat_template_kwargs."
                                 f"enable_thinking {given!r} contradict each other (it "
                                 f"would be {str(wanted).lower()})", param="reasoning_effort")
    elif effort == "none" and not reads_effort:
        raise InvalidRequest("reasoning_effort 'none' is not supported with this model (its "
                             "chat template has no switch to turn its thinking off)",
                             param="reasoning_effort", code="unsupported_parameter")
