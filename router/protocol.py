"""OpenAI request bodies (completions, chat completions) and their conversion into engine requests:
token ids, SamplingParams fields and one entry per choice, validated with errors naming the param.

Typed fields are validated strictly (no "1" for 1, no true for 1); unknown fields are allowed and
ignored, as OpenAI clients send extras. Response bodies live in router/responses.py.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, ValidationError

from pd_runtime.engine.errors import InvalidRequestError
from pd_runtime.engine.sampling_params import SamplingParams
from router.backend import BackendError

INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
MAX_N = 128  # choices per request: each is a whole engine request
MAX_SUB_REQUESTS = 1024  # prompts x n


class InvalidRequest(BackendError):
    """Bad input from the client: HTTP 400 naming the param."""

    def __init__(self, message: str, param: Optional[str] = None, code: Optional[str] = None):
        super().__init__(400, message, param=param, code=code)


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)


class StreamOptions(_Body):
    include_usage: bool = False


class _SamplingBody(_Body):
    model: Optional[str] = None
    max_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    seed: Optional[int] = None
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: Optional[list[int]] = None
    n: int = 1
    stream: Optional[bool] = False
    stream_options: Optional[StreamOptions] = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    priority: int = 0  # extension: lower values are scheduled first


class CompletionRequest(_SamplingBody):
    prompt: Any = None  # str | list[str] | list[int] | list[list[int]], checked by hand
    logprobs: Optional[int] = None
    echo: bool = False


class ContentPart(_Body):
    type: str
    text: Optional[str] = None


class ChatMessage(_Body):
    role: str
    content: Optional[Union[str, list[ContentPart]]] = None
    name: Optional[str] = None


class ChatCompletionRequest(_SamplingBody):
    messages: list[ChatMessage]
    logprobs: Optional[bool] = False
    top_logprobs: Optional[int] = None
    max_completion_tokens: Optional[int] = None


@dataclass
class ChoiceSpec:
    """One engine request: choice `index` of the response, for prompt `prompt_index`."""
    index: int
    prompt_index: int
    params: dict


@dataclass
class PreparedRequest:
    kind: Literal["completion", "chat"]
    model: str
    prompts: list[list[int]]
    choices: list[ChoiceSpec]
    stream: bool
    include_usage: bool
    priority: int
    logprobs: Optional[int]  # top-n asked for (0: only the sampled token), None: not asked
    echo_texts: Optional[list[str]] = None  # completions with echo: the text of each prompt


def parse_json(raw: bytes) -> dict:
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise InvalidRequest(f"the body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise InvalidRequest("the body must be a JSON object", code="invalid_json")
    return data


def _validate(model: type[_Body], data: dict) -> Any:
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = [str(part) for part in first["loc"]]
        # Union branches show up as loc parts ("str", "list[str]"); the client's param is the head.
        param = loc[0] if loc else None
        where = ".".join(loc)
        raise InvalidRequest(f"{where}: {first['msg']}" if where else first["msg"],
                             param=param) from None
    except RecursionError:
        raise InvalidRequest("the body is nested too deeply") from None


def _check_model(requested: Optional[str], served: str) -> None:
    if requested is not None and requested != served:
        raise InvalidRequest(f"the model {requested!r} does not exist; this server serves "
                             f"{served!r}", param="model", code="model_not_found")


def _int64(value: Optional[int], param: str) -> None:
    if value is not None and not INT64_MIN <= value <= INT64_MAX:
        raise InvalidRequest(f"{param} must fit in a signed 64-bit integer", param=param)


def _sampling_fields(body: _SamplingBody, max_tokens: Optional[int]) -> dict:
    params: dict[str, Any] = {}
    for name in ("temperature", "top_p", "top_k", "min_p", "seed"):
        value = getattr(body, name)
        if value is not None:
            params[name] = value
    for name in ("top_k", "seed", "priority"):
        _int64(getattr(body, name), name)
    if body.stop is not None:
        params["stop"] = [body.stop] if isinstance(body.stop, str) else list(body.stop)
    if body.stop_token_ids:
        if any(not 0 <= t <= INT64_MAX for t in body.stop_token_ids):
            raise InvalidRequest("stop_token_ids must be non-negative 64-bit integers",
                                 param="stop_token_ids")
        params["stop_token_ids"] = list(body.stop_token_ids)
    params["ignore_eos"] = body.ignore_eos
    params["skip_special_tokens"] = body.skip_special_tokens
    if max_tokens is not None:
        params["max_tokens"] = max_tokens
    return params


def _check_sampling(params: dict, renames: Optional[dict] = None) -> None:
    """SamplingParams is the one place sampling values are judged; `renames` maps its field
    names to the client's (chat says max_completion_tokens and top_logprobs)."""
    try:
        SamplingParams(**params)
    except InvalidRequestError as exc:
        raise InvalidRequest(str(exc), param=(renames or {}).get(exc.param, exc.param)) from None


