"""Stage 6, `opd`: Draft-OPD, the drafter trained on its own replayed proposals.

Consumes `replays` (drafting replayed by the current drafter from the rollout's error positions,
every proposal scored by the target), the `rollouts` they were replayed on (the sequences and
their target features, or only the tokens when online, below), the `drafter` to start from (an
`sft` or `opd` dataset) and, optionally,
`features` for a soft-CE anchor on SFT data. Produces `opd` with the `sft` dataset's layout:
`model.safetensors` + `drafter_config.json`, `draft_vocab.safetensors` copied unchanged from the
drafter (the map is frozen since stage 2; replays of another map are refused), `metrics.parquet`
and `summary.json`, so `load_drafter_dataset`, `evaluate` and the next round's rollout take it.

One training item is one (rollout sequence, replay sample): every anchor e of that sequence is a
row of ONE training-time-test unroll over the sequence (`Drafter.unroll(..., replays=...)`):
  step 0, row e-2: reads the rollout's target feature f_{e-2} and the committed token y_{e-1}
    (the prefix y<e) and predicts y-hat_1 at position e;
  step k >= 1, row e-2: reads ONLY its own hidden state of step k-1 and the replayed token
    y-hat_k, and predicts y-hat_{k+1}.
Rows are independent after step 0 (a chain sees step-0 keys of rows <= e-2, all in the prefix,
and its own chain keys), so anchors of one sequence train together. The target contributes only
the loss: teacher p_k = softmax(lm_head(teacher_hidden_k) / T) on the draft vocab, recomputed
exactly through the frozen head from the replay's post-norm hidden states.
A block drafter (DFlash, `Drafter.drafts_blocks`) reads no draft: each replay is the block at
position e-1, an extra block of the sequence's one training forward (models/dflash/train.py, models/blocks.py).

Losses (`loss`): "draft_opd" (forward KL on accepted proposals + gamma^k-decayed reverse KL on
rejected ones; for a block drafter its block form, `models.losses.block_opd_loss`),
"reverse_kl_k1" / "reverse_kl_k3" (sampled reverse KL on the replayed tokens, score-function
gradient), "tv" (1 - alpha) and "expected_length" (maximise sum_k prod_{i<=k} alpha_i along the
replayed path). A block drafter refuses, before any work, those that do not apply to blocks
(`models.losses.block_loss_error`). At a replay temperature > 0 a proposal's acceptance is drawn
from its recorded accept probability with a seeded generator, so a resumed run draws the same.

`ce_lambda` > 0 adds lambda x the EAGLE-3 TTT soft-CE: on batches of the `features` input when
given, else on the rollout sequences' own teacher-forced rows inside the same unroll (no extra
drafter forward: every non-anchor row already is an SFT row). A `features` input made with
`features.mode=online` holds no hidden states: the target computes each anchor batch's inside
the loop (as sft does; the summary's `online_features` counts the forwards).

Online rollouts (meta `mode: online`, a run with `features.mode=online`) hold no hidden states
either: the loaders compute each batch's (training items, replay and teacher-forced
validation) with one target forward over its token rows on the training thread
(`ReplayIndex.featurize`), rounded to bf16 as the cache stores them, so where that forward's
padded width equals the rollout's (one sequence a batch in both) the drafter is the cached
run's byte for byte. The replays' teacher_hidden is stored per replay slot in both modes. The
next round's rollout of this drafter is online too (`featurize.trained_online`).

Budget: every step logs `row_steps`, the drafter rows it ran forward and backward times the
unrolled steps; `budget_row_steps` sets the number of optimizer steps so their sum reaches it
(matched-compute comparisons, see lab/experiments/).

An empty `replays` dataset (a drafter that was never rejected) is a no-op: the output is the
input drafter unchanged, with `"trained": false` in its summary, so a chain goes on.

The loop is `pipeline.core.trainer.Trainer`, shared with `sft` (checkpoints with exact resume in
`<root>/_work/opd/<version>/`, DDP or FSDP (`opd.fsdp`) under `torchrun`; online features are
recomputed on resume, the same bytes). Validation on held-out sequences (by
seq_id): the replay loss and per-step acceptance on their replays, and the teacher-forced
acceptance / simulated tau on their rollout features (as `sft` reports it); with an optional
`heldout` input, also the teacher-forced acceptance on those sequences (`heldout_*`, as `sft`
logs it), so an opd run and a continued-SFT run are compared on the same sequences.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import pyarrow as pa
import torch
from pydantic import Field, field_validator, model_validator
from torch import Tensor, nn

from models.drafter import Drafter, TrainableDrafter, require
from models.drafters import drafter_class, kind_spec
from models.losses import (
    ReplayLoss,
    acceptance_rate,
    block_loss_error,
    replay_loss,
    teacher_draft_probs,
)
from pipeline.core import training, validation
from pipeline.core.budget import step_costs, steps_for_budget
from pipeline.core.checks import (
    check_drafter_kind,
    check_made_by,
    check_same_target,
    check_same_vocab,
)
from pipeline.core.config import optional_field
from pipeline.core.drafters import (
    drafter_kind,
    load_drafter_dataset,
    refuse_untrained,
    write_drafter_dataset,
    written_summary,
)
from pipeline.core.featurize import FeatureSource
from pipeline.core.replays import ReplayBatch, ReplayIndex, replay_outcomes
from pipeline.core.runner import RunContext
from pipeline.core.stage import DRAFTER_DATASETS, Inputs, Stage
from pipeline.core.trainer import METRICS_SCHEMA as TRAIN_METRICS_SCHEMA
from pipeline.core.trainer import (
    StepOutput,
    TrainConfig,
    Trainer,
    TrainResult,
    autocast,
    resolve_precision,
)
from storage import Dataset, DatasetWriter, OpdError

log = logging.getLogger("opd")

METRICS_SCHEMA = pa.schema(
    [
        *TRAIN_METRICS_SCHEMA,
        ("ttt_loss", pa.float64()),  # val: teacher-forced soft-CE on held-out rollout sequences
        ("replay_acc", pa.list_(pa.float64())),  # val, per replay step: argmax q == target argmax
        ("replay_alpha", pa.list_(pa.float64())),  # val, per replay step: sum min(p, q) at T=1
        ("replay_tau_sim", pa.float64()),
        ("replay_tau_expected", pa.float64()),
    ]
)


class Config(TrainConfig):
    round: int = Field(1, ge=1)
    """Which Draft-OPD round this is; part of the version, so each round gets its own dataset."""
    loss: ReplayLoss = "draft_opd"
    gamma: float = Field(0.8, gt=0, le=1)
    """draft_opd: rejected proposals at block position k (0-based) weigh gamma^k."""
    lambda_accept: float = Field(1.0, ge=0)
    lambda_reject: float = Field(1.0, ge=0)
    fit_boundary: bool | None = optional_field(
        "draft_opd on chains: the first rejected draft of each replay also takes forward KL to "
        "its teacher (its context is all accepted, so its teacher is what it should match), as "
        "the block form always does. Unset: reverse KL only there"
    )
    temperature: float = Field(1.0, gt=0)
    """Temperature of the teacher p and of the drafter's q inside the losses. Positive even for a
    greedy (T=0) replay: a one-hot teacher makes the reverse KL infinite; the replay's own
    temperature still decides which proposals count as accepted."""
    positions: Literal["all", "reached"] = "all"
    """Which replayed positions enter the loss: all K, or only those verification reaches
    (up to and including the first rejection, acceptance drawn from accept_prob)."""
    ce_lambda: float = Field(1.0, ge=0)
    """Weight of the EAGLE-3 soft-CE anchor; 0 = none. On by default: on the embedded target it
    was never worse and the replay loss alone moved held-out tau less (see lab/experiments/)."""
    ce_source: Literal["rollouts", "features"] = "rollouts"
    """Where the anchor's rows come from: the rollout sequences' own teacher-forced rows (free:
    they are in the replay unroll already) or batches of the `features` input (an extra unroll)."""
    ce_ttt_steps: int = Field(3, ge=1)
    """Unrolled steps of the soft-CE anchor on `features` batches (rollout rows use the replay's K)."""
    budget_row_steps: int | None = Field(None, ge=1)
    """Train until the drafter has run this many rows x unrolled steps (forward + backward);
    overrides `epochs`."""
    val_ttt_steps: int = Field(6, ge=1)
    """Steps of the teacher-forced validation on held-out rollout sequences (= its tau's K);
    set through `drafting.k`."""
    # Fine-tuning a trained drafter, not warming up a fresh one: smaller batches and lr, a
    # longer warm-up, more held out (replayed sequences are fewer than SFT's) and checked more
    # often.
    batch_size: int = Field(8, ge=1)
    """Training items (sequence, sample) per batch per rank."""
    lr: float = Field(3e-4, gt=0)
    """Peak lr: lower than the SFT warm-up's, since this fine-tunes a trained drafter."""
    warmup_ratio: float = Field(0.05, ge=0, lt=1)
    val_share: float = Field(0.1, ge=0, lt=1)
    """Share of rollout sequences held out (by seq_id) with all their replays."""
    val_every: int = Field(50, ge=1)

    @field_validator("fit_boundary")
    @classmethod
    def _off_is_unset(cls, value: bool | None) -> bool | None:
        return value or None  # off and unset are one version

    @model_validator(mode="after")
    def _check(self) -> Config:
        if self.steps is None and self.budget_row_steps is None and self.epochs is None:
            raise ValueError("set one of steps, budget_row_steps or epochs")
        return self


# -- data ----------------------------------------------------------------------------------


# -- the unroll and the losses ---------------------------------------------------------------


def _replay_loss(
    cfg: Config,
    logits: Tensor,
    target_logits: Tensor,
    tokens: Tensor,
    accepted: Tensor,
    mask: Tensor,
    drafter: Drafter,
) -> Tensor:
    """`models.losses.replay_loss` with the stage's loss settings (training and validation)."""
    return replay_loss(
        cfg.loss,
        logits,
        target_logits,
        tokens,
        accepted,
        mask,
        drafter.vocab,
        temperature=cfg.temperature,
        gamma=cfg.gamma,
        lambda_accept=cfg.lambda_accept,
        lambda_reject=cfg.lambda_reject,
        fit_boundary=bool(cfg.fit_boundary),
        blocks=drafter.drafts_blocks,
    )


# -- budget, validation ----------------------------------------------------------------------


def _cycle(loader: training.FeatureLoader, start: int) -> Iterator[training.PaddedBatch]:
    """Batches from global batch index `start` on, epoch after epoch (the CE anchor's stream)."""
    epoch, position = loader.position(start)
    while True:
        with contextlib.closing(loader.iterate(epoch, position)) as batches:
            yield from batches
        epoch, position = epoch + 1, 0


@torch.no_grad()
def validate_replays(
    drafter: Drafter, loader: training.FeatureLoader, target: Any, cfg: Config
) -> dict[str, Any]:
    """Held-out replay loss and, per replay step, greedy hit rate and expected alpha at T=1."""
    vocab = drafter.vocab
    device = next(drafter.parameters()).device
    K = loader.index.depth
    sums = torch.zeros(2 + 3 * K, dtype=torch.float64)  # loss x N, N, hits[K], alpha[K], n[K]
    generator = torch.Generator().manual_seed(cfg.seed)
    was_training = drafter.training
    drafter.eval()
    with contextlib.closing(loader.iterate(0)) as batches:
        for batch in batches:
            b = batch.to(device)
            with autocast(device, cfg.bf16):
                out = drafter.unroll(b.features, None, K, replays=(b.item, b.anchor, b.tokens))
            logits = drafter.replay_logits(out, b.item, b.anchor)  # [N, K, Vd]
            target_logits = target.teacher(b.teacher_hidden, vocab, [cfg.temperature])  # [N, K, V]
            accepted, mask = replay_outcomes(
                b.accept_prob, b.replay_length, cfg.positions, generator
            )
            loss = _replay_loss(cfg, logits, target_logits, b.tokens, accepted, mask, drafter)
            verified = (torch.arange(K, device=device) < b.replay_length[:, None]).double()
            hits = vocab.to_target(logits.argmax(-1)) == target_logits.argmax(-1)  # [N, K]
            p_full = teacher_draft_probs(target_logits, vocab, 1.0, renormalize=False)
            alpha = acceptance_rate(logits.softmax(-1), p_full)  # [N, K]
            n = len(b.item)
            sums += torch.cat(
                [
                    torch.tensor([float(loss) * n, n], dtype=torch.float64),
                    (hits.double() * verified).sum(0).cpu(),
                    (alpha.double() * verified).sum(0).cpu(),
                    verified.sum(0).cpu(),
                ]
            )
    drafter.train(was_training)
    training.all_reduce_sum(sums)
    n = sums[2 + 2 * K :].clamp_min(1)
    acc, alpha = sums[2 : 2 + K] / n, sums[2 + K : 2 + 2 * K] / n
    return {
        "loss": float(sums[0] / sums[1].clamp_min(1)),
        "replay_acc": acc.tolist(),
        "replay_alpha": alpha.tolist(),
        "replay_tau_sim": float(1 + acc.cumprod(0).sum()),
        "replay_tau_expected": float(1 + alpha.cumprod(0).sum()),
    }


def _validate(drafter: Drafter, data: _Data, target: Any, cfg: Config) -> dict[str, Any]:
    replay_val, ttt_val = data.replay_val, data.ttt_val
    row: dict[str, Any] = {}
    if ttt_val is not None:
        ttt = validation.validate(
            drafter,
            ttt_val,
            target,
            ttt_steps=cfg.val_ttt_steps,
            tau_k=cfg.val_ttt_steps,
            temperature=cfg.temperature,
            step_decay=cfg.gamma,
            bf16=cfg.bf16,
        )
        row |= {k: ttt[k] for k in ("acc", "alpha", "tau_sim", "tau_expected", "tau_chain")}
        row["ttt_loss"] = ttt["loss"]
    if replay_val is not None:
        row |= validate_replays(drafter, replay_val, target, cfg)
    if data.heldout is not None:
        row |= validation.validate_heldout(
            drafter, data.heldout, target, k=cfg.val_ttt_steps, bf16=cfg.bf16
        )
    return row


# -- the stage -------------------------------------------------------------------------------


def precheck(cfg: Config, inputs: Mapping[str, Dataset], ctx: RunContext) -> None:
    """Everything must come from one target, one vocab map, the rollouts replayed on, and the
    drafter being trained (on-policy data belongs to the drafter that made it)."""
    replays, rollouts, source = inputs["replays"], inputs["rollouts"], inputs["drafter"]
    feats, heldout = inputs.get("features"), inputs.get("heldout")
    for ds in (replays, rollouts, source, feats, heldout):
        if ds is not None:
            check_same_target(ds, ctx.target_loader.identity)
    kind = drafter_kind(source)
    refuse_untrained(kind, f"opd (training {source.ref} on replays)")
    try:
        require(drafter_class(kind), TrainableDrafter, "be trained on replays")
    except ValueError as e:
        raise OpdError(f"{source.ref}: {e}") from None
    for data in (rollouts, replays):
        check_drafter_kind(data, kind, str(source.ref))
    if kind_spec(kind).drafts_blocks and (error := block_loss_error(cfg.loss, cfg.positions)):
        raise OpdError(f"{source.ref} is a {kind} drafter: {error}")
    check_made_by(rollouts, source)
    check_made_by(replays, source)
    scored_on = replays.inputs.get("rollouts")
    if scored_on is not None and scored_on != str(rollouts.ref):
        raise OpdError(
            f"{replays.ref} was scored on {scored_on}, not on {rollouts.ref}: pass the rollouts "
            "its seq_ids and anchors refer to"
        )
    check_same_vocab(source, [d for d in (replays, rollouts, feats, heldout) if d is not None])
    wants_features = cfg.ce_lambda > 0 and cfg.ce_source == "features"
    if wants_features != (feats is not None):
        raise OpdError(
            "the features input feeds the soft-CE anchor only: pass it exactly when ce_lambda > 0 "
            f"and ce_source='features' (got ce_lambda={cfg.ce_lambda}, ce_source={cfg.ce_source!r}, "
            f"features {'given' if feats is not None else 'not given'})"
        )


@dataclass
class _Data:
    """The loaders of one opd run: training items, their validation splits, the CE anchor."""

    index: ReplayIndex
    train_items: list[int]
    val_items: list[int]
    train: training.FeatureLoader
    replay_val: training.FeatureLoader | None
    ttt_val: training.FeatureLoader | None
    anchor: training.FeatureLoader | None
    heldout: training.FeatureLoader | None


def _setup_data(
    cfg: Config,
    inputs: dict[str, Dataset],
    vocab: Any,
    rank: int,
    world_size: int,
    *,
    source: FeatureSource,
    pin_memory: bool = False,
) -> _Data:
    """The run's loaders; `source` gives the states the drafter reads, computing them batch by
    batch for online datasets (the rollouts, the anchor's features, a held-out one)."""
    replays, rollouts = inputs["replays"], inputs["rollouts"]
    ce_on_rollouts = cfg.ce_lambda > 0 and cfg.ce_source == "rollouts"
    index = ReplayIndex(replays, rollouts, full_sequences=ce_on_rollouts, source=source)
    bad = vocab.to_draft(index.tokens) < 0
    if bad.any():
        raise OpdError(
            f"{replays.ref} replays token {int(index.tokens[bad][0])}, which is outside the draft "
            "vocab: the replays were not drafted with this vocab map"
        )
    seqs = index.features.keys
    _, val_seqs = training.holdout_split(seqs, cfg.val_share, cfg.seed)
    held_out = {seqs[i] for i in val_seqs}
    train_items = [i for i, key in enumerate(index.keys) if key not in held_out]
    val_items = [i for i, key in enumerate(index.keys) if key in held_out]
    if not train_items:
        raise OpdError(
            f"all {len(index)} replayed sequences of {replays.ref} are held out for validation: "
            "lower val_share or replay more sequences"
        )
    common = dict(
        batch_size=cfg.batch_size,
        max_tokens=cfg.max_tokens,
        rank=rank,
        world_size=world_size,
        pin_memory=pin_memory,
    )
    held = dict(shuffle=False, equal_ranks=False, **common)
    anchor = None
    if "features" in inputs:
        feature_index = training.FeatureIndex(
            inputs["features"], index.features.columns, source=source
        )
        anchor = training.FeatureLoader(
            feature_index,
            range(len(feature_index)),
            seed=cfg.seed + 1,
            prefetch=cfg.prefetch,
            **common,
        )
    return _Data(
        index=index,
        train_items=train_items,
        val_items=val_items,
        train=training.FeatureLoader(
            index, train_items, seed=cfg.seed, prefetch=cfg.prefetch, **common
        ),
        replay_val=training.FeatureLoader(index, val_items, **held) if val_items else None,
        ttt_val=training.FeatureLoader(index.features, val_seqs, **held) if val_seqs else None,
        anchor=anchor,
        heldout=validation.heldout_loader(
            inputs["heldout"], cfg, rank, world_size, source=source, pin_memory=pin_memory
        )
        if "heldout" in inputs
        else None,
    )


def _total_steps(cfg: Config, data: _Data, world_size: int) -> int:
    """`steps`, else the steps whose row-steps reach `budget_row_steps`, else `epochs` passes."""
    if cfg.steps is not None or cfg.budget_row_steps is None:
        return cfg.epoch_steps(len(data.train))
    anchor = data.anchor

    @functools.cache
    def replay_costs(epoch: int) -> list[int]:
        return step_costs(
            data.index.lengths,
            data.train_items,
            steps_per_row=data.index.depth,
            epoch=epoch,
            cfg=cfg,
            world_size=world_size,
        )

    @functools.cache
    def anchor_costs(epoch: int) -> list[int]:
        return step_costs(
            anchor.index.lengths,
            anchor.rows,
            steps_per_row=cfg.ce_ttt_steps,
            epoch=epoch,
            cfg=cfg.model_copy(update={"seed": cfg.seed + 1}),
            world_size=world_size,
        )

    def step_cost(step: int) -> int:
        epoch, position = data.train.position(step)
        cost = replay_costs(epoch)[position]
        if anchor is not None:
            epoch, position = anchor.position(step)
            cost += anchor_costs(epoch)[position]
        return cost

    return steps_for_budget(cfg.budget_row_steps, step_cost)


def replay_step(
    model: nn.Module,
    drafter: Drafter,
    batch: ReplayBatch,
    step: int,
    anchor_batch: training.PaddedBatch | None,
    *,
    target: Any,
    vocab: Any,
    cfg: Config,
    rank: int,
) -> StepOutput:
    """The Draft-OPD loss of one batch of replays (+ the soft-CE anchor when on). `model` is
    the drafter's training module (DDP-wrapped or FSDP-sharded)."""
    device = target.device
    K = batch.tokens.shape[1]
    b = batch.to(device)
    # Seeded by step and rank, so a resumed run draws the same acceptances.
    generator = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step * 7919 + rank)
    accepted, mask = replay_outcomes(b.accept_prob, b.replay_length, cfg.positions, generator)
    with torch.no_grad():
        target_logits = target.teacher(b.teacher_hidden, vocab, [cfg.temperature])  # [N, K, V]
    unrolls = [(b.features, b.loss_mask, (b.item, b.anchor, b.tokens), K)]
    if anchor_batch is not None:
        fb = validation.to_device(anchor_batch, device)
        unrolls.append((validation.features_of(fb), fb["loss_mask"], None, cfg.ce_ttt_steps))
    with autocast(device, cfg.bf16):
        outs = model(*unrolls)
    logits = drafter.replay_logits(outs[0], b.item, b.anchor, lazy=True)  # [N, K, Vd]
    loss = _replay_loss(cfg, logits, target_logits, b.tokens, accepted, mask, drafter)
    tokens, row_steps = int(batch.lengths.sum()), batch.row_steps
    if cfg.ce_lambda > 0 and cfg.ce_source == "rollouts":
        with torch.no_grad():
            teacher = target.draft_teacher(b.last_hidden, vocab, cfg.temperature)
        loss = loss + cfg.ce_lambda * drafter.rollout_ce_loss(
            outs[0], teacher, b.item, b.anchor, cfg.gamma
        )
    if anchor_batch is not None:
        with torch.no_grad():
            teacher = target.draft_teacher(fb["last_hidden"], vocab, cfg.temperature)
        anchor_loss = drafter.sft_loss(
            outs[1], teacher, fb["last_hidden"], decay=cfg.gamma, objective=None
        )
        loss = loss + cfg.ce_lambda * anchor_loss
        tokens += anchor_batch.num_tokens
        row_steps += anchor_batch.num_tokens * cfg.ce_ttt_steps
    return StepOutput(loss, tokens, row_steps)


