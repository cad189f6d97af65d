"""EAGLE-3 drafter: config, draft vocabulary, the one-layer model, training-time test, save/load.

Row convention (shared with models/speculative.py and every training stage): drafter row t reads
the target feature f_t (sequence position t) and token x_{t+1}, sits at rope position t and
predicts x_{t+2}. A chain continues row t at step k >= 1 with position t+k, its own previous
hidden_out and token x_{t+k+1}, and predicts x_{t+k+2}. The teacher for x_j is the target's
distribution at position j-1.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import MISSING, asdict, dataclass, fields
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
CONFIG_FILE = "drafter_config.json"
WEIGHTS_FILE = "model.safetensors"


def default_aux_layer_ids(num_layers: int) -> tuple[int, int, int]:
    """EAGLE-3 / vLLM default feature layers, HF `hidden_states[k]` convention (state entering layer k)."""
    return (2, num_layers // 2, num_layers - 3)


def rope_parameters_of(target_config: Mapping[str, Any]) -> dict[str, Any]:
    """The target's rope settings in transformers-5 form ({"rope_type", "rope_theta", ...})."""
    params = target_config.get("rope_parameters")
    if params:
        params = dict(params)
    else:
        # Configs written by transformers 4 keep theta and scaling as separate top-level keys.
        params = dict(target_config.get("rope_scaling") or {})
        params["rope_theta"] = target_config.get("rope_theta", 10000.0)
    if "type" in params and "rope_type" not in params:
        params["rope_type"] = params.pop("type")
    params.setdefault("rope_type", "default")
    return params


@dataclass(frozen=True)
class DrafterConfig:
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
                raise ValueError(
                    f"DrafterConfig.{name} must be positive, got {getattr(self, name)}"
                )
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
    ) -> DrafterConfig:
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
    def from_dict(cls, data: Mapping[str, Any]) -> DrafterConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(
                f"unknown DrafterConfig keys {unknown}; was this file written by another version?"
            )
        required = {f.name for f in fields(cls) if f.default is MISSING}
        missing = sorted(required - set(data))
        if missing:
            raise ValueError(f"DrafterConfig is missing keys {missing}")
        return cls(**data)


def check_aux_layer_ids(aux_layer_ids: Sequence[int] | None, num_layers: int) -> None:
    """Raise unless there are 3 strictly increasing ids in [1, num_layers).

    vLLM collects aux states in ascending layer order, once per layer, and id 0 (the embedding
    output) has no residual to add there: out-of-order or repeated ids load but accept nothing.
    """
    if aux_layer_ids is None or len(aux_layer_ids) != 3:
        raise ValueError(
            f"EAGLE-3 needs exactly 3 aux layer ids, got {aux_layer_ids!r}; the default for a "
            f"{num_layers}-layer target is {list(default_aux_layer_ids(num_layers))}"
        )
    check_aux_layer_order(aux_layer_ids)
    if int(aux_layer_ids[-1]) >= num_layers:
        raise ValueError(
            f"aux layer ids {list(aux_layer_ids)} out of range for a {num_layers}-layer target: ids use the "
            f"HF hidden_states[k] convention (state entering layer k), so each must be in [1, {num_layers})"
        )


def check_aux_layer_order(aux_layer_ids: Sequence[int]) -> None:
    """Raise unless the ids are strictly increasing and >= 1 (the part checkable without the target)."""
    ids = [int(i) for i in aux_layer_ids]
    if ids[0] < 1 or any(b <= a for a, b in zip(ids, ids[1:], strict=False)):
        raise ValueError(
            f"aux layer ids {ids} must be strictly increasing and >= 1 (vLLM collects the states "
            "in ascending layer order, once per layer, and id 0 is the embedding output); "
            "e.g. [1, 3, 5] for a 6-layer target"
        )


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


