"""The child process that prepares large request bodies for pd_runtime/entrypoints/openai/request_parsing/intake.py:
it lowers its own priority first, then imports the request schema and keeps the tokenizer it was
given.

This module imports nothing heavy at the top: a spawned child imports it before its
initializer runs, and those imports would otherwise compete with the serving process at full
priority.
"""

from __future__ import annotations

import os
import pickle
from array import array
from typing import Optional

_tokenizer = None


def init(tokenizer_state: bytes) -> None:
    global _tokenizer
    # Parsing a huge body is background work: when cores are short, the serving loop wins.
    os.nice(10)
    import pd_runtime.entrypoints.openai.request_parsing.protocol  # noqa: F401  (the schema, imported once at low priority)

    _tokenizer = pickle.loads(tokenizer_state)


def prepare(kind: str, body_path: str, model_name: str, max_model_len: int, defaults: dict,
            history: Optional[bytes] = None):
    """A PreparedRequest with array-packed prompts (unpickled without a per-int cost), or the
    fields of the error to answer with (an exception that needs keyword arguments does not
    survive pickling), or ("history", response id) when a Responses request continues a
    stored response whose conversation was not given."""
    from pd_runtime.router.backend import BackendError
    from pd_runtime.entrypoints.openai.request_parsing.protocol import parse_json, prepare_chat, prepare_completion
    from pd_runtime.entrypoints.openai.responses.request import NeedsHistory, prepare_responses

    with open(body_path, "rb") as file:
        raw = file.read()
    try:
        if kind == "responses":
            prepared = prepare_responses(parse_json(raw), _tokenizer, model_name,
                                         max_model_len, defaults, history)
        else:
            build = prepare_chat if kind == "chat" else prepare_completion
            prepared = build(parse_json(raw), _tokenizer, model_name, max_model_len, defaults)
    except NeedsHistory as need:
        return "history", need.response_id
    except BackendError as exc:
        return exc.status, exc.message, exc.type, exc.param, exc.code
    prepared.prompts = [array("q", prompt) for prompt in prepared.prompts]
    return prepared
