"""What the drafter kinds' configs share: saving and reading back (`KindConfig`), the
target's sizes read off its HF config and checked (`TargetLayout`), and the target's embedding
checked against them."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import MISSING, asdict, dataclass, fields
from typing import Any, Self

from torch import Tensor

from models.layers import SUPPORTED_ROPE_TYPES, rope_parameters_of


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


@dataclass(frozen=True)
class TargetLayout(KindConfig):
    """The fields of a kind's config copied from its target (`target_layout`), checked: positive
    sizes, query heads in whole groups over the kv heads, a rope the drafter computes. A kind's
    config adds its own fields and checks them after this one's (`check_positive`)."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_parameters: dict[str, Any]
    max_position_embeddings: int
    vocab_size: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "rope_parameters", dict(self.rope_parameters))
        self.check_positive(
            (
                "hidden_size",
                "intermediate_size",
                "num_attention_heads",
                "num_key_value_heads",
                "head_dim",
                "max_position_embeddings",
                "vocab_size",
            )
        )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
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

    def check_positive(self, names: Sequence[str]) -> None:
        """Refuse a field of `names` that is not positive, naming it."""
        for name in names:
            if int(getattr(self, name)) <= 0:
                raise ValueError(
                    f"{type(self).__name__}.{name} must be positive, got {getattr(self, name)}"
                )


def check_embedding_shape(embed_weight: Tensor, config: Any) -> None:
    """Refuse an embedding that is not [config.vocab_size, config.hidden_size]: the drafter was
    built for another target."""
    if tuple(embed_weight.shape) != (config.vocab_size, config.hidden_size):
        raise ValueError(
            f"target embedding has shape {tuple(embed_weight.shape)} but the drafter expects "
            f"[vocab {config.vocab_size}, hidden {config.hidden_size}]: pass the embedding "
            "of the target this drafter was built for"
        )
