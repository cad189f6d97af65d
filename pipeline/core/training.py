"""Building blocks of the drafter-training stages (sft, opd): data, schedule, checkpoints, DDP, metrics.

- `FeatureIndex` / `FeatureLoader`: rows of memory-mapped Arrow IPC shards (ragged tensor and
  list columns, one row = one sequence), planned into padded batches per epoch from a seed and
  striped over ranks; a background thread builds the next batches while the step runs.
- `holdout_split`: a deterministic validation share, keyed by row name, not by shard layout.
- `adamw`, `WarmupCosine`: the optimizer and its linear warm-up + cosine learning-rate schedule.
- `Checkpointer`: weights, optimizer, scheduler, RNG and loop state as safetensors + JSON
  (never pickle), so a resumed run continues bit-for-bit where the saved one stopped.
- DDP and FSDP helpers that are no-ops in a single process (`torchrun` initialises
  torch.distributed).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import queue
import random
import shutil
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import torch
import torch.distributed as dist
from safetensors.torch import load as safetensors_load
from safetensors.torch import save as safetensors_save
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, distribute_tensor

from pipeline.core import featurize
from storage import Dataset, OpdError, disk_error, read_tensor_column

# -- distributed ---------------------------------------------------------------------------


def distributed() -> bool:
    """Whether torch.distributed is initialised (a `torchrun` launch), i.e. ranks must talk."""
    return dist.is_available() and dist.is_initialized()


def resolve_ranks(rank: int, world_size: int) -> tuple[int, int]:
    """(rank, world_size) of this process, checked against torch.distributed when it is up."""
    if distributed():
        actual = (dist.get_rank(), dist.get_world_size())
        if (rank, world_size) != actual:
            raise OpdError(
                f"the stage was given rank {rank} of {world_size} but torch.distributed says "
                f"rank {actual[0]} of {actual[1]}: pass the process group's rank and world size"
            )
        return actual
    if world_size > 1:
        raise OpdError(
            f"training with world_size={world_size} needs torch.distributed: launch the stage "
            "with `torchrun --nproc-per-node N` (or call dist.init_process_group first)"
        )
    return rank, world_size


def world_size() -> int:
    return dist.get_world_size() if distributed() else 1


def wrap_ddp(module: nn.Module) -> nn.Module:
    """DistributedDataParallel around `module` when several ranks train, else `module` itself."""
    if not distributed() or dist.get_world_size() == 1:
        return module
    device = next(module.parameters()).device
    ids = [device.index] if device.type == "cuda" else None
    return nn.parallel.DistributedDataParallel(module, device_ids=ids)


def shard_fsdp(module: nn.Module) -> nn.Module:
    """Shard `module`'s trainable parameters over the ranks (FSDP2 `fully_shard`, in place).

    Frozen parameters stay whole and untouched: the drafter's embedding IS the target's tensor
    (shared, never saved), and sharding it would detach it from the target."""
    from torch.distributed.fsdp import fully_shard

    frozen = {p for p in module.parameters() if not p.requires_grad}
    fully_shard(module, ignored_params=frozen)
    return module


def full_tensor(t: Tensor) -> Tensor:
    """`t` whole: gathered from every rank when FSDP shards it (a collective: every rank must
    call it, in the same order), else `t` itself."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def shard_like(full: Tensor, like: Tensor) -> Tensor:
    """`full` held as `like` is: this rank's FSDP shard of it when `like` is sharded (cut
    locally: every rank read the same whole tensor), else `full` itself."""
    if not isinstance(like, DTensor):
        return full
    return distribute_tensor(
        full.to(like.device), like.device_mesh, like.placements, src_data_rank=None
    )


def full_optimizer_state(state: Mapping[str, Any]) -> dict[str, Any]:
    """An optimizer's state_dict with every FSDP-sharded tensor gathered whole (a collective),
    so a checkpoint holds the same tensors whether or not training was sharded."""
    return {
        "state": {
            idx: {key: full_tensor(value) for key, value in entry.items()}
            for idx, entry in sorted(state["state"].items())
        },
        "param_groups": state["param_groups"],
    }


