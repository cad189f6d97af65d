"""Prompt lookup as a drafter kind: vLLM's `ngram` speculative method behind the `Drafter`
interface. It reads no target state and holds no weights: its config is the n-gram range, and
its export is the `vllm serve` command that switches vLLM's own n-gram proposer on.

It is no `TrainableDrafter`: its dataset is written untrained by the `sft` stage, and the
Draft-OPD stages refuse it. Every evaluation of a trained drafter also decodes its prompts
with this kind (`KindSpec.baseline`), so each τ is read beside what needs no training.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from models.drafter import ChainShape, ExportTarget, Proposer, ServableDrafter, Shape
from models.export_format import CONFIG_FILE, PROVENANCE_KEY, WEIGHTS_FILE, ExportError
from models.kind_config import KindConfig
from models.ngram.lookup import lookup
from models.ngram.proposer import LookupProposer
from models.vocab import DraftVocab

PROMPT_LOOKUP_SIZES = (2, 4)
"""vLLM's prompt-lookup n-gram sizes (prompt_lookup_min, _max) by default: the range vLLM's
docs use; longer matches are tried first."""
SETTINGS = {
    "prompt_lookup_min": PROMPT_LOOKUP_SIZES[0],
    "prompt_lookup_max": PROMPT_LOOKUP_SIZES[1],
}
PROBE_TOKENS = 64
"""Length of the token rows `probe_logits` looks drafts up in."""


@dataclass(frozen=True)
class NgramConfig(KindConfig):
    vocab_size: int
    prompt_lookup_min: int = PROMPT_LOOKUP_SIZES[0]
    prompt_lookup_max: int = PROMPT_LOOKUP_SIZES[1]

    def __post_init__(self) -> None:
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(
                f"prompt_lookup_min ({self.prompt_lookup_min}) must lie in [1, "
                f"prompt_lookup_max ({self.prompt_lookup_max})]"
            )


class NgramDrafter(ServableDrafter):
    config_type = NgramConfig

    def __init__(self, config: NgramConfig) -> None:
        super().__init__()
        self.config = config

    # -- building -------------------------------------------------------------------------

    @classmethod
    def new(cls, target: Any, vocab: DraftVocab, settings: Mapping[str, Any]) -> NgramDrafter:
        return cls(cls.config_for(target, vocab.draft_vocab_size, settings))

    @classmethod
    def config_for(
        cls, target: Any, draft_vocab_size: int, settings: Mapping[str, Any]
    ) -> NgramConfig:
        unknown = sorted(set(settings) - set(SETTINGS))
        if unknown:
            raise ValueError(
                f"unknown n-gram lookup settings {unknown}; it takes {sorted(SETTINGS)}"
            )
        return NgramConfig(target.vocab_size, **(SETTINGS | dict(settings)))

    @classmethod
    def settings_of(cls, config: Mapping[str, Any]) -> dict[str, Any]:
        return {name: config.get(name, default) for name, default in SETTINGS.items()}

    @classmethod
    def from_config(
        cls,
        config: NgramConfig,
        embed_weight: Tensor | None,
        tensors: Mapping[str, Tensor],
        source: str,
    ) -> NgramDrafter:
        if tensors:
            raise ValueError(
                f"{source}: an n-gram lookup holds no tensors, found {sorted(tensors)}"
            )
        return cls(config)

    def tensors(self) -> dict[str, Tensor]:
        return {}

    def untrained(self) -> NgramDrafter:
        return type(self)(self.config)  # nothing to train: the same lookup

    @property
    def vocab(self) -> DraftVocab:
        return DraftVocab.full(self.config.vocab_size)  # it proposes target ids

    def check_target(self, target: Any) -> None:
        if self.config.vocab_size != target.vocab_size:
            raise ValueError(
                f"drafter does not match the target: its vocab size is {self.config.vocab_size}, "
                f"the target's {target.vocab_size}; use the lookup written for this target"
            )

    # -- decoding -------------------------------------------------------------------------

    def proposer(
        self, shape: Shape, temperature: float, generator: torch.Generator, timer: Any
    ) -> Proposer:
        if not isinstance(shape, ChainShape):
            raise ValueError(
                "an n-gram lookup drafts one chain per step (vLLM's ngram method): unset "
                "drafting.tree"
            )
        cfg = self.config
        return LookupProposer(cfg.prompt_lookup_min, cfg.prompt_lookup_max, shape.k)

    # -- serving --------------------------------------------------------------------------

    def speculative_config(self, export_dir: Path, k: int) -> dict[str, Any]:
        return {
            "method": self.spec.serve_method,
            "num_speculative_tokens": k,
            "prompt_lookup_min": self.config.prompt_lookup_min,
            "prompt_lookup_max": self.config.prompt_lookup_max,
        }

    def write_export(
        self, fmt: str, out_dir: Path, target: ExportTarget, *, k: int, verifier: str | None
    ) -> Path:
        vocab = getattr(target.config, "vocab_size", None)
        if vocab != self.config.vocab_size:
            raise ExportError(
                f"the lookup was written for a target of vocab size {self.config.vocab_size}, "
                f"this target's is {vocab}"
            )
        out_dir.mkdir(parents=True, exist_ok=True)
        spec = self.speculative_config(out_dir, k)
        served = getattr(target.config, "_name_or_path", "") or "<target-model-dir>"
        config = {
            # what `vllm serve --speculative-config` takes: vLLM's own proposer, no weights
            "speculative_config": spec,
            "serve": f"vllm serve {shlex.quote(served)} --speculative-config "
            + shlex.quote(json.dumps(spec)),
            PROVENANCE_KEY: {
                "drafter_kind": self.kind,
                "drafter_config": self.config.to_dict(),
                "target": dict(target.identity or {}),
            },
        }
        (out_dir / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        return out_dir

    @classmethod
    def read_export(cls, export_dir: Path, embed_weight: Tensor | None) -> NgramDrafter:
        path = export_dir / CONFIG_FILE
        if (export_dir / WEIGHTS_FILE).exists():
            raise ExportError(f"{export_dir} holds {WEIGHTS_FILE}: an n-gram lookup has no weights")
        try:
            config = json.loads(path.read_text())
            spec = config["speculative_config"]
            drafter = cls(NgramConfig.from_dict(config[PROVENANCE_KEY]["drafter_config"]))
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise ExportError(
                f"{path} is not an n-gram lookup export ({err}); re-export it"
            ) from None
        served = {k: spec.get(k) for k in SETTINGS}
        if spec.get("method") != cls.spec.serve_method or served != drafter.settings_of(
            drafter.config.to_dict()
        ):
            raise ExportError(
                f"{path}: its speculative_config {spec} does not serve the recorded lookup "
                f"{drafter.config.to_dict()}; re-export it"
            )
        return drafter

    def probe_logits(self, seed: int) -> Tensor:
        """A lookup has no logits: its drafts on token rows drawn from `seed` (from a small
        alphabet, so n-grams repeat) stand in for them, -1 past what it proposes [R, K]."""
        g = torch.Generator().manual_seed(seed)
        vocab = min(self.config.vocab_size, 8)
        rows = torch.randint(vocab, (4, PROBE_TOKENS), generator=g).tolist()
        k = 4
        cfg = self.config
        drafts = [lookup(r, cfg.prompt_lookup_min, cfg.prompt_lookup_max, k) for r in rows]
        return torch.tensor([d + [-1] * (k - len(d)) for d in drafts], dtype=torch.float32)
