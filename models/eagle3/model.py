"""The EAGLE-3 network: config and one decoder layer over fused low/mid/high target features,
a `models.chain.ChainNetwork` (its row convention, and the training-time test SFT and OPD train
through, are models/chain.py's): row t reads the fused feature f_t and token x_{t+1}.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from models.chain import ChainAttention, TTTCache
from models.features import Features
from models.head_loss import HeadLogits
from models.kind_config import (
    KindConfig,
    check_embedding_shape,
    hf_config_dict,
    target_layout,
)
from models.kv import KVCache
from models.layers import (
    SUPPORTED_ROPE_TYPES,
    RMSNorm,
    RotaryEmbedding,
    SwiGLU,
)
from models.target import check_aux_layer_ids, default_aux_layer_ids
from models.vocab import DraftVocab, VocabBuffers


@dataclass(frozen=True)
class Eagle3Config(KindConfig):
    """Shape of an EAGLE-3 drafter; every field but `draft_vocab_size` and `aux_layer_ids` is the target's."""

    hidden_size: int
    target_hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_parameters: dict[str, Any]
    max_position_embeddings: int
    vocab_size: int
    draft_vocab_size: int
    aux_layer_ids: tuple[int, int, int]
    target_num_layers: int
    hidden_act: str = "silu"

    def __post_init__(self) -> None:
        object.__setattr__(self, "aux_layer_ids", tuple(int(i) for i in self.aux_layer_ids))
        object.__setattr__(self, "rope_parameters", dict(self.rope_parameters))
        for name in (
            "hidden_size",
            "target_hidden_size",
            "intermediate_size",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "max_position_embeddings",
            "vocab_size",
            "draft_vocab_size",
            "target_num_layers",
        ):
            if int(getattr(self, name)) <= 0:
                raise ValueError(f"Eagle3Config.{name} must be positive, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.draft_vocab_size > self.vocab_size:
            raise ValueError(
                f"draft_vocab_size ({self.draft_vocab_size}) exceeds the target vocab ({self.vocab_size}); "
                "choose a draft vocab no larger than the target's"
            )
        check_aux_layer_ids(self.aux_layer_ids, self.target_num_layers)
        rope_type = self.rope_parameters.get("rope_type", "default")
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"rope_type {rope_type!r} is not supported by the drafter (supported: "
                f"{', '.join(SUPPORTED_ROPE_TYPES)}); use a target with one of those rope types"
            )
        if "rope_theta" not in self.rope_parameters:
            raise ValueError(
                "rope_parameters must contain rope_theta (copy it from the target config)"
            )
        if self.hidden_act != "silu":
            raise ValueError(
                f"hidden_act {self.hidden_act!r} is not supported; the drafter MLP is SiLU-gated"
            )

    @classmethod
    def from_target(
        cls,
        target_hf_config: Any,
        draft_vocab_size: int,
        aux_layer_ids: Sequence[int] | None = None,
    ) -> Eagle3Config:
        """Copy sizes, attention layout, norm eps, rope and context length from the target's HF config.

        `aux_layer_ids` default: (2, N//2, N-3) as vLLM picks when a checkpoint names none.
        """
        cfg = hf_config_dict(target_hf_config)
        num_layers = cfg["num_hidden_layers"]
        return cls(
            **target_layout(cfg),
            target_hidden_size=cfg["hidden_size"],
            draft_vocab_size=draft_vocab_size,
            aux_layer_ids=tuple(aux_layer_ids)
            if aux_layer_ids is not None
            else default_aux_layer_ids(num_layers),
            target_num_layers=num_layers,
            hidden_act=cfg.get("hidden_act", "silu"),
        )


class Eagle3DecoderLayer(nn.Module):
    """vLLM's llama_eagle3 first layer with norm_before_residual=False: the residual is the raw hidden."""

    def __init__(self, config: Eagle3Config) -> None:
        super().__init__()
        H, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(H, eps)
        self.hidden_norm = RMSNorm(H, eps)
        # q/k/v read the 2H-wide [embedding; hidden] input
        self.self_attn = ChainAttention(
            2 * H,
            H,
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim,
        )
        self.post_attention_layernorm = RMSNorm(H, eps)
        self.mlp = SwiGLU(config.hidden_size, config.intermediate_size)

    def forward(
        self,
        embeds: Tensor,
        hidden: Tensor,
        cos: Tensor,
        sin: Tensor,
        attention_mask: Tensor | None,
        cache: KVCache | TTTCache | None,
    ) -> Tensor:
        normed = [self.input_layernorm(embeds), self.hidden_norm(hidden)]
        x = torch.cat(normed, dim=-1)  # [B, T, 2H]
        h = hidden + self.self_attn(x, cos, sin, attention_mask, cache)  # [B, T, H]
        return h + self.mlp(self.post_attention_layernorm(h))  # [B, T, H]


