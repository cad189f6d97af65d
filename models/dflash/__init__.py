"""DFlash, the block drafter kind: a whole block drafted in one forward per verify step, from
the target's context and mask tokens (`SPEC` describes it to the registry, models/drafters.py)."""

from typing import Annotated, Literal

from pydantic import Field

from models.dflash.drafter import DFlashDrafter
from models.dflash.model import DEFAULT_BLOCK_SIZE
from models.kind import KindSettings, KindSpec, optional_setting

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
        "dflash: anchor + drafted slots per block (>= 2)"
    )
    layers: Annotated[int, Field(ge=1)] | None = optional_setting("dflash: decoder layers")
    anchors: Annotated[int, Field(ge=1)] | None = optional_setting(
        "dflash: training anchors per sequence (at most)"
    )
    mask_token_id: Annotated[int, Field(ge=0)] | None = optional_setting(
        "dflash: the mask slots' token id (default: the target's pad token, else its last id)"
    )
    head: Literal["draft", "target"] | None = optional_setting(
        "dflash: draft (default), a trained head over the features' draft vocab; target, the "
        "target's own lm_head, frozen, over the full vocab"
    )

    def max_draft_depth(self) -> int | None:
        return (self.block_size or DEFAULT_BLOCK_SIZE) - 1


SPEC = KindSpec(
    name="dflash",
    title="DFlash",
    settings=DFlashSettings,
    drafter=DFlashDrafter,
    drafts_blocks=True,
    export_formats=("dflash",),
    serve_method="dflash",
)
