"""Request bodies into PreparedRequests without stalling the event loop: the body is read against
its size limit, then prepared inline when small, or in a child process when large.

Why a process: JSON parsing, validation and tokenizing hold the GIL, so in a thread a 20 MB body
would still stall every other request (/health included) for seconds. Nothing on the way holds
the GIL for long either: the body goes to the child
(pd_runtime/entrypoints/openai/request_parsing/parser_process.py) through a temporary file written from a thread
(pickling 20 MB holds it for 30-100 ms; a file write releases it), the child gets the tokenizer once
and answers with prompts packed as arrays, and the event loop unpacks them a few prompts at a time.
"""

from __future__ import annotations

import asyncio
import copy
import functools
import logging
import multiprocessing
import os
import pickle
import tempfile
import threading
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Callable, Optional

from starlette.requests import ClientDisconnect, Request

from pd_runtime.entrypoints.openai.request_parsing import parser_process
from pd_runtime.entrypoints.openai.request_parsing.protocol import (PreparedRequest, is_token_ids, parse_json,
                                                    prepare_chat, prepare_completion)
from pd_runtime.entrypoints.openai.responses.request import NeedsHistory, prepare_responses
from pd_runtime.entrypoints.openai.request_parsing.schema import InvalidRequest
from pd_runtime.entrypoints.openai.streaming import ClientDisconnected
from pd_runtime.router.backend import Backend, BackendError

log = logging.getLogger(__name__)

# Bodies up to this size are prepared on the event loop (tokenizing 16 KB of text took 18-38 ms
# on the 2-core dev box, with the test and bench tokenizers); larger ones go to the child...
INLINE_MAX_BYTES = 8 * 1024
# ...unless their prompts are token ids, up to this size: nothing to tokenize, and parsing
# 256 KB of JSON numbers takes ~2 ms. (Through the child, each 2048-token prompt cost ~8 ms of
# thread and process hops, one at a time: 200 at once were refused in 1-2.3 s, not at once.)
INLINE_TOKEN_IDS_MAX_BYTES = 256 * 1024
_UNPACK_PROMPTS_PER_SLICE = 64

PREPARE: dict[str, Callable[..., PreparedRequest]] = {"completion": prepare_completion,
                                                      "chat": prepare_chat,
                                                      "responses": prepare_responses}


