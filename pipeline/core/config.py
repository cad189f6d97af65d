"""Typed, strict configuration shared by every stage.

Unknown keys are rejected (a typo must never silently fall back to a default). A config's
version-relevant part serialises to canonical JSON and becomes part of its dataset's version;
fields that cannot change the output (progress bars, log levels) are declared with
`runtime_field()` and left out, so flipping them never invalidates cached datasets.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

_RUNTIME = "opd_runtime_only"
_UNSET_OMITTED = "opd_omitted_when_none"


class StrictConfig(BaseModel):
    """Base for every config: unknown keys are errors, values are validated on assignment, and
    floats are finite (inf/NaN cannot be hashed into a version and break every stage)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


def runtime_field(default: Any, description: str) -> Any:
    """A field that does not change the stage's output, so it is not part of the version."""
    return Field(default, description=description, json_schema_extra={_RUNTIME: True})


def optional_field(description: str) -> Any:
    """An opt-in setting (default None) that is part of the version only when set, so adding it
    to a config leaves every dataset version computed without it unchanged."""
    return Field(None, description=description, json_schema_extra={_UNSET_OMITTED: True})


def version_dict(cfg: BaseModel) -> dict[str, Any]:
    """The config as JSON data minus runtime-only fields and unset `optional_field`s
    (recursively): what the version hashes."""
    out: dict[str, Any] = {}
    for name, field in type(cfg).model_fields.items():
        extra = field.json_schema_extra
        value = getattr(cfg, name)
        if isinstance(extra, dict) and (
            extra.get(_RUNTIME) or (extra.get(_UNSET_OMITTED) and value is None)
        ):
            continue
        out[name] = _jsonable(value)
    return out


StopConfidence = Annotated[float, Field(ge=0.0, lt=1.0)]
"""A chain's stop threshold (models.drafter.ChainShape.stop_confidence): in [0, 1), since a
joint probability never exceeds 1 and a threshold of 1 would propose nothing."""


class DraftTree(StrictConfig):
    """An EAGLE-2 dynamic draft tree (models/eagle3/propose.py). The defaults are EAGLE-2's
    (its EaModel: total_token=60, depth=5, top_k=10)."""

    depth: int = Field(5, ge=1)
    """Deepest node: drafter forwards per step, and the most tokens a step can accept."""
    top_k: int = Field(10, ge=1)
    """Children kept per expanded node, and nodes expanded per depth."""
    budget: int = Field(60, ge=1)
    """Tree nodes the target verifies per step (besides the last committed token)."""
    min_confidence: float = Field(0.0, ge=0.0, lt=1.0)
    """Stop expanding once no frontier node's joint drafter probability reaches it. 0 (EAGLE-2)
    always drafts `depth` levels; on a CPU, where the drafter's forwards are a large share of a
    step, a floor saves the levels the verifier would rarely accept."""

    @model_validator(mode="after")
    def _check(self) -> DraftTree:
        if self.budget < self.depth:
            raise ValueError(
                f"tree budget ({self.budget}) is smaller than its depth ({self.depth}): the "
                "tree could never reach that depth; raise drafting.tree.budget or lower "
                "drafting.tree.depth"
            )
        most = self.top_k + (self.depth - 1) * self.top_k**2
        if self.budget > most:
            raise ValueError(
                f"tree budget ({self.budget}) exceeds the {most} candidates depth {self.depth} "
                f"x top-k {self.top_k} drafts; lower drafting.tree.budget or raise top_k"
            )
        return self


MAX_BLOCK_SIZE = 128
"""A DFlash block's static bound: 8x the largest block the public DFlash recipes train (8-16),
since a block's training activations and attention grow with it at every anchor (a block of
100,000 grew the process to 17 GB before it was killed); the target's positions bound it too."""


class DrafterConfig(StrictConfig):
    """Which drafter kind a run trains, and that kind's own settings (each None = the kind's
    default, documented where the kind defines it: models/dflash/model.py)."""

    kind: Literal["eagle3", "dflash"] = "eagle3"
    """eagle3: one layer drafting a chain, a forward per draft; dflash: a block drafted in one
    forward (models/dflash)."""
    # The bounds are checked before any work (the upper ones that depend on the target, as the
    # target's positions, layers and vocab, by `Drafter.check_settings` when the target loads).
    block_size: Annotated[int, Field(ge=2, le=MAX_BLOCK_SIZE)] | None = optional_field(
        "dflash: anchor + drafted slots per block (>= 2)"
    )
    layers: Annotated[int, Field(ge=1)] | None = optional_field("dflash: decoder layers")
    anchors: Annotated[int, Field(ge=1)] | None = optional_field(
        "dflash: training anchors per sequence (at most)"
    )
    mask_token_id: Annotated[int, Field(ge=0)] | None = optional_field(
        "dflash: the mask slots' token id (default: the target's pad token, else its last id)"
    )
    head: Literal["draft", "target"] | None = optional_field(
        "dflash: draft (default), a trained head over the features' draft vocab; target, the "
        "target's own lm_head, frozen, over the full vocab"
    )

    @model_validator(mode="after")
    def _check(self) -> DrafterConfig:
        given = sorted(k for k, v in self.settings().items() if v is not None)
        if self.kind == "eagle3" and given:
            raise ValueError(
                f"drafter.{given[0]} is a DFlash setting; EAGLE-3 drafters size themselves from "
                "the target (drop it or set drafter.kind=dflash)"
            )
        return self

    def settings(self) -> dict[str, Any]:
        """The kind's settings that were set (what `Drafter.new` takes)."""
        names = ("block_size", "layers", "anchors", "mask_token_id", "head")
        return {n: getattr(self, n) for n in names if getattr(self, n) is not None}


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
