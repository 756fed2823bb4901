"""Structured outputs: a request's output held to a JSON schema, a regular expression, a list
of choices or a grammar (vLLM's `structured_outputs` fields, OpenAI's `response_format`).

The spec travels in `SamplingParams.structured_outputs` as plain data, a dict with exactly one
of KINDS and any of OPTIONS; it is compiled here into an llguidance grammar, judged once where
the parameters are made (a bad schema, regex or grammar is a 400 naming the field), and each
engine enforces it token by token (engine/sampling/grammar.py). Torch-free: the router imports it.
"""

from __future__ import annotations

import copy
import functools
import json
import threading
from typing import Any

from pd_runtime.errors import InvalidRequestError

KINDS = ("json", "regex", "choice", "grammar", "json_object")
# disable_fallback names a choice between backends; there is one here, so it changes nothing.
OPTIONS = ("disable_any_whitespace", "disable_additional_properties", "disable_fallback")
# Set by the router for a reasoning model (not a client's field): the grammar holds only the
# answer after the model's think block, which the prompt opened ("open") or the output may open
# ("optional"), as vLLM starts a grammar after the reasoning (engine/sampling/grammar.py: the tags are
# found by their token ids, never put in the grammar: tokenizers make them added tokens); or,
# for gpt-oss ("harmony"), the final channel's message, after its header's tokens.
THINK = "think"
THINK_MODES = ("open", "optional", "harmony")
THINK_START, THINK_END = "<think>", "</think>"
# Where gpt-oss's answer begins: `<|channel|>final`, maybe ` <|constrain|>json`, `<|message|>`
# (within HARMONY_HEADER_TOKENS tokens, not past a message's end or start).
HARMONY_ANSWER = ("<|channel|>", "final", "<|message|>")
HARMONY_HEADER_TOKENS = 20


def think_tag_ids(tokenizer) -> "tuple[int, int] | None":
    """(<think>, </think>) as the tokenizer's own tokens, or None where either is spelled in
    several (then the tags cannot be told from text the answer may hold: no `think`)."""
    ids = [tokenizer.encode(tag, add_special_tokens=False) for tag in (THINK_START, THINK_END)]
    return (ids[0][0], ids[1][0]) if all(len(i) == 1 for i in ids) else None


def harmony_answer_ids(tokenizer) -> "tuple[tuple[int, ...], int, tuple[int, ...]] | None":
    """The final channel's header as gpt-oss's tokenizer spells it: (`<|channel|>final`'s
    tokens, `<|message|>`'s token, the tokens no header passes: `<|end|>`, `<|start|>`), or
    None where its markers are not tokens of their own."""
    ids = [tokenizer.encode(t, add_special_tokens=False)
           for t in (*HARMONY_ANSWER, "<|end|>", "<|start|>")]
    if any(len(ids[i]) != 1 for i in (0, 2, 3, 4)):
        return None
    return tuple(ids[0] + ids[1]), ids[2][0], (ids[3][0], ids[4][0])
PARAM = "structured_outputs"
# Bounds the work a request can ask of the router and of each engine step.
MAX_SPEC_CHARS = 100_000
MAX_CHOICES = 1024
MAX_DEPTH = 256  # nesting of the spec's data
BIG_STACK_BYTES = 256 << 20
_STACK_LOCK = threading.Lock()  # threading.stack_size is process-wide
# Whitespace between JSON tokens: a run of spaces or tabs, or one line break and its
# indentation, at most 32 characters each. Whatever a formatter writes, but a model cannot
# fill max_tokens with blank lines, as it can where any run is allowed (vLLM's default).
# disable_any_whitespace: none at all.
JSON_WHITESPACE = r"(?:[\x20\x09]{1,32}|\x0D?\x0A[\x20\x09]{0,32})"


def check(spec: Any, param: str = PARAM) -> None:
    """Raises InvalidRequestError naming `param` (the client's field the spec came from)
    unless `spec` is a well-formed spec whose grammar compiles."""
    compile_grammar(spec, param)


class _Refused(ValueError):
    """A spec this module refuses; compile_grammar names the client's field."""


def compile_grammar(spec: Any, param: str = PARAM) -> str:
    """The llguidance grammar of `spec` (what an LLMatcher is built from)."""
    try:
        return _grammar(spec)
    except _Refused as exc:
        raise InvalidRequestError(f"{param}: {exc}", param=param) from None


