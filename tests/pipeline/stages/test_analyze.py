"""The analyze stage: each query on a hand-written log with hand-computed answers, then the
stage and the CLI on literal rollouts/eval datasets written with the store."""

import ast
import json
import math

import polars as pl
import pyarrow as pa
import pytest
from click.testing import CliRunner
from PIL import Image

from cli.main import cli
from pipeline.core import report
from pipeline.core.runner import run_stage
from pipeline.stages import analyze
from storage import OpdError

# One source, K=3, two sequences of two verify steps each. Per drafted token:
# (seq, step, anchor, offset, token, target_token, outcome, accept_prob, confidence)
A, R, N = "accepted", "rejected", "not_reached"
ROWS = [
    ("a", 0, 10, 1, 5, 5, A, 1.0, 0.9),
    ("a", 0, 10, 2, 6, 6, A, 0.8, 0.8),
    ("a", 0, 10, 3, 7, 8, R, 0.1, 0.3),
    ("a", 1, 13, 1, 4, 9, R, 0.2, 0.6),
    ("a", 1, 13, 2, 5, -1, N, 0.3, 0.1),
    ("a", 1, 13, 3, 6, -1, N, 0.3, 0.1),
    ("b", 0, 20, 1, 5, 5, A, 0.9, 0.95),
    ("b", 0, 20, 2, 7, 3, R, 0.4, 0.55),
    ("b", 0, 20, 3, 9, -1, N, 0.3, 0.1),
    ("b", 1, 22, 1, 5, 5, A, 0.7, 1.0),
    ("b", 1, 22, 2, 6, 6, A, 0.6, 0.7),
    ("b", 1, 22, 3, 7, 7, A, 0.5, 0.65),
]
# (seq, step, anchor, drafted, accepted, emitted)
STEPS = [("a", 0, 10, 3, 2, 3), ("a", 1, 13, 3, 0, 1), ("b", 0, 20, 3, 1, 2), ("b", 1, 22, 3, 3, 4)]


def _drafts(rows=ROWS, source="s", rnd=1) -> pl.LazyFrame:
    seq, step, anchor, offset, token, target, outcome, ap, conf = map(list, zip(*rows, strict=True))
    return pl.LazyFrame(
        {
            "source": source,
            "round": pl.Series([rnd] * len(rows), dtype=pl.Int64),
            "seq_id": seq,
            "step": step,
            "anchor": anchor,
            "offset": offset,
            "token": token,
            "target_token": target,
            "position": [a + o - 1 for a, o in zip(anchor, offset, strict=True)],
            "accept_prob": ap,
            "outcome": outcome,
            "confidence": pl.Series(conf, dtype=pl.Float64),
        }
    )


def _steps(rows=STEPS, source="s", rnd=1) -> pl.LazyFrame:
    seq, step, anchor, drafted, accepted, emitted = map(list, zip(*rows, strict=True))
    return pl.LazyFrame(
        {
            "source": source,
            "round": pl.Series([rnd] * len(rows), dtype=pl.Int64),
            "seq_id": seq,
            "step": step,
            "anchor": anchor,
            "drafted": drafted,
            "accepted": accepted,
            "emitted": emitted,
        }
    )


def _close(got, want):
    assert len(got) == len(want), (got, want)
    for g, w in zip(got, want, strict=True):
        assert (g is None and w is None) or math.isclose(g, w, abs_tol=1e-12), (got, want)


# -- queries on the literal log -----------------------------------------------------------------


def test_acceptance_by_offset():
    t = analyze.acceptance_by_offset(_drafts()).collect()
    assert t["offset"].to_list() == [1, 2, 3]
    assert t["drafted"].to_list() == [4, 4, 4]
    assert t["reached"].to_list() == [4, 3, 2]
    assert t["accepted"].to_list() == [3, 2, 1]
    _close(t["alpha"].to_list(), [3 / 4, 2 / 3, 1 / 2])
    # mean accept_prob over reached drafts only (not-reached rows carry 0.3 and must not count)
    _close(
        t["expected_alpha"].to_list(),
        [(1.0 + 0.2 + 0.9 + 0.7) / 4, (0.8 + 0.4 + 0.6) / 3, (0.1 + 0.5) / 2],
    )


