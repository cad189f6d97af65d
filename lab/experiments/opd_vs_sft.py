"""`opd experiment opd-vs-sft`: Draft-OPD against continued SFT at matched compute, from one SFT
warm-up (budgets and arms: lab/experiments/common.py).

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

Both arms spend the same drafter budget in row-steps (how it is counted: common.py).

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
"""

from __future__ import annotations

import logging
import statistics
from typing import Any

import polars as pl

from lab.experiments.common import (
    ARM_NAMES,
    ARMS,
    BUDGET_UNIT,
    TEMPERATURES,
    Runner,
    Warmup,
    WarmupPrompts,
    arm_budget,
    check_arm_options,
    heldout_sequences,
    measure_speed,
    opd_arm,
    save_result,
    seed_stats,
    sft_arm,
    suffix,
    val_curve,
    warm_up,
)
from lab.experiments.report import (
    COLORS,
    fmt_stats,
    plot_tau,
    tau_summary,
    warm_taus,
    write_report,
)
from models.draft_length import tau_change_by_offset
from pipeline.core.report import figure, md_table, png
from pipeline.core.runner import RunContext
from pipeline.profiles import PipelineConfig
from storage import Dataset

log = logging.getLogger("opd")


def opd_vs_sft(
    cfg: PipelineConfig,
    ctx: RunContext,
    *,
    seeds: int = 3,
    first_seed: int | None = None,
    budget: int | None = None,
    budget_ratio: float = 1.0,
    sft_data_temperature: float | None = None,
    prompts: WarmupPrompts = WarmupPrompts(),
    command: str | None = None,
    speed: bool = False,
) -> dict[str, Any]:
    """Run the experiment (see the module docstring); returns the result as JSON-able data.

    `budget` (row-steps per arm) defaults to `budget_ratio` x the warm-up's own budget.
    `prompts` go to `warm_up`, which says what each changes. `first_seed` (default
    `sft.seed`) lets separate processes run disjoint seeds against one root; a later run over
    all seeds reuses their datasets. `command`: the command line to quote in the report.
    `speed`: also time the first seed's drafters against plain decoding (`measure_speed`).
    """
    check_arm_options(
        cfg,
        seeds=seeds,
        budget=budget,
        budget_ratio=budget_ratio,
        first_seed=first_seed,
        sft_data_temperature=sft_data_temperature,
    )
    run = Runner(ctx)
    warm = warm_up(run, cfg, prompts)
    budget = arm_budget(warm, budget, budget_ratio)
    log.info(
        "[experiment] warm-up %s spent %d row-steps; each arm gets %d",
        warm.drafter.ref,
        warm.budget,
        budget,
    )
    heldout = heldout_sequences(run, cfg, warm)
    runs = []
    first = cfg.sft.seed if first_seed is None else first_seed
    for seed in range(first, first + seeds):
        runs.append(
            {
                "seed": seed,
                "sft_continued": sft_arm(
                    run, cfg, seed, budget, sft_data_temperature, warm, heldout
                ),
                "opd": opd_arm(run, cfg, seed, budget, warm, key=f"s{seed}", heldout=heldout),
            }
        )

    result: dict[str, Any] = {"experiment": "opd-vs-sft", **_headline(runs, warm)}
    result["by_set"] = _by_set(runs, warm)
    result |= {
        "seeds": [r["seed"] for r in runs],
        "budget_unit": BUDGET_UNIT,
        "budget_row_steps": budget,
        "k": cfg.drafting.k,
        "drafter_kind": cfg.drafter.kind,
        "temperatures": list(TEMPERATURES),
        "rounds": cfg.rounds,
        "opd_train_temperature": cfg.rollout.temperature,
        "sft_data_temperature": cfg.rollout.temperature
        if sft_data_temperature is None
        else sft_data_temperature,
        "lr": cfg.opd.lr,
        "heldout_prompts": warm.eval_config.max_prompts,
        "eval_prompts": str(warm.eval_prompts.ref),
        "rollout_prompts": str(warm.rollout_prompts.ref),
        "heldout_sequences": str(heldout.ref),
        "warmup": _warmup_record(warm),
        "runs": runs,
    }
    if speed:
        first_run = runs[0]
        arms = {"sft_warmup": warm.drafter} | {
            arm: ctx.store.open(first_run[arm]["drafter"]) for arm in ARMS
        }
        result["speed"] = {
            "seed": first_run["seed"],
            "arms": measure_speed(ctx, warm.eval_config, warm.eval_prompts, arms),
        }
    report = _opd_vs_sft_report(ctx, run, result, command)
    result["report"] = str(report.ref)
    result["report_md"] = str(report.path / "report.md")
    save_result(ctx, run, "opd-vs-sft", result)
    return result