def _pass_through(
    output: DatasetWriter, source: Dataset, replays: Dataset, base: dict, rank: int
) -> dict:
    """No replays (the drafter was never rejected): the round's drafter is its input's."""
    log.warning(
        "[opd] %s is empty (the drafter was never rejected): nothing to train on; %s is %s "
        "unchanged",
        replays.ref,
        output.ref,
        source.ref,
    )
    summary = base | {"trained": False, "reason": f"{replays.ref} has no replays", "steps": 0}
    if rank == 0:
        summary = write_drafter_dataset(output, source, source, [], METRICS_SCHEMA, summary)
    return summary


def _trained_summary(cfg: Config, data: _Data, result: TrainResult) -> dict:
    vals = [m for m in result.metrics if m["kind"] == "val"]
    return {k: v for k, v in result.summary().items() if k != "tokens_per_s_this_run"} | {
        "trained": True,
        "depth": data.index.depth,
        "train_items": len(data.train_items),
        "val_items": len(data.val_items),
        "train_replays": int(sum(len(data.index.items[i][1]) for i in data.train_items)),
        "ce_anchor": cfg.ce_source if cfg.ce_lambda > 0 else None,
        "validation": vals[-1] if vals else None,
    }


def _trainer(
    cfg: Config,
    drafter: Drafter,
    data: _Data,
    output: DatasetWriter,
    rank: int,
    world_size: int,
    ctx: RunContext,
    source: Dataset,
    replays: Dataset,
) -> Trainer:
    """The round's trainer, set up (resumed where a checkpoint exists) and announced."""
    trainer = Trainer(
        cfg,
        stage="opd",
        drafter=drafter,
        forward=drafter.training_module(),
        loader=data.train,
        total_steps=_total_steps(cfg, data, world_size),
        work_dir=output.store.root / "_work" / "opd" / output.version,
        schema=METRICS_SCHEMA,
        rank=rank,
        progress=ctx.progress,
        label=f"opd-r{cfg.round}",
    )
    trainer.setup()
    log.info(
        "[opd] round %d: %s on %s (%d train / %d val items, K=%d, loss %s); %d steps, %d per "
        "epoch; checkpoints in %s",
        cfg.round,
        source.ref,
        replays.ref,
        len(data.train_items),
        len(data.val_items),
        data.index.depth,
        cfg.loss,
        trainer.total,
        trainer.per_epoch,
        trainer.checkpointer.directory,
    )
    return trainer


