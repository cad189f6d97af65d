"""`opd experiment objectives`: EAGLE-3's training-time test against EAGLE-1's objective.

From the full chain's own prompts -> generate -> features (cached datasets shared with
`opd run full`), for each seed the `sft` stage trains the same drafter twice:

  eagle3: the default objective, soft-CE over a `ttt_steps`-step training-time-test unroll;
  eagle1: `sft.objective=eagle1`, feature regression + 0.1 x CE on one teacher-forced step.

The budget is matched in data passes: both runs take the same optimizer steps over the same
token rows in the same order (same features, `sft.steps`/`epochs`, batch size, lr schedule and
seed), so what differs is only the loss and how deep each row is unrolled for it. Their
row-steps (rows x unrolled steps run forward+backward) therefore differ by `ttt_steps`; each
run's are reported.

Both drafters are evaluated on the held-out prompts at T=0 and T=1 with the evaluate stage
(same K, prompts and seed). The per-position acceptance alpha_k (accepted / reached at draft
offset k, whose input holds k-1 hidden states the drafter made itself) is what the objectives
should differ in: without training-time test the drafter never trains on its own hidden
states, so alpha_k may decay with k where EAGLE-3's stays flat.

The result is a report dataset (`report`, stage `experiment-objectives`): `objectives.parquet`
(tau and alpha_1..alpha_K per objective, seed and temperature), `acceptance_by_offset.parquet`
(the counts behind each alpha), `summary.parquet` (means over seeds), `alpha_by_offset.png`
and `report.md`; the manifest, written last, holds the JSON result in its meta.
"""

from __future__ import annotations

import io
import logging
import statistics
from typing import Any

import polars as pl

from lab.experiments.report import sft_data
from models.drafters import DEFAULT_KIND, KINDS
from pipeline.core.drafters import METRICS_FILE, refuse_untrained
from pipeline.core.report import md_table
from pipeline.core.runner import RunContext, StageResult, run_stage
from pipeline.profiles import PipelineConfig
from pipeline.stages import analyze, evaluate, sft
from storage import Dataset, OpdError

log = logging.getLogger("opd")

LABELS = dict(KINDS[DEFAULT_KIND].objectives)  # the default kind's own objective first
OBJECTIVES = tuple(LABELS)
COLORS = dict(zip(OBJECTIVES, ("tab:blue", "tab:orange"), strict=True))
TEMPERATURES = (0.0, 1.0)
MATCHED = (
    "same optimizer steps over the same token rows in the same order (features, sft steps or "
    "epochs, batch size, lr schedule and seed); row-steps differ by the unroll depth"
)
REPORT_STAGE, REPORT_VERSION = "experiment-objectives", "1"


def sft_config(cfg: PipelineConfig, objective: str, seed: int) -> sft.Config:
    """The sft config of one run: the profile's, with this seed and objective. EAGLE-1 trains one
    step, so the TTT step weighting is left at its default (it would refuse another)."""
    if objective == OBJECTIVES[0]:
        return cfg.sft.model_copy(update={"seed": seed})
    return sft.Config.model_validate(
        cfg.sft.model_dump()
        | {"seed": seed, "objective": objective, "step_decay": sft.DEFAULT_STEP_DECAY}
    )


def _check(cfg: PipelineConfig, seeds: int) -> None:
    refuse_untrained(cfg.drafter.kind, "the objectives experiment")
    if seeds < 1:
        raise OpdError(f"--seeds must be >= 1, got {seeds}")
    if cfg.sft.objective is not None:
        raise OpdError(
            "the objectives experiment trains both objectives itself: drop --set sft.objective"
        )
    if cfg.drafting.tree is not None:
        raise OpdError(
            "the objectives experiment compares acceptance per chain offset: drop drafting.tree"
        )
    if cfg.drafting.acceptance == "typical":
        # its table would hold lossy T=1 numbers beside lossless ones, unmarked
        raise OpdError(
            "the objectives experiment compares the objectives under lossless verification, and "
            "drafting.acceptance=typical is lossy: drop it (opd eval --set "
            "drafting.acceptance=typical measures a drafter with it)"
        )


