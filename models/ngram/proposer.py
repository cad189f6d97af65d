"""The lookup drafter's proposer in the decoding loop: each row's text, grown by the rows the
loop commits, looked up once per verify step (no forward)."""

from __future__ import annotations

import torch
from torch import Tensor

from models.drafter import Proposal
from models.features import Features
from models.ngram.lookup import lookup


class LookupProposer:
    """Chains of point-mass drafts: a looked-up token has q = 1 at any temperature, so the
    loop accepts it with the target's p(x) and a rejection leaves p without x."""

    def __init__(self, min_n: int, max_n: int, k: int) -> None:
        self.min_n, self.max_n, self.k = min_n, max_n, k
        self.texts: list[list[int]] | None = None  # per batch row: prompt + generated

    def propose(self, rows: Features, budget: Tensor) -> Proposal:
        ids = rows.ids.tolist()  # [B, T]
        valid = rows.valid.tolist() if rows.valid is not None else None
        new = [
            [t for j, t in enumerate(r) if valid is None or valid[i][j]] for i, r in enumerate(ids)
        ]
        if self.texts is None:  # the prefill: every prompt token after the first, and the first
            heads = rows.head.tolist() if rows.head is not None else [None] * len(new)
            self.texts = [
                ([h] if h is not None else []) + r for h, r in zip(heads, new, strict=True)
            ]
        else:
            for text, r in zip(self.texts, new, strict=True):
                text += r
        budget = budget.clamp(max=self.k).tolist()
        drafts = [
            lookup(t, self.min_n, self.max_n, b) for t, b in zip(self.texts, budget, strict=True)
        ]
        width = max(map(len, drafts))
        device = rows.ids.device
        tokens = torch.tensor([d + [0] * (width - len(d)) for d in drafts], dtype=torch.long)
        lengths = torch.tensor([len(d) for d in drafts], dtype=torch.long, device=device)
        ones = torch.ones(len(drafts), width, device=device)
        return Proposal(
            tokens=tokens.reshape(len(drafts), width).to(device),
            q=ones,
            confidence=ones,
            forwards=0,
            lengths=lengths,
        )

    def keep_rows(self, rows: Tensor) -> None:
        self.texts = [self.texts[i] for i in rows.tolist()]
