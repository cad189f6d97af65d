"""Stage 2, `features`: cache what the drafter trains on, one target forward per batch.

Consumes `trajectories` and the target. Produces `features`: Arrow IPC shards (uncompressed,
memory-mapped and zero-copy at read time), one row per sequence: seq_id, input_ids, loss_mask,
aux_hidden [T, 3H] (hidden_states at the low/mid/high layer ids) and last_hidden [T, H] (the
target's final post-norm state, from which training recomputes the teacher's distribution
through the frozen head), both bf16. Also `draft_vocab.safetensors`: the draft vocabulary map
(d2t, t2d, token counts) built once here from loss-masked token frequencies of the whole
trajectories dataset and never rebuilt downstream. The manifest's meta records the target's
identity, layer ids and dtype; consumers refuse features made by another target.

`mode=online` (unset = cached, the default: the versioned cache is the design) writes the same
shards without the two hidden-state columns, and the same vocab file: 5 bytes a token instead
of 5 + 8H (32 KiB at H = 4096). Its meta says `mode: online`, and the training stages (sft, and
opd's features anchor) then run the target over each batch inside their loop
(`training.FeatureIndex.featurize`), trading disk for one target forward per training batch
(and per validation batch). A drafter trained on it rolls out online too (rollout writes
tokens only; score and opd compute the states). The map stays frozen here, and lineage, checks
and chains read an online features dataset as any other.

Shard i (rows_per_shard trajectories, in trajectories order) is written by rank i % world_size.
Resumes: completed shards are skipped; the vocab file is deterministic and rewritten if absent.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
import pyarrow as pa
import torch
from pydantic import Field, field_validator
from safetensors.torch import save as save_safetensors
from tqdm import tqdm

from models.vocab import DraftVocab
from pipeline.core.checks import VOCAB_FILE, check_same_target
from pipeline.core.config import StrictConfig, optional_field
from pipeline.core.featurize import (
    ONLINE,
    feature_schema,
    length_batches,
    sequence_features,
    token_schema,
)
from pipeline.core.runner import RunContext
from pipeline.core.stage import Inputs, Stage
from storage import Dataset, DatasetWriter, OpdError, tensor_array


class Config(StrictConfig):
    draft_vocab_size: int = Field(4096, ge=2)
    """Top-N target tokens by loss-masked frequency that the drafter can propose; capped at the
    target's vocab size. Larger covers more of the target's mass but costs drafter head time."""
    batch_size: int = Field(8, ge=1)
    rows_per_shard: int = Field(256, ge=1)
    max_seq_len: int = Field(1024, ge=2)
    """Longer trajectories are truncated (features cost T x 4H x 2 bytes per sequence)."""
    mode: Literal["cached", "online"] | None = optional_field(
        "cached (unset): store the hidden states, the versioned cache; online: store only the "
        "tokens and the vocab map, and let sft/opd compute the hidden states in their training "
        "loop (one target forward per batch, for 8H bytes a token less on disk). Unset rather "
        "than 'cached' by default so existing features versions stay unchanged"
    )

    @field_validator("mode")
    @classmethod
    def _cached_is_unset(cls, value: str | None) -> str | None:
        # Naming the default explicitly must give the default's version.
        return None if value == "cached" else value


def token_counts(trajectories: Dataset, vocab_size: int) -> torch.Tensor:
    """Loss-masked token frequencies over every trajectory: int64 [V]."""
    import polars as pl

    counts = (
        trajectories.scan()
        .select(pl.col("input_ids"), pl.col("loss_mask"))
        .explode("input_ids", "loss_mask")
        .filter(pl.col("loss_mask") == 1)
        .group_by("input_ids")
        .len()
        .collect()
    )
    out = torch.zeros(vocab_size, dtype=torch.int64)
    ids = torch.from_numpy(counts["input_ids"].to_numpy().astype(np.int64))
    if len(ids) and int(ids.max()) >= vocab_size:
        raise OpdError(
            f"{trajectories.ref} holds token id {int(ids.max())} >= the target's vocab size "
            f"{vocab_size}: these trajectories come from another model"
        )
    out[ids] = torch.from_numpy(counts["len"].to_numpy().astype(np.int64))
    return out


def run(
    cfg: Config, inputs: Inputs, output: DatasetWriter, rank: int, world_size: int, ctx: RunContext
) -> dict:
    traj = inputs["trajectories"]
    target = ctx.target_loader.target
    check_same_target(traj, ctx.target_loader.identity)
    rows = traj.read_table().select(["seq_id", "input_ids", "loss_mask"]).to_pylist()
    if not rows:
        raise OpdError(f"{traj.ref} is empty: nothing to cache")
    counts = token_counts(traj, target.vocab_size)
    vocab = DraftVocab.from_counts(counts, min(cfg.draft_vocab_size, target.vocab_size))
    if not output.has_shard(VOCAB_FILE):
        output.write_bytes(
            VOCAB_FILE, save_safetensors({"d2t": vocab.d2t, "t2d": vocab.t2d, "counts": counts})
        )
    coverage = float(counts[vocab.t2d].sum()) / max(1, int(counts.sum()))

    online = cfg.mode == ONLINE
    schema = token_schema() if online else feature_schema(target.hidden_size)
    n_shards = (len(rows) + cfg.rows_per_shard - 1) // cfg.rows_per_shard
    mine = [i for i in range(n_shards) if i % world_size == rank]
    bar = tqdm(total=len(mine), desc="features", unit="shard", disable=not ctx.progress)
    for i in mine:
        shard = f"part-{i:05d}.arrow"
        if output.has_shard(shard):
            bar.update()
            continue
        chunk = rows[i * cfg.rows_per_shard : (i + 1) * cfg.rows_per_shard]
        for r in chunk:
            r["input_ids"] = r["input_ids"][: cfg.max_seq_len]
            r["loss_mask"] = r["loss_mask"][: cfg.max_seq_len]
        if online:  # the tokens only: training computes the hidden states
            output.write_ipc(shard, pa.Table.from_pylist(chunk, schema=schema))
            bar.update()
            continue
        seqs = [r["input_ids"] for r in chunk]
        aux_rows: list[torch.Tensor | None] = [None] * len(chunk)
        last_rows: list[torch.Tensor | None] = [None] * len(chunk)
        batches = length_batches([len(s) for s in seqs], cfg.batch_size)
        for j, aux, last in sequence_features(target, seqs, batches):
            aux_rows[j], last_rows[j] = aux, last
        table = pa.table(
            [
                pa.array([r["seq_id"] for r in chunk], pa.string()),
                pa.array([r["input_ids"] for r in chunk], pa.list_(pa.int32())),
                pa.array([r["loss_mask"] for r in chunk], pa.list_(pa.int8())),
                tensor_array(aux_rows, schema.field("aux_hidden")),
                tensor_array(last_rows, schema.field("last_hidden")),
            ],
            schema=schema,
        )
        output.write_ipc(shard, table)
        bar.update()
    bar.close()
    return {
        "target": ctx.target_loader.identity,
        "aux_layer_ids": list(target.aux_layer_ids),
        "hidden_size": target.hidden_size,
        "dtype": "bfloat16",
        "draft_vocab_size": int(vocab.t2d.sum()),
        "draft_vocab_coverage": round(coverage, 4),
        "sequences": len(rows),
        "tokens": int(sum(len(r["input_ids"]) for r in rows)),
    } | ({"mode": ONLINE, "trajectories": str(traj.ref)} if online else {})


STAGE = Stage(
    name="features",
    output="features",
    version="1",
    config=Config,
    run=run,
    doc="low/mid/high + last hidden states of the trajectories; the frozen draft-vocab map",
    inputs={"trajectories": ("trajectories",)},
    sharded=True,
)
