"""The target's features of token sequences, as the `features` stage caches them and `rollout`
writes them beside its sequences (so sft/opd loaders read both unchanged)."""

from __future__ import annotations

import pyarrow as pa
import torch

from storage import tensor_field


def feature_schema(hidden: int) -> pa.Schema:
    return pa.schema(
        [
            pa.field("seq_id", pa.string()),
            pa.field("input_ids", pa.list_(pa.int32())),
            pa.field("loss_mask", pa.list_(pa.int8())),
            tensor_field("aux_hidden", torch.bfloat16, 3 * hidden),
            tensor_field("last_hidden", torch.bfloat16, hidden),
        ]
    )


@torch.no_grad()
def forward_batch(target, seqs: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded batch; causal attention means padding never touches real positions."""
    width = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s)
    aux, last = target.forward_features(ids.to(target.device))  # no LM head: logits unused
    return aux.to(torch.bfloat16).cpu(), last.to(torch.bfloat16).cpu()