def _warmup_record(warm: Warmup) -> dict[str, Any]:
    """The warm-up as the result records it: its datasets, budget, evaluation and validations."""
    return {
        "drafter": str(warm.drafter.ref),
        "prompts": str(warm.prompts.ref),
        "budget_row_steps": warm.budget,
        "tau": warm.tau,
        "alpha": warm.alpha,
        "free_baseline": warm.free_baseline,
        "by_set": warm.by_set,
        "val": val_curve(warm.drafter),
    }


def _headline(runs: list[dict[str, Any]], warm: Warmup) -> dict[str, Any]:
    """tau per arm and temperature (mean, per seed, std) and OPD / continued SFT."""
    out: dict[str, Any] = {}
    for t in TEMPERATURES:
        s = suffix(t)
        for arm in ARMS:
            values = [r[arm]["tau"][str(t)] for r in runs]
            out[f"tau_{arm}{s}"] = statistics.fmean(values)
            out[f"tau_{arm}{s}_per_seed"] = values
            out[f"tau_{arm}{s}_std"] = seed_stats(values)["std"]
        out[f"opd_over_sft_continued{s}"] = out[f"tau_opd{s}"] / out[f"tau_sft_continued{s}"]
        out[f"opd_over_sft_continued{s}_per_seed"] = [
            r["opd"]["tau"][str(t)] / r["sft_continued"]["tau"][str(t)] for r in runs
        ]
        out[f"tau_sft_warmup{s}"] = warm.tau[str(t)]
    return out


