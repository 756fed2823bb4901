"""vLLM's tokenizer endpoints, for clients that tokenize through the server rather than load the
model's files (lm-eval's remote tokenizer, prompt-length checks): POST /tokenize (a prompt, or
chat messages through the chat template), POST /detokenize, GET /tokenizer_info.
"""

from __future__ import annotations

import asyncio
from typing import Any, Optional

from pd_runtime.entrypoints.openai.request_parsing.chat_prompt import chat_text
from pd_runtime.entrypoints.openai.request_parsing.protocol import INT64_MAX, _check_model, _validate, parse_json
from pd_runtime.entrypoints.openai.request_parsing.schema import (Body, ChatCompletionRequest, ChatMessage,
                                                  InvalidRequest)


class TokenizeRequest(Body):
    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[ChatMessage]] = None
    add_special_tokens: Optional[bool] = None  # prompt: true; messages: false (the template's)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: Optional[dict[str, Any]] = None
    return_token_strs: bool = False


class DetokenizeRequest(Body):
    model: Optional[str] = None
    tokens: list[int]


async def tokenize(raw: bytes, backend) -> dict:
    body: TokenizeRequest = _validate(TokenizeRequest, parse_json(raw))
    _check_model(body.model, backend.model_name)
    tok = backend.tokenizer
    if (body.prompt is None) == (body.messages is None):
        raise InvalidRequest("give either prompt or messages", param="prompt")
    if body.prompt is not None:
        text, special = body.prompt, body.add_special_tokens is not False
    else:
        chat = ChatCompletionRequest.model_validate({
            "messages": [m.model_dump(exclude_none=True) for m in body.messages],
            "add_generation_prompt": body.add_generation_prompt,
            "continue_final_message": body.continue_final_message,
            "chat_template_kwargs": body.chat_template_kwargs})
        text, special = chat_text(chat, tok), bool(body.add_special_tokens)
    # encode_batch releases the GIL: a long text does not stall the event loop.
    ids = await asyncio.to_thread(tok.encode, text, special) if text else []
    return {"count": len(ids), "max_model_len": backend.max_model_len, "tokens": ids,
            "token_strs": [tok.decode([t], skip_special_tokens=False) for t in ids]
            if body.return_token_strs else None}


def detokenize(raw: bytes, backend) -> dict:
    body: DetokenizeRequest = _validate(DetokenizeRequest, parse_json(raw))
    _check_model(body.model, backend.model_name)
    if any(not 0 <= t <= INT64_MAX for t in body.tokens):
        raise InvalidRequest("tokens must be non-negative 64-bit integers", param="tokens")
    return {"prompt": backend.tokenizer.decode(body.tokens, skip_special_tokens=False)}


def tokenizer_info(backend) -> dict:
    tok = backend.tokenizer
    special = tok.files.get("special_tokens") or {}
    return {"tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": special.get("bos_token", tok.bos_token),
            "eos_token": special.get("eos_token", tok.eos_token),
            "pad_token": special.get("pad_token"), "unk_token": special.get("unk_token"),
            "chat_template": tok.chat_template, "model_max_length": backend.max_model_len,
            "vocab_size": tok.vocab_size}
