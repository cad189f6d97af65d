"""Building blocks of the drafter-training stages (sft, opd), one import for the stages: the
optimizer and its schedule (here), and the ranks (`ranks`), batches (`batches`) and checkpoints
(`checkpoints`) modules' public names.

- `FeatureIndex` / `FeatureLoader`, `holdout_split`, `nested_subset`, `plan_batches`: batches.py.
- `adamw`, `WarmupCosine`: the optimizer and its linear warm-up + cosine learning-rate schedule.
- `Checkpointer`: checkpoints.py.
- DDP and FSDP helpers that are no-ops in a single process: ranks.py.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from pipeline.core.batches import (
    FeatureIndex,
    FeatureLoader,
    PaddedBatch,
    epoch_position,
    holdout_split,
    nested_subset,
    plan_batches,
)
from pipeline.core.checkpoints import Checkpoint, Checkpointer
from pipeline.core.ranks import (
    all_reduce_sum,
    barrier,
    distributed,
    full_optimizer_state,
    full_tensor,
    resolve_ranks,
    shard_fsdp,
    shard_like,
    world_size,
    wrap_ddp,
)
from storage import OpdError

# -- optimisation --------------------------------------------------------------------------


def adamw(
    model: nn.Module, *, lr: float, weight_decay: float, betas: tuple[float, float] = (0.9, 0.95)
) -> torch.optim.AdamW:
    """AdamW over the trainable parameters; norms and other 1-D parameters are not decayed."""
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    if not decay and not no_decay:
        raise OpdError("the model has no trainable parameters")
    groups = [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=lr, betas=betas)


class WarmupCosine:
    """Linear warm-up to each group's peak lr, then a cosine down to `min_lr_ratio` x peak.

    Optimizer step s (0-based) runs at peak x factor(s): (s + 1) / warmup during warm-up, then
    the cosine, reaching exactly the minimum at the last step. Call `step()` after each
    optimizer step. Its only state is the step count.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        total_steps: int,
        warmup_steps: int,
        min_lr_ratio: float,
    ):
        if total_steps < 1 or not 0 <= warmup_steps < max(total_steps, 2):
            raise OpdError(
                f"need total_steps >= 1 and 0 <= warmup_steps < total_steps, got "
                f"{total_steps} and {warmup_steps}"
            )
        if not 0 <= min_lr_ratio <= 1:
            raise OpdError(f"min_lr_ratio must be in [0, 1], got {min_lr_ratio}")
        self.optimizer = optimizer
        self.total_steps, self.warmup_steps, self.min_lr_ratio = (
            total_steps,
            warmup_steps,
            min_lr_ratio,
        )
        self.peaks = [group["lr"] for group in optimizer.param_groups]
        self.steps_done = 0
        self._apply()

    def factor(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        span = max(1, self.total_steps - 1 - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / span)
        return self.min_lr_ratio + (1 - self.min_lr_ratio) * 0.5 * (
            1 + math.cos(math.pi * progress)
        )

    def _apply(self) -> None:
        f = self.factor(self.steps_done)
        for group, peak in zip(self.optimizer.param_groups, self.peaks, strict=True):
            group["lr"] = peak * f

    def step(self) -> None:
        self.steps_done += 1
        self._apply()

    @property
    def lr(self) -> float:
        """The first group's current learning rate (what the next optimizer step uses)."""
        return self.optimizer.param_groups[0]["lr"]

    def state_dict(self) -> dict[str, Any]:
        return {"steps_done": self.steps_done, "peaks": list(self.peaks)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.steps_done = int(state["steps_done"])
        self.peaks = [float(p) for p in state["peaks"]]
        self._apply()


__all__ = [
    "Checkpoint",
    "Checkpointer",
    "FeatureIndex",
    "FeatureLoader",
    "PaddedBatch",
    "WarmupCosine",
    "adamw",
    "all_reduce_sum",
    "barrier",
    "distributed",
    "epoch_position",
    "full_optimizer_state",
    "full_tensor",
    "holdout_split",
    "nested_subset",
    "plan_batches",
    "resolve_ranks",
    "shard_fsdp",
    "shard_like",
    "world_size",
    "wrap_ddp",
]