class RMSNorm(nn.Module):
    """Llama RMSNorm: normalise in fp32, scale in the input dtype (as HF and vLLM do)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rope_inv_freq(rope_parameters: Mapping[str, Any], head_dim: int) -> Tensor:
    """Inverse frequencies [head_dim/2] for the default, linear and llama3 rope types."""
    theta = float(rope_parameters["rope_theta"])
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    rope_type = rope_parameters.get("rope_type", "default")
    if rope_type == "default":
        return inv_freq.float()
    factor = float(rope_parameters["factor"])
    if rope_type == "linear":
        return (inv_freq / factor).float()
    if rope_type == "llama3":
        low = float(rope_parameters["low_freq_factor"])
        high = float(rope_parameters["high_freq_factor"])
        old_context = float(rope_parameters["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        # Long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
        scaled = torch.where(wavelen > old_context / low, inv_freq / factor, inv_freq)
        smooth = (old_context / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_context / high) & (wavelen <= old_context / low)
        return torch.where(medium, smoothed, scaled).float()
    raise ValueError(
        f"rope_type {rope_type!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
    )


class RotaryEmbedding(nn.Module):
    def __init__(self, rope_parameters: Mapping[str, Any], head_dim: int) -> None:
        super().__init__()
        # A plain attribute, not a buffer: module.to(bfloat16) must not round the frequencies.
        self.inv_freq = rope_inv_freq(rope_parameters, head_dim)

    def forward(self, position_ids: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        if self.inv_freq.device != position_ids.device:
            self.inv_freq = self.inv_freq.to(position_ids.device)
        freqs = position_ids.float()[..., None] * self.inv_freq  # [B, T, d/2]
        emb = torch.cat([freqs, freqs], dim=-1)  # [B, T, d]
        return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [B, heads, T, d]; cos, sin [B, T, d]."""
    return x * cos[:, None] + _rotate_half(x) * sin[:, None]


class DrafterCache:
    """The drafter's own KV cache for chain drafting: per layer k, v [B, n_kv, S, d]."""

    def __init__(self) -> None:
        self.keys: list[Tensor] = []
        self.values: list[Tensor] = []

    @property
    def length(self) -> int:
        return self.keys[0].shape[2] if self.keys else 0

    def append(self, k: Tensor, v: Tensor, layer: int = 0) -> tuple[Tensor, Tensor]:
        """Add new keys/values [B, n_kv, T, d] and return all of them [B, n_kv, S, d]."""
        if layer == len(self.keys):
            self.keys.append(k)
            self.values.append(v)
        else:
            self.keys[layer] = torch.cat([self.keys[layer], k], dim=2)
            self.values[layer] = torch.cat([self.values[layer], v], dim=2)
        return self.keys[layer], self.values[layer]

    def crop(self, n: int) -> None:
        """Keep the first n positions (drop the keys of rejected drafts)."""
        if not 0 <= n <= self.length:
            raise ValueError(f"cannot crop a cache of length {self.length} to {n}")
        self.keys = [k[:, :, :n] for k in self.keys]
        self.values = [v[:, :, :n] for v in self.values]


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

    def __init__(self, config: DrafterConfig) -> None:
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
        cache: DrafterCache | TTTCache | None,
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