def _row_steps(ds: Dataset) -> int:
    m = pl.read_parquet(ds.file(METRICS_FILE)).filter(pl.col("kind") == "train")
    return int(m["row_steps"].sum())


def _acceptance(ev: Dataset, k: int) -> pl.DataFrame:
    """offset 1..k (every one, unreached ones with alpha null), reached, accepted, alpha,
    expected_alpha of an eval dataset."""
    got = analyze.acceptance_by_offset(analyze.scan_drafts(ev)).collect()
    offsets = pl.DataFrame({"offset": list(range(1, k + 1))}, schema={"offset": pl.Int64})
    return offsets.join(
        got.select("offset", "reached", "accepted", "alpha", "expected_alpha"),
        on="offset",
        how="left",
    ).with_columns(pl.col("reached", "accepted").fill_null(0))


def objectives(
    cfg: PipelineConfig, ctx: RunContext, *, seeds: int = 2, prompts: Dataset | None = None
) -> dict[str, Any]:
    """Run the experiment (see the module docstring); returns the result as JSON-able data.

    `prompts`: use this dataset instead of running the prompts stage.
    """
    _check(cfg, seeds)
    k = cfg.drafting.k
    results: dict[str, StageResult] = sft_data(cfg, ctx, prompts)
    prompts = prompts or results["prompts"].dataset
    feats = results["features"].dataset

    runs: list[dict[str, Any]] = []
    offsets: list[pl.DataFrame] = []
    for seed in range(cfg.sft.seed, cfg.sft.seed + seeds):
        for objective in OBJECTIVES:
            key = f"s{seed}:{objective}"
            scfg = sft_config(cfg, objective, seed)
            drafter = run_stage(sft.STAGE, scfg, {"features": feats}, ctx)
            results[key] = drafter
            for t in TEMPERATURES:
                # tau and alpha only: no plain-decoding timing, no untrained-drafter contrast
                ecfg = cfg.evaluate.model_copy(
                    update={
                        "temperature": t,
                        "measure_baseline": False,
                        "untrained_contrast": False,
                    }
                )
                ev = run_stage(
                    evaluate.STAGE, ecfg, {"prompts": prompts, "drafter": drafter.dataset}, ctx
                )
                results[f"{key}:eval-T{t}"] = ev
                acc = _acceptance(ev.dataset, k)
                ids = {"objective": objective, "seed": seed, "temperature": t}
                offsets.append(acc.select(*(pl.lit(v).alias(c) for c, v in ids.items()), pl.all()))
                runs.append(
                    ids
                    | {
                        "tau": ev.dataset.meta["tau"],
                        **{f"alpha_{i + 1}": a for i, a in enumerate(acc["alpha"].to_list())},
                        "verify_steps": ev.dataset.meta["verify_steps"],
                        "sft_steps": drafter.dataset.meta["steps"],
                        "row_steps": _row_steps(drafter.dataset),
                        "drafter": str(drafter.ref),
                        "eval": str(ev.ref),
                    }
                )
    table = pl.DataFrame(runs)
    acceptance = pl.concat(offsets)
    summary = summarize(table, k)
    result = _result(cfg, prompts, feats, table, summary, seeds)
    report = write_report(ctx, result, table, acceptance, summary, results)
    results["report"] = report
    result["report"] = str(report.ref)
    result["report_md"] = str(report.dataset.path / "report.md")
    ctx.store.record_run(ctx.run_name, {key: r.ref for key, r in results.items()})
    return result


def summarize(table: pl.DataFrame, k: int) -> pl.DataFrame:
    """Per objective and temperature: seeds, tau mean/std/min/max, and alpha_k averaged over
    seeds (seeds that never reached offset k left out)."""
    alphas = [f"alpha_{i}" for i in range(1, k + 1)]
    return (
        table.group_by("objective", "temperature", maintain_order=True)
        .agg(
            pl.len().alias("seeds"),
            pl.col("tau").mean().alias("tau_mean"),
            pl.col("tau").std().fill_null(0.0).alias("tau_std"),
            pl.col("tau").min().alias("tau_min"),
            pl.col("tau").max().alias("tau_max"),
            *(pl.col(a).mean() for a in alphas),
            pl.col("row_steps").mean().cast(pl.Int64).alias("row_steps"),
        )
        .sort("temperature", "objective", descending=[False, True])
    )


