"""Stage 4, `rollout`: target-assisted speculative decoding with the current drafter, logged.

Consumes `prompts` (one split) and a drafter (`sft` or `opd`), with the target. The target
verifies every block, so the sequences are the target's own (token for token its greedy output
at T=0) while the log records where the drafter failed. Produces `rollouts`, per shard i
(`rows_per_shard` prompts, in prompt order; written by rank i % world_size):

  sequences-{i:05d}.parquet   seq_id, prompt_id, input_ids (prompt + generated: exactly the
                              decoder's tokens), prompt_len, loss_mask (1 on generated tokens),
                              finish_reason (eos | length)
  features-{i:05d}.arrow      the `features` stage's schema (seq_id, input_ids, loss_mask and
                              the states the drafter's kind reads: aux_hidden [T, n*H] bf16,
                              last_hidden [T, H] bf16; Medusa's, last_hidden alone), one target
                              forward per `batch_size` sequences sorted by length, written by
                              `featurize.FeatureSource`, so sft/opd loaders read it unchanged;
                              online (below): the token columns only
  rejections-{i:05d}.parquet  the rejection log, one row per drafted token (REJECTIONS_SCHEMA;
                              one schema for every drafter kind, `drafter_kind` names it: a
                              DFlash block is logged as the chain the loop verified)
  steps-{i:05d}.parquet       one row per verify step: seq_id, step, anchor, drafted, accepted,
                              emitted
  teacher-{i:05d}.arrow       only with `keep_teacher` (chains and blocks): one row per verify
                              step, in steps' order: seq_id, step, anchor, teacher_hidden [K, H]
                              bf16, the verify forward's post-norm last hidden at the state
                              predicting each draft (zeros past the block). That forward already
                              read the drafter's own proposals, so these are the teachers of the
                              logged blocks as they were drafted (`score.source=logged` turns
                              them into replays with no further forward)

plus `draft_vocab.safetensors` copied unchanged from the drafter. Positions count from the first
prompt token: a step's `anchor` is the position of its first draft, a draft's `position` is
anchor + offset - 1. `confidence` is the drafter's max draft probability for that draft,
max_v q_v with q = softmax(logits / T) (T = 1 when decoding greedily, where q is one-hot), as
the decoder computed it when drafting. Acceptance by offset over the whole log is one polars query:

    pl.scan_parquet(ds.path / "rejections-*.parquet")
      .filter(pl.col("outcome") != "not_reached")
      .group_by("offset").agg((pl.col("outcome") == "accepted").mean()).sort("offset")

With `drafting.tree` set, rollout decodes on EAGLE-2 dynamic trees (models/chain_propose.py; the one loop in models/decoding.py verifies them)
and the rejection log has one row per tree node (TREE_REJECTIONS_SCHEMA: the chain columns plus
`node` and `parent`, 0 = the root). Per verify step it holds the accepted path (outcome
accepted, one node per depth: offset = depth, position = anchor + depth - 1) and the rejected
siblings (outcome rejected: children of the root or of a path node that the verifier tried
before the one it accepted, or all of them where the path ended), the untried nodes as
not_reached; `target_token` of a rejected node is what the target emitted at its position.
A position with a rejected node is one where the drafter's most confident token was wrong,
which is exactly the chain's error position, so `score` reads tree logs unchanged (see
docs/drafters.md: draft trees). `confidence` is max_v q_v at the node's parent. steps-*.parquet gains `depth` (the row's depth budget), and alpha is per depth.

`run` (the run name the runner was given, `--run-name`) is not part of the version: a dataset
reused by another run keeps the name of the run that computed it.

Online rollouts (`features.mode=online`): when the drafter trained on online feature rows (an
sft on an online features dataset, an opd on online rollouts; `featurize.trained_online`), or
`rollout.features=online` says so, features-*.arrow hold only seq_id, input_ids and loss_mask
(the online features dataset's `token_schema`, 5 bytes a token instead of 5 + 8H) and run no
featurizing forward; `score` computes the hidden states of the sequences it replays, in these
same batches, and opd's loaders those of each training batch. `rollout.features=cached`
keeps them for a drafter trained online; unset, the setting is in no version. The verify
forwards' teachers (`keep_teacher`) are per verify step, not per token, and stay as they are.

Manifest meta: tau (mean accepted + 1 per verify step), alpha per offset (acceptance given the
offset was reached; None where never reached), the target's identity, the drafter ref, round;
online also `mode: online` and `feature_batch_size` (the batches score featurizes in);
`hidden_states` when the features hold fewer than both states (`FeatureSource.meta`).
Resumes: shards whose four (five) files are complete are skipped; a shard's sampling seed depends only
on (seed, shard, batch), so any worker layout and any resume produce the same bytes; online or
cached is decided from the drafter's inputs and the config, the same on every resume.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Literal

import polars as pl
import pyarrow as pa
import torch
import torch.nn.functional as F
from pydantic import Field, field_validator, model_validator
from tqdm import tqdm

from models.decoding import depth_alpha
from models.drafter import Drafter
from models.target import Target
from pipeline.core.checks import VOCAB_FILE
from pipeline.core.config import DraftTree, StopConfidence, StrictConfig, optional_field
from pipeline.core.decoders import check_tree_setting, decoder
from pipeline.core.drafters import check_drafting_depth, load_drafter_dataset
from pipeline.core.featurize import ONLINE, FeatureSource, trained_online
from pipeline.core.prompt_sets import select_prompts
from pipeline.core.rollouts import TEACHER_FORMAT, shard_files, teacher_file
from pipeline.core.runner import RunContext
from pipeline.core.stage import DRAFTER_DATASETS, Inputs, Stage
from pipeline.core.trajectory_files import SEQUENCE_FIELDS
from storage import DatasetWriter, tensor_array, tensor_field

log = logging.getLogger("opd")

SEQUENCES_SCHEMA = pa.schema(SEQUENCE_FIELDS)
REJECTIONS_SCHEMA = pa.schema(
    [
        # the named run (`--run-name`) that computed these rows; a later run with the same
        # config reuses the dataset (its version leaves the name out), and `_runs/` says which
        # runs read it
        ("run", pa.string()),
        ("round", pa.int32()),
        ("drafter", pa.string()),  # the drafter dataset ref, e.g. sft@0123456789ab
        ("drafter_kind", pa.string()),  # eagle3 (chains, trees) | dflash (blocks)
        ("seq_id", pa.string()),
        ("step", pa.int32()),  # verify step of the sequence, 0-based
        ("anchor", pa.int32()),  # sequence position of the block's first draft
        ("offset", pa.int32()),  # 1-based place in the block
        ("position", pa.int32()),  # anchor + offset - 1: sequence position of this draft
        ("token", pa.int32()),  # the drafted target token id
        ("q", pa.float32()),  # draft probability of the token at the temperature (1 at T=0)
        ("p", pa.float32()),  # target probability at the temperature (one-hot at T=0)
        ("accept_prob", pa.float32()),  # min(1, p/q); 1/0 at T=0
        ("outcome", pa.string()),  # accepted | rejected | not_reached
        ("target_token", pa.int32()),  # what the target emitted there; -1 if not reached
        ("k", pa.int32()),
        ("temperature", pa.float32()),
        ("confidence", pa.float32()),  # max_v q_v (see the module docstring)
    ]
)
TREE_REJECTIONS_SCHEMA = pa.schema(
    [
        *REJECTIONS_SCHEMA,
        ("node", pa.int32()),  # 1-based index in the step's tree, parents before children
        ("parent", pa.int32()),  # the parent's node index, 0 = the root (last committed token)
    ]
)
STEPS_SCHEMA = pa.schema(
    [
        ("seq_id", pa.string()),
        ("step", pa.int32()),
        ("anchor", pa.int32()),
        ("drafted", pa.int32()),
        ("accepted", pa.int32()),
        ("emitted", pa.int32()),
    ]
)
TREE_STEPS_SCHEMA = pa.schema([*STEPS_SCHEMA, ("depth", pa.int32())])


class Config(StrictConfig):
    split: Literal["train", "heldout"] = "train"
    max_prompts: int | None = Field(None, ge=1)
    """Use N prompts of the split (None = all), after `skip_prompts`."""
    skip_prompts: int = Field(0, ge=0)
    """Prompts of the split to skip first. Set it to the `generate` stage's max_prompts to draft
    on contexts the SFT data never covered: at T=0 a rollout of an SFT prompt repeats its
    trajectory token for token (decoding is lossless), so it adds no new sequence."""
    new_prompts_each_round: bool = False
    """Round r skips another (r - 1) x max_prompts prompts, so every Draft-OPD round drafts on
    contexts no earlier round (or the SFT data, with skip_prompts) has seen."""
    k: int = Field(6, ge=1)
    """Drafted tokens per verify step; set through `drafting.k` (the K it will serve with)."""
    tree: DraftTree | None = optional_field("decode on draft trees; set through `drafting.tree`")
    stop_confidence: StopConfidence | None = optional_field(
        "stop a chain's drafting below this joint confidence: `drafting.stop_confidence`"
    )
    temperature: float = Field(0.0, ge=0.0)
    """Decoding temperature (0 = greedy); verify at the temperature the drafter will serve at."""
    max_new_tokens: int = Field(128, ge=1)
    batch_size: int = Field(8, ge=1)
    seed: int = 0
    round: int = Field(1, ge=1)
    """Draft-OPD round; part of the version, so each round's rollout is its own dataset."""
    rows_per_shard: int = Field(256, ge=1)
    keep_teacher: bool | None = optional_field(
        "also write the verify forwards' teachers (teacher-*.arrow); set by score.source=logged"
    )
    features: Literal["cached", "online"] | None = optional_field(
        "cached: features-*.arrow hold the sequences' hidden states; online: only their tokens "
        "(score and opd compute the states with the target). Unset: as the drafter's own "
        "training data (sft on an online features dataset, opd on online rollouts), so "
        "features.mode=online reaches every round with no other setting"
    )

    @model_validator(mode="after")
    def _check(self) -> Config:
        if self.new_prompts_each_round and self.max_prompts is None:
            raise ValueError("new_prompts_each_round needs max_prompts (the prompts per round)")
        if self.keep_teacher and self.tree is not None:
            raise ValueError(
                "rollout.keep_teacher keeps chains' and blocks' teachers; a draft tree's nodes "
                "are scored at their parents: drop drafting.tree or use score.source=replay"
            )
        return self

    @field_validator("keep_teacher")
    @classmethod
    def _off_is_unset(cls, value: bool | None) -> bool | None:
        return value or None  # off and unset are one version


