"""Runs one stage: check inputs, compute the output version, skip or resume, commit.

A stage is its module's `STAGE` record (`pipeline.core.stage.Stage`): a typed config and a
`run(cfg, inputs, output, rank, world_size, ctx) -> meta` that writes the shards. The runner
owns everything around that: that every input is a kind its role reads, the version (config +
input versions + the target's identity when the stage uses one), skipping work that exists,
the per-rank writer, the commit, and logging which versions were read and written. With
several ranks each writes its shards and marks itself done; the last one to finish commits,
once (`pipeline.distributed` runs the ranks). Plain Python: flows/ calls it as tasks.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import torch

from pipeline.core.config import StrictConfig, version_dict
from pipeline.core.precision import device_name
from pipeline.core.stage import Stage
from pipeline.core.targets import resolve_device, resolve_dtype
from storage import Dataset, DatasetRef, DatasetWriter, OpdError, Store

log = logging.getLogger("opd")


@dataclass
class RunContext:
    """What a stage may need besides its config and inputs, shared across stages of one run."""

    store: Store
    target_loader: Any = (
        None  # pipeline.core.targets.TargetLoader; None for stages without a target
    )
    progress: bool = True
    run_name: str = "default"
    """The named run (`--run-name`) the stages run for; rollout writes it into its log."""


@dataclass
class StageResult:
    dataset: Dataset
    reused: bool
    seconds: float

    @property
    def ref(self) -> DatasetRef:
        return self.dataset.ref


def output_version_config(stage: Stage, cfg: StrictConfig, ctx: RunContext) -> dict[str, Any]:
    """The config recorded in (and hashed into) the output's manifest."""
    if not isinstance(cfg, stage.config):
        raise OpdError(
            f"stage {stage.name} takes a {stage.config.__name__}, got {type(cfg).__name__}"
        )
    cfg = resolved(stage, cfg, ctx)
    stage_cfg = version_dict(cfg) if stage.version_config is None else stage.version_config(cfg)
    out: dict[str, Any] = {"stage": stage_cfg}
    if stage.version_extra is not None:  # e.g. the content hash of a source file
        try:
            out |= stage.version_extra(cfg)
        except ValueError as e:
            raise OpdError(str(e)) from None
    # `auto` means different engines on different machines; None: the stage used none this time
    if stage.engine is not None and (engine := stage.engine(cfg, ctx)) is not None:
        out["engine"] = engine
    if stage.uses_target:
        if ctx.target_loader is None:
            raise OpdError(f"stage {stage.name} needs a target but none is configured")
        out["target"] = ctx.target_loader.identity
    return out


def resolved(stage: Stage, cfg: StrictConfig, ctx: RunContext) -> StrictConfig:
    """`cfg` as the stage runs it on this machine (`Stage.resolve`)."""
    return cfg if stage.resolve is None else stage.resolve(cfg, ctx)


def compute_note(stage: Stage, cfg: StrictConfig, ctx: RunContext) -> str:
    """Where a stage computes and in what precision, for its lines: `cpu AVX-512-BF16, target
    float32, training bf16`. Speeds differ about 10x between the machines this runs on."""
    if not stage.uses_target or ctx.target_loader is None:
        return device_name(torch.device("cpu"))
    target = ctx.target_loader.cfg
    device = "cuda (device_map=auto)" if target.device_map else device_name(resolve_device(target))
    note = f"{device}, target {resolve_dtype(target)}"
    bf16 = getattr(resolved(stage, cfg, ctx), "bf16", None)
    if isinstance(bf16, bool):
        note += f", training {'bf16 autocast' if bf16 else 'fp32'}"
    return note


def planned_ref(
    stage: Stage, cfg: StrictConfig, inputs: dict[str, Dataset], ctx: RunContext
) -> DatasetRef:
    """The exact ref this stage will produce from these inputs (no work done)."""
    return ctx.store.writer(
        stage.output,
        stage=stage.name,
        stage_version=stage.version,
        config=output_version_config(stage, cfg, ctx),
        inputs={role: ds.ref for role, ds in inputs.items()},
    ).ref


def _check_not_empty(stage: Stage, writer: DatasetWriter, inputs: dict[str, Dataset]) -> None:
    """0 rows from inputs that have rows means the stage read the wrong thing: refuse to
    commit it (sharded stages only: a drafter dataset is files, not rows)."""
    if not stage.sharded or stage.may_be_empty:
        return
    fed = [d for d in inputs.values() if d.num_rows > 0]
    rows = sum(s.get("rows") or 0 for s in writer.completed_shards())
    if rows == 0 and fed:
        raise OpdError(
            f"stage {stage.name} would commit 0 rows from {', '.join(str(d.ref) for d in fed)}; "
            "check its inputs and config (e.g. max_prompts, skip_prompts, split)"
        )


