"""What block drafters share in training: a drafted slot that never reads the drafts before it
(a DFlash block's mask slots, a Medusa head), so the teacher-forced forward of a block is exactly
what decoding drafts from the same context.

A block at anchor position a drafts x_{a+1}, ..., x_{a+K} (slot k drafts x_{a+k}); slot k's
teacher is the target's distribution at position a+k-1. `BlockUnroll` holds one training
forward's blocks, and the functions below are its loss, its teacher-forced acceptance and its
logits along replays; each kind builds its blocks its own way (models/dflash/train.py,
models/medusa/train.py). A training forward's slots are `HeadLogits` (DFlash's share one head,
each Medusa head has its own), which the loss reads through the fused, chunked head of
models/head_loss.py, every slot's teacher read in place. A block's slots are also drafted
alike, in decoding (`block_chain`) and in replays (`block_replay`): each slot from its own q,
which no earlier draft changes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from models.acceptance import AcceptanceStats
from models.drafter import Proposal, Replayed
from models.features import Features
from models.head_loss import HeadLogits, by_head, head_loss
from models.losses import (
    Logits,
    acceptance_rate,
    materialized,
    soft_cross_entropy,
    teacher_draft_probs,
)
from models.vocab import DraftVocab


@dataclass
class BlockUnroll:
    """One training forward's blocks: per batch row A anchors, K drafted slots each."""

    logits: list[Logits]  # [K] of [N, A, Vd]: slot k+1 of each block (`HeadLogits` or fp32)
    anchors: Tensor  # [N, A] anchor positions
    valid: Tensor  # [N, A, K] bool: the slot's label exists and is trained on
    replayed: Logits | None = None  # [R, K, Vd]: the block at each replay's anchor, in order

    def stacked(self) -> Tensor:
        """The slots' logits [N, A, K, Vd] fp32, computed whole (the unfused path)."""
        return torch.stack([materialized(x) for x in self.logits], dim=2)


def at_slots(per_position: Tensor, anchors: Tensor, steps: int) -> Tensor:
    """per_position [N, T, ...] -> its value at position a+k-1 of each slot k: [N, A, K, ...]."""
    N, T = per_position.shape[:2]
    index = anchors[..., None] + torch.arange(steps, device=anchors.device)  # [N, A, K]
    flat = index.clamp(max=T - 1).view(N, -1)
    rest = per_position.shape[2:]
    gathered = per_position.gather(1, flat.view(N, -1, *([1] * len(rest))).expand(-1, -1, *rest))
    return gathered.view(*index.shape, *rest)


def _check_decay(decay: float) -> None:
    if not 0 < decay <= 1:
        raise ValueError(f"decay must lie in (0, 1], got {decay}")


def block_loss(logits: Tensor, teacher: Tensor, valid: Tensor, decay: float) -> Tensor:
    """Position-decayed soft cross-entropy: sum_k decay^(k-1) * mean over valid blocks of
    -sum_v p_v log q_v at slot k. logits, teacher [N, A, K, Vd]; valid [N, A, K]. The decay
    (0.8 per slot: exp(-(k-1)/4.5), near the public trainers' gamma 4 for B=8) spends the
    gradient where acceptance is decided: a slot only counts if every slot before it did."""
    _check_decay(decay)
    return sum(
        decay**k * soft_cross_entropy(logits[:, :, k], teacher[:, :, k], valid[:, :, k])
        for k in range(logits.shape[2])
    )


def sft_block_loss(out: BlockUnroll, teacher: Tensor, decay: float) -> Tensor:
    """`block_loss` of an unroll against the target's draft-vocab distribution teacher [N, T, Vd]
    (fused when every slot is a `HeadLogits`, else on the logits and teachers gathered whole)."""
    if out.logits and all(isinstance(x, HeadLogits) for x in out.logits):
        return _fused_block_loss(out.logits, out.anchors, out.valid, teacher, decay)
    logits = out.stacked()
    return block_loss(logits, at_slots(teacher, out.anchors, logits.shape[2]), out.valid, decay)


