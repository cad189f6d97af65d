"""The pruned draft vocabulary (d2t / t2d), frozen from the features stage on."""

from __future__ import annotations

import torch
from torch import Tensor, nn


class DraftVocab:
    """The pruned draft vocabulary: `d2t` offsets (target_id = draft_id + d2t[draft_id]) and `t2d` membership."""

    def __init__(self, d2t: Tensor, t2d: Tensor) -> None:
        if d2t.dtype != torch.int64 or d2t.dim() != 1:
            raise ValueError(
                f"d2t must be a 1-D int64 tensor, got {d2t.dtype} with shape {tuple(d2t.shape)}"
            )
        if t2d.dtype != torch.bool or t2d.dim() != 1:
            raise ValueError(
                f"t2d must be a 1-D bool tensor, got {t2d.dtype} with shape {tuple(t2d.shape)}"
            )
        target_ids = torch.arange(d2t.numel(), device=d2t.device) + d2t
        if target_ids.numel() and (target_ids.min() < 0 or target_ids.max() >= t2d.numel()):
            raise ValueError(f"d2t maps draft ids outside the target vocab [0, {t2d.numel()})")
        if (target_ids[1:] <= target_ids[:-1]).any():
            raise ValueError("d2t must map draft ids to strictly increasing target ids")
        if int(t2d.sum()) != d2t.numel():
            raise ValueError(
                f"t2d marks {int(t2d.sum())} target ids but d2t has {d2t.numel()} draft ids"
            )
        if not bool(t2d.to(target_ids.device)[target_ids].all()):
            raise ValueError(
                "t2d is inconsistent with d2t: a draft id maps to a target id t2d does not mark"
            )
        self.d2t = d2t
        self.t2d = t2d
        self.draft_to_target_ids = target_ids
        lookup = torch.full((t2d.numel(),), -1, dtype=torch.int64, device=d2t.device)
        lookup[target_ids] = torch.arange(d2t.numel(), device=d2t.device)
        self._target_to_draft = lookup

    @classmethod
    def from_counts(cls, counts: Tensor, draft_vocab_size: int) -> DraftVocab:
        """Top `draft_vocab_size` target ids by (loss-masked) frequency; ties go to the lower id."""
        if counts.dim() != 1:
            raise ValueError(
                f"counts must be 1-D over the target vocab, got shape {tuple(counts.shape)}"
            )
        if not 0 < draft_vocab_size <= counts.numel():
            raise ValueError(
                f"draft_vocab_size must be in [1, {counts.numel()}], got {draft_vocab_size}"
            )
        # A stable sort on descending counts keeps equal counts in ascending id order.
        order = torch.sort(counts, descending=True, stable=True).indices
        chosen = torch.sort(order[:draft_vocab_size]).values.to(torch.int64)
        t2d = torch.zeros(counts.numel(), dtype=torch.bool, device=counts.device)
        t2d[chosen] = True
        return cls(chosen - torch.arange(draft_vocab_size, device=counts.device), t2d)

    @classmethod
    def full(cls, vocab_size: int) -> DraftVocab:
        """The identity map: every target id is its own draft id (a full-vocabulary head)."""
        return cls(
            torch.zeros(vocab_size, dtype=torch.int64), torch.ones(vocab_size, dtype=torch.bool)
        )

    @property
    def is_full(self) -> bool:
        """Whether the map is the identity: draft ids are target ids and any map reads them."""
        return self.draft_vocab_size == self.vocab_size

    @property
    def vocab_size(self) -> int:
        return self.t2d.numel()

    @property
    def draft_vocab_size(self) -> int:
        return self.d2t.numel()

    def to_target(self, draft_ids: Tensor) -> Tensor:
        return self.draft_to_target_ids.to(draft_ids.device)[draft_ids]

    def to_draft(self, target_ids: Tensor) -> Tensor:
        """Draft id of each target id, -1 where the token is not in the draft vocab."""
        return self._target_to_draft.to(target_ids.device)[target_ids]


class VocabBuffers(nn.Module):
    """A drafter network that carries its frozen draft vocabulary as the `d2t` / `t2d` buffers
    (saved with its weights, under the names vLLM's checkpoints use)."""

    def register_vocab(self, vocab: DraftVocab, vocab_size: int, draft_vocab_size: int) -> None:
        """Hold `vocab`, refusing one whose sizes are not the config's."""
        if (vocab.vocab_size, vocab.draft_vocab_size) != (vocab_size, draft_vocab_size):
            raise ValueError(
                f"draft vocab maps {vocab.draft_vocab_size} of {vocab.vocab_size} ids but the "
                f"config says {draft_vocab_size} of {vocab_size}"
            )
        self.register_buffer("d2t", vocab.d2t.clone())
        self.register_buffer("t2d", vocab.t2d.clone())

    @property
    def vocab(self) -> DraftVocab:
        return DraftVocab(self.d2t, self.t2d)