def test_acceptance_by_offset_never_reached_is_null():
    rows = [("a", 0, 5, 1, 5, 6, R, 0.0, 0.5), ("a", 0, 5, 2, 6, -1, N, 0.0, 0.5)]
    t = analyze.acceptance_by_offset(_drafts(rows)).collect()
    assert t["reached"].to_list() == [1, 0]
    assert t["alpha"].to_list() == [0.0, None]


def test_tau_summary_per_sequence_and_distribution():
    total = analyze.tau_summary(_steps()).collect().row(0, named=True)
    assert total == {"verify_steps": 4, "drafted": 12, "accepted": 6, "tau": 2.5}
    per = analyze.tau_per_sequence(_steps()).collect()
    assert per["seq_id"].to_list() == ["a", "b"]
    assert per["verify_steps"].to_list() == [2, 2]
    _close(per["tau"].to_list(), [2.0, 3.0])  # a: mean(3, 1); b: mean(2, 4)
    dist = analyze.tau_distribution(per.lazy()).collect().row(0, named=True)
    assert dist["sequences"] == 2
    want = {
        "mean": 2.5,
        "std": math.sqrt(0.5),
        "min": 2.0,
        "p10": 2.1,
        "p50": 2.5,
        "p90": 2.9,
        "max": 3.0,
    }
    for key, value in want.items():
        assert math.isclose(dist[key], value), (key, dist[key])


def test_tau_per_sequence_keeps_sources_apart():
    steps = pl.concat([_steps(), _steps([("a", 0, 5, 3, 0, 1)], source="t")])
    per = analyze.tau_per_sequence(steps).collect()
    assert per.select("source", "seq_id").rows() == [("s", "a"), ("s", "b"), ("t", "a")]
    _close(per["tau"].to_list(), [2.0, 3.0, 1.0])


def test_calibration():
    t = analyze.calibration(_drafts(), bins=4).collect()
    # reached drafts: 0.3 -> bin 1; 0.6 0.55 0.7 0.65 -> bin 2 (0.7, 0.65 accepted);
    # 0.9 0.8 0.95 1.0 -> bin 3 (all accepted; 1.0 clipped into the last bin); bin 0 is empty
    assert t["bin"].to_list() == [1, 2, 3]
    _close(t["confidence_lo"].to_list(), [0.25, 0.5, 0.75])
    _close(t["confidence_hi"].to_list(), [0.5, 0.75, 1.0])
    assert t["drafts"].to_list() == [1, 4, 4]
    assert t["accepted"].to_list() == [0, 2, 4]
    _close(t["acceptance"].to_list(), [0.0, 0.5, 1.0])
    _close(t["mean_confidence"].to_list(), [0.3, 0.625, 0.9125])


def test_calibration_without_confidence_is_empty():
    lf = _drafts().with_columns(pl.lit(None, pl.Float64).alias("confidence"))
    assert analyze.calibration(lf).collect().height == 0


def test_top_rejected_tokens():
    t = analyze.top_rejected_tokens(_drafts()).collect()
    # token 7: verified 3 times (a0o3 -> 8, b0o2 -> 3, b1o3 accepted): 2 rejections, replacement
    # tie 8 vs 3 goes to the smaller id; token 4: once, rejected -> 9. Tokens 5, 6: never rejected.
    assert t.rows() == [(7, 2, 3, 2 / 3, 3, 0.5), (4, 1, 1, 1.0, 9, 1.0)]
    assert t.columns == [
        "token",
        "rejected",
        "reached",
        "rejection_rate",
        "target_token",
        "target_share",
    ]
    assert analyze.top_rejected_tokens(_drafts(), n=1).collect()["token"].to_list() == [7]


def test_acceptance_by_position():
    t = analyze.acceptance_by_position(_drafts(), bucket=8).collect()
    # reached positions: 10 11 12 13 (2 accepted) | 20 21 22 23 (3 accepted) | 24 (accepted)
    assert t.rows() == [(8, 16, 4, 2, 0.5), (16, 24, 4, 3, 0.75), (24, 32, 1, 1, 1.0)]