def _check_n(body: _SamplingBody, num_prompts: int) -> None:
    if not 1 <= body.n <= MAX_N:
        raise InvalidRequest(f"n must be in [1, {MAX_N}], got {body.n}", param="n")
    if body.n * num_prompts > MAX_SUB_REQUESTS:
        raise InvalidRequest(f"prompts x n must be at most {MAX_SUB_REQUESTS}", param="n")
    if body.seed is not None and body.seed + body.n - 1 > INT64_MAX:
        raise InvalidRequest("seed + n - 1 must fit in a signed 64-bit integer", param="seed")


def _check_length(prompt: list[int], max_tokens: int, max_model_len: int, param: str) -> None:
    if len(prompt) >= max_model_len:
        raise InvalidRequest(f"the prompt has {len(prompt)} tokens; this model's context is "
                             f"{max_model_len} tokens, including at least one generated token",
                             param=param, code="context_length_exceeded")
    if len(prompt) + max_tokens > max_model_len:
        raise InvalidRequest(f"the prompt ({len(prompt)} tokens) plus max_tokens ({max_tokens}) "
                             f"exceeds this model's context of {max_model_len} tokens",
                             param=param, code="context_length_exceeded")


def _choices(prompts: list[list[int]], n: int, params: dict) -> list[ChoiceSpec]:
    """n independent requests per prompt, indexed prompt-major as OpenAI orders them; with a
    seed, choice i of a prompt uses seed + i so that the n choices differ yet reproduce."""
    choices = []
    for p in range(len(prompts)):
        for i in range(n):
            own = dict(params)
            if "seed" in own:
                own["seed"] = params["seed"] + i
            choices.append(ChoiceSpec(len(choices), p, own))
    return choices


def _completion_prompts(prompt: Any, tokenizer) -> tuple[list[list[int]], list[Optional[str]]]:
    """Token ids of each prompt (and its text when given as text)."""
    def is_ids(value):
        return isinstance(value, list) and value and all(
            isinstance(t, int) and not isinstance(t, bool) for t in value)

    if isinstance(prompt, str):
        items = [prompt]
    elif is_ids(prompt):
        items = [prompt]
    elif isinstance(prompt, list) and prompt and all(
            isinstance(p, str) or is_ids(p) for p in prompt):
        items = prompt
    else:
        raise InvalidRequest("prompt must be a non-empty string, a list of strings, a list of "
                             "token ids or a list of token-id lists", param="prompt")
    prompts, texts = [], []
    for item in items:
        if isinstance(item, str):
            ids = tokenizer.encode(item) if item else []
            texts.append(item)
        else:
            if any(t < 0 or t > INT64_MAX for t in item):
                raise InvalidRequest("prompt token ids must be non-negative", param="prompt")
            ids = list(item)
            texts.append(None)
        if not ids:
            raise InvalidRequest("the prompt is empty", param="prompt")
        prompts.append(ids)
    return prompts, texts


