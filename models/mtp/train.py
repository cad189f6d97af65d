"""MTP's per-depth loss (DeepSeek-V3's L_MTP) over a training-time-test unroll
(models/chain.py), teacher-forced (SFT) or on a Draft-OPD batch's ground-truth rows.

DeepSeek-V3 trains its D modules with L_MTP = (lambda / D) * sum_k CE_k: every depth alike.
lambda only weighs L_MTP against the main model's loss, which is frozen here, so it would
only rescale the learning rate and is left out. The depths are the unrolled steps: the D
modules, then the last module reused (what decoding drafts deeper with), each weighed 1/S
instead of `sft.step_decay`^k.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor

from models.losses import ce_rollout_loss, sft_loss


def depth_mean_loss(
    step_logits: Sequence[Tensor], step_valid: Sequence[Tensor], teacher: Tensor
) -> Tensor:
    """(1/S) sum_k soft-CE of depth k against the target's distribution. step_logits[k]
    [B, T, V], step_valid[k] [B, T] bool, teacher [B, T, V] (step k's row t against the
    teacher at position t+k+1, as `models.losses.sft_loss`)."""
    return sft_loss(step_logits, step_valid, teacher, 1.0) / len(step_logits)


def depth_mean_rollout_loss(
    step_logits: Sequence[Tensor],
    step_valid: Sequence[Tensor],
    teacher: Tensor,
    anchor_rows: Tensor,
) -> Tensor:
    """`depth_mean_loss` on the rows of a replay unroll that read ground truth (anchor_rows
    [B, T] bool read replayed drafts past step 0): Draft-OPD's CE anchor."""
    return ce_rollout_loss(step_logits, step_valid, teacher, anchor_rows, 1.0) / len(step_logits)