def all_reduce_sum(t: Tensor) -> Tensor:
    """Sum `t` over ranks in place (no-op in a single process); returns `t`."""
    if not distributed():
        return t
    if dist.get_backend() == "nccl" and t.device.type == "cpu":
        # NCCL reduces only GPU tensors; these sums are a handful of numbers
        on_gpu = t.to(torch.device("cuda", torch.cuda.current_device()))
        dist.all_reduce(on_gpu, op=dist.ReduceOp.SUM)
        return t.copy_(on_gpu)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def barrier() -> None:
    if distributed():
        dist.barrier()


# -- data ----------------------------------------------------------------------------------


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


# -- optimisation --------------------------------------------------------------------------


def adamw(
    model: nn.Module, *, lr: float, weight_decay: float, betas: tuple[float, float] = (0.9, 0.95)
) -> torch.optim.AdamW:
    """AdamW over the trainable parameters; norms and other 1-D parameters are not decayed."""
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    if not decay and not no_decay:
        raise OpdError("the model has no trainable parameters")
    groups = [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=lr, betas=betas)


class WarmupCosine:
    """Linear warm-up to each group's peak lr, then a cosine down to `min_lr_ratio` x peak.

    Optimizer step s (0-based) runs at peak x factor(s): (s + 1) / warmup during warm-up, then
    the cosine, reaching exactly the minimum at the last step. Call `step()` after each
    optimizer step. Its only state is the step count.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        total_steps: int,
        warmup_steps: int,
        min_lr_ratio: float,
    ):
        if total_steps < 1 or not 0 <= warmup_steps < max(total_steps, 2):
            raise OpdError(
                f"need total_steps >= 1 and 0 <= warmup_steps < total_steps, got "
                f"{total_steps} and {warmup_steps}"
            )
        if not 0 <= min_lr_ratio <= 1:
            raise OpdError(f"min_lr_ratio must be in [0, 1], got {min_lr_ratio}")
        self.optimizer = optimizer
        self.total_steps, self.warmup_steps, self.min_lr_ratio = (
            total_steps,
            warmup_steps,
            min_lr_ratio,
        )
        self.peaks = [group["lr"] for group in optimizer.param_groups]
        self.steps_done = 0
        self._apply()

    def factor(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        span = max(1, self.total_steps - 1 - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / span)
        return self.min_lr_ratio + (1 - self.min_lr_ratio) * 0.5 * (
            1 + math.cos(math.pi * progress)
        )

    def _apply(self) -> None:
        f = self.factor(self.steps_done)
        for group, peak in zip(self.optimizer.param_groups, self.peaks, strict=True):
            group["lr"] = peak * f

    def step(self) -> None:
        self.steps_done += 1
        self._apply()

    @property
    def lr(self) -> float:
        """The first group's current learning rate (what the next optimizer step uses)."""
        return self.optimizer.param_groups[0]["lr"]

    def state_dict(self) -> dict[str, Any]:
        return {"steps_done": self.steps_done, "peaks": list(self.peaks)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.steps_done = int(state["steps_done"])
        self.peaks = [float(p) for p in state["peaks"]]
        self._apply()


# -- checkpoints ---------------------------------------------------------------------------

_CKPT_TENSORS = "tensors.safetensors"
_CKPT_STATE = "state.json"
_CKPT_SUMS = "checksums.json"
_CKPT_FORMAT = 1
_log = logging.getLogger("opd")


@dataclass
class Checkpoint:
    """What `Checkpointer.load` returns; the optimizer/scheduler/RNG parts are restored by it."""

    step: int
    model: dict[str, Tensor]
    state: dict[str, Any]  # the caller's loop state (data position, metrics so far, ...)


def _rng_state() -> tuple[dict[str, Tensor], dict[str, Any]]:
    tensors = {"rng/torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"rng/cuda/{i}"] = s
    version, mt, gauss = random.getstate()
    return tensors, {"python": [version, list(mt), gauss]}


def _set_rng_state(tensors: Mapping[str, Tensor], state: Mapping[str, Any]) -> None:
    torch.set_rng_state(tensors["rng/torch"])
    cuda = sorted(
        (k for k in tensors if k.startswith("rng/cuda/")), key=lambda k: int(k.split("/")[-1])
    )
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([tensors[k] for k in cuda])
    version, mt, gauss = state["python"]
    random.setstate((version, tuple(mt), gauss))


def _optimizer_parts(sd: Mapping[str, Any]) -> tuple[dict[str, Tensor], dict[str, Any]]:
    tensors: dict[str, Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for idx, entry in sd["state"].items():
        for key, value in entry.items():
            if isinstance(value, Tensor):
                tensors[f"optim/{idx}/{key}"] = value.detach().contiguous()
            else:
                scalars.setdefault(str(idx), {})[key] = value
    return tensors, {"param_groups": sd["param_groups"], "scalars": scalars}


def _optimizer_state(
    tensors: Mapping[str, Tensor], parts: Mapping[str, Any], params: Sequence[Tensor]
) -> dict[str, Any]:
    """The optimizer's state_dict from a checkpoint; a moment of an FSDP-sharded parameter
    `params[i]` becomes this rank's shard of it, as the optimizer holds it."""
    state: dict[int, dict[str, Any]] = {}
    for name, t in tensors.items():
        if name.startswith("optim/"):
            _, idx, key = name.split("/", 2)
            param = params[int(idx)]
            if isinstance(param, DTensor) and t.shape == param.shape:  # not the scalar `step`
                t = shard_like(t, param)
            state.setdefault(int(idx), {})[key] = t
    for idx, entry in parts["scalars"].items():
        state.setdefault(int(idx), {}).update(entry)
    return {"state": state, "param_groups": parts["param_groups"]}


class Checkpointer:
    """Numbered checkpoints under `directory`: `step-00000120/` holding `tensors.safetensors`,
    `state.json` and `checksums.json` (the sha256 of the other two).

    Each is written into a hidden temporary directory, fsynced and renamed into place, so a kill
    at any moment leaves the previous checkpoints intact. The newest `keep` are kept. A
    checkpoint that fails its checksums is never resumed from: `latest()` sets it aside with a
    warning and offers the one before, so a flipped byte cannot be trained on and then rotate
    the good checkpoints out.
    """

    def __init__(self, directory: str | os.PathLike, keep: int = 2):
        if keep < 1:
            raise OpdError(f"keep must be >= 1, got {keep}")
        self.directory = Path(directory)
        self.keep = keep

    def _steps(self) -> list[int]:
        if not self.directory.is_dir():
            return []
        return sorted(
            int(p.name[5:])
            for p in self.directory.iterdir()
            if p.is_dir() and p.name.startswith("step-") and p.name[5:].isdigit()
        )

    def path(self, step: int) -> Path:
        return self.directory / f"step-{step:08d}"

    def latest(self) -> int | None:
        """The newest checkpoint whose files match their checksums, or None (a fresh start).

        One that fails is renamed to `.step-N.corrupt-PID` (kept for inspection; it goes with
        the work directory when the stage commits) and a warning names it."""
        for step in reversed(self._steps()):
            path = self.path(step)
            _, problem = self._read(path)
            if problem is None:
                return step
            aside = self.directory / f".{path.name}.corrupt-{os.getpid()}"
            shutil.rmtree(aside, ignore_errors=True)
            os.rename(path, aside)
            _log.warning(
                "checkpoint %s %s: set aside as %s; using the checkpoint before it, if any",
                path,
                problem,
                aside.name,
            )
        return None

    def _read(self, path: Path) -> tuple[dict[str, bytes], str | None]:
        """The checkpoint's files and what is wrong with them (None: all match their checksums)."""
        try:
            sums = json.loads((path / _CKPT_SUMS).read_bytes())
            files = {name: (path / name).read_bytes() for name in (_CKPT_TENSORS, _CKPT_STATE)}
        except (OSError, ValueError) as e:
            return {}, f"is unreadable ({e})"
        for name, data in files.items():
            if not isinstance(sums, dict) or sums.get(name) != hashlib.sha256(data).hexdigest():
                return files, f"is corrupted: {name} fails its sha256 check"
        return files, None

    def save(
        self,
        step: int,
        *,
        model: Mapping[str, Tensor],
        optimizer: torch.optim.Optimizer | Mapping[str, Any],
        scheduler: WarmupCosine,
        state: Mapping[str, Any],
    ) -> Path:
        """Write checkpoint `step`: model tensors, optimizer, scheduler, RNG and `state` (JSON).

        `optimizer` is the optimizer or its state_dict with whole tensors (under FSDP every rank
        gathers it, `full_optimizer_state`, and rank 0 saves: the files are the same either way)."""
        sd = optimizer.state_dict() if isinstance(optimizer, torch.optim.Optimizer) else optimizer
        optim_tensors, optim_parts = _optimizer_parts(sd)
        rng_tensors, rng_parts = _rng_state()
        tensors = {f"model/{k}": v.detach().contiguous() for k, v in model.items()}
        tensors |= optim_tensors | rng_tensors
        doc = {
            "format": _CKPT_FORMAT,
            "step": step,
            "optimizer": optim_parts,
            "scheduler": scheduler.state_dict(),
            "rng": rng_parts,
            "state": dict(state),
        }
        # Serialised in memory and written here: safetensors' own file writer reports no error
        # on a full disk, and the checksums must be of the bytes meant, not of what landed.
        files = {_CKPT_TENSORS: safetensors_save(tensors), _CKPT_STATE: json.dumps(doc).encode()}
        files[_CKPT_SUMS] = json.dumps(
            {name: hashlib.sha256(data).hexdigest() for name, data in files.items()}
        ).encode()
        final = self.path(step)
        tmp = self.directory / f".step-{step:08d}.tmp-{os.getpid()}"
        try:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            for name, data in files.items():
                with open(tmp / name, "wb") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
        except OSError as e:
            shutil.rmtree(tmp, ignore_errors=True)
            raise disk_error(
                e,
                f"checkpoint {final}",
                kept="earlier checkpoints are kept and a re-run resumes from the newest",
            ) from e
        for old in self._steps()[: -self.keep]:
            shutil.rmtree(self.path(old), ignore_errors=True)
        return final

    def load(
        self,
        step: int,
        *,
        optimizer: torch.optim.Optimizer,
        scheduler: WarmupCosine,
        restore_rng: bool = True,
    ) -> Checkpoint:
        """Restore optimizer, scheduler and RNG from checkpoint `step`; return its model and state."""
        path = self.path(step)
        files, problem = self._read(path)
        if problem is not None:
            raise OpdError(f"checkpoint {path} {problem}; delete it to resume from an earlier one")
        doc = json.loads(files[_CKPT_STATE])
        tensors = safetensors_load(files[_CKPT_TENSORS])
        if doc.get("format") != _CKPT_FORMAT:
            raise OpdError(
                f"checkpoint {path} has format {doc.get('format')}, expected {_CKPT_FORMAT}"
            )
        params = [p for group in optimizer.param_groups for p in group["params"]]
        optimizer.load_state_dict(_optimizer_state(tensors, doc["optimizer"], params))
        scheduler.load_state_dict(doc["scheduler"])
        if restore_rng:
            _set_rng_state(tensors, doc["rng"])
        model = {k[6:]: v for k, v in tensors.items() if k.startswith("model/")}
        return Checkpoint(step=doc["step"], model=model, state=doc["state"])

    def clear(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)


# -- validation metrics --------------------------------------------------------------------
