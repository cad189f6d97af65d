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

import torch
from torch import Tensor

from models.blocks import BlockUnroll
from models.dflash.model import DFlashModel
from models.features import Features, replay_inputs


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
    module docstring) joins its row's blocks in the same forward: `replayed` [R, K, Vd]. The
    logits are `HeadLogits` of the one head (the losses compute them a chunk at a time)."""
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
    logits = drafter(blocks, everything, context, visible, steps, lazy_head=True)  # [N, A', K, Vd]
    label = anchors[..., None] + torch.arange(1, steps + 1, device=device)  # [N, A, K]
    trained = keep.gather(1, label.clamp(max=T - 1).view(N, -1)).view(label.shape)
    replayed = None if replays is None else logits[item, A + column]  # [R, K, Vd]
    valid = real[..., None] & (label < T) & trained
    return BlockUnroll([logits[:, :A, k] for k in range(steps)], anchors, valid, replayed)


@torch.no_grad()
def block_slot_logits(drafter: DFlashModel, features: Features, anchors: Tensor, k: int) -> Tensor:
    """The K slots' logits [C, K, Vd] each anchor e of one sequence drafts from after committing
    y<e: one forward of all C blocks (anchor position e-1, context < e-1) over one context pass.
    features: ids [T], aux [T, F]; anchors [C] with 2 <= e <= T."""
    device = drafter.fc.weight.device
    most = drafter.config.block_size - 1
    ids, aux_hidden, anchors = replay_inputs(features, anchors, k, device, most)
    starts = anchors - 1  # [C] block positions
    width = int(starts.max())
    positions = torch.arange(width, device=device)
    context = drafter.context_kv(aux_hidden[:width].to(device)[None], positions[None])
    visible = (positions < starts[:, None])[None]  # [1, C, S]
    blocks = drafter.block_tokens(ids[starts][None])  # [1, C, B]
    return drafter(blocks, starts[None], context, visible, k)[0]  # [C, K, Vd]
