"""What every experiment shares: one SFT warm-up, the two arms at a matched drafter budget
(continued SFT and Draft-OPD rounds), their evaluation at T=0 and T=1, and saving the result.

Both arms spend the same drafter budget, counted in drafter forward+backward row-steps: rows of
the training-time-test unroll x unrolled steps (SFT: every token row x ttt_steps; OPD: the rows
up to a sequence's last anchor x the replay depth K). Continued SFT runs the fewest steps whose
row-steps reach the budget; each OPD round gets budget / rounds the same way. Both arms use the
same peak learning rate (`opd.lr`). Target forwards are not in the budget (OPD runs one rollout
and one scoring per round, continued SFT one data rollout); their token counts are reported.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import polars as pl
import torch

from pipeline import chains
from pipeline.chains import Step
from pipeline.core import budget as budget_steps
from pipeline.core import training, validation
from pipeline.core.drafters import METRICS_FILE, load_drafter_dataset
from pipeline.core.runner import RunContext, StageResult, run_stage
from pipeline.core.stage import Stage
from pipeline.profiles import PipelineConfig
from pipeline.stages import evaluate, opd, rollout, sft
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
    index = training.FeatureIndex(data, validation.FEATURE_COLUMNS)
    rows, _ = training.holdout_split(index.keys, cfg.val_share, cfg.seed)

    @functools.cache
    def plan(epoch: int) -> list[int]:
        return budget_steps.step_costs(
            index.lengths, rows, steps_per_row=cfg.unroll_depth, epoch=epoch, cfg=cfg, world_size=1
        )

    return budget_steps.steps_for_budget(budget, lambda s: nth_step(plan, s))


def nth_step(plan: Callable[[int], list[int]], step: int) -> int:
    """The value of optimizer step `step` when the trainer runs epoch 0, 1, ... end to end;
    `plan(epoch)` lists one value per batch (epochs may differ in length)."""
    epoch, index = training.epoch_position(lambda e: len(plan(e)), step)
    return plan(epoch)[index]


def seed_stats(values: list[float]) -> dict[str, Any]:
    return {
        "mean": statistics.fmean(values),
        "std": statistics.stdev(values) if len(values) > 1 else 0.0,
        "min": min(values),
        "max": max(values),
        "per_seed": values,
    }


def val_curve(ds: Dataset) -> list[dict[str, Any]]:
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


class Runner:
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


@dataclass(frozen=True)
class WarmupPrompts:
    """The prompts datasets an experiment's warm-up reads (`warm_up` says what each changes);
    None: the warm-up's own."""

    prompts: Dataset | None = None  # instead of running the prompts stage
    eval_prompts: Dataset | None = None
    eval_max_prompts: int | None = None
    rollout_prompts: Dataset | None = None


@dataclass
class Warmup:
    """The shared start of every arm and variant: its prompts, features and SFT drafter."""

    prompts: Dataset
    features: Dataset
    drafter: Dataset
    budget: int  # row-steps the warm-up's own training ran
    tau: dict[str, float]  # evaluated, by temperature
    alpha: dict[str, list[float]]  # evaluated acceptance per draft offset, by temperature
    free_baseline: dict[str, Any]  # the training-free baseline's τ on the same prompts, by T
    by_set: dict[str, dict[str, float]]  # evaluated τ per held-out set, by temperature
    eval_prompts: Dataset  # whose held-out split every evaluation decodes (default: `prompts`)
    eval_config: evaluate.Config  # how (cfg.evaluate, with the experiment's own prompt count)
    rollout_prompts: Dataset  # whose train split the arms' fresh sequences come from (`prompts`)


