"""The Prefect flows: each pipeline step is a task; our dataset versions are the cache.

Prefect's own result cache and persistence are off (NO_CACHE, persist_result=False): a stage
is skipped only because its dataset version exists with a manifest, never because Prefect
remembers a result whose files may be gone. Task runs are named `<step>:<NAME@VERSION>`.
"""

from __future__ import annotations

from prefect import flow, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE

from pipeline.chains import CHAINS, Step, record_results, run_chain, summary_markdown
from pipeline.export import export_chain_result
from pipeline.profiles import load_config
from pipeline.runner import RunContext, StageResult, planned_ref, run_stage
from pipeline.targets import TargetLoader
from storage import Dataset, OpdError, Store, check_run_name


@task(cache_policy=NO_CACHE, persist_result=False, retries=1, retry_delay_seconds=2)
def stage_task(step: Step, inputs: dict[str, Dataset], ctx: RunContext, force: bool) -> StageResult:
    return run_stage(step.stage, step.cfg, inputs, ctx, force=force)


@task(cache_policy=NO_CACHE, persist_result=False, task_run_name="export")
def export_task(results: dict[str, StageResult], ctx: RunContext, k: int) -> dict | None:
    return export_chain_result(results, ctx.target_loader, ctx.store.root, k)


def _run_as_tasks(
    steps: list[Step], ctx: RunContext, external: dict[str, Dataset], forced: set[str]
) -> dict[str, StageResult]:
    def execute(step: Step, inputs: dict[str, Dataset]) -> StageResult:
        ref = planned_ref(step.stage, step.cfg, inputs, ctx)
        named = stage_task.with_options(task_run_name=f"{step.key}:{ref}")
        return named(step, inputs, ctx, step.key in forced)

    return run_chain(steps, ctx, external=external, execute=execute)


@flow(name="opd-steps", validate_parameters=False, persist_result=False)
def steps_flow(
    steps: list[Step], ctx: RunContext, external: dict[str, Dataset], forced: set[str]
) -> dict[str, StageResult]:
    """What `opd run ... --prefect` runs in-process: the given steps as tasks."""
    return _run_as_tasks(steps, ctx, external, forced)


def run_steps_flow(
    steps: list[Step], ctx: RunContext, external: dict[str, Dataset], forced: set[str]
) -> dict[str, StageResult]:
    return steps_flow(steps, ctx, external, forced)


@flow(name="opd-pipeline", persist_result=False)
def opd_pipeline(
    profile: str = "default",
    overrides: list[str] | None = None,
    rounds: int | None = None,
    stages: list[str] | None = None,
    chain: str = "full",
    run_name: str = "default",
    root: str | None = None,
) -> dict[str, str]:
    """The whole pipeline (or `chain`), as Prefect tasks.

    profile: config profile (tiny, default); overrides: `section.key=value` items; rounds:
    OPD rounds; stages: steps to recompute on cached inputs (e.g. ["score-r1"]; what depends
    on them is recomputed only if its inputs changed); root: the data root (default OPD_HOME).
    """
    if chain not in CHAINS:
        raise OpdError(f"unknown chain {chain!r}; chains: {', '.join(CHAINS)}")
    check_run_name(run_name)
    sets = list(overrides or []) + ([f"rounds={rounds}"] if rounds is not None else [])
    cfg = load_config(profile, None, sets)
    store = Store(root) if root else Store()
    ctx = RunContext(
        store=store, target_loader=TargetLoader(cfg.target), progress=False, run_name=run_name
    )
    steps = CHAINS[chain](cfg)
    keys = [s.key for s in steps]
    bad = [s for s in stages or [] if s not in keys]
    if bad:
        raise OpdError(f"unknown stage(s) {bad} for chain {chain!r}; steps: {', '.join(keys)}")
    results = _run_as_tasks(steps, ctx, {}, set(stages or []))
    record_results(ctx, run_name, results)
    if chain == "full":
        export_task(results, ctx, cfg.drafting.k)
    create_markdown_artifact(
        key="opd-pipeline-summary", markdown=summary_markdown(results), description="datasets and τ"
    )
    return {k: str(r.ref) for k, r in results.items()}
