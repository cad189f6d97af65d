"""Stage `evaluate`: speculative decoding on held-out prompts; τ, n-α and wall-clock speed-up.

Consumes `prompts` (the held-out split by default) and a drafter (`sft` or `opd`), with the
target. Produces `eval`: `steps.parquet` (one row per verify step: sequence, step, anchor,
drafted, accepted, emitted), `drafts.parquet` (one row per drafted token: offset, token, q, p,
accept probability, outcome, the target's token) and, in the manifest's meta, the headline
numbers: τ (mean of accepted + 1 per verify step, the EAGLE/vLLM convention), α per offset
(acceptance given the offset was reached), target forwards per emitted token, and tokens/s of
speculative decoding against plain target decoding timed in the same run on the same prompts.
At T=0 it also checks that both decoders emitted identical tokens (`lossless_t0`), counts the
outputs that did (`t0_identical`) and records where each other one first differs, with the
target's top-2 logit gap there (`t0_mismatches`, earliest: `t0_first_divergence`): in bf16,
near-ties can flip between the batched verify forward and plain decoding (docs/drafters.md).

The training-free baseline: every evaluation also decodes the same prompts, in the same loop
and settings, with the registry's baseline kind (`KindSpec.baseline`: prompt lookup, which any
vLLM user can switch on for free) and records its τ, α, tokens/s and speed-up as
`free_baseline`, so a trained drafter is always read beside what needs no training. Its pass
times plain decoding batch by batch beside it, as the drafter's does: a speed-up over plain
decoding timed in another pass moved with the machine's load (1.03-1.50x for one lookup).
Its numbers depend on the prompts, the target and the decoding settings, never on the drafter,
so they are cached in `<root>/_baseline/<key>.json` (keyed by those and by this machine, as
wall-clock numbers belong to it): the evaluations of one run's sft and opd drafters decode it
once.

With `drafting.tree` set it decodes on EAGLE-2 dynamic trees (models/chain_propose.py; the one loop in models/decoding.py verifies them):
`drafts.parquet` then has one row per tree node (plus node, parent and confidence; offset is
the node's depth), `steps.parquet` the row's depth budget, and α is per depth (a step that
reached depth d-1 accepting a node at depth d), since siblings make per-draft rates moot.

With `backend=vllm` the drafter's export also runs inside vLLM on the same prompts, K and
temperature, adding `tau_vllm` (from vLLM's spec-decode counters) and, at T=0, `vllm_lossless`
and `vllm_matches_project` (see models/vllm_engine.measure_speculation); τ, α and the logs stay
the project decoder's, which records every draft.

Sharded under `opd run --nproc N` (or a Prefect fan-out): rank r decodes the r-th contiguous
run of whole batches, so each batch is decoded exactly as one process decodes it, and writes its
rows and sums into `ranks/R-of-N/` (kept for a re-run if another rank fails); rank 0 waits for
every rank, concatenates the rows in prompt order into the same two files one process writes,
computes every number from them (τ from all verify steps, never a mean of per-rank τs), drops
`ranks/` and commits one dataset: its rows, τ, α and `lossless_t0` equal one process's.
Tokens/s are per process (all ranks' tokens over their summed decoding seconds), so speed-up
compares both decoders on the same machines.

One process decodes in one pass (not resumable mid-way); wall-clock numbers vary between runs,
so re-running a version is skipped unless forced.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import polars as pl
import torch
from pydantic import Field, field_validator

from models import vllm_engine
from models.decoding import (
    depth_alpha,
    target_generate,
)
from models.drafter import Drafter, ServableDrafter
from models.vocab import DraftVocab
from pipeline.core.config import (
    DraftTree,
    StopConfidence,
    StrictConfig,
    TypicalAcceptance,
    optional_field,
    runtime_field,
    version_dict,
)
from pipeline.core.decoders import check_tree_setting, decoder
from pipeline.core.drafters import (
    baseline_kind,
    check_drafting_depth,
    load_drafter_dataset,
    needs_training,
)
from pipeline.core.runner import RunContext
from pipeline.core.stage import DRAFTER_DATASETS, HELDOUT_SETS, Inputs, Stage
from pipeline.core.targets import check_engine_target, resolve_dtype
from storage import Dataset, DatasetWriter, OpdError, canonical_json
from storage.jsonfile import UnreadableJson, read_json_object
from storage.layout import atomic_write_text

log = logging.getLogger("opd")


class Config(StrictConfig):
    split: Literal["train", "heldout"] = "heldout"
    max_prompts: int = Field(64, ge=1)
    skip_prompts: int | None = optional_field(
        "prompts of the split to skip first: measures a recipe chosen on the first prompts on "
        "others, which nothing was tuned or validated on"
    )
    k: int = Field(6, ge=1)
    """Drafted tokens per verify step; set through `drafting.k`."""
    tree: DraftTree | None = optional_field("decode on draft trees; set through `drafting.tree`")
    stop_confidence: StopConfidence | None = optional_field(
        "stop a chain's drafting below this joint confidence: `drafting.stop_confidence`"
    )
    acceptance: Literal["lossless", "typical"] | None = optional_field(
        "lossless (unset) or typical, Medusa's lossy rule: set through `drafting.acceptance`"
    )
    typical: TypicalAcceptance | None = optional_field(
        "typical acceptance's thresholds: set through `drafting.typical`"
    )
    temperature: float = Field(0.0, ge=0.0)
    max_new_tokens: int = Field(128, ge=1)
    batch_size: int = Field(1, ge=1)
    """1 = the latency setting in which EAGLE and vLLM report speed-ups; larger batches
    finish faster on CPU but hide the per-sequence speed-up."""
    seed: int = 0
    measure_baseline: bool = runtime_field(True, "time plain target decoding for the speed-up")
    backend: Literal["hf", "vllm"] = "hf"
    """`vllm`: also measure the exported drafter inside vLLM (needs the `vllm` extra)."""
    untrained_contrast: bool = True
    """Also measure a freshly initialised drafter (same config and vocab map) on the same
    prompts, so τ is read against what training bought."""
    free_baseline: bool = runtime_field(
        True,
        "also measure the training-free baseline kind (prompt lookup) on the same prompts, "
        "cached per prompts, target, settings and machine (module docstring)",
    )

    @field_validator("skip_prompts")
    @classmethod
    def _skip_not_negative(cls, v: int | None) -> int | None:
        if v is not None and v < 0:
            raise ValueError(f"skip_prompts counts prompts to skip: give 0 or more, not {v}")
        return v


def prompt_sets(prompts: Dataset, cfg: Config) -> tuple[list[list[int]], list[str]]:
    """The prompts to decode and the held-out set each belongs to. Prompts made with
    `heldout_sets` give max_prompts (after skip_prompts) of EACH set, so every benchmark is
    measured; other prompts give the split's first max_prompts, all in set "all"."""
    sets = prompts.meta.get(HELDOUT_SETS) if cfg.split == "heldout" else None
    rows = prompts.scan().filter(pl.col("split") == cfg.split)
    if sets:
        name = pl.col("source").str.split(":").list.first()
        picked = [
            rows.filter(name == s).slice(cfg.skip_prompts or 0, cfg.max_prompts).collect()
            for s in sets
        ]
        table = pl.concat(picked)
        labels = [s for s, part in zip(sets, picked, strict=True) for _ in range(part.height)]
    else:
        table = rows.slice(cfg.skip_prompts or 0, cfg.max_prompts).collect()
        labels = ["all"] * table.height
    if not table.height and cfg.skip_prompts:
        raise OpdError(
            f"{prompts.ref} has no {cfg.split!r} prompts after skipping {cfg.skip_prompts} to "
            "evaluate on: lower evaluate.skip_prompts"
        )
    if not table.height:
        raise OpdError(f"{prompts.ref} has no {cfg.split!r} prompts to evaluate on")
    return table["prompt_ids"].to_list(), labels


