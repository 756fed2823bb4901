"""The parsers' one registry (pd_runtime/parsers/registry.py) against the names config and
`pd-runtime serve`'s flags accept: every name a deployment may set has its parser, and every
parser a name to set it by."""

from __future__ import annotations

import typing

from pd_runtime import serve_flags
from pd_runtime.config_router import RouterConfig
from pd_runtime.parsers import registry
from pd_runtime.parsers.tool_calls import FORMATS, CallReader

SWITCHES = {"auto", "none"}  # not parsers: pick the chat template's, or none


def _names(field: str) -> set[str]:
    return set(typing.get_args(RouterConfig.model_fields[field].annotation)) - SWITCHES


def test_every_configurable_parser_is_in_the_registry_and_back():
    assert _names("tool_call_parser") == set(registry.TOOL_CALL_PARSERS)
    assert _names("reasoning_parser") == set(registry.REASONING_PARSERS)
    assert set(serve_flags.TOOL_CALL_PARSERS.values()) - SWITCHES <= set(registry.TOOL_CALL_PARSERS)
    assert set(serve_flags.REASONING_PARSERS.values()) - SWITCHES <= set(registry.REASONING_PARSERS)


def test_the_json_reader_knows_every_format_it_is_named_for():
    named = {name for name, reader in registry.TOOL_CALL_READERS.items()
             if reader is CallReader}
    assert named | {"required"} == set(FORMATS)
