"""A Responses API response from the chat output (pd_runtime/entrypoints/openai/responses/request.py
made the chat request): the response object with its output items (reasoning, message,
function_call) and, streamed, the typed events OpenAI's clients accumulate: response.created, output
items added and done, text, reasoning and call-argument deltas, and response.completed (or
.incomplete at max_output_tokens).

The chat ResponseBuilder does the accumulating (detokenized text, the thinking split, tool
calls read back); this class only re-shapes what it gives. A stream's last event carries the
response whole, with the items as they were streamed.
"""

from __future__ import annotations

import json
import secrets
import time
from typing import Any, Optional

from pd_runtime.api import StreamChunk
from pd_runtime.entrypoints.openai.request_parsing.protocol import PreparedRequest
from pd_runtime.entrypoints.openai.completion_bodies import ResponseBuilder
from pd_runtime.entrypoints.openai.responses.request import ResponsesRequest
from pd_runtime.gateway.live_run import event_data, failed_events, split_events
from pd_runtime.router.backend import BackendError

_LIFECYCLE = (b"created", b"queued", b"in_progress", b"completed", b"incomplete", b"failed")


def _item_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


class ResponsesBuilder:
    """One Responses request's output (n is always 1), built the same way streamed or not:
    `events` per worker chunk (`add` for a JSON response, which keeps none of them),
    `closing` at the end, `final_body` the response it ended with."""

    def __init__(self, prepared: PreparedRequest, response_id: str, tokenizer,
                 request: ResponsesRequest):
        self.chat = ResponseBuilder(prepared, response_id, tokenizer)
        self.prepared = prepared
        self.id = response_id
        self.request = request
        self.tokenizer = tokenizer
        self.seq = 0
        self.items: list[dict] = []  # output items, in order
        self.open: Optional[dict] = None  # the one being streamed
        self.calls: dict[int, dict] = {}  # a streamed tool call's index -> its item
        # Logprobs by the output characters their chunk added: (start, end, entries).
        self.spans: list[tuple[int, int, list]] = []
        self.next_span = 0  # the first span not yet given to the text (or passed over)
        self.answer_start: Optional[int] = None  # where the answer starts in the output
        self.final: Optional[dict] = None  # the response the output ended with
        self.progressed = False  # response.in_progress is sent

    # -- the events --------------------------------------------------------------------------
    def add(self, index: int, chunk: StreamChunk) -> None:
        self.events(index, chunk)

    def events(self, index: int, chunk: StreamChunk) -> list[dict]:
        out = self.opening()
        before = len(self.chat.choices[index].text)
        payload = self.chat.add(index, chunk)
        if payload is None:
            return out
        choice = payload["choices"][0]
        delta = choice["delta"]
        if choice.get("logprobs") and self.request.logprobs:
            self.spans.append((before, len(self.chat.choices[index].text),
                               choice["logprobs"]["content"]))
        if delta.get("reasoning"):
            out += self._open("reasoning")
            self.open["content"][0]["text"] += delta["reasoning"]
            out.append(self._event("response.reasoning_text.delta", **self._at(),
                                   content_index=0, delta=delta["reasoning"]))
        if delta.get("content"):
            out += self._open("message")
            part = self.open["content"][0]
            part["text"] += delta["content"]
            logprobs = self._text_logprobs(part["text"])
            part["logprobs"] += logprobs
            out.append(self._event("response.output_text.delta", **self._at(),
                                   content_index=0, delta=delta["content"], logprobs=logprobs))
        for call in delta.get("tool_calls") or ():
            out += self._call_delta(call)
        if choice.get("finish_reason") is not None:
            out += self._close()
            if not self.items:  # nothing said: an empty message
                out += self._open("message") + self._close()
        return out

    def closing(self) -> list[dict]:
        """The last event: the response whole (response.completed, or .incomplete at
        max_output_tokens)."""
        out = self.opening()
        status = self._status()
        self.final = self.snapshot(status, self.items)
        return out + [self._event(f"response.{status}", response=self.final)]

    def failed(self, error: BackendError, seq: Optional[int] = None) -> list[dict]:
        """A stream that fails after its first event ends saying so: an error event, then
        response.failed with the items so far; numbered from `seq` (default: after every event
        built; a stream cut while it sent them gives what it sent)."""
        out = self.opening()
        return out + failed_events(self.seq if seq is None else seq + len(out),
                                   self.snapshot("in_progress", self.items), error)

    def final_body(self) -> dict:
        """A JSON response: the one its output ended with."""
        return self.final or self.closing()[-1]["response"]

    def opening(self) -> list[dict]:
        """The first events, each once: response.created and .in_progress. A background
        response is created `queued`, before the model's first token, which brings
        .in_progress (a poll in between reads `queued`)."""
        out = []
        if self.seq == 0:
            queued = self.request.background
            out.append(self._event("response.created",
                                   response=self.snapshot("queued" if queued else "in_progress")))
            if queued:
                return out  # .in_progress with the first token: this is called again then
        if not self.progressed:
            self.progressed = True
            out.append(self._event("response.in_progress", response=self.snapshot("in_progress")))
        return out

    def _call_delta(self, call: dict) -> list[dict]:
        out: list[dict] = []
        fn = call.get("function") or {}
        item = self.calls.get(call["index"])
        if item is None:
            out += self._close()
            item = self.calls[call["index"]] = {
                "type": "function_call", "id": _item_id("fc"), "call_id": call["id"],
                "name": fn.get("name"), "arguments": "", "status": "in_progress"}
            self.open = item
            self.items.append(item)
            out.append(self._event("response.output_item.added",
                                   output_index=len(self.items) - 1, item=dict(item)))
        if fn.get("arguments"):
            item["arguments"] += fn["arguments"]
            out.append(self._event("response.function_call_arguments.delta", **self._at(),
                                   delta=fn["arguments"]))
        return out

    def _open(self, kind: str) -> list[dict]:
        """Make an item of `kind` the open one (closing the one before): its added events."""
        if self.open is not None and self.open["type"] == kind:
            return []
        out = self._close()
        if kind == "reasoning":
            item = {"type": "reasoning", "id": _item_id("rs"), "summary": [],
                    "content": [_part("reasoning_text", "")], "status": "in_progress"}
        else:
            item = {"type": "message", "id": _item_id("msg"), "status": "in_progress",
                    "role": "assistant", "content": [_part("output_text", "")]}
        self.open = item
        self.items.append(item)
        out += [self._event("response.output_item.added", output_index=len(self.items) - 1,
                            item=dict(item, content=[])),
                self._event("response.content_part.added", **self._at(), content_index=0,
                            part=dict(item["content"][0]))]
        return out

    def _close(self) -> list[dict]:
        item, self.open = self.open, None
        if item is None:
            return []
        out: list[dict] = []
        at = {"item_id": item["id"], "output_index": self.items.index(item)}
        item["status"] = "completed"
        if item["type"] == "function_call":
            out.append(self._event("response.function_call_arguments.done", **at,
                                   name=item["name"], arguments=item["arguments"]))
        else:
            part = item["content"][0]
            if item["type"] == "message":
                part["logprobs"] += self._text_logprobs(part["text"], final=True)
                out.append(self._event("response.output_text.done", **at, content_index=0,
                                       text=part["text"], logprobs=part["logprobs"]))
            else:
                out.append(self._event("response.reasoning_text.done", **at, content_index=0,
                                       text=part["text"]))
            out.append(self._event("response.content_part.done", **at, content_index=0,
                                   part=dict(part)))
        out.append(self._event("response.output_item.done", output_index=at["output_index"],
                               item=dict(item)))
        return out

    def _text_logprobs(self, shown: str, final: bool = False) -> list[dict]:
        """The logprobs of the chunks whose characters are in the output text shown so far
        (`shown`): a chunk that added only thinking, its end tag or a call's text gives none
        (by where its characters fall in the output: the answer starts after the thinking;
        `final`: what the text never showed is passed over)."""
        if self.next_span >= len(self.spans):
            return []
        begin = self.answer_start
        if begin is None:
            choice = self.chat.choices[0]
            begin = self.answer_start = choice.think.content_start(choice.text) \
                if choice.think is not None else 0
            if begin is None:  # still thinking
                return []
        end = begin + len(shown)
        out = []
        while self.next_span < len(self.spans):
            start, stop, entries = self.spans[self.next_span]
            if start >= end and not (final and start == stop == end):
                break
            self.next_span += 1
            if stop > begin or start == stop == begin:
                out += [{"token": e["token"], "logprob": e["logprob"], "bytes": e["bytes"],
                         "top_logprobs": e["top_logprobs"]} for e in entries]
        return out

    def _at(self) -> dict:
        return {"item_id": self.open["id"], "output_index": len(self.items) - 1}

    def _event(self, kind: str, **fields: Any) -> dict:
        event = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return event

    # -- the response object -----------------------------------------------------------------
    def snapshot(self, status: str, items: Optional[list] = None) -> dict:
        """The response object in `status`, with these output items."""
        sampling = self.prepared.choices[0].params
        body = {"id": self.id, "object": "response", "created_at": self.chat.created,
                "status": status, "error": None, "incomplete_details": None,
                "model": self.prepared.model, "output": list(items or []),
                "temperature": sampling.temperature, "top_p": sampling.top_p,
                "store": self.request.store, **self.request.echo}
        if status in ("completed", "incomplete"):
            body["completed_at"] = int(time.time())
            body["usage"] = self.usage_body()
        else:
            body["usage"] = None
        if status == "incomplete":
            body["incomplete_details"] = {"reason": "max_output_tokens"}
        if self.prepared.service_tier is not None:
            body["service_tier"] = self.prepared.service_tier
        return body

    @property
    def stores(self) -> bool:
        return self.request.store

    def conversation(self) -> list[dict]:
        """The chat messages a later request's previous_response_id continues: this one's
        (earlier ones' included, instructions not), then its answer with its thinking (which
        the template writes back, or not, as for chat's `reasoning`)."""
        answer: dict = {"role": "assistant", "content": None}
        for item in self.items:  # as the client got them: its call ids
            if item["type"] == "message":
                answer["content"] = item["content"][0]["text"]
            elif item["type"] == "reasoning":
                answer["reasoning"] = item["content"][0]["text"]
            elif item["type"] == "function_call":
                answer.setdefault("tool_calls", []).append({
                    "id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}})
        return self.request.messages + [answer]

    def usage(self) -> dict:
        """In the chat form (what run records count)."""
        return self.chat.usage()

    def usage_body(self) -> dict:
        usage = self.chat.usage()
        return {"input_tokens": usage["prompt_tokens"],
                "input_tokens_details": usage["prompt_tokens_details"],
                "output_tokens": usage["completion_tokens"],
                "output_tokens_details": {"reasoning_tokens": self._reasoning_tokens()},
                "total_tokens": usage["total_tokens"]}

    def _status(self) -> str:
        return "incomplete" if self.chat.choices[0].finish_reason == "length" else "completed"

    def _reasoning_tokens(self) -> int:
        """The output tokens through the end of the thinking (all of them while it had not
        ended); 0 without thinking (none, or an empty block)."""
        choice = self.chat.choices[0]
        if choice.think is None or not choice.think.split(choice.text)[0]:
            return 0
        ids = choice.token_ids
        begin = choice.think.content_start(choice.text)
        if begin is None:
            return len(ids)
        skip = self.prepared.choices[0].params.skip_special_tokens  # (as the text was decoded)
        low, high = 1, len(ids)  # the shortest prefix whose text reaches the answer
        while low < high:
            mid = (low + high) // 2
            if len(self.tokenizer.decode(ids[:mid], skip_special_tokens=skip)) >= begin:
                high = mid
            else:
                low = mid + 1
        return high


def stored_body(output: tuple[str, bytes]) -> Optional[dict]:
    """A finished Responses run's response object from its kept output: the JSON body, or a
    stream's last event that carries the response."""
    kind, data = output
    return json.loads(data) if kind == "json" else latest_response(split_events(data))


def latest_response(events: list[bytes]) -> Optional[dict]:
    """The response object of the last lifecycle event (created, queued, in_progress, ...)
    among SSE `events`, found by their `event:` lines (a long output's deltas not parsed)."""
    for event in reversed(events):
        at = event.find(b"event: response.")
        if at >= 0 and event[at + 16:event.find(b"\n", at)] in _LIFECYCLE:
            payload = event_data(event)
            if isinstance(payload, dict) and isinstance(payload.get("response"), dict):
                return payload["response"]
    return None


def _part(kind: str, text: str) -> dict:
    if kind == "output_text":
        return {"type": kind, "text": text, "annotations": [], "logprobs": []}
    return {"type": kind, "text": text}
