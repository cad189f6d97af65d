"""EAGLE-3 as a drafter kind: the network of models/eagle3/model.py behind the `Drafter`
interface (its proposals, replays and training forwards are every chain drafter's,
models/chain.py; its SFT objectives in train.py)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from models.chain import ChainDrafter, Unrolled
from models.drafter import (
    ExportTarget,
    FrozenEmbeddingDrafter,
    ServableDrafter,
    TrainableDrafter,
)
from models.eagle3.export import export_eagle3, export_speculators, read_eagle3_export
from models.eagle3.model import Eagle3Config, Eagle3Model
from models.eagle3.train import objective_loss
from models.export_format import ExportError
from models.vocab import DraftVocab


class Eagle3Drafter(
    Eagle3Model, ChainDrafter, FrozenEmbeddingDrafter, TrainableDrafter, ServableDrafter
):
    # -- building -------------------------------------------------------------------------

    @classmethod
    def new(cls, target: Any, vocab: DraftVocab, settings: Mapping[str, Any]) -> Eagle3Drafter:
        config = Eagle3Config.from_target(
            target.config, vocab.draft_vocab_size, target.aux_layer_ids
        )
        return cls(config, target.embed_weight, vocab)

    @classmethod
    def from_tensors(
        cls,
        config: Mapping[str, Any],
        embed_weight: Tensor,
        tensors: Mapping[str, Tensor],
        source: str,
    ) -> Eagle3Drafter:
        cfg = Eagle3Config.from_dict(config)
        if tuple(embed_weight.shape) != (cfg.vocab_size, cfg.hidden_size):
            raise ValueError(
                f"{source} was trained for a target with vocab {cfg.vocab_size} and hidden size "
                f"{cfg.hidden_size}, but the given embedding is {tuple(embed_weight.shape)}: load "
                "it with the target it was trained for"
            )
        return cls.from_checked_tensors(cfg, embed_weight, tensors, source)

    def check_target(self, target: Any) -> None:
        cfg = self.config
        pairs = [
            ("vocab size", cfg.vocab_size, target.vocab_size),
            ("vocab map (t2d) size", self.t2d.numel(), target.vocab_size),
            ("hidden size", cfg.hidden_size, target.hidden_size),
            ("target hidden size (fc input / 3)", cfg.target_hidden_size, target.hidden_size),
            ("target layer count", cfg.target_num_layers, target.num_layers),
            ("aux layer ids", tuple(cfg.aux_layer_ids), tuple(target.aux_layer_ids)),
        ]
        for name, theirs, ours in pairs:
            if theirs != ours:
                raise ValueError(
                    f"drafter does not match the target: drafter {name} is {theirs}, target's "
                    f"is {ours}; use the drafter trained for this target (or load the target "
                    "with the drafter's aux layer ids)"
                )
        self.check_embedding(target)

    # -- training -------------------------------------------------------------------------

    def sft_loss(
        self,
        out: Unrolled,
        teacher: Tensor,
        last_hidden: Tensor,
        *,
        decay: float,
        objective: str | None = None,
    ) -> Tensor:
        return objective_loss(out, teacher, last_hidden, decay=decay, objective=objective)

    # -- serving --------------------------------------------------------------------------

    def write_export(
        self, fmt: str, out_dir: Path, target: ExportTarget, *, k: int, verifier: str | None
    ) -> Path:
        if fmt == "eagle3":
            return export_eagle3(
                self,
                target.config,
                out_dir,
                target_identity=target.identity,
                target_embed_weight=target.embed_weight,
            )
        if verifier is None:
            raise ValueError("a speculators export names its verifier: pass verifier")
        return export_speculators(
            self,
            target.config,
            out_dir,
            verifier_name_or_path=verifier,
            speculative_tokens=k,
            target_identity=target.identity,
            target_embed_weight=target.embed_weight,
        )

    @classmethod
    def read_export(cls, export_dir: Path, embed_weight: Tensor | None) -> Eagle3Drafter:
        config, embed, tensors = read_eagle3_export(export_dir, embed_weight)
        try:
            return cls.from_tensors(config.to_dict(), embed, tensors, str(export_dir))
        except ValueError as err:  # a tensor set or shape that does not fit the config
            raise ExportError(str(err)) from None

    @torch.no_grad()
    def probe_logits(self, seed: int) -> Tensor:
        g = torch.Generator().manual_seed(seed)
        cfg = self.config
        ids = torch.randint(0, cfg.vocab_size, (2, 9), generator=g)  # [B, T]
        aux = torch.randn(2, 9, 3 * cfg.target_hidden_size, generator=g)  # [B, T, 3*H_t]
        pos = torch.arange(9).expand(2, 9)
        device = self.fc.weight.device
        logits, _ = self(ids.to(device), self.fuse(aux.to(device)), pos.to(device))
        return logits  # [B, T, Vd]
