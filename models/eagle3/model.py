"""The EAGLE-3 network: config, one decoder layer over fused low/mid/high target features, and
training-time test (the unrolled forward SFT and OPD train through).

Row convention (shared by the proposer, the replays and every training unroll): drafter row t
reads the target feature f_t (sequence position t) and token x_{t+1}, sits at rope position t
and predicts x_{t+2}. A chain continues row t at step k >= 1 with position t+k, its own previous
hidden_out and token x_{t+k+1}, and predicts x_{t+k+2}. The teacher for x_j is the target's
distribution at position j-1.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import MISSING, asdict, dataclass, fields
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from models.kv import KVCache
from models.layers import (
    SUPPORTED_ROPE_TYPES,
    RMSNorm,
    RotaryEmbedding,
    SwiGLU,
    apply_rope,
    rope_parameters_of,
)
from models.target import check_aux_layer_ids, default_aux_layer_ids
from models.vocab import DraftVocab


@dataclass(frozen=True)
class Eagle3Config:
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
        cfg = (
            target_hf_config.to_dict()
            if hasattr(target_hf_config, "to_dict")
            else dict(target_hf_config)
        )
        num_layers = cfg["num_hidden_layers"]
        heads = cfg["num_attention_heads"]
        return cls(
            hidden_size=cfg["hidden_size"],
            target_hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_parameters=rope_parameters_of(cfg),
            max_position_embeddings=cfg["max_position_embeddings"],
            vocab_size=cfg["vocab_size"],
            draft_vocab_size=draft_vocab_size,
            aux_layer_ids=tuple(aux_layer_ids)
            if aux_layer_ids is not None
            else default_aux_layer_ids(num_layers),
            target_num_layers=num_layers,
            hidden_act=cfg.get("hidden_act", "silu"),
        )

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["aux_layer_ids"] = list(self.aux_layer_ids)
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Eagle3Config:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(
                f"unknown Eagle3Config keys {unknown}; was this file written by another version?"
            )
        required = {f.name for f in fields(cls) if f.default is MISSING}
        missing = sorted(required - set(data))
        if missing:
            raise ValueError(f"Eagle3Config is missing keys {missing}")
        return cls(**data)


class TTTCache:
    """Keys of a training-time-test unroll: step-0 keys of all rows, then each row's own chain keys.

    Step k's query at row t sees step-0 keys at rows <= t (causal) and the step 1..k keys of row t
    only: exactly the cache a chain drafting from row t would hold. Chain keys are kept per row
    ([B, n_kv, T, k, d]) so attention costs T*T + T*k scores, never a dense [T*k, T*k] mask.
    """

    def __init__(self) -> None:
        self.context: tuple[Tensor, Tensor] | None = None
        self.chain_keys: list[Tensor] = []
        self.chain_values: list[Tensor] = []


def _ttt_attention(q: Tensor, k: Tensor, v: Tensor, cache: TTTCache) -> Tensor:
    """q [B, h, T, d], k/v [B, n_kv, T, d] -> [B, h, T, d]; adds this step's keys to `cache`."""
    groups = q.shape[1] // k.shape[1]
    if cache.context is None:
        cache.context = (k, v)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=groups > 1)
    cache.chain_keys.append(k)
    cache.chain_values.append(v)
    T = q.shape[2]
    scale = q.shape[-1] ** -0.5
    ctx_k = cache.context[0].repeat_interleave(groups, dim=1)  # [B, h, T, d]
    ctx_v = cache.context[1].repeat_interleave(groups, dim=1)
    own_k = torch.stack(cache.chain_keys, dim=3).repeat_interleave(groups, dim=1)  # [B, h, T, k, d]
    own_v = torch.stack(cache.chain_values, dim=3).repeat_interleave(groups, dim=1)
    ctx_scores = (q @ ctx_k.transpose(-1, -2)) * scale  # [B, h, T, T]
    causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    ctx_scores = ctx_scores.masked_fill(~causal, float("-inf"))
    own_scores = (q.unsqueeze(3) * own_k).sum(-1) * scale  # [B, h, T, k]
    probs = torch.cat([ctx_scores, own_scores], dim=-1).float().softmax(-1).to(q.dtype)
    return probs[..., :T] @ ctx_v + (probs[..., T:].unsqueeze(-1) * own_v).sum(3)


