"""The DFlash block drafter: config, Qwen3-style decoder layers whose attention reads the
projected target context, and the block forward every caller (proposer, training) shares.

A block at anchor position a is [x_a, m, m, ..., m] (block_size B, m the mask token) at rope
positions a .. a+B-1; slot k (1 <= k < B) predicts x_{a+k}. The context is the target's features
at positions < a (the anchor's own features do not exist yet when decoding: x_a is the token the
target just emitted), fused once by `fc` + `hidden_norm`; every layer projects that same fused
tensor to its own keys and values (k-norm and rope at the context positions), exactly as vLLM's
`qwen3_dflash` fills its draft KV cache. Queries come only from the block: a block sees its
visible context and all of its own slots (bidirectional), never another block.

Head (`head`, the pipeline's `drafter.head`): "draft" trains a [Vd, H] head over the features
stage's frozen DraftVocab, as EAGLE-3's; "target" is the target's own lm_head [V, H], frozen,
over the full vocabulary, as the public DFlash trainers do. A target head is a draft-vocab head
whose map is the identity (`DraftVocab.full`), so teachers, losses, acceptance and the decoding
loop's `vocab_map` read it unchanged; it is saved with the drafter and shipped in exports (vLLM
shares the target's head when the shipped one equals it).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

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
    apply_rope,
)
from models.target import check_aux_layer_ids
from models.vocab import DraftVocab, VocabBuffers

DEFAULT_BLOCK_SIZE = 8
"""ModelOpt's block; 7 drafted slots cover EAGLE-3's default of 7 trained offsets
(drafting.ttt_steps), so one SFT trains the same offsets for either kind."""
DEFAULT_LAYERS = 2
"""A single layer has only one attention hop from the context to the block. Measured on this CPU
(docs/drafters.md, DFlash): the 2-layer forward over an 8-token block costs 0.63-0.68 of a
one-token forward of the 6-layer embedded target, not the small share hoped for."""
HEADS = ("draft", "target")
DEFAULT_HEAD = "draft"
"""Measured on the default profile (same 900-step SFT, seed and data): held-out teacher-forced
tau_chain 2.55 / 2.97 / 3.29 / 3.49 / 3.62 at steps 200..600 with the draft head, 2.56 / 2.92 /
3.30 / 3.44 / 3.60 with the target's frozen head, so no gain in acceptance, while the target's
[V, H] head added 0.67 ms (12%) to a decoding drafter forward on this CPU
(docs/drafters.md, DFlash)."""
DEFAULT_TARGET_LAYERS = 3
"""The target layers the context reads: EAGLE-3's three aux layers (the run's one target serves
either kind); the public DFlash recipes read 5 (`drafter.target_layers`)."""
DEFAULT_ANCHORS = 256
"""Anchors per training sequence: the default profile's sequences (prompt + 96 new tokens) are
shorter, so every trainable position becomes an anchor; longer ones are subsampled."""


@dataclass(frozen=True)
class DFlashConfig(TargetLayout):
    """Shape of a DFlash drafter. Sizes, attention layout, norm eps and rope are the target's
    (`TargetLayout`); `num_layers`, `block_size`, `mask_token_id` and `anchors` are the kind's
    own settings."""

    target_hidden_size: int
    draft_vocab_size: int
    target_layer_ids: tuple[int, ...]  # HF hidden_states[k] convention, as the features stage
    target_num_layers: int
    num_layers: int
    block_size: int
    mask_token_id: int
    anchors: int
    head: str = DEFAULT_HEAD  # drafters saved before the choice existed have a draft head

    def __post_init__(self) -> None:
        super().__post_init__()
        object.__setattr__(self, "target_layer_ids", tuple(int(i) for i in self.target_layer_ids))
        self.check_positive(("num_layers", "anchors", "draft_vocab_size"))
        if self.block_size < 2:
            raise ValueError(
                f"DFlash block_size must be >= 2 (the anchor plus at least one drafted slot), "
                f"got {self.block_size}"
            )
        if self.block_size > self.max_position_embeddings:
            raise ValueError(
                f"DFlash block_size {self.block_size} exceeds the target's "
                f"{self.max_position_embeddings} positions (max_position_embeddings): a block "
                "spans block_size positions; use a smaller block_size"
            )
        if self.num_layers > self.target_num_layers:
            raise ValueError(
                f"a {self.num_layers}-layer drafter is deeper than the target "
                f"({self.target_num_layers} layers): a block would cost more than the target's "
                "verify forward over it; use fewer layers"
            )
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(
                f"DFlash mask_token_id {self.mask_token_id} is outside the target vocab "
                f"[0, {self.vocab_size})"
            )
        if self.draft_vocab_size > self.vocab_size:
            raise ValueError(
                f"draft_vocab_size ({self.draft_vocab_size}) exceeds the target vocab "
                f"({self.vocab_size})"
            )
        if self.head not in HEADS:
            raise ValueError(f"DFlash head must be one of {list(HEADS)}, got {self.head!r}")
        if self.head == "target" and self.draft_vocab_size != self.vocab_size:
            raise ValueError(
                f"a DFlash target head covers the full vocab ({self.vocab_size}), but "
                f"draft_vocab_size is {self.draft_vocab_size}; build it with DraftVocab.full"
            )
        check_aux_layer_ids(
            self.target_layer_ids, self.target_num_layers, len(self.target_layer_ids)
        )

    @classmethod
    def from_target(
        cls,
        target_hf_config: Any,
        draft_vocab_size: int,
        target_layer_ids: Sequence[int],
        *,
        num_layers: int = DEFAULT_LAYERS,
        block_size: int = DEFAULT_BLOCK_SIZE,
        mask_token_id: int | None = None,
        anchors: int = DEFAULT_ANCHORS,
        head: str = DEFAULT_HEAD,
    ) -> DFlashConfig:
        cfg = hf_config_dict(target_hf_config)
        return cls(
            **target_layout(cfg),
            target_hidden_size=cfg["hidden_size"],
            draft_vocab_size=draft_vocab_size,
            target_layer_ids=tuple(target_layer_ids),
            target_num_layers=cfg["num_hidden_layers"],
            num_layers=num_layers,
            block_size=block_size,
            mask_token_id=default_mask_token(cfg) if mask_token_id is None else mask_token_id,
            anchors=anchors,
            head=head,
        )


def default_mask_token(target_config: Mapping[str, Any]) -> int:
    """The target's pad token when it has one that is not also EOS/BOS (the embedded target's
    `<|pad|>`, id 2): generated and feature sequences never hold it as a trained token, and
    its embedding row is frozen like every other. Else the last id (a byte-level BPE's rarest
    merge). Either is safe for losslessness: the mask token only ever enters the drafter as an
    input, so a target that emits it costs acceptance at worst, never correctness."""
    pad = target_config.get("pad_token_id")
    specials = {target_config.get("eos_token_id"), target_config.get("bos_token_id")}
    if isinstance(pad, int) and pad not in specials:
        return pad
    return int(target_config["vocab_size"]) - 1


def block_attention(
    q: Tensor, k_ctx: Tensor, v_ctx: Tensor, k_blk: Tensor, v_blk: Tensor, visible: Tensor
) -> Tensor:
    """Attention of blocks over their visible context and their own slots.

    q [N, h, A, B, d] (A blocks of B slots per row), k_ctx/v_ctx [N, kv, S, d], k_blk/v_blk
    [N, kv, A, B, d], visible [N, A, S] bool (context slots each block may read) -> [N, h, A, B, d].
    Block-to-block scores are computed per block ([.., B, B]), never as a dense [AB, AB] mask.
    """
    if q.shape[2] == 1:  # one block per row (decoding): one fused kernel instead of ~12 ops
        N, h, _, B, d = q.shape
        keys = torch.cat([k_ctx, k_blk[:, :, 0]], dim=2)  # [N, kv, S+B, d]
        values = torch.cat([v_ctx, v_blk[:, :, 0]], dim=2)
        mask = torch.cat([visible, visible.new_ones(N, 1, B)], dim=2)[:, None]  # [N, 1, 1, S+B]
        out = F.scaled_dot_product_attention(
            q[:, :, 0], keys, values, attn_mask=mask, enable_gqa=h != k_ctx.shape[1]
        )  # [N, h, B, d]
        return out[:, :, None]
    groups = q.shape[1] // k_ctx.shape[1]
    k_ctx, v_ctx = k_ctx.repeat_interleave(groups, 1), v_ctx.repeat_interleave(groups, 1)
    k_blk, v_blk = k_blk.repeat_interleave(groups, 1), v_blk.repeat_interleave(groups, 1)
    scale = q.shape[-1] ** -0.5
    ctx = torch.einsum("nhabd,nhsd->nhabs", q, k_ctx) * scale  # [N, h, A, B, S]
    ctx = ctx.masked_fill(~visible[:, None, :, None, :], float("-inf"))
    own = torch.einsum("nhabd,nhacd->nhabc", q, k_blk) * scale  # [N, h, A, B, B]
    probs = torch.cat([ctx, own], dim=-1).float().softmax(-1).to(q.dtype)
    S = k_ctx.shape[2]
    out = torch.einsum("nhabs,nhsd->nhabd", probs[..., :S], v_ctx)
    return out + torch.einsum("nhabc,nhacd->nhabd", probs[..., S:], v_blk)


class DFlashAttention(nn.Module):
    """Qwen3 attention (GQA, per-head q/k RMSNorm, rope) whose keys are the context's and the block's."""

    def __init__(self, config: DFlashConfig) -> None:
        super().__init__()
        H, d = config.hidden_size, config.head_dim
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = d
        self.q_proj = nn.Linear(H, self.num_heads * d, bias=False)
        self.k_proj = nn.Linear(H, self.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(H, self.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(self.num_heads * d, H, bias=False)
        self.q_norm = RMSNorm(d, config.rms_norm_eps)
        self.k_norm = RMSNorm(d, config.rms_norm_eps)

    def _kv(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        """x [N, T, H] -> k, v [N, kv, T, d] (k normed and rotated)."""
        N, T, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(N, T, self.num_kv_heads, self.head_dim))
        v = self.v_proj(x).view(N, T, self.num_kv_heads, self.head_dim)
        return apply_rope(k.transpose(1, 2), cos, sin), v.transpose(1, 2)

    def context_kv(self, context: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        """The fused context [N, S, H] (rope cos/sin [N, S, d]) -> this layer's k, v [N, kv, S, d]."""
        return self._kv(context, cos, sin)

    def forward(
        self, x: Tensor, cos: Tensor, sin: Tensor, k_ctx: Tensor, v_ctx: Tensor, visible: Tensor
    ) -> Tensor:
        """x [N, A, B, H] block slots (cos/sin [N, A*B, d]) -> [N, A, B, H]."""
        N, A, B, H = x.shape
        flat = x.reshape(N, A * B, H)
        q = self.q_norm(self.q_proj(flat).view(N, A * B, self.num_heads, self.head_dim))
        q = apply_rope(q.transpose(1, 2), cos, sin)  # [N, h, AB, d]
        k, v = self._kv(flat, cos, sin)  # [N, kv, AB, d]
        out = block_attention(
            q.view(N, self.num_heads, A, B, self.head_dim),
            k_ctx,
            v_ctx,
            k.view(N, self.num_kv_heads, A, B, self.head_dim),
            v.view(N, self.num_kv_heads, A, B, self.head_dim),
            visible,
        )  # [N, h, A, B, d]
        out = out.permute(0, 2, 3, 1, 4).reshape(N, A, B, self.num_heads * self.head_dim)
        return self.o_proj(out)


