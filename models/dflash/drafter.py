"""DFlash as a drafter kind: the block drafter of models/dflash/model.py behind the `Drafter`
interface (its proposals in propose.py, its training forward in train.py).

Head (setting `head`): "draft", a trained draft-vocabulary head over the features stage's frozen
DraftVocab, as EAGLE-3's. The interface and every stage already carry that map (training
teachers, acceptance, the decoding loop's `vocab_map`), and on this CPU a [Vd, H] head is a
fraction of the target's [V, H] one per drafted slot; vLLM serves a shipped `lm_head` with `d2t`
for dflash too. "target", the target's lm_head, frozen, over the identity map: the same code
paths with Vd = V (models/dflash/model.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from models.blocks import BlockTraining
from models.dflash.export import export_dflash, read_dflash_export
from models.dflash.model import DFlashConfig, DFlashModel
from models.dflash.propose import DFlashProposer
from models.dflash.train import block_slot_logits, block_unroll
from models.drafter import (
    ExportTarget,
    FrozenEmbeddingDrafter,
    Proposer,
    ServableDrafter,
    Shape,
    TrainableDrafter,
    check_matches_target,
)
from models.vocab import DraftVocab


class DFlashDrafter(
    DFlashModel, FrozenEmbeddingDrafter, BlockTraining, TrainableDrafter, ServableDrafter
):
    config_type = DFlashConfig
    # The training forwards are train.py's functions, the drafter first.
    slot_logits = block_slot_logits
    unroll = block_unroll

    # -- building -------------------------------------------------------------------------

    @classmethod
    def new(cls, target: Any, vocab: DraftVocab, settings: Mapping[str, Any]) -> DFlashDrafter:
        if cls.spec.settings.given(settings)["head"] == "target":
            vocab = DraftVocab.full(target.vocab_size)  # the target's head reads every id
        config = cls.config_for(target, vocab.draft_vocab_size, settings)
        drafter = cls(config, target.embed_weight, vocab)
        if config.head == "target":
            drafter.take_target_head(target.lm_head_weight)
        return drafter

    @classmethod
    def config_for(
        cls, target: Any, draft_vocab_size: int, settings: Mapping[str, Any]
    ) -> DFlashConfig:
        given = cls.spec.settings.given(settings)
        ids = tuple(target.aux_layer_ids)
        if len(ids) != given["target_layers"]:
            raise ValueError(
                f"a DFlash drafter reading {given['target_layers']} target layers needs the "
                f"target's states at as many layers, and it captures {len(ids)} ({list(ids)}): "
                f"load the target with {given['target_layers']} aux layer ids "
                f"(target.aux_layers={given['target_layers']}) or set target_layers={len(ids)}"
            )
        return DFlashConfig.from_target(
            target.config,
            draft_vocab_size,
            ids,
            num_layers=given["layers"],
            block_size=given["block_size"],
            mask_token_id=given["mask_token_id"],
            anchors=given["anchors"],
            head=given["head"],
        )

    def take_target_head(self, lm_head_weight: Tensor) -> None:
        """Copy the target's lm_head [V, H] into this drafter's frozen head."""
        with torch.no_grad():
            self.lm_head.weight.copy_(lm_head_weight)

    def untrained(self) -> DFlashDrafter:
        fresh = super().untrained()
        if self.config.head == "target":  # fresh weights around the same frozen head
            fresh.take_target_head(self.lm_head.weight)
        return fresh

    def check_target(self, target: Any) -> None:
        cfg = self.config
        check_matches_target(
            self,
            target,
            [
                ("target layer count", cfg.target_num_layers, target.num_layers),
                ("target layer ids", tuple(cfg.target_layer_ids), tuple(target.aux_layer_ids)),
            ],
        )
        self.check_embedding(target)
        if self.config.head == "target":
            ours, head = target.lm_head_weight, self.lm_head.weight
            if not torch.equal(head.to(ours.device, ours.dtype), ours):
                raise ValueError(
                    "the drafter's frozen lm_head is not the target's; use the drafter trained "
                    "for this target"
                )

    # -- decoding -------------------------------------------------------------------------

    def proposer(
        self, shape: Shape, temperature: float, generator: torch.Generator, timer: Any
    ) -> Proposer:
        return DFlashProposer(self, shape, temperature, generator, timer)

    # -- serving --------------------------------------------------------------------------

    def write_export(
        self, fmt: str, out_dir: Path, target: ExportTarget, *, k: int, verifier: str | None
    ) -> Path:
        return export_dflash(self, out_dir, target_identity=target.identity)

    def served_tokens(self, k: int) -> int:
        # vLLM's dflash proposer drafts num_speculative_tokens slots and never reads block_size.
        return self.config.block_size - 1

    @classmethod
    def read_export(cls, export_dir: Path, embed_weight: Tensor | None) -> DFlashDrafter:
        if embed_weight is None:
            raise ValueError(f"{export_dir}: a DFlash export has no embedding; pass the target's")
        config, tensors = read_dflash_export(export_dir)
        return cls.from_export(export_dir, config, embed_weight, tensors)

    @torch.no_grad()
    def probe_logits(self, seed: int) -> Tensor:
        g = torch.Generator().manual_seed(seed)
        cfg = self.config
        device = self.fc.weight.device
        width = len(cfg.target_layer_ids) * cfg.target_hidden_size
        aux = torch.randn(1, 9, width, generator=g).to(device)  # [N, S, n*H_t]
        context = self.context_kv(aux, torch.arange(9, device=device)[None])
        anchors = torch.tensor([[3, 6]], device=device)  # [N, A]
        tokens = torch.randint(0, cfg.vocab_size, (1, 2), generator=g).to(device)
        visible = torch.arange(9, device=device)[None, None] < anchors[..., None]  # [N, A, S]
        return self(self.block_tokens(tokens), anchors, context, visible)  # [N, A, B-1, Vd]
