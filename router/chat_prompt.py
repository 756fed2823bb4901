"""A chat request's messages into the prompt text, through the model's chat template, with the
options vLLM's chat API takes: `add_generation_prompt` (default true), `continue_final_message`
(the prompt ends inside the last message, for the model to go on with it) and
`chat_template_kwargs` (the template's own variables, such as Qwen3's `enable_thinking`).

A message's text parts are joined with newlines, as vLLM joins them for text-only templates.
"""

from __future__ import annotations

from typing import Optional

from pd_runtime.api import InvalidRequestError
from pd_runtime.chat_template import ChatTemplateError
from router.schema import ChatCompletionRequest, ChatMessage, InvalidRequest
from router.tools import template_messages

# Names the renderer sets itself: a chat_template_kwargs entry may not replace them.
_RESERVED = frozenset({"messages", "add_generation_prompt", "continue_final_message",
                       "bos_token", "eos_token", "tools", "documents"})


def _message_dict(message: ChatMessage, index: int) -> dict:
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
    return out


def chat_text(body: ChatCompletionRequest, tokenizer, tools: Optional[list] = None) -> str:
    """The rendered prompt; a 400 naming the field for anything the template or options refuse.
    `tools`: the request's tools, for the template (router/tools.py)."""
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
    dicts = template_messages([_message_dict(m, i) for i, m in enumerate(body.messages)],
                              body.messages)
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
