"""Building blocks every drafter kind shares: Llama RMSNorm and rotary position embeddings
(default, linear and llama3 rope types, read from the target's config)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


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


class SwiGLU(nn.Module):
    """The Llama / Qwen MLP: down(silu(gate(x)) * up(x)); vLLM's parameter names."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: Tensor) -> Tensor:  # [..., H] -> [..., H]
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


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
