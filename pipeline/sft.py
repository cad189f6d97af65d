"""Stage 3, `sft`: the EAGLE-3 warm-up, trained with training-time test on cached features.

Consumes `features` (and the target it was made with: only its frozen embedding and LM head
are used, never a forward); optionally a trained `drafter` to continue from and `more_features`
(same target and vocab map, e.g. the original features beside fresh rollouts) to train on too.
Produces `sft`: `model.safetensors` + `drafter_config.json` (load
with `models.drafter.load_drafter(dataset.path, target.embed_weight)`), `draft_vocab.safetensors`
copied unchanged from the features, `metrics.parquet` (one `train` row per step, one `val` row
per validation) and `summary.json` (the manifest's meta).

Each step unrolls the drafter `ttt_steps` times over every row of a padded batch (step k feeds
back its own hidden state and reads ground-truth tokens) and minimises
sum_k step_decay^k * soft-CE(q_k, p), p = the target's distribution on the draft vocab,
recomputed from the cached last hidden state through the frozen LM head.

Written for `torchrun`: with torch.distributed initialised, ranks take every W-th batch, DDP
averages gradients, and only rank 0 writes checkpoints and the dataset. Checkpoints live in
`<root>/_work/sft/<version>/` until the dataset is written; a killed run resumes from the
newest one and ends bit-for-bit where an uninterrupted run would (on CPU).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import tempfile
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import torch
from pydantic import Field, model_validator
from safetensors.torch import load_file
from torch import Tensor, nn
from tqdm import tqdm

from models.drafter import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    DrafterConfig,
    DraftVocab,
    Eagle3Drafter,
    drafter_tensors,
    save_drafter,
    ttt_unroll,
)
from models.losses import teacher_draft_probs, ttt_loss
from pipeline import training
from pipeline.config import StrictConfig, runtime_field
from pipeline.drafters import load_drafter_dataset
from pipeline.features import VOCAB_FILE, check_same_target, check_same_vocab
from pipeline.runner import RunContext
from storage import Dataset, DatasetWriter, OpdError

OUTPUT = "sft"
STAGE = "sft"
VERSION = "1"
INPUTS = ("features",)
# Continued SFT: given a trained `drafter` (sft/opd dataset), training starts from it, not fresh;
# `more_features` (same target and vocab map) are trained on together with `features`.
OPTIONAL_INPUTS = ("drafter", "more_features")
USES_TARGET = True

METRICS_FILE = "metrics.parquet"
SUMMARY_FILE = "summary.json"
OUTPUT_FILES = (WEIGHTS_FILE, CONFIG_FILE, VOCAB_FILE, METRICS_FILE, SUMMARY_FILE)
FEATURE_COLUMNS = ("input_ids", "loss_mask", "aux_hidden", "last_hidden")

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
        ("acc", pa.list_(pa.float64())),  # per TTT step: T=0 acceptance proxy
        ("alpha", pa.list_(pa.float64())),  # per TTT step: expected sum min(p, q) at T=1 (val)
        ("tau_sim", pa.float64()),
        ("tau_expected", pa.float64()),
        ("tau_chain", pa.float64()),
    ]
)


VAL_KEYS = ("step", "loss", "acc", "alpha", "tau_sim", "tau_expected", "tau_chain")


class TrainingStopped(OpdError):
    """`stop_after_steps` was reached: the checkpoint is saved and a re-run resumes from it."""


class Config(StrictConfig):
    epochs: float | None = Field(2.0, gt=0)
    """Passes over the training sequences; ignored when `steps` is set. Sized for the CPU
    budget: on 1200 greedy trajectories of the previous embedded target (238k tokens), evaluated
    tau (T=0, K=6, held-out prompts) was 2.6 after 1.5 epochs, 4.0 after 4 (draft vocab 4096),
    and 3.5 after 2 epochs with the default profile (1024-token draft vocab, aux layers 1, 3, 5;
    5-7 min). On the current target the default profile's 2 epochs give 2.7 (5 min); more
    epochs keep helping where time allows."""
    steps: int | None = Field(None, ge=1)
    """Optimizer steps; overrides `epochs`."""
    batch_size: int = Field(16, ge=1)
    """Sequences per batch (per rank)."""
    max_tokens: int = Field(4096, ge=1)
    """Padded tokens per batch (rows x longest row): bounds memory, since every TTT step keeps
    [tokens, draft_vocab] fp32 logits for the backward pass."""
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
    """Max global gradient norm (EAGLE's value): the soft-CE gradients of later TTT steps spike
    early in training."""
    ttt_steps: int = Field(7, ge=1)
    """Unrolled drafting steps per training row (EAGLE-3 uses 7)."""
    step_decay: float = Field(0.8, gt=0, le=1)
    """Step k's loss weight is step_decay^k (EAGLE-3's 0.8)."""
    temperature: float = Field(1.0, ge=0)
    """Teacher temperature; 0 trains on the target's argmax (a one-hot teacher)."""
    val_share: float = Field(0.05, ge=0, lt=1)
    """Share of sequences held out for validation (chosen by hashing seq_id with the seed)."""
    val_every: int = Field(100, ge=1)
    """Validate every N steps, and after the last step."""
    tau_k: int = Field(6, ge=1)
    """Draft length K of the simulated tau (the evaluate stage's default K)."""
    seed: int = 0
    bf16: bool = True
    """bf16 autocast (fp32 master weights): 1.4-1.8x faster on CPUs with AMX (ENV-NOTES)."""
    checkpoint_every: int = runtime_field(100, "save a resumable checkpoint every N steps")
    stop_after_steps: int | None = runtime_field(
        None, "stop (TrainingStopped) after N steps with a checkpoint saved; a re-run resumes"
    )
    threads: int | None = runtime_field(None, "torch intra-op threads (None = torch's default)")
    prefetch: int = runtime_field(4, "batches the loader thread prepares ahead")

    @model_validator(mode="after")
    def _check(self) -> Config:
        if self.tau_k > self.ttt_steps:
            raise ValueError(f"tau_k ({self.tau_k}) cannot exceed ttt_steps ({self.ttt_steps})")
        if self.steps is None and self.epochs is None:
            raise ValueError("set either steps or epochs")
        return self


