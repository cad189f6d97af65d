"""The one training loop of the drafter-training stages (sft, opd).

A stage builds its data and its forward module, then hands the trainer two functions: the
loss of one batch (`loss_step`) and a held-out evaluation (`validate`). The trainer owns what
both stages share: AdamW with warm-up + cosine, clipping, bf16 autocast, exact resume from
checkpoints in `<root>/_work/<stage>/<version>/`, DDP or FSDP under `torchrun` (every rank
steps together; only rank 0 saves; SIGINT or SIGTERM saves one at the end of the step it lands in),
validation cadence, `stop_after_steps`, progress and metrics.

    trainer = Trainer(cfg, stage="sft", drafter=drafter, forward=TTTUnroll(drafter, 7), ...)
    trainer.setup()                      # FSDP, optimizer, schedule, resume -> trainer.step
    result = trainer.train(loss_step, validate)
    drafter = trainer.whole_drafter()    # every rank: the weights to write (gathered under FSDP)

Optimizer steps run in the same order as the two loops this replaces did (lr read, forward,
backward, clip, step, schedule), so a resumed run still ends bit-for-bit where an
uninterrupted one would (on CPU).
"""

from __future__ import annotations

import contextlib
import logging
import math
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import torch
from pydantic import Field, PositiveInt
from torch import Tensor, nn
from tqdm import tqdm

from models.drafter import Drafter
from pipeline.core import training
from pipeline.core.config import StrictConfig, optional_field, runtime_field
from pipeline.core.precision import Bf16Setting, resolve_bf16
from pipeline.core.precision import native_bf16 as native_bf16  # where benchmarks import it
from pipeline.core.targets import resolve_device
from storage import OpdError

log = logging.getLogger("opd")

METRICS_SCHEMA = pa.schema(
    [
        ("kind", pa.string()),  # "train" (one row per step) or "val"
        ("step", pa.int64()),  # optimizer steps done
        ("epoch", pa.float64()),
        ("loss", pa.float64()),
        ("lr", pa.float64()),  # the lr this step ran at
        ("grad_norm", pa.float64()),  # before clipping
        ("tokens", pa.int64()),
        ("tokens_per_s", pa.float64()),
        ("row_steps", pa.int64()),  # drafter rows x unrolled steps run forward+backward
        ("acc", pa.list_(pa.float64())),  # per TTT step: T=0 acceptance proxy
        ("alpha", pa.list_(pa.float64())),  # per TTT step: expected sum min(p, q) at T=1 (val)
        ("tau_sim", pa.float64()),
        ("tau_expected", pa.float64()),
        ("tau_chain", pa.float64()),
        # val, with a `heldout` input: teacher-forced acceptance on sequences neither stage
        # trains on, over drafting.k steps in both stages, so sft and opd curves compare
        ("heldout_acc", pa.list_(pa.float64())),
        ("heldout_tau_sim", pa.float64()),
        ("heldout_tau_expected", pa.float64()),
        ("heldout_tau_chain", pa.float64()),
    ]
)
"""The columns of both stages' `metrics.parquet`; opd appends its replay metrics."""


