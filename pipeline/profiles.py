"""The whole pipeline's config: one typed section per stage, named profiles, overrides.

A profile is a JSON file in pipeline/profiles/ holding only what differs from the defaults;
`--config FILE` (JSON) is applied over it and `--set a.b=value` last. Unknown keys anywhere
are errors that name the key. A profile's `kinds` section holds, per drafter kind, what differs
for that student (say DFlash's SFT learning rate): it applies over the profile when the final
config's `drafter.kind` is that kind, under `--config` and `--set`, which still win.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, TypeAdapter, ValidationError, create_model, model_validator

from models.drafters import DEFAULT_KIND, KINDS
from pipeline.core.config import (
    DrafterConfig,
    DraftTree,
    StopConfidence,
    StrictConfig,
    TypicalAcceptance,
    default_drafter,
    optional_field,
)
from pipeline.core.featurize import hidden_columns
from pipeline.core.targets import TargetConfig
from pipeline.stages import STAGES
from storage import OpdError

PROFILE_DIR = Path(__file__).resolve().parent / "profiles"
KINDS_KEY = "kinds"


class DraftingConfig(StrictConfig):
    """How the drafter drafts: one K for every stage and the export."""

    k: int = Field(6, ge=1)
    """Drafted tokens per verify step, as the drafter will serve (vLLM's
    `num_speculative_tokens`): rollout and evaluate decode with it, score replays K tokens,
    and the training stages measure their simulated tau over K steps."""
    ttt_steps: int = Field(7, ge=1)
    """Unrolled steps of SFT's training-time test. EAGLE-3 trains one step deeper than it
    usually serves (7 vs K = 6), so the K-th draft is trained on inputs as off-policy as it
    meets; it must be >= k."""
    tree: DraftTree | None = optional_field(
        "Decode on EAGLE-2 dynamic draft trees instead of K-chains in evaluate and rollout (and "
        "replay tree.depth tokens in score); off by default, so chain datasets keep their versions"
    )
    stop_confidence: StopConfidence | None = optional_field(
        "End a chain's drafting once the drafter's joint confidence in its drafts falls below "
        "this (fewer drafter forwards, a shorter verify; lossless) in rollout and evaluate; "
        "unset: always K drafts, so datasets made without it keep their versions"
    )

    acceptance: Literal["lossless", "typical"] | None = optional_field(
        "How verification accepts drafts in evaluate: lossless (unset: the target's law at "
        "every temperature) or typical, Medusa's typical acceptance, which is LOSSY at T>0 "
        "(opt-in, flagged in every result; rollout and score refuse it)"
    )
    typical: TypicalAcceptance | None = optional_field(
        "typical acceptance's thresholds (unset: Medusa's epsilon 0.09, delta 0.3); only with "
        "drafting.acceptance=typical"
    )

    @model_validator(mode="after")
    def _check(self) -> DraftingConfig:
        if self.typical is not None and self.acceptance != "typical":
            raise ValueError(
                "drafting.typical sets typical acceptance's thresholds: add "
                "drafting.acceptance=typical (or drop drafting.typical)"
            )
        if self.ttt_steps < self.k:
            raise ValueError(
                f"drafting.ttt_steps ({self.ttt_steps}) must be >= drafting.k ({self.k}): "
                "SFT must train every position the drafter serves"
            )
        if self.tree is not None and self.stop_confidence is not None:
            raise ValueError(
                "drafting.stop_confidence stops chains; a tree stops expanding at "
                "drafting.tree.min_confidence: set that one instead"
            )
        if self.tree is not None and self.ttt_steps < self.tree.depth:
            raise ValueError(
                f"drafting.ttt_steps ({self.ttt_steps}) must be >= drafting.tree.depth "
                f"({self.tree.depth}): SFT must train every depth the tree drafts"
            )
        return self


class _PipelineBase(StrictConfig):
    target: TargetConfig = TargetConfig()
    drafting: DraftingConfig = DraftingConfig()
    drafter: DrafterConfig = Field(default_factory=default_drafter)
    """The drafter kind the warm-up trains (later stages read the kind its dataset records)."""
    rounds: int = Field(2, ge=0)
    """Draft-OPD rounds (rollout -> score -> opd) after the SFT warm-up in the `full` chain."""

    @model_validator(mode="before")
    @classmethod
    def _k_lives_in_drafting(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        for stage in STAGES:
            section = data.get(stage.name)
            if isinstance(section, dict):
                for name, source in stage.drafting.items():
                    if name in section:
                        raise ValueError(
                            f"{stage.name}.{name} is set once for every stage as "
                            f"drafting.{source}: use --set drafting.{source}={section[name]}"
                        )
        return data

    @model_validator(mode="after")
    def _read_what_the_kind_reads(self) -> _PipelineBase:
        # The target captures as many aux layers as the kind reads (a kind that reads none
        # leaves them as they are: the target's identity, and so every version, stays).
        count = self.drafter.reads().target_layers
        if count and count != self.target.aux_count:
            if self.target.aux_layers is not None:
                raise ValueError(
                    f"target.aux_layers={self.target.aux_layers}, but a "
                    f"{self.drafter.spec.title} drafter reads {count} target layers: drop "
                    "target.aux_layers (it follows the drafter.* settings)"
                )
            tied = TargetConfig.model_validate(self.target.model_dump() | {"aux_layers": count})
            object.__setattr__(self, "target", tied)
        return self

    @model_validator(mode="after")
    def _tie_drafting(self) -> _PipelineBase:
        stored = list(hidden_columns(self.drafter.reads()))
        for stage in STAGES:
            update = {name: getattr(self.drafting, src) for name, src in stage.drafting.items()}
            if "drafter" in stage.config.model_fields:
                update["drafter"] = self.drafter.model_dump()
            if "hidden_states" in stage.config.model_fields:
                given = getattr(self, stage.name).hidden_states
                tied = stage.config.model_validate({"hidden_states": stored}).hidden_states
                if given is not None and given != tied:
                    raise ValueError(
                        f"{stage.name}.hidden_states={given}, but a {self.drafter.spec.title} "
                        f"drafter reads {stored}: drop it (it follows drafter.kind)"
                    )
                update["hidden_states"] = stored
            if update:
                section = getattr(self, stage.name)
                # validate_assignment would re-run per field; one validated copy is atomic.
                tied = stage.config.model_validate(section.model_dump() | update)
                object.__setattr__(self, stage.name, tied)
        return self

    @model_validator(mode="after")
    def _logged_replays_keep_teachers(self) -> _PipelineBase:
        # score.source=logged reads the teachers the rollout's verify forwards computed: one
        # setting, so a user cannot ask for logged replays from a rollout that dropped them.
        score, rollout = self.score, self.rollout  # type: ignore[attr-defined]
        if score.source == "logged" and not rollout.keep_teacher:
            kept = type(rollout).model_validate(rollout.model_dump() | {"keep_teacher": True})
            object.__setattr__(self, "rollout", kept)
        return self


# One section per stage, derived from the stage list so adding a stage never touches this file.
PipelineConfig = create_model(  # type: ignore[call-overload]
    "PipelineConfig",
    __base__=_PipelineBase,
    __doc__="The whole pipeline's config: the target, drafting, rounds, and one typed section "
    "per stage (from `pipeline.stages.STAGES`).",
    **{s.name: (s.config, Field(default_factory=s.config)) for s in STAGES},
)


def profiles() -> list[str]:
    return sorted(p.stem for p in PROFILE_DIR.glob("*.json"))


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def parse_set(item: str) -> dict[str, Any]:
    """`a.b.c=value` -> {"a": {"b": {"c": value}}}; value is JSON if it parses, else a string."""
    key, sep, raw = item.partition("=")
    if not sep or not key:
        raise OpdError(f"--set {item!r}: expected KEY=VALUE, e.g. --set sft.lr=1e-3")
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        value = raw
    except RecursionError:  # the decoder recurses once per level of nesting
        raise OpdError(f"--set {key}=...: the value is nested too deeply to read") from None
    out: dict[str, Any] = value
    for part in reversed(key.split(".")):
        out = {part: out}
    return out


def _problem(err: Any) -> str:
    msg = err["msg"].removeprefix("Value error, ")
    # The `drafter` union puts the kind in the location (drafter.dflash.layers): users set
    # drafter.layers.
    parts = [p for i, p in enumerate(err["loc"]) if not (i and p in KINDS)]
    loc = ".".join(str(p) for p in parts)
    return f"{loc}: {msg}" if loc else msg


def _fit_profile_aux_ids(data: dict[str, Any], user: dict[str, Any]) -> None:
    """Drop a profile's `target.aux_layer_ids` when the configured drafter reads another
    number of target layers: they were chosen for the profile's kind, and the target's aux
    layers follow the kind (`_read_what_the_kind_reads`), so the kind's count gets its default
    ids. Ids the user gives (--config, --set) stay, and must fit."""
    target, given = data.get("target"), user.get("target")
    if not isinstance(target, dict) or "aux_layer_ids" not in target:
        return
    if isinstance(given, dict) and ("aux_layer_ids" in given or "aux_layers" in given):
        return
    try:
        count = TypeAdapter(DrafterConfig).validate_python(data.get("drafter") or {}).reads()
    except (ValidationError, ValueError):
        return  # the full validation names the problem
    ids = target["aux_layer_ids"]
    if count.target_layers and isinstance(ids, list) and len(ids) != count.target_layers:
        data["target"] = {k: v for k, v in target.items() if k != "aux_layer_ids"}


def load_config(
    profile: str = "default", config_file: Path | None = None, sets: list[str] = ()
) -> PipelineConfig:
    path = PROFILE_DIR / f"{profile}.json"
    if not path.exists():
        raise OpdError(f"unknown profile {profile!r}; available: {', '.join(profiles())}")
    data = json.loads(path.read_text())
    by_kind = data.pop(KINDS_KEY, {})
    user: dict[str, Any] = {}
    if config_file is not None:
        try:
            over = json.loads(Path(config_file).read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise OpdError(f"cannot read config file {config_file}: {e}") from None
        except RecursionError:  # Python's JSON decoder recurses once per level of nesting
            raise OpdError(
                f"cannot read config file {config_file}: its JSON is nested too deeply; a config "
                'is an object of sections, e.g. {"sft": {"lr": 0.001}}'
            ) from None
        if not isinstance(over, dict):
            raise OpdError(
                f"config file {config_file} holds a JSON {type(over).__name__}; it must be an "
                'object of sections, e.g. {"sft": {"lr": 0.001}}'
            )
        user = _merge(user, over)
    for item in sets:
        user = _merge(user, parse_set(item))
    drafter = _merge(data, user).get("drafter")
    kind = drafter.get("kind", DEFAULT_KIND) if isinstance(drafter, dict) else None
    data = _merge(_merge(data, by_kind.get(kind, {}) if isinstance(kind, str) else {}), user)
    _fit_profile_aux_ids(data, user)
    try:
        return PipelineConfig.model_validate(data)
    except ValidationError as e:
        problems = "; ".join(_problem(err) for err in e.errors())
        raise OpdError(f"invalid config: {problems}") from None