def _result(
    cfg: PipelineConfig,
    prompts: Dataset,
    feats: Dataset,
    table: pl.DataFrame,
    summary: pl.DataFrame,
    seeds: int,
) -> dict[str, Any]:
    k = cfg.drafting.k
    out: dict[str, Any] = {
        "experiment": "objectives",
        "matched": MATCHED,
        "k": k,
        "ttt_steps": cfg.drafting.ttt_steps,
        "temperatures": list(TEMPERATURES),
        "seeds": list(range(cfg.sft.seed, cfg.sft.seed + seeds)),
        "prompts": str(prompts.ref),
        "features": str(feats.ref),
        "heldout_prompts": cfg.evaluate.max_prompts,
        "runs": table.to_dicts(),
        "tau": {},
        "alpha": {},
        "row_steps": {},
    }
    for row in summary.iter_rows(named=True):
        obj, t = row["objective"], str(row["temperature"])
        per_seed = table.filter(
            (pl.col("objective") == obj) & (pl.col("temperature") == row["temperature"])
        )["tau"].to_list()
        out["tau"].setdefault(obj, {})[t] = {
            "mean": row["tau_mean"],
            "std": statistics.stdev(per_seed) if len(per_seed) > 1 else 0.0,
            "min": row["tau_min"],
            "max": row["tau_max"],
            "per_seed": per_seed,
        }
        out["alpha"].setdefault(obj, {})[t] = [row[f"alpha_{i}"] for i in range(1, k + 1)]
        out["row_steps"][obj] = row["row_steps"]
    return out


# -- the report ---------------------------------------------------------------------------------

DPI = 110  # the PNG's dpi, which constrained layout must be computed at (as in analyze)