def prompt_ids(prompts: Dataset, cfg: Config) -> list[list[int]]:
    return prompt_sets(prompts, cfg)[0]


def per_set(steps: pl.DataFrame, labels: list[str]) -> dict[str, dict[str, float]]:
    """τ and prompts per held-out set, from the verify steps' sequence ids."""
    sets = pl.DataFrame({"sequence": range(len(labels)), "set": labels})
    sequence = steps["sequence"]
    table = steps.join(sets.cast({"sequence": sequence.dtype}), on="sequence")
    by_set = table.group_by("set").agg(
        (pl.col("accepted") + 1).mean().alias("tau"),
        pl.col("sequence").n_unique().alias("prompts"),
    )
    return {
        r["set"]: {"tau": r["tau"], "prompts": r["prompts"]} for r in by_set.sort("set").to_dicts()
    }


def divergence(target, prompt: list[int], spec: list[int], base: list[int]) -> dict:
    """Where two greedy continuations first differ, and the target's top-2 logit gap there."""
    at = next(
        (i for i, (x, y) in enumerate(zip(spec, base, strict=False)) if x != y),
        min(len(spec), len(base)),
    )
    ids = torch.tensor([prompt + base[:at]], device=target.device)
    top2 = target(ids).logits[0, -1].float().topk(2).values
    return {"position": at, "top2_logit_gap": float(top2[0] - top2[1])}


