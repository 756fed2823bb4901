"""OpenAI response bodies built from worker chunks: completion and chat.completion, their stream
chunks, logprobs in both formats (with token strings), and usage accounting.

One ResponseBuilder per HTTP request; it accumulates every choice, so streaming and not share it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Optional

from pd_runtime.api import StreamChunk
from pd_runtime.entrypoints.openai.request_parsing.protocol import PreparedRequest
from pd_runtime.parsers.harmony import HarmonyStream
from pd_runtime.parsers.reasoning import ThinkStream
from pd_runtime.parsers.registry import HARMONY, read_calls, reader, reasoning_splitter
from pd_runtime.parsers.tool_calls import CallReader
from pd_runtime.parsers.tool_calls_base import call_id


@dataclass
class _Choice:
    index: int
    prompt_index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)  # per token (logprob, {token_id: logprob})
    finish_reason: Optional[str] = None
    stop_reason: Any = None  # vLLM's: the stop string or stop token that ended it, else None
    num_cached_tokens: int = 0
    prompt_logprobs: Optional[list] = None  # echo with logprobs: per prompt position
    started: bool = False  # a stream event went out for it (chat: the role; completions: echo)
    calls: Optional[CallReader] = None  # chat with tools: its content and calls, read
    call_id: str = ""  # a named tool_choice's one call
    call_sent: bool = False  # its first delta (id and name) went out
    # A reasoning model's: its thinking split out (<think> blocks, or gpt-oss's harmony).
    think: Optional[ThinkStream | HarmonyStream] = None
    content_sent: int = 0  # with `think`: characters of the content streamed
    ids_sent: int = 0  # return_token_ids: how many of token_ids the stream has carried


class ResponseBuilder:
    stores = False  # a chat or completion run keeps no conversation (a Responses one may)

    def __init__(self, prepared: PreparedRequest, response_id: str, tokenizer):
        self.prepared = prepared
        self.id = response_id
        self.created = int(time.time())
        self.choices = [_Choice(c.index, c.prompt_index) for c in prepared.choices]
        self.tools = prepared.tools
        for choice in self.choices if self.tools is not None else ():
            if self.tools.mode == "named":
                choice.call_id = call_id(self.tools.short_ids)
            else:
                choice.calls = reader(self.tools)
        for choice in self.choices if prepared.reasoning is not None else ():
            choice.think = reasoning_splitter(prepared.reasoning)
        self._token_text = tokenizer.token_text
        # A logprob's token as shown: its text, or "token_id:N" (return_tokens_as_token_ids).
        self._shown = _as_token_id if prepared.tokens_as_ids else self._token_text

    # -- accumulation and streaming ----------------------------------------------------------
    def add(self, index: int, chunk: StreamChunk) -> Optional[dict]:
        """Record a worker chunk of choice `index`; returns the stream event it makes (None when
        it carries nothing a client would see, e.g. bytes held back by the detokenizer)."""
        choice = self.choices[index]
        token_ids = list(chunk.token_ids or [])
        text = chunk.text or ""
        entries = list(chunk.logprobs or []) if self.prepared.logprobs is not None else []
        offset = len(choice.text)
        prefix = ""
        if not choice.started and self.prepared.echo_texts is not None:
            prefix = self.prepared.echo_texts[choice.prompt_index]
            offset = len(prefix)
            choice.text = prefix
        choice.text += text
        choice.token_ids.extend(token_ids)
        choice.logprobs.extend(entries)
        choice.num_cached_tokens = max(choice.num_cached_tokens,
                                       int(chunk.num_cached_tokens or 0))
        if choice.prompt_logprobs is None and chunk.prompt_logprobs is not None:
            choice.prompt_logprobs = list(chunk.prompt_logprobs)
        if chunk.finished:
            choice.finish_reason = chunk.finish_reason or "stop"
            choice.stop_reason = chunk.stop_reason
        first = not choice.started
        choice.started = True
        if not (prefix or text or entries or choice.finish_reason or first):
            return None
        if prefix and choice.prompt_logprobs is not None:  # the echoed prompt's, then these
            logprobs = self._with_prompt(choice, token_ids[:len(entries)], entries)
        else:
            logprobs = self._logprobs(token_ids[:len(entries)], entries, offset) \
                if entries else None
        if self.prepared.kind == "chat":
            delta: dict[str, Any] = {"role": "assistant"} if first else {}
            self._chat_delta(choice, delta, text, first)
            if not (delta or logprobs or choice.finish_reason):
                return None  # all held back (a call's start)
            item = {"index": index, "delta": delta, "logprobs": logprobs,
                    "finish_reason": choice.finish_reason}
        else:
            item = {"index": index, "text": prefix + text, "logprobs": logprobs,
                    "finish_reason": choice.finish_reason}
        if choice.finish_reason is not None:
            item["stop_reason"] = choice.stop_reason
        body = self._envelope(self._chunk_object, [item], stream=True)
        if self.prepared.token_ids:  # the ids the events so far left out (held back text's too)
            if first:
                where = body if self.prepared.kind == "chat" else item
                where["prompt_token_ids"] = self.prepared.prompts[choice.prompt_index]
            item["token_ids"] = choice.token_ids[choice.ids_sent:]
            choice.ids_sent = len(choice.token_ids)
        return body

    def events(self, index: int, chunk: StreamChunk) -> tuple:
        """The stream events a worker chunk makes (pd_runtime/entrypoints/openai/generation.py's
        stream loop)."""
        payload = self.add(index, chunk)
        return () if payload is None else (payload,)

    def closing(self) -> list:
        """A stream's last events: the usage when asked for, then [DONE]."""
        return ([self.usage_event()] if self.prepared.include_usage else []) + ["[DONE]"]

    @staticmethod
    def failed(error, seq: Optional[int] = None) -> list:
        """A stream that fails after its first event ends with the error, then [DONE]."""
        return [error.body(), "[DONE]"]

    def usage_event(self) -> dict:
        """The last stream event when include_usage: no choices, the request's usage."""
        body = self._envelope(self._chunk_object, [], stream=True)
        body["usage"] = self.usage()
        return body

    # -- whole responses ---------------------------------------------------------------------
    def final_body(self) -> dict:
        items = []
        for choice in self.choices:
            entries = choice.logprobs if self.prepared.logprobs is not None else []
            start = len(self.prepared.echo_texts[choice.prompt_index]) \
                if self.prepared.echo_texts is not None else 0
            logprobs = None
            if self.prepared.logprobs is not None and self.prepared.echo_texts is not None \
                    and choice.prompt_logprobs is not None:  # echo: the prompt's, then these
                logprobs = self._with_prompt(choice, choice.token_ids[:len(entries)], entries)
            elif self.prepared.logprobs is not None:
                logprobs = self._logprobs(choice.token_ids[:len(entries)], entries, start)
            if self.prepared.kind == "chat":
                message, finish = self._message(choice)
                items.append({"index": choice.index, "logprobs": logprobs, "message": message,
                              "finish_reason": finish, "stop_reason": choice.stop_reason})
            else:
                items.append({"index": choice.index, "text": choice.text, "logprobs": logprobs,
                              "finish_reason": choice.finish_reason,
                              "stop_reason": choice.stop_reason})
                self._token_fields(choice, items[-1])
            if self.prepared.token_ids:
                items[-1]["token_ids"] = choice.token_ids
        body = self._envelope(self._object, items, stream=False)
        if self.prepared.kind == "chat" and self.choices:  # one prompt: the response's
            self._token_fields(self.choices[0], body)
        body["usage"] = self.usage()
        return body

    def _token_fields(self, choice: _Choice, into: dict) -> None:
        """vLLM's prompt_token_ids and prompt_logprobs, when asked: on each completion choice
        (a prompt of its own), at the top of a chat response."""
        if self.prepared.token_ids:
            into["prompt_token_ids"] = self.prepared.prompts[choice.prompt_index]
        if self.prepared.prompt_logprobs is not None:
            into["prompt_logprobs"] = self._prompt_logprobs(choice)

    def _message(self, choice: _Choice) -> tuple[dict, Optional[str]]:
        """A finished chat choice's message and finish reason: its thinking split out as
        `reasoning` (pd_runtime/parsers/reasoning.py), its calls read out of the content when it has
        tools: "tool_calls" when the model called under "auto" or "required"; a named
        function's call ends with the output's own reason (as OpenAI's)."""
        text, reasoning = choice.text, None
        if choice.think is not None:
            reasoning, text = choice.think.split(choice.text)
        message: dict[str, Any] = {"role": "assistant",
                                   "content": None if reasoning is not None and not text
                                   else text}
        if reasoning is not None:
            message["reasoning"] = reasoning
        finish = choice.finish_reason
        if self.tools is None:
            return message, finish
        if self.tools.mode == "named":
            message["content"] = None
            message["tool_calls"] = [self._named_call(choice, text)]
            return message, finish
        content, calls = read_calls(self.tools, self._call_source(choice, text))
        if calls:
            message["content"] = content
            message["tool_calls"] = calls
            finish = "tool_calls" if finish == "stop" else finish
        return message, finish

    def _chat_delta(self, choice: _Choice, delta: dict, text: str, first: bool) -> None:
        """A streamed chat delta: the thinking as `reasoning`, then the content (through
        _tool_delta with tools)."""
        content = choice.text
        if choice.think is not None:
            said, content = choice.think.feed(choice.text, choice.finish_reason is not None)
            if said:
                delta["reasoning"] = said
            text = content[choice.content_sent:]
            choice.content_sent = max(choice.content_sent, len(content))
        if self.tools is not None:
            self._tool_delta(choice, delta, content, text, first)
        elif text or first:
            delta["content"] = text

    def _call_source(self, choice: _Choice, content: str) -> str:
        """What the call reader reads: the content, or for harmony's calls the whole output
        (its calls are messages of their own beside the thinking and the answer)."""
        return choice.text if self.tools.parser == HARMONY else content

    def _named_call(self, choice: _Choice, arguments: str) -> dict:
        return {"id": choice.call_id, "type": "function",
                "function": {"name": self.tools.name, "arguments": arguments}}

    def _tool_delta(self, choice: _Choice, delta: dict, content: str, text: str,
                    first: bool) -> None:
        """With tools: a named call's arguments as they come; otherwise the content that
        cannot be a call's start, and each call as it is written (pd_runtime/parsers/tool_calls.py).
        `content`: all of it so far, `text`: what this chunk adds."""
        if self.tools.mode == "named":
            if not choice.call_sent:
                # At once, or for a reasoning model once its answer (the arguments) begins.
                if choice.think is None or text or choice.finish_reason is not None:
                    delta["tool_calls"] = [{"index": 0, **self._named_call(choice, text)}]
                    choice.call_sent = True
            elif text:
                delta["tool_calls"] = [{"index": 0, "function": {"arguments": text}}]
            return
        shown, calls = choice.calls.feed(self._call_source(choice, content),
                                         choice.finish_reason is not None)
        if calls:
            delta["tool_calls"] = calls
        if choice.finish_reason == "stop" and choice.calls.calls:
            choice.finish_reason = "tool_calls"
        if shown or first:
            delta["content"] = shown

    def usage(self) -> dict:
        prompt_tokens = sum(len(p) for p in self.prepared.prompts)
        completion_tokens = sum(len(c.token_ids) for c in self.choices)
        cached: dict[int, int] = {}  # a prompt's n choices share its prefix: count it once
        for c in self.choices:
            cached[c.prompt_index] = max(cached.get(c.prompt_index, 0), c.num_cached_tokens)
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
                "prompt_tokens_details": {"cached_tokens": sum(cached.values())}}

    # -- formats -----------------------------------------------------------------------------
    @property
    def _object(self) -> str:
        return "chat.completion" if self.prepared.kind == "chat" else "text_completion"

    @property
    def _chunk_object(self) -> str:
        return "chat.completion.chunk" if self.prepared.kind == "chat" else "text_completion"

    def _envelope(self, obj: str, choices: list, stream: bool) -> dict:
        body = {"id": self.id, "object": obj, "created": self.created,
                "model": self.prepared.model, "choices": choices}
        if self.prepared.service_tier is not None:  # as OpenAI: the tier that served it
            body["service_tier"] = self.prepared.service_tier
        if stream and self.prepared.include_usage:
            body["usage"] = None  # OpenAI: null on every chunk but the last
        return body

    def _logprobs(self, token_ids: list[int], entries: list, offset: int) -> dict:
        if self.prepared.kind == "chat":
            return {"content": [self._chat_entry(t, e) for t, e in zip(token_ids, entries)],
                    "refusal": None}
        text, shown = self._token_text, self._shown
        tokens, offsets = [], []
        for token in token_ids:
            tokens.append(shown(token))
            offsets.append(offset)
            offset += len(text(token))
        # None: a prompt's first token (echo), which nothing precedes to score it.
        return {"tokens": tokens,
                "token_logprobs": [None if e is None else float(e[0]) for e in entries],
                "top_logprobs": [None if e is None else
                                 {shown(int(k)): float(v) for k, v in e[1].items()}
                                 for e in entries],
                "text_offset": offsets}

    def _prompt_logprobs(self, choice: _Choice) -> Optional[list]:
        """vLLM's prompt_logprobs: per prompt position (None for the first, which nothing
        precedes) the prompt token's {logprob, rank, decoded_token}, then the top-n's, keyed
        by token id."""
        if choice.prompt_logprobs is None:
            return None
        prompt = self.prepared.prompts[choice.prompt_index]
        n, text = self.prepared.prompt_logprobs, self._token_text  # real text, as vLLM's
        out: list = []
        for token, entry in zip(prompt, choice.prompt_logprobs):
            if entry is None:
                out.append(None)
                continue
            logprob, top, rank = entry
            ranked = {str(token): {"logprob": float(logprob), "rank": int(rank),
                                   "decoded_token": text(token)}}
            for place, (other, value) in enumerate(list(top.items())[:n], start=1):
                ranked.setdefault(str(other), {"logprob": float(value), "rank": place,
                                               "decoded_token": text(int(other))})
            out.append(ranked)
        return out

    def _with_prompt(self, choice: _Choice, token_ids: list[int], entries: list) -> dict:
        """Completions with echo and logprobs: the prompt's tokens first (the first one has no
        logprob: nothing precedes it), then the generated ones; offsets from the token strings
        (a BOS has a string of its own there, not in the echoed text), as vLLM counts them."""
        prompt = self.prepared.prompts[choice.prompt_index]
        n = self.prepared.logprobs  # prompt_logprobs may have asked the engine for more
        scored = [e if e is None else (e[0], dict(list(e[1].items())[:n]))
                  for e in choice.prompt_logprobs]
        return self._logprobs(prompt + token_ids, scored + entries, 0)

    def _chat_entry(self, token: int, entry) -> dict:
        # bytes are the token's own text even where it is shown as "token_id:N" (as vLLM's);
        # the top_logprobs' are the shown strings' (as vLLM's, too)
        return {"token": self._shown(token), "logprob": float(entry[0]),
                "bytes": list(self._token_text(token).encode("utf-8", errors="replace")),
                "top_logprobs": [{"token": self._shown(int(k)), "logprob": float(v),
                                  "bytes": list(self._shown(int(k)).encode())}
                                 for k, v in entry[1].items()]}


def _as_token_id(token: int) -> str:
    return f"token_id:{token}"