def run(
    cfg: Config, inputs: Inputs, output: DatasetWriter, rank: int, world_size: int, ctx: RunContext
) -> dict:
    replays, rollouts, source = inputs["replays"], inputs["rollouts"], inputs["drafter"]
    identity = ctx.target_loader.identity
    rank, world_size = training.resolve_ranks(rank, world_size)
    if (summary := written_summary(output)) is not None:
        return summary
    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    target = ctx.target_loader.target
    base = {
        "round": cfg.round,
        "drafter": str(source.ref),
        "replays": str(replays.ref),
        "rollouts": str(rollouts.ref),
        "target": identity,
        "loss": cfg.loss,
    }
    if replays.num_rows == 0:
        return _pass_through(output, source, replays, base, rank)

    drafter = load_drafter_dataset(source, target, identity)
    features = FeatureSource.reading(target, drafter.reads)
    data = _setup_data(
        cfg,
        inputs,
        drafter.vocab,
        rank,
        world_size,
        pin_memory=target.device.type == "cuda",
        source=features,
    )
    trainer = _trainer(cfg, drafter, data, output, rank, world_size, ctx, source, replays)
    anchor_stream = _cycle(data.anchor, trainer.step) if data.anchor is not None else None

    def loss_step(model: nn.Module, batch: ReplayBatch, step: int) -> StepOutput:
        anchor_batch = next(anchor_stream) if anchor_stream is not None else None
        return replay_step(
            model,
            drafter,
            batch,
            step,
            anchor_batch,
            target=target,
            vocab=drafter.vocab,
            cfg=cfg,
            rank=rank,
        )

    def validation(model: Drafter, step: int) -> dict[str, Any]:
        row = _validate(model, data, target, cfg)
        log.info(
            "[opd] step %d: val replay loss %s, replay acc %s, tau_sim %s, held-out tau_sim %s",
            step,
            row.get("loss"),
            [round(a, 3) for a in row.get("replay_acc") or []],
            row.get("tau_sim"),
            row.get("heldout_tau_sim"),
        )
        return row

    has_val = any(v is not None for v in (data.replay_val, data.ttt_val, data.heldout))
    with contextlib.closing(anchor_stream) if anchor_stream else contextlib.nullcontext():
        result = trainer.train(
            loss_step, validation if has_val else None, validate_at_start=has_val
        )
    drafter = trainer.whole_drafter()
    if rank != 0:
        return {}
    online = features.summary([ds for _, ds in sorted(inputs.items())])
    summary = base | _trained_summary(cfg, data, result) | online
    summary = write_drafter_dataset(
        output, drafter, source, result.metrics, METRICS_SCHEMA, summary
    )
    trainer.finish()
    if world_size > 1:
        output.wait_for_ranks()
    return summary


STAGE = Stage(
    name="opd",
    output="opd",
    version="1",
    config=Config,
    run=run,
    resolve=resolve_precision,
    doc="Draft-OPD: train the drafter on its own replayed proposals, scored by the target",
    inputs={"replays": ("replays",), "rollouts": ("rollouts",), "drafter": DRAFTER_DATASETS},
    optional_inputs={
        "features": ("features",),  # the soft-CE anchor's data (ce_source)
        "heldout": ("rollouts", "features"),  # measured at every validation, never trained on
    },
    default_inputs={"drafter": "sft@latest"},
    precheck=precheck,
    per_round=True,
    drafting={"val_ttt_steps": "k"},
    ddp=True,
)
