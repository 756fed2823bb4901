"""What every configuration model shares: strict parsing (unknown keys are errors) and the
error that names the offending field's path (config_loading.py turns it into file:line).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class _Strict(BaseModel):
    # Unknown keys are almost always typos in YAML; reject them with the field name.
    model_config = ConfigDict(extra="forbid")


def _dotted(loc: tuple) -> str:
    return "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc).lstrip(".")


class FieldValueError(ValueError):
    """A cross-field check failed at `loc`, a path relative to the model raising it, so a YAML
    error points at the offending field's line rather than at the section's."""

    def __init__(self, loc: tuple, reason: str):
        super().__init__(f"{_dotted(loc)}: {reason}")
        self.loc = tuple(loc)
        self.reason = reason