class TTTUnroll(nn.Module):
    """The whole training-time-test unroll as one forward, so DDP sees one forward per backward."""

    def __init__(self, drafter: Eagle3Drafter, steps: int):
        super().__init__()
        self.drafter = drafter
        self.steps = steps

    def forward(
        self, aux_hidden: Tensor, input_ids: Tensor, loss_mask: Tensor
    ) -> tuple[list[Tensor], list[Tensor]]:
        out = ttt_unroll(self.drafter, aux_hidden, input_ids, steps=self.steps, loss_mask=loss_mask)
        return [s.logits for s in out], [s.valid for s in out]


def sft_loss(
    step_logits: list[Tensor], step_valid: list[Tensor], teacher: Tensor, decay: float
) -> Tensor:
    """TTT soft-CE: step k's row t is scored against the teacher at position t+k+1.

    step_logits[k] [B, T, Vd], step_valid[k] [B, T], teacher [B, T, Vd]. Rows past T-k-2 have no
    teacher; they are never valid, so slicing them off (views, not shifted copies) is exact.
    """
    T = teacher.shape[1]
    spans = [max(T - k - 1, 0) for k in range(len(step_logits))]
    return ttt_loss(
        [logits[:, :n] for logits, n in zip(step_logits, spans, strict=True)],
        [teacher[:, T - n :] for n in spans],
        [valid[:, :n] for valid, n in zip(step_valid, spans, strict=True)],
        decay,
    )


