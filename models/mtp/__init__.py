"""MTP, DeepSeek-V3-style multi-token prediction modules as a drafter kind: D sequential
modules on the target's last hidden state and the next token's embedding, predicting with
the target's frozen head, drafting a chain (or an EAGLE-2 tree) one module forward per draft
(`SPEC` describes it to the registry, models/drafters.py)."""

from typing import Annotated, Literal

from pydantic import Field

from models.kind import KindSettings, KindSpec, Reads, optional_setting
from models.mtp.drafter import MTPDrafter
from models.mtp.model import DEFAULT_MODULES

MAX_MODULES = 16
"""A static bound; each module is a decoder layer and a 2H x H projection. Depths past the
modules reuse the last one, so more modules than the draft depth train nothing."""


class MTPSettings(KindSettings):
    """MTP's settings, each None = its declared default."""

    kind: Literal["mtp"] = "mtp"
    modules: Annotated[int, Field(ge=1, le=MAX_MODULES)] | None = optional_setting(
        "mtp: D sequential MTP modules (default 1, as DeepSeek-V3); drafts deeper than D "
        "reuse the last module, and D must not exceed drafting.ttt_steps",
        DEFAULT_MODULES,
        recorded_as="num_modules",
    )

    def trained_depth(self) -> int:
        return self.modules or DEFAULT_MODULES  # module d trains at unrolled depth d only


SPEC = KindSpec(
    name="mtp",
    title="MTP",
    settings=MTPSettings,
    drafter=MTPDrafter,
    reads=Reads(last_hidden=True),  # h_t and the tokens' embeddings: no aux layer is stored
    export_note=(
        "vLLM's mtp method loads MTP layers only from inside a DeepSeek/MiMo-family target's "
        "checkpoint, and its eagle format lacks the modules' norms (docs/drafters.md: MTP)"
    ),
)
