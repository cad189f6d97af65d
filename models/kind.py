"""What a drafter kind says about itself: its settings model and its `KindSpec`.

A kind is one package in models/ whose `__init__` exports `SPEC`: its strict settings model (a
`KindSettings` whose `kind` is the kind's name), its drafter class and its capabilities. The
registry (`models.drafters.KINDS`) is built from the specs; the pipeline's `drafter` config
section is the union of their settings models on `kind`, and the CLI's choices and every
kind-specific check read the spec, so no stage, command or benchmark names a kind.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field

OMITTED_WHEN_NONE = "opd_omitted_when_none"
"""Marks a field left out of a config's version while it is None (`optional_setting`)."""


def optional_setting(description: str) -> Any:
    """An opt-in setting (default None) that is part of a version only when set, so adding it
    leaves every dataset version computed without it unchanged."""
    return Field(None, description=description, json_schema_extra={OMITTED_WHEN_NONE: True})


class KindSettings(BaseModel):
    """A kind's settings (the pipeline's `drafter` section when `kind` names it): unknown keys
    are errors, and a kind's own fields are `optional_setting`s, so a run that sets none hashes
    as `{"kind": ...}` alone. Subclasses declare `kind: Literal["<name>"] = "<name>"`."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    kind: str
    depth_setting: ClassVar[str | None] = None
    """The setting that bounds `max_draft_depth` (what a user raises to draft deeper)."""

    def settings(self) -> dict[str, Any]:
        """The kind's settings that were set (what `Drafter.new` takes)."""
        return {
            name: getattr(self, name)
            for name in type(self).model_fields
            if name != "kind" and getattr(self, name) is not None
        }

    def max_draft_depth(self) -> int | None:
        """The most draft offsets a drafter of these settings proposes per step (None: no
        bound of its own; a chain drafter is bounded only by what it was trained for)."""
        return None


@dataclass(frozen=True)
class KindSpec:
    """One drafter kind: its name, settings model, drafter class and capabilities."""

    name: str
    title: str  # how messages name it ("EAGLE-3")
    settings: type[KindSettings]
    drafter: type  # a `models.drafter.Drafter` subclass
    drafts_blocks: bool = False
    """Whether a drafted token's distribution ignores the drafts before it (one block per
    forward): Draft-OPD then takes its block form (`models.losses.block_opd_loss`)."""
    export_formats: tuple[str, ...] = ()  # the first is the default; () exports nothing
    serve_method: str | None = None  # vLLM's `--speculative-config` "method"; None: not served
    objectives: Mapping[str, str] = field(default_factory=dict)
    """SFT objectives the kind trains besides its own default, by name -> label; the first is
    the default's own name (naming it is the same as leaving `sft.objective` unset)."""
    tree_note: str | None = None  # what the export says about serving draft trees
    baseline: bool = False
    """The training-free kind every evaluation also decodes its prompts with (at most one):
    what a trained drafter's τ and speed-up are read against."""

    def __post_init__(self) -> None:
        self.drafter.spec = self  # a drafter reaches its capabilities through its class

    def settings_of(self, values: Mapping[str, Any]) -> KindSettings:
        """`values` (a recorded drafter's settings, by name) as this kind's settings model."""
        return self.settings.model_validate({"kind": self.name, **values})
