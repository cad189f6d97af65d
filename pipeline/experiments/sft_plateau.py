"""`opd experiment sft-plateau`: where SFT stops paying, against data and against steps.

From the full chain's own prompts -> generate -> features (cached datasets shared with
`opd run full`), the `sft` stage trains the profile's drafter several times:

  the data axis: `sft.train_share` of the training sequences for each of `data_shares` (nested:
    a smaller share's sequences are inside a larger one's), each for the profile's epochs, so
    the optimizer steps grow with the data;
  the steps axis: all training sequences for each of `epochs`.

Every run validates on the same sequences, the sft stage's own split of the training prompts
(`sft.val_share`, by sequence name), which no run trains on: the curves are tuned on nothing
the benchmarks hold. Validation is teacher-forced on the target's own continuation: tau_sim is
the T=0 acceptance length over `drafting.k` drafts (greedy drafts against the target's
argmax), tau_expected the T=1 expectation (sum over prefixes of prod_k sum min(p, q)).
`sft.val_every` sets how often each run validates, so the curves show tau against tokens
seen within a run too.

An axis is at its plateau when its last step up (the largest share against the one below, or
the most epochs against the fewer) raised neither temperature's tau by `plateau_gain` or more.

The result is an `experiment@VERSION` report dataset (stage `experiment-sft-plateau`): `runs.parquet` (one
row per run: share, epochs, sequences, steps, tokens, final tau at T=0 and T=1), `curves.parquet`
(every validation of every run against tokens seen), `plateau.png` and `report.md`; the
manifest, written last, holds the JSON result in its meta. Every sft run is a cached dataset,
so runs made beforehand (in parallel processes, with the same settings) are picked up.
"""

from __future__ import annotations

import logging
from typing import Any

import polars as pl

from pipeline import chains
from pipeline.core.config import default_drafter
from pipeline.core.drafters import METRICS_FILE
from pipeline.core.report import figure, md_table, png
from pipeline.core.runner import RunContext, StageResult, run_stage
from pipeline.experiments import report
from pipeline.profiles import PipelineConfig
from pipeline.stages import sft
from storage import Dataset, OpdError

log = logging.getLogger("opd")

REPORT_KIND = "experiment-sft-plateau"
DEFAULT_PLATEAU_GAIN = 0.01
"""A step up that raises tau by less than this is no gain: 0.01 is about the spread of tau over
seeds measured on the real model (docs/results.md, SmolLM2: 0.001-0.018)."""
TAUS = {"tau_sim": "T=0", "tau_expected": "T=1"}


def run_config(cfg: PipelineConfig, share: float, epochs: float) -> sft.Config:
    """The sft config of one run: the profile's, at this share of the data and these epochs
    (validated, so share 1 is the profile's own version)."""
    return sft.Config.model_validate(
        cfg.sft.model_dump() | {"train_share": share, "epochs": epochs}
    )


def _check(cfg: PipelineConfig, shares: list[float], epochs: list[float]) -> None:
    if cfg.sft.steps is not None:
        raise OpdError(
            "the plateau experiment sizes every run in epochs (steps grow with the data): "
            "drop --set sft.steps"
        )
    if cfg.sft.train_share is not None:
        raise OpdError("the plateau experiment sets sft.train_share itself: drop that setting")
    if not shares or any(not 0 < s <= 1 for s in shares):
        raise OpdError(f"--data-shares must be in (0, 1], got {shares}")
    if not epochs or any(e <= 0 for e in epochs):
        raise OpdError(f"--epochs must be > 0, got {epochs}")


def plan(
    cfg: PipelineConfig, shares: list[float], epochs: list[float]
) -> list[tuple[float, float]]:
    """(share, epochs) of every run: each share at the profile's epochs, then all the data at
    each of `epochs`, without repeats, in that order."""
    runs = [(s, cfg.sft.epochs) for s in sorted(set(shares))]
    runs += [(1.0, e) for e in sorted(set(epochs))]
    return list(dict.fromkeys(runs))


def _curve(ds: Dataset) -> tuple[pl.DataFrame, dict[str, Any]]:
    """(every validation against tokens seen, the run's totals) from a drafter's metrics."""
    m = pl.read_parquet(ds.file(METRICS_FILE))
    train = m.filter(pl.col("kind") == "train").select(
        "step", pl.col("tokens").cum_sum().alias("tokens_seen"), "row_steps"
    )
    val = (
        m.filter(pl.col("kind") == "val")
        .join(train.select("step", "tokens_seen"), on="step", how="left")
        .select(
            "step",
            pl.col("tokens_seen").fill_null(0),
            "tau_sim",
            "tau_expected",
            pl.col("acc").list.first().alias("acc_1"),
        )
    )
    if val.is_empty():
        raise OpdError(f"{ds.ref} has no validation rows: the sft val_share must be above 0")
    totals = {"tokens": int(train["tokens_seen"].max()), "row_steps": int(train["row_steps"].sum())}
    return val, totals