def _rehash_inputs(inputs: dict[str, Dataset]) -> None:
    """Hash every byte of every input before training or a forced recompute. Readers otherwise
    trust a file whose size and mtime match the hash checked on first read, so a byte flipped
    in place would be trained on and committed under the same version. A training stage runs
    for minutes where sha256 reads GB/s; --force is a recompute asked for because something
    looked wrong."""
    for ds in inputs.values():
        ds.verify_all(rehash=True)


def _out_of_memory(stage: Stage, cfg: StrictConfig, rank: int) -> str:
    batch = getattr(cfg, "batch_size", None)
    knob = (
        f"lower {stage.name}.batch_size (now {batch}), e.g. --set "
        f"{stage.name}.batch_size={max(1, batch // 2)}"
        if batch is not None
        else "lower its batch settings"
    )
    return (
        f"stage {stage.name} ran out of GPU memory on rank {rank}: {knob}; its completed "
        "shards are kept and a re-run resumes from them"
    )


def run_stage(
    stage: Stage,
    cfg: StrictConfig,
    inputs: dict[str, Dataset],
    ctx: RunContext,
    *,
    force: bool = False,
    rank: int = 0,
    world_size: int = 1,
) -> StageResult:
    stage.check_inputs(inputs, cfg)
    cfg = resolved(stage, cfg, ctx)
    if stage.precheck is not None:
        stage.precheck(cfg, inputs, ctx)
    for role, ds in inputs.items():
        log.info("[%s] reads %s: %s", stage.name, role, ds.ref)
    writer = ctx.store.writer(
        stage.output,
        stage=stage.name,
        stage_version=stage.version,
        config=output_version_config(stage, cfg, ctx),
        inputs={role: ds.ref for role, ds in inputs.items()},
        rank=rank,
        world_size=world_size,
        # A forced recompute is staged beside the committed version and swapped in at commit.
        replace=force,
    )
    t0 = time.perf_counter()
    if writer.exists() and not force:
        ctx.store.set_latest(writer.ref)
        log.info("[%s] %s exists; nothing to do (use --force to recompute)", stage.name, writer.ref)
        return StageResult(ctx.store.open(writer.ref), True, 0.0)
    if force or stage.ddp:
        _rehash_inputs(inputs)
    with writer:
        if writer.exists():  # another process committed it while we waited for the lock
            return StageResult(ctx.store.open(writer.ref), True, time.perf_counter() - t0)
        # Files without rows (a rollout's vocab map, written first) are not work to resume from.
        done = sum(s["rows"] is not None for s in writer.completed_shards())
        if done:
            log.info("[%s] resuming %s from %d completed shard(s)", stage.name, writer.ref, done)
        try:
            meta = stage.run(cfg, inputs, writer, rank, world_size, ctx) or {}
        except torch.OutOfMemoryError:
            if world_size > 1:
                writer.rank_failed()
            else:
                writer.discard_if_empty()
            raise OpdError(_out_of_memory(stage, cfg, rank)) from None
        except Exception:
            if world_size > 1:
                writer.rank_failed()
            else:
                writer.discard_if_empty()  # a refusal before any shard leaves no directory
            raise
        if stage.uses_target:
            meta = {**meta, **ctx.target_loader.record()}
        if world_size == 1:
            _check_not_empty(stage, writer, inputs)
            ds = writer.commit(meta=meta)
        else:
            # The last rank to finish commits, once: the others return without a dataset.
            writer.rank_done()
            with writer.commit_lock():
                if writer.exists():
                    return StageResult(ctx.store.open(writer.ref), False, time.perf_counter() - t0)
                if writer.ranks_done() != list(range(world_size)):
                    return StageResult(None, False, time.perf_counter() - t0)  # type: ignore[arg-type]
                _check_not_empty(stage, writer, inputs)
                ds = writer.commit(meta=meta)
    seconds = time.perf_counter() - t0
    log.info(
        "[%s] wrote %s (%d rows, %.1fs; %s)",
        stage.name,
        ds.ref,
        ds.num_rows,
        seconds,
        compute_note(stage, cfg, ctx),
    )
    return StageResult(ds, False, seconds)