def _fused_block_loss(
    slots: Sequence[HeadLogits], anchors: Tensor, valid: Tensor, teacher: Tensor, decay: float
) -> Tensor:
    """`block_loss` as one fused pass per head over its slots' valid rows (all of DFlash's
    slots share one head: one head-gradient buffer for the block, not one a slot; each Medusa
    head has its own), slot k's teacher read in place at position anchor+k, never gathered
    into [N, A, K, Vd]. slots K of [N, A, Vd]; anchors [N, A]; valid [N, A, K]; teacher
    [N, T, Vd]."""
    _check_decay(decay)
    if valid.shape != (*anchors.shape, len(slots)):
        raise ValueError(
            f"valid has shape {tuple(valid.shape)}, expected {(*anchors.shape, len(slots))}"
        )
    for k, x in enumerate(slots):
        if x.shape[:-1] != anchors.shape:
            raise ValueError(f"slot {k} has shape {tuple(x.shape)}, anchors {tuple(anchors.shape)}")
    total = []
    for ks in by_head(slots):
        hidden, items, positions, weights = [], [], [], []
        for k in ks:
            n, a = valid[:, :, k].nonzero(as_tuple=True)  # [M_k] each
            hidden.append(slots[k].hidden[n, a])  # [M_k, H]
            items.append(n)
            positions.append(anchors[n, a] + k)
            weights.append(torch.full((len(n),), decay**k / max(len(n), 1), device=valid.device))
        rows = replace(slots[ks[0]], hidden=torch.cat(hidden))  # [sum M_k, H]
        index = (torch.cat(items), torch.cat(positions))
        total.append(head_loss(rows, teacher, index, torch.cat(weights)))
    return torch.stack(total).sum()


@torch.no_grad()
def block_acceptance(
    out: BlockUnroll, target_logits: Tensor, vocab: DraftVocab, *, chain_k: int, expected: bool
) -> AcceptanceStats:
    """AcceptanceStats per slot of an unroll; target_logits [N, T, V] at every position. A
    block's leading hits are what greedy decoding accepts there (module docstring)."""
    K = len(out.logits)
    if not 1 <= chain_k <= K:
        raise ValueError(f"chain_k must be in [1, {K}] (the drafted slots), got {chain_k}")
    stats = AcceptanceStats.zeros(K, chain_k, target_logits.device)
    choice = at_slots(target_logits.argmax(-1), out.anchors, K)  # [N, A, K]
    hit = torch.zeros_like(out.valid)
    p = teacher_draft_probs(target_logits, vocab, 1.0, renormalize=False) if expected else None
    for k, logits in enumerate(out.logits):  # the head on the slots that count only
        n, a = out.valid[:, :, k].nonzero(as_tuple=True)  # [M] each
        rows = logits[n, a]  # [M, Vd]
        hit[n, a, k] = vocab.to_target(rows.argmax(-1)) == choice[n, a, k]
        if p is not None:  # [N, T, Vd] read at each slot's position a+k
            alpha = acceptance_rate(materialized(rows).softmax(-1), p[n, out.anchors[n, a] + k])
            stats.alpha_sum[k] = alpha.double().sum()
    stats.hits = hit.sum((0, 1)).double()
    stats.valid = out.valid.sum((0, 1)).double()
    chain_valid = out.valid[..., :chain_k].all(-1)  # [N, A]
    chain_len = hit[..., :chain_k].long().cumprod(-1).sum(-1)  # [N, A] leading hits
    stats.chain_rows = chain_valid.sum().double()
    stats.chain_len = chain_len[chain_valid].sum().double()
    return stats


def block_replay_logits(out: BlockUnroll, anchor: Tensor, *, lazy: bool = False) -> Logits:
    """The drafter's logits [R, K, Vd] along each replay of an unroll given replays (with
    `lazy`, as the unroll holds them: DFlash's a `HeadLogits`, Medusa's a `HeadSlots`)."""
    if out.replayed is None or out.replayed.shape[0] != len(anchor):
        raise ValueError("replay_logits needs the unroll that was given these replays")
    return out.replayed if lazy else materialized(out.replayed)