def new_drafter(target: Any, vocab: DraftVocab, seed: int) -> Eagle3Drafter:
    """A freshly initialised drafter for `target` (deterministic in `seed`)."""
    config = DrafterConfig.from_target(target.config, vocab.draft_vocab_size, target.aux_layer_ids)
    torch.manual_seed(seed)
    return Eagle3Drafter(config, target.embed_weight, vocab).to(target.device)


def _autocast(device: torch.device, enabled: bool):
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=enabled)


def _to(batch: training.PaddedBatch, device: torch.device) -> dict[str, Tensor]:
    cols = {k: v.to(device, non_blocking=True) for k, v in batch.columns.items()}
    cols["loss_mask"] = cols["loss_mask"].bool()
    return cols


def train_step(
    model: nn.Module, batch: training.PaddedBatch, target: Any, vocab: DraftVocab, cfg: Config
) -> dict[str, Any]:
    """Forward and backward of one batch; returns its metrics row, summed over ranks."""
    b = _to(batch, target.device)
    with torch.no_grad():
        target_logits = target.logits_from_hidden(b["last_hidden"])  # [B, T, V]
        teacher = teacher_draft_probs(target_logits, vocab, cfg.temperature)  # [B, T, Vd]
    with _autocast(target.device, cfg.bf16):
        logits, valid = model(b["aux_hidden"], b["input_ids"], b["loss_mask"])
    loss = sft_loss(logits, valid, teacher, cfg.step_decay)
    loss.backward()
    acc = training.ttt_acceptance(
        logits, valid, target_logits, vocab, chain_k=cfg.tau_k, expected=False
    ).all_reduce()
    sums = torch.tensor([float(loss.detach()), batch.num_tokens, 1.0], dtype=torch.float64)
    training.all_reduce_sum(sums)  # [loss, tokens, ranks]
    return {"loss": float(sums[0] / sums[2]), "tokens": int(sums[1]), "acc": acc.accuracy()}


@torch.no_grad()
def validate(
    drafter: Eagle3Drafter, loader: training.FeatureLoader, target: Any, cfg: Config
) -> dict[str, Any]:
    """Held-out TTT loss, per-step T=0 accuracy, expected alpha and the simulated taus (all ranks)."""
    vocab = drafter.vocab
    device = next(drafter.parameters()).device
    stats = training.AcceptanceStats.zeros(cfg.ttt_steps, cfg.tau_k)
    loss_sum = torch.zeros(2, dtype=torch.float64)  # [sum of loss x tokens, tokens]
    was_training = drafter.training
    drafter.eval()
    with contextlib.closing(loader.iterate(0)) as batches:
        for batch in batches:
            b = _to(batch, device)
            target_logits = target.logits_from_hidden(b["last_hidden"])  # [B, T, V]
            teacher = teacher_draft_probs(target_logits, vocab, cfg.temperature)
            with _autocast(device, cfg.bf16):
                out = ttt_unroll(
                    drafter,
                    b["aux_hidden"],
                    b["input_ids"],
                    steps=cfg.ttt_steps,
                    loss_mask=b["loss_mask"],
                )
            logits, valid = [s.logits for s in out], [s.valid for s in out]
            loss = sft_loss(logits, valid, teacher, cfg.step_decay)
            loss_sum += torch.tensor(
                [float(loss) * batch.num_tokens, batch.num_tokens], dtype=torch.float64
            )
            stats = stats + training.ttt_acceptance(
                logits, valid, target_logits, vocab, chain_k=cfg.tau_k
            )
    drafter.train(was_training)
    stats = stats.all_reduce()
    training.all_reduce_sum(loss_sum)
    return {"loss": float(loss_sum[0] / loss_sum[1].clamp_min(1)), **stats.summary()}


def _empty_row(kind: str, step: int, epoch: float) -> dict[str, Any]:
    return {name: None for name in METRICS_SCHEMA.names} | {
        "kind": kind,
        "step": step,
        "epoch": epoch,
    }