def warm_up(run: Runner, cfg: PipelineConfig, given: WarmupPrompts) -> Warmup:
    """The SFT chain's prompts -> generate -> features -> sft (cached with `opd run full`'s),
    on `given.prompts` when set instead of the prompts stage's.

    `eval_prompts`: evaluate decodes this prompts dataset's held-out split instead of the warm-up
    prompts' own (benchmark sets the training prompts do not hold; `check_eval_prompts`), the
    first `eval_max_prompts` of each set (default `evaluate.max_prompts`, which also sizes the
    held-out validation sequences: `heldout_config`). `rollout_prompts`: the Draft-OPD rounds
    and continued SFT's fresh sequences draw on this prompts dataset's train split instead of
    the warm-up prompts' (prompts SFT never saw; `check_rollout_prompts`)."""
    if cfg.rounds < 1:
        raise OpdError("the experiment needs rounds >= 1 (Draft-OPD rounds); set --set rounds=2")
    steps = chains.sft_chain(cfg)[:-1]
    prompts = given.prompts
    if prompts is None:
        prompts = run.chain(steps[:1], {})["prompts"]
    ecfg = cfg.evaluate
    if given.eval_max_prompts is not None:
        ecfg = ecfg.model_copy(update={"max_prompts": given.eval_max_prompts})
    eval_prompts = given.eval_prompts
    if eval_prompts is None:
        eval_prompts = prompts
    else:  # before the warm-up trains, not after
        check_eval_prompts(eval_prompts, prompts, ecfg)
    rollout_prompts = given.rollout_prompts
    if rollout_prompts is None:
        rollout_prompts = prompts
    else:
        check_rollout_prompts(rollout_prompts, prompts, eval_prompts, ecfg)
    external = {"prompts": prompts}
    out = run.chain(steps[1:], external) | external
    drafter = out["sft"]
    evaluated = evaluate_drafter(run, "warmup", ecfg, eval_prompts, drafter)
    return Warmup(
        out["prompts"],
        out["features"],
        drafter,
        sft_budget(drafter),
        evaluated["tau"],
        evaluated["alpha"],
        evaluated["free_baseline"],
        evaluated["by_set"],
        eval_prompts,
        ecfg,
        rollout_prompts,
    )


def check_eval_prompts(
    eval_prompts: Dataset, train_prompts: Dataset, ecfg: evaluate.Config
) -> None:
    """Refuse held-out prompts that the training prompts hold: τ measured on them would not be
    held out (the drafters train on the target's continuations of every training prompt)."""
    held = {tuple(ids) for ids in evaluate.prompt_ids(eval_prompts, ecfg)}
    shared = len(held & _train_prompts(train_prompts))
    if shared:
        raise OpdError(
            f"{shared} of the {len(held)} prompts evaluate would decode from {eval_prompts.ref}'s "
            f"{ecfg.split!r} split are training prompts of {train_prompts.ref}: pass evaluation "
            "prompts whose held-out sets the training prompts do not hold (e.g. made with "
            "prompts.heldout_sets=[mt_bench,gsm8k,humaneval])"
        )


def check_rollout_prompts(
    rollout_prompts: Dataset, train_prompts: Dataset, eval_prompts: Dataset, ecfg: evaluate.Config
) -> None:
    """Refuse rollout prompts the warm-up trained on or evaluation decodes. Fresh prompts are
    their point: at T=0 a rollout of a training prompt repeats the SFT sequence token for token,
    and an arm trained on an evaluated prompt would make its τ not held out."""
    fresh = _train_prompts(rollout_prompts)
    if not fresh:
        raise OpdError(
            f"{rollout_prompts.ref} has no 'train' split rows for the rollouts to draw on: pass "
            "a prompts dataset made by the prompts stage (e.g. prompts.seed=1 for other draws)"
        )
    held = {tuple(ids) for ids in evaluate.prompt_ids(eval_prompts, ecfg)}
    for other, what in (
        (_train_prompts(train_prompts), f"training prompts of the warm-up's {train_prompts.ref}"),
        (held, f"prompts evaluate decodes from {eval_prompts.ref}"),
    ):
        if shared := len(fresh & other):
            raise OpdError(
                f"{shared} of the {len(fresh)} train prompts of {rollout_prompts.ref} are {what}: "
                "pass rollout prompts that neither trains nor evaluates on (e.g. the prompts "
                "stage with another prompts.seed)"
            )


