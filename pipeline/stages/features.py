"""Stage 2, `features`: cache what the drafter trains on, one target forward per batch.

Consumes `trajectories` and the target. Produces `features`: Arrow IPC shards (uncompressed,
memory-mapped and zero-copy at read time), one row per sequence: seq_id, input_ids, loss_mask
and the target's states the run's drafter kind reads (`hidden_states`, set from `drafter`:
`models.kind.Reads`), both bf16: aux_hidden [T, n*H] (hidden_states at the n aux layer ids;
EAGLE-3's low/mid/high, n = 3) and last_hidden [T, H] (the target's final post-norm state,
from which training recomputes the teacher's distribution through the frozen head); a Medusa
run stores last_hidden alone (2·H bytes a token instead of 8·H), and the meta's
`hidden_states` names what a dataset stores when it is not both. The rows are written by
`featurize.FeatureSource`, the one source every stage reads features through. Also `draft_vocab.safetensors`: the draft vocabulary map
(d2t, t2d, token counts) built once here from loss-masked token frequencies of the whole
trajectories dataset and never rebuilt downstream. With the optional `drafter` input (a drafter
to continue training on new trajectories, e.g. one imported with `opd data import-drafter`)
the map is that drafter's, copied byte for byte, so `sft --input drafter=...` accepts it. The
manifest's meta records the target's identity, layer ids and dtype; consumers refuse features
made by another target.

`mode=online` (unset = cached, the default: the versioned cache is the design) writes the same
shards without the hidden-state columns, and the same vocab file: 5 bytes a token instead
of 5 + 8H (32 KiB at H = 4096). Its meta says `mode: online`, and the training stages (sft, and
opd's features anchor) then run the target over each batch inside their loop
(`featurize.FeatureSource.padded`), trading disk for one target forward per training batch
(and per validation batch). A drafter trained on it rolls out online too (rollout writes
tokens only; score and opd compute the states). The map stays frozen here, and lineage, checks
and chains read an online features dataset as any other.

Shard i (rows_per_shard trajectories, in trajectories order) is written by rank i % world_size.
Resumes: completed shards are skipped; the vocab file is deterministic and rewritten if absent.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
import torch
from pydantic import Field, field_validator
from safetensors.torch import save as save_safetensors
from tqdm import tqdm

from models.vocab import DraftVocab
from pipeline.core.checks import VOCAB_FILE, check_same_target, vocab_of
from pipeline.core.config import StrictConfig, optional_field
from pipeline.core.featurize import HIDDEN_COLUMNS, ONLINE, FeatureSource, HiddenColumn
from pipeline.core.runner import RunContext
from pipeline.core.stage import DRAFTER_DATASETS, Inputs, Stage
from storage import Dataset, DatasetWriter, OpdError


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

    hidden_states: list[HiddenColumn] | None = optional_field(
        "the target's states stored: what the run's drafter kind reads (set from `drafter`, "
        "models.kind.Reads: [last_hidden] for Medusa). Unset: aux_hidden and last_hidden, what "
        "EAGLE-3 and DFlash read, so their features versions stay unchanged"
    )

    @field_validator("mode")
    @classmethod
    def _cached_is_unset(cls, value: str | None) -> str | None:
        # Naming the default explicitly must give the default's version.
        return None if value == "cached" else value

    @field_validator("hidden_states")
    @classmethod
    def _both_is_unset(cls, value: list[str] | None) -> list[str] | None:
        if value is None or set(value) == set(HIDDEN_COLUMNS):
            return None
        return [name for name in HIDDEN_COLUMNS if name in value]  # one order, one version


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
    if "drafter" in inputs:  # continuing a drafter: its map, frozen since its own features
        check_same_target(inputs["drafter"], ctx.target_loader.identity)
        theirs = vocab_of(inputs["drafter"])
        vocab = DraftVocab(theirs["d2t"], theirs["t2d"])
        if not output.has_shard(VOCAB_FILE):
            output.write_file(VOCAB_FILE, inputs["drafter"].file(VOCAB_FILE))
    else:
        vocab = DraftVocab.from_counts(counts, min(cfg.draft_vocab_size, target.vocab_size))
    if not output.has_shard(VOCAB_FILE):
        output.write_bytes(
            VOCAB_FILE, save_safetensors({"d2t": vocab.d2t, "t2d": vocab.t2d, "counts": counts})
        )
    coverage = float(counts[vocab.t2d].sum()) / max(1, int(counts.sum()))

    stored = HIDDEN_COLUMNS if cfg.hidden_states is None else cfg.hidden_states
    source = FeatureSource(target, stored, online=cfg.mode == ONLINE)
    n_shards = (len(rows) + cfg.rows_per_shard - 1) // cfg.rows_per_shard
    mine = [i for i in range(n_shards) if i % world_size == rank]
    for i in tqdm(mine, desc="features", unit="shard", disable=not ctx.progress):
        shard = f"part-{i:05d}.arrow"
        if output.has_shard(shard):
            continue
        chunk = rows[i * cfg.rows_per_shard : (i + 1) * cfg.rows_per_shard]
        for r in chunk:
            r["input_ids"] = r["input_ids"][: cfg.max_seq_len]
            r["loss_mask"] = r["loss_mask"][: cfg.max_seq_len]
        output.write_ipc(shard, source.table(chunk, cfg.batch_size))
    return {
        "target": ctx.target_loader.identity,
        "aux_layer_ids": list(target.aux_layer_ids),
        "hidden_size": target.hidden_size,
        "dtype": "bfloat16",
        "draft_vocab_size": int(vocab.t2d.sum()),
        "draft_vocab_coverage": round(coverage, 4),
        "sequences": len(rows),
        "tokens": int(sum(len(r["input_ids"]) for r in rows)),
        **source.meta(),
        **({"trajectories": str(traj.ref)} if source.online else {}),
    }


STAGE = Stage(
    name="features",
    output="features",
    version="1",
    config=Config,
    run=run,
    doc="the target's states the drafter kind reads (aux layers, last hidden) of the trajectories; the frozen draft-vocab map",
    inputs={"trajectories": ("trajectories",)},
    # a drafter to continue training on these trajectories: its vocab map instead of a new one
    optional_inputs={"drafter": DRAFTER_DATASETS},
    sharded=True,
)
