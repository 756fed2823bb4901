"""A Backend that streams a fixed script of chunks (errors included), for testing how the HTTP
layer maps chunks and errors to responses without an engine behind it.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any, AsyncIterator, Optional

from pd_runtime.api import ChunkError, StreamChunk
from pd_runtime.config import TenantConfig


def token_chunk(text: str, token_id: int = 1, finished: bool = False) -> StreamChunk:
    return StreamChunk(token_ids=[token_id], text=text, finished=finished,
                       finish_reason="length" if finished else None, num_prompt_tokens=1,
                       num_cached_tokens=0, path="scripted")


def error(status: int, message: str = "scripted failure", **extra) -> StreamChunk:
    return StreamChunk(finished=True, finish_reason="error",
                       error=ChunkError("scripted", message, status, **extra))


class ScriptedBackend:
    def __init__(self, tokenizer, script: list[StreamChunk], is_ready: bool = True,
                 step_s: float = 0.0):
        self.model_name = "scripted"
        self.max_model_len = 128
        self.tokenizer = tokenizer
        self.sampling_defaults: dict = {}
        self.script = script
        self.is_ready = is_ready
        self.step_s = step_s
        self.closed: list[str] = []  # request ids whose stream the consumer closed early
        self.observed: list[dict] = []  # what the app reported through observe()

    def authenticate(self, api_key: Optional[str]) -> Optional[TenantConfig]:
        return None

    async def generate(self, request_id: str, prompt_ids: list[int], params, *,
                       priority: int = 0, tenant=None, deadline=None,
                       flex: bool = False, cache_salt=None) -> AsyncIterator[StreamChunk]:
        done = False
        try:
            for chunk in self.script:
                await asyncio.sleep(self.step_s)
                done = chunk.finished
                yield dataclasses.replace(chunk)
        finally:
            if not done:
                self.closed.append(request_id)

    def health(self) -> dict:
        return {"backend": "scripted"}

    def ready(self) -> bool:
        return self.is_ready

    def active_config(self) -> dict:
        return {"backend": "scripted"}

    def metrics_text(self) -> bytes:
        return b""

    def observe(self, event: str, **fields: Any) -> None:
        self.observed.append({"event": event, **fields})
