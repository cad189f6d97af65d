"""Stage 3, `sft`: the EAGLE-3 warm-up, trained with training-time test on the target's features.

Consumes `features` (and the target it was made with: only its frozen embedding and LM head
are used, never a forward, unless the features are online, below); optionally a trained `drafter` to continue from and `more_features`
(same target and vocab map, e.g. the original features beside fresh rollouts) to train on too.
An optional `heldout` input (feature sequences the stage never trains on, e.g. a rollout of
held-out prompts by the starting drafter, so it carries the same vocab map) makes every
validation also log the teacher-forced acceptance on them as `heldout_*` (over drafting.k
steps, as `opd` logs it), starting at step 0, so runs of both stages are compared on the same
sequences.
A features input made with `features.mode=online` (or rollouts of such a run) holds tokens
and the vocab map only: each training and validation batch's hidden states are then computed by
the target inside the loop (one forward per batch, rounded to bf16 as the features stage stores
them), and the summary's `online_features` names the sequences they came from (a features
dataset's trajectories, or the rollouts) and counts the forwards. A resumed run
recomputes the same numbers, so resume stays exact.
Produces `sft`, a drafter dataset (layout in `pipeline.core.drafters`; the draft-vocab map is
copied unchanged from the features). A kind that needs no training (prompt lookup: no
`TrainableDrafter`) is written as built, with no step and `untrained: true` in its summary
(`write_untrained`), so evaluate, rollout, tune and export take it as any drafter; the sft
chain featurizes nothing for it (its features are the tokens and the map only).

Each step unrolls the drafter `ttt_steps` times over every row of a padded batch (step k feeds
back its own hidden state and reads ground-truth tokens) and minimises
sum_k step_decay^k * soft-CE(q_k, p), p = the target's distribution on the draft vocab,
recomputed from the cached last hidden state through the frozen LM head's draft-id rows. The
step's T=0 accuracy also needs the full vocabulary's argmax, which the whole head gives at V/Vd
times the cost (6x at SmolLM2's 49k / 8k): `models.teacher.ArgmaxCache` runs it the first time
a sequence is read and keeps the argmax for the later epochs (rebuilt on resume, same numbers).

`objective=eagle1` trains the same drafter with EAGLE-1's objective instead, to compare the
two: one teacher-forced step (no training-time test) minimising smooth-L1 between row t's
hidden_out and the target's last hidden state at t+1 (the state a chain step stands in for)
plus 0.1 x the soft-CE above (`models.losses.eagle1_loss`). Validation still unrolls
`ttt_steps` steps, so its per-step acceptance shows how each objective holds up down the chain.

The loop is `pipeline.core.trainer.Trainer` (shared with `opd`): written for `torchrun` (DDP, or
FSDP with `sft.fsdp`), resumable from checkpoints in `<root>/_work/sft/<version>/`, bit-for-bit
on CPU.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any, Literal

import torch
from pydantic import Field, field_validator, model_validator
from torch import nn

from models.drafter import Drafter, TrainableDrafter, require
from models.drafters import KINDS, drafter_class, recorded_settings
from models.kind import KindSettings
from models.losses import teacher_draft_probs
from models.teacher import ArgmaxCache
from models.vocab import DraftVocab
from pipeline.core import training
from pipeline.core.checks import check_drafter_vocab, check_same_target, check_same_vocab, vocab_of
from pipeline.core.config import DrafterConfig, default_drafter, optional_field
from pipeline.core.drafters import (
    check_continued_drafter,
    check_drafter_settings,
    load_drafter_dataset,
    needs_training,
    write_drafter_dataset,
    written_summary,
)
from pipeline.core.featurize import FeatureSource
from pipeline.core.runner import RunContext
from pipeline.core.stage import DRAFTER_DATASETS, Inputs, Stage
from pipeline.core.trainer import (
    METRICS_SCHEMA,
    StepOutput,
    TrainConfig,
    Trainer,
    TrainResult,
    autocast,
    resolve_precision,
)
from pipeline.core.validation import (
    features_of,
    heldout_loader,
    to_device,
    validate,
    validate_heldout,
)
from storage import Dataset, DatasetWriter, OpdError

VAL_KEYS = ("step", "loss", "acc", "alpha", "tau_sim", "tau_expected", "tau_chain")
SUMMARY_KEYS = (  # of the trainer's summary
    "steps",
    "epochs",
    "final_train_loss",
    "seconds_this_run",
    "tokens_per_s_this_run",
    "loader_stall_share",
)

log = logging.getLogger("opd")

# Every registered kind's SFT objectives; each kind's first is its default (the same as unset).
Objective = Literal[tuple(dict.fromkeys(o for k in KINDS.values() for o in k.objectives))]
DEFAULT_OBJECTIVES = {next(iter(k.objectives)) for k in KINDS.values() if k.objectives}
DEFAULT_STEP_DECAY = 0.8


def unrolled_steps(objective: str | None, ttt_steps: int) -> int:
    """Drafter steps each training row runs forward+backward: the row-step budget's factor."""
    return 1 if objective == "eagle1" else ttt_steps


