"""The OpenAI request bodies this server reads (completions, chat completions) as strict
pydantic models, and what pd_runtime/entrypoints/openai/request_parsing/protocol.py turns a body into: one
PreparedRequest with one ChoiceSpec per engine request. Typed fields are strict (no "1" for 1);
unknown fields are allowed (OpenAI clients send extras); pd_runtime/entrypoints/openai/request_parsing/protocol.py
checks the rest by hand.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict

from pd_runtime.api import SamplingParams
from pd_runtime.router.backend import BackendError


class InvalidRequest(BackendError):
    """Bad input from the client: HTTP 400 naming the param."""

    def __init__(self, message: str, param: Optional[str] = None, code: Optional[str] = None):
        super().__init__(400, message, param=param, code=code)


class Body(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)


class StreamOptions(Body):
    include_usage: bool = False


class SamplingBody(Body):
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
    min_tokens: int = 0  # extension (vLLM): no EOS, stop token id or stop string before these
    include_stop_str_in_output: bool = False  # extension (vLLM)
    # Extensions (vLLM's): keep N of the prompt's tokens, its last (truncation_side "left",
    # the default) or its first ("right"); whether the tokenizer adds its special tokens
    # (completions: yes, chat: no, the template carries them).
    truncate_prompt_tokens: Optional[int] = None
    truncation_side: Optional[Literal["left", "right"]] = None
    add_special_tokens: Optional[bool] = None
    skip_special_tokens: bool = True
    priority: int = 0  # extension: lower values are scheduled first
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    repetition_penalty: Optional[float] = None  # extension (vLLM)
    logit_bias: Optional[dict[str, float]] = None
    best_of: Optional[int] = None  # only as many as n: every choice is returned
    user: Optional[str] = None  # an end-user id for the client's own bookkeeping; no effect
    # OpenAI's: "flex" is not held to the latency targets (routed by load, scheduled after
    # the default tier, queued rather than refused); "auto" and "default" are the default.
    service_tier: Optional[Literal["auto", "default", "flex", "priority", "scale"]] = None
    # vLLM's, as RL and evaluation tools send them: the tokens that may be chosen, words never
    # written, the prompt's own logprobs, the token ids in the response and as logprob tokens,
    # and a prefix-cache salt (requests share cached blocks only under the same salt).
    allowed_token_ids: Optional[list[int]] = None
    bad_words: Optional[list[str]] = None
    prompt_logprobs: Optional[int] = None
    return_token_ids: Optional[bool] = None
    return_tokens_as_token_ids: Optional[bool] = None
    cache_salt: Optional[str] = None
    # vLLM's beam search (pd_runtime/entrypoints/openai/beam_search.py): n is the beam width.
    use_beam_search: bool = False
    length_penalty: float = 1.0


class CompletionRequest(SamplingBody):
    prompt: Any = None  # str | list[str] | list[int] | list[list[int]], checked by hand
    logprobs: Optional[int] = None
    echo: bool = False


class ContentPart(Body):
    type: str
    text: Optional[str] = None


class ChatMessage(Body):
    role: str
    content: Optional[Union[str, list[ContentPart]]] = None
    name: Optional[str] = None


class ChatCompletionRequest(SamplingBody):
    messages: list[ChatMessage]
    logprobs: Optional[bool] = False
    top_logprobs: Optional[int] = None
    max_completion_tokens: Optional[int] = None
    # Extensions (vLLM's): how the chat template ends the prompt, and its own variables.
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: Optional[dict[str, Any]] = None
    echo: Optional[bool] = None  # vLLM's chat echo: refused when true
    reasoning_effort: Optional[Any] = None  # a reasoning model's: pd_runtime/entrypoints/openai/request_parsing/chat_prompt.py


@dataclass
class ChoiceSpec:
    """One engine request: choice `index` of the response, for prompt `prompt_index`, with its
    sampling parameters, validated once here (the workers take them as they are)."""
    index: int
    prompt_index: int
    params: SamplingParams


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
    tools: Any = None  # chat with tool calls: pd_runtime/entrypoints/openai/request_parsing/tools.py's ToolPlan
    service_tier: Optional[str] = None  # "default" or "flex" when the request named one
    # A reasoning model's chat: whether the prompt left its think block open (None: no
    # thinking is split out; pd_runtime/parsers/reasoning.py), or "harmony" (gpt-oss's channels,
    # pd_runtime/parsers/harmony.py)
    reasoning: Optional[bool | str] = None
    # a Responses API request's: pd_runtime/entrypoints/openai/responses/request.py ResponsesRequest
    responses: Any = None
    token_ids: bool = False  # return_token_ids: prompt_token_ids and each choice's token_ids
    tokens_as_ids: bool = False  # return_tokens_as_token_ids: logprob tokens as "token_id:N"
    prompt_logprobs: Optional[int] = None  # top-n of each prompt token, asked for as such
    cache_salt: Optional[str] = None  # the request's own, beside its tenant's
    beam: Any = None  # use_beam_search: pd_runtime/entrypoints/openai/beam_search.py's BeamSpec