class Eagle3Attention(nn.Module):
    """Llama attention (GQA, rope) whose q/k/v read the 2H-wide [embedding; hidden] input."""

    def __init__(self, config: Eagle3Config) -> None:
        super().__init__()
        H, d = config.hidden_size, config.head_dim
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = d
        self.q_proj = nn.Linear(2 * H, self.num_heads * d, bias=False)
        self.k_proj = nn.Linear(2 * H, self.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(2 * H, self.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(self.num_heads * d, H, bias=False)

    def forward(
        self,
        x: Tensor,
        cos: Tensor,
        sin: Tensor,
        attention_mask: Tensor | None,
        cache: KVCache | TTTCache | None,
    ) -> Tensor:
        B, T, _ = x.shape  # [B, T, 2H]
        q = self.q_proj(x).view(B, T, self.num_heads, self.head_dim).transpose(1, 2)  # [B, h, T, d]
        # k, v: [B, kv, T, d]
        k = self.k_proj(x).view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if isinstance(cache, TTTCache):
            out = _ttt_attention(q, k, v, cache)
        else:
            past = cache.length if cache is not None else 0
            if cache is not None:
                k, v = cache.append(k, v)  # [B, kv, S, d]
            if attention_mask is None:
                # Plain causal over cache + new: new row i sits at key index past + i.
                S = past + T
                attention_mask = torch.ones(T, S, dtype=torch.bool, device=x.device).tril(
                    diagonal=past
                )
            else:
                attention_mask = attention_mask[:, None]  # [B, 1, T, S]
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=attention_mask, enable_gqa=self.num_heads != self.num_kv_heads
            )
        return self.o_proj(out.transpose(1, 2).reshape(B, T, self.num_heads * self.head_dim))


class Eagle3DecoderLayer(nn.Module):
    """vLLM's llama_eagle3 first layer with norm_before_residual=False: the residual is the raw hidden."""

    def __init__(self, config: Eagle3Config) -> None:
        super().__init__()
        H, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(H, eps)
        self.hidden_norm = RMSNorm(H, eps)
        self.self_attn = Eagle3Attention(config)
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


class Eagle3Model(nn.Module):
    """One EAGLE-3 decoder layer over the target's frozen embedding and fused low/mid/high features.

    Parameter names match vLLM's native EAGLE-3 checkpoints 1:1 (`fc`, `midlayer.*`, `norm`,
    `lm_head`, `d2t`, `t2d`); `embed_tokens` is the target's and is never saved.
    """

    def __init__(self, config: Eagle3Config, embed_weight: Tensor, vocab: DraftVocab) -> None:
        super().__init__()
        if tuple(embed_weight.shape) != (config.vocab_size, config.hidden_size):
            raise ValueError(
                f"target embedding has shape {tuple(embed_weight.shape)} but the drafter expects "
                f"[vocab {config.vocab_size}, hidden {config.hidden_size}]: pass the embedding of the target "
                "this drafter was built for"
            )
        if (vocab.vocab_size, vocab.draft_vocab_size) != (
            config.vocab_size,
            config.draft_vocab_size,
        ):
            raise ValueError(
                f"draft vocab maps {vocab.draft_vocab_size} of {vocab.vocab_size} ids but the config says "
                f"{config.draft_vocab_size} of {config.vocab_size}"
            )
        self.config = config
        self.embed_tokens = nn.Embedding.from_pretrained(embed_weight, freeze=True)
        self.fc = nn.Linear(3 * config.target_hidden_size, config.hidden_size, bias=False)
        self.midlayer = Eagle3DecoderLayer(config)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.draft_vocab_size, bias=False)
        self.rotary = RotaryEmbedding(config.rope_parameters, config.head_dim)
        self.register_buffer("d2t", vocab.d2t.clone())
        self.register_buffer("t2d", vocab.t2d.clone())

    @property
    def vocab(self) -> DraftVocab:
        return DraftVocab(self.d2t, self.t2d)

    def fuse(self, aux_hidden: Tensor) -> Tensor:
        """[B, T, 3*H_t] low/mid/high target states -> [B, T, H]."""
        if aux_hidden.shape[-1] != 3 * self.config.target_hidden_size:
            raise ValueError(
                f"aux_hidden last dim is {aux_hidden.shape[-1]}, expected 3 * {self.config.target_hidden_size} "
                f"(the target's states at layers {list(self.config.aux_layer_ids)}, concatenated)"
            )
        return self.fc(aux_hidden.to(self.fc.weight.dtype))

    def forward(
        self,
        input_ids: Tensor,
        hidden: Tensor,
        position_ids: Tensor,
        *,
        attention_mask: Tensor | None = None,
        cache: KVCache | TTTCache | None = None,
    ) -> tuple[Tensor, Tensor]:
        """Returns (logits [B, T, Vd] fp32, hidden_out [B, T, H] before the final norm).

        `attention_mask`: bool [B, T, S], True = may attend, S = cached keys + T; None = causal.
        """
        self._check_inputs(input_ids, hidden, position_ids, attention_mask, cache)
        embeds = self.embed_tokens(input_ids).to(hidden.dtype)  # [B, T, H]
        cos, sin = self.rotary(position_ids, hidden.dtype)  # [B, T, d]
        hidden_out = self.midlayer(embeds, hidden, cos, sin, attention_mask, cache)  # [B, T, H]
        logits = self.lm_head(self.norm(hidden_out)).float()  # [B, T, Vd]
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