def sft_plateau(
    cfg: PipelineConfig,
    ctx: RunContext,
    *,
    data_shares: list[float],
    epochs: list[float] | None = None,
    plateau_gain: float = DEFAULT_PLATEAU_GAIN,
    prompts: Dataset | None = None,
) -> dict[str, Any]:
    """Run the experiment (see the module docstring); returns the result as JSON-able data.

    `epochs`: the steps axis's runs [default: the profile's epochs and twice them].
    `prompts`: use this dataset instead of running the prompts stage."""
    if epochs is None and cfg.sft.epochs is not None:
        epochs = [cfg.sft.epochs, 2 * cfg.sft.epochs]
    _check(cfg, data_shares, epochs or [])
    results: dict[str, StageResult] = {}
    data_steps = chains.sft_chain(cfg)[:3]  # prompts, generate, features
    external: dict[str, Dataset] = {}
    if prompts is not None:
        data_steps, external = data_steps[1:], {"prompts": prompts}
    results |= chains.run_chain(data_steps, ctx, external=external)
    feats = results["features"].dataset

    runs: list[dict[str, Any]] = []
    curves: list[pl.DataFrame] = []
    for share, n_epochs in plan(cfg, data_shares, epochs):
        key = f"share{share:g}:epochs{n_epochs:g}"
        log.info("[experiment] sft-plateau: %s", key)
        drafter = run_stage(sft.STAGE, run_config(cfg, share, n_epochs), {"features": feats}, ctx)
        results[key] = drafter
        val, totals = _curve(drafter.dataset)
        ids = {"run": key, "share": share, "epochs": n_epochs}
        curves.append(val.select(*(pl.lit(v).alias(c) for c, v in ids.items()), pl.all()))
        last = val.row(-1, named=True)
        meta = drafter.dataset.meta
        runs.append(
            ids
            | {
                "sequences": meta["train_sequences"],
                "steps": meta["steps"],
                **totals,
                "tau_t0": last["tau_sim"],
                "tau_t1": last["tau_expected"],
                "acc_1": last["acc_1"],
                "drafter": str(drafter.ref),
            }
        )
    table, curve = pl.DataFrame(runs), pl.concat(curves)
    result = _result(cfg, feats, table, plateau_gain)
    ds = report.write_report(
        ctx,
        REPORT_KIND,
        {"experiment": "sft-plateau", "plateau_gain": plateau_gain},
        {key: r.dataset for key, r in results.items()},
        tables={"runs": table, "curves": curve},
        plots={"plateau": lambda: plot_plateau(table, curve, result["profile_epochs"])},
        markdown=lambda: report_markdown(result, table),
        meta=result,
    )
    result["report"] = str(ds.ref)
    result["report_md"] = str(ds.path / "report.md")
    ctx.store.record_run(ctx.run_name, {k: r.ref for k, r in results.items()} | {"report": ds.ref})
    return result


def axis_gains(table: pl.DataFrame, axis: str, fixed: dict[str, float]) -> list[dict[str, Any]]:
    """Along `axis` (share or epochs), with the other held at `fixed`: each step up's tau gain
    at T=0 and T=1 over the run below it."""
    rows = table.filter(*(pl.col(c) == v for c, v in fixed.items())).sort(axis).to_dicts()
    return [
        {
            "from": lo[axis],
            "to": hi[axis],
            "gain_t0": hi["tau_t0"] - lo["tau_t0"],
            "gain_t1": hi["tau_t1"] - lo["tau_t1"],
        }
        for lo, hi in zip(rows, rows[1:], strict=False)
    ]


def _verdict(gains: list[dict[str, Any]], plateau_gain: float) -> str:
    if not gains:
        return "not measured (one run on this axis)"
    last = gains[-1]
    if max(last["gain_t0"], last["gain_t1"]) < plateau_gain:
        return f"plateau: {last['from']:g} -> {last['to']:g} raised tau by < {plateau_gain:g}"
    return (
        f"still rising: {last['from']:g} -> {last['to']:g} raised tau by "
        f"{last['gain_t0']:+.3f} (T=0), {last['gain_t1']:+.3f} (T=1)"
    )