def _seq_ids(prompts: list[dict]) -> list[str]:
    """`{prompt_id}-{n}`, n counting earlier rows with the same prompt_id: unique per dataset."""
    seen: dict[str, int] = {}
    out = []
    for p in prompts:
        n = seen.get(p["prompt_id"], 0)
        seen[p["prompt_id"]] = n + 1
        out.append(f"{p['prompt_id']}-{n}")
    return out


def _merge_columns(out: dict[str, list], cols: dict[str, list], rows: list[int]) -> None:
    """Append a batch's columnar log; its `sequence` (index into the batch) becomes a shard row."""
    for name, values in cols.items():
        if name == "sequence":
            values = [rows[v] for v in values]
        out.setdefault(name, []).extend(values)


def rollout_shard(
    target: Target,
    drafter: Drafter,
    chunk: list[dict],
    shard: int,
    cfg: Config,
    on_batch: Callable[[int], object] | None = None,
) -> dict[str, Any]:
    """Decode one shard's prompts; return its sequences and logs as columns. `on_batch` gets
    each decoded batch's sequence count (a progress bar's update)."""
    order = sorted(range(len(chunk)), key=lambda j: len(chunk[j]["prompt_ids"]))
    generated: list[list[int]] = [[] for _ in chunk]
    reasons = [""] * len(chunk)
    records: dict[str, list] = {}
    steps: dict[str, list] = {}
    teachers: list[torch.Tensor] = []
    for b in range(0, len(order), cfg.batch_size):
        idx = order[b : b + cfg.batch_size]
        seed = cfg.seed * 1_000_003 + shard * 1_009 + b
        decode = decoder(
            cfg.k,
            cfg.tree,
            cfg.temperature,
            cfg.max_new_tokens,
            seed,
            cfg.stop_confidence,
            keep_teacher=bool(cfg.keep_teacher),
        )
        res = decode(target, drafter, [list(chunk[j]["prompt_ids"]) for j in idx])
        for j, seq, why in zip(idx, res.sequences, res.finish_reasons, strict=True):
            generated[j], reasons[j] = seq, why
        _merge_columns(records, res.records, idx)
        _merge_columns(steps, res.steps, idx)
        if res.teacher is not None:  # [R, N, H], N < K when every row's block was shorter
            teachers.append(F.pad(res.teacher, (0, 0, 0, cfg.k - res.teacher.shape[1])))
        if on_batch is not None:
            on_batch(len(idx))
    sequences = [list(p["prompt_ids"]) + g for p, g in zip(chunk, generated, strict=True)]

    # Records come grouped by batch; the log is written per sequence, in step and offset order.
    n_rec = len(records.get("sequence", []))
    rec_order = sorted(
        range(n_rec),
        key=lambda r: (
            records["sequence"][r],
            records["step"][r],
            records["node" if cfg.tree else "offset"][r],
        ),
    )
    records = {name: [v[r] for r in rec_order] for name, v in records.items()}
    step_order = sorted(
        range(len(steps.get("sequence", []))),
        key=lambda r: (steps["sequence"][r], steps["step"][r]),
    )
    steps = {name: [v[r] for r in step_order] for name, v in steps.items()}
    teacher = torch.cat(teachers)[step_order] if teachers else None  # [steps, K, H]
    confidence = records.pop("confidence", [])
    return {
        "sequences": sequences,
        "generated": generated,
        "reasons": reasons,
        "records": records,
        "confidence": confidence,
        "steps": steps,
        "teacher": teacher,
    }


