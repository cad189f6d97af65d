"""`opd experiment opd-vs-sft` and `opd experiment ablate`: Draft-OPD against continued SFT at
matched compute, and one-factor-at-a-time ablations of Draft-OPD, from one SFT warm-up.

opd-vs-sft. From ONE SFT warm-up (the full chain's own prompts -> generate -> features -> sft
steps, so their cached datasets are shared with `opd run full`), for each seed:

  (a) continued SFT: the `sft` stage trains on from the warm-up drafter (its optional `drafter`
      input) on the original features plus fresh target trajectories (`more_features`): a
      rollout (speculative decoding is lossless, so these are the target's own sequences; the
      warm-up drafter only speeds it up) whose features carry the drafter's vocab map, over the
      same prompts the Draft-OPD rounds draft on (with `rollout.new_prompts_each_round`, all
      rounds' prompts at once), at the same temperature, so both arms see the same new contexts;
      `sft_data_temperature` (e.g. 1.0) samples them instead;
  (b) Draft-OPD: `rounds` rounds of rollout -> score -> opd from the warm-up drafter.

Both arms spend the same drafter budget, counted in drafter forward+backward row-steps: rows of
the training-time-test unroll x unrolled steps (SFT: every token row x ttt_steps; OPD: the rows
up to a sequence's last anchor x the replay depth K). Continued SFT runs the fewest steps whose
row-steps reach the budget; each OPD round gets budget / rounds the same way. Both arms use the
same peak learning rate (`opd.lr`). Target forwards are not in the budget (OPD runs one rollout
and one scoring per round, continued SFT one data rollout); their token counts are reported.

The warm-up, continued-SFT and OPD drafters are evaluated on the held-out prompts at T=0 and
T=1 with the same K (the evaluate stage, same seed for every arm). Where SFT plateaus: both
arms also validate on the SAME held-out sequences, which neither trains on: a greedy rollout,
by the warm-up drafter, of exactly the prompts evaluate decodes (the prompts dataset's held-out
split, first `evaluate.max_prompts`, `evaluate.max_new_tokens`). Greedy decoding is lossless, so
these are the target's own continuations that T=0 evaluation verifies against: the teacher-
forced curve ends where the real tau markers are measured, and nothing is ever selected on it
(no early stopping), so it does not leak into the result. It is the `heldout` input of the sft
and opd stages; their validations log `heldout_tau_sim` (T=0) and `heldout_tau_expected` (T=1)
~10 times over continued SFT and a few times per OPD round, against cumulative row-steps.

The result (JSON, also saved under `<root>/_experiments/`) leads with the headline numbers:
`tau_{arm}` (T=0) and `tau_{arm}_t1` (T=1) as the mean over seeds, with `_per_seed` and `_std`,
and `opd_over_sft_continued[_t1]`. A report dataset (`experiment@VERSION`: Parquet tables, PNG
plots and report.md) holds the per-seed table, the tau plot and the plateau plot.

ablate. Around the OPD defaults (the profile's config), it varies one factor at a time (loss
family, greedy vs sampled replays, rounds, replays per anchor, gamma), always from the same
warm-up and with the same total drafter budget, and evaluates every variant at T=0 and T=1 for
each seed. Variants share every dataset whose config they share (the stage cache: e.g. the
greedy round-1 rollout is one dataset for every loss family), and the report dataset holds the
table of tau per variant and the plot.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
import logging
import statistics
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import polars as pl

from models.losses import ReplayLoss
from pipeline import chains, evaluate, opd, rollout, sft, training
from pipeline.analyze import _figure, _md_table, _png
from pipeline.chains import Step
from pipeline.drafters import METRICS_FILE
from pipeline.profiles import PipelineConfig
from pipeline.runner import RunContext, StageResult, run_stage
from pipeline.stage import Stage
from storage import Dataset, OpdError, canonical_json

log = logging.getLogger("opd")

BUDGET_UNIT = (
    "drafter forward+backward row-steps: rows of the training-time-test unroll x unrolled "
    "steps (continued SFT: token rows x ttt_steps; OPD: rows up to a sequence's last anchor x K)"
)
TEMPERATURES = (0.0, 1.0)
ARMS = ("sft_continued", "opd")
ARM_NAMES = {"sft_warmup": "SFT warm-up", "sft_continued": "continued SFT", "opd": "Draft-OPD"}
SFT_VALIDATIONS = 10
"""Held-out points along continued SFT: enough to see a plateau, each costs one pass over the
held-out sequences (48 on the default profile, a few training steps' worth)."""
OPD_VALIDATIONS = 4
"""Held-out points per OPD round (plus its start)."""
REPORT_NAME = "experiment"
"""The dataset name of the experiments' reports (`experiment@VERSION`)."""


def suffix(t: float) -> str:
    """The key suffix of a temperature: T=0 is the headline (no suffix), T=1 is `_t1`."""
    return "" if t == 0 else f"_t{t:g}"


def sft_budget(ds: Dataset) -> int:
    """Row-steps an `sft` dataset's training ran: tokens of every step x its unrolled steps
    (ttt_steps; 1 for objective=eagle1)."""
    metrics = pl.read_parquet(ds.file(METRICS_FILE)).filter(pl.col("kind") == "train")
    stage = ds.config["stage"]
    return int(metrics["tokens"].sum()) * sft.unrolled_steps(
        stage.get("objective"), int(stage["ttt_steps"])
    )


def sft_steps_for_budget(data: list[Dataset], cfg: sft.Config, budget: int) -> int:
    """The fewest sft optimizer steps (one rank) whose row-steps reach `budget` on `data`."""
    index = training.FeatureIndex(data, sft.FEATURE_COLUMNS)
    rows, _ = training.holdout_split(index.keys, cfg.val_share, cfg.seed)

    @functools.cache
    def plan(epoch: int) -> list[int]:
        batches = training.plan_batches(
            index.lengths,
            rows,
            batch_size=cfg.batch_size,
            max_tokens=cfg.max_tokens,
            seed=cfg.seed,
            epoch=epoch,
            shuffle=True,
            world_size=1,
        )
        return [int(index.lengths[b].sum()) * cfg.unroll_depth for b in batches]

    per_epoch = len(plan(0))
    return opd.steps_for_budget(budget, lambda s: plan(s // per_epoch)[s % per_epoch])


def _stats(values: list[float]) -> dict[str, Any]:
    return {
        "mean": statistics.fmean(values),
        "std": statistics.stdev(values) if len(values) > 1 else 0.0,
        "min": min(values),
        "max": max(values),
        "per_seed": values,
    }


def _val_curve(ds: Dataset) -> list[dict[str, Any]]:
    """Validation rows of a drafter dataset on its own split: step, teacher-forced tau_sim, loss."""
    m = pl.read_parquet(ds.file(METRICS_FILE)).filter(
        (pl.col("kind") == "val") & pl.col("tau_sim").is_not_null()
    )
    return [
        {"step": r["step"], "tau_sim": r["tau_sim"], "loss": r["loss"]}
        for r in m.select("step", "tau_sim", "loss").iter_rows(named=True)
    ]


def heldout_curve(ds: Dataset, start: int) -> list[dict[str, Any]]:
    """The `heldout_*` validations of a drafter dataset, each at `start` + the row-steps its
    training had run by then (empty for a dataset trained without a `heldout` input)."""
    m = pl.read_parquet(ds.file(METRICS_FILE))
    if "heldout_tau_sim" not in m.columns:
        return []
    spent = (
        m.filter(pl.col("kind") == "train")
        .select("step", pl.col("row_steps").cum_sum().alias("spent"))
        .vstack(
            pl.DataFrame({"step": [0], "spent": [0]}, schema={"step": pl.Int64, "spent": pl.Int64})
        )
    )
    vals = m.filter((pl.col("kind") == "val") & pl.col("heldout_tau_sim").is_not_null())
    rows = vals.join(spent, on="step", how="left").sort("step")
    return [
        {
            "step": r["step"],
            "row_steps": start + int(r["spent"]),
            "tau_sim": r["heldout_tau_sim"],
            "tau_expected": r["heldout_tau_expected"],
            "tau_chain": r["heldout_tau_chain"],
        }
        for r in rows.iter_rows(named=True)
    ]


class _Runner:
    """Runs steps through the stage runner and remembers every result by key."""

    def __init__(self, ctx: RunContext):
        self.ctx = ctx
        self.results: dict[str, StageResult] = {}

    def chain(
        self, steps: list[Step], external: dict[str, Dataset], prefix: str = ""
    ) -> dict[str, Dataset]:
        res = chains.run_chain(steps, self.ctx, external=external)
        self.results |= {prefix + k: r for k, r in res.items()}
        return {k: r.dataset for k, r in res.items()}

    def stage(self, key: str, stage: Stage, cfg, inputs: dict[str, Dataset]) -> Dataset:
        self.results[key] = run_stage(stage, cfg, inputs, self.ctx)
        return self.results[key].dataset

    def produced(self) -> dict[str, Dataset]:
        return {k: r.dataset for k, r in self.results.items() if r.dataset is not None}


@dataclass
class Warmup:
    """The shared start of every arm and variant: its prompts, features and SFT drafter."""

    prompts: Dataset
    features: Dataset
    drafter: Dataset
    budget: int  # row-steps the warm-up's own training ran
    tau: dict[str, float]  # evaluated, by temperature


def warm_up(run: _Runner, cfg: PipelineConfig, prompts: Dataset | None) -> Warmup:
    """The SFT chain's prompts -> generate -> features -> sft (cached with `opd run full`'s)."""
    if cfg.rounds < 1:
        raise OpdError("the experiment needs rounds >= 1 (Draft-OPD rounds); set --set rounds=2")
    steps = chains.sft_chain(cfg)[:-1]
    external: dict[str, Dataset] = {}
    if prompts is not None:
        steps, external = steps[1:], {"prompts": prompts}
    out = run.chain(steps, external) | external
    drafter = out["sft"]
    return Warmup(
        out["prompts"],
        out["features"],
        drafter,
        sft_budget(drafter),
        _evaluate(run, "warmup", cfg, out["prompts"], drafter),
    )


def _evaluate(
    run: _Runner, key: str, cfg: PipelineConfig, prompts: Dataset, drafter: Dataset
) -> dict[str, float]:
    taus = {}
    for t in TEMPERATURES:
        # tau only: no plain-decoding timing, no untrained-drafter contrast (the warm-up is it)
        ecfg = cfg.evaluate.model_copy(
            update={"temperature": t, "measure_baseline": False, "untrained_contrast": False}
        )
        taus[str(t)] = run.stage(
            f"{key}:eval-T{t}", evaluate.STAGE, ecfg, {"prompts": prompts, "drafter": drafter}
        ).meta["tau"]
    return taus


def _budget(warm: Warmup, budget: int | None, budget_ratio: float) -> int:
    if not budget_ratio > 0 or (budget is not None and budget < 1):
        raise OpdError("the budget must be positive: set --budget N or --budget-ratio R > 0")
    return budget or max(1, round(budget_ratio * warm.budget))


def heldout_config(cfg: PipelineConfig) -> rollout.Config:
    """The greedy rollout of the prompts evaluate decodes: the held-out validation sequences."""
    return cfg.rollout.model_copy(
        update={
            "split": cfg.evaluate.split,
            "max_prompts": cfg.evaluate.max_prompts,
            "skip_prompts": 0,
            "new_prompts_each_round": False,
            "max_new_tokens": cfg.evaluate.max_new_tokens,
            "temperature": 0.0,
            "round": 1,
        }
    )


def _rollout_seed(temperature: float, seed: int, cfg: PipelineConfig) -> int:
    """A greedy rollout does not depend on its seed: keep one, so seeds share the dataset."""
    return seed if temperature > 0 else cfg.rollout.seed


def sft_data_config(cfg: PipelineConfig, seed: int, temperature: float | None) -> rollout.Config:
    """The rollout giving continued SFT its fresh sequences: every prompt the OPD rounds draft on."""
    t = cfg.rollout.temperature if temperature is None else temperature
    per_round = cfg.rollout.max_prompts
    return cfg.rollout.model_copy(
        update={
            "temperature": t,
            "seed": _rollout_seed(t, seed, cfg),
            "round": 1,
            "new_prompts_each_round": False,
            "max_prompts": per_round * cfg.rounds
            if cfg.rollout.new_prompts_each_round
            else per_round,
        }
    )


def opd_arm(
    run: _Runner,
    cfg: PipelineConfig,
    seed: int,
    budget: int,
    warm: Warmup,
    *,
    key: str,
    heldout: Dataset | None = None,
) -> dict[str, Any]:
    """Draft-OPD rounds from the warm-up drafter, each round spending budget / rounds."""
    per_round = max(1, round(budget / cfg.rounds))
    opd_update: dict[str, Any] = {"seed": seed, "budget_row_steps": per_round, "steps": None}
    if heldout is not None:
        opd_update["validations"] = OPD_VALIDATIONS
    seeded = cfg.model_copy(
        update={
            "rollout": cfg.rollout.model_copy(
                update={"seed": _rollout_seed(cfg.rollout.temperature, seed, cfg)}
            ),
            "score": cfg.score.model_copy(update={"seed": seed}),
            "opd": cfg.opd.model_copy(update=opd_update),
        }
    )
    rounds = chains.opd_rounds(seeded)
    external = {"prompts": warm.prompts, "sft": warm.drafter, "features": warm.features}
    if heldout is not None:
        external["heldout"] = heldout
        for step in rounds:
            if step.stage is opd.STAGE:
                step.inputs["heldout"] = "heldout"
    out = run.chain(rounds, external, prefix=f"{key}:")
    final = out[rounds[-1].key]
    n = range(1, cfg.rounds + 1)
    opd_sets = [out[f"opd-r{r}"] for r in n]
    rollouts = [out[f"rollout-r{r}"] for r in n]
    curve: list[dict[str, Any]] = []
    start = warm.budget
    for r, ds in zip(n, opd_sets, strict=True):
        points = heldout_curve(ds, start) if ds.meta.get("trained") else []
        # a later round's step-0 point is the previous round's last one (the same drafter)
        curve += [p | {"round": r} for p in points if r == 1 or p["step"] > 0]
        start += int(ds.meta.get("budget_row_steps", 0))
    return {
        "drafter": str(final.ref),
        "drafters": [str(d.ref) for d in opd_sets],
        "steps": [d.meta.get("steps") for d in opd_sets],
        "budget_row_steps": int(sum(d.meta.get("budget_row_steps", 0) for d in opd_sets)),
        "replays": [out[f"score-r{r}"].meta.get("replays") for r in n],
        "rollout_tau": [d.meta.get("tau") for d in rollouts],
        "rollout_tokens": [d.meta.get("tokens") for d in rollouts],
        "tau": _evaluate(run, f"{key}:opd", cfg, warm.prompts, final),
        "val": [_val_curve(d) for d in opd_sets if d.meta.get("trained")],
        "heldout_curve": curve,
    }


def _sft_arm(
    run: _Runner,
    cfg: PipelineConfig,
    seed: int,
    budget: int,
    sft_data_temperature: float | None,
    warm: Warmup,
    heldout: Dataset,
) -> dict[str, Any]:
    """Continued SFT on target sequences of the OPD rounds' prompts, from the warm-up drafter."""
    data_cfg = sft_data_config(cfg, seed, sft_data_temperature)
    data = run.stage(
        f"s{seed}:sft-data",
        rollout.STAGE,
        data_cfg,
        {"prompts": warm.prompts, "drafter": warm.drafter},
    )
    sft_cfg = cfg.sft.model_copy(update={"seed": seed, "lr": cfg.opd.lr, "epochs": None})
    steps = sft_steps_for_budget([data, warm.features], sft_cfg, budget)
    sft_cfg = sft_cfg.model_copy(update={"steps": steps, "validations": SFT_VALIDATIONS})
    cont = run.stage(
        f"s{seed}:sft-continued",
        sft.STAGE,
        sft_cfg,
        {
            "features": data,
            "more_features": warm.features,
            "drafter": warm.drafter,
            "heldout": heldout,
        },
    )
    return {
        "drafter": str(cont.ref),
        "data": str(data.ref),
        "steps": steps,
        "budget_row_steps": sft_budget(cont),
        "data_rollout_tokens": data.meta.get("tokens"),
        "tau": _evaluate(run, f"s{seed}:sft-continued", cfg, warm.prompts, cont),
        "val": _val_curve(cont),
        "heldout_curve": [p | {"round": None} for p in heldout_curve(cont, warm.budget)],
    }


def _save(ctx: RunContext, run: _Runner, kind: str, result: dict[str, Any]) -> None:
    """Record the run and save the result JSON under `<root>/_experiments/`."""
    produced = {k: d.ref for k, d in run.produced().items()}
    ctx.store.record_run(ctx.run_name, produced)
    key = hashlib.sha256(
        canonical_json({k: str(v) for k, v in produced.items()}).encode()
    ).hexdigest()[:12]
    path = ctx.store.root / "_experiments" / f"{kind}-{key}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    result["saved_to"] = str(path)
    path.write_text(json.dumps(result, indent=2))


# -- opd-vs-sft ------------------------------------------------------------------------------


def opd_vs_sft(
    cfg: PipelineConfig,
    ctx: RunContext,
    *,
    seeds: int = 3,
    first_seed: int | None = None,
    budget: int | None = None,
    budget_ratio: float = 1.0,
    sft_data_temperature: float | None = None,
    prompts: Dataset | None = None,
    command: str | None = None,
) -> dict[str, Any]:
    """Run the experiment (see the module docstring); returns the result as JSON-able data.

    `budget` (row-steps per arm) defaults to `budget_ratio` x the warm-up's own budget.
    `prompts`: use this dataset instead of running the prompts stage. `first_seed` (default
    `sft.seed`) lets separate processes run disjoint seeds against one root; a later run over
    all seeds reuses their datasets. `command`: the command line to quote in the report.
    """
    if seeds < 1:
        raise OpdError(f"--seeds must be >= 1, got {seeds}")
    run = _Runner(ctx)
    warm = warm_up(run, cfg, prompts)
    budget = _budget(warm, budget, budget_ratio)
    log.info(
        "[experiment] warm-up %s spent %d row-steps; each arm gets %d",
        warm.drafter.ref,
        warm.budget,
        budget,
    )
    heldout = run.stage(
        "heldout",
        rollout.STAGE,
        heldout_config(cfg),
        {"prompts": warm.prompts, "drafter": warm.drafter},
    )
    runs = []
    first = cfg.sft.seed if first_seed is None else first_seed
    for seed in range(first, first + seeds):
        runs.append(
            {
                "seed": seed,
                "sft_continued": _sft_arm(
                    run, cfg, seed, budget, sft_data_temperature, warm, heldout
                ),
                "opd": opd_arm(run, cfg, seed, budget, warm, key=f"s{seed}", heldout=heldout),
            }
        )

    result: dict[str, Any] = {"experiment": "opd-vs-sft"}
    for t in TEMPERATURES:
        s = suffix(t)
        for arm in ARMS:
            values = [r[arm]["tau"][str(t)] for r in runs]
            result[f"tau_{arm}{s}"] = statistics.fmean(values)
            result[f"tau_{arm}{s}_per_seed"] = values
            result[f"tau_{arm}{s}_std"] = _stats(values)["std"]
        result[f"opd_over_sft_continued{s}"] = (
            result[f"tau_opd{s}"] / result[f"tau_sft_continued{s}"]
        )
        result[f"opd_over_sft_continued{s}_per_seed"] = [
            r["opd"]["tau"][str(t)] / r["sft_continued"]["tau"][str(t)] for r in runs
        ]
        result[f"tau_sft_warmup{s}"] = warm.tau[str(t)]
    result |= {
        "seeds": [r["seed"] for r in runs],
        "budget_unit": BUDGET_UNIT,
        "budget_row_steps": budget,
        "k": cfg.drafting.k,
        "temperatures": list(TEMPERATURES),
        "rounds": cfg.rounds,
        "opd_train_temperature": cfg.rollout.temperature,
        "sft_data_temperature": cfg.rollout.temperature
        if sft_data_temperature is None
        else sft_data_temperature,
        "lr": cfg.opd.lr,
        "heldout_prompts": cfg.evaluate.max_prompts,
        "heldout_sequences": str(heldout.ref),
        "warmup": {
            "drafter": str(warm.drafter.ref),
            "budget_row_steps": warm.budget,
            "tau": warm.tau,
            "val": _val_curve(warm.drafter),
        },
        "runs": runs,
    }
    report = _opd_vs_sft_report(ctx, run, result, command)
    result["report"] = str(report.ref)
    result["report_md"] = str(report.path / "report.md")
    _save(ctx, run, "opd-vs-sft", result)
    return result


def _tau_table(result: dict[str, Any]) -> pl.DataFrame:
    """One row per (arm, seed, temperature): the evaluated tau (the warm-up has no seed)."""
    rows = [
        {
            "arm": "sft_warmup",
            "seed": None,
            "temperature": t,
            "tau": result["warmup"]["tau"][str(t)],
        }
        for t in TEMPERATURES
    ]
    rows += [
        {"arm": arm, "seed": r["seed"], "temperature": t, "tau": r[arm]["tau"][str(t)]}
        for r in result["runs"]
        for arm in ARMS
        for t in TEMPERATURES
    ]
    return pl.DataFrame(
        rows,
        schema={"arm": pl.String, "seed": pl.Int64, "temperature": pl.Float64, "tau": pl.Float64},
    )


def _curve_table(result: dict[str, Any]) -> pl.DataFrame:
    """One row per held-out validation: arm, seed, round, step, cumulative row-steps, taus."""
    schema = {
        "arm": pl.String,
        "seed": pl.Int64,
        "round": pl.Int64,
        "step": pl.Int64,
        "row_steps": pl.Int64,
        "tau_sim": pl.Float64,
        "tau_expected": pl.Float64,
        "tau_chain": pl.Float64,
    }
    rows = [
        {"arm": arm, "seed": r["seed"]} | p
        for r in result["runs"]
        for arm in ARMS
        for p in r[arm]["heldout_curve"]
    ]
    return pl.DataFrame(rows, schema=schema)


def _summary(tau: pl.DataFrame, by: Sequence[str]) -> pl.DataFrame:
    """Mean, std, min, max and seed count of tau per group and temperature, in first-seen order."""
    return tau.group_by([*by, "temperature"], maintain_order=True).agg(
        pl.col("tau").mean().alias("mean"),
        pl.col("tau").std().fill_null(0.0).alias("std"),
        pl.col("tau").min().alias("min"),
        pl.col("tau").max().alias("max"),
        pl.len().alias("seeds"),
    )


# -- the report dataset ----------------------------------------------------------------------


def write_report(
    ctx: RunContext,
    kind: str,
    config: dict[str, Any],
    inputs: dict[str, Dataset],
    tables: dict[str, pl.DataFrame],
    plots: dict[str, Callable[[], bytes]],
    markdown: Callable[[], str],
    meta: dict[str, Any],
) -> Dataset:
    """An `experiment@VERSION` dataset: Parquet tables, PNG plots and report.md (manifest last).

    Its version is the experiment's kind and config plus every dataset it read, so re-running
    an experiment whose datasets are all cached finds its report too.
    """
    writer = ctx.store.writer(
        REPORT_NAME,
        stage=kind,
        stage_version="1",
        config=config,
        inputs={role: ds.ref for role, ds in inputs.items()},
    )
    if writer.exists():
        ctx.store.set_latest(writer.ref)
        return ctx.store.open(writer.ref)
    with writer:
        if writer.exists():  # another process committed it while we waited for the lock
            return ctx.store.open(writer.ref)
        for name, table in tables.items():
            writer.write_parquet(f"{name}.parquet", table.to_arrow())
        for name, plot in plots.items():
            writer.write_bytes(f"{name}.png", plot(), fmt="png")
        writer.write_bytes("report.md", markdown().encode(), fmt="markdown")
        ds = writer.commit(meta=meta)
    log.info("[experiment] wrote report %s (%s)", ds.ref, ds.path / "report.md")
    return ds


_COLORS = {"sft_warmup": "0.35", "sft_continued": "tab:blue", "opd": "tab:orange"}
_T_NAMES = {0.0: "T=0 (greedy)", 1.0: "T=1 (sampled)"}


def plot_tau(
    tau: pl.DataFrame,
    labels: list[str],
    title: str,
    reference: dict[float, float] | None = None,
    breaks: Sequence[int] = (),
) -> bytes:
    """Evaluated tau per row label (column `label`), one panel per temperature: the mean over
    seeds with a +-std error bar, each seed a small cross, the warm-up as a dashed line, and a
    rule above each row index in `breaks` (where a new group of rows starts)."""
    n = len(labels)
    fig = _figure(10.0, 2.3 + 0.4 * n)
    axes = fig.subplots(1, len(TEMPERATURES), sharey=True)
    for ax, t in zip(axes, TEMPERATURES, strict=True):
        for i, label in enumerate(labels):
            values = tau.filter((pl.col("label") == label) & (pl.col("temperature") == t))["tau"]
            if values.is_empty():
                continue
            mean, std = values.mean(), values.std() if len(values) > 1 else 0.0
            ax.errorbar(
                mean,
                i,
                xerr=std,
                fmt="o",
                color="tab:blue",
                capsize=4,
                ms=6,
                label="mean over seeds ± std" if i == 0 else None,
            )
            ax.plot(
                values.to_list(),
                [i + 0.2] * len(values),
                "x",
                color="0.3",
                ms=5,
                label="one seed" if i == 0 else None,
            )
            ax.annotate(
                f"{mean:.3f}",
                (mean, i),
                xytext=(0, 7),
                textcoords="offset points",
                ha="center",
                fontsize=8,
            )
        for i in breaks:
            ax.axhline(i - 0.5, color="0.75", lw=0.8)
        if reference is not None:
            ax.axvline(reference[t], color="0.4", ls="--", lw=1, label="SFT warm-up")
        ax.set_title(f"evaluated τ, {_T_NAMES.get(t, f'T={t:g}')}", fontsize=10)
        ax.set_xlabel("τ: tokens per target forward (held-out prompts)")
        ax.margins(x=0.15, y=0.6 / max(n, 1))
        ax.grid(axis="x", alpha=0.3)
    axes[0].set_yticks(range(n), labels, fontsize=9)
    axes[0].invert_yaxis()
    handles, names = axes[0].get_legend_handles_labels()
    fig.legend(handles, names, loc="outside lower center", ncols=3, fontsize=8)
    fig.suptitle(title, fontsize=11)
    return _png(fig)


def _mean_curve(points: list[list[tuple[float, float]]]) -> tuple[list[float], list[float]]:
    """Mean over seeds of curves aligned by validation index (every seed validates at the same
    steps of its run; their row-steps differ slightly), as long as the shortest one."""
    n = min(len(p) for p in points)
    xs = [statistics.fmean(p[i][0] for p in points) for i in range(n)]
    ys = [statistics.fmean(p[i][1] for p in points) for i in range(n)]
    return xs, ys


def plot_plateau(curves: pl.DataFrame, result: dict[str, Any]) -> bytes:
    """Held-out teacher-forced tau vs cumulative drafter row-steps, per arm (mean line, thin
    per-seed lines), with the evaluated tau of the warm-up and of each arm's final drafter."""
    fig = _figure(11.0, 4.8)
    axes = fig.subplots(1, 2)
    warm = result["warmup"]
    panels = (
        (0.0, "tau_sim", "T=0: teacher-forced τ (greedy acceptance)"),
        (1.0, "tau_expected", "T=1: teacher-forced expected τ (Σ min(p, q))"),
    )
    last = max(
        warm["budget_row_steps"] + r[a]["budget_row_steps"] for r in result["runs"] for a in ARMS
    )
    scale, unit = (1e6, "millions") if last >= 1e6 else (1e3, "thousands")
    for ax, (t, column, title) in zip(axes, panels, strict=True):
        for arm in ARMS:
            color = _COLORS[arm]
            per_seed = []
            for r in result["runs"]:
                c = curves.filter((pl.col("arm") == arm) & (pl.col("seed") == r["seed"]))
                xy = [(x / scale, y) for x, y in zip(c["row_steps"], c[column], strict=True)]
                if xy:
                    per_seed.append(xy)
                    ax.plot(*zip(*xy, strict=True), color=color, lw=0.8, alpha=0.35)
            if per_seed:
                xs, ys = _mean_curve(per_seed)
                ax.plot(
                    xs,
                    ys,
                    "-",
                    color=color,
                    lw=2.2,
                    label=f"{ARM_NAMES[arm]}: held-out, teacher-forced",
                )
            ends = [
                (warm["budget_row_steps"] + r[arm]["budget_row_steps"]) / scale
                for r in result["runs"]
            ]
            taus = [r[arm]["tau"][str(t)] for r in result["runs"]]
            ax.errorbar(
                statistics.fmean(ends),
                statistics.fmean(taus),
                yerr=statistics.stdev(taus) if len(taus) > 1 else 0.0,
                fmt="s",
                ms=8,
                color=color,
                mec="k",
                capsize=4,
                label=f"{ARM_NAMES[arm]}: evaluated τ (decoding)",
            )
        ax.plot(
            warm["budget_row_steps"] / scale,
            warm["tau"][str(t)],
            "D",
            ms=8,
            color=_COLORS["sft_warmup"],
            mec="k",
            label="SFT warm-up: evaluated τ",
        )
        ax.set_title(title, fontsize=10)
        ax.set_xlabel(f"drafter row-steps, warm-up + continued ({unit})")
        ax.set_ylabel("τ (tokens per target forward)")
        ax.grid(alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncols=3, fontsize=8)
    fig.suptitle(
        "Where continued SFT flattens: both arms from the same warm-up, on the same held-out "
        "sequences",
        fontsize=11,
    )
    return _png(fig)


def _fmt_stats(values: list[float]) -> str:
    s = _stats(values)
    return f"{s['mean']:.3f} ± {s['std']:.3f}"


def _at(per_seed: list[pl.DataFrame], share: float, column: str) -> float:
    """Mean over seeds of `column` at the validation `share` of the way through each run."""
    return statistics.fmean(
        g[column][min(len(g) - 1, round(share * (len(g) - 1)))] for g in per_seed
    )


def _plateau_table(curves: pl.DataFrame) -> pl.DataFrame:
    """Per arm (mean over seeds): held-out teacher-forced tau at the start, half-way and the end
    of its budget, and what the second half added (a plateau adds ~0)."""
    rows = []
    for arm in ARMS:
        c = curves.filter(pl.col("arm") == arm)
        if c.is_empty():
            continue
        per_seed = [g.sort("row_steps") for _, g in c.group_by("seed", maintain_order=True)]
        rows.append(
            {
                "arm": arm,
                "tau_sim_start": _at(per_seed, 0.0, "tau_sim"),
                "tau_sim_half": _at(per_seed, 0.5, "tau_sim"),
                "tau_sim_end": _at(per_seed, 1.0, "tau_sim"),
                "second_half_gain": _at(per_seed, 1.0, "tau_sim") - _at(per_seed, 0.5, "tau_sim"),
                "tau_expected_end": _at(per_seed, 1.0, "tau_expected"),
            }
        )
    return pl.DataFrame(rows)


def _opd_vs_sft_report(
    ctx: RunContext, run: _Runner, result: dict[str, Any], command: str | None
) -> Dataset:
    tau = _tau_table(result)
    curves = _curve_table(result)
    plateau = _plateau_table(curves)
    labeled = tau.with_columns(pl.col("arm").replace_strict(ARM_NAMES).alias("label"))
    warm = result["warmup"]

    def markdown() -> str:
        lines = [
            "# Draft-OPD vs continued SFT at matched compute",
            "",
            *([f"Made by `{command}`.", ""] if command else []),
            f"K={result['k']}, {result['rounds']} Draft-OPD round(s), seeds "
            f"{', '.join(map(str, result['seeds']))}, lr {result['lr']:g}. Each arm spends "
            f"**{result['budget_row_steps']:,}** {BUDGET_UNIT}; the SFT warm-up "
            f"`{warm['drafter']}` spent {warm['budget_row_steps']:,}. τ is evaluated on "
            f"{result['heldout_prompts']} held-out prompts.",
            "",
            "## τ on held-out prompts",
            "",
            "| T | SFT warm-up | continued SFT | Draft-OPD | OPD / SFT | OPD / SFT per seed |",
            "|---|---|---|---|---|---|",
        ]
        for t in TEMPERATURES:
            s = suffix(t)
            ratios = ", ".join(f"{v:.3f}" for v in result[f"opd_over_sft_continued{s}_per_seed"])
            lines.append(
                f"| {t:g} | {result[f'tau_sft_warmup{s}']:.3f} "
                f"| {_fmt_stats(result[f'tau_sft_continued{s}_per_seed'])} "
                f"| {_fmt_stats(result[f'tau_opd{s}_per_seed'])} "
                f"| {result[f'opd_over_sft_continued{s}']:.3f} | {ratios} |"
            )
        lines += [
            "",
            "Mean ± sample std over seeds; per-seed values in `tau.parquet` (below).",
            "",
            "![tau per arm](tau.png)",
            "",
            _md_table(tau),
            "",
            "## Where SFT plateaus: held-out τ against drafter row-steps",
            "",
            "Both arms validate on the same held-out sequences, which neither trains on: the "
            f"target's greedy continuations (`{result['heldout_sequences']}`) of the prompts "
            "evaluate decodes. Lines: teacher-forced τ of the drafter at each validation (thin: "
            "one seed; thick: mean over seeds), at the row-steps spent so far (OPD cumulative "
            "over its rounds); squares: the evaluated τ (real decoding) of each arm's final "
            "drafter; diamond: the warm-up's. The teacher-forced τ (per-step acceptance over "
            "every position of the sequences) and the decoded τ (over the positions where "
            "decoding's blocks start) differ in level: compare slopes along a line, and "
            "squares with each other.",
            "",
            "![held-out tau vs row-steps](plateau.png)",
            "",
            _md_table(plateau),
            "",
            "Every point: `heldout_curve.parquet`.",
            "",
            "## Datasets",
            "",
            f"- warm-up drafter `{warm['drafter']}`, held-out sequences "
            f"`{result['heldout_sequences']}`",
            *(
                f"- seed {r['seed']}: continued SFT `{r['sft_continued']['drafter']}`, "
                f"Draft-OPD `{r['opd']['drafter']}`"
                for r in result["runs"]
            ),
        ]
        return "\n".join(lines)

    config = {
        "experiment": "opd-vs-sft",
        "seeds": result["seeds"],
        "budget_row_steps": result["budget_row_steps"],
        "sft_data_temperature": result["sft_data_temperature"],
    }
    headline = {k: v for k, v in result.items() if k.startswith(("tau_", "opd_over_"))}
    return write_report(
        ctx,
        "opd-vs-sft",
        config,
        run.produced(),
        {
            "tau": tau,
            "tau_summary": _summary(tau, ["arm"]),
            "heldout_curve": curves,
            "plateau": plateau,
        },
        {
            "tau": lambda: plot_tau(
                labeled,
                [ARM_NAMES[a] for a in ARMS],
                "Draft-OPD vs continued SFT",
                _warm_taus(warm),
            ),
            "plateau": lambda: plot_plateau(curves, result),
        },
        markdown,
        headline,
    )


def _warm_taus(warm: dict[str, Any]) -> dict[float, float]:
    return {t: warm["tau"][str(t)] for t in TEMPERATURES}


def summary_text(result: dict[str, Any]) -> str:
    """A short human-readable table of the result."""
    lines = [
        f"opd-vs-sft: K={result['k']}, {result['rounds']} OPD round(s), "
        f"{len(result['seeds'])} seed(s), budget {result['budget_row_steps']} row-steps per arm",
        f"  ({result['budget_unit']})",
        f"{'T':>5} {'warm-up':>9} {'cont. SFT':>18} {'Draft-OPD':>18} {'OPD/SFT':>8}",
    ]
    for t in result["temperatures"]:
        s = suffix(t)
        sft_s = f"{result[f'tau_sft_continued{s}']:.3f} ± {result[f'tau_sft_continued{s}_std']:.3f}"
        opd_s = f"{result[f'tau_opd{s}']:.3f} ± {result[f'tau_opd{s}_std']:.3f}"
        lines.append(
            f"{t:>5} {result[f'tau_sft_warmup{s}']:>9.3f} {sft_s:>18} {opd_s:>18} "
            f"{result[f'opd_over_sft_continued{s}']:>8.3f}"
        )
    lines.append(f"report: {result['report_md']}")
    lines.append(f"saved to {result['saved_to']}")
    return "\n".join(lines)


# -- ablate ----------------------------------------------------------------------------------


@dataclass
class Variant:
    """One row of the ablation: `factor` set to `level`, everything else the OPD defaults."""

    factor: str
    level: str
    cfg: PipelineConfig
    default: bool  # the variant is the unchanged config (the baseline)


def _update(cfg: PipelineConfig, **sections: dict[str, Any]) -> PipelineConfig:
    """`cfg` with fields of its sections replaced (`rounds` is a top-level field)."""
    update: dict[str, Any] = {
        name: getattr(cfg, name).model_copy(update=fields) for name, fields in sections.items()
    }
    return cfg.model_copy(update=update)


def _replays(cfg: PipelineConfig, temperature: float, samples: int) -> PipelineConfig:
    """Rollouts and replays at `temperature` (greedy replays are one per anchor)."""
    return _update(
        cfg,
        rollout={"temperature": temperature},
        score={"temperature": temperature, "samples": samples if temperature > 0 else 1},
    )


ABLATED_LOSSES = tuple(loss for loss in typing.get_args(ReplayLoss) if loss != "reverse_kl_k3")
"""The loss families the `loss` factor trains. reverse_kl_k3 trains exactly as reverse_kl_k1
(both take the score-function gradient of the sampled reverse KL; only the logged value
differs): on the default profile the two gave byte-identical drafters, so it would repeat a row."""

FACTORS: dict[str, Callable[[PipelineConfig], list[tuple[str, PipelineConfig]]]] = {
    "loss": lambda cfg: [(loss, _update(cfg, opd={"loss": loss})) for loss in ABLATED_LOSSES],
    "replays": lambda cfg: [
        ("greedy", _replays(cfg, 0.0, 1)),
        ("sampled", _replays(cfg, 1.0, cfg.score.samples)),
    ],
    "rounds": lambda cfg: [(str(n), cfg.model_copy(update={"rounds": n})) for n in (1, 2, 3, 4)],
    # several replays per anchor only differ when sampled, so this factor samples at T=1
    "samples": lambda cfg: [(f"{n} (T=1)", _replays(cfg, 1.0, n)) for n in (1, 2, 4)],
    "gamma": lambda cfg: [
        (f"{g:g}", _update(cfg, opd={"gamma": g})) for g in sorted({0.5, 0.8, 1.0, cfg.opd.gamma})
    ],
}
"""Factor -> its levels as (label, config) around a baseline config."""
DEFAULT_FACTORS = ("loss",)
"""What `opd experiment ablate` varies by default: the loss family, the question the other
factors are secondary to; 4 families x 2 seeds, an estimated 40 min on the default profile (README)."""


def ablation_variants(cfg: PipelineConfig, factors: Sequence[str]) -> list[Variant]:
    """Every level of every factor, in order; a level equal to the baseline is marked default."""
    unknown = [f for f in factors if f not in FACTORS]
    if unknown or not factors:
        raise OpdError(
            f"unknown ablation factor(s) {unknown}; pass --factors as a comma-separated subset "
            f"of {','.join(FACTORS)}"
        )
    base = cfg.model_dump()
    return [
        Variant(factor, level, vcfg, vcfg.model_dump() == base)
        for factor in dict.fromkeys(factors)
        for level, vcfg in FACTORS[factor](cfg)
    ]


def ablate(
    cfg: PipelineConfig,
    ctx: RunContext,
    *,
    factors: Sequence[str] = DEFAULT_FACTORS,
    seeds: int = 2,
    budget: int | None = None,
    budget_ratio: float = 0.25,
    prompts: Dataset | None = None,
    command: str | None = None,
) -> dict[str, Any]:
    """OPD variants, one factor at a time, from opd-vs-sft's warm-up at one drafter budget
    (`budget`, else `budget_ratio` x the warm-up's; split over each variant's rounds), each
    evaluated at T=0 and T=1 for every seed. Returns the result as JSON-able data."""
    if seeds < 1:
        raise OpdError(f"--seeds must be >= 1, got {seeds}")
    variants = ablation_variants(cfg, factors)
    run = _Runner(ctx)
    warm = warm_up(run, cfg, prompts)
    budget = _budget(warm, budget, budget_ratio)
    log.info(
        "[ablate] %d variants x %d seeds from %s, %d row-steps each",
        len(variants),
        seeds,
        warm.drafter.ref,
        budget,
    )
    rows = []
    for v in variants:
        per_seed = []
        for seed in range(cfg.sft.seed, cfg.sft.seed + seeds):
            arm = opd_arm(run, v.cfg, seed, budget, warm, key=f"{v.factor}={v.level}:s{seed}")
            per_seed.append(
                {"seed": seed} | {k: arm[k] for k in ("drafter", "budget_row_steps", "tau")}
            )
        row: dict[str, Any] = {"factor": v.factor, "level": v.level, "default": v.default}
        for t in TEMPERATURES:
            values = [r["tau"][str(t)] for r in per_seed]
            s = suffix(t)
            row |= {f"tau{s}": statistics.fmean(values), f"tau{s}_std": _stats(values)["std"]}
            row[f"tau{s}_per_seed"] = values
        rows.append(row | {"runs": per_seed})
    result: dict[str, Any] = {
        "experiment": "ablate",
        "factors": list(dict.fromkeys(factors)),
        "seeds": list(range(cfg.sft.seed, cfg.sft.seed + seeds)),
        "budget_unit": BUDGET_UNIT,
        "budget_row_steps": budget,
        "k": cfg.drafting.k,
        "temperatures": list(TEMPERATURES),
        "warmup": {
            "drafter": str(warm.drafter.ref),
            "budget_row_steps": warm.budget,
            "tau": warm.tau,
        },
        "rows": rows,
    }
    report = _ablate_report(ctx, run, result, command)
    result["report"] = str(report.ref)
    result["report_md"] = str(report.path / "report.md")
    _save(ctx, run, "ablate", result)
    return result


def _ablation_table(result: dict[str, Any]) -> pl.DataFrame:
    """One row per (variant, seed, temperature): the evaluated tau and the variant's drafter."""
    rows = [
        {
            "factor": row["factor"],
            "level": row["level"],
            "default": row["default"],
            "seed": r["seed"],
            "temperature": t,
            "tau": r["tau"][str(t)],
            "drafter": r["drafter"],
        }
        for row in result["rows"]
        for r in row["runs"]
        for t in TEMPERATURES
    ]
    return pl.DataFrame(rows)


def _ablate_report(
    ctx: RunContext, run: _Runner, result: dict[str, Any], command: str | None
) -> Dataset:
    table = _ablation_table(result)
    labels = [
        f"{r['factor']}={r['level']}" + (" *" if r["default"] else "") for r in result["rows"]
    ]
    labeled = table.with_columns(
        (
            pl.col("factor")
            + "="
            + pl.col("level")
            + pl.when(pl.col("default")).then(pl.lit(" *")).otherwise(pl.lit(""))
        ).alias("label")
    )
    warm = result["warmup"]

    def markdown() -> str:
        lines = [
            "# Draft-OPD ablations, one factor at a time",
            "",
            *([f"Made by `{command}`.", ""] if command else []),
            f"Every variant starts from the SFT warm-up `{warm['drafter']}` (τ "
            f"{warm['tau']['0.0']:.3f} at T=0, {warm['tau']['1.0']:.3f} at T=1) and spends "
            f"**{result['budget_row_steps']:,}** {BUDGET_UNIT} in all, split evenly over its "
            f"rounds; everything not named in a row is the profile's OPD default (`*` marks the "
            f"level equal to it). K={result['k']}, seeds {', '.join(map(str, result['seeds']))}; "
            "τ evaluated on the held-out prompts, mean ± sample std over seeds.",
            "",
            "![tau per variant](ablation.png)",
            "",
            "| factor | level | τ at T=0 | τ at T=1 | T=0 per seed | T=1 per seed |",
            "|---|---|---|---|---|---|",
        ]
        for r in result["rows"]:
            level = r["level"] + (" *" if r["default"] else "")
            per = [
                ", ".join(f"{v:.3f}" for v in r[f"tau{suffix(t)}_per_seed"]) for t in TEMPERATURES
            ]
            lines.append(
                f"| {r['factor']} | {level} | {r['tau']:.3f} ± {r['tau_std']:.3f} "
                f"| {r['tau_t1']:.3f} ± {r['tau_t1_std']:.3f} | {per[0]} | {per[1]} |"
            )
        lines += [
            "",
            "Per seed with the drafters: `ablation.parquet`; per variant: `ablation_summary.parquet`.",
        ]
        return "\n".join(lines)

    config = {
        "experiment": "ablate",
        "factors": result["factors"],
        "seeds": result["seeds"],
        "budget_row_steps": result["budget_row_steps"],
    }
    headline = {"rows": [{k: v for k, v in r.items() if k != "runs"} for r in result["rows"]]}
    return write_report(
        ctx,
        "ablate",
        config,
        run.produced(),
        {
            "ablation": table,
            "ablation_summary": _summary(table, ["factor", "level", "default"]),
        },
        {
            "ablation": lambda: plot_tau(
                labeled,
                labels,
                "Draft-OPD ablations, one factor at a time (* = default)",
                _warm_taus(warm),
                breaks=[
                    i
                    for i, (a, b) in enumerate(itertools.pairwise(result["rows"]), start=1)
                    if a["factor"] != b["factor"]
                ],
            )
        },
        markdown,
        headline,
    )


def ablate_summary_text(result: dict[str, Any]) -> str:
    """What `opd experiment ablate` prints: tau per variant at both temperatures."""
    lines = [
        f"ablate: {len(result['rows'])} variants x {len(result['seeds'])} seed(s), "
        f"{result['budget_row_steps']} row-steps each, K={result['k']} "
        f"(warm-up tau {result['warmup']['tau']['0.0']:.3f} / {result['warmup']['tau']['1.0']:.3f})",
        f"{'variant':<28} {'tau T=0':>16} {'tau T=1':>16}",
    ]
    for r in result["rows"]:
        label = f"{r['factor']}={r['level']}" + (" *" if r["default"] else "")
        lines.append(
            f"{label:<28} {r['tau']:>8.3f} ± {r['tau_std']:<5.3f} {r['tau_t1']:>8.3f} ± {r['tau_t1_std']:<5.3f}"
        )
    lines.append(f"report: {result['report_md']}")
    lines.append(f"saved to {result['saved_to']}")
    return "\n".join(lines)
