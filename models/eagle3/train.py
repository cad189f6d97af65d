"""EAGLE-3's SFT objectives over a training-time-test unroll (the unroll, its acceptance and
Draft-OPD's pieces are every chain drafter's: models/chain.py)."""

from __future__ import annotations

from torch import Tensor

from models.chain import Unrolled
from models.losses import eagle1_loss, sft_loss


def objective_loss(
    out: Unrolled,
    teacher: Tensor,
    last_hidden: Tensor,
    *,
    decay: float,
    objective: str | None = None,
) -> Tensor:
    """EAGLE-3's TTT soft-CE over every step, or EAGLE-1's objective on step 0 (the only step
    it trains)."""
    if objective == "eagle1":
        return eagle1_loss(out.logits[0], out.hidden[0], out.valid[0], teacher, last_hidden)
    return sft_loss(out.logits, out.valid, teacher, decay)
