"""The runtime's typed errors: a request's bad input, its refusal or its deadline (each maps to an
HTTP status) and a model directory we cannot serve. Part of the contract pd_runtime/api.py exports.
"""

from __future__ import annotations


class InvalidRequestError(ValueError):
    """Bad input from the user (maps to HTTP 400); `param` names the offending field."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class RequestTooLargeError(InvalidRequestError):
    """The request can never fit (prompt longer than max_model_len, or beyond the KV cache)."""


class ModelLoadError(ValueError):
    """A model directory we cannot serve; the message names the file and the field or tensor."""


class EngineOverloadedError(RuntimeError):
    """Admission refused: the waiting queue is full (maps to HTTP 429 with Retry-After)."""

    def __init__(self, message: str, retry_after_s: float = 1.0):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class DeadlineExceededError(RuntimeError):
    """The request's deadline passed before it finished (maps to HTTP 504)."""
