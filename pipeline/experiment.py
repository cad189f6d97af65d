"""`opd experiment opd-vs-sft`: after an SFT warm-up, does Draft-OPD beat continued SFT at matched compute?

From ONE SFT warm-up (the full chain's own prompts -> generate -> features -> sft steps, so their
cached datasets are shared with `opd run full`), for each seed:

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
T=1 with the same K (the evaluate stage, same seed for every arm). The result holds tau per
temperature per arm, per seed and mean/std/min/max over seeds, each arm's budget, and the
validation curves (teacher-forced simulated tau per validation step) that show a plateau.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import statistics
from typing import Any

import polars as pl

from pipeline import chains, evaluate, opd, rollout, sft, training
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
    """Validation rows of a drafter dataset: step, teacher-forced tau_sim and loss."""
    m = pl.read_parquet(ds.file(METRICS_FILE)).filter(pl.col("kind") == "val")
    return [
        {"step": r["step"], "tau_sim": r["tau_sim"], "loss": r["loss"]}
        for r in m.select("step", "tau_sim", "loss").iter_rows(named=True)
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


def opd_vs_sft(
    cfg: PipelineConfig,
    ctx: RunContext,
    *,
    seeds: int = 2,
    first_seed: int | None = None,
    budget: int | None = None,
    budget_ratio: float = 1.0,
    sft_data_temperature: float | None = None,
    prompts: Dataset | None = None,
) -> dict[str, Any]:
    """Run the experiment (see the module docstring); returns the result as JSON-able data.

    `budget` (row-steps per arm) defaults to `budget_ratio` x the warm-up's own budget.
    `prompts`: use this dataset instead of running the prompts stage. `first_seed` (default
    `sft.seed`) lets separate processes run disjoint seeds against one root; a later run over
    all seeds reuses their datasets.
    """
    if seeds < 1:
        raise OpdError(f"--seeds must be >= 1, got {seeds}")
    if cfg.rounds < 1:
        raise OpdError("the experiment needs rounds >= 1 (Draft-OPD rounds for arm b)")
    if not budget_ratio > 0 or (budget is not None and budget < 1):
        raise OpdError("the budget must be positive: set --budget N or --budget-ratio R > 0")
    run = _Runner(ctx)
    warm_steps = chains.sft_chain(cfg)[:-1]  # prompts, generate, features, sft
    external: dict[str, Dataset] = {}
    if prompts is not None:
        warm_steps, external = warm_steps[1:], {"prompts": prompts}
    warm = run.chain(warm_steps, external) | external
    prompts, feats, warmup = warm["prompts"], warm["features"], warm["sft"]
    warm_budget = sft_budget(warmup)
    budget = budget or max(1, round(budget_ratio * warm_budget))
    log.info(
        "[experiment] warm-up %s spent %d row-steps; each arm gets %d",
        warmup.ref,
        warm_budget,
        budget,
    )
    result: dict[str, Any] = {
        "experiment": "opd-vs-sft",
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
        "warmup": {
            "drafter": str(warmup.ref),
            "budget_row_steps": warm_budget,
            "tau": _evaluate(run, "warmup", cfg, prompts, warmup),
            "val": _val_curve(warmup),
        },
        "seeds": [],
    }
    first = cfg.sft.seed if first_seed is None else first_seed
    for seed in range(first, first + seeds):
        result["seeds"].append(
            _one_seed(run, cfg, seed, budget, sft_data_temperature, prompts, feats, warmup)
        )

    for arm in ("sft_continued", "opd"):
        result[f"tau_{arm}"] = {
            str(t): _stats([s[arm]["tau"][str(t)] for s in result["seeds"]]) for t in TEMPERATURES
        }
    result["tau_sft_warmup"] = result["warmup"]["tau"]
    result["opd_over_sft_continued"] = {
        str(t): result["tau_opd"][str(t)]["mean"] / result["tau_sft_continued"][str(t)]["mean"]
        for t in TEMPERATURES
    }
    produced = {k: r.ref for k, r in run.results.items() if r.dataset is not None}
    ctx.store.record_run(ctx.run_name, produced)
    key = hashlib.sha256(
        canonical_json({k: str(v) for k, v in produced.items()}).encode()
    ).hexdigest()[:12]
    path = ctx.store.root / "_experiments" / f"opd-vs-sft-{key}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    result["saved_to"] = str(path)
    path.write_text(json.dumps(result, indent=2))
    return result


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


def _one_seed(
    run: _Runner,
    cfg: PipelineConfig,
    seed: int,
    budget: int,
    sft_data_temperature: float | None,
    prompts: Dataset,
    feats: Dataset,
    warmup: Dataset,
) -> dict[str, Any]:
    # (a) continued SFT on target sequences, from the warm-up drafter
    data_cfg = sft_data_config(cfg, seed, sft_data_temperature)
    data = run.stage(
        f"s{seed}:sft-data", rollout.STAGE, data_cfg, {"prompts": prompts, "drafter": warmup}
    )
    sft_cfg = cfg.sft.model_copy(update={"seed": seed, "lr": cfg.opd.lr, "epochs": None})
    steps = sft_steps_for_budget([data, feats], sft_cfg, budget)
    # a few validations along the way show whether continued SFT still improves
    sft_cfg = sft_cfg.model_copy(update={"steps": steps, "val_every": max(1, steps // 4)})
    cont = run.stage(
        f"s{seed}:sft-continued",
        sft.STAGE,
        sft_cfg,
        {"features": data, "more_features": feats, "drafter": warmup},
    )

    # (b) Draft-OPD rounds; a greedy rollout does not depend on the seed, so it is shared
    per_round = max(1, round(budget / cfg.rounds))
    seeded = cfg.model_copy(
        update={
            "rollout": cfg.rollout.model_copy(
                update={"seed": _rollout_seed(cfg.rollout.temperature, seed, cfg)}
            ),
            "score": cfg.score.model_copy(update={"seed": seed}),
            "opd": cfg.opd.model_copy(
                update={"seed": seed, "budget_row_steps": per_round, "steps": None}
            ),
        }
    )
    rounds = chains.opd_rounds(seeded)
    out = run.chain(
        rounds, {"prompts": prompts, "sft": warmup, "features": feats}, prefix=f"s{seed}:"
    )
    final = out[rounds[-1].key]
    opd_sets = [out[f"opd-r{r}"] for r in range(1, cfg.rounds + 1)]
    rollouts = [out[f"rollout-r{r}"] for r in range(1, cfg.rounds + 1)]
    return {
        "seed": seed,
        "sft_continued": {
            "drafter": str(cont.ref),
            "data": str(data.ref),
            "steps": sft_cfg.steps,
            "budget_row_steps": sft_budget(cont),
            "data_rollout_tokens": data.meta.get("tokens"),
            "tau": _evaluate(run, f"s{seed}:sft-continued", cfg, prompts, cont),
            "val": _val_curve(cont),
        },
        "opd": {
            "drafter": str(final.ref),
            "drafters": [str(d.ref) for d in opd_sets],
            "steps": [d.meta.get("steps") for d in opd_sets],
            "budget_row_steps": int(sum(d.meta.get("budget_row_steps", 0) for d in opd_sets)),
            "replays": [out[f"score-r{r}"].meta.get("replays") for r in range(1, cfg.rounds + 1)],
            "rollout_tau": [d.meta.get("tau") for d in rollouts],
            "rollout_tokens": [d.meta.get("tokens") for d in rollouts],
            "tau": _evaluate(run, f"s{seed}:opd", cfg, prompts, final),
            "val": [_val_curve(d) for d in opd_sets if d.meta.get("trained")],
        },
    }


def summary_text(result: dict[str, Any]) -> str:
    """A short human-readable table of the result."""
    lines = [
        f"opd-vs-sft: K={result['k']}, {result['rounds']} OPD round(s), "
        f"{len(result['seeds'])} seed(s), budget {result['budget_row_steps']} row-steps per arm",
        f"  ({result['budget_unit']})",
        f"{'T':>5} {'warm-up':>9} {'cont. SFT':>18} {'Draft-OPD':>18} {'OPD/SFT':>8}",
    ]
    for t in map(str, result["temperatures"]):
        s, o = result["tau_sft_continued"][t], result["tau_opd"][t]
        lines.append(
            f"{t:>5} {result['tau_sft_warmup'][t]:>9.3f} {s['mean']:>10.3f} ± {s['std']:<5.3f} "
            f"{o['mean']:>10.3f} ± {o['std']:<5.3f} {result['opd_over_sft_continued'][t]:>8.3f}"
        )
    lines.append(f"saved to {result['saved_to']}")
    return "\n".join(lines)
