"""`opd experiment sft-plateau`: where SFT stops paying, against data and against steps.

From the full chain's own prompts -> generate -> features (cached datasets shared with
`opd run full`), the `sft` stage trains the profile's drafter several times:

  the data axis: `sft.train_share` of the training sequences for each of `data_shares` (nested:
    a smaller share's sequences are inside a larger one's), each for the profile's size;
  the steps axis: all training sequences for each of the sizes asked for.

Runs are sized like the profile's sft: in epochs (`sft.epochs`; the optimizer steps then grow
with the data), or in optimizer steps when `sft.steps` is set (every share then gets the same
steps, and the steps axis is one run per step count). A recipe sized in steps thus finds its
hand-made runs cached instead of retraining them in epochs.

Every run validates on the same sequences, the sft stage's own split of the training prompts
(`sft.val_share`, by sequence name), which no run trains on: the curves are tuned on nothing
the benchmarks hold. Validation is teacher-forced on the target's own continuation: tau_sim is
the T=0 acceptance length over `drafting.k` drafts (greedy drafts against the target's
argmax), tau_expected the T=1 expectation (sum over prefixes of prod_k sum min(p, q)).
`sft.val_every` sets how often each run validates, so the curves show tau against tokens
seen within a run too.

An axis is at its plateau when its last step up (the largest share or size against the one
below it) raised neither temperature's tau by `plateau_gain` or more.

The result is an `experiment@VERSION` report dataset (stage `experiment-sft-plateau`): `runs.parquet` (one
row per run: share, epochs, sequences, steps, tokens, final tau at T=0 and T=1; a run sized in
steps records the epochs it reached), `curves.parquet`
(every validation of every run against tokens seen), `plateau.png` and `report.md`; the
manifest, written last, holds the JSON result in its meta. Every sft run is a cached dataset,
so runs made beforehand (in parallel processes, with the same settings) are picked up.
"""

from __future__ import annotations

import logging
from typing import Any

import polars as pl

from lab.experiments import report
from pipeline.core.config import default_drafter
from pipeline.core.drafters import METRICS_FILE, refuse_untrained
from pipeline.core.report import figure, md_table, png
from pipeline.core.runner import RunContext, StageResult, run_stage
from pipeline.profiles import PipelineConfig
from pipeline.stages import sft
from storage import Dataset, OpdError

log = logging.getLogger("opd")

REPORT_KIND = "experiment-sft-plateau"
DEFAULT_PLATEAU_GAIN = 0.01
"""A step up that raises tau by less than this is no gain: 0.01 is about the spread of tau over
seeds measured on the real model (lab/notebook/, SmolLM2: 0.001-0.018)."""
TAUS = {"tau_sim": "T=0", "tau_expected": "T=1"}


def size_unit(cfg: PipelineConfig) -> str:
    """How the runs are sized, "steps" or "epochs": the profile's sft is sized in steps when
    `sft.steps` is set (it then overrides `sft.epochs`)."""
    return "epochs" if cfg.sft.steps is None else "steps"


def run_config(cfg: PipelineConfig, share: float, size: float) -> sft.Config:
    """The sft config of one run: the profile's, at this share of the data and this many epochs
    or steps (validated, so share 1 at the profile's size is the profile's own version)."""
    return sft.Config.model_validate(
        cfg.sft.model_dump() | {"train_share": share, size_unit(cfg): size}
    )


def _check(
    cfg: PipelineConfig, shares: list[float], epochs: list[float], steps: list[float]
) -> None:
    refuse_untrained(cfg.drafter.kind, "the sft-plateau experiment")
    if size_unit(cfg) == "steps" and epochs:
        raise OpdError(
            "sft.steps is set, so the runs are sized in steps: give --steps instead of --epochs "
            "(or --set sft.steps=null to size them in epochs)"
        )
    if size_unit(cfg) == "epochs" and steps:
        raise OpdError(
            "--steps sizes runs in optimizer steps, which needs --set sft.steps=N (the steps "
            "of every data share); without it the runs are sized in epochs: give --epochs"
        )
    if any(s <= 0 or s != int(s) for s in steps):
        raise OpdError(f"--steps must be whole numbers > 0, got {steps}")
    if cfg.sft.train_share is not None:
        raise OpdError("the plateau experiment sets sft.train_share itself: drop that setting")
    if not shares or any(not 0 < s <= 1 for s in shares):
        raise OpdError(f"--data-shares must be in (0, 1], got {shares}")
    if any(e <= 0 for e in epochs):
        raise OpdError(f"--epochs must be > 0, got {epochs}")