def prepare_completion(data: dict, tokenizer, model_name: str,
                       max_model_len: int) -> PreparedRequest:
    body: CompletionRequest = _validate(CompletionRequest, data)
    _check_model(body.model, model_name)
    if body.prompt is None:
        raise InvalidRequest("prompt is required", param="prompt")
    prompts, texts = _completion_prompts(body.prompt, tokenizer)
    _check_n(body, len(prompts))
    max_tokens = 16 if body.max_tokens is None else body.max_tokens  # OpenAI's default
    params = _sampling_fields(body, max_tokens)
    if body.logprobs is not None:
        params["logprobs"] = body.logprobs
        if body.echo:
            raise InvalidRequest("echo with logprobs is not supported (no prompt logprobs)",
                                 param="echo")
    _check_sampling(params)
    for prompt in prompts:
        _check_length(prompt, max_tokens, max_model_len, "prompt")
    echo = [t if t is not None else tokenizer.decode(p, skip_special_tokens=False)
            for p, t in zip(prompts, texts)] if body.echo else None
    return PreparedRequest("completion", model_name, prompts, _choices(prompts, body.n, params),
                           bool(body.stream), _include_usage(body), body.priority,
                           body.logprobs, echo)


def _message_dict(message: ChatMessage, index: int) -> dict:
    content = message.content
    if isinstance(content, list):
        texts = []
        for part in content:
            if part.type != "text" or part.text is None:
                raise InvalidRequest(f"messages[{index}].content: only text parts are supported "
                                     f"(got type {part.type!r})", param="messages")
            texts.append(part.text)
        content = "".join(texts)
    out = {"role": message.role, "content": content or ""}
    if message.name is not None:
        out["name"] = message.name
    return out


def _chat_prompt(messages: list[ChatMessage], tokenizer) -> list[int]:
    if not messages:
        raise InvalidRequest("messages must not be empty", param="messages")
    dicts = [_message_dict(m, i) for i, m in enumerate(messages)]
    try:
        ids = tokenizer.encode_chat(dicts)
    except InvalidRequestError as exc:
        raise InvalidRequest(str(exc), param="messages") from None
    except Exception as exc:  # the template is user-influenced code: any failure is a bad request
        raise InvalidRequest(f"the chat template failed on these messages: {exc}",
                             param="messages") from None
    if not ids:
        raise InvalidRequest("the chat prompt is empty", param="messages")
    return ids


def prepare_chat(data: dict, tokenizer, model_name: str, max_model_len: int) -> PreparedRequest:
    body: ChatCompletionRequest = _validate(ChatCompletionRequest, data)
    _check_model(body.model, model_name)
    prompt = _chat_prompt(body.messages, tokenizer)
    _check_n(body, 1)
    requested = body.max_completion_tokens if body.max_completion_tokens is not None \
        else body.max_tokens
    param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    # OpenAI's default for chat: as much as the context leaves.
    max_tokens = requested if requested is not None else max(1, max_model_len - len(prompt))
    params = _sampling_fields(body, max_tokens)
    logprobs = None
    if body.top_logprobs is not None and not body.logprobs:
        raise InvalidRequest("top_logprobs needs logprobs: true", param="top_logprobs")
    if body.logprobs:
        logprobs = params["logprobs"] = body.top_logprobs or 0
    _check_sampling(params, {"max_tokens": param, "logprobs": "top_logprobs"})
    _check_length(prompt, max_tokens, max_model_len, "messages")
    return PreparedRequest("chat", model_name, [prompt], _choices([prompt], body.n, params),
                           bool(body.stream), _include_usage(body), body.priority, logprobs)


def _include_usage(body: _SamplingBody) -> bool:
    if body.stream_options is not None and not body.stream:
        raise InvalidRequest("stream_options is only allowed with stream: true",
                             param="stream_options")
    return bool(body.stream_options and body.stream_options.include_usage)
