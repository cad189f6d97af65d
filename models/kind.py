"""What a drafter kind says about itself: its settings model, what it reads, and its `KindSpec`.

A kind is one package in models/ whose `__init__` exports `SPEC`: its strict settings model (a
`KindSettings` whose `kind` is the kind's name), what it reads of the target's states
(`Reads`), its drafter class and its capabilities. The registry (`models.drafters.KINDS`) is
built from the specs; the pipeline's `drafter` config section is the union of their settings
models on `kind`, and the CLI's choices, the features a run stores and every kind-specific
check read the spec, so no stage, command or benchmark names a kind.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field

OMITTED_WHEN_NONE = "opd_omitted_when_none"
"""Marks a field left out of a config's version while it is None (`optional_setting`)."""
_DEFAULT = "opd_default"  # what a setting left None means
_RECORDED_AS = "opd_recorded_as"  # the drafter config field that records a setting


def optional_setting(
    description: str, default: Any = None, *, recorded_as: str | None = None
) -> Any:
    """A kind's setting, declared once: opt-in (None in the config, so it is part of a version
    only when set and adding it leaves every existing version unchanged), `default` what None
    means, and `recorded_as` the field of the kind's saved drafter config that holds it (the
    setting's own name when None)."""
    extra = {OMITTED_WHEN_NONE: True, _DEFAULT: default, _RECORDED_AS: recorded_as}
    return Field(None, description=description, json_schema_extra=extra)


@dataclass(frozen=True)
class Reads:
    """What a kind reads of the target's states, so a run stores and computes nothing else.

    `target_layers`: how many of the target's intermediate layers (its aux layers,
    `target.aux_layer_ids`, strictly increasing, as many as this), 0 for none;
    `last_hidden`: the target's final (post-norm) state, which a trained kind's teacher is
    also computed from. Reads() reads nothing."""

    target_layers: int = 0
    last_hidden: bool = False

    def __post_init__(self) -> None:
        if self.target_layers < 0:
            raise ValueError(f"a kind reads >= 0 target layers, got {self.target_layers}")


EAGLE_READS = Reads(target_layers=3, last_hidden=True)
"""Three aux layers (low, mid, high) and the last hidden state: EAGLE-3's, and what a kind
that declares nothing reads (every dataset made before kinds declared it)."""


class KindSettings(BaseModel):
    """A kind's settings (the pipeline's `drafter` section when `kind` names it): unknown keys
    are errors, and a kind's own fields are `optional_setting`s, so a run that sets none hashes
    as `{"kind": ...}` alone. Subclasses declare `kind: Literal["<name>"] = "<name>"`."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    kind: str
    spec: ClassVar[KindSpec]  # set by the kind's spec
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

    def trained_depth(self) -> int:
        """The fewest unrolled training depths (`drafting.ttt_steps`) that train every part of
        a drafter of these settings (1: any)."""
        return 1

    def reads(self) -> Reads:
        """What a drafter of these settings reads of the target (the spec's, unless a setting
        changes it)."""
        return self.spec.reads

    @classmethod
    def _declared(cls) -> dict[str, dict[str, Any]]:
        return {
            name: info.json_schema_extra or {}
            for name, info in cls.model_fields.items()
            if name != "kind"
        }

    @classmethod
    def given(cls, settings: Mapping[str, Any]) -> dict[str, Any]:
        """Every setting's value: `settings` (by name, as `Drafter.new` takes them) over the
        declared defaults; an unknown name is refused in one line."""
        declared = cls._declared()
        unknown = sorted(set(settings) - set(declared))
        if unknown:
            title = cls.spec.title
            raise ValueError(
                f"unknown {title} drafter settings {unknown}; {title} takes {sorted(declared)}"
            )
        return {name: extra.get(_DEFAULT) for name, extra in declared.items()} | dict(settings)

    @classmethod
    def recorded(cls, config: Mapping[str, Any]) -> dict[str, Any]:
        """The settings a saved drafter config (`config.to_dict()`) was built with, by name; a
        config saved before a setting existed holds its default."""
        return {
            name: config.get(extra.get(_RECORDED_AS) or name, extra.get(_DEFAULT))
            for name, extra in cls._declared().items()
        }


@dataclass(frozen=True)
class KindSpec:
    """One drafter kind: its name, settings model, what it reads, drafter class and
    capabilities."""

    name: str
    title: str  # how messages name it ("EAGLE-3")
    settings: type[KindSettings]
    drafter: type  # a `models.drafter.Drafter` subclass
    reads: Reads = EAGLE_READS
    """What it reads of the target's states at its default settings (`KindSettings.reads`)."""
    drafts_blocks: bool = False
    """Whether a drafted token's distribution ignores the drafts before it (one block per
    forward): Draft-OPD then takes its block form (`models.losses.block_opd_loss`)."""
    export_formats: tuple[str, ...] = ()  # the first is the default; () exports nothing
    serve_method: str | None = None  # vLLM's `--speculative-config` "method"; None: not served
    objectives: Mapping[str, str] = field(default_factory=dict)
    """SFT objectives the kind trains besides its own default, by name -> label; the first is
    the default's own name (naming it is the same as leaving `sft.objective` unset)."""
    tree_note: str | None = None  # what the export says about serving draft trees
    export_note: str | None = None  # why a kind with no export format has none
    baseline: bool = False
    """The training-free kind every evaluation also decodes its prompts with (at most one):
    what a trained drafter's τ and speed-up are read against."""

    def __post_init__(self) -> None:
        # a drafter and its settings reach the kind's capabilities through their classes
        self.drafter.spec = self
        self.settings.spec = self

    def settings_of(self, values: Mapping[str, Any]) -> KindSettings:
        """`values` (a recorded drafter's settings, by name) as this kind's settings model."""
        return self.settings.model_validate({"kind": self.name, **values})