class Eagle3Model(VocabBuffers):
    """One EAGLE-3 decoder layer over the target's frozen embedding and fused low/mid/high features.

    Parameter names match vLLM's native EAGLE-3 checkpoints 1:1 (`fc`, `midlayer.*`, `norm`,
    `lm_head`, `d2t`, `t2d`); `embed_tokens` is the target's and is never saved.
    """

    def __init__(self, config: Eagle3Config, embed_weight: Tensor, vocab: DraftVocab) -> None:
        super().__init__()
        check_embedding_shape(embed_weight, config)
        self.config = config
        self.embed_tokens = nn.Embedding.from_pretrained(embed_weight, freeze=True)
        self.fc = nn.Linear(3 * config.target_hidden_size, config.hidden_size, bias=False)
        self.midlayer = Eagle3DecoderLayer(config)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.draft_vocab_size, bias=False)
        self.rotary = RotaryEmbedding(config.rope_parameters, config.head_dim)
        self.register_vocab(vocab, config.vocab_size, config.draft_vocab_size)

    def fuse(self, aux_hidden: Tensor) -> Tensor:
        """[B, T, 3*H_t] low/mid/high target states -> [B, T, H]."""
        if aux_hidden.shape[-1] != 3 * self.config.target_hidden_size:
            raise ValueError(
                f"aux_hidden last dim is {aux_hidden.shape[-1]}, expected 3 * {self.config.target_hidden_size} "
                f"(the target's states at layers {list(self.config.aux_layer_ids)}, concatenated)"
            )
        return self.fc(aux_hidden.to(self.fc.weight.dtype))

    def read_features(self, features: Features) -> Tensor:
        """The low/mid/high states [..., 3*H_t] it reads (a `ChainNetwork`)."""
        return features.aux

    start_hidden = fuse  # step 0's hidden: the fused features

    def chain_step(
        self,
        step: int,
        input_ids: Tensor,
        hidden: Tensor,
        position_ids: Tensor,
        *,
        attention_mask: Tensor | None = None,
        cache: KVCache | TTTCache | None = None,
        head_at: Tensor | None = None,
        lazy_head: bool = False,
    ) -> tuple[Tensor | HeadLogits, Tensor]:
        """Every step is the one layer's forward."""
        return self(
            input_ids,
            hidden,
            position_ids,
            attention_mask=attention_mask,
            cache=cache,
            head_at=head_at,
            lazy_head=lazy_head,
        )

    def forward(
        self,
        input_ids: Tensor,
        hidden: Tensor,
        position_ids: Tensor,
        *,
        attention_mask: Tensor | None = None,
        cache: KVCache | TTTCache | None = None,
        head_at: Tensor | None = None,
        lazy_head: bool = False,
    ) -> tuple[Tensor | HeadLogits, Tensor]:
        """Returns (logits [B, T, Vd] fp32, hidden_out [B, T, H] before the final norm).

        `attention_mask`: bool [B, T, S], True = may attend, S = cached keys + T; None = causal.
        `head_at` [B]: one row of each batch row, where alone the logits are computed ([B, Vd]).
        `lazy_head`: the logits as a `HeadLogits`, for a fused loss to compute a chunk at a time.
        """
        self._check_inputs(input_ids, hidden, position_ids, attention_mask, cache)
        embeds = self.embed_tokens(input_ids).to(hidden.dtype)  # [B, T, H]
        cos, sin = self.rotary(position_ids, hidden.dtype)  # [B, T, d]
        hidden_out = self.midlayer(embeds, hidden, cos, sin, attention_mask, cache)  # [B, T, H]
        read = hidden_out
        if head_at is not None:  # one row of each batch row: [B, H]
            read = hidden_out[torch.arange(len(head_at), device=head_at.device), head_at]
        if lazy_head:
            return HeadLogits.of(self.norm(read), self.lm_head.weight), hidden_out
        logits = self.lm_head(self.norm(read)).float()  # [B, T, Vd], or [B, Vd] at head_at
        return logits, hidden_out

    def _check_inputs(
        self,
        input_ids: Tensor,
        hidden: Tensor,
        position_ids: Tensor,
        attention_mask: Tensor | None,
        cache: KVCache | TTTCache | None,
    ) -> None:
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [B, T], got shape {tuple(input_ids.shape)}")
        B, T = input_ids.shape
        if tuple(hidden.shape) != (B, T, self.config.hidden_size):
            raise ValueError(
                f"hidden must be [B={B}, T={T}, H={self.config.hidden_size}], got {tuple(hidden.shape)}; "
                "pass drafter.fuse(aux_hidden) at step 1 and the previous hidden_out after"
            )
        if tuple(position_ids.shape) != (B, T):
            raise ValueError(
                f"position_ids must be [B={B}, T={T}], got {tuple(position_ids.shape)}"
            )
        if attention_mask is None:
            return
        if isinstance(cache, TTTCache):
            raise ValueError("a TTTCache builds its own mask; do not pass attention_mask with it")
        S = T + (cache.length if cache is not None else 0)
        if attention_mask.dtype != torch.bool or tuple(attention_mask.shape) != (B, T, S):
            raise ValueError(
                f"attention_mask must be bool [B={B}, T={T}, S={S}] (S = cached keys + new rows), got "
                f"{attention_mask.dtype} {tuple(attention_mask.shape)}"
            )
