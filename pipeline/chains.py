"""Which stages a chain runs, in what order, and which step's output feeds which input.

The wiring is data (a list of `Step`s) so the plain-Python runner here and the Prefect flow
in flows/ execute exactly the same chain: the flow only wraps each step in a task.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType

from pipeline import features, generate
from pipeline.config import StrictConfig
from pipeline.profiles import PipelineConfig
from pipeline.runner import RunContext, StageResult, run_stage
from storage import Dataset, OpdError

log = logging.getLogger("opd")


@dataclass
class Step:
    key: str  # unique within the chain; also the config section for single-stage runs
    module: ModuleType
    cfg: StrictConfig
    inputs: dict[str, str] = field(default_factory=dict)  # role -> key of an earlier step


def stage_modules() -> dict[str, ModuleType]:
    """Stage name -> module, in pipeline order."""
    from pipeline import prompts

    return {"prompts": prompts, "generate": generate, "features": features}


def single_step(name: str, cfg: PipelineConfig) -> Step:
    modules = stage_modules()
    if name not in modules:
        raise OpdError(
            f"unknown stage {name!r}; stages: {', '.join(modules)}; chains: {', '.join(CHAINS)}"
        )
    return Step(name, modules[name], getattr(cfg, name))


def sft_chain(cfg: PipelineConfig) -> list[Step]:
    from pipeline import prompts

    return [
        Step("prompts", prompts, cfg.prompts),
        Step("generate", generate, cfg.generate, {"prompts": "prompts"}),
        Step("features", features, cfg.features, {"trajectories": "generate"}),
    ]


CHAINS: dict[str, Callable[[PipelineConfig], list[Step]]] = {"sft-chain": sft_chain}

Execute = Callable[[Step, dict[str, Dataset]], StageResult]


def run_chain(
    steps: list[Step],
    ctx: RunContext,
    *,
    external: dict[str, Dataset] | None = None,
    execute: Execute | None = None,
    force: set[str] = frozenset(),
) -> dict[str, StageResult]:
    """Run steps in order; a step's inputs come from earlier steps or `external` datasets."""
    results: dict[str, StageResult] = {}
    available: dict[str, Dataset] = dict(external or {})

    def default_execute(step: Step, inputs: dict[str, Dataset]) -> StageResult:
        return run_stage(step.module, step.cfg, inputs, ctx, force=step.key in force)

    execute = execute or default_execute
    for step in steps:
        inputs = {}
        for role, source in step.inputs.items():
            if source in results:
                inputs[role] = results[source].dataset
            elif source in available:
                inputs[role] = available[source]
            else:
                raise OpdError(f"step {step.key!r} needs {role!r} from {source!r}, which has not run")
        results[step.key] = execute(step, inputs)
    return results