class TrainConfig(StrictConfig):
    """What every drafter-training stage configures the same way. Defaults are the SFT
    warm-up's; a stage that needs others (opd fine-tunes a trained drafter) redeclares them."""

    epochs: float | None = Field(2.0, gt=0)
    """Passes over the training items; ignored when `steps` is set. Sized for the CPU budget:
    on 1200 greedy trajectories of the previous embedded target (238k tokens), evaluated tau
    (T=0, K=6, held-out prompts) was 2.6 after 1.5 epochs, 4.0 after 4 (draft vocab 4096), and
    3.5 after 2 epochs with the default profile (1024-token draft vocab, aux layers 1, 3, 5;
    5-7 min). On the current target the default profile's 2 epochs give 2.7 (5 min); more
    epochs keep helping where time allows."""
    steps: int | None = Field(None, ge=1)
    """Optimizer steps; overrides `epochs`."""
    batch_size: int = Field(16, ge=1)
    """Training items per batch (per rank)."""
    max_tokens: int = Field(4096, ge=1)
    """Padded tokens per batch (rows x longest row): bounds memory, since every unrolled step
    keeps [tokens, draft_vocab] fp32 logits for the backward pass."""
    lr: float = Field(2e-3, gt=0)
    """Peak lr. A single freshly initialised layer tolerates (and on a CPU budget needs) a
    higher lr than fine-tuning: 1e-3..3e-3 converges within a few hundred steps."""
    warmup_ratio: float = Field(0.03, ge=0, lt=1)
    """Share of steps spent warming up linearly; short, as the model is one layer deep."""
    min_lr_ratio: float = Field(0.1, ge=0, le=1)
    """The cosine ends at this share of the peak lr."""
    weight_decay: float = Field(0.0, ge=0)
    """EAGLE-3's recipe uses none; the drafter underfits rather than overfits."""
    grad_clip: float = Field(0.5, gt=0)
    """Max global gradient norm (EAGLE's value): the soft-CE gradients of later unrolled steps
    spike early in training."""
    val_share: float = Field(0.05, ge=0, lt=1)
    """Share of sequences held out for validation (chosen by hashing seq_id with the seed)."""
    val_every: int = Field(100, ge=1)
    """Validate every N steps, and after the last step."""
    validations: PositiveInt | None = optional_field(
        "validate this many times, evenly spaced over the run (overrides val_every): a run "
        "whose length is set by a budget gets a known number of points on its curve"
    )
    seed: int = 0
    bf16: Bf16Setting = "auto"
    """bf16 autocast (fp32 master weights): `auto` where the device runs bf16 natively (CUDA, a
    CPU with AMX: 1.4-1.8x faster there, ENV-NOTES; `pipeline.core.precision.native_bf16`),
    else fp32; true forces it (emulated, 7.8x slower, on an AVX2-only CPU). The version holds
    the resolved true/false (`resolved`), so fp32 and bf16 drafters never share one."""
    checkpoint_every: int = runtime_field(100, "save a resumable checkpoint every N steps")
    stop_after_steps: int | None = runtime_field(
        None, "stop (TrainingStopped) after N steps with a checkpoint saved; a re-run resumes"
    )
    threads: int | None = runtime_field(None, "torch intra-op threads (None = torch's default)")
    prefetch: int = runtime_field(4, "batches the loader thread prepares ahead")
    fsdp: bool = runtime_field(
        False,
        "shard the drafter's weights, gradients and optimizer state over the ranks (FSDP2 "
        "fully_shard) instead of replicating them (DDP), for drafters one GPU cannot train; a "
        "no-op in one process. Not part of the version: like the number of ranks it changes "
        "only where sums are rounded (the same global batch, schedule and checkpoint files; "
        "measured: per-step losses within 7e-8 relative of DDP's over 24 sft and opd steps "
        "on 2 gloo ranks; tests/pipeline/test_distributed.py holds them to one process's)",
    )

    def epoch_steps(self, per_epoch: int) -> int:
        """Optimizer steps of `steps`, else of `epochs` passes over `per_epoch` batches."""
        if self.steps is not None:
            return self.steps
        if self.epochs is None:
            raise OpdError("set steps or epochs")
        return math.ceil(self.epochs * per_epoch)

    def validation_steps(self, total_steps: int) -> set[int]:
        """The steps after which to validate: every `val_every`-th, or `validations` evenly
        spaced ones; the last step always."""
        if self.validations is None:
            every = set(range(self.val_every, total_steps + 1, self.val_every))
        else:
            n = self.validations
            every = {math.ceil(i * total_steps / n) for i in range(1, n + 1)}
        return every | {total_steps}


class Interrupts:
    """SIGINT and SIGTERM during training, deferred to the end of the step they land in, so the
    loop can save a checkpoint there (a signal mid optimizer step would leave half-updated
    weights); a second signal stops at once. Only the main thread may install signal handlers,
    so elsewhere (a Dask worker thread, say) signals act as they would without it."""

    def __init__(self) -> None:
        self.received: str | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> Interrupts:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame: object) -> None:
        if self.received is not None:
            raise KeyboardInterrupt(f"second {signal.Signals(signum).name}: stopping now")
        self.received = signal.Signals(signum).name
        log.warning(
            "%s: finishing this step and saving a checkpoint (send it again to stop at once)",
            self.received,
        )

    def any_rank(self) -> bool:
        """Whether any rank received a signal (every rank must stop at the same step)."""
        if training.world_size() == 1:
            return self.received is not None
        flag = torch.tensor([1.0 if self.received is not None else 0.0], dtype=torch.float64)
        return bool(training.all_reduce_sum(flag)[0] > 0)


