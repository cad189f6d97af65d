"""Training rows and batches: `FeatureIndex` / `FeatureLoader` read rows of memory-mapped Arrow
IPC shards (ragged tensor and list columns, one row = one sequence), planned into padded
batches per epoch from a seed and striped over ranks, a background thread building the next
batches while the step runs; `holdout_split` and `nested_subset` pick rows by their names, not
by shard layout."""

from __future__ import annotations

import contextlib
import hashlib
import queue
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import torch
from torch import Tensor

from pipeline.core import featurize
from storage import Dataset, OpdError, read_tensor_column


@dataclass
class _Column:
    """One column of one record batch: values of all rows back to back, and row offsets."""

    values: Tensor  # [sum T, *trailing]
    offsets: np.ndarray  # int64 [R + 1]


def _ragged(batch: pa.RecordBatch, name: str) -> _Column:
    field = batch.schema.field(name)
    column = batch.column(name)
    if (field.metadata or {}).get(b"opd.dtype"):
        values, offsets = read_tensor_column(column, field)
        return _Column(values, np.asarray(offsets))
    if not pa.types.is_list(field.type) and not pa.types.is_large_list(field.type):
        raise OpdError(
            f"column {name!r} is {field.type}, not a per-token column (a list or tensor column)"
        )
    offsets = column.offsets.to_numpy().astype(np.int64)
    flat = column.values.to_numpy(zero_copy_only=False)[offsets[0] : offsets[-1]]
    with warnings.catch_warnings():
        # The mapped buffer is read-only; torch warns because it cannot enforce that.
        warnings.simplefilter("ignore", UserWarning)
        values = torch.from_numpy(flat)
    return _Column(values, offsets - offsets[0])


@dataclass
class PaddedBatch:
    """Right-padded rows: every column is [B, T, ...] with zeros past each row's length."""

    columns: dict[str, Tensor]
    lengths: Tensor  # [B] int64
    rows: Tensor  # [B] row ids in the FeatureIndex
    share: float = 1.0
    """This rank's share of the optimizer step's tokens (DDP weighs its loss by it); 0 for a
    stand-in row on a rank that a batch of fewer rows than ranks left without one."""

    def __getitem__(self, name: str) -> Tensor:
        return self.columns[name]

    def pin_memory(self) -> PaddedBatch:
        """A page-locked copy, so the host->GPU copy runs asynchronously (non_blocking)."""
        return PaddedBatch(
            {k: v.pin_memory() for k, v in self.columns.items()}, self.lengths, self.rows
        )

    @property
    def num_tokens(self) -> int:
        return int(self.lengths.sum())


