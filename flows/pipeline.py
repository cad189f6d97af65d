"""The Prefect flows: each pipeline step is a task; our dataset versions are the cache.

Prefect's own result cache and persistence are off (NO_CACHE, persist_result=False): a stage
is skipped only because its dataset version exists with a manifest, never because Prefect
remembers a result whose files may be gone. Task runs are named `<step>:<NAME@VERSION>`.

Fan-out (`opd-pipeline` with `workers=N` or `dask_address=tcp://...`): the chain runs as a
subflow on a Dask task runner, a sharded step as one task per rank (`<step>:<REF>:rank<r>`)
that carries the step's config and input refs, never a loaded model; a training step as one
task that launches torchrun with one process per rank.
"""

from __future__ import annotations

import time

from prefect import flow, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE

from pipeline import distributed
from pipeline.chains import (
    CHAINS,
    Step,
    export_chain_result,
    record_results,
    run_chain,
    summary_markdown,
)
from pipeline.core.runner import RunContext, StageResult, planned_ref, run_stage
from pipeline.core.targets import TargetLoader
from pipeline.profiles import load_config
from storage import Dataset, OpdError, Store, check_run_name


@task(cache_policy=NO_CACHE, persist_result=False, retries=1, retry_delay_seconds=2)
def stage_task(step: Step, inputs: dict[str, Dataset], ctx: RunContext, force: bool) -> StageResult:
    return run_stage(step.stage, step.cfg, inputs, ctx, force=force)


rank_task = task(
    distributed.run_rank,
    name="rank_task",
    cache_policy=NO_CACHE,
    persist_result=False,
    retries=1,
    retry_delay_seconds=2,
)


@task(cache_policy=NO_CACHE, persist_result=False)
def torchrun_task(argv: list[str], nproc: int) -> None:
    distributed.launch(nproc, argv)


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


def _fan_out(
    step: Step,
    inputs: dict[str, Dataset],
    ctx: RunContext,
    forced: set[str],
    ranks: int,
    launch_argv: list[str],
) -> StageResult:
    ref = planned_ref(step.stage, step.cfg, inputs, ctx)
    force = step.key in forced
    # A committed sharded step still fans out: each rank finds it and returns at once (and
    # checks it computes the same version as the flow).
    cached = ctx.store.exists(ref) and not force
    trains = step.stage.ddp and ranks > 1 and not cached
    if not (step.stage.sharded or trains):
        return stage_task.with_options(task_run_name=f"{step.key}:{ref}")(step, inputs, ctx, force)
    t0 = time.perf_counter()
    refs = {role: str(ds.ref) for role, ds in inputs.items()}
    if step.stage.ddp:
        argv = [*launch_argv[:2], "run", step.key, *launch_argv[2:]]
        argv += [a for role, r in refs.items() for a in ("--input", f"{role}={r}")]
        argv += ["--force"] * force
        torchrun_task.with_options(task_run_name=f"{step.key}:{ref}:torchrun")(argv, ranks)
    else:
        futures = [
            rank_task.with_options(task_run_name=f"{step.key}:{ref}:rank{r}").submit(
                step,
                refs,
                root=str(ctx.store.root),
                target=ctx.target_loader.cfg,
                run_name=ctx.run_name,
                force=force,
                rank=r,
                world_size=ranks,
                expected=str(ref),
            )
            for r in range(ranks)
        ]
        # Rank 0 may wait for the others inside its stage: their errors (naming the rank) first.
        for f in reversed(futures):
            f.result()
    return StageResult(ctx.store.open(ref), cached, time.perf_counter() - t0)


@flow(name="opd-chain", validate_parameters=False, persist_result=False)
def fan_out_flow(
    steps: list[Step], ctx: RunContext, forced: set[str], ranks: int, launch_argv: list[str]
) -> dict[str, StageResult]:
    """The chain on the task runner `opd-pipeline` picked: sharded steps as a task per rank."""

    def execute(step: Step, inputs: dict[str, Dataset]) -> StageResult:
        return _fan_out(step, inputs, ctx, forced, ranks, launch_argv)

    return run_chain(steps, ctx, execute=execute)


def dask_runner(workers: int | None, dask_address: str | None):
    """(task runner, ranks) for the fan-out; checks a given scheduler answers before any work."""
    from prefect_dask import DaskTaskRunner

    if workers is not None and dask_address:
        raise OpdError("give workers (a local Dask cluster) or dask_address (an existing one)")
    if dask_address:
        from distributed import Client

        try:
            with Client(dask_address, timeout=10) as client:
                n = len(client.scheduler_info()["workers"])
        except (OSError, TimeoutError, ValueError) as e:
            raise OpdError(
                f"no Dask scheduler answers at {dask_address} ({e}): start one (`dask scheduler` "
                "and `dask worker ADDRESS` per machine) or drop dask_address"
            ) from None
        if n == 0:
            raise OpdError(f"the Dask cluster at {dask_address} has no workers: start some")
        return DaskTaskRunner(address=dask_address), n
    if workers < 1:
        raise OpdError(f"workers must be >= 1 (Dask worker processes), got {workers}")
    # One thread per worker process: a rank is a process with its own target copy and torch pool.
    kwargs = {"n_workers": workers, "threads_per_worker": 1, "processes": True}
    return DaskTaskRunner(cluster_kwargs=kwargs), workers


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
    workers: int | None = None,
    dask_address: str | None = None,
) -> dict[str, str]:
    """The whole pipeline (or `chain`), as Prefect tasks.

    profile: config profile (tiny, default); overrides: `section.key=value` items; rounds:
    OPD rounds; stages: steps to recompute on cached inputs (e.g. ["score-r1"]; what depends
    on them is recomputed only if its inputs changed); root: the data root (default OPD_HOME).
    workers: fan out on a local Dask cluster of this many worker processes, one rank each;
    dask_address: fan out on an existing Dask cluster (tcp://HOST:8786), one rank per worker.
    Without either, every step runs in this process.
    """
    if chain not in CHAINS:
        raise OpdError(f"unknown chain {chain!r}; chains: {', '.join(CHAINS)}")
    check_run_name(run_name)
    fan_out = workers is not None or bool(dask_address)
    runner, ranks = dask_runner(workers, dask_address) if fan_out else (None, 1)
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
    if runner is None:
        results = _run_as_tasks(steps, ctx, {}, set(stages or []))
    else:
        # What a training step's torchrun processes are started with: this flow's config.
        argv = ["--root", str(store.root.resolve()), "--profile", profile, "--run-name", run_name]
        argv += [a for o in sets for a in ("--set", o)] + ["--no-progress"]
        chain_flow = fan_out_flow.with_options(task_runner=runner)
        results = chain_flow(steps, ctx, set(stages or []), ranks, argv)
    record_results(ctx, run_name, results)
    if chain == "full":
        export_task(results, ctx, cfg.drafting.k)
    create_markdown_artifact(
        key="opd-pipeline-summary", markdown=summary_markdown(results), description="datasets and τ"
    )
    return {k: str(r.ref) for k, r in results.items()}