class Config(TrainConfig):
    ttt_steps: int = Field(7, ge=1)
    """Unrolled drafting steps per training row; set through `drafting.ttt_steps`."""
    tau_k: int = Field(6, ge=1)
    """Draft length K of the simulated tau; set through `drafting.k`."""
    step_decay: float = Field(DEFAULT_STEP_DECAY, gt=0, le=1)
    """Step k's loss weight is step_decay^k (EAGLE-3's 0.8)."""
    temperature: float = Field(1.0, ge=0)
    """Teacher temperature; 0 trains on the target's argmax (a one-hot teacher)."""
    objective: Objective | None = optional_field(
        "eagle3 (unset): training-time test over ttt_steps; eagle1: EAGLE-1's feature "
        "regression + 0.1 x CE on one teacher-forced step, to compare the objectives. Unset "
        "rather than 'eagle3' by default so existing sft versions stay unchanged"
    )

    drafter: DrafterConfig | None = optional_field(
        "The drafter kind and its settings (set through the pipeline's `drafter` section); "
        "unset is EAGLE-3, so EAGLE-3 sft versions stay unchanged"
    )
    train_share: float | None = optional_field(
        "Train on this share of the training sequences (0 < share <= 1; unset or 1: all), for "
        "SFT's curve against data (`opd experiment sft-plateau`). Shares are nested (a smaller "
        "share's sequences are inside a larger one's) and the validation split is unchanged"
    )

    @field_validator("objective")
    @classmethod
    def _default_objective_is_unset(cls, value: str | None) -> str | None:
        # Naming the default explicitly must give the default's version.
        return None if value in DEFAULT_OBJECTIVES else value

    @field_validator("train_share")
    @classmethod
    def _whole_share_is_unset(cls, value: float | None) -> float | None:
        if value is not None and not 0 < value <= 1:
            raise ValueError(f"sft.train_share must be in (0, 1], got {value}")
        return None if value == 1 else value

    @field_validator("drafter")
    @classmethod
    def _default_drafter_is_unset(cls, value: KindSettings | None) -> KindSettings | None:
        return None if value == default_drafter() else value

    @model_validator(mode="after")
    def _check(self) -> Config:
        if self.tau_k > self.ttt_steps:
            raise ValueError(f"tau_k ({self.tau_k}) cannot exceed ttt_steps ({self.ttt_steps})")
        if self.steps is None and self.epochs is None:
            raise ValueError("set either steps or epochs")
        self._check_kind(self.drafter or default_drafter())
        if self.objective == "eagle1" and self.step_decay != DEFAULT_STEP_DECAY:
            raise ValueError(
                f"sft.step_decay ({self.step_decay}) weights training-time-test steps, which "
                "objective=eagle1 does not unroll: drop the step_decay setting"
            )
        return self

    def _check_kind(self, drafter: KindSettings) -> None:
        depth = drafter.max_draft_depth()
        if depth is not None and self.ttt_steps > depth:
            deeper = f"raise drafter.{drafter.depth_setting} or " if drafter.depth_setting else ""
            raise ValueError(
                f"drafting.ttt_steps ({self.ttt_steps}) trained offsets do not fit a "
                f"{drafter.kind} drafter drafting {depth} per step; {deeper}lower "
                "drafting.ttt_steps"
            )
        spec = KINDS[drafter.kind]
        if self.ttt_steps < drafter.trained_depth():
            raise ValueError(
                f"drafting.ttt_steps ({self.ttt_steps}) unrolls fewer depths than the "
                f"{drafter.trained_depth()} a {spec.title} drafter of {drafter.settings()} "
                "trains (the parts past them would never learn): raise drafting.ttt_steps or "
                "lower that setting"
            )
        if self.objective is not None and self.objective not in spec.objectives:
            raise ValueError(
                f"sft.objective={self.objective} is not a {spec.title} objective; unset it for a "
                f"{drafter.kind} drafter"
            )

    @property
    def unroll_depth(self) -> int:
        """Unrolled steps per training row (see `unrolled_steps`)."""
        return unrolled_steps(self.objective, self.ttt_steps)