class FeatureIndex:
    """Every row of one or more datasets' IPC shards, memory-mapped, for random access by row id.

    `columns` are per-token columns (list<int/float> or ragged tensor columns) that must have
    the same length in every row; `key_column` names rows for `holdout_split`. Several datasets
    are indexed one after the other (e.g. continued SFT on the original features plus fresh
    trajectories); equal keys across them land on the same side of a hold-out split.

    An online features dataset (`features.mode=online`) holds the token columns only: its rows'
    hidden states are computed by `source` (`featurize.FeatureSource`, which also refuses, up
    front, cached rows that lack a state it reads) in `featurize`, which the loader calls on
    the training thread for each batch it hands out (one target forward per batch). Indexing
    needs no target (lengths and keys are the token columns'); featurizing does.
    """

    def __init__(
        self,
        datasets: Dataset | Sequence[Dataset],
        columns: Sequence[str],
        key_column: str = "seq_id",
        *,
        source: featurize.FeatureSource | None = None,
    ):
        datasets = [datasets] if isinstance(datasets, Dataset) else list(datasets)
        self.columns = tuple(columns)
        self.source = source
        self._chunks: list[dict[str, _Column]] = []
        keys: list[str] = []
        chunk_of, local, lengths, online = [], [], [], []
        for dataset in datasets:
            shards = dataset.shards("ipc")
            if not shards:
                raise OpdError(f"{dataset.ref} has no Arrow IPC shards to train on")
            if source is not None:
                source.check(dataset)
            computed = featurize.HIDDEN_COLUMNS if featurize.is_online(dataset) else ()
            for shard in shards:
                for batch in dataset.ipc_batches(shard):
                    missing = [
                        c
                        for c in (*self.columns, key_column)
                        if c not in batch.schema.names and c not in computed
                    ]
                    if missing:
                        raise OpdError(
                            f"{dataset.ref} shard {shard!r} lacks columns {missing}; "
                            f"it has {batch.schema.names}"
                        )
                    cols = {
                        name: _ragged(batch, name)
                        for name in self.columns
                        if name in batch.schema.names
                    }
                    n = np.diff(next(iter(cols.values())).offsets)
                    for name, col in cols.items():
                        if not np.array_equal(np.diff(col.offsets), n):
                            raise OpdError(
                                f"{dataset.ref} shard {shard!r}: column {name!r} has other row "
                                f"lengths than {self.columns[0]!r}; the shard is malformed"
                            )
                    online.append(np.full(len(n), len(cols) < len(self.columns)))
                    chunk_of.append(np.full(len(n), len(self._chunks), np.int64))
                    local.append(np.arange(len(n), dtype=np.int64))
                    lengths.append(n)
                    keys += batch.column(key_column).to_pylist()
                    self._chunks.append(cols)
        self._chunk_of = np.concatenate(chunk_of)
        self._local = np.concatenate(local)
        self.lengths = np.concatenate(lengths)
        self.keys = [str(k) for k in keys]
        self.online = np.concatenate(online)  # [N] bool: hidden states computed by `featurize`

    def __len__(self) -> int:
        return len(self.lengths)

    def collate(self, rows: Sequence[int]) -> PaddedBatch:
        """Copy rows into fresh right-padded tensors (zero past each length)."""
        rows = np.asarray(rows, dtype=np.int64)
        lengths = self.lengths[rows]
        width = int(lengths.max())
        out: dict[str, Tensor] = {}
        for name in self.columns:
            proto = next((c[name].values for c in self._chunks if name in c), None)
            if proto is None:  # only online rows hold it: `featurize` makes the whole column
                continue
            # Token ids become int64 here, off the training thread, since embeddings need it.
            dtype = torch.int64 if proto.dtype == torch.int32 else proto.dtype
            out[name] = torch.zeros(len(rows), width, *proto.shape[1:], dtype=dtype)
        for i, row in enumerate(rows):
            chunk = self._chunks[self._chunk_of[row]]
            j = self._local[row]
            for name, col in chunk.items():
                out[name][i, : lengths[i]] = col.values[col.offsets[j] : col.offsets[j + 1]]
        return PaddedBatch(out, torch.from_numpy(lengths.copy()), torch.from_numpy(rows))

    def featurize(self, batch: PaddedBatch) -> PaddedBatch:
        """`batch` with the hidden states of its online rows filled in (in place): one target
        forward over those rows, padded to their longest. A no-op without online rows."""
        mine = np.flatnonzero(self.online[batch.rows.numpy()])
        if len(mine) == 0:
            return batch
        if self.source is None:
            raise OpdError(
                "an online features dataset needs the target to compute its hidden states; "
                "build the FeatureIndex with source= (a featurize.FeatureSource)"
            )
        ids = batch["input_ids"]
        seqs = [ids[i, : int(batch.lengths[i])].tolist() for i in mine]
        width = ids.shape[1]
        for name, values in self.source.padded(seqs, width).items():
            if name not in self.columns:
                continue
            if name not in batch.columns and len(mine) == len(batch.rows):
                batch.columns[name] = values
                continue
            column = batch.columns.setdefault(
                name, torch.zeros(len(batch.rows), width, values.shape[-1], dtype=values.dtype)
            )
            column[torch.from_numpy(mine)] = values
        return batch


def holdout_split(keys: Sequence[str], share: float, seed: int) -> tuple[list[int], list[int]]:
    """(train rows, validation rows): the `share` of rows whose keyed hash is smallest.

    Keyed by the row's name, so a row stays on its side however the shards are laid out.
    At least one row is held out when share > 0, and at least one is left to train on.
    """
    if not 0 <= share < 1:
        raise OpdError(f"validation share must be in [0, 1), got {share}")
    n = len(keys)
    n_val = 0 if share == 0 else max(1, round(share * n))
    if n_val >= n:
        raise OpdError(
            f"holding out {n_val} of {n} sequences leaves none to train on: "
            "lower the validation share or add data"
        )
    digest = [hashlib.sha256(f"{seed}:{k}".encode()).digest() for k in keys]
    order = sorted(range(n), key=digest.__getitem__)
    return sorted(order[n_val:]), sorted(order[:n_val])