def _result(
    cfg: PipelineConfig, feats: Dataset, table: pl.DataFrame, plateau_gain: float
) -> dict[str, Any]:
    data = axis_gains(table, "share", {"epochs": cfg.sft.epochs})
    steps = axis_gains(table, "epochs", {"share": 1.0})
    return {
        "experiment": "sft-plateau",
        "drafter_kind": (cfg.sft.drafter or default_drafter()).kind,
        "features": str(feats.ref),
        "profile_epochs": cfg.sft.epochs,
        "k": cfg.drafting.k,
        "plateau_gain": plateau_gain,
        "runs": table.to_dicts(),
        "data_axis": {"gains": data, "verdict": _verdict(data, plateau_gain)},
        "steps_axis": {"gains": steps, "verdict": _verdict(steps, plateau_gain)},
    }


# -- the report ---------------------------------------------------------------------------------


def plot_plateau(table: pl.DataFrame, curve: pl.DataFrame, profile_epochs: float) -> bytes:
    """Left: every run's validation tau against tokens seen (T=0 solid, T=1 dashed). Right: the
    final tau against training sequences at the profile's epochs (the data axis)."""
    fig = figure(11.0, 4.6)
    left, right = fig.subplots(1, 2)
    colors = [f"C{i}" for i in range(10)]
    for i, row in enumerate(table.iter_rows(named=True)):
        run = curve.filter(pl.col("run") == row["run"])
        label = f"{row['sequences']} seqs × {row['epochs']:g} ep"
        for col, style in (("tau_sim", "o-"), ("tau_expected", "s--")):
            left.plot(
                run["tokens_seen"],
                run[col],
                style,
                color=colors[i % 10],
                ms=3,
                label=f"{label}, {TAUS[col]}",
            )
    left.set_xlabel("training tokens seen")
    left.set_ylabel("held-out τ (teacher-forced)")
    left.grid(alpha=0.3)
    left.legend(fontsize=7, frameon=False)
    data = table.filter(pl.col("epochs") == profile_epochs).sort("sequences")
    for col, style, name in (("tau_t0", "o-", "T=0"), ("tau_t1", "s--", "T=1")):
        right.plot(data["sequences"], data[col], style, color="black", label=name)
    right.set_xscale("log", base=2)
    right.set_xlabel(f"training sequences ({profile_epochs:g} epochs each)")
    right.set_ylabel("held-out τ after training")
    right.grid(alpha=0.3)
    right.legend(fontsize=8, frameon=False)
    fig.suptitle("SFT against data and steps (validation: the sft split of training prompts)")
    return png(fig)


def report_markdown(result: dict[str, Any], table: pl.DataFrame) -> str:
    gains = lambda axis: pl.DataFrame(result[axis]["gains"])  # noqa: E731
    lines = [
        f"# SFT plateau: {result['drafter_kind']}",
        "",
        f"- features `{result['features']}`; validation: the sft stage's split of the training "
        f"prompts; τ over K = {result['k']} drafts, teacher-forced (T=0: greedy; T=1: expected)",
        f"- data axis (each share for {result['profile_epochs']:g} epochs): "
        f"{result['data_axis']['verdict']}",
        f"- steps axis (all the data): {result['steps_axis']['verdict']}",
        "",
        "![plateau](plateau.png)",
        "",
        "## Runs",
        "",
        md_table(table.drop("run"), code=("drafter",)),
        "",
    ]
    for axis in ("data_axis", "steps_axis"):
        if result[axis]["gains"]:
            lines += [f"## Gains along the {axis.replace('_', ' ')}", "", md_table(gains(axis)), ""]
    lines += ["Every validation of every run: `curves.parquet`.", ""]
    return "\n".join(lines)


def summary_text(result: dict[str, Any]) -> str:
    """A short human-readable table of the result."""
    lines = [
        f"sft-plateau ({result['drafter_kind']}, validation τ over K={result['k']}, "
        "teacher-forced)",
        f"{'share':>6} {'epochs':>6} {'seqs':>5} {'steps':>5} {'tokens':>9} "
        f"{'τ T=0':>6} {'τ T=1':>6} {'acc_1':>6}",
    ]
    for r in result["runs"]:
        lines.append(
            f"{r['share']:>6g} {r['epochs']:>6g} {r['sequences']:>5} {r['steps']:>5} "
            f"{r['tokens']:>9} {r['tau_t0']:>6.3f} {r['tau_t1']:>6.3f} {r['acc_1']:>6.3f}"
        )
    lines.append(f"data axis: {result['data_axis']['verdict']}")
    lines.append(f"steps axis: {result['steps_axis']['verdict']}")
    lines.append(f"report: {result['report_md']}")
    return "\n".join(lines)
