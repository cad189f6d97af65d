"""The feature source: the target's features of token sequences, as a drafter kind reads them.

One place decides, for every stage, which hidden states exist (what the kind reads,
`models.kind.Reads`: the target's aux layers, its last hidden state, or neither) and where they
come from: the `features` stage caches them and `rollout` writes them beside its sequences (so
sft/opd loaders read both unchanged), or, for a dataset made with `features.mode=online` (the
token columns and the vocab map, no hidden states), `score` and the training loaders have the
target compute them. A cached dataset stores only what its kind reads: aux + last for EAGLE-3
and DFlash (8·H bytes a token with three aux layers), the last hidden state alone for Medusa
(2·H); its meta's `hidden_states` names them when they are not both.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Iterator, Mapping, Sequence
from typing import Any, Literal

import pyarrow as pa
import torch
from torch import Tensor

from models.features import Features
from models.kind import Reads
from storage import (
    Dataset,
    DatasetNotFound,
    OpdError,
    read_tensor_column,
    tensor_array,
    tensor_field,
)

ONLINE = "online"
"""`features.mode` (and the features and rollouts manifests' meta `mode`) of a dataset without
hidden states."""
HIDDEN_COLUMNS = ("aux_hidden", "last_hidden")
"""The hidden-state columns there are (the aux layers concatenated, the last hidden state):
what a cached dataset stores unless its meta's `hidden_states` says fewer."""
HiddenColumn = Literal["aux_hidden", "last_hidden"]
ONLINE_DATASETS = ("features", "rollouts")
"""The datasets that hold feature rows (`features-*.arrow` in rollouts), cached or online."""
TRAINED_ON = {"sft": "features", "opd": "rollouts"}
"""A drafter dataset's input role holding the feature rows it trained on."""
TOKEN_COLUMNS = ("input_ids", "loss_mask")


def hidden_columns(reads: Reads) -> tuple[str, ...]:
    """The hidden-state columns a kind that reads `reads` needs."""
    return tuple(
        name
        for name, read in zip(
            HIDDEN_COLUMNS, (reads.target_layers > 0, reads.last_hidden), strict=True
        )
        if read
    )


def token_schema() -> pa.Schema:
    """The columns every features dataset holds: an online one holds only these."""
    return pa.schema(
        [
            pa.field("seq_id", pa.string()),
            pa.field("input_ids", pa.list_(pa.int32())),
            pa.field("loss_mask", pa.list_(pa.int8())),
        ]
    )


def feature_schema(
    hidden: int, aux_layers: int = 3, columns: Sequence[str] = HIDDEN_COLUMNS
) -> pa.Schema:
    """A cached feature shard's columns: the tokens, then `columns` (bf16) of a target of
    width `hidden` capturing `aux_layers` aux layers."""
    widths = {"aux_hidden": aux_layers * hidden, "last_hidden": hidden}
    return pa.schema(
        [
            *token_schema(),
            *(tensor_field(name, torch.bfloat16, widths[name]) for name in columns),
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


@torch.no_grad()
def forward_batch(target: Any, seqs: list[list[int]]) -> tuple[Tensor, Tensor]:
    """Right-padded batch; causal attention means padding never touches real positions."""
    width = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s)
    aux, last = target.forward_features(ids.to(target.device))  # no LM head: logits unused
    return aux.to(torch.bfloat16).cpu(), last.to(torch.bfloat16).cpu()


class FeatureSource:
    """The hidden states one drafter kind reads (`hidden`: some of HIDDEN_COLUMNS), for the
    sequences a stage asks about, cached or `online`.

    Writing: `table` is a shard of feature rows (the features stage's, a rollout's
    features-*.arrow): the token columns and, unless online, the states the kind reads, one
    target forward per `length_batches` batch. Reading: `sequences` (score: rows of one shard
    as `Features`), `padded` (the training loaders, `training.FeatureIndex`: a batch's online
    rows, computed on the training thread). Every state it computes is rounded to bf16 as the
    cache stores it, so a reader gets the same numbers either way wherever the forward's
    padded width is the same (the forward is exact per row at a given width, not across
    widths: fp32 attention sums round differently). `target_forwards` / `target_seconds`
    count what computing them cost this process."""

    def __init__(
        self, target: Any, hidden: Sequence[str] = HIDDEN_COLUMNS, *, online: bool = False
    ):
        unknown = sorted(set(hidden) - set(HIDDEN_COLUMNS))
        if unknown:
            raise ValueError(f"unknown hidden-state columns {unknown}; there are {HIDDEN_COLUMNS}")
        self.target = target
        self.hidden = tuple(name for name in HIDDEN_COLUMNS if name in hidden)
        self.online = online
        self.target_forwards, self.target_seconds = 0, 0.0

    @classmethod
    def reading(cls, target: Any, reads: Reads, *, online: bool = False) -> FeatureSource:
        """The source of what a kind that reads `reads` reads."""
        return cls(target, hidden_columns(reads), online=online)

    @property
    def columns(self) -> tuple[str, ...]:
        """The per-token columns a training batch holds: the tokens and the states read."""
        return (*TOKEN_COLUMNS, *self.hidden)

    @property
    def stored(self) -> tuple[str, ...]:
        """The hidden-state columns `table` writes (none online)."""
        return () if self.online else self.hidden

    def meta(self) -> dict[str, Any]:
        """What a dataset written through `table` says of its rows in its manifest's meta."""
        if self.online:
            return {"mode": ONLINE}
        return {"hidden_states": list(self.hidden)} if self.hidden != HIDDEN_COLUMNS else {}

    def check(self, ds: Dataset) -> None:
        """Refuse, before any work, cached feature rows that lack a state the kind reads (made
        for a kind that reads less)."""
        if is_online(ds):
            return
        stored = ds.meta.get("hidden_states", list(HIDDEN_COLUMNS))
        missing = [name for name in self.hidden if name not in stored]
        if missing:
            raise OpdError(
                f"{ds.ref} stores {stored or 'no hidden states'} (made for a drafter kind that "
                f"reads only those), and this drafter also reads {missing}: make "
                f"{ds.ref.name} for this drafter kind (--set drafter.kind=...)"
            )

    def table(self, rows: Sequence[Mapping[str, Any]], batch_size: int) -> pa.Table:
        """`rows` (seq_id, input_ids, loss_mask) as one feature shard, with their states."""
        seqs = [list(r["input_ids"]) for r in rows]
        states: dict[str, list[Tensor | None]] = {name: [None] * len(rows) for name in self.stored}
        if self.stored:
            for j, row in self._computed(seqs, length_batches([len(s) for s in seqs], batch_size)):
                for name in self.stored:
                    states[name][j] = row[name]
        schema = feature_schema(
            self.target.hidden_size, len(self.target.aux_layer_ids), self.stored
        )
        return pa.table(
            [
                pa.array([r["seq_id"] for r in rows], pa.string()),
                pa.array(seqs, pa.list_(pa.int32())),
                pa.array([r["loss_mask"] for r in rows], pa.list_(pa.int8())),
                *(tensor_array(states[name], schema.field(name)) for name in self.stored),
            ],
            schema=schema,
        )

    def sequences(
        self, ds: Dataset, shard: str, seqs: list[list[int]], wanted: Collection[int]
    ) -> Iterator[tuple[int, Features]]:
        """(row, its `Features`: one sequence, [T] ids) of each `wanted` row of feature shard
        `shard` of `ds`, whose token rows are `seqs`: as stored, or, online, computed in the
        batches the cached dataset would have been written in (length-sorted,
        `feature_batch_size` of its meta), batches without a wanted row skipped, so the
        bytes are the cached ones."""
        if is_online(ds):
            batch_size = int(ds.meta.get("feature_batch_size", 1))
            batches = length_batches([len(s) for s in seqs], batch_size)
            computed = self._computed(seqs, [b for b in batches if set(wanted).intersection(b)])
        else:
            computed = self._stored(ds, shard)
        for j, row in computed:
            if j in wanted:
                aux, last = row.get("aux_hidden"), row.get("last_hidden")
                yield j, Features(torch.tensor(seqs[j]), aux, last)

    def padded(self, seqs: list[list[int]], width: int) -> dict[str, Tensor]:
        """The states of `seqs` [B, width, D] each in ONE target forward, zero past each row's
        length, as a cached batch is collated."""
        out = {}
        for j, row in self._computed(seqs, [list(range(len(seqs)))]):
            for name, values in row.items():
                column = out.setdefault(
                    name, torch.zeros(len(seqs), width, values.shape[-1], dtype=values.dtype)
                )
                column[j, : len(values)] = values
        return out

    def summary(self, datasets: Sequence[Dataset]) -> dict[str, Any]:
        """With online feature rows among `datasets`: the sequences the target featurized (a
        features dataset's trajectories; rollouts are their own) and what it cost this run
        (timings measure the run); empty when all were cached, so a cached run's summary is
        unchanged."""
        online = [ds for ds in datasets if is_online(ds)]
        if not online:
            return {}
        return {
            "online_features": {
                "features": [str(ds.ref) for ds in online],
                "trajectories": [sequences_of(ds) for ds in online],
                "target_forwards_this_run": self.target_forwards,
                "target_seconds_this_run": round(self.target_seconds, 2),
            }
        }

    def _computed(
        self, seqs: list[list[int]], batches: list[list[int]]
    ) -> Iterator[tuple[int, dict[str, Tensor]]]:
        """(row, its states [T, D] bf16 by column) of every row of `batches`, one target
        forward per batch, each row cut to its length."""
        if not self.hidden:  # a kind that reads none: nothing to compute
            yield from ((j, {}) for idx in batches for j in idx)
            return
        for idx in batches:
            t0 = time.perf_counter()
            aux, last = forward_batch(self.target, [seqs[j] for j in idx])
            self.target_forwards += 1
            self.target_seconds += time.perf_counter() - t0
            states = {"aux_hidden": aux, "last_hidden": last}
            for r, j in enumerate(idx):
                yield j, {name: states[name][r, : len(seqs[j])] for name in self.hidden}

    def _stored(self, ds: Dataset, shard: str) -> Iterator[tuple[int, dict[str, Tensor]]]:
        """(row, its states as stored, by column) of every row of a cached feature shard."""
        row0 = 0
        for batch in ds.ipc_batches(shard):
            columns = {
                name: read_tensor_column(batch.column(name), batch.schema.field(name))
                for name in self.hidden
            }
            for r in range(batch.num_rows):
                yield (
                    row0 + r,
                    {
                        name: values[offsets[r] : offsets[r + 1]]
                        for name, (values, offsets) in columns.items()
                    },
                )
            row0 += batch.num_rows
