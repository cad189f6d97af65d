"""DFlash's drafts for the decoding loop: ONE drafter forward per verify step.

The proposer keeps its own cache of the context's per-layer keys and values: each step projects
only the rows committed since the last step (their target features from the verify forward, or
the prefill) and appends them, with a validity mask, as models/kv.py does for every cache. The
block [last committed token, mask x (B-1)] then reads all valid context slots (every one sits
before the anchor) and drafts B-1 tokens at once; the loop uses the first `budget` of them as a
chain (node i continues node i-1). The block's own keys are never cached: the next step's
context rows come from the target.

Slot i's distribution q_i does not depend on the drafts before it (they are mask tokens to the
drafter), so each slot is drawn from its own q_i and the loop's Leviathan test on each is exact.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from models.blocks import block_chain
from models.dflash.model import DFlashModel
from models.drafter import ChainShape, Proposal, Shape
from models.features import Features
from models.kv import CachedRows


class DFlashProposer(CachedRows):
    """Blocks from a DFlash drafter, with its context cache."""

    def __init__(
        self,
        drafter: DFlashModel,
        shape: Shape,
        temperature: float,
        generator: torch.Generator,
        timer: Any,
    ) -> None:
        drafts = drafter.config.block_size - 1
        if not isinstance(shape, ChainShape):
            raise ValueError(
                "a DFlash drafter drafts one block per step, not a tree; drop drafting.tree"
            )
        if shape.k > drafts:
            raise ValueError(
                f"k={shape.k} drafts per step exceed the DFlash block's {drafts} drafted slots "
                f"(block_size {drafter.config.block_size}); lower drafting.k"
            )
        self.drafter, self.temperature, self.gen, self.timer = (
            drafter,
            temperature,
            generator,
            timer,
        )
        super().__init__()  # the cache holds the context's keys and values
        self.to_target = drafter.vocab.draft_to_target_ids

    def propose(self, rows: Features, budget: Tensor) -> Proposal:
        batch, device = len(rows.ids), rows.ids.device
        if self.valid is None:
            self.valid = torch.zeros(batch, 0, dtype=torch.bool, device=device)
            self.to_target = self.to_target.to(device)
        last = rows.valid.sum(1) - 1  # [B] the last committed row
        index = torch.arange(batch, device=device)
        anchor = rows.ids[index, last]  # [B] the token after it: the block's first slot
        with self.timer("drafter"):
            for layer, (k, v) in enumerate(self.drafter.context_kv(rows.aux, rows.positions)):
                self.cache.append(k, v, layer)  # [B, kv, S, d]
            self.valid = torch.cat([self.valid, rows.valid], dim=1)
            logits = self.drafter(
                self.drafter.block_tokens(anchor[:, None]),  # [B, 1, Bk]
                rows.positions[index, last][:, None] + 1,  # [B, 1]
                list(zip(self.cache.keys, self.cache.values, strict=True)),
                self.valid[:, None],  # [B, 1, S]
                int(budget.max()),
            )[:, 0]  # [B, K, Vd]
        return block_chain(logits, self.temperature, self.gen, self.to_target)
