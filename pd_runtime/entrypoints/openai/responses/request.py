"""OpenAI's Responses API (`POST /v1/responses`) as a chat request: its input items
(pd_runtime/entrypoints/openai/responses/input_items.py), instructions, function tools, text format and
sampling fields become a chat completions body, which the chat path validates, renders and runs;
pd_runtime/entrypoints/openai/responses/events.py turns the chat output back into a response
object and its stream events.

A field this server cannot honour is refused naming it (hosted tools, images and files), as
on the chat path; unknown fields are ignored. A chat
error's `param` is given back under the Responses name (`max_tokens` -> `max_output_tokens`).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Optional

from pd_runtime.entrypoints.openai.request_parsing.chat_prompt import EFFORTS
from pd_runtime.entrypoints.openai.request_parsing.protocol import prepare_chat
from pd_runtime.entrypoints.openai.responses.input_items import input_messages
from pd_runtime.entrypoints.openai.request_parsing.schema import InvalidRequest, PreparedRequest
from pd_runtime.router.backend import BackendError

# Responses fields copied to the chat body as they are (OpenAI's, then vLLM's extensions that
# its Responses endpoint takes too).
_SAME_FIELDS = ("model", "temperature", "top_p", "top_logprobs", "parallel_tool_calls", "user",
                "service_tier", "stream", "seed", "top_k", "min_p", "repetition_penalty",
                "presence_penalty", "frequency_penalty", "stop", "stop_token_ids", "ignore_eos",
                "min_tokens", "priority", "logit_bias", "skip_special_tokens",
                "chat_template_kwargs", "structured_outputs", "guided_json", "guided_regex",
                "guided_choice", "guided_grammar", "guided_whitespace_pattern",
                "allowed_token_ids", "bad_words", "cache_salt")
# Fields whose only accepted values are these (anything else would be ignored if taken).
_OFF_VALUES: dict[str, tuple] = {
    "conversation": (None,),
    "prompt": (None,),
    "truncation": (None, "disabled", "auto"),
    "max_tool_calls": (None,),
    "context_management": (None,),
}
_FUNCTION_KEYS = ("name", "description", "parameters", "strict")
MAX_METADATA_KEYS = 16  # OpenAI's limits
_INCLUDE_LOGPROBS = "message.output_text.logprobs"
# Asked by clients that keep no state on the server (store false) so they can send a reasoning
# item back: here a reasoning item carries its text in the clear (`content`), and templates
# drop past thinking, so there is nothing to encrypt; accepted, with no effect.
_INCLUDE_REASONING = "reasoning.encrypted_content"
# A chat error's words for the Responses ones.
_RENAMES = (("max_tokens", "max_output_tokens"), ("response_format", "text.format"),
            ("messages", "input"), ("reasoning_effort", "reasoning.effort"))
# A chat error's param -> the Responses field it came from.
_PARAMS = {"max_tokens": "max_output_tokens", "messages": "input",
           "response_format": "text.format", "logprobs": "include",
           "reasoning_effort": "reasoning.effort"}
_SUMMARIES = ("auto", "concise", "detailed")


@dataclass
class ResponsesRequest:
    """What the response echoes back and how it is built: the request's own fields, as OpenAI's
    response object repeats them."""

    echo: dict = field(default_factory=dict)
    logprobs: bool = False
    store: bool = True  # kept for GET /v1/responses/{id} and a later previous_response_id
    messages: list = field(default_factory=list)  # the conversation so far, without instructions
    background: bool = False  # run apart from its request: polled, streamed again, cancelled


class NeedsHistory(Exception):
    """The request continues a stored response (previous_response_id): its conversation is
    wanted first (pd_runtime/entrypoints/openai/generation.py reads it from the run store and
    prepares again)."""

    def __init__(self, response_id: str):
        super().__init__(response_id)
        self.response_id = response_id


def prepare_responses(data: dict, tokenizer, model_name: str, max_model_len: int,
                      defaults: Optional[dict] = None,
                      history: Optional[bytes] = None) -> PreparedRequest:
    """Responses request `data` as the chat request it runs as, with what its response needs
    (`prepared.responses`). `history`: the JSON of `previous_response_id`'s conversation;
    NeedsHistory when the request names one and it is not given."""
    previous = data.get("previous_response_id")
    if previous is not None:
        if not isinstance(previous, str) or not previous:
            raise InvalidRequest("previous_response_id must be a response's id",
                                 param="previous_response_id")
        if history is None:
            chat_body(data)  # the request's own fields judged first: a bad one is its 400
            raise NeedsHistory(previous)
    chat, request = chat_body(data, json.loads(history) if previous is not None else None)
    try:
        try:
            prepared = prepare_chat(chat, tokenizer, model_name, max_model_len, defaults)
        except InvalidRequest as exc:
            if data.get("truncation") != "auto" or exc.code != "context_length_exceeded":
                raise
            prepared, kept = _truncated(chat, exc, tokenizer, model_name, max_model_len,
                                        defaults)
            skip = len(chat["messages"]) - len(request.messages)  # the instructions
            # What is stored: the messages it was given.
            request.messages = [request.messages[i - skip] for i in kept if i >= skip]
    except BackendError as exc:  # named as the client named it
        exc.param = responses_param(exc.param)
        exc.message = re.sub(r"tools\[(\d+)\]\.function\.", r"tools[\1].", exc.message)
        for old, new in _RENAMES:
            exc.message = re.sub(rf"(?<![.\w]){old}\b", new, exc.message)
        raise
    prepared.responses = request
    return prepared


def _truncated(chat: dict, too_long: InvalidRequest, tokenizer, model_name: str,
               max_model_len: int, defaults: Optional[dict]
               ) -> tuple[PreparedRequest, list[int]]:
    """`truncation: "auto"`: the conversation without its oldest messages, as few dropped as
    make it fit: whole turns first (a turn begins at a user message, so a call and its output
    go together; the instructions and system messages before the first turn stay), then,
    when its last turn alone is too long (an agent's one request and its many calls), that
    turn's oldest steps (an assistant message and the tool outputs after it), its user message
    kept. (prepared, the indices of the messages kept); `too_long` when nothing fits."""
    messages = chat["messages"]
    n = len(messages)
    system = 0
    while system < n and messages[system]["role"] == "system":
        system += 1
    users = [i for i in range(system, n) if messages[i]["role"] == "user"]
    head = list(range(system))
    # Each candidate drops more than the one before it.
    candidates = [head + list(range(start, n)) for start in users if start > system]
    if users:
        last = users[-1]
        candidates += [head + [last] + list(range(step, n)) for step in range(last + 2, n)
                       if messages[step]["role"] == "assistant" and
                       _answered_within(messages[step:])]
    fitting, lo, hi = None, 0, len(candidates) - 1  # the first that fits (fewest dropped)
    while lo <= hi:
        mid = (lo + hi) // 2
        kept = [messages[i] for i in candidates[mid]]
        try:
            fitting = prepare_chat({**chat, "messages": kept}, tokenizer, model_name,
                                   max_model_len, defaults), candidates[mid]
            hi = mid - 1
        except InvalidRequest as exc:
            if exc.code != "context_length_exceeded":
                raise
            lo = mid + 1
    if fitting is None:
        raise too_long
    return fitting


def _answered_within(messages: list[dict]) -> bool:
    """Whether every tool output in `messages` answers a call made in them (a cut between a
    call and its output would leave the output alone: parallel calls, each with its own
    reasoning, come as several assistant messages before their outputs)."""
    calls: set = set()
    for message in messages:
        for call in message.get("tool_calls") or ():
            calls.add(call.get("id"))
        if message["role"] == "tool" and message.get("tool_call_id") not in calls:
            return False
    return True


def chat_body(data: dict, history: Optional[list] = None) -> tuple[dict, ResponsesRequest]:
    """The chat completions body for Responses request `data` (a dict of JSON values), and what
    its response echoes. `history`: the chat messages of `previous_response_id`'s conversation
    (its input and output), put before this input."""
    for name, allowed in _OFF_VALUES.items():
        if data.get(name) not in allowed:
            raise InvalidRequest(f"{name} {json.dumps(data[name])} is not supported by this "
                                 f"server", param=name, code="unsupported_parameter")
    chat: dict[str, Any] = {k: data[k] for k in _SAME_FIELDS if data.get(k) is not None}
    messages: list[dict] = []
    instructions = data.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise InvalidRequest("instructions must be a string", param="instructions")
        messages.append({"role": "system", "content": instructions})
    conversation = (history or []) + input_messages(data.get("input"))
    # A developer message is the template's system message (the conversation keeps its role).
    chat["messages"] = messages + [dict(m, role="system") if m["role"] == "developer" else m
                                   for m in conversation]
    if data.get("max_output_tokens") is not None:
        chat["max_tokens"] = data["max_output_tokens"]
    tools = _tools(data.get("tools"))
    if tools:
        chat["tools"] = tools
    tool_choice = _tool_choice(data.get("tool_choice"))
    if tools and tool_choice is not None:
        chat["tool_choice"] = tool_choice
    elif tool_choice not in (None, "auto", "none"):
        raise InvalidRequest("tool_choice names a tool, or requires one, but tools is empty",
                             param="tool_choice")
    response_format, text = _text_format(data.get("text"))
    if response_format is not None:
        chat["response_format"] = response_format
    logprobs = _include(data.get("include"))
    if logprobs:
        chat["logprobs"] = True
    else:
        chat.pop("top_logprobs", None)
        if data.get("top_logprobs"):
            raise InvalidRequest(f"top_logprobs needs include: [\"{_INCLUDE_LOGPROBS}\"]",
                                 param="top_logprobs")
    reasoning = _reasoning(data.get("reasoning"))
    if reasoning["effort"] is not None:
        chat["reasoning_effort"] = reasoning["effort"]
    store = data.get("store", True)
    if not isinstance(store, bool) and store is not None:
        raise InvalidRequest("store must be a boolean", param="store")
    background = data.get("background")
    if not isinstance(background, bool) and background is not None:
        raise InvalidRequest("background must be a boolean", param="background")
    if background and store is False:
        raise InvalidRequest("background needs store: true (its response is read back by its "
                             "id)", param="background")
    stream_options = data.get("stream_options")
    if stream_options is not None and not isinstance(stream_options, dict):
        raise InvalidRequest("stream_options must be an object", param="stream_options")
    echo = {"instructions": instructions,
            "max_output_tokens": data.get("max_output_tokens"),
            "metadata": _metadata(data.get("metadata")),
            "parallel_tool_calls": data.get("parallel_tool_calls") is not False,
            "previous_response_id": data.get("previous_response_id"),
            "reasoning": reasoning,
            "text": text,
            "tool_choice": data.get("tool_choice") or ("auto" if tools else "none"),
            "tools": data.get("tools") or [],
            "top_logprobs": data.get("top_logprobs") or 0,
            "truncation": data.get("truncation") or "disabled",
            "user": data.get("user"),
            "background": bool(background)}
    return chat, ResponsesRequest(echo, logprobs, store is not False, conversation,
                                  bool(background))


def responses_param(param: Optional[str]) -> Optional[str]:
    """A chat error's param under the Responses field it came from."""
    if param is None:
        return None
    return _PARAMS.get(re.split(r"[.\[]", param, maxsplit=1)[0], param)


# -- tools, text format, reasoning, include, metadata ------------------------------------------
def _tools(tools: Any) -> list[dict]:
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise InvalidRequest("tools must be a list", param="tools")
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise InvalidRequest(f"tools[{i}]: only function tools are supported by this "
                                 f"server (got type {kind!r})", param=f"tools[{i}].type",
                                 code="unsupported_parameter")
        # In the client's order: a template may write the tool as it stands.
        fn = {k: v for k, v in tool.items() if k in _FUNCTION_KEYS and v is not None}
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(choice: Any) -> Any:
    if choice is None or choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function":
        if not isinstance(choice.get("name"), str):
            raise InvalidRequest("tool_choice.name must be a string", param="tool_choice.name")
        return {"type": "function", "function": {"name": choice["name"]}}
    raise InvalidRequest(f"tool_choice {json.dumps(choice)} is not supported by this server "
                         f"(auto, none, required or a function)", param="tool_choice",
                         code="unsupported_parameter")


def _text_format(text: Any) -> tuple[Optional[dict], dict]:
    """`text` -> (the chat response_format, the `text` the response echoes)."""
    if text is None:
        return None, {"format": {"type": "text"}}
    if not isinstance(text, dict):
        raise InvalidRequest("text must be an object", param="text")
    if text.get("verbosity") not in (None, "medium"):
        raise InvalidRequest(f"text.verbosity {json.dumps(text['verbosity'])} is not "
                             f"supported by this server", param="text.verbosity",
                             code="unsupported_parameter")
    fmt = text.get("format") or {"type": "text"}
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None, {"format": fmt}
    if kind == "json_object":
        return {"type": "json_object"}, {"format": fmt}
    if kind == "json_schema":
        spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": spec}, {"format": fmt}
    raise InvalidRequest(f"text.format.type must be text, json_object or json_schema (got "
                         f"{kind!r})", param="text.format.type")


def _reasoning(reasoning: Any) -> dict:
    """`reasoning` as the response echoes it. Its effort is the chat path's reasoning_effort
    (pd_runtime/entrypoints/openai/request_parsing/chat_prompt.py; its value judged here, before a stored
    conversation is read); a summary is accepted and none is made: the reasoning item carries the
    whole thinking as its content, with an empty summary. Which past thinking the model sees back is
    its chat template's choice, so `context` is "auto" only, and `mode` "standard" only."""
    if reasoning is None:
        return {"effort": None, "summary": None}
    if not isinstance(reasoning, dict):
        raise InvalidRequest("reasoning must be an object", param="reasoning")
    effort = reasoning.get("effort")
    if effort not in (None,) + EFFORTS:
        raise InvalidRequest(f"reasoning.effort must be one of {', '.join(EFFORTS)} (got "
                             f"{effort!r})", param="reasoning.effort")
    summary = reasoning.get("summary")
    for key in ("summary", "generate_summary"):  # the second: its former name
        if reasoning.get(key) not in (None,) + _SUMMARIES:
            raise InvalidRequest(f"reasoning.{key} must be one of {', '.join(_SUMMARIES)}",
                                 param=f"reasoning.{key}")
        summary = summary or reasoning.get(key)
    echoed = {"effort": effort, "summary": summary}
    for key, allowed in (("context", "auto"), ("mode", "standard")):
        if reasoning.get(key) not in (None, allowed):
            raise InvalidRequest(f"reasoning.{key} {json.dumps(reasoning[key])} is not "
                                 f"supported by this server (only {allowed!r})",
                                 param=f"reasoning.{key}", code="unsupported_parameter")
        if reasoning.get(key) is not None:
            echoed[key] = allowed
    return echoed


def _include(include: Any) -> bool:
    if include is None:
        return False
    if not isinstance(include, list) or not all(isinstance(v, str) for v in include):
        raise InvalidRequest("include must be a list of strings", param="include")
    for value in include:
        if value not in (_INCLUDE_LOGPROBS, _INCLUDE_REASONING):
            raise InvalidRequest(f"include {value!r} is not supported by this server (only "
                                 f"{_INCLUDE_LOGPROBS!r} and {_INCLUDE_REASONING!r})",
                                 param="include", code="unsupported_parameter")
    return _INCLUDE_LOGPROBS in include


def _metadata(metadata: Any) -> dict:
    if metadata is None:
        return {}
    if not isinstance(metadata, dict) or len(metadata) > MAX_METADATA_KEYS or not all(
            isinstance(k, str) and len(k) <= 64 and isinstance(v, str) and len(v) <= 512
            for k, v in metadata.items()):
        raise InvalidRequest(f"metadata must be an object of at most {MAX_METADATA_KEYS} "
                             f"string values (keys up to 64 characters, values up to 512)",
                             param="metadata")
    return metadata
