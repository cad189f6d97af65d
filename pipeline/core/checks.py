"""Checks that data belongs together: made with this target, and with one draft-vocab map.

Hidden states of one target mean nothing to another, and the draft-vocab map (`d2t`, `t2d`)
is frozen from the features stage on, so a stage refuses inputs that break either rule before
it does any work.
"""

from __future__ import annotations

import torch
from safetensors.torch import load_file
from torch import Tensor

from models.drafter import Drafter
from storage import Dataset, OpdError

VOCAB_FILE = "draft_vocab.safetensors"
"""The frozen draft-vocab map, carried unchanged by every dataset from `features` on."""


def check_same_target(ds: Dataset, identity: dict) -> None:
    """Refuse a dataset computed by another target (hidden states would be meaningless)."""
    theirs = ds.config.get("target") or ds.meta.get("target")
    if theirs is None:
        return
    keys = ("weights_sha256", "hidden_size", "vocab_size", "num_layers", "aux_layer_ids")
    # the files beside the weights, where the dataset records them (older ones do not)
    keys += ("settings_sha256",) if "settings_sha256" in theirs else ()
    diff = {k: (theirs.get(k), identity.get(k)) for k in keys if theirs.get(k) != identity.get(k)}
    if diff:
        raise OpdError(
            f"{ds.ref} was made with a different target ({', '.join(f'{k}: {a} vs {b}' for k, (a, b) in diff.items())}); "
            "re-run its stage with this target, or configure the target it was made with"
        )


def vocab_of(ds: Dataset) -> dict[str, Tensor]:
    """The `d2t` / `t2d` tensors of a dataset's draft-vocab map file."""
    if VOCAB_FILE not in ds.shards():
        raise OpdError(
            f"{ds.ref} has no {VOCAB_FILE}; it must carry the draft vocab map it was made with"
        )
    return load_file(ds.file(VOCAB_FILE))  # ds.file checks its sha256 first


def check_same_vocab(reference: Dataset, others: list[Dataset]) -> None:
    """Refuse data made with another draft-vocab map than `reference` (the map is never rebuilt)."""
    mine = vocab_of(reference)
    for ds in others:
        theirs = vocab_of(ds)
        if not all(torch.equal(mine[k], theirs[k]) for k in ("d2t", "t2d")):
            raise OpdError(
                f"{ds.ref} uses another draft-vocab map than {reference.ref}; the map is frozen "
                "from the features stage on: make it with the same features lineage"
            )


def check_drafter_vocab(data: Dataset, drafter: Drafter, drafter_ref: str) -> None:
    """Refuse a drafter whose map differs from the one `data` was made (or drafted) with. A
    full-vocabulary drafter (DFlash's target head) reads target ids and no map: it reads any."""
    theirs, ours = vocab_of(data), drafter.vocab
    if not ours.is_full and not (
        torch.equal(theirs["d2t"], ours.d2t.cpu()) and torch.equal(theirs["t2d"], ours.t2d.cpu())
    ):
        made_by = data.meta.get("drafter")
        raise OpdError(
            f"{drafter_ref} has another draft-vocab map (d2t/t2d) than {data.ref}"
            + (f" (drafted by {made_by})" if made_by else "")
            + "; the map is frozen from the features stage on: use data made with this "
            "drafter's lineage (e.g. its rollouts), or the drafter that made the data"
        )


def check_made_by(data: Dataset, drafter: Dataset) -> None:
    """Refuse on-policy data (rollouts, replays) that another drafter made: it records the states
    that drafter's own proposals led to, so training or replaying another on it is off-policy.
    Data whose manifest records no drafter (written by hand) is not checked."""
    made_by = data.inputs.get("drafter")
    if made_by is not None and made_by != str(drafter.ref):
        raise OpdError(
            f"{data.ref} was made by {made_by}, not by {drafter.ref} (--input drafter): on-policy "
            f"data belongs to its drafter; pass --input drafter={made_by}, or make "
            f"{data.ref.name} with {drafter.ref} first"
        )


def check_drafter_kind(data: Dataset, kind: str, drafter_ref: str) -> None:
    """Refuse on-policy data (rollouts, replays) drafted by another drafter kind: its log and
    replays are a chain's or a block's, and another kind cannot replay or train on them. Data
    that records no kind (written before kinds were recorded) is left to `check_made_by`."""
    theirs = data.meta.get("drafter_kind")
    if theirs is not None and theirs != kind:
        raise OpdError(
            f"{data.ref} was drafted by a {theirs} drafter, but {drafter_ref} is a {kind} "
            f"drafter: pass the {theirs} drafter that made it, or make {data.ref.name} with "
            f"{drafter_ref} first"
        )
