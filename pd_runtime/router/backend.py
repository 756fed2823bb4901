"""What the HTTP layer (pd_runtime/entrypoints/openai/app.py) needs from whatever serves the
requests behind it.

One implementation: pd_runtime/router/core.py (`PoolBackend`), over the Ray pools or over the same workers
in this process (pd_runtime/workers/local_pool.py, for tests and single-process runs).

The contract, written once here:
- `generate(request_id, prompt_ids, params, priority=, tenant=, cache_salt=)` (the request's
  prefix-cache salt, beside its tenant's) is an async generator of `StreamChunk`s
  (pd_runtime/api.py, where each field is written): `token_ids`, `text`, `finished`,
  `finish_reason`, `stop_reason`, `logprobs` (per new token
  `(logprob, {token_id: logprob}, rank)`, or None), `num_prompt_tokens`, `num_cached_tokens`,
  `path`. The last chunk has `finished` set. A failure is one chunk with `error` (a
  `ChunkError`: type, message, status, param, retry_after_s) and `finished` set, after which
  the generator ends; `status` is the HTTP status the router answers with (400 bad input, 429
  refused by admission (with retry_after_s), 503 no worker can serve, 500 a bug).
  `params` are SamplingParams keyword fields, already validated by the router.
- Ownership: if the consumer stops early (`aclose()`, or cancellation while it awaits a chunk),
  the backend cancels the request everywhere and frees its blocks; it never raises for that.
- `authenticate` raises BackendError(401) for a missing or wrong key when keys are configured,
  returns the tenant for a good key, and None when no keys are configured (anonymous).
- `observe(event, **fields)` (optional: the app skips it when absent) is told about HTTP-level
  events ("http_request" with path (the route template), method, status, latency_s,
  request_id) for the backend's metrics; it must be cheap and should not raise.
- Errors raised (not streamed) from `authenticate` or before `generate`'s first chunk must be
  BackendError (or subclasses) to get their status; any other exception is answered with 500.
"""

from __future__ import annotations

from typing import Any, AsyncIterator, Optional, Protocol, runtime_checkable

from pd_runtime.api import ChunkError, StreamChunk
from pd_runtime.config import TenantConfig
from pd_runtime.tokenizer import Tokenizer

# OpenAI error `type` by HTTP status, for errors that do not name their own.
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_error",
    503: "service_unavailable",
}


class BackendError(Exception):
    """An error the router answers with an OpenAI error body and this HTTP status."""

    def __init__(self, status: int, message: str, *, type: Optional[str] = None,
                 param: Optional[str] = None, code: Optional[str] = None,
                 retry_after_s: Optional[float] = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or ERROR_TYPES.get(status, "invalid_request_error")
        self.param = param
        self.code = code
        self.retry_after_s = retry_after_s

    @classmethod
    def from_chunk_error(cls, error: ChunkError) -> "BackendError":
        """The exception form of a chunk's `error`: a kind of the worker's own that is not the
        status's OpenAI type is kept as the `code`."""
        status = _as_status(error.status)
        kind = error.type
        code = kind if kind and kind != ERROR_TYPES.get(status) else None
        retry = error.retry_after_s
        if status == 429 and retry is None:
            retry = 1.0
        return cls(status, error.message or "request failed", param=error.param, code=code,
                   retry_after_s=retry)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def _as_status(value: Any) -> int:
    return value if isinstance(value, int) and 400 <= value <= 599 else 503


@runtime_checkable
class Backend(Protocol):
    model_name: str  # the served model id (GET /v1/models, the `model` field)
    max_model_len: int  # prompt + generated tokens must fit in this
    tokenizer: Tokenizer
    # Sampling fields a request leaves out take these (pd_runtime.sampling_defaults; {}: OpenAI's).
    sampling_defaults: dict

    def authenticate(self, api_key: Optional[str]) -> Optional[TenantConfig]: ...

    def generate(self, request_id: str, prompt_ids: list[int], params: dict, *, priority: int,
                 tenant: Optional[TenantConfig], deadline: Optional[float] = None,
                 flex: bool = False, cache_salt: Optional[str] = None, prepaid: bool = False
                 ) -> AsyncIterator[StreamChunk]: ...

    async def admit_tenant(self, tenant: Optional[TenantConfig], tokens: int
                           ) -> Optional[StreamChunk]: ...

    def health(self) -> dict: ...

    def ready(self) -> bool: ...

    def active_config(self) -> dict: ...

    async def reset_prefix_cache(self) -> dict: ...

    def worker_reports(self) -> dict: ...

    def host_report(self) -> dict: ...

    def metrics_text(self) -> bytes: ...

    def observe(self, event: str, **fields: Any) -> None: ...
