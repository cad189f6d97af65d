"""Medusa heads (Medusa-1: the target frozen): N heads on the target's last hidden state.

Head k (1 <= k <= N) reads the target's final post-norm state h_t at position t, the state
whose own next token x_{t+1} the target predicts, and predicts x_{t+1+k}:

    z_k = h_t + SiLU(W_k h_t)      (one residual block per layer, `num_layers` of them)
    logits_k = U_k z_k             (U_k over the frozen draft vocabulary, [Vd, H])

No head reads a drafted token or another head, so one forward drafts every offset at once, and a
head's distribution never depends on the drafts before it (a block, to the verifier and to
Draft-OPD). Initialisation is Medusa's: W_k = 0, so z_k = h_t, and U_k = the target's lm_head
rows of the draft vocabulary, so every head starts out as the target's next-token head.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from models.head_loss import HeadLogits
from models.kind_config import KindConfig
from models.vocab import DraftVocab, VocabBuffers

DEFAULT_HEADS = 4  # Medusa's default head count
DEFAULT_LAYERS = 1  # residual blocks per head (Medusa-1's default)


@dataclass(frozen=True)
class MedusaConfig(KindConfig):
    """Shape of a Medusa drafter: the target's width and vocabulary, the draft vocabulary's
    size, and the kind's own settings (`num_heads`, `num_layers`)."""

    hidden_size: int
    vocab_size: int
    draft_vocab_size: int
    num_heads: int = DEFAULT_HEADS
    num_layers: int = DEFAULT_LAYERS

    def __post_init__(self) -> None:
        for name in ("hidden_size", "vocab_size", "draft_vocab_size", "num_heads", "num_layers"):
            if int(getattr(self, name)) <= 0:
                raise ValueError(f"MedusaConfig.{name} must be positive, got {getattr(self, name)}")
        if self.draft_vocab_size > self.vocab_size:
            raise ValueError(
                f"draft vocab ({self.draft_vocab_size}) exceeds the target vocab ({self.vocab_size})"
            )


class ResidualBlock(nn.Module):
    """x + SiLU(W x), with W [H, H] and no bias (vLLM's Medusa layout)."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size, bias=False)
        self.act = nn.SiLU()

    def forward(self, x: Tensor) -> Tensor:
        return x + self.act(self.linear(x))


class MedusaHeads(VocabBuffers):
    """N heads, each `num_layers` residual blocks and a draft-vocabulary head; `d2t` / `t2d`
    carry the draft vocabulary's map as buffers (saved with the heads)."""

    def __init__(self, config: MedusaConfig, vocab: DraftVocab) -> None:
        super().__init__()
        self.config = config
        H = config.hidden_size
        self.blocks = nn.ModuleList(
            nn.Sequential(*(ResidualBlock(H) for _ in range(config.num_layers)))
            for _ in range(config.num_heads)
        )
        self.heads = nn.ModuleList(
            nn.Linear(H, config.draft_vocab_size, bias=False) for _ in range(config.num_heads)
        )
        self.register_vocab(vocab, config.vocab_size, config.draft_vocab_size)

    def start_from_target_head(self, lm_head_weight: Tensor) -> None:
        """Medusa's initialisation: zero residual blocks, each head the target's lm_head rows
        [Vd, H] of the draft vocabulary (lm_head_weight [V, H])."""
        rows = lm_head_weight[self.vocab.draft_to_target_ids.to(lm_head_weight.device)]
        with torch.no_grad():
            for block, head in zip(self.blocks, self.heads, strict=True):
                for layer in block:
                    layer.linear.weight.zero_()
                head.weight.copy_(rows.to(head.weight.dtype))

    def forward(
        self, last_hidden: Tensor, heads: int | None = None, *, lazy_head: bool = False
    ) -> Tensor | list[HeadLogits]:
        """last_hidden [..., H] -> logits [..., K, Vd] of the first `heads` heads (all: None).
        `lazy_head`: each head's logits [..., Vd] as a `HeadLogits` (K of them, one weight
        each), for a fused loss to compute a chunk at a time."""
        k = self.config.num_heads if heads is None else heads
        x = last_hidden.to(self.heads[0].weight.dtype)
        pairs = zip(self.blocks[:k], self.heads[:k], strict=True)
        if lazy_head:
            return [HeadLogits.of(block(x), head.weight) for block, head in pairs]
        return torch.stack([head(block(x)) for block, head in pairs], dim=-2)  # [..., K, Vd]
