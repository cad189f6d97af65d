"""Every stage, in pipeline order: the one list that names them (see `pipeline.core.stage`)."""

from __future__ import annotations

from pipeline.core.stage import Stage
from pipeline.stages import analyze, evaluate, features, generate, opd, prompts, rollout, score, sft
from storage import OpdError

STAGES: tuple[Stage, ...] = (
    prompts.STAGE,
    generate.STAGE,
    features.STAGE,
    sft.STAGE,
    rollout.STAGE,
    score.STAGE,
    opd.STAGE,
    evaluate.STAGE,
    analyze.STAGE,
)
BY_NAME: dict[str, Stage] = {s.name: s for s in STAGES}


def get(name: str) -> Stage:
    if name not in BY_NAME:
        raise OpdError(f"unknown stage {name!r}; stages: {', '.join(BY_NAME)}")
    return BY_NAME[name]