def test_round_comparison():
    r2 = [
        ("x", 0, 7, 1, 5, 5, A, 1.0, None),
        ("x", 0, 7, 2, 6, 2, R, 0.0, None),
        ("x", 0, 7, 3, 4, -1, N, 0.0, None),
    ]
    drafts = pl.concat([_drafts(r2, source="t", rnd=2), _drafts()])
    steps = pl.concat([_steps([("x", 0, 7, 3, 1, 2)], source="t", rnd=2), _steps()])
    t = analyze.round_comparison(drafts, steps).collect()
    assert t.select("round", "source", "offset").rows() == [
        (1, "s", 1),
        (1, "s", 2),
        (1, "s", 3),
        (2, "t", 1),
        (2, "t", 2),
        (2, "t", 3),
    ]
    _close(t["alpha"].to_list(), [3 / 4, 2 / 3, 1 / 2, 1.0, 0.0, None])
    _close(t["tau"].to_list(), [2.5] * 3 + [2.0] * 3)
    assert t["verify_steps"].to_list() == [4] * 3 + [1] * 3


def test_token_text_is_repr_escaped():
    class Tok:
        def decode(self, ids, **kw):
            return {1: " def", 2: "\n", 3: "a|b`c"}[ids[0]]

    table = pl.DataFrame({"token": [1, 2], "target_token": [3, -1]})
    out = analyze.decode_tokens(table, Tok())
    assert out["text"].to_list() == ["' def'", "'\\n'"]
    assert out["target_text"].to_list() == ["'a|b`c'", None]
    assert report.md_code("'a|b`c'") == "``'a\\|b`c'``"


def test_partial_utf8_tokens_show_their_bytes(tiny):
    _, ctx, _, _ = tiny
    tok = ctx.target_loader.tokenizer
    partial = [i for i in range(len(tok)) if "\ufffd" in tok.decode([i])]
    assert len(partial) > 1  # a byte-level BPE has tokens for lone bytes of multi-byte chars
    texts = [analyze.token_text(tok, i) for i in partial]
    assert len(set(texts)) == len(texts)  # all distinct, unlike their shared decode '\ufffd'
    for i, text in zip(partial, texts, strict=True):
        assert text.startswith("b'")
        raw = ast.literal_eval(text)
        assert raw.decode("utf-8", "replace") == tok.decode([i])


# -- the stage on literal datasets --------------------------------------------------------------


def _raw_drafts(rows=ROWS, eval_style=False) -> pa.Table:
    seq, step, anchor, offset, token, target, outcome, ap, conf = map(list, zip(*rows, strict=True))
    cols = {
        "step": step,
        "anchor": anchor,
        "offset": offset,
        "token": token,
        "q": [0.5] * len(rows),
        "p": [0.5] * len(rows),
        "accept_prob": ap,
        "outcome": outcome,
        "target_token": target,
    }
    if eval_style:  # eval: integer `sequence`, no confidence
        return pa.table({"sequence": [ord(s) - ord("a") for s in seq], **cols})
    return pa.table(
        {
            "run": ["default"] * len(rows),
            "round": [1] * len(rows),
            "seq_id": seq,
            **cols,
            "confidence": conf,
        }
    )


def _raw_steps(rows=STEPS, eval_style=False) -> pa.Table:
    seq, step, anchor, drafted, accepted, emitted = map(list, zip(*rows, strict=True))
    ids = {"sequence": [ord(s) - ord("a") for s in seq]} if eval_style else {"seq_id": seq}
    return pa.table(
        {
            **ids,
            "step": step,
            "anchor": anchor,
            "drafted": drafted,
            "accepted": accepted,
            "emitted": emitted,
        }
    )


def _write_log(store, identity, name="rollouts", rnd=1, rows=ROWS, steps=STEPS):
    eval_style = name == "eval"
    stage = {"k": 3, "temperature": 0.0} | ({} if eval_style else {"round": rnd})
    w = store.writer(
        name, stage="test-log", stage_version="1", config={"stage": stage, "target": identity}
    )
    with w:
        if eval_style:
            w.write_parquet("drafts.parquet", _raw_drafts(rows, True))
            w.write_parquet("steps.parquet", _raw_steps(steps, True))
        else:  # two shards, as the rollout stage writes them
            d, s = _raw_drafts(rows), _raw_steps(steps)
            w.write_parquet("rejections-00000.parquet", d.slice(0, 6))
            w.write_parquet("rejections-00001.parquet", d.slice(6))
            w.write_parquet("steps-00000.parquet", s.slice(0, 2))
            w.write_parquet("steps-00001.parquet", s.slice(2))
        return w.commit(meta={"drafter": "sft@000000000000"})


