"""EAGLE-3 as a drafter kind: the network of models/eagle3/model.py behind the `Drafter`
interface (its proposals, replays and training forwards are every chain drafter's,
models/chain.py; its SFT objectives in train.py)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from models.chain import ChainDrafter
from models.drafter import (
    ExportTarget,
    FrozenEmbeddingDrafter,
    ServableDrafter,
    TrainableDrafter,
    check_matches_target,
)
from models.eagle3.export import export_eagle3, export_speculators, read_eagle3_export
from models.eagle3.model import Eagle3Config, Eagle3Model
from models.eagle3.train import objective_loss
from models.vocab import DraftVocab


class Eagle3Drafter(
    Eagle3Model, ChainDrafter, FrozenEmbeddingDrafter, TrainableDrafter, ServableDrafter
):
    config_type = Eagle3Config

    # -- building -------------------------------------------------------------------------

    @classmethod
    def new(cls, target: Any, vocab: DraftVocab, settings: Mapping[str, Any]) -> Eagle3Drafter:
        config = cls.config_for(target, vocab.draft_vocab_size, settings)
        return cls(config, target.embed_weight, vocab)

    @classmethod
    def config_for(
        cls, target: Any, draft_vocab_size: int, settings: Mapping[str, Any]
    ) -> Eagle3Config:
        return Eagle3Config.from_target(target.config, draft_vocab_size, target.aux_layer_ids)

    def check_target(self, target: Any) -> None:
        cfg = self.config
        check_matches_target(
            self,
            target,
            [
                ("target hidden size (fc input / 3)", cfg.target_hidden_size, target.hidden_size),
                ("target layer count", cfg.target_num_layers, target.num_layers),
                ("aux layer ids", tuple(cfg.aux_layer_ids), tuple(target.aux_layer_ids)),
            ],
            "use the drafter trained for this target (or load the target with the drafter's "
            "aux layer ids)",
        )
        self.check_embedding(target)

    # -- training -------------------------------------------------------------------------

    sft_loss = staticmethod(objective_loss)  # train.py's objectives read the unroll alone

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
        return cls.from_export(export_dir, config, embed, tensors)

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