def new_drafter(
    target: Any, vocab: DraftVocab, seed: int, drafter: KindSettings | None = None
) -> TrainableDrafter:
    """A freshly initialised drafter of the configured kind (the default kind when None) for
    `target` (deterministic in `seed`)."""
    drafter = drafter or default_drafter()
    cls = drafter_class(drafter.kind)
    require(cls, TrainableDrafter, "be trained")
    torch.manual_seed(seed)
    return cls.new(target, vocab, drafter.settings()).to(target.device)


def train_step(
    model: nn.Module,
    drafter: Drafter,
    batch: training.PaddedBatch,
    target: Any,
    cfg: Config,
    argmax: ArgmaxCache,
) -> StepOutput:
    """The objective's loss on one batch, with its per-step T=0 accuracy (summed over ranks).
    `model` is the drafter's training module (DDP-wrapped or FSDP-sharded); `argmax` the run's
    cache over the batches' FeatureIndex, for the drafter's vocab map (module docstring)."""
    b = to_device(batch, target.device)
    with torch.no_grad():
        # the draft ids' logits [B, T, Vd] and the full vocabulary's argmax [B, T]
        target_logits = argmax.teacher(b["last_hidden"], batch.rows, batch.lengths)
        teacher = teacher_draft_probs(target_logits, drafter.vocab, cfg.temperature)  # [B, T, Vd]
    with autocast(target.device, cfg.bf16):
        (out,) = model((features_of(b), b["loss_mask"], None, cfg.unroll_depth))
    loss = drafter.sft_loss(
        out, teacher, b["last_hidden"], decay=cfg.step_decay, objective=cfg.objective
    )
    chain_k = min(cfg.tau_k, cfg.unroll_depth)
    acc = drafter.acceptance(out, target_logits, chain_k=chain_k, expected=False).reduced(
        training.all_reduce_sum
    )
    tokens = batch.num_tokens
    return StepOutput(loss, tokens, tokens * cfg.unroll_depth, {"acc": acc.accuracy()})


def precheck(cfg: Config, inputs: Mapping[str, Dataset], ctx: RunContext) -> None:
    """Before the output's directory exists: a drafter to continue is of the configured kind
    and settings and was built for the trained offsets; a fresh drafter's settings fit the
    target (a DFlash block longer than its positions would only fail, or exhaust memory,
    once training allocates it)."""
    wanted = cfg.drafter or default_drafter()
    if not needs_training(wanted.kind):
        if "drafter" in inputs:
            raise OpdError(
                f"a {wanted.kind} drafter needs no training, so there is nothing to continue: "
                "drop --input drafter"
            )
        check_drafter_settings(wanted, ctx.target_loader.target)
        return
    try:
        require(drafter_class(wanted.kind), TrainableDrafter, "be trained")
    except ValueError as e:
        raise OpdError(str(e)) from None
    if "drafter" not in inputs:
        check_drafter_settings(wanted, ctx.target_loader.target)
        return
    source = inputs["drafter"]
    check_continued_drafter(source, wanted)
    depth = KINDS[wanted.kind].settings_of(recorded_settings(source.path)).max_draft_depth()
    if depth is not None and cfg.ttt_steps > depth:
        raise OpdError(
            f"drafting.ttt_steps ({cfg.ttt_steps}) trained offsets do not fit {source.ref}, a "
            f"{wanted.kind} drafter drafting {depth} per step: lower drafting.ttt_steps"
        )


def _starting_drafter(
    inputs: dict[str, Dataset], target: Any, vocab: DraftVocab, cfg: Config, ctx: RunContext
) -> Drafter:
    """A fresh drafter, or (continued SFT) the given one, which must use the features' map."""
    if "drafter" not in inputs:
        return new_drafter(target, vocab, cfg.seed, cfg.drafter)
    kind = (cfg.drafter or default_drafter()).kind
    drafter = load_drafter_dataset(inputs["drafter"], target, ctx.target_loader.identity, kind=kind)
    check_drafter_vocab(inputs["features"], drafter, str(inputs["drafter"].ref))
    return drafter.to(target.device)


