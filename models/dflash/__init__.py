"""DFlash, the block drafter kind: a whole block drafted in one forward per verify step, from
the target's context and mask tokens (`SPEC` describes it to the registry, models/drafters.py)."""

from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import Field

from models.dflash.drafter import DFlashDrafter
from models.dflash.model import (
    DEFAULT_ANCHORS,
    DEFAULT_BLOCK_SIZE,
    DEFAULT_HEAD,
    DEFAULT_LAYERS,
    DEFAULT_TARGET_LAYERS,
)
from models.kind import KindSettings, KindSpec, Reads, optional_setting

MAX_BLOCK_SIZE = 128
"""A DFlash block's static bound: 8x the largest block the public DFlash recipes train (8-16),
since a block's training activations and attention grow with it at every anchor (a block of
100,000 grew the process to 17 GB before it was killed); the target's positions bound it too."""


class DFlashSettings(KindSettings):
    """DFlash's settings, each None = its default (documented in models/dflash/model.py)."""

    kind: Literal["dflash"] = "dflash"
    depth_setting = "block_size"
    # The bounds are checked before any work (the upper ones that depend on the target, as the
    # target's positions, layers and vocab, by `Drafter.check_settings` when the target loads).
    block_size: Annotated[int, Field(ge=2, le=MAX_BLOCK_SIZE)] | None = optional_setting(
        "dflash: anchor + drafted slots per block (>= 2)", DEFAULT_BLOCK_SIZE
    )
    layers: Annotated[int, Field(ge=1)] | None = optional_setting(
        "dflash: decoder layers", DEFAULT_LAYERS, recorded_as="num_layers"
    )
    anchors: Annotated[int, Field(ge=1)] | None = optional_setting(
        "dflash: training anchors per sequence (at most)", DEFAULT_ANCHORS
    )
    # None: `models.dflash.model.default_mask_token`, which depends on the target
    mask_token_id: Annotated[int, Field(ge=0)] | None = optional_setting(
        "dflash: the mask slots' token id (default: the target's pad token, else its last id)"
    )
    head: Literal["draft", "target"] | None = optional_setting(
        "dflash: draft (default), a trained head over the features' draft vocab; target, the "
        "target's own lm_head, frozen, over the full vocab",
        DEFAULT_HEAD,
    )
    target_layers: Annotated[int, Field(ge=1)] | None = optional_setting(
        "dflash: target layers whose states the drafter reads (the target's aux layers, "
        "target.aux_layer_ids; default 3, the public DFlash recipes read 5)",
        DEFAULT_TARGET_LAYERS,
    )

    def max_draft_depth(self) -> int | None:
        return (self.block_size or DEFAULT_BLOCK_SIZE) - 1

    def reads(self) -> Reads:
        return Reads(self.target_layers or DEFAULT_TARGET_LAYERS, last_hidden=True)

    @classmethod
    def recorded(cls, config: Mapping[str, Any]) -> dict[str, Any]:
        # The config records the layers themselves; the setting is how many.
        return super().recorded(config) | {"target_layers": len(config["target_layer_ids"])}


SPEC = KindSpec(
    name="dflash",
    title="DFlash",
    settings=DFlashSettings,
    drafter=DFlashDrafter,
    reads=Reads(DEFAULT_TARGET_LAYERS, last_hidden=True),
    drafts_blocks=True,
    export_formats=("dflash",),
    serve_method="dflash",
)
