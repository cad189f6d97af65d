"""Stage 5, `score`: replay drafting from the rollout's error positions; the target scores it.

Consumes `rollouts` and a drafter (`sft` or `opd`), with the target. The drafter must be the one
that produced the rollout (its manifest's `drafter` input; on-policy data belongs to its drafter),
its draft-vocab map the rollout's (d2t/t2d are compared with the rollout's
`draft_vocab.safetensors`), and both must come from this target.

Anchors (per sequence): every verify step's first rejected position (`anchors="rejected"`),
plus accepted positions sampled so that their number is `accepted_share` x the number of
rejected anchors (stochastic rounding, without replacement, at most all accepted positions);
then, if `max_anchors_per_seq` is set and exceeded, a uniform sample of that many of the union.
A sequence without a rejection therefore gets no anchor, and a rollout without any rejection
(a drafter that was never wrong) gives an empty `replays` dataset, meta {"anchors": 0, ...},
with a clear log message. All sampling is seeded by (seed, seq_id): any sharding or resume
gives the same bytes.

Tree rollouts (`drafting.tree`) log every tree node; a position with a rejected node is one
where the drafter's most confident token there was wrong (siblings are tried in confidence
order), i.e. where its own chain would have failed, so the anchors are read the same way and
each replay is tree.depth tokens deep. The replays are chains on purpose: a tree step accepts
the chain's path whenever the top-1 token is right, and a better top-1 ranking is what lifts
every depth of the tree (docs/drafters.md: draft trees).

Replay of anchor e (sample j): the CURRENT drafter drafts y-hat_1..y-hat_K from the prefix y<e,
exactly as the decoder would: row e-2 reads the rollout's target feature f_{e-2} and y_{e-1},
then K-1 chain steps read only the drafter's own hidden states and tokens. All anchors and
samples of a sequence share ONE drafter pass over the prefix rows; their chains advance
together, one batched forward per step, each seeing the prefix rows <= e-2 and its own chain
keys through the attention mask (`Drafter.replay`); a DFlash drafter drafts every anchor's
block (at position e-1, over the context before it) in one forward. Then the target scores
every replayed token of the sequence in ONE tree-masked forward (`Target.score_tree`: the
sequence once plus E x n x K branch tokens), instead of one full-prefix forward per anchor.

Online rollouts (`features.mode=online`: features-*.arrow hold tokens only, meta `mode: online`)
carry no target features: score computes them (the states the drafter reads, rounded to bf16
as the cache stores them) in the batches a cached rollout would have (sorted by length,
`feature_batch_size` at a time, `featurize.FeatureSource.sequences`), one target forward per
batch that holds a replayed sequence, batches without one skipped. Same batches, same padded width, so
the replays are byte for byte those of the cached rollout; the cost is the rollout's own
featurizing forward, moved here (the meta's `online_features` counts them).

Output, per rollout shard i, `replays-{i:05d}.arrow` (Arrow IPC, one row per (sequence,
anchor, sample), in sequence, anchor, sample order; schema `replay_schema(H)`):
  seq_id, shard (the rollout features shard holding the sequence), row (its row in that shard),
  anchor (e), kind ("rejected" | "accepted": where the anchor came from), sample (j),
  tokens [K] int32 (y-hat, target ids), logq [K] float32 (log q(y-hat_k) under the drafter at
  the replay temperature; 0 at T=0, where q is one-hot), p_token [K] float32 (the target's
  p(y-hat_k) at the temperature; one-hot 1/0 at T=0), accept_prob [K] (min(1, p/q); 1/0 at T=0),
  reach_prob [K] (prod_{i<k} accept_prob_i), length (K, or up to and including the first
  drafted EOS: a decoder ends the block there, so later tokens are never verified),
  teacher_hidden [K, H] bf16 (the target's post-norm last hidden at the state predicting
  y-hat_k: softmax(lm_head(teacher_hidden_k) / T) is the target's FULL distribution there).
  It is kept in both modes: K x 2H bytes per replay row (anchor), not per sequence token.
Plus `draft_vocab.safetensors`, copied unchanged. Resumes: completed shards are skipped; a
shard's replays depend only on its rollout shard and the seeds (online: on the same batches
recomputed), so a resumed run writes the same bytes.

`source=logged` (it sets `rollout.keep_teacher`) keeps the blocks the rollout drafted instead of
drafting new ones: a replay is one verify step's block (chains and DFlash blocks; not trees),
anchor = the step's anchor (its first draft's position, so its context is y<anchor, as for a
replay), kind "rejected" for a step that rejected a draft and "accepted" for a step that
accepted its whole block (sampled by `accepted_share` as above), tokens / q / p / accept_prob
from the rejection log, length = the drafted block, and teacher_hidden from the verify forward
the rollout kept (`teacher-*.arrow`): that forward read the drafter's own proposals, so it is
the teacher at every drafted slot, the rejected ones included. No drafter or target forward
runs. It needs the rollout's temperature and K and one sample per anchor.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Mapping
from typing import Any, Literal

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.ipc as ipc
import torch
from pydantic import Field, field_validator, model_validator
from torch import Tensor
from tqdm import tqdm

from models import verify
from models.drafter import Drafter, TrainableDrafter, require
from models.features import Features
from models.target import Target
from pipeline.core.checks import (
    VOCAB_FILE,
    check_drafter_kind,
    check_drafter_vocab,
    check_made_by,
    check_same_target,
)
from pipeline.core.config import DraftTree, StrictConfig, optional_field
from pipeline.core.drafters import drafter_kind, load_drafter_dataset, refuse_untrained
from pipeline.core.featurize import FeatureSource, is_online
from pipeline.core.rollouts import shard_files, teacher_file
from pipeline.core.runner import RunContext
from pipeline.core.stage import DRAFTER_DATASETS, Inputs, Stage
from storage import (
    Dataset,
    DatasetWriter,
    OpdError,
    read_tensor_column,
    tensor_array,
    tensor_field,
)

log = logging.getLogger("opd")


class Config(StrictConfig):
    anchors: Literal["rejected"] = "rejected"
    """Where replays start: each verify step's first rejected position."""
    accepted_share: float = Field(0.1, ge=0)
    """Additional anchors from accepted positions, as a share of the rejected anchors."""
    max_anchors_per_seq: int | None = Field(None, ge=1)
    """Anchor budget per sequence (a uniform sample of the selected ones); None = all."""
    samples: int = Field(1, ge=1)
    """Replays per anchor; forced to 1 at temperature 0 (greedy replays are identical)."""
    k: int = Field(6, ge=1)
    """Replay depth: drafted tokens per replay; set through `drafting.k`."""
    tree: DraftTree | None = optional_field(
        "set through `drafting.tree`: the rollouts were decoded on trees, and replays are "
        "tree.depth tokens deep (the most a tree step accepts) instead of K"
    )
    temperature: float = Field(0.0, ge=0)
    """The serving temperature: drafts are sampled from q and scored against p at it."""
    seed: int = 0
    round: int = Field(1, ge=1)
    """Draft-OPD round; part of the version, so each round's replays are their own dataset."""
    source: Literal["replay", "logged"] | None = optional_field(
        "where replays come from: unset or replay, the drafter drafts again from every anchor "
        "and the target scores it; logged, the rollout's own blocks with its verify forward's "
        "teachers (see the module docstring)"
    )

    @field_validator("source")
    @classmethod
    def _replay_is_unset(cls, value: str | None) -> str | None:
        return None if value == "replay" else value  # the default and unset are one version

    @model_validator(mode="after")
    def _check_logged(self) -> Config:
        if self.source == "logged" and self.samples != 1:
            raise ValueError(
                f"score.samples={self.samples} replays each anchor {self.samples} times, but "
                "score.source=logged keeps the one block the rollout drafted: set score.samples=1"
            )
        if self.source == "logged" and self.tree is not None:
            raise ValueError(
                "score.source=logged reads chains and blocks; a tree's nodes are scored at their "
                "parents: drop drafting.tree or use score.source=replay"
            )
        return self

    @property
    def depth(self) -> int:
        """Tokens per replay: the tree's depth when decoding on trees, else K."""
        return self.k if self.tree is None else self.tree.depth

    @model_validator(mode="before")
    @classmethod
    def _greedy_single_sample(cls, data: Any) -> Any:
        if (
            isinstance(data, dict)
            and data.get("temperature", 0.0) == 0
            and data.get("samples", 1) != 1
        ):
            log.info("[score] temperature 0: greedy replays are identical; using samples=1")
            data = {**data, "samples": 1}
        return data