class Intake:
    """One per app: reads and prepares the generation requests of `backend`; `close()` stops
    the child process, if one was started."""

    def __init__(self, backend: Backend, max_body_bytes: int):
        self.backend = backend
        self.max_body_bytes = max_body_bytes
        self._tokenizer_state = _tokenizer_state(backend.tokenizer)
        self._pool: Optional[ProcessPoolExecutor] = None
        self._lock = threading.Lock()
        self.prepared_in_child = 0  # bodies handed to the child process
        self.prepared_inline_ids = 0  # large bodies of token-id prompts prepared inline

    async def read_body(self, request: Request) -> bytearray:
        """The whole body; 413 as soon as it is known to exceed the limit (declared length
        first, then bytes counted as they arrive, for chunked bodies)."""
        limit = self.max_body_bytes
        declared = request.headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > limit:
            raise _too_large(limit)
        body = bytearray()
        try:
            async for part in request.stream():
                body += part
                if len(body) > limit:
                    raise _too_large(limit)
        except ClientDisconnect:  # gone mid-body: a disconnect (499 in the logs), not a 500
            raise ClientDisconnected() from None
        return body

    async def prepare(self, kind: str, raw: bytearray,
                      history: Optional[bytes] = None) -> PreparedRequest:
        """`history`: a Responses request's stored conversation (NeedsHistory asks for it)."""
        backend = self.backend
        extra = {"history": history} if kind == "responses" else {}
        if len(raw) + len(history or b"") <= INLINE_MAX_BYTES or self._tokenizer_state is None:
            return PREPARE[kind](parse_json(raw), backend.tokenizer, backend.model_name,
                                 backend.max_model_len, backend.sampling_defaults, **extra)
        if kind == "completion" and len(raw) <= INLINE_TOKEN_IDS_MAX_BYTES:
            body = parse_json(raw)
            if _token_id_prompts(body.get("prompt")):
                self.prepared_inline_ids += 1
                return PREPARE[kind](body, backend.tokenizer, backend.model_name,
                                     backend.max_model_len, backend.sampling_defaults)
        self.prepared_in_child += 1
        loop = asyncio.get_running_loop()
        path = await loop.run_in_executor(None, _write_temporary, raw)
        pool = self._executor()
        try:
            # Submitting from a thread too: the first submit starts the child, and writing a
            # large tokenizer to a child still starting up would block the loop.
            future = await loop.run_in_executor(None, functools.partial(
                pool.submit, parser_process.prepare, kind, path, backend.model_name,
                backend.max_model_len, backend.sampling_defaults, history))
            outcome = await asyncio.wrap_future(future)
        except BrokenProcessPool:  # the child died (killed, out of memory): a new one next time
            self._discard(pool)
            raise BackendError(503, "the request parser process failed; retry",
                               code="parser_unavailable", retry_after_s=1.0) from None
        finally:
            os.unlink(path)
        if isinstance(outcome, tuple) and outcome[0] == "history":
            raise NeedsHistory(outcome[1])
        if isinstance(outcome, tuple):
            status, message, kind_, param, code = outcome
            raise BackendError(status, message, type=kind_, param=param, code=code)
        for i, packed in enumerate(outcome.prompts):
            outcome.prompts[i] = packed.tolist()
            if i % _UNPACK_PROMPTS_PER_SLICE == _UNPACK_PROMPTS_PER_SLICE - 1:
                await asyncio.sleep(0)
        return outcome

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)

    def _executor(self) -> ProcessPoolExecutor:
        with self._lock:
            if self._pool is None:
                # spawn: forking a process that runs threads (uvicorn, the engine, Ray) can
                # copy a lock held by another thread into the child.
                self._pool = ProcessPoolExecutor(
                    max_workers=1, mp_context=multiprocessing.get_context("spawn"),
                    initializer=parser_process.init, initargs=(self._tokenizer_state,))
            return self._pool

    def _discard(self, broken: ProcessPoolExecutor) -> None:
        with self._lock:
            if self._pool is broken:  # not a newer one another request has started since
                self._pool = None
        broken.shutdown(wait=False, cancel_futures=True)


def int_param(request: Request, name: str, default: int) -> int:
    """Query parameter `name` as an integer (`default` when absent); a 400 naming it."""
    value = request.query_params.get(name)
    if value is None:
        return default
    try:
        return int(value)
    except ValueError:
        raise InvalidRequest(f"{name} must be an integer", param=name) from None


def _write_temporary(data: bytearray) -> str:
    fd, path = tempfile.mkstemp(prefix="pd-router-body-")
    with open(fd, "wb") as file:
        file.write(data)
    return path


def _too_large(limit: int) -> BackendError:
    return BackendError(413, f"the body exceeds {limit} bytes (max_request_body_bytes)",
                        code="body_too_large")


def _tokenizer_state(tokenizer) -> Optional[bytes]:
    """The tokenizer pickled for the child, or None (then every body is prepared inline).
    State built lazily and not picklable (a compiled chat template) is left for the child to
    build again."""
    try:
        return pickle.dumps(tokenizer)
    except Exception:
        pass
    clone = copy.copy(tokenizer)
    for name, value in list(vars(clone).items()):
        try:
            pickle.dumps(value)
        except Exception:
            setattr(clone, name, None)
    try:
        return pickle.dumps(clone)
    except Exception:
        log.warning("the tokenizer cannot be sent to a parser process; large request bodies "
                    "will be parsed on the event loop", exc_info=True)
        return None


def _token_id_prompts(prompt) -> bool:
    """A completion prompt of token ids (one list of ints, or a list of them): no text."""
    return is_token_ids(prompt) or (isinstance(prompt, list) and bool(prompt)
                                    and all(is_token_ids(p) for p in prompt))