def nested_subset(keys: Sequence[str], rows: Sequence[int], share: float, seed: int) -> list[int]:
    """The `share` of `rows` (at least one) whose keyed hash is smallest, sorted.

    Keyed by the row's name, as `holdout_split` is but under another key (so the subset is not
    the rows next to the validation split): a smaller share's rows are inside a larger one's.
    """
    if not 0 < share <= 1:
        raise OpdError(f"training share must be in (0, 1], got {share}")
    n = max(1, round(share * len(rows)))
    order = sorted(rows, key=lambda r: hashlib.sha256(f"{seed}:train:{keys[r]}".encode()).digest())
    return sorted(order[:n])


def plan_batches(
    lengths: np.ndarray,
    rows: Sequence[int],
    *,
    batch_size: int,
    max_tokens: int,
    seed: int,
    epoch: int,
    shuffle: bool,
    world_size: int,
    equal_ranks: bool = True,
) -> list[list[int]]:
    """The batches of one epoch, in order: the same for any `world_size`.

    A batch holds at most `batch_size` rows and `max_tokens` padded tokens (rows x longest
    row). Shuffled rows are sorted by length inside windows of 64 batches, so a batch holds
    similar lengths (little padding) while the data order stays random across windows. With
    `equal_ranks` (training) every batch is one optimizer step, split across the DDP ranks
    (`FeatureLoader`), so 1 and N processes follow the same schedule; without it (evaluation)
    rank r takes batches r, r + W, r + 2W, ...
    """
    rows = np.asarray(rows, dtype=np.int64)
    if len(rows) == 0:
        return []
    longest = int(lengths[rows].max())
    if longest > max_tokens:
        raise OpdError(
            f"a sequence has {longest} tokens but a batch may hold only {max_tokens}: "
            "raise max_tokens (or truncate sequences when caching features)"
        )
    gen = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    if shuffle:
        rows = rows[torch.randperm(len(rows), generator=gen).numpy()]
        window = batch_size * 64
        rows = np.concatenate(
            [
                w[np.argsort(lengths[w], kind="stable")]
                for w in np.split(rows, range(window, len(rows), window))
            ]
        )
    batches: list[list[int]] = []
    current: list[int] = []
    width = 0
    for r in rows.tolist():
        n = int(lengths[r])
        if current and (
            len(current) == batch_size or max(width, n) * (len(current) + 1) > max_tokens
        ):
            batches.append(current)
            current, width = [], 0
        current.append(r)
        width = max(width, n)
    batches.append(current)
    if shuffle:
        batches = [batches[i] for i in torch.randperm(len(batches), generator=gen).tolist()]
    if equal_ranks and len(rows) < world_size:
        raise OpdError(
            f"{len(rows)} training sequences cannot feed {world_size} ranks: "
            "add data or use fewer ranks"
        )
    return batches


_END = object()  # the producer's end-of-data marker


def epoch_position(epoch_len: Callable[[int], int], step: int) -> tuple[int, int]:
    """(epoch, batch index) of the `step`-th batch (from 0) when epochs 0, 1, ... run end to
    end and epoch e holds `epoch_len(e)` batches. Epochs may differ (`max_tokens` packs each
    epoch's shuffle into its own number of batches), so no step is found by divmod."""
    epoch = 0
    while step >= (n := epoch_len(epoch)):
        if n == 0:
            raise OpdError("an epoch of the training data holds no batch")
        step -= n
        epoch += 1
    return epoch, step