def shift_left(x: Tensor, n: int, fill: float | bool = 0) -> Tensor:
    """out[:, t] = x[:, t + n], `fill` past the end. Used to align step-k rows with tokens and teachers."""
    if n == 0:
        return x
    out = torch.full_like(x, fill)
    if n < x.shape[1]:
        out[:, : x.shape[1] - n] = x[:, n:]
    return out


@dataclass
class TTTStep:
    """One unrolled step k: row t predicts x_{t+k+2}; its teacher is the target at position t+k+1."""

    logits: Tensor  # [B, T, Vd] fp32
    valid: Tensor  # [B, T] bool
    hidden_out: Tensor  # [B, T, H]


def ttt_unroll(
    drafter: Eagle3Model,
    aux_hidden: Tensor,
    input_ids: Tensor,
    *,
    steps: int = 7,
    step_tokens: Sequence[Tensor | None] | None = None,
    loss_mask: Tensor | None = None,
) -> list[TTTStep]:
    """Training-time test: run the drafter `steps` times over every row, feeding back its own hidden.

    aux_hidden [B, T, 3*H_t] (target features at positions 0..T-1), input_ids [B, T].
    Step 0 row t reads (fuse(aux)_t, x_{t+1}); step k >= 1 reads step k-1's hidden_out of row t and
    token `step_tokens[k][:, t]` if given (drafter-sampled, OPD) else ground truth x_{t+k+1} (SFT).
    `step_tokens[0]` must be None: step 0 always reads the committed token.
    Row t at step k is valid iff x_{t+k+2} exists and, when `loss_mask` [B, T] is given, it is set there.
    Teachers align with `shift_left(teacher, k + 1)`.
    """
    if input_ids.dim() != 2 or aux_hidden.shape[:2] != input_ids.shape:
        raise ValueError(
            f"aux_hidden {tuple(aux_hidden.shape)} and input_ids {tuple(input_ids.shape)} must share [B, T]"
        )
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    if step_tokens is not None:
        if len(step_tokens) != steps:
            raise ValueError(
                f"step_tokens has {len(step_tokens)} entries, expected one per step ({steps})"
            )
        if step_tokens[0] is not None:
            raise ValueError(
                "step_tokens[0] must be None: step 0 reads the committed token x_{t+1}"
            )
    if loss_mask is not None and (
        loss_mask.shape != input_ids.shape or loss_mask.dtype != torch.bool
    ):
        raise ValueError(
            f"loss_mask must be bool {tuple(input_ids.shape)}, got {loss_mask.dtype} {tuple(loss_mask.shape)}"
        )

    B, T = input_ids.shape
    positions = torch.arange(T, device=input_ids.device).expand(B, T)
    keep = loss_mask if loss_mask is not None else torch.ones_like(input_ids, dtype=torch.bool)
    cache = TTTCache()
    hidden = drafter.fuse(aux_hidden)  # [B, T, H]
    out = []
    for k in range(steps):
        given = step_tokens[k] if step_tokens is not None else None
        tokens = given if given is not None else shift_left(input_ids, k + 1)
        logits, hidden = drafter(tokens, hidden, positions + k, cache=cache)
        out.append(
            TTTStep(logits=logits, valid=shift_left(keep, k + 2, fill=False), hidden_out=hidden)
        )
    return out
