"""A Responses request's `input` as chat messages, for pd_runtime/entrypoints/openai/
responses/request.py: a string is one user message; message, function_call,
function_call_output and reasoning items become the chat turns a template renders, a model's
calls joined to the assistant message before them, a reasoning item's thinking carried by the
assistant turn after it.
"""

from __future__ import annotations

from typing import Any, Optional

from pd_runtime.entrypoints.openai.request_parsing.schema import InvalidRequest

_TEXT_PARTS = ("input_text", "output_text", "text")


def input_messages(items: Any) -> list[dict]:
    """`input` (a string, or a list of message, function_call and function_call_output items)
    as chat messages; a model's calls join the assistant message before them."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise InvalidRequest("input must be a string or a non-empty list of items",
                             param="input")
    messages: list[dict] = []
    thinking = None  # a reasoning item's text, for the assistant turn it comes before
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise InvalidRequest(f"input[{i}] must be an object", param=f"input[{i}]")
        kind = item.get("type", "message")
        if kind == "message":
            messages.append(_message(item, i))
            if messages[-1]["role"] == "assistant" and thinking is not None:
                messages[-1]["reasoning"] = thinking
            thinking = None
        elif kind == "function_call":
            call = _history_call(item, i)
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and thinking is None:
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
                if thinking is not None:
                    messages[-1]["reasoning"] = thinking
            thinking = None
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": _string(item, "call_id", i),
                             "content": _text(item.get("output"), f"input[{i}].output")})
            thinking = None
        elif kind == "reasoning":
            thinking = _reasoning_text(item, i)
        else:
            raise InvalidRequest(f"input[{i}]: items of type {kind!r} are not supported by "
                                 f"this server (message, function_call, function_call_output, "
                                 f"reasoning)", param=f"input[{i}].type",
                                 code="unsupported_parameter")
    return messages


def _reasoning_text(item: dict, i: int) -> Optional[str]:
    """A reasoning item's thinking (its `reasoning_text` parts; a summary is not the thinking),
    which the next assistant turn carries to the template as chat's `reasoning` does."""
    parts = item.get("content")
    if parts is None:
        return None
    if not isinstance(parts, list) or not all(
            isinstance(p, dict) and p.get("type") == "reasoning_text"
            and isinstance(p.get("text"), str) for p in parts):
        raise InvalidRequest(f"input[{i}].content must be a list of reasoning_text parts",
                             param=f"input[{i}].content")
    return "\n".join(p["text"] for p in parts) if parts else None


def _message(item: dict, i: int) -> dict:
    role = item.get("role")
    if role not in ("user", "system", "developer", "assistant"):
        raise InvalidRequest(f"input[{i}].role must be user, system, developer or assistant",
                             param=f"input[{i}].role")
    return {"role": role, "content": _text(item.get("content"), f"input[{i}].content")}


def _text(content: Any, where: str) -> str:
    """A string, or a list of text parts joined with newlines (as chat joins them)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequest(f"{where} must be a string or a list of text parts", param=where)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            raise InvalidRequest(f"{where}[{j}]: only text parts are supported (input_text, "
                                 f"output_text; got {kind!r})", param=f"{where}[{j}].type",
                                 code="unsupported_parameter")
        texts.append(part["text"])
    return "\n".join(texts)


def _history_call(item: dict, i: int) -> dict:
    arguments = item.get("arguments", "")
    if not isinstance(arguments, str):
        raise InvalidRequest(f"input[{i}].arguments must be a string (JSON)",
                             param=f"input[{i}].arguments")
    return {"id": _string(item, "call_id", i), "type": "function",
            "function": {"name": _string(item, "name", i), "arguments": arguments}}


def _string(item: dict, key: str, i: int) -> str:
    value = item.get(key)
    if not isinstance(value, str) or not value:
        raise InvalidRequest(f"input[{i}].{key} must be a non-empty string",
                             param=f"input[{i}].{key}")
    return value
