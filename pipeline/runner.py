"""Runs one stage: resolve inputs, compute the output version, skip or resume, commit.

A stage module (pipeline/<stage>.py) defines:

    OUTPUT = "trajectories"            # the dataset it produces
    VERSION = "1"                      # bump when the code's output changes for the same config
    INPUTS = ("prompts",)              # roles it reads (each is a dataset name)
    Config(StrictConfig)               # its typed config
    run(cfg, inputs, output, rank, world_size, ctx) -> dict   # writes shards; returns manifest meta

The runner owns everything around that: the version (config + input versions + the target's
identity when the stage uses one), skipping work that exists, the per-rank writer, the commit
and logging which versions were read and written. Plain Python: flows/ calls it as tasks.
"""

from __future__ import annotations

import logging
import shutil
import time
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from pipeline.config import StrictConfig, version_dict
from storage import Dataset, DatasetRef, OpdError, Store

log = logging.getLogger("opd")


@dataclass
class RunContext:
    """What a stage may need besides its config and inputs, shared across stages of one run."""

    store: Store
    target_loader: Any = None  # pipeline.targets.TargetLoader; None for stages without a target
    progress: bool = True
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class StageResult:
    dataset: Dataset
    reused: bool
    seconds: float

    @property
    def ref(self) -> DatasetRef:
        return self.dataset.ref


def output_version_config(module: ModuleType, cfg: StrictConfig, ctx: RunContext) -> dict[str, Any]:
    """The config recorded in (and hashed into) the output's manifest."""
    out: dict[str, Any] = {"stage": version_dict(cfg)}
    if hasattr(module, "version_extra"):  # e.g. the content hash of a source file
        try:
            out |= module.version_extra(cfg)
        except ValueError as e:
            raise OpdError(str(e)) from None
    if hasattr(module, "resolved_engine"):  # `auto` means different engines on different machines
        out["engine"] = module.resolved_engine(cfg, ctx)
    if getattr(module, "USES_TARGET", False):
        if ctx.target_loader is None:
            raise OpdError(f"stage {module.STAGE} needs a target but none is configured")
        out["target"] = ctx.target_loader.identity
    return out


def planned_ref(
    module: ModuleType, cfg: StrictConfig, inputs: dict[str, Dataset], ctx: RunContext
) -> DatasetRef:
    """The exact ref this stage will produce from these inputs (no work done)."""
    return ctx.store.writer(
        module.OUTPUT,
        stage=module.STAGE,
        stage_version=module.VERSION,
        config=output_version_config(module, cfg, ctx),
        inputs={role: ds.ref for role, ds in inputs.items()},
    ).ref


def run_stage(
    module: ModuleType,
    cfg: StrictConfig,
    inputs: dict[str, Dataset],
    ctx: RunContext,
    *,
    force: bool = False,
    rank: int = 0,
    world_size: int = 1,
) -> StageResult:
    missing = set(module.INPUTS) - set(inputs)
    if missing:
        raise OpdError(f"stage {module.STAGE} needs inputs {sorted(missing)}")
    for role, ds in inputs.items():
        log.info("[%s] reads %s: %s", module.STAGE, role, ds.ref)
    writer = ctx.store.writer(
        module.OUTPUT,
        stage=module.STAGE,
        stage_version=module.VERSION,
        config=output_version_config(module, cfg, ctx),
        inputs={role: ds.ref for role, ds in inputs.items()},
        rank=rank,
        world_size=world_size,
    )
    t0 = time.perf_counter()
    aside = None
    if writer.exists():
        if not force:
            ctx.store.set_latest(writer.ref)
            log.info(
                "[%s] %s exists; nothing to do (use --force to recompute)", module.STAGE, writer.ref
            )
            return StageResult(ctx.store.open(writer.ref), True, 0.0)
        # Recompute into a fresh directory; the old one comes back if the new run fails.
        aside = writer.dir.with_name(f".{writer.version}.replaced-{int(time.time())}")
        writer.dir.rename(aside)
    try:
        with writer:
            if writer.exists():  # another process committed it while we waited for the lock
                return StageResult(ctx.store.open(writer.ref), True, time.perf_counter() - t0)
            done = len(writer.completed_shards())
            if done:
                log.info(
                    "[%s] resuming %s from %d completed shard(s)", module.STAGE, writer.ref, done
                )
            meta = module.run(cfg, inputs, writer, rank, world_size, ctx) or {}
            if world_size > 1:
                writer.rank_done()
                if writer.ranks_done() != list(range(world_size)):
                    return StageResult(None, False, time.perf_counter() - t0)  # type: ignore[arg-type]
            ds = writer.commit(meta=meta)
    except BaseException:
        if aside is not None and not writer.exists():
            shutil.rmtree(writer.dir, ignore_errors=True)
            aside.rename(writer.dir)
        raise
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)
    seconds = time.perf_counter() - t0
    log.info("[%s] wrote %s (%d rows, %.1fs)", module.STAGE, ds.ref, ds.num_rows, seconds)
    return StageResult(ds, False, seconds)
