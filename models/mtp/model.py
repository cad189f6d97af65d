"""The MTP network: DeepSeek-V3's multi-token prediction modules as a drafter beside a frozen
target, a `models.chain.ChainNetwork` (row convention and training-time test: models/chain.py).

Module k (1-based) at row t reads the previous module's hidden state h^{k-1}_t (the target's
last hidden state h_t for the first) and the embedding of the token k positions on,
x_{t+k}; both go through their own RMSNorm (`hnorm`, `enorm`), are concatenated
[embedding; hidden] and projected 2H -> H (`eh_proj`); one Llama decoder layer gives h^k_t,
and the target's own lm_head, frozen, after the module's `norm` predicts x_{t+k+1}. The
embedding and the head are shared with the target (DeepSeek-V3 shares both with its main
model); the head is a copy saved with the drafter, checked equal to the target's. Its
vocabulary is the target's whole one (`DraftVocab.full`), never the features' pruned map.

Depths beyond the D modules reuse the last module, reading its own previous output: how
vLLM's and SGLang's MTP proposers serve more speculative tokens than a checkpoint has modules.
In decoding and in the training unroll every step attends to one draft KV cache, as an EAGLE
chain does: the keys the first module wrote over the committed rows, then the chain's own
(docs/drafters.md: MTP says why).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from models.chain import ChainAttention, ChainLayer, ChainNetwork
from models.features import Features
from models.kind_config import TargetLayout, hf_config_dict, target_layout
from models.layers import (
    RMSNorm,
    RotaryEmbedding,
    SwiGLU,
)
from models.vocab import DraftVocab

DEFAULT_MODULES = 1
"""DeepSeek-V3 trains and ships one MTP module."""


@dataclass(frozen=True)
class MTPConfig(TargetLayout):
    """Shape of an MTP drafter: the target's layout (`TargetLayout`) and `num_modules` (D)."""

    num_modules: int = DEFAULT_MODULES

    def __post_init__(self) -> None:
        super().__post_init__()
        self.check_positive(("num_modules",))

    @classmethod
    def from_target(cls, target_hf_config: Any, num_modules: int = DEFAULT_MODULES) -> MTPConfig:
        """The target's sizes, attention layout, norm eps, rope and context length."""
        cfg = hf_config_dict(target_hf_config)
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(
                f"hidden_act {cfg['hidden_act']!r} is not supported; the MTP layer's MLP is SiLU-gated"
            )
        return cls(**target_layout(cfg), num_modules=num_modules)


class MTPModule(ChainLayer):
    """One MTP module: [enorm(embedding); hnorm(hidden)] -> eh_proj -> one decoder layer; `norm`
    is its head's norm (each DeepSeek-V3 module has its own before the shared head)."""

    def __init__(self, config: MTPConfig) -> None:
        super().__init__()
        H, eps = config.hidden_size, config.rms_norm_eps
        self.enorm = RMSNorm(H, eps)
        self.hnorm = RMSNorm(H, eps)
        self.eh_proj = nn.Linear(2 * H, H, bias=False)
        self.input_layernorm = RMSNorm(H, eps)
        self.self_attn = ChainAttention(
            H, H, config.num_attention_heads, config.num_key_value_heads, config.head_dim
        )
        self.post_attention_layernorm = RMSNorm(H, eps)
        self.mlp = SwiGLU(H, config.intermediate_size)
        self.norm = RMSNorm(H, eps)

    def attention_input(self, embeds: Tensor, hidden: Tensor) -> tuple[Tensor, Tensor]:
        x = self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(hidden)], dim=-1))  # [B, T, H]
        return self.input_layernorm(x), x


class MTPModel(ChainNetwork):
    """D MTP modules between the target's frozen embedding and its frozen lm_head.

    `embed_tokens` is the target's and is never saved; `lm_head` is a frozen copy of the
    target's head (saved: checkpoints load without the target's head at hand); `d2t` / `t2d`
    are the identity map over the target's vocabulary.
    """

    def __init__(self, config: MTPConfig, embed_weight: Tensor, lm_head_weight: Tensor) -> None:
        super().__init__()
        shape = (config.vocab_size, config.hidden_size)
        for name, weight in (("embedding", embed_weight), ("lm_head", lm_head_weight)):
            if tuple(weight.shape) != shape:
                raise ValueError(
                    f"target {name} has shape {tuple(weight.shape)} but the drafter expects "
                    f"[vocab {shape[0]}, hidden {shape[1]}]: pass the target's own"
                )
        self.config = config
        self.embed_tokens = nn.Embedding.from_pretrained(embed_weight, freeze=True)
        self.layers = nn.ModuleList(MTPModule(config) for _ in range(config.num_modules))
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.lm_head.weight.requires_grad_(False)
        with torch.no_grad():
            self.lm_head.weight.copy_(lm_head_weight)
        self.rotary = RotaryEmbedding(config.rope_parameters, config.head_dim)
        self.register_vocab(
            DraftVocab.full(config.vocab_size), config.vocab_size, config.vocab_size
        )

    def read_features(self, features: Features) -> Tensor:
        """The target's last hidden state [..., H]: the only target state MTP reads."""
        if features.last_hidden is None:
            raise ValueError(
                "MTP modules read the target's last hidden state: the features carry none"
            )
        return features.last_hidden

    def start_hidden(self, states: Tensor) -> Tensor:
        """The first module reads the target's state itself (through its `hnorm`)."""
        return states.to(self.layers[0].eh_proj.weight.dtype)

    def step_layer(self, step: int) -> tuple[ChainLayer, nn.Module]:
        """Module step+1, or the last one past D, and that module's own norm."""
        module = self.layers[min(step, len(self.layers) - 1)]
        return module, module.norm
