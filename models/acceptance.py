"""Teacher-forced acceptance statistics of a drafter, summed so batches and ranks add up."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor


@dataclass
class AcceptanceStats:
    """Sums (so batches and ranks add up) for the greedy acceptance of an unrolled drafter.

    Per draft offset k (a chain step, a block slot): hits[k] / valid[k] is the T=0 acceptance
    proxy alpha_k (the drafter's argmax equals the target's); alpha_sum[k] / valid[k] the
    expected T=1 acceptance sum_v min(p, q). `chain_len` adds up, over drafts valid at each of
    the first `chain_k` offsets, the number of leading offsets that hit: the accepted length
    greedy speculative decoding would get there (teacher-forced inputs equal the drafts exactly
    while the draft is still accepted). Each kind computes them from its own outputs
    (`Drafter.acceptance`).
    """

    hits: Tensor  # [K] float64
    valid: Tensor  # [K]
    alpha_sum: Tensor  # [K]
    chain_rows: Tensor  # []
    chain_len: Tensor  # []
    chain_k: int

    @classmethod
    def zeros(cls, steps: int, chain_k: int, device: torch.device | str = "cpu") -> AcceptanceStats:
        """Sums on the device of the logits they count: a CPU copy per batch would make every
        training step on a GPU wait for it, and NCCL reduces only device tensors."""
        z = torch.zeros(steps, dtype=torch.float64, device=device)
        return cls(
            z,
            z.clone(),
            z.clone(),
            torch.zeros((), dtype=torch.float64, device=device),
            torch.zeros((), dtype=torch.float64, device=device),
            chain_k,
        )

    def __add__(self, other: AcceptanceStats) -> AcceptanceStats:
        return AcceptanceStats(
            self.hits + other.hits,
            self.valid + other.valid,
            self.alpha_sum + other.alpha_sum,
            self.chain_rows + other.chain_rows,
            self.chain_len + other.chain_len,
            self.chain_k,
        )

    def reduced(self, reduce_sum: Callable[[Tensor], Tensor]) -> AcceptanceStats:
        """The stats after `reduce_sum` of their sums as one flat tensor: the caller's sum over
        ranks (pipeline.core.training.all_reduce_sum), which knows the process group."""
        flat = torch.cat(
            [self.hits, self.valid, self.alpha_sum, self.chain_rows[None], self.chain_len[None]]
        )
        flat = reduce_sum(flat)
        k = len(self.hits)
        return AcceptanceStats(
            flat[:k], flat[k : 2 * k], flat[2 * k : 3 * k], flat[-2], flat[-1], self.chain_k
        )

    def accuracy(self) -> list[float]:
        return (self.hits / self.valid.clamp_min(1)).tolist()

    def summary(self) -> dict[str, Any]:
        """Per-step accuracy and expected alpha; tau = 1 + sum_k prod_{i<=k} alpha_i over chain_k steps."""
        k = self.chain_k
        acc = self.hits / self.valid.clamp_min(1)
        alpha = self.alpha_sum / self.valid.clamp_min(1)
        return {
            "acc": acc.tolist(),
            "alpha": alpha.tolist(),
            "tau_sim": float(1 + acc[:k].cumprod(0).sum()),
            "tau_expected": float(1 + alpha[:k].cumprod(0).sum()),
            "tau_chain": float(1 + self.chain_len / self.chain_rows.clamp_min(1)),
        }