def _train_prompts(prompts: Dataset) -> set[tuple[int, ...]]:
    """The token ids of a prompts dataset's train split."""
    rows = prompts.scan().filter(pl.col("split") == "train").select("prompt_ids").collect()
    return {tuple(ids) for ids in rows["prompt_ids"].to_list()}


def evaluate_drafter(
    run: Runner, key: str, ecfg: evaluate.Config, prompts: Dataset, drafter: Dataset
) -> dict[str, dict[str, Any]]:
    """{"tau": tau, "alpha": acceptance per draft offset (chain position or block slot),
    "by_set": τ per held-out set (empty when the prompts name none), "free_baseline": the
    training-free baseline's τ on the same prompts (prompt lookup, when evaluate measured it:
    `evaluate.free_baseline`)}, each by temperature, decoding the held-out prompts."""
    out: dict[str, dict[str, Any]] = {"tau": {}, "alpha": {}, "free_baseline": {}, "by_set": {}}
    for t in TEMPERATURES:
        # no plain-decoding timing, no untrained-drafter contrast (the warm-up is it)
        at_t = ecfg.model_copy(
            update={"temperature": t, "measure_baseline": False, "untrained_contrast": False}
        )
        meta = run.stage(
            f"{key}:eval-T{t}", evaluate.STAGE, at_t, {"prompts": prompts, "drafter": drafter}
        ).meta
        out["tau"][str(t)], out["alpha"][str(t)] = meta["tau"], meta["alpha"]
        out["by_set"][str(t)] = {name: one["tau"] for name, one in meta.get("by_set", {}).items()}
        if "free_baseline" in meta:
            free = meta["free_baseline"]
            out["free_baseline"][str(t)] = {"title": free["title"], "tau": free["tau"]}
    return out


MAX_BUDGET_RATIO = 1000.0
"""An arm spending a thousand warm-ups is beyond any study here (days on the default profile),
so a larger ratio is a typo; bounding it also keeps ratio x budget a finite float."""
MAX_SEED = 2**32 - 1
"""Every stage's seeds derive from an arm's seed (the rollout's per-batch seeds multiply it by
1,000,003, and torch takes seeds below 2**64); 2**32 - 1 is the range seeds usually take."""


def check_arm_options(
    cfg: PipelineConfig,
    *,
    seeds: int,
    budget: int | None,
    budget_ratio: float,
    first_seed: int | None = None,
    sft_data_temperature: float | None = None,
) -> None:
    """Refuse, before the warm-up runs, options the arms could only fail on after it (or, for
    the temperature, after writing part of a rollout)."""
    # The Draft-OPD rounds' steps are built only after the warm-up and the SFT arm; building
    # them now runs their checks first (rollout and score refuse typical acceptance).
    chains.opd_rounds(cfg)
    if seeds < 1:
        raise OpdError(f"--seeds must be >= 1, got {seeds}")
    if budget is not None and budget < 1:
        raise OpdError(f"--budget must be >= 1 drafter row-step, got {budget}")
    if not (math.isfinite(budget_ratio) and 0 < budget_ratio <= MAX_BUDGET_RATIO):
        raise OpdError(
            f"--budget-ratio must be a finite number in (0, {MAX_BUDGET_RATIO:g}], got "
            f"{budget_ratio:g}: the share of the warm-up's row-steps each arm spends"
        )
    if first_seed is not None and not 0 <= first_seed <= MAX_SEED - seeds + 1:
        raise OpdError(
            f"--first-seed and --seeds must keep every seed below {MAX_SEED + 1} and >= 0, got "
            f"seeds {first_seed} .. {first_seed + seeds - 1}"
        )
    t = sft_data_temperature
    if t is not None and not (math.isfinite(t) and t >= 0):
        raise OpdError(f"sft_data_temperature must be a finite number >= 0 (0: greedy), got {t:g}")


