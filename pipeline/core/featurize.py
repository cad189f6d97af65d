"""The target's features of token sequences, as the `features` stage caches them and `rollout`
writes them beside its sequences (so sft/opd loaders read both unchanged), or as the training
loaders compute them from an online features dataset (`features.mode=online`): one that holds
the token columns and the vocab map, but no hidden states."""

from __future__ import annotations

import pyarrow as pa
import torch

from storage import Dataset, tensor_field

ONLINE = "online"
"""`features.mode` (and the features manifest's meta `mode`) of a dataset without hidden states."""
HIDDEN_COLUMNS = ("aux_hidden", "last_hidden")
"""What an online features dataset leaves out and the training loaders compute."""


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
    """Whether `ds` is a features dataset whose hidden states are computed while training."""
    return ds.ref.name == "features" and ds.meta.get("mode") == ONLINE


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
