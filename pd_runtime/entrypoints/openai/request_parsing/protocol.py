"""OpenAI request bodies (completions, chat completions) and their conversion into engine requests:
token ids, SamplingParams fields and one entry per choice, validated with errors naming the param.

Typed fields are validated strictly (no "1" for 1, no true for 1); unknown fields are allowed and
ignored, as OpenAI clients send extras, but OpenAI fields this server does not implement are
refused unless they hold their "off" value. The body schemas live in
pd_runtime/entrypoints/openai/request_parsing/schema.py, the response bodies in
pd_runtime/entrypoints/openai/completion_bodies.py.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Optional

from pydantic import ValidationError

from pd_runtime.api import InvalidRequestError, SamplingParams, bad_word_spellings, check_bad_words
from pd_runtime.entrypoints.openai import beam_search
from pd_runtime.entrypoints.openai.request_parsing.chat_prompt import chat_text
from pd_runtime.entrypoints.openai.request_parsing.reasoning_request import prepare as prepare_reasoning
from pd_runtime.entrypoints.openai.request_parsing.schema import (ChatCompletionRequest, ChoiceSpec,
                                                  CompletionRequest, InvalidRequest,
                                                  PreparedRequest, Body, SamplingBody)
from pd_runtime.entrypoints.openai.request_parsing.structured_fields import structured_spec
from pd_runtime.entrypoints.openai.request_parsing.text_checks import lone_surrogate_field, min_tokens
from pd_runtime.entrypoints.openai.request_parsing.tools import prepare as prepare_tools
from pd_runtime.parsers.text import refuse_json_constant

INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
MAX_N = 128  # choices per request: each is a whole engine request
MAX_SUB_REQUESTS = 1024  # prompts x n
# The engine checks every stop condition after every token: keep the lists short.
MAX_STOP_STRINGS = 64
MAX_STOP_TOKEN_IDS = 1024

# OpenAI fields this server does not implement, with the values that mean "not used": anything
# else is refused naming the field, rather than accepted and silently ignored.
_OFF_VALUES: dict[str, tuple] = {
    "suffix": (None, ""),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "parallel_tool_calls": (None, True),  # OpenAI's default; without tools it does nothing
    "functions": (None, []),
    "function_call": (None, "none"),
    "audio": (None,),
    "modalities": (None, ["text"]),
    "prediction": (None,),
    "reasoning_effort": (None,),
    "web_search_options": (None,),
    # vLLM's extensions that would change the output: its per-request template (this server
    # renders the model's own). (Beam search: pd_runtime/entrypoints/openai/beam_search.py;
    # structured outputs: pd_runtime/entrypoints/openai/request_parsing/structured_fields.py.)
    "chat_template": (None,),
    "documents": (None, []),
    "guided_whitespace_pattern": (None,),
    "logits_processors": (None,),
    "spaces_between_special_tokens": (None, True),
    "logprob_token_ids": (None,),
    "thinking_token_budget": (None,),
    "repetition_detection": (None,),
}


def parse_json(raw: bytes) -> dict:
    """The body as a dict of JSON values: no NaN or Infinity (Python's json extension) and no
    lone UTF-16 surrogates (valid JSON escapes, but not text anything downstream can encode)."""
    try:
        data = json.loads(raw, parse_constant=refuse_json_constant)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise InvalidRequest(f"the body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise InvalidRequest("the body must be a JSON object", code="invalid_json")
    key = lone_surrogate_field(raw, data)
    if key is not None:
        name = key.encode("utf-8", "backslashreplace").decode()  # the key may be the culprit
        raise InvalidRequest(f"{name}: a string holds a lone UTF-16 surrogate, which is not a "
                             f"Unicode character", param=name)
    return data


def _validate(model: type[Body], data: dict) -> Any:
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


# What chat completions implement of _OFF_VALUES (pd_runtime/entrypoints/openai/request_parsing/tools.py,
# pd_runtime/entrypoints/openai/request_parsing/chat_prompt.py); completions refuse them.
_CHAT_ONLY = frozenset({"tools", "tool_choice", "parallel_tool_calls", "reasoning_effort"})


def _refuse_unimplemented(body: SamplingBody, data: dict, chat: bool = False) -> None:
    for name, off in _OFF_VALUES.items():
        if chat and name in _CHAT_ONLY:
            continue
        value = data.get(name)
        if not any(_same_json(value, o) for o in off):
            allowed = " or ".join(json.dumps(o) for o in off)
            raise InvalidRequest(f"{name} is not supported by this server (only {allowed})",
                                 param=name, code="unsupported_parameter")
    if body.best_of is not None and body.best_of != body.n:
        raise InvalidRequest(f"best_of is not supported by this server (only null or n, which "
                             f"is {body.n})", param="best_of", code="unsupported_parameter")


def _same_json(value: Any, off: Any) -> bool:
    """Equal as JSON values: true is not 1 here, unlike in Python."""
    if type(value) is not type(off):
        return False
    return value is None or json.dumps(value, sort_keys=True) == json.dumps(off, sort_keys=True)


def _logit_bias(bias: dict[str, float], vocab_size: int) -> dict[str, float]:
    for key in bias:
        if not (key.isascii() and key.isdigit() and len(key) <= 20 and int(key) < vocab_size):
            raise InvalidRequest(f"logit_bias keys must be token ids in [0, {vocab_size}), got "
                                 f"{key[:40]!r}", param="logit_bias")
    return dict(bias)


def _sampling_fields(body: SamplingBody, max_tokens: Optional[int], tokenizer,
                     defaults: dict) -> dict:
    """SamplingParams fields: the body's, else the model's `defaults` (sampling_defaults.py)."""
    vocab_size = tokenizer.vocab_size
    params: dict[str, Any] = {}
    for name in ("temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty",
                 "frequency_penalty", "repetition_penalty"):
        value = getattr(body, name)
        if value is None:
            value = defaults.get(name)
        if value is not None:
            params[name] = value
    for name in ("top_k", "seed", "priority"):
        _int64(getattr(body, name), name)
    if body.logit_bias:
        params["logit_bias"] = _logit_bias(body.logit_bias, vocab_size)
    if body.stop is not None:
        params["stop"] = [body.stop] if isinstance(body.stop, str) else list(body.stop)
        if len(params["stop"]) > MAX_STOP_STRINGS:
            raise InvalidRequest(f"stop may hold at most {MAX_STOP_STRINGS} strings",
                                 param="stop")
    if body.stop_token_ids:
        if any(not 0 <= t <= INT64_MAX for t in body.stop_token_ids):
            raise InvalidRequest("stop_token_ids must be non-negative 64-bit integers",
                                 param="stop_token_ids")
        if len(body.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise InvalidRequest(f"stop_token_ids may hold at most {MAX_STOP_TOKEN_IDS} ids",
                                 param="stop_token_ids")
        params["stop_token_ids"] = list(body.stop_token_ids)
    if body.allowed_token_ids is not None:
        if any(not 0 <= t < vocab_size for t in body.allowed_token_ids):
            raise InvalidRequest(f"allowed_token_ids must be token ids in [0, {vocab_size})",
                                 param="allowed_token_ids")
        params["allowed_token_ids"] = list(body.allowed_token_ids)
    if body.bad_words:
        try:  # before the tokenizer sees them
            check_bad_words(body.bad_words)
        except InvalidRequestError as exc:
            raise InvalidRequest(str(exc), param="bad_words") from None
        params["bad_words"] = list(body.bad_words)
        params["bad_words_token_ids"] = bad_word_spellings(
                body.bad_words, lambda text: tokenizer.encode(text, add_special_tokens=False))
    if body.prompt_logprobs is not None and not body.stream:
        params["prompt_logprobs"] = body.prompt_logprobs
    elif body.prompt_logprobs:  # a stream never shows them; 0 asks for nothing (as vLLM)
        raise InvalidRequest("prompt_logprobs are not available with stream: true",
                             param="prompt_logprobs")
    params["ignore_eos"] = body.ignore_eos
    params["min_tokens"] = body.min_tokens
    params["include_stop_str_in_output"] = body.include_stop_str_in_output
    params["skip_special_tokens"] = body.skip_special_tokens
    spec, _ = structured_spec(body.model_extra or {}) if body.model_extra else (None, None)
    if spec is not None:
        params["structured_outputs"] = spec
    if max_tokens is not None:
        params["max_tokens"] = max_tokens
    return params


def _check_sampling(params: dict, renames: Optional[dict] = None) -> SamplingParams:
    """SamplingParams is the one place sampling values are judged, here, once per request; the
    workers and the engine take the object as it is. `renames` maps its field names to the
    client's (chat says max_completion_tokens and top_logprobs)."""
    try:
        return SamplingParams(**params)
    except InvalidRequestError as exc:
        raise InvalidRequest(str(exc), param=(renames or {}).get(exc.param, exc.param)) from None


def _check_n(body: SamplingBody, num_prompts: int) -> None:
    if not 1 <= body.n <= MAX_N:
        raise InvalidRequest(f"n must be in [1, {MAX_N}], got {body.n}", param="n")
    if body.n * num_prompts > MAX_SUB_REQUESTS:
        raise InvalidRequest(f"prompts x n must be at most {MAX_SUB_REQUESTS}", param="n")
    if body.seed is not None and body.seed + body.n - 1 > INT64_MAX:
        raise InvalidRequest("seed + n - 1 must fit in a signed 64-bit integer", param="seed")


def _check_length(prompt: list[int], max_tokens: int, max_model_len: int, param: str) -> None:
    _refuse_long_prompt(len(prompt), "", max_model_len, param)
    if len(prompt) + max_tokens > max_model_len:
        raise InvalidRequest(f"the prompt ({len(prompt)} tokens) plus max_tokens ({max_tokens}) "
                             f"exceeds this model's context of {max_model_len} tokens",
                             param=param, code="context_length_exceeded")


def _refuse_long_prompt(num_tokens: int, at_least: str, max_model_len: int, param: str) -> None:
    if num_tokens >= max_model_len:
        raise InvalidRequest(f"the prompt has {at_least}{num_tokens} tokens; this model's context "
                             f"is {max_model_len} tokens, including at least one generated token",
                             param=param, code="context_length_exceeded")


def _encode(text: str, tokenizer, max_model_len: int, param: str,
            add_special_tokens: bool = True, truncating: bool = False) -> list[int]:
    """Token ids of `text`, refusing first, from its length alone, a text that cannot fit
    (unless the caller keeps only its end): tokenizing megabytes only to count them would take
    seconds."""
    if not truncating:
        _refuse_long_prompt(min_tokens(text, tokenizer, max_model_len), "at least ",
                            max_model_len, param)
    return tokenizer.encode(text, add_special_tokens=add_special_tokens) if text else []


def _truncation(body: SamplingBody, max_model_len: int, room: int) -> Optional[tuple[int, bool]]:
    """vLLM's truncate_prompt_tokens: how many prompt tokens to keep (-1: as many as leave
    `room` output tokens in the context) and whether from the start (truncation_side "right"),
    or None to refuse a prompt too long for the context. A kept prompt that still leaves no
    room for max_tokens is refused afterwards, as any prompt is."""
    value = body.truncate_prompt_tokens
    if value is None:
        return None
    if value == -1:
        if room >= max_model_len:
            raise InvalidRequest(f"max_tokens ({room}) leaves no room in this model's context "
                                 f"of {max_model_len} tokens for a prompt", param="max_tokens")
        return max_model_len - room, body.truncation_side == "right"
    if not 1 <= value <= max_model_len:
        raise InvalidRequest(f"truncate_prompt_tokens must be -1 or in [1, {max_model_len}] "
                             f"(the context), got {value}", param="truncate_prompt_tokens")
    return value, body.truncation_side == "right"


def _cut(ids: list[int], text: Optional[str], tokenizer,
         truncation: Optional[tuple[int, bool]]) -> list[int]:
    if truncation is None:
        return ids
    keep, from_start = truncation
    if text is not None:  # the special tokens the tokenizer added stay, as HF truncates
        return tokenizer.truncate(text, ids, keep, from_start)
    return ids[:keep] if from_start else ids[-keep:]


def _choices(prompts: list[list[int]], n: int, params: SamplingParams) -> list[ChoiceSpec]:
    """n independent requests per prompt, indexed prompt-major as OpenAI orders them; with a
    seed, choice i of a prompt uses seed + i so that the n choices differ yet reproduce."""
    choices = []
    for p in range(len(prompts)):
        for i in range(n):
            own = params if params.seed is None or i == 0 else \
                dataclasses.replace(params, seed=params.seed + i)
            choices.append(ChoiceSpec(len(choices), p, own))
    return choices


def is_token_ids(value: Any) -> bool:
    """A non-empty list of ints (not bools). The set of the items' types is built in C: a
    per-item Python check cost ~1 ms per 1,000 ids, one request at a time on the event loop."""
    return isinstance(value, list) and bool(value) and set(map(type, value)) == {int}


def _completion_prompts(prompt: Any, tokenizer, max_model_len: int,
                        truncation: Optional[tuple[int, bool]] = None,
                        add_special_tokens: bool = True
                        ) -> tuple[list[list[int]], list[Optional[str]]]:
    """Token ids of each prompt (truncated, when asked), and its text when given as text and
    kept whole."""
    def is_ids(value):
        if truncation is None and isinstance(value, list) and value and \
                isinstance(value[0], int):
            # Length first: checking the type of every id of a huge list costs seconds.
            _refuse_long_prompt(len(value), "", max_model_len, "prompt")
        return is_token_ids(value)

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
            ids = _encode(item, tokenizer, max_model_len, "prompt", add_special_tokens,
                          truncating=truncation is not None)
            cut = _cut(ids, item, tokenizer, truncation)
            texts.append(item if len(cut) == len(ids) else None)
            ids = cut
        else:
            if min(item) < 0 or max(item) > INT64_MAX:
                raise InvalidRequest("prompt token ids must be non-negative", param="prompt")
            ids = _cut(list(item), None, tokenizer, truncation)
            texts.append(None)
        if not ids:
            raise InvalidRequest("the prompt is empty", param="prompt")
        prompts.append(ids)
    return prompts, texts


def _default_max_tokens(endpoint_default: int, defaults: dict) -> int:
    """A request that names no max_tokens: the endpoint's default, or the model's
    max_new_tokens when smaller (it never caps a value the request names)."""
    return min(endpoint_default, defaults.get("max_tokens", endpoint_default))


def prepare_completion(data: dict, tokenizer, model_name: str, max_model_len: int,
                       defaults: Optional[dict] = None) -> PreparedRequest:
    """`defaults`: the model's sampling defaults for fields the body leaves out ({}: OpenAI's)."""
    defaults = defaults or {}
    body: CompletionRequest = _validate(CompletionRequest, data)
    _check_model(body.model, model_name)
    if body.prompt is None:
        raise InvalidRequest("prompt is required", param="prompt")
    _refuse_unimplemented(body, data)
    max_tokens = _default_max_tokens(16, defaults) if body.max_tokens is None \
        else body.max_tokens  # 16: OpenAI's default
    truncation = _truncation(body, max_model_len, max_tokens)
    prompts, texts = _completion_prompts(body.prompt, tokenizer, max_model_len, truncation,
                                         body.add_special_tokens is not False)
    _check_n(body, len(prompts))
    params = _sampling_fields(body, max_tokens, tokenizer, defaults)
    if body.logprobs is not None:
        params["logprobs"] = body.logprobs
        if body.echo:  # the prompt's tokens are scored too (how evaluation harnesses score)
            params["prompt_logprobs"] = max(body.logprobs, params.get("prompt_logprobs", 0))
    sampling = _check_sampling(params)
    for prompt in prompts:
        _check_length(prompt, max_tokens, max_model_len, "prompt")
    echo = [t if t is not None else tokenizer.decode(p, skip_special_tokens=False)
            for p, t in zip(prompts, texts)] if body.echo else None
    return PreparedRequest("completion", model_name, prompts, _choices(prompts, body.n, sampling),
                           bool(body.stream), _include_usage(body), body.priority,
                           body.logprobs, echo, service_tier=_service_tier(body),
                           beam=beam_search.spec(body, data, "structured_outputs" in params),
                           **_token_fields(body))


def prepare_chat(data: dict, tokenizer, model_name: str, max_model_len: int,
                 defaults: Optional[dict] = None) -> PreparedRequest:
    defaults = defaults or {}
    body: ChatCompletionRequest = _validate(ChatCompletionRequest, data)
    _check_model(body.model, model_name)
    _refuse_unimplemented(body, data, chat=True)
    tools, tool_spec, tool_plan = prepare_tools(body.model_extra or {},
                                                getattr(tokenizer, "tool_call_format", None))
    if body.echo:
        raise InvalidRequest("echo is not supported on chat completions",
                             param="echo", code="unsupported_parameter")
    requested = body.max_completion_tokens if body.max_completion_tokens is not None \
        else body.max_tokens
    truncation = _truncation(body, max_model_len, requested or 1)
    # As Tokenizer.encode_chat: the template already carries any BOS (vLLM's default too).
    text = chat_text(body, tokenizer, tools)
    prompt = _encode(text, tokenizer, max_model_len, "messages", bool(body.add_special_tokens),
                     truncating=truncation is not None)
    prompt = _cut(prompt, text, tokenizer, truncation)
    if not prompt:
        raise InvalidRequest("the chat prompt is empty", param="messages")
    _check_n(body, 1)
    param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    # OpenAI's default for chat: as much as the context leaves.
    max_tokens = requested if requested is not None else \
        _default_max_tokens(max(1, max_model_len - len(prompt)), defaults)
    params = _sampling_fields(body, max_tokens, tokenizer, defaults)
    if tool_spec is not None:
        if "structured_outputs" in params:
            raise InvalidRequest(f"{structured_spec(body.model_extra)[1]}: a request may ask "
                                 f"for one structured output; tool_choice "
                                 f"{json.dumps(body.model_extra.get('tool_choice'))} holds "
                                 f"the output to the tools' calls", param="tool_choice")
        params["structured_outputs"] = tool_spec
    if tool_plan is not None and tool_plan.mode == "auto":
        params["skip_special_tokens"] = False  # a format's markers may be special tokens
    logprobs = None
    if body.top_logprobs is not None and not body.logprobs:
        raise InvalidRequest("top_logprobs needs logprobs: true", param="top_logprobs")
    if body.logprobs:
        logprobs = params["logprobs"] = body.top_logprobs or 0
    thinking = prepare_reasoning(text, params, tokenizer, body.model_extra or {})
    sampling = _check_sampling(params, {"max_tokens": param, "logprobs": "top_logprobs"})
    _check_length(prompt, max_tokens, max_model_len, "messages")
    return PreparedRequest("chat", model_name, [prompt], _choices([prompt], body.n, sampling),
                           bool(body.stream), _include_usage(body), body.priority, logprobs,
                           tools=tool_plan, service_tier=_service_tier(body),
                           reasoning=thinking,
                           beam=beam_search.spec(body, data, "structured_outputs" in params),
                           **_token_fields(body))


def _token_fields(body: SamplingBody) -> dict:
    """PreparedRequest's fields for vLLM's token-level extensions."""
    if body.cache_salt is not None and not body.cache_salt:
        raise InvalidRequest("cache_salt must be a non-empty string", param="cache_salt")
    return {"token_ids": bool(body.return_token_ids),
            "tokens_as_ids": bool(body.return_tokens_as_token_ids),
            "prompt_logprobs": None if body.stream else body.prompt_logprobs,
            "cache_salt": body.cache_salt}


def _service_tier(body: SamplingBody) -> Optional[str]:
    """The tier a request named ("auto" is "default"), or None."""
    tier = body.service_tier
    if tier in ("priority", "scale"):
        raise InvalidRequest(f"service_tier {tier!r} is not supported by this server (auto, "
                             f"default or flex)", param="service_tier",
                             code="unsupported_parameter")
    return None if tier is None else "flex" if tier == "flex" else "default"


def _include_usage(body: SamplingBody) -> bool:
    if body.stream_options is not None and not body.stream:
        raise InvalidRequest("stream_options is only allowed with stream: true",
                             param="stream_options")
    return bool(body.stream_options and body.stream_options.include_usage)
