"""Draft-OPD's replays as training data: the score stage's replay rows joined to their rollout
sequences (`ReplayIndex`), collated into `ReplayBatch`es, and the acceptance outcomes drawn
from their recorded probabilities (`replay_outcomes`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import torch
from torch import Tensor

from models import verify
from models.features import Features
from pipeline.core import training, validation
from pipeline.core.featurize import FeatureSource
from storage import Dataset, OpdError, read_tensor_column

FEATURE_COLUMNS = validation.FEATURE_COLUMNS
REPLAY_COLUMNS = ("tokens", "accept_prob", "teacher_hidden")


def _fixed_width(batch: pa.RecordBatch, name: str) -> Tensor:
    """A per-replay [K] list column or [K, D] tensor column as one [R, K(, D)] tensor."""
    field = batch.schema.field(name)
    column = batch.column(name)
    if (field.metadata or {}).get(b"opd.dtype"):
        values, offsets = read_tensor_column(column, field)
        offsets = np.asarray(offsets)
    elif pa.types.is_list(field.type) or pa.types.is_large_list(field.type):
        offsets = column.offsets.to_numpy().astype(np.int64)
        values = torch.from_numpy(
            column.values.to_numpy(zero_copy_only=False)[offsets[0] : offsets[-1]].copy()
        )
        offsets = offsets - offsets[0]
    else:
        raise OpdError(f"replay column {name!r} is {field.type}, expected a per-step list")
    widths = np.diff(offsets)
    if len(widths) and (widths != widths[0]).any():
        raise OpdError(
            f"replay column {name!r} has rows of different lengths {sorted(set(widths))}"
        )
    k = int(widths[0]) if len(widths) else 0
    return values.reshape(len(widths), k, *values.shape[1:]).clone()


@dataclass
class ReplayBatch:
    """Training items right-padded to [B, T]; their N replays as flat [N, K] arrays. The hidden
    states of online rollouts are None until `ReplayIndex.featurize` computes them."""

    aux_hidden: Tensor | None  # [B, T, n*H] bf16; None also for a kind that reads no aux layer
    input_ids: Tensor  # [B, T] int64
    loss_mask: Tensor  # [B, T] bool
    last_hidden: Tensor | None  # [B, T, H] bf16
    lengths: Tensor  # [B] rows each item unrolls
    item: Tensor  # [N] batch row of each replay
    anchor: Tensor  # [N] each replay's anchor e (its drafts follow the prefix y<e)
    tokens: Tensor  # [N, K] int64 replayed target ids
    accept_prob: Tensor  # [N, K] float32
    replay_length: Tensor  # [N] verified tokens of each replay (K, or up to a drafted EOS)
    teacher_hidden: Tensor  # [N, K, H] bf16
    feature_rows: Tensor | None = None  # [B] each item's row in the rollouts' FeatureIndex
    share: float = 1.0  # this rank's share of the step's tokens (training.PaddedBatch.share)

    @property
    def row_steps(self) -> int:
        return int(self.lengths.sum()) * self.tokens.shape[1]

    def _map(self, fn: Callable[[Tensor], Tensor]) -> ReplayBatch:
        return ReplayBatch(
            **{k: (fn(v) if isinstance(v, Tensor) else v) for k, v in self.__dict__.items()}
        )

    def to(self, device: torch.device) -> ReplayBatch:
        return self._map(lambda t: t.to(device, non_blocking=True))

    @property
    def features(self) -> Features:
        """The items as the drafter's features record (sequence convention)."""
        return Features(self.input_ids, self.aux_hidden, self.last_hidden)

    def pin_memory(self) -> ReplayBatch:
        """A page-locked copy, so `to(cuda)` copies asynchronously."""
        return self._map(Tensor.pin_memory)