@dataclass
class Decoded:
    """One share of the prompts decoded: its rows (sequence = index among all the prompts) and
    the sums every number is computed from."""

    steps: pl.DataFrame
    drafts: pl.DataFrame
    sums: dict[str, float] = field(default_factory=dict)  # seconds and tokens of both decoders
    mismatches: list[dict] = field(default_factory=list)  # T=0: where spec and plain differ
    sequences: list[list[int]] = field(default_factory=list)

    @staticmethod
    def concat(parts: list[Decoded]) -> Decoded:
        """The shares, in prompt order, as one."""
        sums: dict[str, float] = {}
        for part in parts:
            for key, value in part.sums.items():
                sums[key] = sums.get(key, 0) + value
        return Decoded(
            pl.concat([p.steps for p in parts if p.steps.height]),
            pl.concat([p.drafts for p in parts if p.drafts.height]),
            sums,
            [m for p in parts for m in p.mismatches],
            [s for p in parts for s in p.sequences],
        )


def evaluate(
    target,
    drafter,
    prompts: list[list[int]],
    cfg: Config,
    progress: bool = False,
    *,
    first: int = 0,
    desc: str = "evaluate",
) -> Decoded:
    """Run both decoders over `prompts` (prompts `first`.. of the evaluation) in batches,
    under a progress bar named `desc` when `progress`."""
    from tqdm import tqdm

    decode = decoder(
        cfg.k,
        cfg.tree,
        cfg.temperature,
        cfg.max_new_tokens,
        cfg.seed,
        cfg.stop_confidence,
        typical=typical_rule(cfg),
    )
    records: dict[str, list] = {}
    steps: dict[str, list] = {}
    out = Decoded(pl.DataFrame(), pl.DataFrame())
    sums = dict.fromkeys(("spec_tokens", "spec_s", "target_s", "drafter_s"), 0.0)
    if cfg.measure_baseline:
        sums |= {"base_tokens": 0.0, "base_s": 0.0}
    for b in tqdm(range(0, len(prompts), cfg.batch_size), desc=desc, disable=not progress):
        batch = prompts[b : b + cfg.batch_size]
        t0 = time.perf_counter()
        res = decode(target, drafter, batch)
        sums["spec_s"] += time.perf_counter() - t0
        sums["spec_tokens"] += sum(len(s) for s in res.sequences)
        out.sequences += res.sequences
        sums["target_s"] += res.stats["target_forward_seconds"]
        sums["drafter_s"] += res.stats["drafter_forward_seconds"]
        # a chain's drafts.parquet leaves the drafter's confidence out: a raw float of the
        # drafter's forward, its last digits differ between thread counts, and the rows are
        # byte-identical for any number of evaluate processes (trees always logged it)
        chain_records = {k: v for k, v in res.records.items() if k != "confidence"}
        for cols, into in (
            (chain_records if cfg.tree is None else res.records, records),
            (res.steps, steps),
        ):
            for key, values in cols.items():
                if key == "sequence":
                    values = [v + first + b for v in values]
                into.setdefault(key, []).extend(values)
        if cfg.measure_baseline:
            t0 = time.perf_counter()
            base = target_generate(target, batch, cfg.max_new_tokens, cfg.temperature, cfg.seed)
            sums["base_s"] += time.perf_counter() - t0
            sums["base_tokens"] += sum(len(s) for s in base.sequences)
            if cfg.temperature == 0:
                pairs = zip(res.sequences, base.sequences, strict=True)
                for i, (spec, plain) in enumerate(pairs):
                    if spec != plain:
                        where = divergence(target, batch[i], spec, plain)
                        out.mismatches.append(where | {"prompt": first + b + i})
    out.steps, out.drafts, out.sums = pl.DataFrame(steps), pl.DataFrame(records), sums
    return out


