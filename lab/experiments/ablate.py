"""`opd experiment ablate`: one-factor-at-a-time ablations of Draft-OPD.

Around the OPD defaults (the profile's config), it varies one factor at a time (loss
family, greedy vs sampled replays, rounds, replays per anchor, where replays start, gamma),
always from the same warm-up and with the same total drafter budget, and evaluates every variant
at T=0 and T=1 for each seed. Every variant validates on opd-vs-sft's held-out sequences, so the
variant equal to the defaults is opd-vs-sft's Draft-OPD arm itself (one dataset). Variants share
every dataset whose config they share (the stage cache: e.g. the greedy round-1 rollout is one
dataset for every loss family), and the report dataset holds the table of tau per variant and
the plot.
"""

from __future__ import annotations

import itertools
import logging
import statistics
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import polars as pl

from lab.experiments.common import (
    BUDGET_UNIT,
    TEMPERATURES,
    Runner,
    WarmupPrompts,
    arm_budget,
    check_arm_options,
    heldout_sequences,
    opd_arm,
    save_result,
    seed_stats,
    suffix,
    warm_up,
)
from lab.experiments.report import plot_tau, tau_summary, warm_taus, write_report
from models.losses import ReplayLoss
from pipeline.core.runner import RunContext
from pipeline.profiles import PipelineConfig
from storage import Dataset, OpdError

log = logging.getLogger("opd")


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
    # accepted anchors as a share of the rejected ones: none (the drafter's errors only), the
    # profile's, and as many as there are rejected ones (asked for: a sequence gives at most its
    # accepted positions, so the report counts the anchors taken)
    "anchors": lambda cfg: [
        (f"accepted {s:g}x", _update(cfg, score={"accepted_share": s}))
        for s in sorted({0.0, cfg.score.accepted_share, 1.0})
    ],
    "gamma": lambda cfg: [
        (f"{g:g}", _update(cfg, opd={"gamma": g})) for g in sorted({0.5, 0.8, 1.0, cfg.opd.gamma})
    ],
}
"""Factor -> its levels as (label, config) around a baseline config."""


DEFAULT_FACTORS = ("loss",)
"""What `opd experiment ablate` varies by default: the loss family, the question the other
factors are secondary to; 4 families x 2 seeds, an estimated 40 min on the default profile (docs/reference.md: Experiments)."""


def ablation_variants(
    cfg: PipelineConfig, factors: Sequence[str], levels: Sequence[str] | None = None
) -> list[Variant]:
    """Every level of every factor, in order, or only the levels labelled in `levels` (a label
    selects that level in every factor that has it); a level equal to the baseline is marked
    default."""
    unknown = [f for f in factors if f not in FACTORS]
    if unknown or not factors:
        raise OpdError(
            f"unknown ablation factor(s) {unknown}; pass --factors as a comma-separated subset "
            f"of {','.join(FACTORS)}"
        )
    base = cfg.model_dump()
    variants = [
        Variant(factor, level, vcfg, vcfg.model_dump() == base)
        for factor in dict.fromkeys(factors)
        for level, vcfg in FACTORS[factor](cfg)
    ]
    if levels is None:
        return variants
    labels = list(dict.fromkeys(v.level for v in variants))
    unknown = [level for level in levels if level not in labels]
    if unknown or not levels:
        raise OpdError(
            f"unknown level(s) {unknown} of --factors {','.join(dict.fromkeys(factors))}; pass "
            f"--levels as a comma-separated subset of: {', '.join(labels)}"
        )
    return [v for v in variants if v.level in levels]