def arm_budget(warm: Warmup, budget: int | None, budget_ratio: float) -> int:
    """Row-steps per arm: `budget`, else `budget_ratio` x the warm-up's (`check_arm_options`
    has bounded both)."""
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
            "keep_teacher": None,  # validation reads its sequences only
        }
    )


def heldout_sequences(run: Runner, cfg: PipelineConfig, warm: Warmup) -> Dataset:
    """The warm-up drafter's greedy rollout of the prompts evaluate decodes (`heldout_config`):
    the sequences every arm and variant validates on. One function for opd-vs-sft and ablate,
    so an ablation's default variant is opd-vs-sft's Draft-OPD arm, the same dataset."""
    return run.stage(
        "heldout",
        rollout.STAGE,
        heldout_config(cfg),
        {"prompts": warm.prompts, "drafter": warm.drafter},
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
            "keep_teacher": None,  # SFT reads its sequences only
            "new_prompts_each_round": False,
            "max_prompts": per_round * cfg.rounds
            if cfg.rollout.new_prompts_each_round
            else per_round,
        }
    )


def opd_arm(
    run: Runner,
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
    external = {"prompts": warm.rollout_prompts, "sft": warm.drafter, "features": warm.features}
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
        # what each round's scoring took, which a weak drafter's few accepted positions can
        # hold below what `score.accepted_share` asks for
        "anchors": [
            {
                "rejected": out[f"score-r{r}"].meta.get("rejected_anchors", 0),
                "accepted": out[f"score-r{r}"].meta.get("accepted_anchors", 0),
            }
            for r in n
        ],
        "rollout_tau": [d.meta.get("tau") for d in rollouts],
        "rollout_tokens": [d.meta.get("tokens") for d in rollouts],
        **evaluate_drafter(run, f"{key}:opd", warm.eval_config, warm.eval_prompts, final),
        "val": [val_curve(d) for d in opd_sets if d.meta.get("trained")],
        "heldout_curve": curve,
    }


def sft_arm(
    run: Runner,
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
        {"prompts": warm.rollout_prompts, "drafter": warm.drafter},
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
        **evaluate_drafter(
            run, f"s{seed}:sft-continued", warm.eval_config, warm.eval_prompts, cont
        ),
        "val": val_curve(cont),
        "heldout_curve": [p | {"round": None} for p in heldout_curve(cont, warm.budget)],
    }


def measure_speed(
    ctx: RunContext, ecfg: evaluate.Config, prompts: Dataset, drafters: dict[str, Dataset]
) -> dict[str, dict[str, dict[str, float]]]:
    """{arm: {temperature: speedup, tau, tokens/s of both decoders}}: each drafter decodes the
    held-out prompts as evaluate does, with plain target decoding timed prompt by prompt in
    the same loop, so every ratio is measured side by side. Wall-clock numbers differ between
    runs and machines, so they are measured here, never cached in a dataset."""
    target = ctx.target_loader.target
    loaded = {
        arm: load_drafter_dataset(ds, target, ctx.target_loader.identity)
        for arm, ds in drafters.items()
    }
    out: dict[str, dict[str, dict[str, float]]] = {arm: {} for arm in drafters}
    for t in TEMPERATURES:
        at_t = ecfg.model_copy(
            update={"temperature": t, "measure_baseline": True, "untrained_contrast": False}
        )
        ids = evaluate.prompt_ids(prompts, at_t)
        for arm, drafter in loaded.items():
            torch.manual_seed(at_t.seed)
            stats = evaluate.summarize(
                evaluate.evaluate(target, drafter, ids, at_t), at_t, len(ids)
            )
            out[arm][str(t)] = {
                name: stats[name]
                for name in ("speedup", "tau", "tokens_per_s", "baseline_tokens_per_s")
            }
            log.info(
                "[experiment] speed %s T=%s: %.2fx plain decoding (tau %.3f)",
                arm,
                t,
                stats["speedup"],
                stats["tau"],
            )
    return out


def save_result(ctx: RunContext, run: Runner, kind: str, result: dict[str, Any]) -> None:
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
