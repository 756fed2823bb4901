"""The plain dicts a worker streams per engine step, and the typed errors they carry.

Errors travel as data (not as Ray exceptions) so the router can map them to HTTP statuses.
"""

from __future__ import annotations

from typing import Optional

from pd_runtime.engine.errors import EngineOverloadedError, InvalidRequestError


def output_chunk(out, path: str) -> dict:
    """A chunk from an engine RequestOutput (duck-typed: this module stays torch-free)."""
    return {
        "request_id": out.request_id,
        "token_ids": list(out.new_token_ids),
        "text": out.new_text,
        "finished": out.finished,
        "finish_reason": out.finish_reason,
        "logprobs": out.new_logprobs,
        "num_prompt_tokens": out.num_prompt_tokens,
        "num_cached_tokens": out.num_cached_tokens,
        "path": path,
        "queue_s": getattr(out, "queue_s", None),
    }


def merge_chunks(into: dict, later: dict) -> dict:
    """`into` followed by `later`, as one chunk (consecutive outputs of one request)."""
    into["token_ids"] = into["token_ids"] + later["token_ids"]
    into["text"] = (into["text"] or "") + (later["text"] or "")
    if into["logprobs"] is not None or later["logprobs"] is not None:
        into["logprobs"] = (into["logprobs"] or []) + (later["logprobs"] or [])
    for key in ("finished", "finish_reason", "queue_s"):
        into[key] = later[key]
    return into


def error_chunk(exc: Exception, status: Optional[int] = None,
                retry_after_s: Optional[float] = None) -> dict:
    if isinstance(exc, EngineOverloadedError):
        kind, code = "overloaded", status or 429
        extra = {"retry_after_s": exc.retry_after_s}
    elif isinstance(exc, InvalidRequestError):
        kind, code = "invalid_request_error", status or 400
        extra = {"param": exc.param}
    else:
        kind, code = "unavailable", status or 503
        extra = {} if retry_after_s is None else {"retry_after_s": retry_after_s}
    return {"finished": True, "finish_reason": "error", "token_ids": [], "text": "",
            "error": {"type": kind, "message": str(exc), "status": code, **extra}}


class WorkerError(RuntimeError):
    """An error chunk turned back into an exception on the caller's side."""

    def __init__(self, error: dict):
        super().__init__(error.get("message", "worker error"))
        self.error = error
        self.status = error.get("status", 503)
