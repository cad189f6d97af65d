"""Typed, strict configuration shared by every stage.

Unknown keys are rejected (a typo must never silently fall back to a default). A config's
version-relevant part serialises to canonical JSON and becomes part of its dataset's version;
fields that cannot change the output (progress bars, log levels) are declared with
`runtime_field()` and left out, so flipping them never invalidates cached datasets.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

_RUNTIME = "opd_runtime_only"


class StrictConfig(BaseModel):
    """Base for every config: unknown keys are errors, values are validated on assignment, and
    floats are finite (inf/NaN cannot be hashed into a version and break every stage)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


def runtime_field(default: Any, description: str) -> Any:
    """A field that does not change the stage's output, so it is not part of the version."""
    return Field(default, description=description, json_schema_extra={_RUNTIME: True})


def version_dict(cfg: BaseModel) -> dict[str, Any]:
    """The config as JSON data minus runtime-only fields (recursively): what the version hashes."""
    out: dict[str, Any] = {}
    for name, field in type(cfg).model_fields.items():
        extra = field.json_schema_extra
        if isinstance(extra, dict) and extra.get(_RUNTIME):
            continue
        value = getattr(cfg, name)
        out[name] = _jsonable(value)
    return out


def _jsonable(value: Any) -> Any:
    if isinstance(value, BaseModel):
        return version_dict(value)
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if hasattr(value, "__fspath__"):
        return str(value)
    return value