def run(
    cfg: Config,
    inputs: dict[str, Dataset],
    output: DatasetWriter,
    rank: int,
    world_size: int,
    ctx: RunContext,
) -> dict:
    feats = inputs["features"]
    sources = [feats, *([inputs["more_features"]] if "more_features" in inputs else [])]
    for ds in sources:
        check_same_target(ds, ctx.target_loader.identity)
    rank, world_size = training.resolve_ranks(rank, world_size)
    if all(output.has_shard(f) for f in OUTPUT_FILES):  # trained; only the commit was missing
        return json.loads((output.dir / SUMMARY_FILE).read_text())
    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    target = ctx.target_loader.target
    vocab_tensors = load_file(feats.file(VOCAB_FILE))
    vocab = DraftVocab(vocab_tensors["d2t"], vocab_tensors["t2d"])
    check_same_vocab(feats, sources[1:])

    index = training.FeatureIndex(sources, FEATURE_COLUMNS)
    train_rows, val_rows = training.holdout_split(index.keys, cfg.val_share, cfg.seed)
    common = dict(
        batch_size=cfg.batch_size, max_tokens=cfg.max_tokens, rank=rank, world_size=world_size
    )
    train = training.FeatureLoader(
        index, train_rows, seed=cfg.seed, prefetch=cfg.prefetch, **common
    )
    val = training.FeatureLoader(index, val_rows, shuffle=False, equal_ranks=False, **common)
    per_epoch = len(train)
    total = cfg.steps or math.ceil(cfg.epochs * per_epoch)

    if "drafter" in inputs:
        drafter = load_drafter_dataset(inputs["drafter"], target, ctx.target_loader.identity)
        if not (
            torch.equal(drafter.d2t.cpu(), vocab.d2t) and torch.equal(drafter.t2d.cpu(), vocab.t2d)
        ):
            raise OpdError(
                f"{inputs['drafter'].ref} uses another draft-vocab map than {feats.ref}: continued "
                "SFT needs features made with the drafter's map (e.g. its rollouts)"
            )
        drafter.to(target.device)
    else:
        drafter = new_drafter(target, vocab, cfg.seed)
    drafter.train()
    optimizer = training.adamw(drafter, lr=cfg.lr, weight_decay=cfg.weight_decay)
    schedule = training.WarmupCosine(
        optimizer,
        total_steps=total,
        warmup_steps=round(cfg.warmup_ratio * total),
        min_lr_ratio=cfg.min_lr_ratio,
    )
    ckpt = training.Checkpointer(output.store.root / "_work" / STAGE / output.version)
    step, metrics = 0, []
    if (latest := ckpt.latest()) is not None:
        saved = ckpt.load(latest, optimizer=optimizer, scheduler=schedule)
        expected = drafter_tensors(drafter).keys()
        if saved.model.keys() != expected:
            raise OpdError(
                f"checkpoint {ckpt.path(latest)} holds other tensors than the drafter; delete it"
            )
        # strict=False: embed_tokens is the target's and never saved
        drafter.load_state_dict(saved.model, strict=False)
        step, metrics = saved.step, saved.state["metrics"]
        if saved.state["data_position"] != list(divmod(step, per_epoch)):
            raise OpdError(f"checkpoint {ckpt.path(latest)} does not match this data; delete it")
        log.info("[sft] resuming from step %d (%s)", step, ckpt.path(latest))
    log.info(
        "[sft] reads %s (%d train / %d val sequences); writes %s; %d steps, %d per epoch; "
        "checkpoints in %s",
        feats.ref,
        len(train_rows),
        len(val_rows),
        output.ref,
        total,
        per_epoch,
        ckpt.directory,
    )

    model = training.wrap_ddp(TTTUnroll(drafter, cfg.ttt_steps))
    params = [p for p in drafter.parameters() if p.requires_grad]
    bar = tqdm(
        total=total, initial=step, desc="sft", unit="step", disable=not ctx.progress or rank != 0
    )
    t_start, wait_start, tokens_run, side_seconds = time.perf_counter(), train.wait_seconds, 0, 0.0
    epoch, position = divmod(step, per_epoch)
    with contextlib.closing(train.iterate(epoch, position, epochs=None)) as batches:
        for batch in batches:
            t0 = time.perf_counter()
            lr = schedule.lr
            row = train_step(model, batch, target, vocab, cfg)
            grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            schedule.step()
            step += 1
            tok_s = row["tokens"] / max(time.perf_counter() - t0, 1e-9)
            tokens_run += row["tokens"]
            row |= {"lr": lr, "grad_norm": float(grad_norm), "tokens_per_s": tok_s}
            metrics.append(_empty_row("train", step, step / per_epoch) | row)
            bar.set_postfix(loss=f"{row['loss']:.3f}", tok_s=f"{tok_s:.0f}")
            bar.update()

            t_side = time.perf_counter()  # validation and checkpoints are not step time
            if val_rows and (step % cfg.val_every == 0 or step == total):
                row = validate(drafter, val, target, cfg)
                metrics.append(_empty_row("val", step, step / per_epoch) | row)
                log.info(
                    "[sft] step %d: val loss %.4f, acc %s, tau_sim %.3f, tau_chain %.3f",
                    step,
                    row["loss"],
                    [round(a, 3) for a in row["acc"]],
                    row["tau_sim"],
                    row["tau_chain"],
                )
            stopping = cfg.stop_after_steps is not None and step >= cfg.stop_after_steps
            if rank == 0 and (step % cfg.checkpoint_every == 0 or stopping) and step < total:
                ckpt.save(
                    step,
                    model=drafter_tensors(drafter),
                    optimizer=optimizer,
                    scheduler=schedule,
                    state={"metrics": metrics, "data_position": list(divmod(step, per_epoch))},
                )
            side_seconds += time.perf_counter() - t_side
            if stopping and step < total:
                training.barrier()
                bar.close()
                raise TrainingStopped(
                    f"stopped after step {step} of {total} (stop_after_steps); "
                    f"re-run the stage to resume from {ckpt.path(step)}"
                )
            if step >= total:
                break
    bar.close()
    seconds = time.perf_counter() - t_start
    stall_share = (train.wait_seconds - wait_start) / max(seconds - side_seconds, 1e-9)
    training.barrier()
    if rank != 0:
        return {}

    last_train = next(m for m in reversed(metrics) if m["kind"] == "train")
    last_val = next((m for m in reversed(metrics) if m["kind"] == "val"), None)
    summary = {
        "features": str(feats.ref),
        "more_features": [str(ds.ref) for ds in sources[1:]],
        "steps": total,
        "epochs": total / per_epoch,
        "train_sequences": len(train_rows),
        "val_sequences": len(val_rows),
        "draft_vocab_size": vocab.draft_vocab_size,
        "aux_layer_ids": list(target.aux_layer_ids),
        "target": ctx.target_loader.identity,
        "final_train_loss": last_train["loss"],
        "validation": last_val and {k: last_val[k] for k in VAL_KEYS},
        "seconds_this_run": round(seconds, 2),
        "tokens_per_s_this_run": round(tokens_run / max(seconds, 1e-9), 1),
        "loader_stall_share": round(stall_share, 4),
    }
    with tempfile.TemporaryDirectory() as tmp:
        save_drafter(drafter, tmp)
        for name in (WEIGHTS_FILE, CONFIG_FILE):
            output.write_file(name, Path(tmp) / name)
    output.write_file(VOCAB_FILE, feats.file(VOCAB_FILE))
    output.write_parquet(METRICS_FILE, pa.Table.from_pylist(metrics, schema=METRICS_SCHEMA))
    output.write_bytes(SUMMARY_FILE, json.dumps(summary, indent=2, sort_keys=True).encode())
    ckpt.clear()
    if world_size > 1:
        output.wait_for_ranks()
    return summary