def typical_rule(cfg: Config) -> TypicalAcceptance | None:
    """The typical-acceptance thresholds when `drafting.acceptance=typical`, else None."""
    return (cfg.typical or TypicalAcceptance()) if cfg.acceptance == "typical" else None


def lossy(cfg: Config) -> bool:
    """Whether this evaluation's output leaves the target's law (typical acceptance at T>0)."""
    return cfg.acceptance == "typical" and cfg.temperature > 0


def summarize(out: Decoded, cfg: Config, prompts: int) -> dict[str, Any]:
    """The headline numbers of all the prompts' rows and sums."""
    step_df, draft_df, sums = out.steps, out.drafts, out.sums
    tau = float((step_df["accepted"] + 1).mean())
    reached: list[int] | None = None
    if cfg.tree is None:
        by_offset = (
            draft_df.filter(pl.col("outcome") != "not_reached")
            .group_by("offset")
            .agg((pl.col("outcome") == "accepted").mean().alias("alpha"), pl.len().alias("n"))
            .sort("offset")
        )
        alpha, reached = by_offset["alpha"].to_list(), by_offset["n"].to_list()
    else:
        alpha = depth_alpha(
            step_df["accepted"].to_torch(), step_df["depth"].to_torch(), cfg.tree.depth
        )
    stats = {
        "tau": tau,
        "alpha": alpha,
        # late offsets are reached by few drafts (a run of predictable text reaches them whole),
        # so their alpha can read 1.00 over a dozen drafts: the counts say how much it weighs
        **({"alpha_reached": reached} if reached is not None else {}),
        "k": cfg.k,
        **({"stop_confidence": cfg.stop_confidence} if cfg.stop_confidence is not None else {}),
        **({"tree": cfg.tree.model_dump()} if cfg.tree else {}),
        "temperature": cfg.temperature,
        **(
            {"acceptance": "typical", "lossless": False, **typical_rule(cfg).model_dump()}
            if lossy(cfg)
            else {}
        ),
        "prompts": prompts,
        "verify_steps": step_df.height,
        "emitted_tokens": int(step_df["emitted"].sum()),
        "target_forwards_per_token": step_df.height / max(1, int(step_df["emitted"].sum())),
        "tokens_per_s": sums["spec_tokens"] / sums["spec_s"],
        "decode_overhead_share": 1 - (sums["target_s"] + sums["drafter_s"]) / sums["spec_s"],
    }
    if cfg.measure_baseline:
        stats["baseline_tokens_per_s"] = sums["base_tokens"] / sums["base_s"]
        stats["speedup"] = stats["tokens_per_s"] / stats["baseline_tokens_per_s"]
        if cfg.temperature == 0:
            stats["lossless_t0"] = not out.mismatches
            # Batched and single-row float math can order two near-equal logits differently (in
            # bf16 often, docs/drafters.md); the target's top-2 gap at each first divergence
            # tells such a tie from a real bug.
            stats["t0_mismatches"] = out.mismatches
            stats["t0_identical"] = prompts - len(out.mismatches)
            stats["t0_first_divergence"] = min(
                (m["position"] for m in out.mismatches), default=None
            )
    return stats


SHOWN_MISMATCHES = 5  # the rest are in the manifest's t0_mismatches


def identity_line(stats: dict[str, Any]) -> str:
    """How many T=0 outputs equal plain greedy decoding, and where the others first differ."""
    line = f"T=0: {stats['t0_identical']} of {stats['prompts']} outputs identical to plain greedy"
    shown = stats["t0_mismatches"][:SHOWN_MISMATCHES]
    if shown:
        where = ", ".join(
            f"prompt {m['prompt']} at token {m['position']} (top-2 logit gap "
            f"{m['top2_logit_gap']:.3g})"
            for m in shown
        )
        more = len(stats["t0_mismatches"]) - len(shown)
        line += f"; first divergences: {where}" + (f" and {more} more" if more else "")
    return line


