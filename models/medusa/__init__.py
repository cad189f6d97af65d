"""Medusa, the head drafter kind: N heads on the target's last hidden state drafting every offset
in one pass, as a chain or a static tree of top-k candidates per head (`SPEC` describes it to the
registry, models/drafters.py)."""

from typing import Annotated, Literal

from pydantic import Field

from models.kind import KindSettings, KindSpec, Reads, optional_setting
from models.medusa.drafter import MedusaDrafter
from models.medusa.model import DEFAULT_HEADS, DEFAULT_LAYERS

MAX_HEADS = 64
"""A static bound: 16x Medusa's default; every head is an [H, H] block and a [Vd, H] head, so at
a real target's width a few dozen are already gigabytes of optimizer state."""


class MedusaSettings(KindSettings):
    """Medusa's settings, each None = its default (models/medusa/model.py)."""

    kind: Literal["medusa"] = "medusa"
    depth_setting = "heads"
    heads: Annotated[int, Field(ge=1, le=MAX_HEADS)] | None = optional_setting(
        "medusa: heads, the most tokens one step drafts (default 4)",
        DEFAULT_HEADS,
        recorded_as="num_heads",
    )
    layers: Annotated[int, Field(ge=1, le=8)] | None = optional_setting(
        "medusa: residual blocks per head (default 1)", DEFAULT_LAYERS, recorded_as="num_layers"
    )

    def max_draft_depth(self) -> int | None:
        return self.heads or DEFAULT_HEADS


SPEC = KindSpec(
    name="medusa",
    title="Medusa",
    settings=MedusaSettings,
    drafter=MedusaDrafter,
    reads=Reads(last_hidden=True),  # the heads read h_t only: no aux layer is ever stored
    drafts_blocks=True,
    export_formats=("medusa",),
    serve_method="medusa",
    tree_note=(
        "vLLM serves this Medusa drafter as a chain, each head's top-1 token (its Medusa "
        "proposer drafts no trees), not the static top-k trees of drafting.tree"
    ),
)
