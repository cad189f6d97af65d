"""Stage `analyze`: study a rejection log (a `rollouts` or `eval` dataset) with polars.

Consumes one or more drafted-token logs: a `rollouts` dataset (`rejections-*.parquet` and
`steps-*.parquet`) or an `eval` dataset (`drafts.parquet` and `steps.parquet`). Several inputs,
e.g. the rollouts of every round of a run, are compared side by side. Produces `report`: one
Parquet table per query, PNG plots and `report.md` embedding both with the headline numbers
(also the manifest's meta).

Every query is a pure `LazyFrame -> LazyFrame` function over the columns both logs share, so a
user can run the same questions on any log in a notebook:

    import polars as pl
    from pipeline.stages import analyze
    drafts = analyze.scan_drafts(store.open("rollouts@latest"))
    analyze.acceptance_by_offset(drafts).collect()

Conventions: a drafted token is *reached* when every draft before it in its block was
accepted (outcome != "not_reached"); α at offset i (n-α) = accepted / reached at offset i;
τ = mean(accepted + 1) over verify steps (the EAGLE/vLLM convention).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from pathlib import PurePosixPath
from typing import Any

import polars as pl
from pydantic import Field

from pipeline.core.checks import check_same_target
from pipeline.core.config import LOSSY_NOTE, StrictConfig, is_lossy
from pipeline.core.report import figure, md_table, png
from pipeline.core.runner import RunContext, StageResult
from pipeline.core.stage import Inputs, Stage
from storage import Dataset, DatasetWriter, OpdError, Store

log = logging.getLogger("opd")

SOURCE_NAMES = ("rollouts", "eval")
DRAFT_COLUMNS = ("step", "anchor", "offset", "token", "accept_prob", "outcome", "target_token")
STEP_COLUMNS = ("step", "anchor", "drafted", "accepted")
ID_COLUMNS = ("seq_id", "sequence")  # rollouts name the sequence seq_id, eval names it sequence


class Config(StrictConfig):
    top_tokens: int = Field(20, ge=1)
    """How many of the most rejected draft tokens to list."""
    confidence_bins: int = Field(10, ge=2)
    """Equal-width bins of drafter confidence over [0, 1] for the calibration table."""
    position_bucket: int = Field(32, ge=1)
    """Width, in tokens, of the sequence-position buckets."""


# -- reading the logs ---------------------------------------------------------------------------


def source_roles(n: int) -> list[str]:
    return ["source", *(f"source-{i}" for i in range(2, n + 1))]


def _log_shards(ds: Dataset) -> tuple[list[str], list[str]]:
    """(drafted-token log shards, step log shards) of a rollouts or eval dataset."""
    if ds.ref.name not in SOURCE_NAMES:
        raise OpdError(
            f"{ds.ref} is not a rejection log; analyze reads a rollouts or an eval dataset "
            "(e.g. --input rollouts@latest or --input eval@latest)"
        )
    drafts, steps = [], []
    for shard in ds.shards("parquet"):
        base = PurePosixPath(shard).name
        if base == "drafts.parquet" or base.startswith("rejections-"):
            drafts.append(shard)
        elif base == "steps.parquet" or base.startswith("steps-"):
            steps.append(shard)
    if not drafts or not steps:
        raise OpdError(
            f"{ds.ref} lacks its {'drafted-token' if not drafts else 'verify-step'} log "
            "(rejections-*.parquet / drafts.parquet and steps-*.parquet / steps.parquet); "
            "re-run the stage that made it"
        )
    rows = {s["path"]: s["rows"] or 0 for s in ds.manifest["shards"]}
    if sum(rows[s] for s in drafts) == 0:
        raise OpdError(
            f"{ds.ref} has no drafted tokens (no verify step drafted any): nothing to analyze"
        )
    return drafts, steps


def _round(ds: Dataset) -> int | None:
    r = ds.config.get("stage", {}).get("round", ds.meta.get("round"))
    return int(r) if r is not None else None


def _scan(ds: Dataset, shards: list[str], required: Sequence[str], what: str) -> pl.LazyFrame:
    lf = pl.scan_parquet([str(ds.file(s)) for s in shards])
    schema = lf.collect_schema()
    id_col = next((c for c in ID_COLUMNS if c in schema), None)
    missing = [c for c in required if c not in schema] + ([] if id_col else ["seq_id"])
    if missing:
        raise OpdError(
            f"{ds.ref}: its {what} log lacks column(s) {', '.join(missing)}; it was written by an "
            "older stage version: re-run that stage"
        )
    return lf.with_columns(
        pl.col(id_col).cast(pl.String).alias("seq_id"),
        pl.lit(str(ds.ref)).alias("source"),
        pl.lit(_round(ds), pl.Int64).alias("round"),
    )


def scan_drafts(ds: Dataset) -> pl.LazyFrame:
    """The drafted-token log: one row per drafted token, with `seq_id` (String), `source`,
    `round`, `position` (= anchor + offset - 1) and `confidence` (null where not logged)."""
    drafts, _ = _log_shards(ds)
    lf = _scan(ds, drafts, DRAFT_COLUMNS, "drafted-token")
    confidence = pl.col("confidence") if "confidence" in lf.collect_schema() else pl.lit(None)
    return lf.select(
        "source",
        "round",
        "seq_id",
        *(pl.col(c).cast(pl.Int64) for c in ("step", "anchor", "offset", "token", "target_token")),
        (pl.col("anchor") + pl.col("offset") - 1).cast(pl.Int64).alias("position"),
        pl.col("accept_prob").cast(pl.Float64),
        pl.col("outcome").cast(pl.String),
        confidence.cast(pl.Float64).alias("confidence"),
    )


def scan_steps(ds: Dataset) -> pl.LazyFrame:
    """The verify-step log: one row per verify step, with `seq_id` (String), `source`, `round`."""
    _, steps = _log_shards(ds)
    lf = _scan(ds, steps, STEP_COLUMNS, "verify-step")
    return lf.select(
        "source",
        "round",
        "seq_id",
        *(pl.col(c).cast(pl.Int64) for c in STEP_COLUMNS),
    )


# -- the queries: each a pure function of a log -------------------------------------------------

_REACHED = pl.col("outcome") != "not_reached"
_ACCEPTED = pl.col("outcome") == "accepted"


def _ratio(num: str, den: str) -> pl.Expr:
    return pl.when(pl.col(den) > 0).then(pl.col(num) / pl.col(den)).otherwise(None)


def acceptance_by_offset(drafts: pl.LazyFrame, by: Sequence[str] = ()) -> pl.LazyFrame:
    """n-α per draft offset: offset, drafted, reached, accepted, alpha (= accepted / reached;
    null if never reached) and expected_alpha (mean min(1, p/q) over reached drafts: the same
    quantity without the accept/reject sampling noise at T > 0)."""
    return (
        drafts.group_by([*by, "offset"])
        .agg(
            pl.len().cast(pl.Int64).alias("drafted"),
            _REACHED.sum().cast(pl.Int64).alias("reached"),
            _ACCEPTED.sum().cast(pl.Int64).alias("accepted"),
            pl.col("accept_prob").filter(_REACHED).mean().alias("expected_alpha"),
        )
        .with_columns(_ratio("accepted", "reached").alias("alpha"))
        .sort([*by, "offset"])
    )


def tau_summary(steps: pl.LazyFrame, by: Sequence[str] = ()) -> pl.LazyFrame:
    """τ over verify steps: verify_steps, drafted, accepted, tau (= mean(accepted + 1))."""
    agg = [
        pl.len().cast(pl.Int64).alias("verify_steps"),
        pl.col("drafted").sum().alias("drafted"),
        pl.col("accepted").sum().alias("accepted"),
        (pl.col("accepted") + 1).mean().alias("tau"),
    ]
    if not by:
        return steps.select(agg)
    return steps.group_by(list(by)).agg(agg).sort(list(by))


def tau_per_sequence(steps: pl.LazyFrame) -> pl.LazyFrame:
    """τ of each sequence (one per prompt): source, seq_id, verify_steps, drafted, accepted, tau."""
    return tau_summary(steps, by=("source", "seq_id"))


def tau_distribution(per_sequence: pl.LazyFrame) -> pl.LazyFrame:
    """Spread of per-sequence τ (one row): sequences, mean, std, min, p10, p50, p90, max."""
    tau = pl.col("tau")
    return per_sequence.select(
        pl.len().cast(pl.Int64).alias("sequences"),
        tau.mean().alias("mean"),
        tau.std().alias("std"),
        tau.min().alias("min"),
        tau.quantile(0.1, "linear").alias("p10"),
        tau.median().alias("p50"),
        tau.quantile(0.9, "linear").alias("p90"),
        tau.max().alias("max"),
    )


def calibration(drafts: pl.LazyFrame, bins: int = 10) -> pl.LazyFrame:
    """Acceptance vs drafter confidence (EAGLE-2's table), over reached drafts with a logged
    confidence: bin, confidence_lo, confidence_hi, drafts, accepted, acceptance, mean_confidence.
    Bins are equal-width over [0, 1]; a confidence of exactly 1 falls in the last one."""
    binned = drafts.filter(_REACHED & pl.col("confidence").is_not_null()).with_columns(
        (pl.col("confidence") * bins).floor().clip(0, bins - 1).cast(pl.Int64).alias("bin")
    )
    return (
        binned.group_by("bin")
        .agg(
            pl.len().cast(pl.Int64).alias("drafts"),
            _ACCEPTED.sum().cast(pl.Int64).alias("accepted"),
            pl.col("confidence").mean().alias("mean_confidence"),
        )
        .with_columns(
            (pl.col("bin") / bins).alias("confidence_lo"),
            ((pl.col("bin") + 1) / bins).alias("confidence_hi"),
            _ratio("accepted", "drafts").alias("acceptance"),
        )
        .select(
            "bin",
            "confidence_lo",
            "confidence_hi",
            "drafts",
            "accepted",
            "acceptance",
            "mean_confidence",
        )
        .sort("bin")
    )


def top_rejected_tokens(drafts: pl.LazyFrame, n: int = 20) -> pl.LazyFrame:
    """The n draft tokens rejected most often: token, rejected, reached (times it was verified),
    rejection_rate, target_token (the token the target emitted instead most often; ties go to the
    smaller id) and target_share (its share of that token's rejections)."""
    reached = drafts.filter(_REACHED)
    per_token = reached.group_by("token").agg(
        (pl.col("outcome") == "rejected").sum().cast(pl.Int64).alias("rejected"),
        pl.len().cast(pl.Int64).alias("reached"),
    )
    replacements = (
        reached.filter(pl.col("outcome") == "rejected")
        .group_by("token", "target_token")
        .agg(pl.len().cast(pl.Int64).alias("count"))
        .group_by("token")
        .agg(
            pl.col("target_token")
            .sort_by(["count", "target_token"], descending=[True, False])
            .first(),
            pl.col("count").max().alias("target_count"),
        )
    )
    return (
        per_token.filter(pl.col("rejected") > 0)
        .join(replacements, on="token", how="left")
        .with_columns(
            _ratio("rejected", "reached").alias("rejection_rate"),
            _ratio("target_count", "rejected").alias("target_share"),
        )
        .select("token", "rejected", "reached", "rejection_rate", "target_token", "target_share")
        .sort(["rejected", "token"], descending=[True, False])
        .head(n)
    )


def acceptance_by_position(drafts: pl.LazyFrame, bucket: int = 32) -> pl.LazyFrame:
    """Acceptance of reached drafts by sequence position (tokens from the first prompt token),
    in buckets [position_start, position_end): reached, accepted, alpha."""
    return (
        drafts.filter(_REACHED)
        .with_columns(((pl.col("position") // bucket) * bucket).alias("position_start"))
        .group_by("position_start")
        .agg(
            pl.len().cast(pl.Int64).alias("reached"),
            _ACCEPTED.sum().cast(pl.Int64).alias("accepted"),
        )
        .with_columns(
            (pl.col("position_start") + bucket).alias("position_end"),
            _ratio("accepted", "reached").alias("alpha"),
        )
        .select("position_start", "position_end", "reached", "accepted", "alpha")
        .sort("position_start")
    )


def round_comparison(drafts: pl.LazyFrame, steps: pl.LazyFrame) -> pl.LazyFrame:
    """α by offset and τ per source (round) side by side: round, source, offset, reached,
    accepted, alpha, tau, verify_steps. Rounds ascending (sources without one last)."""
    by = ("round", "source")
    alpha = acceptance_by_offset(drafts, by=by).select(
        *by, "offset", "reached", "accepted", "alpha"
    )
    tau = tau_summary(steps, by=by).select(*by, "tau", "verify_steps")
    return alpha.join(tau, on=list(by), how="left", nulls_equal=True).sort(
        ["round", "source", "offset"], nulls_last=True
    )


# -- decoding tokens ----------------------------------------------------------------------------


def _byte_level_decoder() -> dict[str, int]:
    """GPT-2 byte-level BPE's printable stand-in character -> the byte it encodes."""
    keep = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    shifted = [b for b in range(256) if b not in keep]
    return {chr(b): b for b in keep} | {chr(256 + i): b for i, b in enumerate(shifted)}


_BYTE_LEVEL = _byte_level_decoder()


def token_text(tokenizer: Any, token: int | None) -> str | None:
    """A token as repr-escaped text, so whitespace and newlines stay visible: ' def', '\\n'.
    A token holding part of a multi-byte character decodes to U+FFFD, which would make such
    tokens indistinguishable: those show their bytes instead (b'\\xc4')."""
    if token is None or token < 0:
        return None
    text = tokenizer.decode([token], skip_special_tokens=False, clean_up_tokenization_spaces=False)
    if "\ufffd" not in text:
        return repr(text)
    piece = tokenizer.convert_ids_to_tokens(token)
    if all(ch in _BYTE_LEVEL for ch in piece):
        return repr(bytes(_BYTE_LEVEL[ch] for ch in piece))
    return repr(piece)


def decode_tokens(table: pl.DataFrame, tokenizer: Any) -> pl.DataFrame:
    """Add `text` and `target_text` (repr-escaped) to a collected top_rejected_tokens table."""
    return table.with_columns(
        pl.Series("text", [token_text(tokenizer, t) for t in table["token"]], pl.String),
        pl.Series(
            "target_text", [token_text(tokenizer, t) for t in table["target_token"]], pl.String
        ),
    )


# -- plots --------------------------------------------------------------------------------------


def _int_locator(**kw):
    from matplotlib.ticker import MaxNLocator

    return MaxNLocator(integer=True, **kw)


def _plot_label(text: str | None, limit: int = 18) -> str:
    """Token text for a tick label: ASCII-escaped (the plot font lacks many glyphs), '$' escaped
    (matplotlib would start math mode), long text cut with an ellipsis."""
    if text is None:
        return "-"
    s = text.encode("ascii", "backslashreplace").decode("ascii")
    if len(s) > limit:
        s = s[: limit - 3] + "..."
    return s.replace("$", r"\$")


def plot_acceptance_by_offset(table: pl.DataFrame, tau: float) -> bytes:
    offsets = table["offset"].to_list()
    alpha = table["alpha"].to_list()
    heights = [a or 0.0 for a in alpha]
    through = [math.prod(heights[: i + 1]) for i in range(len(heights))]
    fig = figure(6.4, 4.4)
    ax = fig.add_subplot()
    bars = ax.bar(offsets, heights, color="tab:blue", label="α: accepted / reached at this offset")
    ax.plot(
        offsets,
        through,
        "o-",
        color="tab:orange",
        label="Π α up to this offset: share of blocks accepted through it",
    )
    labels = [
        "not\nreached" if a is None else f"{a:.2f}\nn={n}"
        for a, n in zip(alpha, table["reached"].to_list(), strict=True)
    ]
    ax.bar_label(bars, labels=labels, padding=2, fontsize=7)
    ax.set_xticks(offsets)
    ax.set_ylim(0, 1.2)
    ax.set_xlabel("draft offset in the block (1 = first drafted token)")
    ax.set_ylabel("acceptance rate (fraction)")
    ax.set_title(f"Acceptance by draft offset (n-α); τ = {tau:.3f} tokens per target forward")
    fig.legend(loc="outside lower center", fontsize=8, ncols=1)
    return png(fig)


def plot_tau_distribution(per_sequence: pl.DataFrame, tau: float, k: int) -> bytes:
    values = per_sequence["tau"].to_list()
    fig = figure(6.4, 4.0)
    ax = fig.add_subplot()
    edges = [1 + 0.25 * i for i in range(4 * k + 2)]
    ax.hist(values, bins=edges, color="tab:blue", edgecolor="white", label="sequences")
    ax.axvline(tau, color="tab:red", linestyle="--", label=f"τ over all verify steps = {tau:.3f}")
    ax.set_xlim(1, k + 1.25)
    ax.set_xlabel("τ per sequence (mean accepted + 1; tokens per target forward)")
    ax.set_ylabel("sequences (count)")
    ax.yaxis.set_major_locator(_int_locator())
    ax.set_title(f"Distribution of τ over {len(values)} sequences")
    fig.legend(loc="outside lower center", fontsize=8, ncols=2)
    return png(fig)


def plot_calibration(table: pl.DataFrame, bins: int) -> bytes:
    fig = figure(6.4, 5.0)
    top, bottom = fig.subplots(2, 1, sharex=True, height_ratios=[3, 1])
    top.plot([0, 1], [0, 1], "--", color="gray", label="acceptance = confidence")
    top.plot(
        table["mean_confidence"],
        table["acceptance"],
        "o-",
        color="tab:blue",
        label="observed (mean confidence of the bin)",
    )
    top.set_xlim(0, 1)
    top.set_ylim(0, 1.05)
    top.set_ylabel("acceptance rate (fraction)")
    top.set_title("Calibration: acceptance vs drafter confidence")
    fig.legend(loc="outside lower center", fontsize=8, ncols=2)
    _draft_counts(
        bottom,
        table["confidence_lo"],
        table["drafts"],
        1 / bins,
        "drafter confidence (its logged probability for the draft)",
    )
    return png(fig)


def _draft_counts(ax: Any, left: Any, drafts: Any, width: float, xlabel: str) -> None:
    """The drafts behind each bin, as the low panel under a per-bin rate."""
    ax.bar(left, drafts, width=width, align="edge", color="tab:gray", edgecolor="white")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("drafts")
    ax.yaxis.set_major_locator(_int_locator(nbins=3))


def plot_top_rejected(table: pl.DataFrame) -> bytes:
    labels = [
        f"{_plot_label(t)} → {_plot_label(g)}"
        for t, g in zip(table["text"].to_list(), table["target_text"].to_list(), strict=True)
    ]
    counts = table["rejected"].to_list()
    rates = [
        f"{r:.0%} of {n}"
        for r, n in zip(table["rejection_rate"].to_list(), table["reached"].to_list(), strict=True)
    ]
    fig = figure(8.0, 1.8 + 0.3 * len(labels))
    ax = fig.add_subplot()
    ys = list(range(len(labels)))
    bars = ax.barh(ys, counts, color="tab:red")
    ax.bar_label(bars, labels=rates, padding=3, fontsize=7)
    ax.set_yticks(ys, labels, fontsize=8, family="monospace")
    ax.invert_yaxis()
    ax.set_xlim(0, max(counts) * 1.25)
    ax.xaxis.set_major_locator(_int_locator())
    ax.set_xlabel("rejections (count); bar label: share of its verified drafts that were rejected")
    ax.set_title(
        "Most rejected draft tokens\n(draft token → the target's most frequent replacement)"
    )
    return png(fig)


def plot_acceptance_by_position(table: pl.DataFrame, bucket: int) -> bytes:
    fig = figure(6.4, 5.0)
    top, bottom = fig.subplots(2, 1, sharex=True, height_ratios=[3, 1])
    alpha = [a if a is not None else 0.0 for a in table["alpha"].to_list()]
    top.bar(
        table["position_start"],
        alpha,
        width=bucket,
        align="edge",
        color="tab:blue",
        edgecolor="white",
    )
    top.set_ylim(0, 1.05)
    top.set_ylabel("acceptance rate (fraction)")
    top.set_title(f"Acceptance of reached drafts by sequence position ({bucket}-token buckets)")
    _draft_counts(
        bottom,
        table["position_start"],
        table["reached"],
        bucket,
        "position in the sequence (tokens from the first prompt token)",
    )
    return png(fig)


def _round_names(table: pl.DataFrame) -> dict[str, str]:
    """source -> legend name: "round N" when rounds tell the sources apart, else the ref too."""
    pairs = table.select("round", "source").unique(maintain_order=True).rows()
    rounds = [r for r, _ in pairs]
    distinct = None not in rounds and len(set(rounds)) == len(rounds)
    return {
        source: f"round {r}" if distinct else (f"r{r} {source}" if r is not None else source)
        for r, source in pairs
    }


def plot_round_comparison(table: pl.DataFrame) -> bytes:
    names = _round_names(table)
    fig = figure(10.0, 4.2)
    left, right = fig.subplots(1, 2, width_ratios=[3, 2])
    taus = []
    for source, name in names.items():
        rows = table.filter(pl.col("source") == source)
        taus.append(rows["tau"][0])
        left.plot(rows["offset"], rows["alpha"].fill_null(0.0), "o-", label=name)
    left.set_ylim(0, 1.05)
    left.set_xticks(sorted(set(table["offset"].to_list())))
    left.set_xlabel("draft offset in the block (1 = first drafted token)")
    left.set_ylabel("acceptance rate α (fraction)")
    left.set_title("α by offset per round")
    fig.legend(loc="outside lower center", fontsize=8, ncols=min(len(names), 3))
    xs = list(range(len(names)))
    bars = right.bar(xs, taus, color="tab:green")
    right.bar_label(bars, labels=[f"{t:.3f}" for t in taus], padding=2, fontsize=8)
    right.set_xticks(
        xs, [_plot_label(n, 28) for n in names.values()], rotation=30, ha="right", fontsize=8
    )
    right.set_ylim(1, max(taus) * 1.15)
    right.set_ylabel("τ (tokens per target forward)")
    right.set_title("τ per round")
    return png(fig)


# -- the report ---------------------------------------------------------------------------------


def _source_line(ds: Dataset) -> str:
    stage = ds.config.get("stage", {})
    facts = [f"round {_round(ds)}"] if _round(ds) is not None else []
    facts += [f"{k}={stage[key]}" for k, key in (("K", "k"), ("T", "temperature")) if key in stage]
    drafter = ds.meta.get("drafter") or ds.inputs.get("drafter")
    if drafter:
        facts.append(f"drafter {drafter}")
    if is_lossy(ds.meta):
        facts.append(f"**LOSSY**: {LOSSY_NOTE}")
    return f"- `{ds.ref}`" + (f" ({', '.join(facts)})" if facts else "")


def _check_roles(inputs: dict[str, Dataset]) -> list[Dataset]:
    roles = source_roles(len(inputs))
    if sorted(inputs) != sorted(roles):
        raise OpdError(
            f"analyze takes its logs as roles {', '.join(roles)}; got {', '.join(inputs)}"
        )
    return [inputs[r] for r in roles]


def run(
    cfg: Config, inputs: Inputs, output: DatasetWriter, rank: int, world_size: int, ctx: RunContext
) -> dict:
    if world_size != 1:
        raise OpdError("analyze runs as one worker; use world_size=1")
    sources = _check_roles(inputs)
    for ds in sources:
        check_same_target(ds, ctx.target_loader.identity)
    drafts = pl.concat([scan_drafts(ds) for ds in sources])
    steps = pl.concat([scan_steps(ds) for ds in sources])
    tokenizer = ctx.target_loader.tokenizer
    several = len(sources) > 1

    per_sequence = tau_per_sequence(steps)
    queries = {
        "acceptance_by_offset": acceptance_by_offset(drafts),
        "tau": tau_summary(steps),
        "tau_per_sequence": per_sequence,
        "tau_distribution": tau_distribution(per_sequence),
        "calibration": calibration(drafts, cfg.confidence_bins),
        "top_rejected_tokens": top_rejected_tokens(drafts, cfg.top_tokens),
        "acceptance_by_position": acceptance_by_position(drafts, cfg.position_bucket),
        "confidence_logged": drafts.group_by("source").agg(
            pl.col("confidence").is_not_null().any().alias("logged")
        ),
    }
    if several:
        queries["round_comparison"] = round_comparison(drafts, steps)
    tables = dict(zip(queries, pl.collect_all(list(queries.values())), strict=True))
    tables["top_rejected_tokens"] = decode_tokens(tables["top_rejected_tokens"], tokenizer)

    offsets, total = tables["acceptance_by_offset"], tables["tau"].row(0, named=True)
    tau, k = float(total["tau"]), int(offsets["offset"].max())
    top = tables["top_rejected_tokens"]
    no_confidence = sorted(tables["confidence_logged"].filter(~pl.col("logged"))["source"])
    meta: dict[str, Any] = {
        "sources": [str(ds.ref) for ds in sources],
        "tau": tau,
        "alpha": offsets["alpha"].to_list(),
        "verify_steps": int(total["verify_steps"]),
        "drafted_tokens": int(offsets["drafted"].sum()),
        "top_rejected": top.select(
            "token", "text", "rejected", "rejection_rate", "target_token", "target_text"
        )
        .head(10)
        .to_dicts(),
    }
    if lossy := [str(ds.ref) for ds in sources if is_lossy(ds.meta)]:
        meta["lossy"] = lossy
    if several:
        rc = tables["round_comparison"]
        meta["rounds"] = [
            {"source": s, "round": r, "tau": g["tau"][0], "alpha": g["alpha"].to_list()}
            for (r, s), g in rc.group_by(["round", "source"], maintain_order=True)
        ]

    written = [
        "acceptance_by_offset",
        "tau_per_sequence",
        "tau_distribution",
        "acceptance_by_position",
    ]
    written += ["top_rejected_tokens"] if top.height else []
    written += ["calibration"] if tables["calibration"].height else []
    written += ["round_comparison"] if several else []
    for name in written:
        output.write_parquet(f"{name}.parquet", tables[name].to_arrow())

    plots = {
        "acceptance_by_offset": lambda: plot_acceptance_by_offset(offsets, tau),
        "tau_distribution": lambda: plot_tau_distribution(tables["tau_per_sequence"], tau, k),
        "acceptance_by_position": lambda: plot_acceptance_by_position(
            tables["acceptance_by_position"], cfg.position_bucket
        ),
        "top_rejected_tokens": lambda: plot_top_rejected(top),
        "calibration": lambda: plot_calibration(tables["calibration"], cfg.confidence_bins),
        "round_comparison": lambda: plot_round_comparison(tables["round_comparison"]),
    }
    for name in written:
        if name in plots:
            output.write_bytes(f"{name}.png", plots[name](), fmt="png")

    report = _markdown(sources, tables, meta, cfg, no_confidence)
    output.write_bytes("report.md", report.encode(), fmt="markdown")
    alpha = " ".join("-" if a is None else f"{a:.2f}" for a in meta["alpha"])
    log.info("[analyze] tau=%.3f alpha=[%s] over %d verify steps", tau, alpha, meta["verify_steps"])
    return meta


def _calibration_section(calibration: pl.DataFrame, no_confidence: list[str]) -> list[str]:
    out: list[str] = []
    if calibration.height:
        if no_confidence:
            out += [
                f"Without {', '.join(f'`{s}`' for s in no_confidence)}: no `confidence` column in its log.",
                "",
            ]
        out += [
            "Confidence is the drafter's probability for its draft as the log records it (rollouts: "
            "max_v q_v at the rollout temperature, T=1 when greedy; eval: q of the drafted token at "
            "T=1); acceptance is over reached drafts.",
            "",
            "![calibration](calibration.png)",
            "",
            md_table(calibration),
            "",
        ]
    else:
        out += [
            "Skipped: the drafted-token logs have no `confidence` column (the drafter's probability "
            "of each drafted token); re-run the stage that made them with a version that logs it.",
            "",
        ]
    return out


def _rejected_section(top: pl.DataFrame) -> list[str]:
    out = ["## Most rejected draft tokens", ""]
    if top.height:
        out += [
            "Text is repr-escaped (whitespace and newlines visible). `target_text` is the token the "
            "target emitted instead most often; `target_share` its share of those rejections.",
            "",
            "![top rejected tokens](top_rejected_tokens.png)",
            "",
            md_table(
                top.select(
                    "token",
                    "text",
                    "rejected",
                    "reached",
                    "rejection_rate",
                    "target_token",
                    "target_text",
                    "target_share",
                ),
                code=("text", "target_text"),
            ),
            "",
        ]
    else:
        out += ["No drafted token was rejected.", ""]
    return out


def _markdown(
    sources: list[Dataset],
    tables: dict[str, pl.DataFrame],
    meta: dict[str, Any],
    cfg: Config,
    no_confidence: list[str],
) -> str:
    # The report's template, section after section in the order it renders.
    alpha = ", ".join("–" if a is None else f"{a:.3f}" for a in meta["alpha"])
    pooled = ", pooled over all inputs (per round below)" if len(sources) > 1 else ""
    out = [
        "# Rejection-log report",
        "",
        "Inputs:",
        *(_source_line(ds) for ds in sources),
        "",
        f"**τ = {meta['tau']:.3f}** tokens per target forward (mean of accepted + 1 over "
        f"{meta['verify_steps']} verify steps{pooled}); {meta['drafted_tokens']} drafted tokens; "
        f"α by offset (accepted / reached): [{alpha}].",
        "",
        *(
            [f"**LOSSY**: {', '.join(meta['lossy'])} verified by {LOSSY_NOTE}.", ""]
            if "lossy" in meta
            else []
        ),
        "## Acceptance by offset (n-α)",
        "",
        "![acceptance by offset](acceptance_by_offset.png)",
        "",
        md_table(tables["acceptance_by_offset"]),
        "",
        "## τ per sequence",
        "",
        "![tau distribution](tau_distribution.png)",
        "",
        md_table(tables["tau_distribution"]),
        "",
        "Per-sequence values: `tau_per_sequence.parquet`.",
        "",
        "## Acceptance vs drafter confidence (calibration)",
        "",
    ]
    out += _calibration_section(tables["calibration"], no_confidence)
    out += _rejected_section(tables["top_rejected_tokens"])
    out += [
        "## Acceptance by position in the sequence",
        "",
        f"Reached drafts in {cfg.position_bucket}-token buckets of the sequence position "
        "(counted from the first prompt token).",
        "",
        "![acceptance by position](acceptance_by_position.png)",
        "",
        md_table(tables["acceptance_by_position"]),
        "",
    ]
    if "round_comparison" in tables:
        rc = tables["round_comparison"]
        wide = rc.pivot(on="offset", index=["round", "source"], values="alpha", sort_columns=True)
        wide = wide.rename({c: f"α{c}" for c in wide.columns if c not in ("round", "source")})
        tau = rc.select("round", "source", "tau", "verify_steps").unique(maintain_order=True)
        out += [
            "## Round over round",
            "",
            "![round comparison](round_comparison.png)",
            "",
            md_table(
                tau.join(wide, on=["round", "source"], nulls_equal=True, maintain_order="left")
            ),
            "",
        ]
    return "\n".join(out)


# -- choosing the inputs ------------------------------------------------------------------------


def run_rollouts(store: Store, run: str) -> list[str]:
    """Every rollouts dataset a named run produced (one per round), in round order."""
    produced = store.run_datasets(run)
    refs = sorted({r for r in produced.values() if r.startswith("rollouts@")})
    if not refs:
        raise OpdError(
            f"run {run!r} produced no rollouts dataset; it has: {', '.join(sorted(set(produced.values())))}"
        )
    return sorted(refs, key=lambda r: (_round(store.open(r)) or 0, r))


def resolve_sources(
    store: Store, refs: Sequence[str] = (), run: str | None = None
) -> dict[str, Dataset]:
    """The logs to analyze, by role: the given refs, the rollouts of every round of `run`, or
    by default the latest rollouts dataset, else the latest eval dataset."""
    if refs and run is not None:
        raise OpdError("pass either --input REF (repeatable) or --run RUN, not both")
    if run is not None:
        refs = run_rollouts(store, run)
    elif not refs:
        found = [n for n in SOURCE_NAMES if (store.root / n / "LATEST").exists()]
        if not found:
            raise OpdError(
                f"no rollouts or eval dataset under {store.root}: run the rollout stage or "
                "`opd eval` first, or pass --input REF"
            )
        refs = [f"{found[0]}@latest"]
    datasets = [store.open(r) for r in refs]
    seen: set[str] = set()
    for ds in datasets:
        if ds.ref.name not in SOURCE_NAMES:
            raise OpdError(
                f"{ds.ref} is not a rejection log; analyze reads rollouts or eval datasets"
            )
        if str(ds.ref) in seen:
            raise OpdError(f"{ds.ref} is given twice; each log may be analyzed once per report")
        seen.add(str(ds.ref))
    return dict(zip(source_roles(len(datasets)), datasets, strict=True))


def summary_text(result: StageResult) -> str:
    """What `opd analyze` prints: the report's ref, headline numbers and where report.md is."""
    meta = result.dataset.meta
    alpha = " ".join("-" if a is None else f"{a:.3f}" for a in meta["alpha"])
    # from the sources, not the report's meta: a report cached from before it recorded them
    store = result.dataset.store
    lossy = [ref for ref in meta["sources"] if is_lossy(store.open(ref).meta)]
    lines = [
        f"{result.ref}  from {', '.join(meta['sources'])}"
        + ("  (cached)" if result.reused else ""),
        *([f"  LOSSY: {', '.join(lossy)} verified by {LOSSY_NOTE}"] if lossy else []),
        f"  tau {meta['tau']:.3f} over {meta['verify_steps']} verify steps, {meta['drafted_tokens']} drafted tokens",
        f"  alpha by offset [{alpha}]",
    ]
    for r in meta.get("rounds", []):
        ra = " ".join("-" if a is None else f"{a:.3f}" for a in r["alpha"])
        lines.append(f"  round {r['round']} {r['source']}: tau {r['tau']:.3f}  alpha [{ra}]")
    if meta["top_rejected"]:
        top = ", ".join(
            f"{t['text']}->{t['target_text']} x{t['rejected']}" for t in meta["top_rejected"][:5]
        )
        lines.append(f"  most rejected: {top}")
    lines.append(f"  report: {result.dataset.path / 'report.md'}")
    return "\n".join(lines)


STAGE = Stage(
    name="analyze",
    output="report",
    version="1",
    config=Config,
    run=run,
    doc="polars report on rejection logs: n-alpha, tau, calibration, top rejected tokens",
    # The first log; further ones (compared side by side) come as `source-2`, `source-3`, ...
    inputs={"source": SOURCE_NAMES},
    repeated_role="source",
    uses_target=True,  # its tokenizer decodes the rejected tokens
)