def plan(cfg: PipelineConfig, shares: list[float], sizes: list[float]) -> list[tuple[float, float]]:
    """(share, size) of every run: each share at the profile's size, then all the data at each
    of `sizes` (epochs or steps, as `size_unit`), without repeats, in that order."""
    runs = [(s, getattr(cfg.sft, size_unit(cfg))) for s in sorted(set(shares))]
    runs += [(1.0, e) for e in sorted(set(sizes))]
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
    steps: list[float] | None = None,
    plateau_gain: float = DEFAULT_PLATEAU_GAIN,
    prompts: Dataset | None = None,
) -> dict[str, Any]:
    """Run the experiment (see the module docstring); returns the result as JSON-able data.

    `epochs` or `steps` (as `size_unit`): the steps axis's runs [default: the profile's size
    and twice it]. `prompts`: use this dataset instead of running the prompts stage."""
    _check(cfg, data_shares, epochs or [], steps or [])
    unit = size_unit(cfg)
    size = getattr(cfg.sft, unit)
    sizes = (epochs if unit == "epochs" else steps) or [size, 2 * size]
    if unit == "steps":
        sizes = [int(s) for s in sizes]  # whole (checked); the CLI parses numbers as floats
    results: dict[str, StageResult] = report.sft_data(cfg, ctx, prompts)
    feats = results["features"].dataset

    runs: list[dict[str, Any]] = []
    curves: list[pl.DataFrame] = []
    for share, n in plan(cfg, data_shares, sizes):
        key = f"share{share:g}:{unit}{n:g}"
        log.info("[experiment] sft-plateau: %s", key)
        drafter = run_stage(sft.STAGE, run_config(cfg, share, n), {"features": feats}, ctx)
        results[key] = drafter
        val, totals = _curve(drafter.dataset)
        ids = {"run": key, "share": share, unit: n}
        curves.append(val.select(*(pl.lit(v).alias(c) for c, v in ids.items()), pl.all()))
        last = val.row(-1, named=True)
        meta = drafter.dataset.meta
        runs.append(
            {
                "run": key,
                "share": share,
                # a run sized in steps reports the epochs it reached (2 decimals: it is a label)
                "epochs": n if unit == "epochs" else round(meta["epochs"], 2),
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
        plots={"plateau": lambda: plot_plateau(table, curve, result["sized_in"], size)},
        markdown=lambda: report_markdown(result, table),
        meta=result,
        report_version="2",  # 2: runs sized in steps; `sized_in` and `profile_size` in the meta
    )
    result["report"] = str(ds.ref)
    result["report_md"] = str(ds.path / "report.md")
    ctx.store.record_run(ctx.run_name, {k: r.ref for k, r in results.items()} | {"report": ds.ref})
    return result


def axis_gains(table: pl.DataFrame, axis: str, fixed: dict[str, float]) -> list[dict[str, Any]]:
    """Along `axis` (share, epochs or steps), with the other held at `fixed`: each step up's tau gain
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
    unit = size_unit(cfg)
    data = axis_gains(table, "share", {unit: getattr(cfg.sft, unit)})
    steps = axis_gains(table, unit, {"share": 1.0})
    return {
        "experiment": "sft-plateau",
        "drafter_kind": (cfg.sft.drafter or default_drafter()).kind,
        "features": str(feats.ref),
        "sized_in": unit,
        "profile_size": getattr(cfg.sft, unit),
        "k": cfg.drafting.k,
        "plateau_gain": plateau_gain,
        "runs": table.to_dicts(),
        "data_axis": {"gains": data, "verdict": _verdict(data, plateau_gain)},
        "steps_axis": {"gains": steps, "verdict": _verdict(steps, plateau_gain)},
    }


# -- the report ---------------------------------------------------------------------------------


def plot_plateau(table: pl.DataFrame, curve: pl.DataFrame, unit: str, size: float) -> bytes:
    """Left: every run's validation tau against tokens seen (T=0 solid, T=1 dashed). Right: the
    final tau against training sequences at the profile's size, `size` `unit` (the data axis)."""
    fig = figure(11.0, 4.6)
    left, right = fig.subplots(1, 2)
    colors = [f"C{i}" for i in range(10)]
    for i, row in enumerate(table.iter_rows(named=True)):
        run = curve.filter(pl.col("run") == row["run"])
        label = f"{row['sequences']} seqs × {row[unit]:g} {'ep' if unit == 'epochs' else unit}"
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
    data = table.filter(pl.col(unit) == size).sort("sequences")
    for col, style, name in (("tau_t0", "o-", "T=0"), ("tau_t1", "s--", "T=1")):
        right.plot(data["sequences"], data[col], style, color="black", label=name)
    right.set_xscale("log", base=2)
    right.set_xlabel(f"training sequences ({size:g} {unit} each)")
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
        f"- data axis (each share for {result['profile_size']:g} {result['sized_in']}): "
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