def plot_alpha_by_offset(table: pl.DataFrame, summary: pl.DataFrame, k: int) -> bytes:
    """alpha_k against k, one panel per temperature: each objective's mean over seeds as a
    line, every seed as a dot; offsets never reached are gaps."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10.0, 5.0), layout="constrained", dpi=DPI)
    axes = fig.subplots(1, len(TEMPERATURES), sharey=True)
    ks = list(range(1, k + 1))

    def values(row: dict[str, Any]) -> list[float]:
        return [float("nan") if row[f"alpha_{i}"] is None else row[f"alpha_{i}"] for i in ks]

    for ax, t in zip(axes, TEMPERATURES, strict=True):
        for obj in OBJECTIVES:
            here = (pl.col("objective") == obj) & (pl.col("temperature") == t)
            for row in summary.filter(here).iter_rows(named=True):
                ax.plot(
                    ks,
                    values(row),
                    "o-",
                    color=COLORS[obj],
                    clip_on=False,  # alpha 0 and 1 sit on the frame
                    label=f"{LABELS[obj]}: τ = {row['tau_mean']:.2f} ± {row['tau_std']:.2f}",
                )
            for row in table.filter(here).iter_rows(named=True):
                ax.plot(ks, values(row), ".", color=COLORS[obj], alpha=0.4, clip_on=False)
        ax.set_title(f"T = {t:g}")
        ax.set_xticks(ks)
        ax.set_ylim(0, 1)
        ax.set_xlabel("draft offset k (its input holds k-1 drafter-made hidden states)")
        ax.grid(alpha=0.3)
        ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.16), fontsize=8, frameon=False)
    axes[0].set_ylabel("α_k = accepted / reached at offset k")
    seeds = table["seed"].n_unique()
    fig.suptitle(
        f"Acceptance by draft offset on held-out prompts (K = {k}; lines: mean of {seeds} "
        "seed(s), dots: each seed; τ: mean ± std over seeds)",
        fontsize=10,
    )
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def report_markdown(result: dict[str, Any], table: pl.DataFrame, summary: pl.DataFrame) -> str:
    k = result["k"]
    alphas = [f"alpha_{i}" for i in range(1, k + 1)]
    seeds = ", ".join(map(str, result["seeds"]))
    return "\n".join(
        [
            "# SFT objective: EAGLE-3 training-time test vs EAGLE-1",
            "",
            f"- features `{result['features']}`, held-out prompts of `{result['prompts']}` "
            f"(up to {result['heldout_prompts']}), K = {k}, seeds {seeds}",
            f"- eagle3: soft-CE over a {result['ttt_steps']}-step training-time-test unroll; "
            "eagle1: smooth-L1 of each row's hidden state to the target's last hidden state "
            "one position later + 0.1 x soft-CE, one teacher-forced step",
            f"- matched: {result['matched']}. Row-steps per run: "
            + ", ".join(f"{o} {n}" for o, n in result["row_steps"].items()),
            "- α_k = accepted / reached at draft offset k (evaluate stage, chain decoding); "
            "τ = mean of accepted + 1 per verify step",
            "",
            "![alpha by offset](alpha_by_offset.png)",
            "",
            "## Means over seeds",
            "",
            md_table(
                summary.select(
                    "objective", "temperature", "seeds", "tau_mean", "tau_std", *alphas, "row_steps"
                )
            ),
            "",
            "## Every run",
            "",
            md_table(table.select("objective", "seed", "temperature", "tau", *alphas, "sft_steps")),
            "",
            "Drafters and eval datasets per run: `objectives.parquet`; reached and accepted "
            "counts behind each α: `acceptance_by_offset.parquet`.",
            "",
        ]
    )


def write_report(
    ctx: RunContext,
    result: dict[str, Any],
    table: pl.DataFrame,
    acceptance: pl.DataFrame,
    summary: pl.DataFrame,
    results: dict[str, StageResult],
) -> StageResult:
    """The report dataset, versioned by the drafters and evals it reports (manifest last)."""
    writer = ctx.store.writer(
        "report",
        stage=REPORT_STAGE,
        stage_version=REPORT_VERSION,
        config={"experiment": "objectives", "k": result["k"], "seeds": result["seeds"]},
        inputs={key: r.ref for key, r in results.items()},
    )
    if writer.exists():
        ctx.store.set_latest(writer.ref)
        return StageResult(ctx.store.open(writer.ref), True, 0.0)
    with writer:
        writer.write_parquet("objectives.parquet", table.to_arrow())
        writer.write_parquet("acceptance_by_offset.parquet", acceptance.to_arrow())
        writer.write_parquet("summary.parquet", summary.to_arrow())
        writer.write_bytes(
            "alpha_by_offset.png", plot_alpha_by_offset(table, summary, result["k"]), fmt="png"
        )
        writer.write_bytes(
            "report.md", report_markdown(result, table, summary).encode(), fmt="markdown"
        )
        ds = writer.commit(meta=result)
    log.info("[experiment] wrote %s", ds.ref)
    return StageResult(ds, False, 0.0)


def summary_text(result: dict[str, Any]) -> str:
    """A short human-readable table of the result."""
    k = result["k"]
    lines = [
        f"objectives: K={k}, {len(result['seeds'])} seed(s); matched: {result['matched']}",
        "  row-steps per run: " + ", ".join(f"{o} {n}" for o, n in result["row_steps"].items()),
        f"{'objective':>9} {'T':>4} {'tau':>15}  alpha_1..alpha_{k}",
    ]
    for t in map(str, result["temperatures"]):
        for obj in OBJECTIVES:
            tau = result["tau"][obj][t]
            alpha = " ".join("  -  " if a is None else f"{a:.3f}" for a in result["alpha"][obj][t])
            lines.append(f"{obj:>9} {t:>4} {tau['mean']:>7.3f} ± {tau['std']:<5.3f}  {alpha}")
    lines.append(f"report: {result['report_md']}")
    return "\n".join(lines)
