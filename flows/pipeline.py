"""The Prefect flows: each pipeline step is a task; our dataset versions are the cache.

Prefect's own result cache and persistence are off (NO_CACHE, persist_result=False): a stage
is skipped only because its dataset version exists with a manifest, never because Prefect
remembers a result whose files may be gone.
"""

from __future__ import annotations

from prefect import flow, task
from prefect.cache_policies import NO_CACHE

from pipeline.chains import Step, run_chain
from pipeline.runner import RunContext, StageResult, planned_ref, run_stage
from storage import Dataset


@task(cache_policy=NO_CACHE, persist_result=False, retries=1, retry_delay_seconds=2)
def stage_task(step: Step, inputs: dict[str, Dataset], ctx: RunContext, force: bool) -> StageResult:
    return run_stage(step.module, step.cfg, inputs, ctx, force=force)


@flow(name="opd-steps", validate_parameters=False, persist_result=False)
def steps_flow(steps: list[Step], ctx: RunContext, external: dict[str, Dataset], forced: set[str]):
    def execute(step: Step, inputs: dict[str, Dataset]) -> StageResult:
        ref = planned_ref(step.module, step.cfg, inputs, ctx)
        named = stage_task.with_options(task_run_name=f"{step.key}:{ref}")
        return named(step, inputs, ctx, step.key in forced)

    return run_chain(steps, ctx, external=external, execute=execute)


def run_steps_flow(
    steps: list[Step], ctx: RunContext, external: dict[str, Dataset], forced: set[str]
) -> dict[str, StageResult]:
    return steps_flow(steps, ctx, external, forced)