def _by_set(runs: list[dict[str, Any]], warm: Warmup) -> dict[str, dict[str, dict[str, Any]]]:
    """{T: {held-out set: τ of the warm-up, each arm's mean and per-seed τ, OPD / continued
    SFT}}: the headline per benchmark (empty where the prompts name no sets)."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for t in map(str, TEMPERATURES):
        out[t] = {}
        for name, warm_tau in warm.by_set.get(t, {}).items():
            row: dict[str, Any] = {"sft_warmup": warm_tau}
            for arm in ARMS:
                row[f"{arm}_per_seed"] = [r[arm]["by_set"][t][name] for r in runs]
                row[arm] = statistics.fmean(row[f"{arm}_per_seed"])
            row["opd_over_sft_continued"] = row["opd"] / row["sft_continued"]
            out[t][name] = row
    return out


def _set_table(result: dict[str, Any]) -> pl.DataFrame:
    """One row per (held-out set, temperature): the warm-up's τ, each arm's mean over seeds
    and OPD / continued SFT."""
    rows = [
        {
            "set": name,
            "temperature": float(t),
            "tau_sft_warmup": row["sft_warmup"],
            "tau_sft_continued": row["sft_continued"],
            "tau_opd": row["opd"],
            "opd_over_sft_continued": row["opd_over_sft_continued"],
        }
        for t, sets in result["by_set"].items()
        for name, row in sets.items()
    ]
    schema = {
        "set": pl.String,
        "temperature": pl.Float64,
        "tau_sft_warmup": pl.Float64,
        "tau_sft_continued": pl.Float64,
        "tau_opd": pl.Float64,
        "opd_over_sft_continued": pl.Float64,
    }
    return pl.DataFrame(rows, schema=schema)


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


def _alpha_table(result: dict[str, Any]) -> pl.DataFrame:
    """Mean over seeds of the evaluated acceptance at each draft offset (1 = the first drafted
    token: a chain's first step, a block's first slot), one row per (arm, temperature)."""
    rows = [
        {"arm": "sft_warmup", "seed": None, "temperature": t, "offset": k + 1, "alpha": a}
        for t in TEMPERATURES
        for k, a in enumerate(result["warmup"]["alpha"][str(t)])
    ]
    rows += [
        {"arm": arm, "seed": r["seed"], "temperature": t, "offset": k + 1, "alpha": a}
        for r in result["runs"]
        for arm in ARMS
        for t in TEMPERATURES
        for k, a in enumerate(r[arm]["alpha"][str(t)])
    ]
    schema = {
        "arm": pl.String,
        "seed": pl.Int64,
        "temperature": pl.Float64,
        "offset": pl.Int64,
        "alpha": pl.Float64,
    }
    return (
        pl.DataFrame(rows, schema=schema)
        .group_by("arm", "temperature", "offset", maintain_order=True)
        .agg(pl.col("alpha").mean().round(3))
        .pivot("offset", index=["arm", "temperature"], values="alpha")
        .rename(lambda c: c if c in ("arm", "temperature") else f"alpha_{c}")
        .sort("temperature", maintain_order=True)
    )


TAU_CHANGES = (("sft_continued", "sft_warmup"), ("opd", "sft_warmup"), ("opd", "sft_continued"))
"""(after, before) pairs whose change of tau the report splits over draft offsets."""


def _mean_alphas(result: dict[str, Any]) -> dict[tuple[str, float], list[float]]:
    """Each arm's acceptance per offset (mean over seeds) at each temperature, over all K
    offsets: an offset decoding never reached accepted nothing there (0)."""
    k = result["k"]

    def padded(alpha: list[float]) -> list[float]:
        return [*alpha, *[0.0] * (k - len(alpha))][:k]

    out = {("sft_warmup", t): padded(result["warmup"]["alpha"][str(t)]) for t in TEMPERATURES}
    for arm in ARMS:
        for t in TEMPERATURES:
            per_seed = [padded(r[arm]["alpha"][str(t)]) for r in result["runs"]]
            out[arm, t] = [statistics.fmean(column) for column in zip(*per_seed, strict=True)]
    return out


def _tau_change_table(result: dict[str, Any]) -> pl.DataFrame:
    """The change of tau between arms, split over the draft offsets that carry it
    (`tau_change_by_offset`), from each arm's mean acceptance per offset."""
    alphas = _mean_alphas(result)
    rows = []
    for t in TEMPERATURES:
        for after, before in TAU_CHANGES:
            shares = tau_change_by_offset(alphas[before, t], alphas[after, t])
            rows.append(
                {"temperature": t, "change": f"{ARM_NAMES[after]} − {ARM_NAMES[before]}"}
                | {f"offset_{i + 1}": round(v, 4) for i, v in enumerate(shares)}
                | {"total": round(sum(shares), 4)}
            )
    return pl.DataFrame(rows)


def _speed_table(result: dict[str, Any]) -> pl.DataFrame:
    """One row per (arm, temperature) of the speed measurement (empty unless the recipe sets `speed`)."""
    arms = result.get("speed", {}).get("arms", {})
    rows = [
        {"arm": arm, "temperature": float(t)} | stats
        for arm, by_t in arms.items()
        for t, stats in by_t.items()
    ]
    schema = {
        "arm": pl.String,
        "temperature": pl.Float64,
        "speedup": pl.Float64,
        "tau": pl.Float64,
        "tokens_per_s": pl.Float64,
        "baseline_tokens_per_s": pl.Float64,
    }
    return pl.DataFrame(rows, schema=schema)


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
    fig = figure(11.0, 4.8)
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
            color = COLORS[arm]
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
            color=COLORS["sft_warmup"],
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
    return png(fig)


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


