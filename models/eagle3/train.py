"""EAGLE-3's training forwards: the training-time-test unroll over cached features (SFT) and
over a rollout's sequences with replayed drafts at the anchor rows (Draft-OPD), and the
teacher-forced acceptance of an unroll.

An unroll's outputs are per step k: logits [B, T, Vd] (row t drafts x_{t+k+2}), valid [B, T]
and hidden_out [B, T, H]; the teacher of step k's row t is the target's distribution at
position t+k+1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from models.acceptance import AcceptanceStats
from models.eagle3.model import Eagle3Model, shift_left, ttt_unroll
from models.features import Features
from models.losses import (
    acceptance_rate,
    ce_rollout_loss,
    eagle1_loss,
    sft_loss,
    teacher_draft_probs,
)
from models.vocab import DraftVocab


@dataclass
class Unrolled:
    """One unroll's per-step outputs (module docstring)."""

    logits: list[Tensor]  # [K] of [B, T, Vd]
    valid: list[Tensor]  # [K] of [B, T] bool
    hidden: list[Tensor]  # [K] of [B, T, H]


def unrolled(
    drafter: Eagle3Model,
    features: Features,
    loss_mask: Tensor | None,
    steps: int,
    replays: tuple[Tensor, Tensor, Tensor] | None = None,
) -> Unrolled:
    """`ttt_unroll` over every row; with replays (item [N], anchor [N], tokens [N, K]) the row
    e-2 of each anchor e reads the replayed drafts at steps >= 1 instead of ground truth, so
    that row is exactly the chain the decoder drafted from the prefix y<e."""
    aux_hidden, input_ids = features.aux, features.ids
    step_tokens = None
    if replays is not None:
        item, anchor, tokens = replays
        row = anchor - 2
        step_tokens = [None]
        for k in range(1, steps):
            given = shift_left(input_ids, k + 1)  # [B, T] ground truth x_{t+k+1}
            given[item, row] = tokens[:, k - 1]
            step_tokens.append(given)
    out = ttt_unroll(
        drafter, aux_hidden, input_ids, steps=steps, step_tokens=step_tokens, loss_mask=loss_mask
    )
    return Unrolled([s.logits for s in out], [s.valid for s in out], [s.hidden_out for s in out])


def objective_loss(
    out: Unrolled,
    teacher: Tensor,
    last_hidden: Tensor,
    *,
    decay: float,
    objective: str | None,
) -> Tensor:
    """EAGLE-3's TTT soft-CE over every step, or EAGLE-1's objective on step 0 (the only step
    it trains)."""
    if objective == "eagle1":
        return eagle1_loss(out.logits[0], out.hidden[0], out.valid[0], teacher, last_hidden)
    return sft_loss(out.logits, out.valid, teacher, decay)


def replay_logits(out: Unrolled, item: Tensor, anchor: Tensor) -> Tensor:
    """The drafter's logits along each replay: step k at (item, anchor row) -> [N, K, Vd]."""
    row = anchor - 2
    return torch.stack([logits[item, row] for logits in out.logits], dim=1)


def rollout_ce_loss(
    out: Unrolled, teacher: Tensor, item: Tensor, anchor: Tensor, decay: float
) -> Tensor:
    """The TTT soft-CE on the replay unroll's rows that read ground truth (all but the anchors)."""
    anchor_rows = torch.zeros(teacher.shape[:2], dtype=torch.bool, device=teacher.device)
    anchor_rows[item, anchor - 2] = True
    return ce_rollout_loss(out.logits, out.valid, teacher, anchor_rows, decay)


@torch.no_grad()
def ttt_acceptance(
    out: Unrolled,
    target_logits: Tensor,
    vocab: DraftVocab,
    *,
    chain_k: int,
    expected: bool = True,
) -> AcceptanceStats:
    """AcceptanceStats of one unrolled batch; target_logits [B, T, V] at every position.
    `expected` also computes sum_v min(p, q) at T=1 (one [B, T, V] softmax per step)."""
    K = len(out.logits)
    if not 1 <= chain_k <= K:
        raise ValueError(f"chain_k must be in [1, {K}] (the unrolled steps), got {chain_k}")
    B, T, _ = target_logits.shape
    stats = AcceptanceStats.zeros(K, chain_k, target_logits.device)
    target_choice = target_logits.argmax(-1)  # [B, T]
    p_full = teacher_draft_probs(target_logits, vocab, 1.0, renormalize=False) if expected else None
    chain_alive = torch.ones(B, T, dtype=torch.bool, device=target_logits.device)
    chain_valid = torch.ones_like(chain_alive)
    chain_len = torch.zeros(B, T, dtype=torch.float64, device=target_logits.device)
    for k, (logits, valid) in enumerate(zip(out.logits, out.valid, strict=True)):
        n = T - k - 1  # rows whose target position t+k+1 exists
        hit = torch.zeros_like(valid)
        if n > 0:
            drafted = vocab.to_target(logits[:, :n].argmax(-1))  # [B, n]
            hit[:, :n] = (drafted == target_choice[:, k + 1 :]) & valid[:, :n]
            if p_full is not None:
                q = logits[:, :n].float().softmax(-1)  # [B, n, Vd]
                alpha = acceptance_rate(q, p_full[:, k + 1 :])  # [B, n]
                stats.alpha_sum[k] = alpha[valid[:, :n]].double().sum()
        stats.hits[k] = hit.sum()
        stats.valid[k] = valid.sum()
        if k < chain_k:
            chain_valid &= valid
            chain_alive &= hit
            chain_len += chain_alive
    stats.chain_rows = chain_valid.sum().double()
    stats.chain_len = chain_len[chain_valid].sum()
    return stats