def ablate(
    cfg: PipelineConfig,
    ctx: RunContext,
    *,
    factors: Sequence[str] = DEFAULT_FACTORS,
    levels: Sequence[str] | None = None,
    seeds: int = 2,
    first_seed: int | None = None,
    budget: int | None = None,
    budget_ratio: float = 0.25,
    prompts: WarmupPrompts = WarmupPrompts(),
    command: str | None = None,
) -> dict[str, Any]:
    """OPD variants, one factor at a time, from opd-vs-sft's warm-up at one drafter budget
    (`budget`, else `budget_ratio` x the warm-up's; split over each variant's rounds), each
    evaluated at T=0 and T=1 for every seed; `levels` keeps only the levels with those labels
    (all when None). `first_seed` (default `sft.seed`) lets separate processes run disjoint
    seeds against one root, as for opd-vs-sft. `prompts` go to `warm_up`, as for opd-vs-sft.
    Returns the result as JSON-able data."""
    check_arm_options(
        cfg, seeds=seeds, budget=budget, budget_ratio=budget_ratio, first_seed=first_seed
    )
    variants = ablation_variants(cfg, factors, levels)
    run = Runner(ctx)
    warm = warm_up(run, cfg, prompts)
    budget = arm_budget(warm, budget, budget_ratio)
    heldout = heldout_sequences(run, cfg, warm)
    log.info(
        "[ablate] %d variants x %d seeds from %s, %d row-steps each",
        len(variants),
        seeds,
        warm.drafter.ref,
        budget,
    )
    first = cfg.sft.seed if first_seed is None else first_seed
    seed_range = range(first, first + seeds)
    rows = []
    for v in variants:
        per_seed = []
        for seed in seed_range:
            key = f"{v.factor}={v.level}:s{seed}"
            arm = opd_arm(run, v.cfg, seed, budget, warm, key=key, heldout=heldout)
            kept = ("drafter", "budget_row_steps", "replays", "anchors", "tau", "alpha", "by_set")
            per_seed.append({"seed": seed} | {k: arm[k] for k in kept})
        row: dict[str, Any] = {"factor": v.factor, "level": v.level, "default": v.default}
        for t in TEMPERATURES:
            values = [r["tau"][str(t)] for r in per_seed]
            s = suffix(t)
            row |= {f"tau{s}": statistics.fmean(values), f"tau{s}_std": seed_stats(values)["std"]}
            row[f"tau{s}_per_seed"] = values
        rows.append(row | {"runs": per_seed})
    result: dict[str, Any] = {
        "experiment": "ablate",
        "factors": list(dict.fromkeys(factors)),
        "levels": list(levels) if levels is not None else None,
        "seeds": list(seed_range),
        "budget_unit": BUDGET_UNIT,
        "budget_row_steps": budget,
        "k": cfg.drafting.k,
        "temperatures": list(TEMPERATURES),
        "warmup": {
            "drafter": str(warm.drafter.ref),
            "budget_row_steps": warm.budget,
            "tau": warm.tau,
        },
        "rollout_prompts": str(warm.rollout_prompts.ref),
        "eval_prompts": str(warm.eval_prompts.ref),
        "rows": rows,
    }
    report = _ablate_report(ctx, run, result, command)
    result["report"] = str(report.ref)
    result["report_md"] = str(report.path / "report.md")
    save_result(ctx, run, "ablate", result)
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


def _alpha_table(result: dict[str, Any]) -> pl.DataFrame:
    """One row per (variant, seed, temperature, draft offset): the evaluated acceptance there
    (offset 1 = the first drafted token: a chain's first step, a block's first slot)."""
    rows = [
        {
            "factor": row["factor"],
            "level": row["level"],
            "seed": r["seed"],
            "temperature": t,
            "offset": k + 1,
            "alpha": a,
        }
        for row in result["rows"]
        for r in row["runs"]
        for t in TEMPERATURES
        for k, a in enumerate(r["alpha"][str(t)])
    ]
    return pl.DataFrame(rows)


def _mean_alpha(row: dict[str, Any], t: float, k: int) -> list[float]:
    """A variant's acceptance per offset at `t`, mean over seeds; an offset a seed's decoding
    never reached accepted nothing there (0), as in opd-vs-sft's split of τ over offsets."""
    per_seed = [[*r["alpha"][str(t)], *[0.0] * k][:k] for r in row["runs"]]
    return [statistics.fmean(column) for column in zip(*per_seed, strict=True)]


