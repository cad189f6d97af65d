"""Teacher-forced validation of a drafter on cached feature sequences, shared by the training
stages (sft, opd): the held-out loss and acceptance per draft offset, and the `heldout_*`
columns both log on sequences neither trains on."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from models.acceptance import AcceptanceStats
from models.drafter import Drafter
from models.features import Features
from models.losses import teacher_draft_probs
from pipeline.core import training
from pipeline.core.featurize import FeatureSource
from pipeline.core.precision import Bf16Setting
from pipeline.core.trainer import TrainConfig, autocast
from storage import Dataset

FEATURE_COLUMNS = ("input_ids", "loss_mask", "aux_hidden", "last_hidden")


def to_device(batch: training.PaddedBatch, device: torch.device) -> dict[str, Tensor]:
    cols = {k: v.to(device, non_blocking=True) for k, v in batch.columns.items()}
    cols["loss_mask"] = cols["loss_mask"].bool()
    return cols


def features_of(cols: Mapping[str, Tensor]) -> Features:
    """A batch of feature columns as the drafter's features record (sequence convention)."""
    return Features(cols["input_ids"], cols.get("aux_hidden"), cols.get("last_hidden"))


@torch.no_grad()
def validate(
    drafter: Drafter,
    loader: training.FeatureLoader,
    target: Any,
    *,
    ttt_steps: int,
    tau_k: int,
    temperature: float,
    step_decay: float,
    bf16: Bf16Setting,
    objective: str | None = None,
) -> dict[str, Any]:
    """Held-out loss of `objective`, and over a `ttt_steps` unroll the per-step T=0 accuracy,
    expected alpha and the simulated taus (all ranks)."""
    vocab = drafter.vocab
    device = next(drafter.parameters()).device
    stats = AcceptanceStats.zeros(ttt_steps, tau_k, device)
    loss_sum = torch.zeros(2, dtype=torch.float64)  # [sum of loss x tokens, tokens]
    was_training = drafter.training
    drafter.eval()
    with contextlib.closing(loader.iterate(0)) as batches:
        for batch in batches:
            b = to_device(batch, device)
            target_logits = target.teacher(b["last_hidden"], vocab, [temperature])  # [B, T, V]
            teacher = teacher_draft_probs(target_logits, vocab, temperature)
            with autocast(device, bf16):
                out = drafter.unroll(features_of(b), b["loss_mask"], ttt_steps)
            loss = drafter.sft_loss(
                out, teacher, b["last_hidden"], decay=step_decay, objective=objective
            )
            loss_sum += torch.tensor(
                [float(loss) * batch.num_tokens, batch.num_tokens], dtype=torch.float64
            )
            stats = stats + drafter.acceptance(out, target_logits, chain_k=tau_k)
    drafter.train(was_training)
    stats = stats.reduced(training.all_reduce_sum)
    training.all_reduce_sum(loss_sum)
    return {"loss": float(loss_sum[0] / loss_sum[1].clamp_min(1)), **stats.summary()}


def heldout_loader(
    ds: Dataset,
    cfg: TrainConfig,
    rank: int,
    world_size: int,
    *,
    source: FeatureSource,
    pin_memory: bool = False,
) -> training.FeatureLoader:
    """Every sequence of a `heldout` input, in order, batched like the stage's validation
    (`source`: the states the drafter reads, computed for an online features dataset)."""
    index = training.FeatureIndex([ds], source.columns, source=source)
    return training.FeatureLoader(
        index,
        range(len(index)),
        batch_size=cfg.batch_size,
        max_tokens=cfg.max_tokens,
        rank=rank,
        world_size=world_size,
        pin_memory=pin_memory,
        shuffle=False,
        equal_ranks=False,
    )


def validate_heldout(
    drafter: Drafter, loader: training.FeatureLoader, target: Any, *, k: int, bf16: Bf16Setting
) -> dict[str, Any]:
    """The `heldout_*` columns of a val row: teacher-forced acceptance over k steps (the loss's
    settings differ between stages, so only the acceptance, which depends on none, is kept)."""
    row = validate(
        drafter, loader, target, ttt_steps=k, tau_k=k, temperature=1.0, step_decay=1.0, bf16=bf16
    )
    return {
        "heldout_acc": row["acc"],
        "heldout_tau_sim": row["tau_sim"],
        "heldout_tau_expected": row["tau_expected"],
        "heldout_tau_chain": row["tau_chain"],
    }
