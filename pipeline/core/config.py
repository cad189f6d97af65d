"""Typed, strict configuration shared by every stage.

Unknown keys are rejected (a typo must never silently fall back to a default). A config's
version-relevant part serialises to canonical JSON and becomes part of its dataset's version;
fields that cannot change the output (progress bars, log levels) are declared with
`runtime_field()` and left out, so flipping them never invalidates cached datasets.
"""

from __future__ import annotations

from typing import Annotated, Any, Union

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator

from models.drafters import DEFAULT_KIND, KINDS
from models.kind import OMITTED_WHEN_NONE, KindSettings

_RUNTIME = "opd_runtime_only"


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
    return Field(None, description=description, json_schema_extra={OMITTED_WHEN_NONE: True})


def version_dict(cfg: BaseModel) -> dict[str, Any]:
    """The config as JSON data minus runtime-only fields and unset `optional_field`s
    (recursively): what the version hashes."""
    out: dict[str, Any] = {}
    for name, field in type(cfg).model_fields.items():
        extra = field.json_schema_extra
        value = getattr(cfg, name)
        if isinstance(extra, dict) and (
            extra.get(_RUNTIME) or (extra.get(OMITTED_WHEN_NONE) and value is None)
        ):
            continue
        out[name] = _jsonable(value)
    return out


StopConfidence = Annotated[float, Field(ge=0.0, lt=1.0)]
"""A chain's stop threshold (models.drafter.ChainShape.stop_confidence): in [0, 1), since a
joint probability never exceeds 1 and a threshold of 1 would propose nothing."""


class TypicalAcceptance(StrictConfig):
    """Medusa's typical acceptance thresholds (`drafting.acceptance=typical`, lossy at T>0): a
    draft x passes when p(x) > min(epsilon, delta * exp(-H(p))) (models/verify.py). The defaults
    are Medusa's (posterior_threshold 0.09, posterior_alpha 0.3)."""

    epsilon: float = Field(0.09, gt=0.0, le=1.0)
    delta: float = Field(0.3, gt=0.0, le=1.0)


LOSSY_NOTE = "typical acceptance (drafting.acceptance=typical), not the target's law"
"""What every output showing the numbers of a lossy evaluation says about them."""


def is_lossy(meta: dict[str, Any]) -> bool:
    """Whether a dataset's numbers came from lossy verification (evaluate records
    `lossless: false` with typical acceptance at T>0)."""
    return meta.get("lossless") is False


class DraftTree(StrictConfig):
    """An EAGLE-2 dynamic draft tree (models/chain_propose.py). The defaults are EAGLE-2's
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


def _one_kind_settings(data: Any) -> Any:
    """The default kind where none is named; name the kind a setting belongs to when it is
    given for another (an extra key would only say it is not permitted)."""
    if not isinstance(data, dict):
        return data
    data = {"kind": DEFAULT_KIND, **data}  # a setting of the default kind needs no kind
    spec = KINDS.get(data["kind"])
    if spec is None:
        return data  # the union names the kinds there are
    for key in sorted(set(data) - set(spec.settings.model_fields)):
        owner = next((s for s in KINDS.values() if key in s.settings.model_fields), None)
        if owner is not None:
            raise ValueError(
                f"drafter.{key} is a {owner.title} setting; {spec.title} drafters do not take "
                f"it (drop it or set drafter.kind={owner.name})"
            )
    return data


DrafterConfig = Annotated[
    Union[tuple(spec.settings for spec in KINDS.values())],  # noqa: UP007 (built at runtime)
    Field(discriminator="kind"),
    BeforeValidator(_one_kind_settings),
]
"""Which drafter kind a run trains, and that kind's own settings: the union of the registered
kinds' settings models (`models.kind.KindSettings`) on `kind`, so a kind's settings are
declared once, in its package."""


def default_drafter() -> KindSettings:
    """The `drafter` section when none is given: the default kind with its defaults."""
    return KINDS[DEFAULT_KIND].settings()


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