class ReplayIndex:
    """Replays grouped into training items, one per (rollout sequence, sample), for FeatureLoader.

    `lengths[i]` is the number of unroll rows item i needs: up to its last anchor's prefix (or the
    whole sequence when `full_sequences`, for a soft-CE on the rollout's own rows). `keys[i]` is
    the item's seq_id, so a held-out split keeps all samples of a sequence on one side.
    Online rollouts (`features.mode=online`) hold no hidden states: `source` computes each
    batch's in `featurize`, as `training.FeatureIndex` does for an online features dataset.
    """

    def __init__(
        self,
        replays: Dataset,
        rollouts: Dataset,
        *,
        full_sequences: bool,
        source: FeatureSource | None = None,
    ):
        columns = FEATURE_COLUMNS if source is None else source.columns
        self.features = training.FeatureIndex(rollouts, columns, source=source)
        feature_row = {key: i for i, key in enumerate(self.features.keys)}
        seq_ids: list[str] = []
        anchors, samples, lengths_given = [], [], []
        cols: dict[str, list[Tensor]] = {name: [] for name in REPLAY_COLUMNS}
        for shard in replays.shards("ipc"):
            for batch in replays.ipc_batches(shard):
                names = batch.schema.names
                missing = [
                    c for c in ("seq_id", "anchor", "sample", *REPLAY_COLUMNS) if c not in names
                ]
                if missing:
                    raise OpdError(
                        f"{replays.ref} shard {shard!r} lacks columns {missing}; it has {names}"
                    )
                seq_ids += [str(s) for s in batch.column("seq_id").to_pylist()]
                anchors += batch.column("anchor").to_pylist()
                samples += batch.column("sample").to_pylist()
                # Replays cut at a drafted EOS (a decoder ends the block there) say so in `length`.
                if "length" in names:
                    lengths_given += batch.column("length").to_pylist()
                else:
                    lengths_given += [None] * batch.num_rows
                for name in REPLAY_COLUMNS:
                    cols[name].append(_fixed_width(batch, name))
        if not seq_ids:
            raise OpdError(f"{replays.ref} has no replay rows")
        self.tokens = torch.cat(cols["tokens"]).long()  # [R, K]
        self.accept_prob = torch.cat(cols["accept_prob"]).float()  # [R, K]
        self.teacher_hidden = torch.cat(cols["teacher_hidden"])  # [R, K, H]
        self.depth = self.tokens.shape[1]
        if self.depth < 1:
            raise OpdError(f"{replays.ref} holds replays of zero tokens")
        self.replay_length = torch.tensor(
            [self.depth if n is None else n for n in lengths_given], dtype=torch.long
        )  # [R]
        if ((self.replay_length < 1) | (self.replay_length > self.depth)).any():
            raise OpdError(f"{replays.ref}: a replay length lies outside [1, {self.depth}]")

        groups: dict[tuple[str, int], list[int]] = {}
        for r, (seq_id, sample) in enumerate(zip(seq_ids, samples, strict=True)):
            groups.setdefault((seq_id, int(sample)), []).append(r)
        self.items: list[tuple[int, np.ndarray, np.ndarray]] = []  # (feature row, replays, anchors)
        lengths, self.keys = [], []
        for (seq_id, sample), rows in groups.items():
            if seq_id not in feature_row:
                raise OpdError(
                    f"{replays.ref} replays sequence {seq_id!r}, which is not in {rollouts.ref}: "
                    "pass the rollouts the replays were scored on"
                )
            f = feature_row[seq_id]
            n = int(self.features.lengths[f])
            e = np.asarray([anchors[r] for r in rows], dtype=np.int64)
            bad = e[(e < 2) | (e > n)]
            if len(bad):
                raise OpdError(
                    f"{replays.ref}: sequence {seq_id!r} ({n} tokens) has anchors {bad.tolist()}; "
                    "an anchor e needs the drafter row e-2 and the token y_{e-1}, so 2 <= e <= "
                    f"{n}: the replays do not belong to this rollout"
                )
            if len(np.unique(e)) != len(e):
                raise OpdError(
                    f"{replays.ref}: sequence {seq_id!r} sample {sample} repeats an anchor; "
                    "each (sequence, anchor, sample) must be one replay row"
                )
            self.items.append((f, np.asarray(rows, dtype=np.int64), e))
            lengths.append(n if full_sequences else int(e.max()))
            self.keys.append(seq_id)
        self.lengths = np.asarray(lengths, dtype=np.int64)

    def __len__(self) -> int:
        return len(self.items)

    def collate(self, rows: list[int]) -> ReplayBatch:
        items = [self.items[i] for i in rows]
        feats = self.features.collate([f for f, _, _ in items])
        lengths = torch.from_numpy(self.lengths[np.asarray(rows)].copy())
        width = int(lengths.max())
        cols = {name: t[:, :width] for name, t in feats.columns.items()}
        ids = cols["input_ids"]
        item = torch.cat([torch.full((len(r),), b) for b, (_, r, _) in enumerate(items)])
        replay = torch.from_numpy(np.concatenate([r for _, r, _ in items]))
        anchor = torch.from_numpy(np.concatenate([e for _, _, e in items]))
        return ReplayBatch(
            aux_hidden=cols.get("aux_hidden"),  # None: online rollouts, `featurize` fills it
            input_ids=ids,
            loss_mask=cols["loss_mask"].bool(),
            last_hidden=cols.get("last_hidden"),
            lengths=lengths,
            item=item,
            anchor=anchor,
            tokens=self.tokens[replay],  # [N, K]
            accept_prob=self.accept_prob[replay],
            replay_length=self.replay_length[replay],
            teacher_hidden=self.teacher_hidden[replay],
            feature_rows=feats.rows,
        )

    def featurize(self, batch: ReplayBatch) -> ReplayBatch:
        """`batch` with its online rows' hidden states filled in: one target forward over the
        batch's token rows [B, T] (`FeatureIndex.featurize`), on the training thread."""
        rows = batch.feature_rows.numpy()
        if not self.features.online[rows].any():  # cached rollouts: nothing to compute
            return batch
        padded = training.PaddedBatch(
            {"input_ids": batch.input_ids},
            torch.from_numpy(self.features.lengths[rows]),
            batch.feature_rows,
        )
        states = self.features.featurize(padded).columns
        batch.aux_hidden, batch.last_hidden = states.get("aux_hidden"), states.get("last_hidden")
        return batch


def replay_outcomes(
    accept_prob: Tensor, length: Tensor, positions: str, generator: torch.Generator
) -> tuple[Tensor, Tensor]:
    """(accepted, mask) [N, K] bool. Acceptance is drawn from accept_prob (exact at 0 and 1);
    mask keeps the first `length` [N] positions (those a decoder would verify), and with
    positions="reached" only those verification reaches (every earlier one accepted)."""
    accepted = verify.draw_outcomes(accept_prob, generator)
    K = accept_prob.shape[1]
    mask = torch.arange(K, device=accept_prob.device) < length[:, None]
    if positions == "reached":
        mask &= verify.reach(accepted.long()).bool()
    return accepted, mask