def replay_schema(hidden: int) -> pa.Schema:
    return pa.schema(
        [
            pa.field("seq_id", pa.string()),
            pa.field("shard", pa.string()),
            pa.field("row", pa.int32()),
            pa.field("anchor", pa.int32()),
            pa.field("kind", pa.string()),
            pa.field("sample", pa.int32()),
            pa.field("tokens", pa.list_(pa.int32())),
            pa.field("logq", pa.list_(pa.float32())),
            pa.field("p_token", pa.list_(pa.float32())),
            pa.field("accept_prob", pa.list_(pa.float32())),
            pa.field("reach_prob", pa.list_(pa.float32())),
            pa.field("length", pa.int32()),
            tensor_field("teacher_hidden", torch.bfloat16, hidden),
        ]
    )


# -- anchors and scoring -----------------------------------------------------------------------


def _seed_of(seed: int, seq_id: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{seq_id}".encode()).digest()[:8], "little") >> 1


def select_anchors(
    rejected: list[int], accepted: list[int], cfg: Config, rng: np.random.Generator
) -> list[tuple[int, str]]:
    """(position, kind) anchors of one sequence, sorted by position (see the module docstring)."""
    want = cfg.accepted_share * len(rejected)
    n_acc = min(int(want) + int(rng.random() < want - int(want)), len(accepted))
    extra = rng.choice(np.asarray(accepted, dtype=np.int64), n_acc, replace=False) if n_acc else []
    chosen = [(int(e), "rejected") for e in rejected] + [(int(e), "accepted") for e in extra]
    if cfg.max_anchors_per_seq is not None and len(chosen) > cfg.max_anchors_per_seq:
        keep = rng.choice(len(chosen), cfg.max_anchors_per_seq, replace=False)
        chosen = [chosen[i] for i in keep]
    return sorted(chosen)


def score_sequence(
    target: Target,
    drafter: TrainableDrafter,
    features: Features,
    anchors: list[int],
    cfg: Config,
    generator: torch.Generator,
) -> dict[str, Any]:
    """Replay every anchor x sample of one sequence (features: its ids [T] and the states the
    drafter reads, [T, F] aux and [T, H] last hidden) and score all of it in one target forward.

    Returns per replay (anchor-major, then sample): tokens, logq, p_token, accept_prob,
    reach_prob [R, K], length [R] and teacher_hidden [R, K, H] (bf16).
    """
    n = cfg.samples
    starts = torch.tensor(anchors, dtype=torch.long).repeat_interleave(n)  # [R]
    chains = drafter.replay(
        features, starts, cfg.depth, temperature=cfg.temperature, generator=generator
    )
    input_ids = features.ids.tolist()
    tokens = chains.tokens.to(target.device)  # [R, K]
    scores = target.score_tree(
        input_ids,
        [(int(e), tokens[c]) for c, e in enumerate(starts.tolist())],
        temperature=cfg.temperature or 1.0,
    )
    if cfg.temperature == 0:
        greedy = torch.stack([lp[:-1].argmax(-1) for lp in scores.log_probs])  # [R, K]
        p_token = verify.greedy_accept(tokens, greedy).float()
        accept = p_token
    else:
        log_p = torch.stack(scores.token_log_probs)  # [R, K]
        p_token = log_p.exp()
        accept = verify.accept_prob_of_logs(log_p, chains.logq.to(log_p.device))
    reach = verify.reach(accept)
    eos = torch.tensor(target.eos_token_ids, dtype=torch.long, device=tokens.device)
    is_eos = torch.isin(tokens, eos)
    first_eos = torch.where(is_eos.any(1), is_eos.long().argmax(1) + 1, cfg.depth)
    return {
        "tokens": tokens.cpu(),
        "logq": chains.logq.cpu(),
        "p_token": p_token.cpu(),
        "accept_prob": accept.cpu(),
        "reach_prob": reach.cpu(),
        "length": first_eos.cpu(),
        "teacher_hidden": torch.stack([h[:-1] for h in scores.hidden]).to(torch.bfloat16).cpu(),
    }


def _log_positions(rollouts: Dataset, shard: str) -> dict[str, tuple[list[int], list[int]]]:
    """seq_id -> (rejected positions, accepted positions) from one rejection-log shard."""
    df = (
        pl.read_parquet(rollouts.file(shard), columns=["seq_id", "position", "outcome"])
        .filter(pl.col("outcome") != "not_reached")
        .group_by("seq_id", "outcome")
        .agg(pl.col("position").unique().sort())
    )
    out: dict[str, tuple[list[int], list[int]]] = {}
    for seq_id, outcome, positions in df.iter_rows():
        rej, acc = out.setdefault(seq_id, ([], []))
        (rej if outcome == "rejected" else acc).extend(positions)
    # A tree step can reject a node and accept its sibling at one position: that position is
    # an error of the drafter's top choice, so it is a rejected anchor only (chains never
    # log a position twice).
    return {
        seq_id: (rej, [e for e in acc if e not in set(rej)]) for seq_id, (rej, acc) in out.items()
    }


def _sequence_anchors(
    rollouts: Dataset, rej_shard: str, seq_ids: list[str], cfg: Config
) -> list[list[tuple[int, str]]]:
    """Each sequence's (position, kind) anchors, in the shard's row order."""
    positions = _log_positions(rollouts, rej_shard)
    out = []
    for seq_id in seq_ids:
        rejected, accepted = positions.get(seq_id, ([], []))
        out.append(
            select_anchors(
                rejected, accepted, cfg, np.random.default_rng(_seed_of(cfg.seed, seq_id))
            )
        )
    return out


def score_shard(
    target: Target,
    drafter: Drafter,
    rollouts: Dataset,
    i: int,
    cfg: Config,
    on_sequences: Callable[[int], object] | None = None,
) -> tuple[pa.Table, int]:
    """All replays of rollout shard i, as one table of `replay_schema`, and the target
    forwards it ran to compute the sequences' features (0 when the rollout cached them).
    `on_sequences` gets counts of the shard's sequences as they are done (a progress bar's
    update): those with no anchor first, then each replayed one."""
    _, feat_shard, rej_shard, _ = shard_files(i)
    tokens = rollouts.read_ipc(feat_shard).select(["seq_id", "input_ids"])
    seq_ids = [str(s) for s in tokens.column("seq_id").to_pylist()]
    seqs = tokens.column("input_ids").to_pylist()
    anchors = _sequence_anchors(rollouts, rej_shard, seq_ids, cfg)
    wanted = {r for r, a in enumerate(anchors) if a}
    if on_sequences is not None:
        on_sequences(len(seqs) - len(wanted))
    source = FeatureSource.reading(target, drafter.reads)
    replays: dict[int, dict[str, Any]] = {}  # row -> its replays; scored in any row order
    for r, seq in source.sequences(rollouts, feat_shard, seqs, wanted):
        gen = torch.Generator(device=target.device).manual_seed(_seed_of(cfg.seed + 1, seq_ids[r]))
        replays[r] = score_sequence(target, drafter, seq, [e for e, _ in anchors[r]], cfg, gen)
        if on_sequences is not None:
            on_sequences(1)
    schema = replay_schema(target.hidden_size)
    cols: dict[str, list] = {name: [] for name in schema.names}
    for r in sorted(replays):  # written in sequence, anchor, sample order
        out, n = replays[r], len(anchors[r]) * cfg.samples
        cols["seq_id"] += [seq_ids[r]] * n
        cols["shard"] += [feat_shard] * n
        cols["row"] += [r] * n
        cols["anchor"] += [e for e, _ in anchors[r] for _ in range(cfg.samples)]
        cols["kind"] += [kind for _, kind in anchors[r] for _ in range(cfg.samples)]
        cols["sample"] += list(range(cfg.samples)) * len(anchors[r])
        for name in ("tokens", "logq", "p_token", "accept_prob", "reach_prob", "length"):
            cols[name] += out[name].tolist()
        cols["teacher_hidden"] += list(out["teacher_hidden"])
    return _replay_table(cols, schema), source.target_forwards


def _replay_table(cols: dict[str, list], schema: pa.Schema) -> pa.Table:
    arrays = [
        tensor_array(cols[f.name], f)
        if f.name == "teacher_hidden"
        else pa.array(cols[f.name], f.type)
        for f in schema
    ]
    return pa.table(arrays, schema=schema)


def logged_shard(rollouts: Dataset, i: int, cfg: Config, hidden: int) -> pa.Table:
    """Rollout shard i's own blocks as replays (`source=logged`), as one `replay_schema` table."""
    seq_shard, feat_shard, rej_shard, _ = shard_files(i)
    rows = {s: r for r, s in enumerate(pl.read_parquet(rollouts.file(seq_shard))["seq_id"])}
    blocks = (
        pl.read_parquet(
            rollouts.file(rej_shard),
            columns=["seq_id", "anchor", "offset", "token", "q", "p", "accept_prob", "outcome"],
        )
        .with_columns(pl.col("seq_id").replace_strict(rows, return_dtype=pl.Int64).alias("row"))
        .sort("row", "anchor", "offset")  # sequence, anchor order, as replays are written
        .group_by("seq_id", "anchor", maintain_order=True)
        .agg(
            pl.col("token", "q", "p", "accept_prob"),
            (pl.col("outcome") == "rejected").any().alias("rejected"),
        )
    )
    teacher = rollouts.read_ipc(teacher_file(i))
    values, offsets = read_tensor_column(
        teacher.column("teacher_hidden").combine_chunks(),
        teacher.schema.field("teacher_hidden"),
    )
    keys = zip(
        teacher.column("seq_id").to_pylist(), teacher.column("anchor").to_pylist(), strict=True
    )
    at = {key: r for r, key in enumerate(keys)}  # (seq_id, anchor) -> teacher row
    schema = replay_schema(hidden)
    cols: dict[str, list] = {name: [] for name in schema.names}
    K = cfg.depth
    for (seq_id,), seq_blocks in blocks.group_by("seq_id", maintain_order=True):
        by_anchor = {b["anchor"]: b for b in seq_blocks.iter_rows(named=True)}
        rejected = [a for a, b in by_anchor.items() if b["rejected"]]
        accepted = [a for a, b in by_anchor.items() if not b["rejected"]]
        rng = np.random.default_rng(_seed_of(cfg.seed, seq_id))
        for anchor, kind in select_anchors(rejected, accepted, cfg, rng):
            b = by_anchor[anchor]
            n = len(b["token"])
            pad = [0.0] * (K - n)
            accept = torch.tensor(b["accept_prob"] + pad)
            r = at[(seq_id, anchor)]
            cols["seq_id"].append(seq_id)
            cols["shard"].append(feat_shard)
            cols["row"].append(rows[seq_id])
            cols["anchor"].append(anchor)
            cols["kind"].append(kind)
            cols["sample"].append(0)
            cols["tokens"].append(b["token"] + [0] * (K - n))
            cols["logq"].append([float(np.log(q)) for q in b["q"]] + pad)
            cols["p_token"].append(b["p"] + pad)
            cols["accept_prob"].append(accept.tolist())
            cols["reach_prob"].append(
                torch.cumprod(torch.cat([torch.ones(1), accept[:-1]]), 0).tolist()
            )
            cols["length"].append(n)
            cols["teacher_hidden"].append(values[offsets[r] : offsets[r + 1]])
    return _replay_table(cols, schema)


def summarize(output: DatasetWriter, cfg: Config) -> dict[str, Any]:
    """Counts and mean acceptance per replay offset over every shard written (all ranks)."""
    kinds: list[str] = []
    accept: list[Tensor] = []
    for s in output.completed_shards():
        if not s["path"].startswith("replays-"):
            continue
        table = ipc.open_file(pa.memory_map(str(output.dir / s["path"]), "r")).read_all()
        kinds += table.column("kind").to_pylist()
        accept += [torch.tensor(a) for a in table.column("accept_prob").to_pylist()]
    meta: dict[str, Any] = {
        "source": cfg.source or "replay",
        "anchors": len(kinds) // cfg.samples,
        "replays": len(kinds),
        "rejected_anchors": kinds.count("rejected") // cfg.samples,
        "accepted_anchors": kinds.count("accepted") // cfg.samples,
        "k": cfg.depth,
        "samples": cfg.samples,
        "temperature": cfg.temperature,
        "round": cfg.round,
    }
    if accept:
        a = torch.stack(accept)  # [R, K]
        meta["accept_prob_by_offset"] = [round(float(x), 4) for x in a.mean(0)]
        meta["expected_accepted"] = round(float(torch.cumprod(a, 1).sum(1).mean()), 4)
    return meta


def precheck(cfg: Config, inputs: Mapping[str, Dataset], ctx: RunContext) -> None:
    """The rollouts come from this target and from the drafter (and kind) that replays them."""
    rollouts, drafter = inputs["rollouts"], inputs["drafter"]
    check_same_target(rollouts, ctx.target_loader.identity)
    refuse_untrained(drafter_kind(drafter), f"score (replaying {drafter.ref}'s drafts)")
    check_drafter_kind(rollouts, drafter_kind(drafter), str(drafter.ref))
    check_made_by(rollouts, drafter)
    if cfg.source == "logged":
        check_logged(cfg, rollouts)


def check_logged(cfg: Config, rollouts: Dataset) -> None:
    """`source=logged` takes the rollout's blocks as they are: they must carry their teachers
    and have been drafted at this temperature and K."""
    features = [s for s in rollouts.shards("ipc") if s.startswith("features-")]
    have = set(rollouts.shards())
    missing = [teacher_file(i) for i in range(len(features)) if teacher_file(i) not in have]
    if missing:
        raise OpdError(
            f"score.source=logged needs the verify forwards' teachers, but {rollouts.ref} has no "
            f"{missing[0]}: it was rolled out without rollout.keep_teacher; rerun the rollout "
            "with --set score.source=logged (which keeps them) or use score.source=replay"
        )
    for name, want in (("temperature", cfg.temperature), ("k", cfg.depth)):
        got = rollouts.meta.get(name)
        if got != want:
            raise OpdError(
                f"score.source=logged keeps the rollout's blocks as drafted, but {rollouts.ref} "
                f"was drafted with {name} {got} and score asks for {want}: set them equal"
            )


def run(
    cfg: Config, inputs: Inputs, output: DatasetWriter, rank: int, world_size: int, ctx: RunContext
) -> dict:
    rollouts, drafter_ds = inputs["rollouts"], inputs["drafter"]
    identity = ctx.target_loader.identity
    target = ctx.target_loader.target
    drafter = load_drafter_dataset(drafter_ds, target, identity).to(target.device)
    try:
        require(drafter, TrainableDrafter, "replay drafts for Draft-OPD")
    except ValueError as e:
        raise OpdError(f"{drafter_ds.ref}: {e}") from None
    check_drafter_vocab(rollouts, drafter, str(drafter_ds.ref))
    FeatureSource.reading(target, drafter.reads).check(rollouts)
    if rank == 0 and not output.has_shard(VOCAB_FILE):
        output.write_file(VOCAB_FILE, rollouts.file(VOCAB_FILE))

    n_shards = len([s for s in rollouts.shards("ipc") if s.startswith("features-")])
    mine = [i for i in range(n_shards) if i % world_size == rank]
    forwards = 0  # online rollouts: target forwards that computed their features, this rank
    # Counted in sequences, not shards: one shard of replays on a real target is many minutes.
    sizes = {i: rollouts.read_ipc(shard_files(i)[1]).num_rows for i in mine}
    bar = tqdm(total=sum(sizes.values()), desc="score", unit="seq", disable=not ctx.progress)
    for i in mine:
        name = f"replays-{i:05d}.arrow"
        if output.has_shard(name):
            bar.update(sizes[i])
            continue
        if cfg.source == "logged":
            output.write_ipc(name, logged_shard(rollouts, i, cfg, target.hidden_size))
            bar.update(sizes[i])
        else:
            table, n = score_shard(target, drafter, rollouts, i, cfg, bar.update)
            output.write_ipc(name, table)
            forwards += n
    bar.close()
    if rank != 0:
        return {}
    if world_size > 1:
        output.wait_for_ranks()
    meta = summarize(output, cfg)
    if is_online(rollouts) and cfg.source != "logged":
        meta["online_features"] = {
            "rollouts": str(rollouts.ref),
            "target_forwards_this_run": forwards,
        }
    if meta["anchors"] == 0:
        log.warning(
            "[score] %s has no rejected drafts: the drafter was never rejected, so there is "
            "nothing to replay; %s is an empty replays dataset (anchors: 0)",
            rollouts.ref,
            output.ref,
        )
    else:
        log.info(
            "[score] %d anchors (%d rejected, %d accepted) x %d samples, K=%d: %d replays",
            meta["anchors"],
            meta["rejected_anchors"],
            meta["accepted_anchors"],
            cfg.samples,
            cfg.depth,
            meta["replays"],
        )
    return meta | {
        "rollouts": str(rollouts.ref),
        "drafter": str(drafter_ds.ref),
        "rollout_drafter": rollouts.meta.get("drafter"),
        "drafter_kind": drafter.kind,
        "target": identity,
    }


STAGE = Stage(
    name="score",
    output="replays",
    version="1",
    config=Config,
    run=run,
    doc="replay drafting from the rollout's error positions; the target scores every proposal",
    inputs={"rollouts": ("rollouts",), "drafter": DRAFTER_DATASETS},
    default_inputs={"drafter": "sft@latest"},
    precheck=precheck,
    sharded=True,
    per_round=True,
    # A drafter the target never rejected leaves nothing to replay; opd then keeps it as is.
    may_be_empty=True,
    drafting={"k": "k", "tree": "tree"},
)
