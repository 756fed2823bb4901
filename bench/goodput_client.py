"""One request of the goodput bench, streamed from /v1/completions and timed into its record:
send, first token, every chunk's gap and token count, refusal or error."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Optional

import httpx

from bench.goodput_workload import RequestSpec

REFUSAL_STATUSES = (429, 503)


@dataclass
class RequestRecord:
    index: int
    kind: str
    input_len: int
    output_len: int                  # asked for (max_tokens)
    scheduled_s: float               # times from the point's start
    sent_s: Optional[float] = None
    end_s: Optional[float] = None
    ttft_s: Optional[float] = None   # from sent_s
    e2e_s: Optional[float] = None    # for a refusal, the time to its status and body
    tpot_s: Optional[float] = None
    itl_s: list[float] = field(default_factory=list)   # one per content chunk after the first
    chunk_tokens: list[Optional[int]] = field(default_factory=list)  # when the chunk says
    output_tokens: int = 0
    status: Optional[int] = None
    outcome: str = "failed"          # completed | refused | failed
    retry_after: Optional[str] = None
    error: Optional[str] = None
    conversation: Optional[int] = None

    @property
    def lag_s(self) -> float:
        return self.sent_s - self.scheduled_s


def request_body(spec: RequestSpec, model: str, ignore_eos: bool) -> bytes:
    return json.dumps({"model": model, "prompt": spec.prompt, "max_tokens": spec.output_len,
                       "temperature": 0.0, "ignore_eos": ignore_eos, "stream": True,
                       "stream_options": {"include_usage": True}},
                      separators=(",", ":")).encode()


def _chunk_tokens(choice: dict) -> Optional[int]:
    if choice.get("token_ids"):
        return len(choice["token_ids"])
    logprobs = choice.get("logprobs")
    if isinstance(logprobs, dict) and logprobs.get("tokens"):
        return len(logprobs["tokens"])
    return None


async def _read_events(resp: httpx.Response, rec: RequestRecord, clock) -> tuple:
    """(time of the first content chunk, usage's completion_tokens), each None if unseen; the
    ITL and tokens of every content chunk go into `rec`, an error event into rec.error."""
    first = last = usage_tokens = None
    async for line in resp.aiter_lines():
        now = clock()
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            break
        event = json.loads(data)
        if event.get("error"):
            rec.error = f"error event: {json.dumps(event['error'])[:300]}"
            break
        if event.get("usage"):
            usage_tokens = event["usage"].get("completion_tokens")
        for choice in event.get("choices") or ():
            tokens = _chunk_tokens(choice)
            if not (choice.get("text") or tokens):
                continue
            if first is None:
                first = now
            else:
                rec.itl_s.append(now - last)
            last = now
            rec.chunk_tokens.append(tokens)
    return first, usage_tokens


async def stream_request(client: httpx.AsyncClient, url: str, body: bytes, rec: RequestRecord,
                         t0: float, ignore_eos: bool) -> RequestRecord:
    """Send one request and time its stream into `rec`; never raises for a server's answer."""
    clock = time.perf_counter
    sent = clock()
    rec.sent_s = sent - t0
    first = usage_tokens = None
    try:
        async with client.stream("POST", url, content=body) as resp:
            rec.status = resp.status_code
            if resp.status_code == 200:
                first, usage_tokens = await _read_events(resp, rec, clock)
            else:
                raw = await resp.aread()
                rec.retry_after = resp.headers.get("retry-after")
                rec.error = f"HTTP {resp.status_code}: {raw[:300].decode(errors='replace')}"
    except (httpx.HTTPError, OSError, ValueError) as exc:
        rec.error = f"{type(exc).__name__}: {exc}"
    end = clock()
    rec.end_s, rec.e2e_s = end - t0, end - sent
    if rec.status in REFUSAL_STATUSES:
        rec.outcome = "refused"
        return rec
    rec.output_tokens = usage_tokens if usage_tokens is not None else \
        sum(n or 1 for n in rec.chunk_tokens)
    if first is not None:
        rec.ttft_s = first - sent
        if rec.output_tokens > 1:
            rec.tpot_s = (rec.e2e_s - rec.ttft_s) / (rec.output_tokens - 1)
    if rec.error is None and first is None:
        rec.error = "no tokens"
    elif rec.error is None and ignore_eos and rec.output_tokens < rec.output_len:
        rec.error = f"{rec.output_tokens} of {rec.output_len} tokens with ignore_eos"
    rec.outcome = "completed" if rec.error is None else "failed"
    return rec