def _grammar(spec: Any) -> str:
    if not isinstance(spec, dict):
        raise _Refused(f"must be an object with one of {', '.join(KINDS)}, got "
                       f"{type(spec).__name__}")
    unknown = sorted(set(spec) - set(KINDS) - set(OPTIONS) - {THINK})
    if unknown:
        raise _Refused(f"has no field {unknown[0]!r} here (one of {', '.join(KINDS)}, and the "
                       f"options {', '.join(OPTIONS)})")
    kinds = _kinds(spec)
    if len(kinds) != 1:
        raise _Refused(f"must give exactly one of {', '.join(KINDS)}, got "
                       f"{', '.join(kinds) if kinds else 'none'}")
    for name in OPTIONS:
        if not isinstance(spec.get(name, False), bool):
            raise _Refused(f"{name} must be a boolean")
    if spec.get(THINK) not in (None, *THINK_MODES):
        raise _Refused(f"{THINK} must be one of {', '.join(THINK_MODES)}")
    spec = {k: v for k, v in spec.items() if k != THINK}  # the grammar is the answer's
    _check_depth(spec)
    try:
        # Not sort_keys: a schema's property order is the order its output follows.
        key = json.dumps(spec)
    except (TypeError, ValueError) as exc:
        raise _Refused(f"is not plain JSON data: {exc}") from None
    if len(key) > MAX_SPEC_CHARS:
        raise _Refused(f"is {len(key)} characters as JSON; at most {MAX_SPEC_CHARS}")
    return _compiled(key)


def _kinds(spec: dict) -> list[str]:
    return [k for k in KINDS if spec.get(k) is not None
            and not (k == "json_object" and spec.get(k) is False)]


def _check_depth(value: Any) -> None:
    """Refuses data nested deeper than MAX_DEPTH, before anything recurses into it."""
    stack = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise _Refused(f"is nested more than {MAX_DEPTH} levels deep")
        if isinstance(item, dict):
            stack.extend((v, depth + 1) for v in item.values())
        elif isinstance(item, list):
            stack.extend((v, depth + 1) for v in item)


def on_big_stack(fn, *args):
    """fn(*args) on a thread with a stack of BIG_STACK_BYTES (reserved, not committed): a
    grammar's rules are parsed recursively, and a long chain of them (thousands, within
    MAX_SPEC_CHARS) overflows a default stack, which kills the process."""
    out: list = []

    def run():
        try:
            out.append((True, fn(*args)))
        except BaseException as exc:  # handed to the caller
            out.append((False, exc))

    with _STACK_LOCK:
        previous = threading.stack_size(BIG_STACK_BYTES)
        try:
            thread = threading.Thread(target=run, name="grammar", daemon=True)
            thread.start()
        finally:
            threading.stack_size(previous)
    thread.join()
    ok, value = out[0]
    if not ok:
        raise value
    return value


@functools.lru_cache(maxsize=256)
def _compiled(key: str) -> str:
    import llguidance

    spec = json.loads(key)
    kind = _kinds(spec)[0]
    value = spec[kind]
    matcher = llguidance.LLMatcher
    if kind in ("json", "json_object"):
        if kind == "json_object":
            if value is not True:
                raise _Refused("json_object must be true")
            schema: Any = {"type": "object"}
        elif isinstance(value, str):
            try:
                schema = json.loads(value, parse_constant=_no_constant)
            except (ValueError, RecursionError) as exc:
                raise _Refused(f"json is a string that is not a JSON schema: {exc}") from None
            _check_depth(schema)
        else:
            schema = value
        if schema is True:  # JSON Schema's "anything"
            schema = {}
        if schema is False:
            raise _Refused("json is the schema false, which nothing matches")
        if not isinstance(schema, dict):
            raise _Refused(f"json must be a JSON schema (an object), got "
                           f"{type(schema).__name__}")
        if spec.get("disable_additional_properties"):
            schema = _closed(copy.deepcopy(schema))
        options = {"whitespace_flexible": False} if spec.get("disable_any_whitespace") \
            else {"whitespace_flexible": True, "whitespace_pattern": JSON_WHITESPACE}
        try:
            grammar = matcher.grammar_from_json_schema(schema, defaults=options)
        except ValueError as exc:
            raise _Refused(f"json cannot be enforced: {exc}") from None
    elif kind == "regex":
        if not isinstance(value, str):
            raise _Refused("regex must be a string")
        grammar = matcher.grammar_from_regex(value)
    elif kind == "choice":
        if not (isinstance(value, list) and value and len(value) <= MAX_CHOICES
                and all(isinstance(c, str) and c for c in value)):
            raise _Refused(f"choice must be a list of 1 to {MAX_CHOICES} non-empty strings")
        grammar = matcher.grammar_from_lark(
            "start: " + " | ".join(json.dumps(c) for c in value))
    else:
        if not isinstance(value, str) or not value.strip():
            raise _Refused("grammar must be a non-empty string (Lark or GBNF)")
        try:
            grammar = llguidance.grammar_from("grammar", value)
        except (ValueError, RecursionError) as exc:
            raise _Refused(f"grammar: {exc}") from None
    error = on_big_stack(matcher.validate_grammar, grammar)
    if error:
        raise _Refused(f"{kind} cannot be enforced: {error.strip()}")
    return grammar


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON value")


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