class TrainingStopped(OpdError):
    """`stop_after_steps` was reached: the checkpoint is saved and a re-run resumes from it."""


def resolve_precision(cfg: TrainConfig, ctx: Any) -> TrainConfig:
    """`cfg` with `bf16` resolved on the device the run trains on, the target's (a training
    stage's `Stage.resolve`)."""
    if cfg.bf16 != "auto":
        return cfg
    target = ctx.target_loader.cfg
    device = torch.device("cuda") if target.device_map is not None else resolve_device(target)
    return cfg.model_copy(update={"bf16": resolve_bf16("auto", device)})


def autocast(device: torch.device, bf16: Bf16Setting) -> torch.autocast:
    """bf16 autocast where the `bf16` setting resolves to it on `device`, else fp32."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=resolve_bf16(bf16, device))


@dataclass
class StepOutput:
    """What a stage's `loss_step` returns for one batch on this rank."""

    loss: Tensor  # [] to back-propagate
    tokens: int
    row_steps: int  # drafter rows x unrolled steps (the budget unit of matched comparisons)
    extra: dict[str, Any] = field(default_factory=dict)  # more columns for the step's row


@dataclass
class TrainResult:
    steps: int
    per_epoch: int
    metrics: list[dict[str, Any]]
    seconds: float
    tokens: int
    row_steps: int
    stall_share: float  # share of step time spent waiting for the loader

    def summary(self) -> dict[str, Any]:
        train = [m for m in self.metrics if m["kind"] == "train"]
        vals = [m for m in self.metrics if m["kind"] == "val"]
        return {
            "steps": self.steps,
            "epochs": self.steps / self.per_epoch,
            "final_train_loss": train[-1]["loss"],
            "budget_row_steps": int(sum(m["row_steps"] for m in train)),
            "validation_start": vals[0] if vals and vals[0]["step"] == 0 else None,
            "seconds_this_run": round(self.seconds, 2),
            "tokens_per_s_this_run": round(self.tokens / max(self.seconds, 1e-9), 1),
            "row_steps_per_s_this_run": round(self.row_steps / max(self.seconds, 1e-9), 1),
            "loader_stall_share": round(self.stall_share, 4),
        }


def empty_row(schema: pa.Schema, kind: str, step: int, epoch: float) -> dict[str, Any]:
    return {name: None for name in schema.names} | {"kind": kind, "step": step, "epoch": epoch}


LossStep = Callable[[nn.Module, Any, int], StepOutput]
"""loss_step(forward, batch, step) -> StepOutput; `forward` is the (DDP-wrapped or
FSDP-sharded) module."""
Validate = Callable[[Drafter, int], dict[str, Any]]
"""validate(drafter, step) -> the metrics of a `val` row (summed over ranks); `drafter` holds
the current weights whole (a gathered copy under FSDP), so it may run any number of forwards."""