class FeatureLoader:
    """This rank's padded batches of one epoch, built ahead of time by a background thread.

    Each epoch's batch plan is a pure function of (seed, epoch), so a resumed run restarts at
    (epoch, batch index) and sees exactly the batches the interrupted run would have.
    `wait_seconds` accumulates the time the consumer spent blocked on the next batch.
    """

    def __init__(
        self,
        index: FeatureIndex,
        rows: Sequence[int],
        *,
        batch_size: int,
        max_tokens: int,
        seed: int = 0,
        shuffle: bool = True,
        rank: int = 0,
        world_size: int = 1,
        equal_ranks: bool = True,
        prefetch: int = 4,
        pin_memory: bool = False,
    ):
        if not 0 <= rank < world_size:
            raise OpdError(f"rank {rank} is not in [0, world_size={world_size})")
        if batch_size < 1 or max_tokens < 1 or prefetch < 1:
            raise OpdError("batch_size, max_tokens and prefetch must be >= 1")
        self.index = index
        self.rows = list(rows)
        self.batch_size, self.max_tokens = batch_size, max_tokens
        self.seed, self.shuffle = seed, shuffle
        self.rank, self.world_size, self.equal_ranks = rank, world_size, equal_ranks
        self.prefetch = prefetch
        # Pinned in the producer thread, off the training step's critical path.
        self.pin_memory = pin_memory
        self.wait_seconds = 0.0
        self._epoch_lens: dict[int, int] = {}
        self._len = self._epoch_len(0)

    def plan(self, epoch: int) -> list[list[int]]:
        """This rank's batches (row ids) of `epoch`."""
        return [rows for rows, _ in self._parts(epoch)]

    def _parts(self, epoch: int) -> list[tuple[list[int], float]]:
        """(row ids, share of the step's tokens) of this rank's batches of `epoch`.

        Training splits each planned batch across the ranks (rows r, r + W, ...; similar lengths
        sit side by side, so the shares come out even). A rank a short batch leaves empty runs
        its first row with share 0: DDP needs every rank in every step, the row adds nothing."""
        batches = plan_batches(
            self.index.lengths,
            self.rows,
            batch_size=self.batch_size,
            max_tokens=self.max_tokens,
            seed=self.seed,
            epoch=epoch,
            shuffle=self.shuffle,
            world_size=self.world_size,
            equal_ranks=self.equal_ranks,
        )
        if not self.equal_ranks:
            return [(b, 1.0) for b in batches[self.rank :: self.world_size]]
        parts = []
        for b in batches:
            mine = b[self.rank :: self.world_size]
            total = int(self.index.lengths[b].sum())
            share = int(self.index.lengths[mine].sum()) / total if mine else 0.0
            parts.append((mine or b[:1], share))
        return parts

    def __len__(self) -> int:
        """Batches of epoch 0 on this rank. Under `max_tokens` each epoch's shuffle packs into
        its own number of batches: find a step's batch with `position`, never by divmod."""
        return self._len

    def _epoch_len(self, epoch: int) -> int:
        if epoch not in self._epoch_lens:
            self._epoch_lens[epoch] = len(self._parts(epoch))
        return self._epoch_lens[epoch]

    def position(self, step: int) -> tuple[int, int]:
        """(epoch, batch index) of the `step`-th batch (from 0) when epochs run end to end."""
        return epoch_position(self._epoch_len, step)

    def iterate(
        self, epoch: int, start: int = 0, *, epochs: int | None = 1
    ) -> Iterator[PaddedBatch]:
        """Batches from batch `start` of `epoch` on, for `epochs` epochs (None = without end),
        prefetched across epoch boundaries. Close the iterator to stop early."""

        def plans() -> Iterator[tuple[list[int], float]]:
            e, first = epoch, start
            while epochs is None or e < epoch + epochs:
                yield from self._parts(e)[first:]
                e, first = e + 1, 0

        ready: queue.Queue = queue.Queue(maxsize=self.prefetch)
        stop = threading.Event()

        def put(item: object) -> None:
            while not stop.is_set():
                with contextlib.suppress(queue.Full):
                    ready.put(item, timeout=0.1)
                    return

        def produce() -> None:
            try:
                for rows, share in plans():
                    if stop.is_set():
                        return
                    batch = self.index.collate(rows)
                    if self.pin_memory:
                        batch = batch.pin_memory()
                    batch.share = share
                    put(batch)
                put(_END)
            except BaseException as e:  # handed to the consumer, which re-raises it
                put(e)

        worker = threading.Thread(target=produce, name="feature-loader", daemon=True)
        worker.start()
        try:
            while True:
                t0 = time.perf_counter()
                item = ready.get()
                self.wait_seconds += time.perf_counter() - t0
                if item is _END:
                    return
                if isinstance(item, BaseException):
                    raise item
                # Online features: the target's forward runs here, on the consuming (training)
                # thread, never in the producer: forward_features hooks the target's layers,
                # and two loaders' producers (training and validation) would share the hooks.
                featurize_batch = getattr(self.index, "featurize", None)
                yield featurize_batch(item) if featurize_batch is not None else item
        finally:
            stop.set()
            worker.join()
