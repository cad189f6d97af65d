"""EAGLE-3, the default drafter kind: one decoder layer over a fusion of three target hidden
states, drafting a chain (or an EAGLE-2 tree) one forward per draft, trained with training-time
test (`SPEC` describes it to the registry, models/drafters.py)."""

from typing import Literal

from models.eagle3.drafter import Eagle3Drafter
from models.kind import KindSettings, KindSpec, Reads


class Eagle3Settings(KindSettings):
    """EAGLE-3 takes no settings: it sizes itself from the target."""

    kind: Literal["eagle3"] = "eagle3"


SPEC = KindSpec(
    name="eagle3",
    title="EAGLE-3",
    settings=Eagle3Settings,
    drafter=Eagle3Drafter,
    reads=Reads(target_layers=3, last_hidden=True),  # low / mid / high, fused by `fc`
    export_formats=("eagle3", "speculators"),
    serve_method="eagle3",
    objectives={"eagle3": "EAGLE-3 (training-time test)", "eagle1": "EAGLE-1 (L_reg + 0.1 CE)"},
    tree_note=(
        "vLLM serves this EAGLE-3 drafter as a chain of num_speculative_tokens drafts; its "
        "speculative config has no draft-tree setting, so the EAGLE-2 trees of drafting.tree "
        "run in the project's own decoder only (docs/drafters.md: draft trees)"
    ),
)