def _analyze(ctx, *datasets, **cfg):
    inputs = dict(zip(analyze.source_roles(len(datasets)), datasets, strict=True))
    return run_stage(analyze.STAGE, analyze.Config(position_bucket=8, **cfg), inputs, ctx).dataset


def _check_png(path):
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with Image.open(path) as im:
        im.verify()
    with Image.open(path) as im:
        w, h = im.size
        assert w >= 400 and h >= 200


def test_stage_on_rollouts(tiny):
    store, ctx, _, _ = tiny
    log = _write_log(store, ctx.target_loader.identity)
    rep = _analyze(ctx, log)
    assert rep.ref.name == "report"
    names = [
        "acceptance_by_offset",
        "tau_per_sequence",
        "tau_distribution",
        "calibration",
        "top_rejected_tokens",
        "acceptance_by_position",
    ]
    assert set(rep.shards("parquet")) == {f"{n}.parquet" for n in names}
    pngs = [
        "acceptance_by_offset",
        "tau_distribution",
        "calibration",
        "top_rejected_tokens",
        "acceptance_by_position",
    ]
    assert set(rep.shards("png")) == {f"{n}.png" for n in pngs}
    for n in pngs:
        _check_png(rep.file(f"{n}.png"))
    md = rep.file("report.md").read_text()
    for n in pngs:
        assert f"]({n}.png)" in md
    assert "**τ = 2.500**" in md and str(log.ref) in md and "round 1" in md
    # decoded with the target's tokenizer, repr-escaped
    tok = ctx.target_loader.tokenizer
    text7 = repr(tok.decode([7], skip_special_tokens=False, clean_up_tokenization_spaces=False))
    top = pl.read_parquet(rep.file("top_rejected_tokens.parquet"))
    assert top["token"].to_list() == [7, 4] and top["text"][0] == text7
    meta = rep.meta
    assert meta["tau"] == 2.5 and meta["verify_steps"] == 4 and meta["drafted_tokens"] == 12
    _close(meta["alpha"], [3 / 4, 2 / 3, 1 / 2])
    first = meta["top_rejected"][0]
    assert (first["token"], first["text"], first["rejected"], first["target_token"]) == (
        7,
        text7,
        2,
        3,
    )
    assert first["target_text"] == repr(
        tok.decode([3], skip_special_tokens=False, clean_up_tokenization_spaces=False)
    )
    assert meta["sources"] == [str(log.ref)] and "rounds" not in meta
    # the tables are the queries' answers, read back from the dataset
    assert pl.read_parquet(rep.file("acceptance_by_position.parquet")).rows() == [
        (8, 16, 4, 2, 0.5),
        (16, 24, 4, 3, 0.75),
        (24, 32, 1, 1, 1.0),
    ]


def test_stage_on_eval_without_confidence(tiny):
    store, ctx, _, _ = tiny
    log = _write_log(store, ctx.target_loader.identity, name="eval")
    drafts = analyze.scan_drafts(log).collect()
    assert drafts["seq_id"].unique().sort().to_list() == ["0", "1"]
    assert drafts["confidence"].null_count() == drafts.height
    assert drafts["position"].to_list() == [a + o - 1 for _, _, a, o, *_ in ROWS]
    rep = _analyze(ctx, log)
    assert "calibration.png" not in rep.shards() and "calibration.parquet" not in rep.shards()
    md = rep.file("report.md").read_text()
    assert "Skipped: the drafted-token logs have no `confidence` column" in md
    assert rep.meta["tau"] == 2.5


