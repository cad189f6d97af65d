"""Which stages a chain runs, in what order, and which step's output feeds which input.

The wiring is data (a list of `Step`s) so the plain-Python runner here and the Prefect flow
in flows/ execute exactly the same chain: the flow only wraps each step in a task.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType

from pipeline import evaluate, features, generate, prompts, sft
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
    return {
        "prompts": prompts,
        "generate": generate,
        "features": features,
        "sft": sft,
        "evaluate": evaluate,
    }


# Which dataset a single-stage run reads for each input role when none is given.
DEFAULT_INPUT = {"drafter": "sft"}


def single_step(name: str, cfg: PipelineConfig) -> Step:
    modules = stage_modules()
    if name not in modules:
        raise OpdError(
            f"unknown stage {name!r}; stages: {', '.join(modules)}; chains: {', '.join(CHAINS)}"
        )
    return Step(name, modules[name], getattr(cfg, name))


def sft_chain(cfg: PipelineConfig) -> list[Step]:
    return [
        Step("prompts", prompts, cfg.prompts),
        Step("generate", generate, cfg.generate, {"prompts": "prompts"}),
        Step("features", features, cfg.features, {"trajectories": "generate"}),
        Step("sft", sft, cfg.sft, {"features": "features"}),
        Step("evaluate", evaluate, cfg.evaluate, {"prompts": "prompts", "drafter": "sft"}),
    ]


CHAINS: dict[str, Callable[[PipelineConfig], list[Step]]] = {"sft-chain": sft_chain}

Execute = Callable[[Step, dict[str, Dataset]], StageResult]


def record_results(ctx: RunContext, run_name: str, results: dict[str, StageResult]) -> None:
    """Remember what a named run produced: by step key, and by dataset name (last one wins)."""
    produced: dict[str, str] = {}
    for key, r in results.items():
        if r.dataset is not None:
            produced[key] = produced[r.ref.name] = str(r.ref)
    ctx.store.record_run(run_name, produced)


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


def summary_markdown(results: dict[str, StageResult]) -> str:
    """A markdown table of what each step produced, with τ where a step measured it."""
    lines = ["| step | dataset | status | τ |", "|---|---|---|---|"]
    for key, r in results.items():
        tau = r.dataset.meta.get("tau") if r.dataset is not None else None
        status = "cached" if r.reused else f"ran {r.seconds:.0f}s"
        tau_s = f"{tau:.3f}" if isinstance(tau, int | float) else ""
        lines.append(f"| {key} | `{r.ref}` | {status} | {tau_s} |")
    return "\n".join(lines)