def _setup_data(
    cfg: Config,
    sources: list[Dataset],
    rank: int,
    world_size: int,
    *,
    source: FeatureSource,
    pin_memory: bool = False,
) -> tuple[training.FeatureLoader, training.FeatureLoader]:
    """Train and validation loaders over the features, split by sequence with `cfg.seed`
    (`source`: the states the drafter reads, computed batch by batch for online features)."""
    index = training.FeatureIndex(sources, source.columns, source=source)
    train_rows, val_rows = training.holdout_split(index.keys, cfg.val_share, cfg.seed)
    if cfg.train_share is not None:
        train_rows = training.nested_subset(index.keys, train_rows, cfg.train_share, cfg.seed)
    common = dict(
        batch_size=cfg.batch_size,
        max_tokens=cfg.max_tokens,
        rank=rank,
        world_size=world_size,
        pin_memory=pin_memory,
    )
    train = training.FeatureLoader(
        index, train_rows, seed=cfg.seed, prefetch=cfg.prefetch, **common
    )
    val = training.FeatureLoader(index, val_rows, shuffle=False, equal_ranks=False, **common)
    return train, val


def _validator(
    cfg: Config,
    val: training.FeatureLoader,
    held: training.FeatureLoader | None,
    target: Any,
) -> Callable[[Drafter, int], dict[str, Any]] | None:
    """The trainer's validation: the objective on the held-out split, and the `heldout_*`
    acceptance when a `heldout` input is given (None: nothing to validate on)."""
    if not val.rows and held is None:
        return None

    def validation(model: Drafter, step: int) -> dict[str, Any]:
        row: dict[str, Any] = {}
        if val.rows:
            row = validate(
                model,
                val,
                target,
                ttt_steps=cfg.ttt_steps,
                tau_k=cfg.tau_k,
                temperature=cfg.temperature,
                step_decay=cfg.step_decay,
                bf16=cfg.bf16,
                objective=cfg.objective,
            )
            log.info(
                "[sft] step %d: val loss %s, acc %s, tau_sim %.3f, tau_chain %.3f",
                step,
                row["loss"],
                [round(a, 3) for a in row["acc"]],
                row["tau_sim"],
                row["tau_chain"],
            )
        if held is not None:
            row |= validate_heldout(model, held, target, k=cfg.tau_k, bf16=cfg.bf16)
            log.info("[sft] step %d: held-out tau_sim %.3f", step, row["heldout_tau_sim"])
        return row

    return validation


def _summary(
    cfg: Config,
    sources: list[Dataset],
    train: training.FeatureLoader,
    val: training.FeatureLoader,
    vocab: DraftVocab,
    ctx: RunContext,
    result: TrainResult,
    drafter_kind: str,
) -> dict[str, Any]:
    """The dataset's summary: its data, the last validation and the run's numbers."""
    last_val = next(
        (m for m in reversed(result.metrics) if m["kind"] == "val" and m["loss"] is not None), None
    )
    run_summary = result.summary()
    return {
        "features": str(sources[0].ref),
        "more_features": [str(ds.ref) for ds in sources[1:]],
        "train_sequences": len(train.rows),
        "val_sequences": len(val.rows),
        # What it trained: an EAGLE objective, or a kind's own loss (DFlash's decayed block CE).
        "objective": cfg.objective or drafter_kind,
        "draft_vocab_size": vocab.draft_vocab_size,
        "aux_layer_ids": list(ctx.target_loader.target.aux_layer_ids),
        "target": ctx.target_loader.identity,
        "validation": last_val and {k: last_val[k] for k in VAL_KEYS},
    } | {k: run_summary[k] for k in SUMMARY_KEYS}


def write_untrained(
    cfg: Config, feats: Dataset, output: DatasetWriter, ctx: RunContext
) -> dict[str, Any]:
    """A kind that needs no training (prompt lookup): its drafter as built from the settings,
    written with no training step and recorded as such (`untrained`), so evaluate, rollout,
    tune and export read it as any drafter dataset."""
    drafter = cfg.drafter or default_drafter()
    target = ctx.target_loader.target
    vocab_tensors = vocab_of(feats)
    vocab = DraftVocab(vocab_tensors["d2t"], vocab_tensors["t2d"])
    built = drafter_class(drafter.kind).new(target, vocab, drafter.settings())
    summary = {
        "features": str(feats.ref),
        "untrained": True,
        "objective": None,
        "draft_vocab_size": built.vocab.draft_vocab_size,
        "target": ctx.target_loader.identity,
        "steps": 0,
    }
    log.info(
        "[sft] a %s drafter needs no training: %s holds it untrained", drafter.kind, output.ref
    )
    return write_drafter_dataset(output, built, feats, [], METRICS_SCHEMA, summary)


