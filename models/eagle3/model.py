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

from models.chain import ChainAttention, ChainLayer, ChainNetwork
from models.features import Features
from models.head_loss import HeadLogits
from models.kind_config import (
    TargetLayout,
    check_embedding_shape,
    hf_config_dict,
    target_layout,
)
from models.layers import (
    RMSNorm,
    RotaryEmbedding,
    SwiGLU,
)
from models.target import check_aux_layer_ids, default_aux_layer_ids
from models.vocab import DraftVocab


@dataclass(frozen=True)
class Eagle3Config(TargetLayout):
    """Shape of an EAGLE-3 drafter: the target's layout (`TargetLayout`), its hidden size and
    layer count, and the kind's own `draft_vocab_size` and `aux_layer_ids`."""

    target_hidden_size: int
    draft_vocab_size: int
    aux_layer_ids: tuple[int, int, int]
    target_num_layers: int
    hidden_act: str = "silu"

    def __post_init__(self) -> None:
        super().__post_init__()
        object.__setattr__(self, "aux_layer_ids", tuple(int(i) for i in self.aux_layer_ids))
        self.check_positive(("target_hidden_size", "draft_vocab_size", "target_num_layers"))
        if self.draft_vocab_size > self.vocab_size:
            raise ValueError(
                f"draft_vocab_size ({self.draft_vocab_size}) exceeds the target vocab ({self.vocab_size}); "
                "choose a draft vocab no larger than the target's"
            )
        check_aux_layer_ids(self.aux_layer_ids, self.target_num_layers)
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


class Eagle3DecoderLayer(ChainLayer):
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

    def attention_input(self, embeds: Tensor, hidden: Tensor) -> tuple[Tensor, Tensor]:
        normed = [self.input_layernorm(embeds), self.hidden_norm(hidden)]
        return torch.cat(normed, dim=-1), hidden  # [B, T, 2H], the raw hidden [B, T, H]


class Eagle3Model(ChainNetwork):
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

    def step_layer(self, step: int) -> tuple[ChainLayer, nn.Module]:
        """Every step runs the one layer."""
        return self.midlayer, self.norm

    def forward(
        self, input_ids: Tensor, hidden: Tensor, position_ids: Tensor, **options: Any
    ) -> tuple[Tensor | HeadLogits, Tensor]:
        """The one layer's step (`chain_step`, whose `options` it takes): (logits [B, T, Vd]
        fp32, hidden_out [B, T, H] before the final norm); `hidden` is `fuse(aux_hidden)` at
        the first step and the previous hidden_out after."""
        return self.chain_step(0, input_ids, hidden, position_ids, **options)