def shard_outputs(i: int, cfg: Config) -> list[str]:
    """The files shard i is complete with."""
    return [*shard_files(i), *([teacher_file(i)] if cfg.keep_teacher else [])]


def _write_shard(
    output: DatasetWriter,
    i: int,
    chunk: list[dict],
    seq_ids: list[str],
    out: dict,
    cfg: Config,
    run_name: str,
    drafter_ref: str,
    kind: str,
    features: FeatureSource,
) -> None:
    seq_file, feat_file, rej_file, steps_file = shard_files(i)
    masks = [
        [0] * len(p["prompt_ids"]) + [1] * len(g)
        for p, g in zip(chunk, out["generated"], strict=True)
    ]
    output.write_parquet(
        seq_file,
        pa.Table.from_pydict(
            {
                "seq_id": seq_ids,
                "prompt_id": [p["prompt_id"] for p in chunk],
                "input_ids": out["sequences"],
                "prompt_len": [len(p["prompt_ids"]) for p in chunk],
                "loss_mask": masks,
                "finish_reason": out["reasons"],
            },
            schema=SEQUENCES_SCHEMA,
        ),
    )
    # online: the tokens only; score and opd compute the states (in these batches, for score)
    rows = [
        {"seq_id": s, "input_ids": seq, "loss_mask": mask}
        for s, seq, mask in zip(seq_ids, out["sequences"], masks, strict=True)
    ]
    output.write_ipc(feat_file, features.table(rows, cfg.batch_size))
    rec = out["records"]
    n = len(rec.get("sequence", []))
    tree = {name: rec.get(name, []) for name in ("node", "parent")} if cfg.tree else {}
    output.write_parquet(
        rej_file,
        pa.Table.from_pydict(
            {
                "run": [run_name] * n,
                "round": [cfg.round] * n,
                "drafter": [drafter_ref] * n,
                "drafter_kind": [kind] * n,
                "seq_id": [seq_ids[s] for s in rec.get("sequence", [])],
                "step": rec.get("step", []),
                "anchor": rec.get("anchor", []),
                "offset": rec.get("offset", []),
                "position": [
                    a + o - 1
                    for a, o in zip(rec.get("anchor", []), rec.get("offset", []), strict=True)
                ],
                "token": rec.get("token", []),
                "q": rec.get("q", []),
                "p": rec.get("p", []),
                "accept_prob": rec.get("accept_prob", []),
                "outcome": rec.get("outcome", []),
                "target_token": rec.get("target_token", []),
                "k": [cfg.k] * n,
                "temperature": [cfg.temperature] * n,
                "confidence": out["confidence"],
                **tree,
            },
            schema=TREE_REJECTIONS_SCHEMA if cfg.tree else REJECTIONS_SCHEMA,
        ),
    )
    st = out["steps"]
    steps_schema = TREE_STEPS_SCHEMA if cfg.tree else STEPS_SCHEMA
    output.write_parquet(
        steps_file,
        pa.Table.from_pydict(
            {
                "seq_id": [seq_ids[s] for s in st.get("sequence", [])],
                **{name: st.get(name, []) for name in steps_schema.names[1:]},
            },
            schema=steps_schema,
        ),
    )
    if cfg.keep_teacher:
        _write_teacher(output, i, seq_ids, st, out["teacher"], features.target.hidden_size)


