"""A test-only drafter kind: a one-layer chain drafter built from EAGLE-3's network, trained and
decoded through the same features, interface and stages, exporting nothing. It shows that a
kind is its package plus one registry line (tests/models/test_toy_kind.py)."""

from typing import Literal

from models.eagle3.drafter import Eagle3Drafter
from models.kind import KindSettings, KindSpec


class ToyDrafter(Eagle3Drafter):
    """EAGLE-3's one decoder layer over the fused aux layers, under another name."""


class ToySettings(KindSettings):
    kind: Literal["toy"] = "toy"


SPEC = KindSpec(name="toy", title="Toy", settings=ToySettings, drafter=ToyDrafter)
