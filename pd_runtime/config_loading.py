"""Loads cluster YAML into the pydantic models of config.py with errors a person can act on:
each names the file, the dotted field (decode.engine.block_size) and its line.
"""

from __future__ import annotations

import difflib
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Optional

import yaml
from pydantic import BaseModel, ValidationError

from pd_runtime.config import (AutoscaleConfig, ClusterConfig, FieldValueError, RoutingConfig,
                               _dotted)

@dataclass(frozen=True)
class ConfigIssue:
    field: str  # dotted path, e.g. decode.engine.block_size; "" for the file as a whole
    line: Optional[int]  # 1-based line in the file
    reason: str


class ConfigError(ValueError):
    """A config file that does not validate; each issue names the field and its line."""

    def __init__(self, source: str, issues: list[ConfigIssue]):
        self.source = str(source)
        self.issues = list(issues)
        super().__init__("\n".join(
            f"{self.source}:{i.line or '?'}: {i.field + ': ' if i.field else ''}{i.reason}"
            for i in self.issues))

    field = property(lambda self: self.issues[0].field)
    line = property(lambda self: self.issues[0].line)
    reason = property(lambda self: self.issues[0].reason)


def load_cluster_config(path: str | Path) -> ClusterConfig:
    return parse_cluster_config(_read(path), source=str(path))


def parse_cluster_config(text: str, source: str = "<string>") -> ClusterConfig:
    data, root = _compose(text, source)
    return _validate(ClusterConfig, data, root, source, prefix=())


def load_routing_config(path: str | Path) -> RoutingConfig:
    """Only `router.routing` of a cluster file (defaults when absent): what the router reloads."""
    return parse_routing_config(_read(path), source=str(path))


def parse_routing_config(text: str, source: str = "<string>") -> RoutingConfig:
    return _parse_section(text, source, ("router", "routing"), RoutingConfig)


def load_autoscale_config(path: str | Path) -> AutoscaleConfig:
    """Only `planner.autoscale` of a cluster file (defaults when absent): what the autoscaler
    reloads (pd_runtime/workers/elastic.py)."""
    return _parse_section(_read(path), str(path), ("planner", "autoscale"), AutoscaleConfig)


def _parse_section(text: str, source: str, keys: tuple[str, ...], model):
    data, root = _compose(text, source)
    for depth, key in enumerate(keys):
        if key not in data or data[key] is None:
            return model()
        data = data[key]
        if not isinstance(data, dict):
            loc = keys[:depth + 1]
            raise ConfigError(source, [ConfigIssue(_dotted(loc), _line_of(root, loc),
                                                   "must be a mapping")])
    return _validate(model, data, root, source, prefix=keys)


def _read(path: str | Path) -> str:
    try:
        return Path(path).read_text()
    except OSError as error:
        raise ConfigError(str(path), [ConfigIssue("", None, f"cannot read: {error}")]) from None


def _compose(text: str, source: str) -> tuple[dict, yaml.Node]:
    """Data plus the node tree it came from: nodes carry the line of every key."""
    loader = yaml.SafeLoader(text)
    try:
        root = loader.get_single_node()
        # Before construction: it flattens `<<` merges into the nodes, overrides after them.
        duplicates = list(_duplicate_keys(root, ())) if root is not None else []
        data = loader.construct_document(root) if root is not None else None
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        line = mark.line + 1 if mark is not None else None
        reason = f"invalid YAML: {getattr(error, 'problem', None) or error}"
        raise ConfigError(source, [ConfigIssue("", line, reason)]) from None
    finally:
        loader.dispose()
    if duplicates:
        raise ConfigError(source, duplicates)
    if root is None:
        raise ConfigError(source, [ConfigIssue("", 1, "the file is empty; expected a mapping "
                                               "of sections (model, ray, prefill, decode, ...)")])
    if not isinstance(data, dict):
        raise ConfigError(source, [ConfigIssue("", root.start_mark.line + 1,
                                               "the top level must be a mapping of sections")])
    return data, root


def _duplicate_keys(node: yaml.Node, loc: tuple):
    # PyYAML keeps the last of two equal keys silently; an edit would then seem to do nothing.
    if isinstance(node, yaml.MappingNode):
        seen = set()
        for key, value in node.value:
            if key.value in seen and key.value != "<<":
                yield ConfigIssue(_dotted(loc + (key.value,)), key.start_mark.line + 1,
                                  "duplicate key")
            seen.add(key.value)
            yield from _duplicate_keys(value, loc + (key.value,))
    elif isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            yield from _duplicate_keys(item, loc + (index,))


def _validate(model: type[BaseModel], data: dict, root: yaml.Node, source: str, prefix: tuple):
    try:
        return model.model_validate(data)
    except ValidationError as error:
        issues = [_issue(model, e, root, prefix) for e in error.errors()]
        raise ConfigError(source, issues) from None


def _issue(model: type[BaseModel], error: dict, root: yaml.Node, prefix: tuple) -> ConfigIssue:
    loc, reason = tuple(error["loc"]), error["msg"]
    cause = (error.get("ctx") or {}).get("error")
    if isinstance(cause, FieldValueError):
        loc, reason = loc + cause.loc, cause.reason
    elif error["type"] == "extra_forbidden":
        allowed = _fields_at(model, loc[:-1])
        close = difflib.get_close_matches(str(loc[-1]), allowed, n=1)
        reason = "unknown field" + (f"; did you mean {close[0]!r}?" if close
                                    else f"; expected one of: {', '.join(allowed)}")
    elif error["type"] != "missing" and not isinstance(error.get("input"), (dict, list)):
        reason += f" (got {error.get('input')!r})"
    return ConfigIssue(_dotted(prefix + loc), _line_of(root, prefix + loc), reason)


def _fields_at(model: Any, loc: tuple) -> list[str]:
    """Field names of the model found at `loc` (through Optional, list and dict); [] if none."""
    for part in loc:
        model = _unwrap(model)
        if _is_model(model) and isinstance(part, str):  # else a list index or dict key: same type
            field = model.model_fields.get(part)
            model = field.annotation if field else None
    model = _unwrap(model)
    return list(model.model_fields) if _is_model(model) else []


def _unwrap(annotation: Any) -> Any:
    while typing.get_origin(annotation) in (typing.Union, list, dict, Annotated):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        annotation = args[-1] if typing.get_origin(annotation) in (list, dict) else args[0]
    return annotation


def _is_model(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def _line_of(root: yaml.Node, loc: tuple) -> int:
    """Line of the deepest key along `loc` that the file spells out."""
    node, line = root, root.start_mark.line + 1
    for part in loc:
        if isinstance(node, yaml.MappingNode):
            # The last match: it is the one the constructor keeps (overrides follow merges).
            match = next(((k, v) for k, v in reversed(node.value) if k.value == str(part)), None)
            if match is None:
                break
            line, node = match[0].start_mark.line + 1, match[1]
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int) and part < len(
                node.value):
            node = node.value[part]
            line = node.start_mark.line + 1
        else:
            break
    return line
