"""What the drafter kinds' configs share: saving and reading back (`KindConfig`), the
target's sizes read off its HF config, and the target's embedding checked against them."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import MISSING, asdict, fields
from typing import Any, Self

from torch import Tensor

from models.layers import rope_parameters_of


def hf_config_dict(config: Any) -> dict[str, Any]:
    """A target's HF config (a `PretrainedConfig` or its dict) as a plain dict."""
    return config.to_dict() if hasattr(config, "to_dict") else dict(config)


def target_layout(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """The fields a drafter copies from its target's HF config dict: sizes, attention layout,
    norm eps, rope and context length (head_dim and the kv heads by HF's defaults when unset)."""
    heads = cfg["num_attention_heads"]
    return dict(
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_attention_heads=heads,
        num_key_value_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_parameters=rope_parameters_of(cfg),
        max_position_embeddings=cfg["max_position_embeddings"],
        vocab_size=cfg["vocab_size"],
    )


class KindConfig:
    """Base of the kinds' frozen config dataclasses: saved as `to_dict()` (tuples as lists, as
    JSON holds them) and read back by `from_dict`, which names unknown and missing keys."""

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)  # type: ignore[call-overload]
        return {k: list(v) if isinstance(v, tuple) else v for k, v in out.items()}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Self:
        names = {f.name for f in fields(cls)}  # type: ignore[arg-type]
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(
                f"unknown {cls.__name__} keys {unknown}; was it written by another version or "
                "for another drafter kind?"
            )
        required = {f.name for f in fields(cls) if f.default is MISSING}  # type: ignore[arg-type]
        missing = sorted(required - set(data))
        if missing:
            raise ValueError(f"{cls.__name__} is missing keys {missing}")
        return cls(**data)


def check_embedding_shape(embed_weight: Tensor, config: Any) -> None:
    """Refuse an embedding that is not [config.vocab_size, config.hidden_size]: the drafter was
    built for another target."""
    if tuple(embed_weight.shape) != (config.vocab_size, config.hidden_size):
        raise ValueError(
            f"target embedding has shape {tuple(embed_weight.shape)} but the drafter expects "
            f"[vocab {config.vocab_size}, hidden {config.hidden_size}]: pass the embedding "
            "of the target this drafter was built for"
        )