def _write_teacher(
    output: DatasetWriter,
    i: int,
    seq_ids: list[str],
    steps: dict[str, list],
    teacher: torch.Tensor | None,
    hidden: int,
) -> None:
    """Shard i's teachers, one row per verify step in `steps`' order."""
    schema = teacher_schema(hidden)
    rows = list(teacher) if steps.get("sequence") else []
    output.write_ipc(
        teacher_file(i),
        pa.table(
            [
                pa.array([seq_ids[s] for s in steps.get("sequence", [])], pa.string()),
                pa.array(steps.get("step", []), pa.int32()),
                pa.array(steps.get("anchor", []), pa.int32()),
                tensor_array(rows, schema.field("teacher_hidden")),
            ],
            schema=schema,
        ),
        fmt=TEACHER_FORMAT,
    )


def teacher_schema(hidden: int) -> pa.Schema:
    return pa.schema(
        [
            pa.field("seq_id", pa.string()),
            pa.field("step", pa.int32()),
            pa.field("anchor", pa.int32()),
            tensor_field("teacher_hidden", torch.bfloat16, hidden),
        ]
    )


def summarize(output: DatasetWriter, cfg: Config) -> dict:
    """tau and alpha per offset (per depth on trees) over every shard written so far (all ranks)."""
    files = [str(output.dir / s["path"]) for s in output.completed_shards()]
    steps = pl.read_parquet([f for f in files if "/steps-" in f])
    log_ = pl.scan_parquet([f for f in files if "/rejections-" in f])
    if cfg.tree is None:
        alpha = dict(
            log_.filter(pl.col("outcome") != "not_reached")
            .group_by("offset")
            .agg((pl.col("outcome") == "accepted").mean())
            .collect()
            .iter_rows()
        )
    else:  # per depth: with siblings, per-node rates are not acceptance rates
        by_depth = depth_alpha(
            steps["accepted"].to_torch(), steps["depth"].to_torch(), cfg.tree.depth
        )
        alpha = {d: a for d, a in enumerate(by_depth, start=1) if a == a}  # NaN: never reached
    counts = dict(log_.group_by("outcome").len().collect().iter_rows())
    seqs = pl.scan_parquet([f for f in files if "/sequences-" in f])
    totals = (
        seqs.select(
            pl.len().alias("sequences"),
            pl.col("input_ids").list.len().sum().alias("tokens"),
            (pl.col("input_ids").list.len() - pl.col("prompt_len")).sum().alias("generated_tokens"),
        )
        .collect()
        .row(0, named=True)
    )
    return {
        "tau": float((steps["accepted"] + 1).mean()) if steps.height else None,
        "alpha": [alpha.get(o) for o in range(1, (cfg.tree.depth if cfg.tree else cfg.k) + 1)],
        **({"tree": cfg.tree.model_dump()} if cfg.tree else {}),
        "verify_steps": steps.height,
        "drafted": sum(counts.values()),
        "accepted": counts.get("accepted", 0),
        "rejected": counts.get("rejected", 0),
        **{k: int(v) for k, v in totals.items()},
        "k": cfg.k,
        "temperature": cfg.temperature,
        "round": cfg.round,
        "split": cfg.split,
        "first_prompt": first_prompt(cfg),
    }


