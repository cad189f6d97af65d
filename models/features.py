"""The features record: what a drafter may read of the target's pass over token rows.

One record for the decoding loop's committed rows, the training stages' cached sequences and a
replayed sequence, carrying what the target's forward computes for a drafter (its aux layers,
its last hidden state) and where each row sits. A kind reads the fields it needs and declares
them (`models.kind.Reads`): the stages store and compute only those (`pipeline.core.featurize`),
so a field the kind does not read may be None (Medusa's sequences carry no aux layers), and a
head that reads the last hidden state changes neither the loop nor the stages.

Two row conventions, one per caller (each method of `models.drafter` says which it receives):
  - committed rows (`Proposer.propose`): row j holds the target's states at sequence position
    `positions[:, j]` and `ids[:, j]`, the token AFTER that position (the one the drafter embeds
    with them; for the last committed row, the token the target just sampled);
  - sequences (`unroll`, `replay`): `ids` are the tokens at positions 0..T-1 themselves, as the
    target read them, and the kind shifts them as its training needs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class Features:
    ids: Tensor  # [B, T] int64 (module docstring: after each position, or at it)
    aux: Tensor | None = None  # [B, T, F] the target's aux layers, concatenated; None: not read
    last_hidden: Tensor | None = None  # [B, T, H] its final (post-norm) state; None: not read
    positions: Tensor | None = None  # [B, T] sequence positions; None: 0..T-1
    valid: Tensor | None = None  # [B, T] bool, rows that hold a token; None: every row
    head: Tensor | None = None
    """[B] the prefill's committed rows only: each prompt's first token, which no row comes
    after (a drafter reading the whole text, as prompt lookup does, needs it)."""

    def select(self, rows: Tensor) -> Features:
        """The batch rows `rows` [B'] (finished sequences left the batch)."""
        return Features(*(None if t is None else t[rows] for t in self._fields()))

    def _fields(self) -> tuple[Tensor | None, ...]:
        return (self.ids, self.aux, self.last_hidden, self.positions, self.valid, self.head)


def replay_inputs(
    features: Features, anchors: Tensor, k: int, device: torch.device, most: int | None = None
) -> tuple[Tensor, Tensor | None, Tensor]:
    """One sequence's ids [T], aux [T, F] (None where the kind reads none) and replay anchors
    [C] on `device`, refusing what no replay can draft from: anchor e drafts after token e-1
    from the prefix y<e, so 2 <= e <= T, and 1 <= k (<= `most`, the drafts one step
    proposes)."""
    ids = torch.as_tensor(features.ids, dtype=torch.long, device=device).reshape(-1)  # [T]
    anchors = torch.as_tensor(anchors, dtype=torch.long, device=device).reshape(-1)  # [C]
    T, C = ids.numel(), anchors.numel()
    for name, states in (("aux_hidden", features.aux), ("last_hidden", features.last_hidden)):
        if states is not None and states.shape[0] != T:
            raise ValueError(f"{name} has {states.shape[0]} rows for {T} tokens")
    if C == 0 or k < 1 or (most is not None and k > most):
        bound = "1 <= k" if most is None else f"1 <= k <= {most} (the drafts one step proposes)"
        raise ValueError(f"need at least one anchor and {bound}, got {C} anchors and k={k}")
    if int(anchors.min()) < 2 or int(anchors.max()) > T:
        raise ValueError(
            f"anchors must lie in [2, {T}] (anchor e drafts after token e-1 from the prefix "
            f"y<e), got {anchors.min().item()}..{anchors.max().item()}"
        )
    return ids, features.aux, anchors
