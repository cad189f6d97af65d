"""The target's features of token sequences, as the `features` stage caches them and `rollout`
writes them beside its sequences (so sft/opd loaders read both unchanged), or as `score` and
the training loaders compute them from an online dataset (`features.mode=online`): features or
rollouts that hold the token columns and the vocab map, but no hidden states."""

from __future__ import annotations

from collections.abc import Iterator

import pyarrow as pa
import torch

from storage import Dataset, DatasetNotFound, OpdError, tensor_field

ONLINE = "online"
"""`features.mode` (and the features and rollouts manifests' meta `mode`) of a dataset without
hidden states."""
HIDDEN_COLUMNS = ("aux_hidden", "last_hidden")
"""What an online dataset leaves out and its readers compute."""
ONLINE_DATASETS = ("features", "rollouts")
"""The datasets that hold feature rows (`features-*.arrow` in rollouts), cached or online."""
TRAINED_ON = {"sft": "features", "opd": "rollouts"}
"""A drafter dataset's input role holding the feature rows it trained on."""


def token_schema() -> pa.Schema:
    """The columns every features dataset holds: an online one holds only these."""
    return pa.schema(
        [
            pa.field("seq_id", pa.string()),
            pa.field("input_ids", pa.list_(pa.int32())),
            pa.field("loss_mask", pa.list_(pa.int8())),
        ]
    )


def feature_schema(hidden: int) -> pa.Schema:
    return pa.schema(
        [
            *token_schema(),
            tensor_field("aux_hidden", torch.bfloat16, 3 * hidden),
            tensor_field("last_hidden", torch.bfloat16, hidden),
        ]
    )


def is_online(ds: Dataset) -> bool:
    """Whether `ds` is a features or rollouts dataset whose rows hold no hidden states: its
    readers (score, the training loaders) compute them with the target."""
    return ds.ref.name in ONLINE_DATASETS and ds.meta.get("mode") == ONLINE


def sequences_of(ds: Dataset) -> str:
    """Where an online dataset's token rows come from: a features dataset's trajectories;
    rollouts hold their own sequences."""
    return ds.meta.get("trajectories", str(ds.ref))


def trained_online(drafter: Dataset) -> bool:
    """Whether the drafter in `drafter` (an sft or opd dataset) trained on online feature rows:
    sft on an online `features` input, opd on online `rollouts`. This is how `features.mode`
    reaches the rollouts of every round: through the data, as it reaches sft and opd."""
    role = TRAINED_ON.get(drafter.ref.name)
    ref = drafter.inputs.get(role) if role else None
    if ref is None:
        return False
    try:
        data = drafter.store.open(ref)
    except DatasetNotFound:
        raise OpdError(
            f"{drafter.ref} was trained on {ref}, which is not in this root, so whether its "
            "run's features are online is unknown: set rollout.features=online or "
            "rollout.features=cached"
        ) from None
    return is_online(data)


def length_batches(lengths: list[int], batch_size: int) -> list[list[int]]:
    """Row indices in the batches the features stage and a cached rollout run the target on:
    sorted by length (stable), `batch_size` at a time. Rows computed in the same batch get the
    same bytes (one padded width); `score` on online rollouts batches them so."""
    order = sorted(range(len(lengths)), key=lengths.__getitem__)
    return [order[b : b + batch_size] for b in range(0, len(order), batch_size)]


def sequence_features(
    target, seqs: list[list[int]], batches: list[list[int]]
) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
    """(row, aux [T, 3H], last [T, H]) bf16 of every row of `batches` (rows of `seqs`, e.g.
    from `length_batches`), one target forward per batch, each row cut to its length."""
    for idx in batches:
        aux, last = forward_batch(target, [seqs[j] for j in idx])
        for r, j in enumerate(idx):
            yield j, aux[r, : len(seqs[j])], last[r, : len(seqs[j])]


@torch.no_grad()
def forward_batch(target, seqs: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded batch; causal attention means padding never touches real positions."""
    width = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s)
    aux, last = target.forward_features(ids.to(target.device))  # no LM head: logits unused
    return aux.to(torch.bfloat16).cpu(), last.to(torch.bfloat16).cpu()


def featurize_rows(target, seqs: list[list[int]], width: int) -> dict[str, torch.Tensor]:
    """aux_hidden [B, width, 3H] and last_hidden [B, width, H] of `seqs` in ONE target forward,
    rounded to bf16 exactly as the features stage stores them (`forward_batch`) and zero past
    each row's length, as a cached batch is collated; so a training step reads the same
    numbers either way wherever the forward's padded width is the same (the forward is
    exact per row at a given width, not across widths: fp32 attention sums round differently)."""
    aux, last = forward_batch(target, seqs)
    out = {
        "aux_hidden": torch.zeros(len(seqs), width, aux.shape[-1], dtype=torch.bfloat16),
        "last_hidden": torch.zeros(len(seqs), width, last.shape[-1], dtype=torch.bfloat16),
    }
    for i, s in enumerate(seqs):
        out["aux_hidden"][i, : len(s)] = aux[i, : len(s)]
        out["last_hidden"][i, : len(s)] = last[i, : len(s)]
    return out
