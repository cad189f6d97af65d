"""The whole pipeline's config: one typed section per stage, named profiles, overrides.

A profile is a JSON file in pipeline/profiles/ holding only what differs from the defaults;
`--config FILE` (JSON) is applied over it and `--set a.b=value` last. Unknown keys anywhere
are errors that name the key.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import Field, ValidationError

from pipeline.config import StrictConfig
from pipeline.evaluate import Config as EvaluateConfig
from pipeline.features import Config as FeaturesConfig
from pipeline.generate import Config as GenerateConfig
from pipeline.opd import Config as OPDConfig
from pipeline.prompts import PromptsConfig
from pipeline.rollout import Config as RolloutConfig
from pipeline.score import Config as ScoreConfig
from pipeline.sft import Config as SFTConfig
from pipeline.targets import TargetConfig
from storage import OpdError

PROFILE_DIR = Path(__file__).resolve().parent / "profiles"


class PipelineConfig(StrictConfig):
    target: TargetConfig = TargetConfig()
    prompts: PromptsConfig = PromptsConfig()
    generate: GenerateConfig = GenerateConfig()
    features: FeaturesConfig = FeaturesConfig()
    sft: SFTConfig = SFTConfig()
    rounds: int = Field(2, ge=0)
    """Draft-OPD rounds (rollout -> score -> opd) after the SFT warm-up in the `full` chain."""
    rollout: RolloutConfig = RolloutConfig()
    score: ScoreConfig = ScoreConfig()
    opd: OPDConfig = OPDConfig()
    evaluate: EvaluateConfig = EvaluateConfig()


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
    out: dict[str, Any] = value
    for part in reversed(key.split(".")):
        out = {part: out}
    return out


def load_config(
    profile: str = "default", config_file: Path | None = None, sets: list[str] = ()
) -> PipelineConfig:
    path = PROFILE_DIR / f"{profile}.json"
    if not path.exists():
        raise OpdError(f"unknown profile {profile!r}; available: {', '.join(profiles())}")
    data = json.loads(path.read_text())
    if config_file is not None:
        try:
            over = json.loads(Path(config_file).read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise OpdError(f"cannot read config file {config_file}: {e}") from None
        if not isinstance(over, dict):
            raise OpdError(
                f"config file {config_file} holds a JSON {type(over).__name__}; it must be an "
                'object of sections, e.g. {"sft": {"lr": 0.001}}'
            )
        data = _merge(data, over)
    for item in sets:
        data = _merge(data, parse_set(item))
    try:
        return PipelineConfig.model_validate(data)
    except ValidationError as e:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc'])}: {err['msg']}" for err in e.errors()
        )
        raise OpdError(f"invalid config: {problems}") from None