def baseline_line(free: dict[str, Any]) -> str:
    """The free baseline's numbers as one line (the log's and `opd eval`'s)."""
    speed = f", {free['speedup']:.2f}x plain decoding" if "speedup" in free else ""
    return (
        f"{free['title']} (needs no training) on the same prompts: tau={free['tau']:.3f}{speed}"
        + (" (cached)" if "cached" in free else "")
    )


# vLLM and this project decode the same way at T=0; past this relative gap τ is worth a look.
TAU_VLLM_TOLERANCE = 0.10


def vllm_stats(
    cfg: Config,
    drafter: Dataset,
    method: str,
    ctx: RunContext,
    prompts: list[list[int]],
    sequences: list[list[int]],
    tau: float,
    engine_log: Path | None = None,
) -> dict:
    """The drafter's export run inside vLLM (see `Config.backend`; vLLM's own output to
    `engine_log`), with a note when its τ differs from the project decoder's by more than
    TAU_VLLM_TOLERANCE."""
    from pipeline.core.export import ensure_export

    loader = ctx.target_loader
    try:
        stats = vllm_engine.measure_speculation(
            vllm_engine.EngineSpec(str(loader.directory), resolve_dtype(loader.cfg), seed=cfg.seed),
            str(ensure_export(drafter, loader, ctx.store.root, cfg.k)),
            cfg.k,
            prompts,
            method=method,
            max_new_tokens=cfg.max_new_tokens,
            temperature=cfg.temperature,
            seed=cfg.seed,
            stop_ids=loader.target.eos_token_ids,
            reference=sequences,
            log=engine_log,
        )
    except vllm_engine.VllmError as e:
        raise OpdError(f"evaluate.backend=vllm: {e}") from None
    if engine_log is not None and engine_log.is_file():  # else on stderr (opd --verbose)
        log.info("[evaluate] vLLM's engine log: %s", engine_log)
    gap = stats["tau_vllm"] / tau - 1
    if abs(gap) > TAU_VLLM_TOLERANCE:
        why = (
            "vLLM drafts greedily and accepts a draft with the target's probability of it, where "
            "this project samples drafts at the temperature"
            if cfg.temperature > 0
            else "not expected at T=0 (same drafter, prompts and K): check vllm_lossless"
        )
        stats["tau_vllm_note"] = (
            f"tau_vllm differs from tau by {gap:+.1%}: {why} (docs/vllm.md: τ inside vLLM)"
        )
    return stats


RANKS_DIR = "ranks"
"""Each rank's share of a sharded evaluation, merged into the dataset's files and dropped."""