class Trainer:
    """Trains `drafter` through `forward` (a module whose forward runs the stage's unroll, so
    DDP sees one forward per backward) on the batches of `loader`."""

    def __init__(
        self,
        cfg: TrainConfig,
        *,
        stage: str,
        drafter: Drafter,
        forward: nn.Module,
        loader: training.FeatureLoader,
        total_steps: int,
        work_dir: Path,
        schema: pa.Schema = METRICS_SCHEMA,
        rank: int = 0,
        progress: bool = True,
        label: str | None = None,
    ):
        self.cfg, self.stage = cfg, stage
        self.drafter, self.forward, self.loader = drafter, forward, loader
        self.total, self.per_epoch = total_steps, len(loader)
        self.schema, self.rank, self.progress = schema, rank, progress
        self.label = label or stage
        self.checkpointer = training.Checkpointer(work_dir)
        self.sharded = False  # FSDP on: set by setup()
        self.step = 0
        self.metrics: list[dict[str, Any]] = []

    # -- setup -----------------------------------------------------------------------------

    def setup(self) -> None:
        """FSDP when on, optimizer and schedule, then resume from the newest checkpoint if
        there is one."""
        self.drafter.train()
        self.sharded = self._shard()
        self._setup_optimizer()
        self._resume()

    def _shard(self) -> bool:
        if not self.cfg.fsdp:
            return False
        world = training.world_size()
        if world == 1:
            # A no-op, not an error: one config runs at every scale (`--nproc` is the only change).
            log.info("[%s] fsdp is on but this is one process: training unsharded", self.label)
            return False
        training.shard_fsdp(self.forward)
        log.info("[%s] FSDP: drafter weights, gradients and optimizer state sharded over %d ranks",
                 self.label, world)  # fmt: skip
        return True

    def whole_drafter(self) -> Drafter:
        """The drafter with its current weights whole: itself, or under FSDP a plain copy
        gathered from every rank (a collective: every rank calls it)."""
        if not self.sharded:
            return self.drafter
        tensors = {k: training.full_tensor(v) for k, v in self.drafter.tensors().items()}
        return self.drafter.rebuilt(tensors, f"{self.label} (FSDP)")

    def _setup_optimizer(self) -> None:
        cfg = self.cfg
        self.optimizer = training.adamw(self.drafter, lr=cfg.lr, weight_decay=cfg.weight_decay)
        self.schedule = training.WarmupCosine(
            self.optimizer,
            total_steps=self.total,
            warmup_steps=round(cfg.warmup_ratio * self.total),
            min_lr_ratio=cfg.min_lr_ratio,
        )

    def _data_position(self, step: int) -> list[int]:
        return list(self.loader.position(step))

    def _resume(self) -> None:
        ckpt = self.checkpointer
        latest = ckpt.latest()
        if latest is None:
            return
        saved = ckpt.load(latest, optimizer=self.optimizer, scheduler=self.schedule)
        if saved.model.keys() != self.drafter.tensors().keys():
            raise OpdError(
                f"checkpoint {ckpt.path(latest)} holds other tensors than the drafter; delete it"
            )
        held = self.drafter.state_dict()  # under FSDP: this rank's shards
        model = {k: training.shard_like(v, held[k]) for k, v in saved.model.items()}
        self.drafter.load_state_dict(model, strict=False)  # embed_tokens is the target's
        self.step, self.metrics = saved.step, saved.state["metrics"]
        if saved.state["data_position"] != self._data_position(self.step):
            raise OpdError(f"checkpoint {ckpt.path(latest)} does not match this data; delete it")
        log.info("[%s] resuming from step %d (%s)", self.label, self.step, ckpt.path(latest))

    def _save(self, step: int) -> None:
        """Rank 0 writes the checkpoint; under FSDP every rank first gathers the whole tensors,
        so the files are the same as unsharded (and a run may resume across `fsdp`)."""
        if self.rank != 0 and not self.sharded:
            return
        model = {k: training.full_tensor(v) for k, v in self.drafter.tensors().items()}
        optimizer = (
            training.full_optimizer_state(self.optimizer.state_dict())
            if self.sharded
            else self.optimizer
        )
        if self.rank == 0:
            self.checkpointer.save(
                step,
                model=model,
                optimizer=optimizer,
                scheduler=self.schedule,
                state={"metrics": self.metrics, "data_position": self._data_position(step)},
            )

    # -- the loop --------------------------------------------------------------------------

    def _validate(self, validate: Validate, step: int) -> None:
        row = validate(self.whole_drafter(), step)
        self.metrics.append(empty_row(self.schema, "val", step, step / self.per_epoch) | row)

    def _optimizer_step(
        self, out: StepOutput, share: float, params: list[nn.Parameter], lr: float
    ) -> dict:
        # DDP averages gradients over the W ranks; weighing each rank's loss by W x its share of
        # the step's tokens makes that the token-weighted gradient of the whole batch, as one
        # process computes it (exactly for token-mean losses, closely for per-step means).
        world = training.world_size()
        (out.loss * (share * world if world > 1 else 1.0)).backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(params, self.cfg.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.schedule.step()
        counted = 1 if share > 0 else 0  # a stand-in row is not data
        sums = torch.tensor(
            [float(out.loss.detach()) * share, out.tokens * counted, out.row_steps * counted],
            dtype=torch.float64,
        )
        training.all_reduce_sum(sums)  # [loss, tokens, row_steps]
        return {
            "loss": float(sums[0]),
            "lr": lr,
            "grad_norm": float(grad_norm),
            "tokens": int(sums[1]),
            "row_steps": int(sums[2]),
        } | out.extra

    def train(
        self, loss_step: LossStep, validate: Validate | None, *, validate_at_start: bool = False
    ) -> TrainResult:
        """Steps until `total_steps`; returns the metrics of every step (resumed ones included)."""
        cfg, total = self.cfg, self.total
        val_steps = cfg.validation_steps(total)
        forward = self.forward if self.sharded else training.wrap_ddp(self.forward)
        params = [p for p in self.drafter.parameters() if p.requires_grad]
        bar = tqdm(
            total=total,
            initial=self.step,
            desc=self.label,
            unit="step",
            disable=not self.progress or self.rank != 0,
        )
        t_start, wait_start = time.perf_counter(), self.loader.wait_seconds
        tokens_run, row_steps_run, side_seconds = 0, 0, 0.0
        epoch, position = self.loader.position(self.step)
        try:
            with (
                # Installed before the starting validation: a stop request that lands in it is
                # deferred like one in a step, not left to the default handler (which another
                # library's signal check may swallow).
                Interrupts() as interrupts,
                contextlib.closing(self.loader.iterate(epoch, position, epochs=None)) as batches,
            ):
                if validate is not None and validate_at_start and self.step == 0:
                    self._validate(validate, 0)
                    if interrupts.any_rank():
                        training.barrier()
                        raise TrainingStopped(
                            f"stopped before step 1 of {total} "
                            f"({interrupts.received or 'a signal on another rank'}), after the "
                            "starting validation; re-run the stage to start again"
                        )
                for batch in batches:
                    t0 = time.perf_counter()
                    lr = self.schedule.lr
                    out = loss_step(forward, batch, self.step)
                    row = self._optimizer_step(out, batch.share, params, lr)
                    self.step += 1
                    step = self.step
                    row["tokens_per_s"] = row["tokens"] / max(time.perf_counter() - t0, 1e-9)
                    tokens_run += row["tokens"]
                    row_steps_run += row["row_steps"]
                    self.metrics.append(
                        empty_row(self.schema, "train", step, step / self.per_epoch) | row
                    )
                    bar.set_postfix(loss=f"{row['loss']:.3f}", tok_s=f"{row['tokens_per_s']:.0f}")
                    bar.update()

                    t_side = time.perf_counter()  # validation and checkpoints are not step time
                    if validate is not None and step in val_steps:
                        self._validate(validate, step)
                    interrupted = interrupts.any_rank()
                    stopping = interrupted or (
                        cfg.stop_after_steps is not None and step >= cfg.stop_after_steps
                    )
                    if (step % cfg.checkpoint_every == 0 or stopping) and step < total:
                        self._save(step)
                    side_seconds += time.perf_counter() - t_side
                    if stopping and step < total:
                        training.barrier()
                        why = interrupts.received or "a signal on another rank"
                        raise TrainingStopped(
                            f"stopped after step {step} of {total} "
                            f"({why if interrupted else 'stop_after_steps'}); "
                            f"re-run the stage to resume from {self.checkpointer.path(step)}"
                        )
                    if step >= total:
                        break
        finally:
            bar.close()
        seconds = time.perf_counter() - t_start
        stall = (self.loader.wait_seconds - wait_start) / max(seconds - side_seconds, 1e-9)
        training.barrier()
        return TrainResult(
            total, self.per_epoch, self.metrics, seconds, tokens_run, row_steps_run, stall
        )

    def finish(self) -> None:
        """The dataset is written: the checkpoints are no longer needed."""
        self.checkpointer.clear()