class Eagle3MLP(nn.Module):
    def __init__(self, config: DrafterConfig) -> None:
        super().__init__()
        H, inter = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(H, inter, bias=False)
        self.up_proj = nn.Linear(H, inter, bias=False)
        self.down_proj = nn.Linear(inter, H, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Eagle3DecoderLayer(nn.Module):
    """vLLM's llama_eagle3 first layer with norm_before_residual=False: the residual is the raw hidden."""

    def __init__(self, config: DrafterConfig) -> None:
        super().__init__()
        H, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(H, eps)
        self.hidden_norm = RMSNorm(H, eps)
        self.self_attn = Eagle3Attention(config)
        self.post_attention_layernorm = RMSNorm(H, eps)
        self.mlp = Eagle3MLP(config)

    def forward(
        self,
        embeds: Tensor,
        hidden: Tensor,
        cos: Tensor,
        sin: Tensor,
        attention_mask: Tensor | None,
        cache: DrafterCache | TTTCache | None,
    ) -> Tensor:
        normed = [self.input_layernorm(embeds), self.hidden_norm(hidden)]
        x = torch.cat(normed, dim=-1)  # [B, T, 2H]
        h = hidden + self.self_attn(x, cos, sin, attention_mask, cache)  # [B, T, H]
        return h + self.mlp(self.post_attention_layernorm(h))  # [B, T, H]


class Eagle3Drafter(nn.Module):
    """One EAGLE-3 decoder layer over the target's frozen embedding and fused low/mid/high features.

    Parameter names match vLLM's native EAGLE-3 checkpoints 1:1 (`fc`, `midlayer.*`, `norm`,
    `lm_head`, `d2t`, `t2d`); `embed_tokens` is the target's and is never saved.
    """

    def __init__(self, config: DrafterConfig, embed_weight: Tensor, vocab: DraftVocab) -> None:
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
        cache: DrafterCache | TTTCache | None = None,
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
        cache: DrafterCache | TTTCache | None,
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
    drafter: Eagle3Drafter,
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


def _write_atomic(path: Path, write: Callable[[Path], object]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    write(tmp)
    os.replace(tmp, path)


def drafter_tensors(drafter: Eagle3Drafter) -> dict[str, Tensor]:
    """Everything a checkpoint holds: all parameters and d2t/t2d, never the target's embedding."""
    return {
        name: t.detach().contiguous()
        for name, t in drafter.state_dict().items()
        if not name.startswith("embed_tokens.")
    }


def save_drafter(drafter: Eagle3Drafter, directory: str | os.PathLike) -> Path:
    """Write `model.safetensors` (no embed_tokens) and `drafter_config.json` into `directory`."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = drafter_tensors(drafter)
    _write_atomic(directory / WEIGHTS_FILE, lambda p: save_file(tensors, str(p)))
    text = json.dumps(drafter.config.to_dict(), indent=2, sort_keys=True)
    _write_atomic(directory / CONFIG_FILE, lambda p: p.write_text(text))
    return directory


def build_drafter(
    config: DrafterConfig, embed_weight: Tensor, tensors: Mapping[str, Tensor], source: str
) -> Eagle3Drafter:
    """A drafter from checkpoint tensors; refuses missing, unexpected or misshapen ones by name."""
    for name in ("d2t", "t2d"):
        if name not in tensors:
            raise ValueError(
                f"{source}: tensor {name!r} is missing; the draft vocab map cannot be rebuilt"
            )
    drafter = Eagle3Drafter(config, embed_weight, DraftVocab(tensors["d2t"], tensors["t2d"]))
    expected = drafter_tensors(drafter)
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    if missing or unexpected:
        raise ValueError(f"{source}: missing tensors {missing}, unexpected tensors {unexpected}")
    for name, t in tensors.items():
        if t.shape != expected[name].shape:
            raise ValueError(
                f"{source}: tensor {name!r} has shape {tuple(t.shape)}, expected {tuple(expected[name].shape)}"
            )
    drafter.to(tensors["fc.weight"].dtype)
    # `.to()` may have cast the shared embedding; re-attach the target's own tensor.
    drafter.embed_tokens.weight = nn.Parameter(embed_weight, requires_grad=False)
    drafter.load_state_dict(tensors, strict=False)
    return drafter


def load_drafter(directory: str | os.PathLike, embed_weight: Tensor) -> Eagle3Drafter:
    """Load a `save_drafter` directory and re-attach the target's embedding."""
    directory = Path(directory)
    config_path, weights_path = directory / CONFIG_FILE, directory / WEIGHTS_FILE
    for path in (config_path, weights_path):
        if not path.is_file():
            raise FileNotFoundError(
                f"{path} not found: is {directory} a directory written by save_drafter?"
            )
    config = DrafterConfig.from_dict(json.loads(config_path.read_text()))
    if tuple(embed_weight.shape) != (config.vocab_size, config.hidden_size):
        raise ValueError(
            f"{directory} was trained for a target with vocab {config.vocab_size} and hidden size "
            f"{config.hidden_size}, but the given embedding is {tuple(embed_weight.shape)}: load it with "
            "the target it was trained for"
        )
    return build_drafter(config, embed_weight, load_file(str(weights_path)), str(directory))
