"""MTP as a drafter kind: the modules of models/mtp/model.py behind the `Drafter` interface.
Its proposals (K-chains, EAGLE-2 trees), replays, training unroll, acceptance and Draft-OPD
pieces are every chain drafter's (models/chain.py); its loss is DeepSeek-V3's per-depth mean
(train.py). It is trained but not served: no vLLM format holds it losslessly beside a
Llama/Qwen target (docs/drafters.md: MTP), so it is no `ServableDrafter`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from models.chain import ChainDrafter, Unrolled
from models.drafter import FrozenEmbeddingDrafter, TrainableDrafter, check_matches_target
from models.mtp.model import MTPConfig, MTPModel
from models.mtp.train import depth_mean_loss, depth_mean_rollout_loss
from models.vocab import DraftVocab


class MTPDrafter(MTPModel, ChainDrafter, FrozenEmbeddingDrafter, TrainableDrafter):
    config_type = MTPConfig

    # -- building -------------------------------------------------------------------------

    @classmethod
    def new(cls, target: Any, vocab: DraftVocab, settings: Mapping[str, Any]) -> MTPDrafter:
        # `vocab` (the features' pruned map) goes unused: the target's head reads every id.
        config = cls.config_for(target, vocab.draft_vocab_size, settings)
        return cls(config, target.embed_weight, target.lm_head_weight)

    @classmethod
    def config_for(
        cls, target: Any, draft_vocab_size: int, settings: Mapping[str, Any]
    ) -> MTPConfig:
        return MTPConfig.from_target(target.config, cls.spec.settings.given(settings)["modules"])

    @classmethod
    def built_for(
        cls, config: Any, embed_weight: Tensor, tensors: Mapping[str, Tensor], source: str
    ) -> MTPDrafter:
        if "lm_head.weight" not in tensors:
            raise ValueError(f"{source}: tensor 'lm_head.weight' (the target's head) is missing")
        return cls(config, embed_weight, tensors["lm_head.weight"])

    def untrained(self) -> MTPDrafter:
        fresh = type(self)(self.config, self.embed_tokens.weight, self.lm_head.weight)
        return fresh.to(self.lm_head.weight.device)

    def check_target(self, target: Any) -> None:
        check_matches_target(self, target)
        for name, theirs, ours in (
            ("embed_tokens", self.embed_tokens.weight, target.embed_weight),
            ("lm_head", self.lm_head.weight, target.lm_head_weight),
        ):
            if theirs.data_ptr() != ours.data_ptr() and not torch.equal(
                theirs.to(ours.device, ours.dtype), ours
            ):
                raise ValueError(
                    f"the drafter's {name} is not the target's; use the drafter trained for "
                    "this target"
                )

    # -- training -------------------------------------------------------------------------

    def unroll(
        self,
        features: Any,
        loss_mask: Tensor | None,
        steps: int,
        replays: tuple[Tensor, Tensor, Tensor] | None = None,
    ) -> Unrolled:
        D = self.config.num_modules
        if steps < D:
            raise ValueError(
                f"{steps} unrolled depths leave MTP modules of the {D} untrained; raise "
                "drafting.ttt_steps or lower drafter.modules"
            )
        return ChainDrafter.unroll(self, features, loss_mask, steps, replays)

    def sft_loss(
        self,
        out: Unrolled,
        teacher: Tensor,
        last_hidden: Tensor,
        *,
        decay: float,
        objective: str | None = None,
    ) -> Tensor:
        return depth_mean_loss(out.logits, out.valid, teacher)

    def rollout_ce_loss(
        self, out: Unrolled, teacher: Tensor, item: Tensor, anchor: Tensor, decay: float
    ) -> Tensor:
        anchor_rows = torch.zeros(teacher.shape[:2], dtype=torch.bool, device=teacher.device)
        anchor_rows[item, anchor - 2] = True
        return depth_mean_rollout_loss(out.logits, out.valid, teacher, anchor_rows)