class DFlashDecoderLayer(nn.Module):
    """A pre-norm Qwen3 decoder layer over the block (vLLM's DFlashQwen3DecoderLayer)."""

    def __init__(self, config: DFlashConfig) -> None:
        super().__init__()
        H, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(H, eps)
        self.self_attn = DFlashAttention(config)
        self.post_attention_layernorm = RMSNorm(H, eps)
        self.mlp = SwiGLU(config.hidden_size, config.intermediate_size)

    def forward(
        self, x: Tensor, cos: Tensor, sin: Tensor, k_ctx: Tensor, v_ctx: Tensor, visible: Tensor
    ) -> Tensor:
        """x [N, A, B, H] -> [N, A, B, H]."""
        h = x + self.self_attn(self.input_layernorm(x), cos, sin, k_ctx, v_ctx, visible)
        return h + self.mlp(self.post_attention_layernorm(h))


class DFlashModel(VocabBuffers):
    """fc + hidden_norm over the target's features, `num_layers` decoder layers, final norm and
    a draft-vocab head (frozen when it is the target's). Parameter names follow vLLM's dflash
    checkpoints (`fc`, `hidden_norm`, `layers.N.*`, `norm`, `lm_head`, `d2t`/`t2d`);
    `embed_tokens` is the target's, never saved."""

    def __init__(self, config: DFlashConfig, embed_weight: Tensor, vocab: DraftVocab) -> None:
        super().__init__()
        check_embedding_shape(embed_weight, config)
        self.config = config
        self.embed_tokens = nn.Embedding.from_pretrained(embed_weight, freeze=True)
        n_features = len(config.target_layer_ids) * config.target_hidden_size
        self.fc = nn.Linear(n_features, config.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashDecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.draft_vocab_size, bias=False)
        # The optimizer takes only trainable parameters, so a target head is never updated.
        self.lm_head.weight.requires_grad_(config.head == "draft")
        self.rotary = RotaryEmbedding(config.rope_parameters, config.head_dim)
        self.register_vocab(vocab, config.vocab_size, config.draft_vocab_size)

    def context_kv(self, aux_hidden: Tensor, positions: Tensor) -> list[tuple[Tensor, Tensor]]:
        """Target features [N, S, n*H_t] at `positions` [N, S] -> per layer (k, v) [N, kv, S, d]."""
        want = len(self.config.target_layer_ids) * self.config.target_hidden_size
        if aux_hidden.shape[-1] != want:
            raise ValueError(
                f"aux_hidden last dim is {aux_hidden.shape[-1]}, expected {want} (the target's "
                f"states at layers {list(self.config.target_layer_ids)}, concatenated)"
            )
        context = self.hidden_norm(self.fc(aux_hidden.to(self.fc.weight.dtype)))  # [N, S, H]
        cos, sin = self.rotary(positions, context.dtype)  # [N, S, d]
        return [layer.self_attn.context_kv(context, cos, sin) for layer in self.layers]

    def block_tokens(self, anchor_tokens: Tensor) -> Tensor:
        """anchor_tokens [N, A] -> the blocks [N, A, B]: the anchor then B-1 mask tokens."""
        blocks = torch.full(
            (*anchor_tokens.shape, self.config.block_size),
            self.config.mask_token_id,
            dtype=torch.long,
            device=anchor_tokens.device,
        )
        blocks[..., 0] = anchor_tokens
        return blocks

    def forward(
        self,
        blocks: Tensor,
        anchor_positions: Tensor,
        context: Sequence[tuple[Tensor, Tensor]],
        visible: Tensor,
        drafts: int | None = None,
        *,
        lazy_head: bool = False,
    ) -> Tensor | HeadLogits:
        """Draft logits [N, A, K, Vd] fp32 of the drafted slots 1..K (K = `drafts`, default
        B-1) of blocks [N, A, B] anchored at `anchor_positions` [N, A], over the per-layer
        context keys/values (`context_kv`) [N, kv, S, d] of which block a reads the slots
        `visible` [N, A, S]. The head runs on those K slots only: the anchor's slot drafts
        nothing, and with the target's head each slot costs a [V, H] product. `lazy_head`:
        the logits as a `HeadLogits`, for a fused loss to compute a chunk at a time."""
        N, A, B = blocks.shape
        positions = anchor_positions[..., None] + torch.arange(B, device=blocks.device)
        x = self.embed_tokens(blocks).to(self.fc.weight.dtype)  # [N, A, B, H]
        cos, sin = self.rotary(positions.reshape(N, A * B), x.dtype)  # [N, AB, d]
        for layer, (k_ctx, v_ctx) in zip(self.layers, context, strict=True):
            x = layer(x, cos, sin, k_ctx, v_ctx, visible)  # [N, A, B, H]
        x = x[:, :, 1 : 1 + (B - 1 if drafts is None else drafts)]  # [N, A, K, H]
        if lazy_head:
            return HeadLogits.of(self.norm(x), self.lm_head.weight)
        return self.lm_head(self.norm(x)).float()  # [N, A, K, Vd]