def _share(n_prompts: int, batch_size: int, rank: int, world_size: int) -> tuple[int, int]:
    """Prompts [lo, hi) of `rank`: a contiguous run of whole batches, so every batch decodes as
    it does in one process and concatenating the ranks' rows in rank order is prompt order."""
    batches = -(-n_prompts // batch_size)
    lo, hi = (batches * r // world_size for r in (rank, rank + 1))
    return min(lo * batch_size, n_prompts), min(hi * batch_size, n_prompts)


def _part_dir(rank: int, world_size: int) -> str:
    return f"{RANKS_DIR}/{rank}-of-{world_size}"


def _write_part(output: DatasetWriter, where: str, parts: dict[str, Decoded]) -> None:
    """A rank's decoded share; its sums file is written last and marks it complete."""
    sums: dict[str, Any] = {}
    for name, part in parts.items():
        if part.steps.height:
            output.write_parquet(f"{where}/{name}-steps.parquet", part.steps.to_arrow())
            output.write_parquet(f"{where}/{name}-drafts.parquet", part.drafts.to_arrow())
        sums[name] = {"sums": part.sums, "mismatches": part.mismatches, "sequences": part.sequences}
    output.write_bytes(f"{where}/sums.json", json.dumps(sums).encode())


def _read_part(output: DatasetWriter, where: str) -> dict[str, Decoded]:
    sums = json.loads((output.dir / where / "sums.json").read_text())
    parts = {}
    for name, s in sums.items():
        tables = [output.dir / where / f"{name}-{t}.parquet" for t in ("steps", "drafts")]
        steps, drafts = (pl.read_parquet(t) if t.exists() else pl.DataFrame() for t in tables)
        parts[name] = Decoded(steps, drafts, s["sums"], s["mismatches"], s["sequences"])
    return parts


def _decode(
    target,
    drafter: Drafter,
    prompts,
    cfg: Config,
    first: int,
    progress: bool,
    baseline: Drafter | None = None,
) -> dict[str, Decoded]:
    """The trained drafter's decoding of `prompts` (and the untrained contrast's, when on and
    the kind trains; and the free baseline's, when given)."""
    torch.manual_seed(cfg.seed)
    parts = {"trained": evaluate(target, drafter, prompts, cfg, progress, first=first)}
    quick = cfg.model_copy(update={"measure_baseline": False})
    if cfg.untrained_contrast and needs_training(drafter.kind):
        torch.manual_seed(cfg.seed)
        untrained = drafter.untrained().eval()
        parts["untrained"] = evaluate(
            target, untrained, prompts, quick, progress, first=first, desc="untrained contrast"
        )
    if baseline is not None:
        parts["baseline"] = evaluate(
            target, baseline, prompts, cfg, progress, first=first, desc="free baseline"
        )
    return parts


BASELINE_DIR = "_baseline"
"""Under the data root: the free baseline's measurements (module docstring)."""


def baseline_plan(cfg: Config, drafter, prompts: Dataset, ctx: RunContext):
    """(the baseline drafter, its cache file, its cached numbers or None), or None when this
    evaluation measures no free baseline: switched off, none registered, the drafter is one, a
    draft tree (the lookup drafts chains, as vLLM's) or lossy verification (its numbers would
    be typical acceptance's, not the target's law)."""
    spec = baseline_kind()
    if not cfg.free_baseline or spec is None or spec.name == drafter.kind:
        return None
    if cfg.tree is not None or lossy(cfg):
        return None
    target = ctx.target_loader.target
    lookup = spec.drafter.new(target, DraftVocab.full(target.vocab_size), {}).eval()
    decoding = version_dict(cfg) | {"measure_baseline": cfg.measure_baseline}
    for unused in ("untrained_contrast", "backend", "stop_confidence"):
        decoding.pop(unused, None)  # a lookup's confidence is 1: no stop rule cuts it
    key = {
        "kind": spec.name,
        "config": lookup.config.to_dict(),
        "target": ctx.target_loader.identity,
        "prompts": str(prompts.ref),
        "evaluate": decoding,
        "machine": [platform.node(), str(target.device), torch.get_num_threads()],
        # 2: its speed-up is over plain decoding timed in its own pass (earlier files hold one
        # over another pass's)
        "timing": 2,
        # 2: the file holds its numbers with their sha256 (`read_cached_baseline`)
        "format": 2,
    }
    digest = hashlib.sha256(canonical_json(key).encode()).hexdigest()[:16]
    path = ctx.store.root / BASELINE_DIR / f"{digest}.json"
    return lookup, path, read_cached_baseline(path, cfg.k)


def read_cached_baseline(path: Path, k: int) -> dict[str, Any] | None:
    """The free baseline's numbers cached in `path`, or None (measure them again): absent, or,
    with one warning naming the file, unreadable, not matching their sha256 (edited or damaged)
    or out of range for K=`k` drafted tokens. The numbers go into an eval's manifest as
    measured, so a damaged entry is never trusted."""
    if not path.exists() and not path.is_symlink():
        return None
    try:
        if not path.is_file():
            raise UnreadableJson(path, "it is not a regular file")
        entry = read_json_object(path)
        stats, digest = entry.get("stats"), entry.get("sha256")
        if not isinstance(stats, dict) or not isinstance(digest, str):
            raise UnreadableJson(path, "it holds no numbers with their sha256")
        if hashlib.sha256(canonical_json(stats).encode()).hexdigest() != digest:
            raise UnreadableJson(path, "its numbers do not match their sha256 (edited or damaged)")
        if (problem := baseline_range_problem(stats, k)) is not None:
            raise UnreadableJson(path, problem)
    except (UnreadableJson, OSError, ValueError) as e:
        reason = e.reason if isinstance(e, UnreadableJson) else str(e)
        log.warning("free baseline cache %s: %s; measuring it again", path, reason)
        return None
    return stats


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def baseline_range_problem(stats: dict[str, Any], k: int) -> str | None:
    """What makes the free baseline's numbers impossible for chains of `k` drafted tokens
    (None: they are possible): τ counts the accepted drafts plus the target's token, so
    1 <= τ <= k + 1; α are rates; a verify step emits at least one token."""
    if not isinstance(stats.get("kind"), str) or not isinstance(stats.get("title"), str):
        return "it names no baseline kind"
    tau = stats.get("tau")
    if not _number(tau) or not 1 <= tau <= k + 1:
        return f"tau={tau!r} is outside [1, {k + 1}], the range at K={k}"
    alpha = stats.get("alpha")
    if not isinstance(alpha, list) or len(alpha) > k:
        return f"alpha={alpha!r} is not a list of at most {k} rates"
    if not all(_number(a) and 0 <= a <= 1 for a in alpha):
        return f"alpha={alpha!r} holds a value outside [0, 1]"
    forwards = stats.get("target_forwards_per_token")
    if not _number(forwards) or not 0 < forwards <= 1:
        return f"target_forwards_per_token={forwards!r} is outside (0, 1]"
    for name in ("tokens_per_s", "speedup", "plain_tokens_per_s"):
        if name in stats or name == "tokens_per_s":
            value = stats.get(name)
            if not _number(value) or value <= 0:
                return f"{name}={value!r} is not a positive number"
    if "lossless_t0" in stats and not isinstance(stats["lossless_t0"], bool):
        return f"lossless_t0={stats['lossless_t0']!r} is not true or false"
    return None


def write_cached_baseline(path: Path, stats: dict[str, Any]) -> None:
    """Cache the free baseline's numbers with their sha256; a cache that cannot be written
    (its directory a file, the entry a directory, a read-only root) costs a warning, not the
    evaluation."""
    entry = {"stats": stats, "sha256": hashlib.sha256(canonical_json(stats).encode()).hexdigest()}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, json.dumps(entry, indent=2, sort_keys=True))
    except OSError as e:
        log.warning(
            "free baseline cache %s not written (%s): the next evaluation measures it again; "
            "remove what is in the way",
            path,
            e.strerror or e,
        )


def baseline_stats(part: Decoded, cfg: Config, prompts: int, spec) -> dict[str, Any]:
    """The free baseline's numbers from its decoding (`free_baseline` in the meta), its
    speed-up over the plain decoding timed in its own pass."""
    base = summarize(part, cfg, prompts)
    out = {
        "kind": spec.name,
        "title": spec.title,
        "tau": base["tau"],
        "alpha": base["alpha"],
        "target_forwards_per_token": base["target_forwards_per_token"],
        "tokens_per_s": base["tokens_per_s"],
    }
    if "speedup" in base:
        out |= {
            "speedup": base["speedup"],
            "plain_tokens_per_s": base["baseline_tokens_per_s"],
            **({"lossless_t0": base["lossless_t0"]} if "lossless_t0" in base else {}),
        }
    return out


def run(
    cfg: Config, inputs: Inputs, output: DatasetWriter, rank: int, world_size: int, ctx: RunContext
) -> dict:
    if cfg.acceptance == "typical" and cfg.backend == "vllm":
        raise OpdError(
            "evaluate.backend=vllm with drafting.acceptance=typical: vLLM verifies with its "
            "lossless rejection sampler only; evaluate typical acceptance with backend=hf"
        )
    check_engine_target("evaluate", cfg, ctx.target_loader.cfg)
    if cfg.tree is not None and cfg.backend == "vllm":
        raise OpdError(
            "evaluate.backend=vllm with drafting.tree: vLLM serves drafters as chains and has no "
            "draft-tree setting (docs/drafters.md: draft trees); evaluate trees with backend=hf"
        )
    check_drafting_depth(inputs["drafter"], cfg.k if cfg.tree is None else cfg.tree.depth)
    target = ctx.target_loader.target
    drafter = load_drafter_dataset(inputs["drafter"], target, ctx.target_loader.identity)
    if cfg.backend == "vllm" and not isinstance(drafter, ServableDrafter):
        raise OpdError(f"evaluate.backend=vllm: a {drafter.kind} drafter is not served by vLLM")
    if cfg.backend == "vllm" and (served := drafter.served_tokens(cfg.k)) != cfg.k:
        raise OpdError(
            f"vLLM serves this {drafter.kind} drafter with {served} drafted tokens per step, not "
            f"drafting.k={cfg.k}: set drafting.k={served} (or --k {served}) so both decoders "
            "draft the same"
        )
    prompts, labels = prompt_sets(inputs["prompts"], cfg)
    check_tree_setting(target, cfg.tree, prompts, cfg.max_new_tokens)
    plan = baseline_plan(cfg, drafter, inputs["prompts"], ctx)
    # sharded, every rank decodes its share of it: a cache hit on some ranks only would leave
    # the merge without their rows
    lookup = plan[0] if plan is not None and (plan[2] is None or world_size > 1) else None
    if world_size == 1:
        merged = _decode(target, drafter, prompts, cfg, 0, ctx.progress, lookup)
    else:
        lo, hi = _share(len(prompts), cfg.batch_size, rank, world_size)
        where = _part_dir(rank, world_size)
        if not output.has_shard(f"{where}/sums.json"):
            _write_part(
                output,
                where,
                _decode(target, drafter, prompts[lo:hi], cfg, lo, ctx.progress, lookup),
            )
        if rank != 0:
            return {}
        output.wait_for_ranks()
        shares = [_read_part(output, _part_dir(r, world_size)) for r in range(world_size)]
        merged = {name: Decoded.concat([s[name] for s in shares]) for name in shares[0]}
    output.discard(RANKS_DIR)  # shares merged (or left by an earlier launch of other ranks)
    out = merged["trained"]
    stats = summarize(out, cfg, len(prompts))
    if len(set(labels)) > 1 or labels[0] != "all":
        stats["by_set"] = per_set(out.steps, labels)
    if cfg.backend == "vllm":
        stats |= vllm_stats(
            cfg,
            inputs["drafter"],
            drafter.spec.serve_method,
            ctx,
            prompts,
            out.sequences,
            stats["tau"],
            output.store.root / "_work" / "evaluate" / output.version / "vllm.log",
        )
    if "untrained" in merged:
        quick = cfg.model_copy(update={"measure_baseline": False})
        base = summarize(merged["untrained"], quick, len(prompts))
        stats |= {"tau_untrained": base["tau"], "alpha_untrained": base["alpha"]}
    if "baseline" in merged:
        free = baseline_stats(merged["baseline"], cfg, len(prompts), baseline_kind())
        write_cached_baseline(plan[1], free)
        stats["free_baseline"] = free
    elif plan is not None:
        stats["free_baseline"] = plan[2] | {"cached": str(plan[1])}
    output.write_parquet("steps.parquet", out.steps.rechunk().to_arrow())
    output.write_parquet("drafts.parquet", out.drafts.rechunk().to_arrow())
    alpha = "alpha=[" + " ".join(f"{a:.2f}" for a in stats["alpha"]) + "]"
    if "alpha_reached" in stats:
        alpha += " of [" + " ".join(map(str, stats["alpha_reached"])) + "] drafts reached"
    speed = f", {stats['speedup']:.2f}x plain decoding" if "speedup" in stats else ""
    for name, one in stats.get("by_set", {}).items():
        log.info("[evaluate] %s: tau=%.3f on %d prompts", name, one["tau"], one["prompts"])
    log.info(
        "[evaluate] tau=%.3f %s T=%s %s%s%s",
        stats["tau"],
        alpha,
        cfg.temperature,
        f"K={cfg.k}" if cfg.tree is None else f"tree={cfg.tree.model_dump()}",
        speed,
        " (typical acceptance: LOSSY, not the target's law)" if lossy(cfg) else "",
    )
    if (free := stats.get("free_baseline")) is not None:
        log.info("[evaluate] beside it, %s", baseline_line(free))
    if "t0_identical" in stats:
        log.info("[evaluate] %s", identity_line(stats))
    return stats | {"drafter": str(inputs["drafter"].ref)}


STAGE = Stage(
    name="evaluate",
    output="eval",
    version="1",
    config=Config,
    run=run,
    doc="speculative decoding on held-out prompts: tau, per-position acceptance, speed-up",
    inputs={"prompts": ("prompts",), "drafter": DRAFTER_DATASETS},
    default_inputs={"drafter": "sft@latest"},
    drafting={
        "k": "k",
        "tree": "tree",
        "stop_confidence": "stop_confidence",
        "acceptance": "acceptance",
        "typical": "typical",
    },
    sharded=True,
)