def _set_names(result: dict[str, Any]) -> list[str]:
    """The held-out sets the evaluations report τ for (none when the prompts name no sets)."""
    first = result["rows"][0]["runs"][0]["by_set"]
    return sorted(first.get("0.0", {}))


def _anchor_lines(result: dict[str, Any]) -> list[str]:
    """report.md's replay anchors per variant and seed (all rounds): what scoring took, beside
    the share a level asks for."""
    lines = [
        "",
        "## Replay anchors (per seed, all rounds)",
        "",
        "| factor | level | seed | rejected | accepted | accepted / rejected |",
        "|---|---|---|---|---|---|",
    ]
    for row in result["rows"]:
        for r in row["runs"]:
            rejected = sum(a["rejected"] for a in r["anchors"])
            accepted = sum(a["accepted"] for a in r["anchors"])
            share = f"{accepted / rejected:.2f}" if rejected else "–"
            lines.append(
                f"| {row['factor']} | {row['level']} | {r['seed']} | {rejected:,} | "
                f"{accepted:,} | {share} |"
            )
    return lines


def _detail_lines(result: dict[str, Any]) -> list[str]:
    """report.md's acceptance per offset and τ per held-out set, per variant (mean of seeds)."""
    k = result["k"]
    lines = [
        "",
        "## Acceptance per draft offset (mean over seeds)",
        "",
        "| factor | level | T | " + " | ".join(f"α{i}" for i in range(1, k + 1)) + " |",
        "|---|---|---|" + "---|" * k,
    ]
    for row in result["rows"]:
        for t in TEMPERATURES:
            alpha = " | ".join(f"{a:.3f}" for a in _mean_alpha(row, t, k))
            lines.append(f"| {row['factor']} | {row['level']} | {t:g} | {alpha} |")
    names = _set_names(result)
    if names:
        lines += [
            "",
            "## τ per held-out set (mean over seeds)",
            "",
            "| factor | level | T | " + " | ".join(names) + " |",
            "|---|---|---|" + "---|" * len(names),
        ]
        for row in result["rows"]:
            for t in TEMPERATURES:
                taus = [
                    statistics.fmean(r["by_set"][str(t)][name] for r in row["runs"])
                    for name in names
                ]
                cells = " | ".join(f"{v:.3f}" for v in taus)
                lines.append(f"| {row['factor']} | {row['level']} | {t:g} | {cells} |")
    return lines


def _ablate_report(
    ctx: RunContext, run: Runner, result: dict[str, Any], command: str | None
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
        lines += _detail_lines(result)
        lines += _anchor_lines(result)
        lines += [
            "",
            "Per seed with the drafters: `ablation.parquet`; per variant: "
            "`ablation_summary.parquet`; acceptance per offset and seed: `ablation_alpha.parquet`.",
        ]
        return "\n".join(lines)

    config = {
        "experiment": "ablate",
        "factors": result["factors"],
        "seeds": result["seeds"],
        "budget_row_steps": result["budget_row_steps"],
    }
    if result["levels"] is not None:  # absent = every level, as reports before --levels were
        config["levels"] = result["levels"]
    headline = {"rows": [{k: v for k, v in r.items() if k != "runs"} for r in result["rows"]]}
    return write_report(
        ctx,
        "ablate",
        config,
        run.produced(),
        {
            "ablation": table,
            "ablation_summary": tau_summary(table, ["factor", "level", "default"]),
            "ablation_alpha": _alpha_table(result),
        },
        {
            "ablation": lambda: plot_tau(
                labeled,
                labels,
                "Draft-OPD ablations, one factor at a time (* = default)",
                warm_taus(warm),
                breaks=[
                    i
                    for i, (a, b) in enumerate(itertools.pairwise(result["rows"]), start=1)
                    if a["factor"] != b["factor"]
                ],
            )
        },
        markdown,
        headline,
        # 2: acceptance per offset and τ per held-out set; 3: replay anchors per seed
        report_version="3",
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