class BlockTraining:
    """The training role's losses and acceptance for a block drafter (DFlash, Medusa), whose
    unroll returns a `BlockUnroll`: mixed in before `TrainableDrafter`. SFT is the
    position-decayed soft CE over the slots; on a Draft-OPD batch the rollout sequences' own
    blocks read ground truth only (no slot reads a draft), so the CE anchor is the same loss.
    A kind assigns `slot_logits(drafter, features, anchors, k)` -> [C, K, Vd]: the logits of
    the K slots each anchor's block drafts from (`replay` samples them)."""

    def sft_loss(
        self,
        out: BlockUnroll,
        teacher: Tensor,
        last_hidden: Tensor,
        *,
        decay: float,
        objective: str | None = None,
    ) -> Tensor:
        return sft_block_loss(out, teacher, decay)

    def acceptance(
        self, out: BlockUnroll, target_logits: Tensor, *, chain_k: int, expected: bool = True
    ) -> AcceptanceStats:
        return block_acceptance(out, target_logits, self.vocab, chain_k=chain_k, expected=expected)

    def replay(
        self,
        features: Features,
        anchors: Tensor,
        k: int,
        *,
        temperature: float = 0.0,
        generator: torch.Generator | None = None,
    ) -> Replayed:
        """K drafts from each anchor e of one sequence, as the proposer drafts them after
        committing y<e: the kind's `slot_logits` [C, K, Vd] at the anchors, sampled as
        `block_replay` does (a slot's q does not depend on the drafts before it)."""
        logits = self.slot_logits(features, anchors, k)  # [C, K, Vd]
        return block_replay(logits, temperature, generator, self.vocab)

    def replay_logits(
        self, out: BlockUnroll, item: Tensor, anchor: Tensor, *, lazy: bool = False
    ) -> Logits:
        return block_replay_logits(out, anchor, lazy=lazy)

    def rollout_ce_loss(
        self, out: BlockUnroll, teacher: Tensor, item: Tensor, anchor: Tensor, decay: float
    ) -> Tensor:
        return sft_block_loss(out, teacher, decay)


def block_chain(
    logits: Tensor, temperature: float, generator: torch.Generator, to_target: Tensor
) -> Proposal:
    """One verify step's block as the loop's chain: logits [B, K, Vd] of the drafted slots ->
    K drafts, the argmax at T=0, else a sample of each slot's own q = softmax(logits / T) (no
    slot reads the drafts before it, so the loop's Leviathan test on each is exact).
    to_target [Vd]: each draft id's target id."""
    if temperature == 0:
        ids = logits.argmax(-1)  # [B, K]
        confidence = logits.softmax(-1).amax(-1)
        q_tok, dists = torch.ones_like(confidence), None
    else:
        q = torch.softmax(logits / temperature, dim=-1)  # [B, K, Vd]
        flat = q.reshape(-1, q.shape[-1])
        ids = torch.multinomial(flat, 1, generator=generator).view(q.shape[:2])  # [B, K]
        q_tok, confidence = q.gather(-1, ids[..., None])[..., 0], q.amax(-1)
        dists = list(q.unbind(1))  # K of [B, Vd]
    return Proposal(
        tokens=to_target[ids],
        q=q_tok,
        confidence=confidence,
        forwards=1,
        dists=dists,
        vocab_map=to_target,
        # one forward drafts every slot: a confidence stop reads each slot on its own
        joint_confidence=False,
    )


def block_replay(
    logits: Tensor, temperature: float, generator: torch.Generator | None, vocab: DraftVocab
) -> Replayed:
    """The drafts of C replayed blocks from their logits [C, K, Vd]: each slot's argmax at T=0,
    else a sample of its own q = softmax(logits / T) with `generator`."""
    C, k = logits.shape[:2]
    log_q = torch.log_softmax(logits / (temperature or 1.0), dim=-1)  # [C, K, Vd]
    if temperature == 0:
        draft, logq = logits.argmax(-1), torch.zeros(C, k, device=logits.device)
    else:
        flat = log_q.exp().reshape(C * k, -1)
        draft = torch.multinomial(flat, 1, generator=generator).view(C, k)  # [C, K]
        logq = log_q.gather(-1, draft[..., None])[..., 0]
    return Replayed(
        tokens=vocab.to_target(draft),
        logq=logq,
        confidence=log_q.amax(-1).exp(),
    )
