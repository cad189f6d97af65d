"""DFlash's training forward: many anchors per cached sequence in one block-structured forward,
its position-decayed loss, its teacher-forced acceptance, and its replays (Draft-OPD).

Anchor a (a sequence position, a >= 1) puts the block [x_a, m, ..., m] at positions a..a+B-1;
its queries read the context features at positions < a and the block's own slots, never another
block (`models.dflash.model.block_attention`). Slot k (1 <= k <= K) drafts x_{a+k}; its teacher
is the target's distribution at position a+k-1. The block's drafts do not depend on the tokens
drafted before them, so the teacher-forced acceptance of a block is exactly what greedy decoding
from the same context would accept.

Replays. A replay from anchor e (its first draft is y_e, drafted from the prefix y<e) is the
block at anchor position e-1: [y_{e-1}, m, ..., m] over the context before e-1, exactly the
proposer's block after committing y<e. Since no slot reads an earlier draft, the training
forward along a replay is that block's forward: no replayed token enters the drafter, and the
replay's tokens matter only to the loss (which slots the verifier accepted, and the target's
distribution at each, which `score` computed conditioned on the drafted prefix).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from models.acceptance import AcceptanceStats
from models.dflash.model import DFlashModel
from models.drafter import Replayed
from models.features import Features, replay_inputs
from models.losses import acceptance_rate, soft_cross_entropy, teacher_draft_probs
from models.vocab import DraftVocab


@dataclass
class BlockUnroll:
    """One training forward's blocks: per batch row A anchors, K drafted slots each."""

    logits: Tensor  # [N, A, K, Vd] fp32: slot k+1 of each block
    anchors: Tensor  # [N, A] anchor positions
    valid: Tensor  # [N, A, K] bool: the slot's label exists and is trained on
    replayed: Tensor | None = None  # [R, K, Vd] fp32: the block at each replay's anchor, in order


def choose_anchors(loss_mask: Tensor, cap: int, *, sample: bool) -> tuple[Tensor, Tensor]:
    """Up to `cap` anchors per row among positions a >= 1 whose first drafted token x_{a+1} is
    trained (loss_mask [N, T]); sampled without repeats from torch's RNG when `sample` (the
    trainer checkpoints that RNG, so resuming redraws the same anchors), else the earliest.
    Returns anchors [N, A] sorted and which of them are real [N, A] (rows with fewer pad)."""
    N, T = loss_mask.shape
    eligible = torch.zeros_like(loss_mask)
    eligible[:, 1 : T - 1] = loss_mask[:, 2:]
    A = max(1, min(cap, int(eligible.sum(1).max())))
    score = torch.rand(N, T, device=loss_mask.device) if sample else -torch.arange(T).float()
    score = torch.where(eligible, score.expand(N, T).to(loss_mask.device), -float("inf"))
    picked = score.topk(A, dim=1).indices.sort(dim=1).values  # [N, A]
    return picked, eligible.gather(1, picked)


def _replay_columns(item: Tensor, rows: int) -> tuple[Tensor, Tensor]:
    """Each replay's column among its batch row's replays (item [R] -> [R]) and, per row, how
    many it has [N]: replays become extra blocks of their row in the one forward."""
    counts = torch.bincount(item, minlength=rows)  # [N]
    order = torch.argsort(item, stable=True)
    starts = torch.cumsum(counts, 0) - counts  # [N]
    column = torch.empty_like(item)
    column[order] = torch.arange(len(item), device=item.device) - starts[item[order]]
    return column, counts


def block_unroll(
    drafter: DFlashModel,
    features: Features,
    loss_mask: Tensor | None,
    steps: int,
    replays: tuple[Tensor, Tensor, Tensor] | None = None,
) -> BlockUnroll:
    """The drafter over every anchor of a batch in one forward. features: aux [N, T, F] (at
    positions 0..T-1), ids [N, T]; loss_mask [N, T] bool; `steps` = K slots trained. With
    replays (item [R], anchor e [R], tokens [R, K]) each replay's block (anchor position e-1,
    module docstring) joins its row's blocks in the same forward: `replayed` [R, K, Vd]."""
    aux_hidden, input_ids = features.aux, features.ids
    block = drafter.config.block_size
    if not 1 <= steps <= block - 1:
        raise ValueError(
            f"{steps} drafted offsets do not fit a DFlash block of {block} (at most {block - 1}); "
            "lower drafting.ttt_steps or raise the drafter's block_size"
        )
    N, T = input_ids.shape
    device = input_ids.device
    keep = loss_mask if loss_mask is not None else torch.ones(N, T, dtype=torch.bool, device=device)
    anchors, real = choose_anchors(keep, drafter.config.anchors, sample=drafter.training)
    A = anchors.shape[1]
    everything = anchors
    if replays is not None:
        item, anchor, _ = replays
        column, counts = _replay_columns(item, N)
        # Rows with fewer replays pad with anchor position 1 (a real block, never read).
        extra = torch.ones(N, int(counts.max()), dtype=torch.long, device=device)  # [N, R']
        extra[item, column] = anchor - 1
        everything = torch.cat([anchors, extra], dim=1)  # [N, A + R']
    positions = torch.arange(T, device=device)
    context = drafter.context_kv(aux_hidden, positions.expand(N, T))  # per layer [N, kv, T, d]
    visible = positions < everything[..., None]  # [N, A', T] context strictly before the anchor
    blocks = drafter.block_tokens(input_ids.gather(1, everything))  # [N, A', B]
    logits = drafter(blocks, everything, context, visible, steps)  # [N, A', K, Vd]
    label = anchors[..., None] + torch.arange(1, steps + 1, device=device)  # [N, A, K]
    trained = keep.gather(1, label.clamp(max=T - 1).view(N, -1)).view(label.shape)
    replayed = None if replays is None else logits[item, A + column]  # [R, K, Vd]
    return BlockUnroll(logits[:, :A], anchors, real[..., None] & (label < T) & trained, replayed)


