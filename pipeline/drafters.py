"""Loading a trained drafter (an `sft` or `opd` dataset) for the target it was trained with."""

from __future__ import annotations

from models.drafter import Eagle3Drafter, load_drafter
from models.target import Target
from pipeline.features import check_same_target
from storage import Dataset, OpdError

DRAFTER_DATASETS = ("sft", "opd")


def load_drafter_dataset(ds: Dataset, target: Target, identity: dict) -> Eagle3Drafter:
    """The drafter in `ds`, with the target's embedding re-attached; refuses a foreign target."""
    if ds.ref.name not in DRAFTER_DATASETS:
        raise OpdError(f"{ds.ref} is not a drafter; pass an sft or opd dataset (e.g. sft@latest)")
    check_same_target(ds, identity)
    ds.verify_all()
    try:
        drafter = load_drafter(ds.path, target.embed_weight)
    except ValueError as e:
        raise OpdError(f"{ds.ref}: {e}") from None
    return drafter.eval()