def run(
    cfg: Config, inputs: Inputs, output: DatasetWriter, rank: int, world_size: int, ctx: RunContext
) -> dict:
    feats = inputs["features"]
    sources = [feats, *([inputs["more_features"]] if "more_features" in inputs else [])]
    heldout = inputs.get("heldout")
    for ds in [*sources, *([heldout] if heldout is not None else [])]:
        check_same_target(ds, ctx.target_loader.identity)
    rank, world_size = training.resolve_ranks(rank, world_size)
    if (summary := written_summary(output)) is not None:
        return summary
    if not needs_training((cfg.drafter or default_drafter()).kind):
        summary = write_untrained(cfg, feats, output, ctx) if rank == 0 else {}
        if world_size > 1 and rank == 0:
            output.wait_for_ranks()
        return summary
    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    target = ctx.target_loader.target
    check_same_vocab(feats, [*sources[1:], *([heldout] if heldout is not None else [])])
    vocab_tensors = vocab_of(feats)
    vocab = DraftVocab(vocab_tensors["d2t"], vocab_tensors["t2d"])

    pin = target.device.type == "cuda"
    source = FeatureSource.reading(target, (cfg.drafter or default_drafter()).reads())
    train, val = _setup_data(cfg, sources, rank, world_size, source=source, pin_memory=pin)
    held = None
    if heldout is not None:
        held = heldout_loader(heldout, cfg, rank, world_size, source=source, pin_memory=pin)
    drafter = _starting_drafter(inputs, target, vocab, cfg, ctx)
    trainer = Trainer(
        cfg,
        stage="sft",
        drafter=drafter,
        forward=drafter.training_module(),
        loader=train,
        total_steps=cfg.epoch_steps(len(train)),
        work_dir=output.store.root / "_work" / "sft" / output.version,
        rank=rank,
        progress=ctx.progress,
    )
    trainer.setup()
    log.info(
        "[sft] reads %s (%d train / %d val sequences); writes %s; %d steps, %d per epoch; "
        "checkpoints in %s",
        feats.ref,
        len(train.rows),
        len(val.rows),
        output.ref,
        trainer.total,
        trainer.per_epoch,
        trainer.checkpointer.directory,
    )

    # the drafter's map: the features' one, or the identity where it drafts over the target's head
    argmax = ArgmaxCache(target.lm_head_weight, drafter.vocab.draft_to_target_ids)

    def loss_step(model: nn.Module, batch: training.PaddedBatch, step: int) -> StepOutput:
        return train_step(model, drafter, batch, target, cfg, argmax)

    # With held-out sequences the curve starts at the starting drafter (step 0), as opd's does.
    result = trainer.train(
        loss_step, _validator(cfg, val, held, target), validate_at_start=held is not None
    )
    drafter = trainer.whole_drafter()
    if rank != 0:
        return {}
    summary = _summary(cfg, sources, train, val, vocab, ctx, result, drafter.kind)
    summary |= source.summary([*sources, *([heldout] if heldout is not None else [])])
    summary = write_drafter_dataset(output, drafter, feats, result.metrics, METRICS_SCHEMA, summary)
    trainer.finish()
    if world_size > 1:
        output.wait_for_ranks()
    return summary


STAGE = Stage(
    name="sft",
    output="sft",
    version="1",
    config=Config,
    run=run,
    resolve=resolve_precision,
    doc="drafter warm-up on cached features (EAGLE-3 training-time test, EAGLE-1's objective, or DFlash blocks)",
    inputs={"features": ("features", "rollouts")},
    # Continued SFT: start from a trained drafter; train on more feature sets (same map) too.
    optional_inputs={
        "drafter": DRAFTER_DATASETS,
        "more_features": ("features", "rollouts"),
        "heldout": ("rollouts", "features"),  # measured at every validation, never trained on
    },
    drafting={"ttt_steps": "ttt_steps", "tau_k": "k"},
    ddp=True,
    precheck=precheck,
)
