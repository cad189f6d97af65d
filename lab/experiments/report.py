"""The experiments' report dataset (`experiment@VERSION`: Parquet tables, PNG plots, report.md)
and the pieces every report draws with."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import polars as pl

from lab.experiments.common import TEMPERATURES, seed_stats
from pipeline import chains
from pipeline.core.report import figure, png
from pipeline.core.runner import RunContext, StageResult
from storage import Dataset

log = logging.getLogger("opd")


REPORT_NAME = "experiment"
"""The dataset name of the experiments' reports (`experiment@VERSION`)."""


def tau_summary(tau: pl.DataFrame, by: Sequence[str]) -> pl.DataFrame:
    """Mean, std, min, max and seed count of tau per group and temperature, in first-seen order."""
    return tau.group_by([*by, "temperature"], maintain_order=True).agg(
        pl.col("tau").mean().alias("mean"),
        pl.col("tau").std().fill_null(0.0).alias("std"),
        pl.col("tau").min().alias("min"),
        pl.col("tau").max().alias("max"),
        pl.len().alias("seeds"),
    )


def write_report(
    ctx: RunContext,
    kind: str,
    config: dict[str, Any],
    inputs: dict[str, Dataset],
    tables: dict[str, pl.DataFrame],
    plots: dict[str, Callable[[], bytes]],
    markdown: Callable[[], str],
    meta: dict[str, Any],
    report_version: str = "1",
) -> Dataset:
    """An `experiment@VERSION` dataset: Parquet tables, PNG plots and report.md (manifest last).

    Its version is the experiment's kind and config plus every dataset it read, so re-running
    an experiment whose datasets are all cached finds its report too; `report_version` changes
    it when a kind's report gains tables, so a re-run writes the new report beside the old.
    """
    writer = ctx.store.writer(
        REPORT_NAME,
        stage=kind,
        stage_version=report_version,
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


COLORS = {"sft_warmup": "0.35", "sft_continued": "tab:blue", "opd": "tab:orange"}


T_NAMES = {0.0: "T=0 (greedy)", 1.0: "T=1 (sampled)"}


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
    fig = figure(10.0, 2.3 + 0.4 * n)
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
        ax.set_title(f"evaluated τ, {T_NAMES.get(t, f'T={t:g}')}", fontsize=10)
        ax.set_xlabel("τ: tokens per target forward (held-out prompts)")
        ax.margins(x=0.15, y=0.6 / max(n, 1))
        ax.grid(axis="x", alpha=0.3)
    axes[0].set_yticks(range(n), labels, fontsize=9)
    axes[0].invert_yaxis()
    handles, names = axes[0].get_legend_handles_labels()
    fig.legend(handles, names, loc="outside lower center", ncols=3, fontsize=8)
    fig.suptitle(title, fontsize=11)
    return png(fig)


def fmt_stats(values: list[float]) -> str:
    s = seed_stats(values)
    return f"{s['mean']:.3f} ± {s['std']:.3f}"


def warm_taus(warm: dict[str, Any]) -> dict[float, float]:
    return {t: warm["tau"][str(t)] for t in TEMPERATURES}


def sft_data(cfg: Any, ctx: RunContext, prompts: Dataset | None) -> dict[str, StageResult]:
    """The SFT chain's data stages (prompts, generate, features), cached with `opd run`'s; from
    `prompts` instead of the prompts stage when given."""
    data_steps = chains.sft_chain(cfg)[:3]  # prompts, generate, features
    external: dict[str, Dataset] = {}
    if prompts is not None:
        data_steps, external = data_steps[1:], {"prompts": prompts}
    return chains.run_chain(data_steps, ctx, external=external)