def test_stage_compares_rounds(tiny):
    store, ctx, _, _ = tiny
    ident = ctx.target_loader.identity
    r1 = _write_log(store, ident, rnd=1)
    r2_rows = [
        ("x", 0, 7, 1, 5, 5, A, 1.0, 0.9),
        ("x", 0, 7, 2, 6, 2, R, 0.0, 0.4),
        ("x", 0, 7, 3, 4, -1, N, 0.0, 0.2),
    ]
    r2 = _write_log(store, ident, rnd=2, rows=r2_rows * 2, steps=[("x", 0, 7, 3, 1, 2)] * 4)
    rep = _analyze(ctx, r2, r1)
    assert "round_comparison.parquet" in rep.shards() and "round_comparison.png" in rep.shards()
    _check_png(rep.file("round_comparison.png"))
    rounds = rep.meta["rounds"]
    assert [(r["round"], r["source"]) for r in rounds] == [(1, str(r1.ref)), (2, str(r2.ref))]
    assert rounds[0]["tau"] == 2.5 and rounds[1]["tau"] == 2.0
    _close(rounds[1]["alpha"], [1.0, 0.0, None])
    assert "## Round over round" in rep.file("report.md").read_text()


def test_refuses_another_targets_log_and_non_logs(tiny):
    store, ctx, _, prompts = tiny
    foreign = _write_log(store, ctx.target_loader.identity | {"weights_sha256": "0" * 64})
    with pytest.raises(OpdError, match="different target"):
        _analyze(ctx, foreign)
    with pytest.raises(OpdError, match="not a rejection log"):
        analyze.resolve_sources(store, [str(prompts.ref)])
    for what, drafts, error in (
        ("empty", _raw_drafts().slice(0, 0), "has no drafted tokens"),
        ("old", _raw_drafts().drop_columns(["outcome"]), "lacks column.s. outcome"),
    ):
        w = store.writer("rollouts", stage="test-log", stage_version="1", config={"case": what})
        with w:
            w.write_parquet("rejections-00000.parquet", drafts)
            w.write_parquet("steps-00000.parquet", _raw_steps())
            bad = w.commit()
        with pytest.raises(OpdError, match=error):
            analyze.scan_drafts(bad)


def test_resolve_sources(tiny):
    store, ctx, _, _ = tiny
    with pytest.raises(OpdError, match="no rollouts or eval dataset"):
        analyze.resolve_sources(store)
    ev = _write_log(store, ctx.target_loader.identity, name="eval")
    assert (
        list(analyze.resolve_sources(store).values())[0].ref == ev.ref
    )  # no rollouts: latest eval
    r2 = _write_log(store, ctx.target_loader.identity, rnd=2)
    r1 = _write_log(store, ctx.target_loader.identity, rnd=1)
    assert analyze.resolve_sources(store)["source"].ref == r1.ref  # latest rollouts first
    store.record_run(
        "exp", {"rollout-r2": r2.ref, "rollout-r1": r1.ref, "rollouts": r2.ref, "eval": ev.ref}
    )
    by_run = analyze.resolve_sources(store, run="exp")
    assert list(by_run) == ["source", "source-2"]
    assert [d.ref for d in by_run.values()] == [r1.ref, r2.ref]
    with pytest.raises(OpdError, match="given twice"):
        analyze.resolve_sources(store, [str(r1.ref), str(r1.ref)])
    with pytest.raises(OpdError, match="not both"):
        analyze.resolve_sources(store, [str(r1.ref)], run="exp")


def test_cli(tiny):
    store, ctx, _, _ = tiny
    root = ["--root", str(store.root)]
    r = CliRunner().invoke(cli, [*root, "analyze", "--profile", "tiny"])
    assert r.exit_code == 2 and r.output.startswith("error: no rollouts or eval dataset"), r.output
    log = _write_log(store, ctx.target_loader.identity)
    r = CliRunner().invoke(
        cli,
        [*root, "analyze", "--profile", "tiny", "--json", "--top", "1", "--position-bucket", "8"],
    )
    assert r.exit_code == 0, r.output
    out = json.loads(r.output)
    assert out["sources"] == [str(log.ref)] and out["tau"] == 2.5 and out["verify_steps"] == 4
    assert [t["token"] for t in out["top_rejected"]] == [7]
    assert out["report"].startswith("report@") and out["path"].endswith("report.md")
    r = CliRunner().invoke(
        cli,
        [
            *root,
            "analyze",
            "--profile",
            "tiny",
            "--input",
            str(log.ref),
            "--top",
            "1",
            "--position-bucket",
            "8",
        ],
    )
    assert r.exit_code == 0, r.output
    assert "(cached)" in r.output and "tau 2.500 over 4 verify steps" in r.output
    assert "alpha by offset [0.750 0.667 0.500]" in r.output
