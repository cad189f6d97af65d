"""Medusa's training forward and its replays (Draft-OPD), in the block form of models/blocks.py.

Every position t of a cached sequence is a block: the heads read h_t, head k drafts x_{t+1+k},
so the block's anchor position is a = t+1 (slot k drafts x_{a+k}; its teacher is the target's
distribution at a+k-1 = t+k). The heads are cheap (one [H, H] block and a [Vd, H] head each),
so unlike DFlash every position trains, not a sample of anchors.

Replays. A replay from anchor e (its first draft is y_e, drafted from the prefix y<e) reads the
last state the decoding loop had there, h_{e-2} (the state that predicted y_{e-1}, the token
the target had just emitted): the heads' logits at position e-2 of the same forward. No replayed
token enters the heads, so, as for a DFlash block, the replay's tokens matter only to the loss.
"""

from __future__ import annotations

import torch
from torch import Tensor

from models.blocks import BlockUnroll
from models.features import Features, replay_inputs
from models.head_loss import HeadSlots
from models.medusa.model import MedusaHeads


def _last_hidden(features: Features) -> Tensor:
    if features.last_hidden is None:
        raise ValueError(
            "Medusa heads read the target's last hidden state: the features carry none"
        )
    return features.last_hidden


def heads_unroll(
    drafter: MedusaHeads,
    features: Features,
    loss_mask: Tensor | None,
    steps: int,
    replays: tuple[Tensor, Tensor, Tensor] | None = None,
) -> BlockUnroll:
    """The first `steps` heads at every position of a batch: features.last_hidden [N, T, H],
    ids [N, T]; loss_mask [N, T] bool (the drafted token x_{t+1+k} must be trained). With
    replays (item [R], anchor e [R], tokens [R, K]) `replayed` [R, K, Vd] are the heads at
    position e-2 of row item (module docstring). Each head's logits are a `HeadLogits` of its
    own weight, the replays' a `HeadSlots` of them (the losses compute them a chunk at a time,
    a head at a time)."""
    heads = drafter.config.num_heads
    if not 1 <= steps <= heads:
        raise ValueError(
            f"{steps} drafted offsets do not fit {heads} Medusa heads (at most {heads}); lower "
            "drafting.ttt_steps or raise drafter.heads"
        )
    hidden = _last_hidden(features)
    N, T = features.ids.shape
    device = features.ids.device
    keep = loss_mask if loss_mask is not None else torch.ones(N, T, dtype=torch.bool, device=device)
    slots = drafter(hidden, steps, lazy_head=True)  # K of [N, T, Vd]
    anchors = torch.arange(1, T + 1, device=device).expand(N, T)  # [N, T]: a = t + 1
    label = anchors[..., None] + torch.arange(1, steps + 1, device=device)  # [N, T, K]
    trained = keep.gather(1, label.clamp(max=T - 1).view(N, -1)).view(label.shape)
    replayed = None
    if replays is not None:
        item, anchor, _ = replays
        replayed = HeadSlots(tuple(s[item, anchor - 2] for s in slots))  # [R, K, Vd]
    return BlockUnroll(slots, anchors, (label < T) & trained, replayed)


@torch.no_grad()
def head_slot_logits(drafter: MedusaHeads, features: Features, anchors: Tensor, k: int) -> Tensor:
    """The K slots' logits [C, K, Vd] each anchor e of one sequence drafts from after committing
    y<e: the first K heads at h_{e-2}. features: ids [T], last_hidden [T, H]; 2 <= e <= T."""
    device = drafter.heads[0].weight.device
    _, _, anchors = replay_inputs(features, anchors, k, device, drafter.config.num_heads)
    hidden = _last_hidden(features).to(device)[anchors - 2]  # [C, H]
    return drafter(hidden, k).float()  # [C, K, Vd]
