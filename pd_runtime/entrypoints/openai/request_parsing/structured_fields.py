"""The request fields that ask for structured outputs, read into one spec for
SamplingParams.structured_outputs (pd_runtime/structured.py): OpenAI's `response_format`
(json_object, json_schema), vLLM's `structured_outputs` object and its older `guided_json`,
`guided_regex`, `guided_choice` and `guided_grammar`. A request names at most one of them;
the spec is compiled here, so a bad schema, regex or grammar is a 400 naming the client's field.
"""

from __future__ import annotations

from typing import Any, Optional

from pd_runtime import structured
from pd_runtime.api import InvalidRequestError
from pd_runtime.entrypoints.openai.request_parsing.schema import InvalidRequest

_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
           "guided_grammar": "grammar"}
# vLLM's structured_outputs fields with no counterpart here, and the router's own.
_UNSUPPORTED = ("whitespace_pattern", "structural_tag", structured.THINK)


def structured_spec(data: dict) -> tuple[Optional[dict], Optional[str]]:
    """The spec the body asks for and the field it came from, or (None, None)."""
    found: list[tuple[dict, str]] = []
    fmt = data.get("response_format")
    if fmt is not None:
        spec = _response_format(fmt)
        if spec is not None:
            found.append((spec, "response_format"))
    for name, kind in _GUIDED.items():
        if data.get(name) is not None:
            found.append(({kind: data[name]}, name))
    value = data.get("structured_outputs")
    if value is not None:
        if isinstance(value, dict):
            for name in _UNSUPPORTED:
                if value.get(name) is not None:
                    raise InvalidRequest(f"structured_outputs.{name} is not supported by this "
                                         f"server", param="structured_outputs",
                                         code="unsupported_parameter")
        found.append((value, "structured_outputs"))
    if not found:
        return None, None
    if len(found) > 1:
        raise InvalidRequest(f"{found[1][1]}: a request may ask for one structured output; it "
                             f"also gives {found[0][1]}", param=found[1][1])
    spec, param = found[0]
    try:
        structured.check(spec, param)
    except InvalidRequestError as exc:
        raise InvalidRequest(str(exc), param=exc.param) from None
    return spec, param


def _response_format(fmt: Any) -> Optional[dict]:
    """OpenAI's response_format as a spec: text is none, json_object any JSON object,
    json_schema its schema (any JSON object when it gives none)."""
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        body = fmt.get("json_schema")
        if not isinstance(body, dict):
            raise InvalidRequest("response_format.json_schema must be an object with the "
                                 "schema", param="response_format")
        schema = body.get("schema")
        return {"json": schema} if schema is not None else {"json_object": True}
    raise InvalidRequest(f"response_format.type must be text, json_object or json_schema, got "
                         f"{kind!r}", param="response_format")
