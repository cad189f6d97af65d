"""Which target model a run uses, loaded once per process and shared by its stages."""

from __future__ import annotations

from functools import cached_property
from pathlib import Path
from typing import Any, Literal

import torch

from models.target import Target, load_target
from pipeline.config import StrictConfig
from storage import OpdError

EMBEDDED_TARGET = Path(__file__).resolve().parent.parent / "models" / "tiny_target" / "model"


class RandomTargetConfig(StrictConfig):
    """A tiny randomly initialised target built in-process (tests; no real distribution)."""

    family: Literal["llama", "qwen3"] = "llama"
    num_layers: int = 4  # >= 4 so the default aux ids (2, N//2, N-3) are distinct-ish and valid
    hidden_size: int = 64
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 128
    seed: int = 0


class TargetConfig(StrictConfig):
    path: str = "embedded"
    """`embedded` (the committed code model), `random` (see `random`), or a local HF directory."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """fp32 by default: on CPU it keeps T=0 decoding exactly equal to plain greedy decoding."""
    aux_layer_ids: list[int] | None = None
    """HF hidden_states[k] ids (the state entering layer k); None = EAGLE-3's (2, N//2, N-3)."""
    random: RandomTargetConfig = RandomTargetConfig()


def _build_random(cfg: RandomTargetConfig, vocab_size: int, tokenizer: Any) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

    common = dict(
        vocab_size=vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        max_position_embeddings=2048,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    hf_cfg = LlamaConfig(**common) if cfg.family == "llama" else Qwen3Config(**common)
    torch.manual_seed(cfg.seed)
    model = AutoModelForCausalLM.from_config(hf_cfg, attn_implementation="sdpa")
    # A random model's logits are nearly flat; scale the head so its distribution is peaked
    # enough that drafts sometimes get accepted in tests (still a deterministic function of seed).
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)
    return model


class TargetLoader:
    """Loads the configured target lazily, once; `identity` is what enters dataset versions."""

    def __init__(self, cfg: TargetConfig):
        self.cfg = cfg

    @property
    def directory(self) -> Path | None:
        """The target's model directory, for engines that load it themselves (None: `random`)."""
        if self.cfg.path == "random":
            return None
        return EMBEDDED_TARGET if self.cfg.path == "embedded" else Path(self.cfg.path).resolve()

    @cached_property
    def tokenizer(self) -> Any:
        from transformers import AutoTokenizer

        directory = (
            EMBEDDED_TARGET if self.cfg.path in ("embedded", "random") else Path(self.cfg.path)
        )
        if (
            not (directory / "tokenizer_config.json").exists()
            and not (directory / "tokenizer.json").exists()
        ):
            raise OpdError(
                f"no tokenizer in {directory}: the target directory must hold the tokenizer "
                "files it was trained with (tokenizer.json / tokenizer_config.json)"
            )
        return AutoTokenizer.from_pretrained(directory, local_files_only=True)

    @cached_property
    def target(self) -> Target:
        dtype = getattr(torch, self.cfg.dtype)
        ids = self.cfg.aux_layer_ids
        try:
            if self.cfg.path == "random":
                model = _build_random(self.cfg.random, len(self.tokenizer), self.tokenizer)
                return Target.from_model(model.to(dtype), aux_layer_ids=ids)
            path = EMBEDDED_TARGET if self.cfg.path == "embedded" else Path(self.cfg.path)
            return load_target(path, dtype=dtype, aux_layer_ids=ids)
        except (ValueError, FileNotFoundError) as e:
            raise OpdError(f"cannot load target {self.cfg.path!r}: {e}") from None

    @cached_property
    def identity(self) -> dict[str, Any]:
        """Weights hash + architecture; not the path, so a moved checkout keeps its versions."""
        ident = {k: v for k, v in self.target.identity.items() if k != "path"}
        ident["dtype"] = self.cfg.dtype
        return ident