def _markdown(
    result: dict[str, Any],
    tau: pl.DataFrame,
    by_set: pl.DataFrame,
    alpha: pl.DataFrame,
    changes: pl.DataFrame,
    plateau: pl.DataFrame,
    speed: pl.DataFrame,
    command: str | None,
) -> str:
    """report.md: the headline table, the plateau evidence and the datasets behind them."""
    warm = result["warmup"]
    lines = [
        "# Draft-OPD vs continued SFT at matched compute",
        "",
        *([f"Made by `{command}`.", ""] if command else []),
        f"K={result['k']}, {result['rounds']} Draft-OPD round(s), seeds "
        f"{', '.join(map(str, result['seeds']))}, lr {result['lr']:g}. Each arm spends "
        f"**{result['budget_row_steps']:,}** {BUDGET_UNIT}; the SFT warm-up "
        f"`{warm['drafter']}` spent {warm['budget_row_steps']:,}. τ is evaluated on the first "
        f"{result['heldout_prompts']} held-out prompts (of each held-out set) of "
        f"`{result['eval_prompts']}`. Both arms' fresh sequences come from the train split of "
        f"`{result['rollout_prompts']}`"
        + (
            " (the warm-up's own)."
            if result["rollout_prompts"] == warm["prompts"]
            else ", prompts the warm-up never trained on."
        ),
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
            f"| {fmt_stats(result[f'tau_sft_continued{s}_per_seed'])} "
            f"| {fmt_stats(result[f'tau_opd{s}_per_seed'])} "
            f"| {result[f'opd_over_sft_continued{s}']:.3f} | {ratios} |"
        )
    free = warm.get("free_baseline") or {}
    if free:
        title = next(iter(free.values()))["title"]
        taus = ", ".join(
            f"{free[str(t)]['tau']:.3f} at T={t:g}" for t in TEMPERATURES if str(t) in free
        )
        lines += ["", f"Beside them, {title} (needs no training) on the same prompts: τ {taus}."]
    lines += [
        "",
        "Mean ± sample std over seeds; per-seed values in `tau.parquet` (below).",
        "",
        "![tau per arm](tau.png)",
        "",
        md_table(tau),
        "",
        *_set_lines(by_set),
        *_offset_lines(alpha, changes),
        *_speed_lines(result, speed),
        "## Where SFT plateaus: held-out τ against drafter row-steps",
        "",
        "Both arms validate on the same held-out sequences, which neither trains on: the "
        f"target's greedy continuations (`{result['heldout_sequences']}`) of "
        f"{_curve_prompts(result)}. Lines: teacher-forced τ of the drafter at each validation (thin: "
        "one seed; thick: mean over seeds), at the row-steps spent so far (OPD cumulative "
        "over its rounds); squares: the evaluated τ (real decoding) of each arm's final "
        "drafter; diamond: the warm-up's. The teacher-forced τ (per-step acceptance over "
        "every position of the sequences) and the decoded τ (over the positions where "
        "decoding's blocks start) differ in level: compare slopes along a line, and "
        "squares with each other.",
        "",
        "![held-out tau vs row-steps](plateau.png)",
        "",
        md_table(plateau),
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


def _curve_prompts(result: dict[str, Any]) -> str:
    """Which prompts the held-out curve continues, against the ones evaluate decodes."""
    own = result["warmup"]["prompts"]
    if result["eval_prompts"] == own:
        return "the prompts evaluate decodes"
    return (
        f"the held-out prompts of the warm-up's `{own}`, while evaluate decodes "
        f"`{result['eval_prompts']}`'s (the recipe's `eval_prompts`): the lines and the squares are on "
        "different prompts"
    )


def _offset_lines(alpha: pl.DataFrame, changes: pl.DataFrame) -> list[str]:
    """report.md's acceptance per draft offset and the offsets that carry τ's changes."""
    return [
        "## Acceptance by draft offset",
        "",
        "alpha_k: of the drafts decoding reached at offset k (a chain's k-th step, a block's "
        "k-th slot), the share the target accepted; the same held-out decoding as τ, mean over "
        "seeds (`alpha.parquet`). Where an arm gains shows here: early offsets lift every "
        "step, late ones only the steps that got that far.",
        "",
        md_table(alpha),
        "",
        "Which offsets carry the change of τ between arms (`tau_changes.parquet`): offset k's "
        "share is what swapping its alpha in, after offsets 1..k-1, adds to τ = 1 + Σ_k "
        "Π_{i≤k} alpha_i; the shares sum to the change of that τ. An offset weighs by the "
        "chance of reaching it, so while alpha_1 is low the later offsets move τ little "
        "whatever their own gain.",
        "",
        md_table(changes),
        "",
    ]


def _set_lines(by_set: pl.DataFrame) -> list[str]:
    if by_set["set"].n_unique() < 2:  # one set: the table above is it
        return []
    return [
        "## τ per held-out set",
        "",
        "Each arm's mean over seeds on each benchmark (`tau_by_set.parquet`); the table above "
        "pools every set's verify steps.",
        "",
        md_table(by_set.sort("temperature", "set")),
        "",
    ]


def _speed_lines(result: dict[str, Any], speed: pl.DataFrame) -> list[str]:
    if speed.is_empty():
        return []
    return [
        "## Speed-up over plain decoding",
        "",
        f"Seed {result['speed']['seed']}'s drafters decode the held-out prompts at K="
        f"{result['k']} with batch 1, plain target decoding timed prompt by prompt in the same "
        "loop (`speed.parquet`). Wall-clock: measured in this run, on this machine, under "
        "whatever else ran on it; read the arms against each other, not against another run.",
        "",
        md_table(
            speed.with_columns(pl.col("arm").replace_strict(ARM_NAMES)).sort(
                "temperature", maintain_order=True
            )
        ),
        "",
    ]


def _opd_vs_sft_report(
    ctx: RunContext, run: Runner, result: dict[str, Any], command: str | None
) -> Dataset:
    tau = _tau_table(result)
    by_set = _set_table(result)
    alpha = _alpha_table(result)
    changes = _tau_change_table(result)
    curves = _curve_table(result)
    plateau = _plateau_table(curves)
    speed = _speed_table(result)
    labeled = tau.with_columns(pl.col("arm").replace_strict(ARM_NAMES).alias("label"))
    warm = result["warmup"]

    def markdown() -> str:
        return _markdown(result, tau, by_set, alpha, changes, plateau, speed, command)

    config = {
        "experiment": "opd-vs-sft",
        "seeds": result["seeds"],
        "budget_row_steps": result["budget_row_steps"],
        "sft_data_temperature": result["sft_data_temperature"],
        # wall-clock numbers are measured anew each run: each measurement is its own report
        **({"speed": result["speed"]} if "speed" in result else {}),
    }
    headline = {k: v for k, v in result.items() if k.startswith(("tau_", "opd_over_"))}
    return write_report(
        ctx,
        "opd-vs-sft",
        config,
        run.produced(),
        {
            "tau": tau,
            "tau_summary": tau_summary(tau, ["arm"]),
            **({"tau_by_set": by_set} if not by_set.is_empty() else {}),
            "alpha": alpha,
            "tau_changes": changes,
            "heldout_curve": curves,
            "plateau": plateau,
            **({"speed": speed} if not speed.is_empty() else {}),
        },
        {
            "tau": lambda: plot_tau(
                labeled,
                [ARM_NAMES[a] for a in ARMS],
                "Draft-OPD vs continued SFT",
                warm_taus(warm),
            ),
            "plateau": lambda: plot_plateau(curves, result),
        },
        markdown,
        headline,
        report_version="2",  # 2: tau_changes, the offsets that carry each change of tau
    )


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
    for t, sets in result["by_set"].items():
        if len(sets) > 1:
            lines += [
                f"  T={t} {name}: warm-up {row['sft_warmup']:.3f}, cont. SFT "
                f"{row['sft_continued']:.3f}, Draft-OPD {row['opd']:.3f}, OPD/SFT "
                f"{row['opd_over_sft_continued']:.3f}"
                for name, row in sets.items()
            ]
    for t, free in result["warmup"].get("free_baseline", {}).items():
        lines.append(
            f"  beside them at T={t}: {free['title']} (no training), tau {free['tau']:.3f}"
        )
    if "speed" in result:
        lines.append(f"speed-up over plain decoding (seed {result['speed']['seed']}):")
        for arm, by_t in result["speed"]["arms"].items():
            each = ", ".join(f"T={t}: {m['speedup']:.2f}x" for t, m in by_t.items())
            lines.append(f"  {ARM_NAMES[arm]}: {each}")
    lines.append(f"report: {result['report_md']}")
    lines.append(f"saved to {result['saved_to']}")
    return "\n".join(lines)
