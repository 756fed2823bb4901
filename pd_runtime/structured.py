"""Structured outputs: a request's output held to a JSON schema, a regular expression, a list
of choices or a grammar (vLLM's `structured_outputs` fields, OpenAI's `response_format`).

The spec travels in `SamplingParams.structured_outputs` as plain data, a dict with exactly one
of KINDS and any of OPTIONS; it is compiled here into an llguidance grammar, judged once where
the parameters are made (a bad schema, regex or grammar is a 400 naming the field), and each
engine enforces it token by token (engine/grammar.py). Torch-free: the router imports it.
"""

from __future__ import annotations

import copy
import functools
import json
from typing import Any

from pd_runtime.api import InvalidRequestError

KINDS = ("json", "regex", "choice", "grammar", "json_object")
# disable_fallback names a choice between backends; there is one here, so it changes nothing.
OPTIONS = ("disable_any_whitespace", "disable_additional_properties", "disable_fallback")
PARAM = "structured_outputs"
# Bounds the work a request can ask of the router and of each engine step.
MAX_SPEC_CHARS = 100_000
MAX_CHOICES = 1024
# Whitespace between JSON tokens: a run of spaces or tabs, or one line break and its
# indentation, at most 32 characters each. Whatever a formatter writes, but a model cannot
# fill max_tokens with blank lines, as it can where any run is allowed (vLLM's default).
# disable_any_whitespace: none at all.
JSON_WHITESPACE = r"(?:[\x20\x09]{1,32}|\x0D?\x0A[\x20\x09]{0,32})"


def check(spec: Any, param: str = PARAM) -> None:
    """Raises InvalidRequestError naming `param` (the client's field the spec came from)
    unless `spec` is a well-formed spec whose grammar compiles."""
    compile_grammar(spec, param)


def compile_grammar(spec: Any, param: str = PARAM) -> str:
    """The llguidance grammar of `spec` (what an LLMatcher is built from)."""
    def _bad(message: str):
        _refuse(message, param)

    if not isinstance(spec, dict):
        _bad(f"must be an object with one of {', '.join(KINDS)}, got {type(spec).__name__}")
    unknown = sorted(set(spec) - set(KINDS) - set(OPTIONS))
    if unknown:
        _bad(f"has no field {unknown[0]!r} here (one of {', '.join(KINDS)}, and the options "
             f"{', '.join(OPTIONS)})")
    kinds = [k for k in KINDS if spec.get(k) is not None and spec.get(k) is not False]
    if len(kinds) != 1:
        _bad(f"must give exactly one of {', '.join(KINDS)}, got "
             f"{', '.join(kinds) if kinds else 'none'}")
    for name in OPTIONS:
        if not isinstance(spec.get(name, False), bool):
            _bad(f"{name} must be a boolean")
    try:
        key = json.dumps(spec, sort_keys=True)
    except (TypeError, ValueError) as exc:
        _bad(f"is not plain JSON data: {exc}")
    if len(key) > MAX_SPEC_CHARS:
        _bad(f"is {len(key)} characters as JSON; at most {MAX_SPEC_CHARS}")
    return _compiled(key, param)


@functools.lru_cache(maxsize=256)
def _compiled(key: str, param: str) -> str:
    import llguidance

    def _bad(message: str):
        _refuse(message, param)

    spec = json.loads(key)
    kind = next(k for k in KINDS if spec.get(k) is not None and spec.get(k) is not False)
    value = spec[kind]
    matcher = llguidance.LLMatcher
    if kind in ("json", "json_object"):
        if kind == "json_object":
            if value is not True:
                _bad("json_object must be true")
            schema: Any = {"type": "object"}
        elif isinstance(value, str):
            try:
                schema = json.loads(value)
            except ValueError as exc:
                _bad(f"json is a string that is not JSON: {exc}")
        else:
            schema = value
        if not isinstance(schema, (dict, bool)):
            _bad(f"json must be a JSON schema (an object), got {type(schema).__name__}")
        if spec.get("disable_additional_properties"):
            schema = _closed(copy.deepcopy(schema))
        options = {"whitespace_flexible": False} if spec.get("disable_any_whitespace") \
            else {"whitespace_flexible": True, "whitespace_pattern": JSON_WHITESPACE}
        grammar = matcher.grammar_from_json_schema(schema, defaults=options)
    elif kind == "regex":
        if not isinstance(value, str):
            _bad("regex must be a string")
        grammar = matcher.grammar_from_regex(value)
    elif kind == "choice":
        if not (isinstance(value, list) and value and len(value) <= MAX_CHOICES
                and all(isinstance(c, str) and c for c in value)):
            _bad(f"choice must be a list of 1 to {MAX_CHOICES} non-empty strings")
        grammar = matcher.grammar_from_lark(
            "start: " + " | ".join(json.dumps(c) for c in value))
    else:
        if not isinstance(value, str) or not value.strip():
            _bad("grammar must be a non-empty string (Lark or GBNF)")
        try:
            grammar = llguidance.grammar_from("grammar", value)
        except ValueError as exc:
            _bad(f"grammar: {exc}")
    error = matcher.validate_grammar(grammar)
    if error:
        _bad(f"{kind} cannot be enforced: {error.strip()}")
    return grammar


def _closed(schema: Any) -> Any:
    """`schema` with additionalProperties false wherever an object schema leaves it out (vLLM's
    disable_additional_properties): only the properties it names may appear. Walks the
    keywords that hold subschemas, so a property that happens to be named "properties" or
    "type" is not taken for one."""
    if not isinstance(schema, dict):
        return schema
    for name in ("properties", "patternProperties", "$defs", "definitions"):
        if isinstance(schema.get(name), dict):
            for sub in schema[name].values():
                _closed(sub)
    for name in ("items", "additionalItems", "contains", "not", "if", "then", "else",
                 "additionalProperties"):
        _closed(schema.get(name))
    for name in ("prefixItems", "anyOf", "oneOf", "allOf", "items"):
        if isinstance(schema.get(name), list):
            for sub in schema[name]:
                _closed(sub)
    if (schema.get("type") == "object" or "properties" in schema) and \
            "additionalProperties" not in schema:
        schema["additionalProperties"] = False
    return schema


def _refuse(message: str, param: str):
    raise InvalidRequestError(f"{param}: {message}", param=param)
