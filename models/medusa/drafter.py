"""Medusa as a drafter kind: the heads of models/medusa/model.py behind the `Drafter` interface
(its proposals in propose.py, its training forward in train.py).

Medusa reads only the target's last hidden state, never its embedding or aux layers: it is no
`FrozenEmbeddingDrafter`, and a checkpoint is the heads plus the draft vocabulary's map.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from models.blocks import BlockTraining
from models.drafter import (
    ExportTarget,
    Proposer,
    ServableDrafter,
    Shape,
    TrainableDrafter,
    check_matches_target,
    check_tensor_set,
)
from models.export_format import ExportError
from models.medusa.export import export_medusa, read_medusa_export
from models.medusa.model import MedusaConfig, MedusaHeads
from models.medusa.propose import MedusaProposer
from models.medusa.train import head_slot_logits, heads_unroll
from models.vocab import DraftVocab


class MedusaDrafter(MedusaHeads, BlockTraining, TrainableDrafter, ServableDrafter):
    config_type = MedusaConfig
    # The training forwards are train.py's functions, the drafter first.
    slot_logits = head_slot_logits
    unroll = heads_unroll

    # -- building -------------------------------------------------------------------------

    @classmethod
    def new(cls, target: Any, vocab: DraftVocab, settings: Mapping[str, Any]) -> MedusaDrafter:
        drafter = cls(cls.config_for(target, vocab.draft_vocab_size, settings), vocab)
        drafter.start_from_target_head(target.lm_head_weight)
        return drafter

    @classmethod
    def config_for(
        cls, target: Any, draft_vocab_size: int, settings: Mapping[str, Any]
    ) -> MedusaConfig:
        given = cls.spec.settings.given(settings)
        return MedusaConfig(
            hidden_size=target.hidden_size,
            vocab_size=target.vocab_size,
            draft_vocab_size=draft_vocab_size,
            num_heads=given["heads"],
            num_layers=given["layers"],
        )

    @classmethod
    def from_config(
        cls,
        config: MedusaConfig,
        embed_weight: Tensor | None,
        tensors: Mapping[str, Tensor],
        source: str,
    ) -> MedusaDrafter:
        for name in ("d2t", "t2d"):
            if name not in tensors:
                raise ValueError(
                    f"{source}: tensor {name!r} is missing; the draft vocab map cannot be rebuilt"
                )
        drafter = cls(config, DraftVocab(tensors["d2t"], tensors["t2d"]))
        check_tensor_set(drafter.tensors(), tensors, source)
        drafter.to(dtype=tensors["heads.0.weight"].dtype)
        drafter.load_state_dict(dict(tensors))
        device = embed_weight.device if embed_weight is not None else torch.device("cpu")
        return drafter.to(device)  # beside the target, whose states it reads

    def tensors(self) -> dict[str, Tensor]:
        return {name: t.detach().contiguous() for name, t in self.state_dict().items()}

    def untrained(self) -> MedusaDrafter:
        # Fresh random heads: Medusa's own start (`new`) copies the target's head, which the
        # untrained contrast does not have at hand.
        fresh = type(self)(self.config, self.vocab)
        return fresh.to(self.heads[0].weight.device)

    def check_target(self, target: Any) -> None:
        check_matches_target(self, target)

    # -- decoding -------------------------------------------------------------------------

    def proposer(
        self, shape: Shape, temperature: float, generator: torch.Generator, timer: Any
    ) -> Proposer:
        return MedusaProposer(self, shape, temperature, generator, timer)

    # -- serving --------------------------------------------------------------------------

    def write_export(
        self, fmt: str, out_dir: Path, target: ExportTarget, *, k: int, verifier: str | None
    ) -> Path:
        if k > self.config.num_heads:  # vLLM builds k heads and finds no weights for the rest
            raise ExportError(
                f"vLLM serves one drafted token per Medusa head: {k} drafted tokens need {k} "
                f"heads, this drafter has {self.config.num_heads}; lower --k"
            )
        return export_medusa(
            self, out_dir, target_config=target.config, target_identity=target.identity
        )

    @classmethod
    def read_export(cls, export_dir: Path, embed_weight: Tensor | None) -> MedusaDrafter:
        config, tensors = read_medusa_export(export_dir)
        return cls.from_export(export_dir, config, embed_weight, tensors)

    @torch.no_grad()
    def probe_logits(self, seed: int) -> Tensor:
        g = torch.Generator().manual_seed(seed)
        hidden = torch.randn(2, 5, self.config.hidden_size, generator=g)  # [B, T, H]
        return self(hidden.to(self.heads[0].weight.device))  # [B, T, N, Vd]
