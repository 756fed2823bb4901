"""One streamed completion over real HTTP (httpx), recorded as it arrives: status, error body
or error event, token strings, logprobs, text, times; bounded so a hang is seen, not waited on.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Optional

import httpx

from tests.chaos_support.workload import RequestSpec


@dataclass
class RequestResult:
    spec: RequestSpec
    cancel_after_tokens: Optional[int] = None  # the client closes the stream after this many
    sent_at: Optional[float] = None            # time.monotonic() of each event
    first_token_at: Optional[float] = None
    ended_at: Optional[float] = None
    status: Optional[int] = None
    response_id: Optional[str] = None          # X-Request-Id: the id in the router's log
    retry_after: Optional[str] = None
    error: Optional[dict] = None               # the OpenAI error object, from body or stream
    error_in_stream: bool = False
    broken: Optional[str] = None               # transport failure or a body that is no error
    tokens: list[str] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    text: str = ""
    finish_reason: Optional[str] = None
    done: bool = False                         # saw data: [DONE]
    hung: bool = False
    cancelled: bool = False
    token_times: list[float] = field(default_factory=list)
    label_class: Optional[str] = None          # set by classify
    detail: str = ""

    @property
    def ttft_s(self) -> Optional[float]:
        if self.first_token_at is None or self.sent_at is None:
            return None
        return self.first_token_at - self.sent_at

    @property
    def finished(self) -> bool:
        return self.ended_at is not None


def _error_object(payload) -> Optional[dict]:
    """The error object if `payload` is an OpenAI error body ({"error": {"message", "type"}})."""
    if isinstance(payload, dict) and isinstance(payload.get("error"), dict):
        err = payload["error"]
        if isinstance(err.get("message"), str) and err.get("type"):
            return err
    return None


async def _consume(client: httpx.AsyncClient, url: str, body: dict, r: RequestResult) -> None:
    async with client.stream("POST", url, json=body) as resp:
        r.status = resp.status_code
        r.response_id = resp.headers.get("x-request-id")
        r.retry_after = resp.headers.get("retry-after")
        if resp.status_code != 200:
            raw = await resp.aread()
            try:
                r.error = _error_object(json.loads(raw))
            except ValueError:
                r.error = None
            if r.error is None:
                r.broken = f"HTTP {resp.status_code} without an OpenAI error body: {raw[:200]!r}"
            return
        if r.cancel_after_tokens == 0:
            r.cancelled = True
            return
        async for line in resp.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            if data == "[DONE]":
                r.done = True
                return
            try:
                event = json.loads(data)
            except ValueError:
                r.broken = f"malformed stream event: {data[:200]!r}"
                return
            err = _error_object(event)
            if err is not None:
                r.error, r.error_in_stream = err, True
                continue  # [DONE] follows
            if "error" in event:
                r.broken = f"stream error event not in the OpenAI format: {data[:200]!r}"
                return
            for choice in event.get("choices") or []:
                lp = choice.get("logprobs") or {}
                new = lp.get("tokens") or []
                if new:
                    now = time.monotonic()
                    if r.first_token_at is None:
                        r.first_token_at = now
                    r.token_times.extend([now] * len(new))
                    r.tokens.extend(new)
                    r.logprobs.extend(float(x) for x in lp.get("token_logprobs") or [])
                r.text += choice.get("text") or ""
                if choice.get("finish_reason"):
                    r.finish_reason = choice["finish_reason"]
            if r.cancel_after_tokens is not None and len(r.tokens) >= r.cancel_after_tokens:
                r.cancelled = True
                return  # leaving the block closes the connection mid-stream
        if r.error is None:
            r.broken = "the stream ended without [DONE]"


async def send(client: httpx.AsyncClient, base_url: str, model: str, r: RequestResult,
               bound_s: float) -> RequestResult:
    """Stream `r.spec` and fill `r`; a request with no end within `bound_s` is marked hung."""
    r.sent_at = time.monotonic()
    try:
        await asyncio.wait_for(_consume(client, base_url + "/v1/completions",
                                        r.spec.body(model), r), bound_s)
    except asyncio.TimeoutError:
        r.hung = True
    except httpx.HTTPError as exc:
        r.broken = f"{type(exc).__name__}: {exc}"
    r.ended_at = time.monotonic()
    return r


def http_client(max_connections: int = 512) -> httpx.AsyncClient:
    # No client timeout: `send` bounds each request itself and calls an overrun a hang.
    return httpx.AsyncClient(timeout=httpx.Timeout(None),
                             limits=httpx.Limits(max_connections=max_connections,
                                                 max_keepalive_connections=64))