def _at_slots(per_position: Tensor, anchors: Tensor, steps: int) -> Tensor:
    """per_position [N, T, ...] -> its value at position a+k-1 of each slot k: [N, A, K, ...]."""
    N, T = per_position.shape[:2]
    index = anchors[..., None] + torch.arange(steps, device=anchors.device)  # [N, A, K]
    flat = index.clamp(max=T - 1).view(N, -1)
    rest = per_position.shape[2:]
    gathered = per_position.gather(1, flat.view(N, -1, *([1] * len(rest))).expand(-1, -1, *rest))
    return gathered.view(*index.shape, *rest)


def block_loss(logits: Tensor, teacher: Tensor, valid: Tensor, decay: float) -> Tensor:
    """Position-decayed soft cross-entropy: sum_k decay^(k-1) * mean over valid blocks of
    -sum_v p_v log q_v at slot k. logits, teacher [N, A, K, Vd]; valid [N, A, K]. The decay
    (0.8 per slot: exp(-(k-1)/4.5), near the public trainers' gamma 4 for B=8) spends the
    gradient where acceptance is decided: a slot only counts if every slot before it did."""
    if not 0 < decay <= 1:
        raise ValueError(f"decay must lie in (0, 1], got {decay}")
    return sum(
        decay**k * soft_cross_entropy(logits[:, :, k], teacher[:, :, k], valid[:, :, k])
        for k in range(logits.shape[2])
    )


def sft_block_loss(out: BlockUnroll, teacher: Tensor, decay: float) -> Tensor:
    """`block_loss` of an unroll against the target's draft-vocab distribution teacher [N, T, Vd]."""
    return block_loss(
        out.logits, _at_slots(teacher, out.anchors, out.logits.shape[2]), out.valid, decay
    )


@torch.no_grad()
def block_acceptance(
    out: BlockUnroll, target_logits: Tensor, vocab: DraftVocab, *, chain_k: int, expected: bool
) -> AcceptanceStats:
    """AcceptanceStats per slot of an unroll; target_logits [N, T, V] at every position. A
    block's leading hits are what greedy decoding accepts there (module docstring)."""
    K = out.logits.shape[2]
    if not 1 <= chain_k <= K:
        raise ValueError(f"chain_k must be in [1, {K}] (the drafted slots), got {chain_k}")
    stats = AcceptanceStats.zeros(K, chain_k, target_logits.device)
    choice = _at_slots(target_logits.argmax(-1), out.anchors, K)  # [N, A, K]
    hit = (vocab.to_target(out.logits.argmax(-1)) == choice) & out.valid
    if expected:
        p = teacher_draft_probs(target_logits, vocab, 1.0, renormalize=False)  # [N, T, Vd]
        alpha = acceptance_rate(out.logits.softmax(-1), _at_slots(p, out.anchors, K))
        stats.alpha_sum = (alpha * out.valid).sum((0, 1)).double()
    stats.hits = hit.sum((0, 1)).double()
    stats.valid = out.valid.sum((0, 1)).double()
    chain_valid = out.valid[..., :chain_k].all(-1)  # [N, A]
    chain_len = hit[..., :chain_k].long().cumprod(-1).sum(-1)  # [N, A] leading hits
    stats.chain_rows = chain_valid.sum().double()
    stats.chain_len = chain_len[chain_valid].sum().double()
    return stats


def block_replay_logits(out: BlockUnroll, anchor: Tensor) -> Tensor:
    """The drafter's logits [R, K, Vd] along each replay of an unroll given replays."""
    if out.replayed is None or len(out.replayed) != len(anchor):
        raise ValueError("replay_logits needs the unroll that was given these replays")
    return out.replayed


@torch.no_grad()
def replay_blocks(
    drafter: DFlashModel,
    features: Features,
    anchors: Tensor,
    k: int,
    *,
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
) -> Replayed:
    """K drafts from each anchor e of one sequence, as the proposer drafts them after committing
    y<e: one forward of all C blocks (anchor position e-1, context < e-1) over one context pass.

    features: ids [T], aux [T, F]; anchors [C] with 2 <= e <= T. T=0 drafts each slot's
    argmax; T>0 samples each slot from its own q = softmax(logits / T) with `generator` (a
    slot's q does not depend on the drafts before it, models/dflash/propose.py)."""
    device = drafter.fc.weight.device
    most = drafter.config.block_size - 1
    ids, aux_hidden, anchors = replay_inputs(features, anchors, k, device, most)
    C = anchors.numel()
    starts = anchors - 1  # [C] block positions
    width = int(starts.max())
    positions = torch.arange(width, device=device)
    context = drafter.context_kv(aux_hidden[:width].to(device)[None], positions[None])
    visible = (positions < starts[:, None])[None]  # [1, C, S]
    blocks = drafter.block_tokens(ids[starts][None])  # [1, C, B]
    logits = drafter(blocks, starts[None], context, visible, k)[0]  # [C, K, Vd]
    log_q = torch.log_softmax(logits / (temperature or 1.0), dim=-1)  # [C, K, Vd]
    if temperature == 0:
        draft, logq = logits.argmax(-1), torch.zeros(C, k, device=device)
    else:
        flat = log_q.exp().reshape(C * k, -1)
        draft = torch.multinomial(flat, 1, generator=generator).view(C, k)  # [C, K]
        logq = log_q.gather(-1, draft[..., None])[..., 0]
    return Replayed(
        tokens=drafter.vocab.to_target(draft),
        logq=logq,
        confidence=log_q.amax(-1).exp(),
    )
