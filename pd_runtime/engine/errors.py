"""Typed errors the engine raises; callers (router, workers) map them to HTTP statuses."""


class InvalidRequestError(ValueError):
    """Bad input from the user (maps to HTTP 400); `param` names the offending field."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class RequestTooLargeError(InvalidRequestError):
    """The request can never fit (prompt longer than max_model_len, or beyond the KV cache)."""


class EngineOverloadedError(RuntimeError):
    """Admission refused: the waiting queue is full (maps to HTTP 429 with Retry-After)."""

    def __init__(self, message: str, retry_after_s: float = 1.0):
        super().__init__(message)
        self.retry_after_s = retry_after_s