def first_prompt(cfg: Config) -> int:
    """Index in the split of this rollout's first prompt."""
    return cfg.skip_prompts + (
        (cfg.round - 1) * cfg.max_prompts if cfg.new_prompts_each_round else 0
    )


def run(
    cfg: Config, inputs: Inputs, output: DatasetWriter, rank: int, world_size: int, ctx: RunContext
) -> dict:
    prompts = select_prompts(
        inputs["prompts"], cfg.split, cfg.max_prompts, first_prompt(cfg)
    )  # refuses none
    drafter_ds = inputs["drafter"]
    target = ctx.target_loader.target
    identity = ctx.target_loader.identity
    check_tree_setting(target, cfg.tree, [p["prompt_ids"] for p in prompts], cfg.max_new_tokens)
    check_drafting_depth(drafter_ds, cfg.k if cfg.tree is None else cfg.tree.depth)
    drafter = load_drafter_dataset(drafter_ds, target, identity).to(target.device)
    online = cfg.features == ONLINE if cfg.features else trained_online(drafter_ds)
    features = FeatureSource.reading(target, drafter.reads, online=online)
    seq_ids = _seq_ids(prompts)
    if rank == 0 and not output.has_shard(VOCAB_FILE):
        output.write_file(VOCAB_FILE, drafter_ds.file(VOCAB_FILE))

    n_shards = (len(prompts) + cfg.rows_per_shard - 1) // cfg.rows_per_shard
    mine = [i for i in range(n_shards) if i % world_size == rank]
    # Counted in sequences, not shards: one shard of slow decoding (a real target on a CPU) is
    # many minutes.
    sizes = {i: len(prompts[i * cfg.rows_per_shard : (i + 1) * cfg.rows_per_shard]) for i in mine}
    bar = tqdm(total=sum(sizes.values()), desc="rollout", unit="seq", disable=not ctx.progress)
    for i in mine:
        if all(output.has_shard(f) for f in shard_outputs(i, cfg)):
            bar.update(sizes[i])
            continue
        lo, hi = i * cfg.rows_per_shard, (i + 1) * cfg.rows_per_shard
        out = rollout_shard(target, drafter, prompts[lo:hi], i, cfg, bar.update)
        _write_shard(
            output,
            i,
            prompts[lo:hi],
            seq_ids[lo:hi],
            out,
            cfg,
            ctx.run_name,
            str(drafter_ds.ref),
            drafter.kind,
            features,
        )
    bar.close()
    if rank != 0:
        return {}
    if world_size > 1:
        output.wait_for_ranks()
    meta = summarize(output, cfg)
    alpha = " ".join("-" if a is None else f"{a:.2f}" for a in meta["alpha"])
    log.info(
        "[rollout] %d sequences, tau=%s alpha=[%s], %d rejected of %d drafted",
        meta["sequences"],
        meta["tau"],
        alpha,
        meta["rejected"],
        meta["drafted"],
    )
    return (
        meta
        | {
            "target": identity,
            "drafter": str(drafter_ds.ref),
            "drafter_kind": drafter.kind,
            "shards": n_shards,
        }
        | features.meta()
        | ({"feature_batch_size": cfg.batch_size} if online else {})
    )


STAGE = Stage(
    name="rollout",
    output="rollouts",
    version="2",
    config=Config,
    run=run,
    doc="target-assisted speculative decoding with the drafter, with a rejection log",
    inputs={"prompts": ("prompts",), "drafter": DRAFTER_DATASETS},
    default_inputs={"drafter": "sft@latest"},
    sharded=True,
    per_round=True,
    drafting={"k": "k", "tree": "tree", "stop_confidence": "stop_confidence"},
)
