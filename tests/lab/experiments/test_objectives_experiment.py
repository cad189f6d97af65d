"""`opd experiment objectives` on the tiny profile: matched runs, the report dataset, bad input."""

import json

import polars as pl
import pytest
from click.testing import CliRunner

from lab.cli import cli
from lab.experiments import objectives
from pipeline.core import drafters
from pipeline.core.runner import planned_ref
from pipeline.profiles import load_config
from pipeline.stages import sft
from storage import OpdError
from tests.lab.conftest import write_recipe


def test_objectives_trains_both_at_matched_steps_and_writes_its_report(tiny):
    store, ctx, cfg, prompts = tiny
    result = objectives.objectives(cfg, ctx, seeds=1, prompts=prompts)
    k, ttt = cfg.drafting.k, cfg.drafting.ttt_steps

    runs = pl.DataFrame(result["runs"])
    assert runs.select("objective", "temperature").rows() == [
        ("eagle3", 0.0),
        ("eagle3", 1.0),
        ("eagle1", 0.0),
        ("eagle1", 1.0),
    ]
    drafter = {
        o: store.open(runs.filter(pl.col("objective") == o)["drafter"][0])
        for o in ("eagle3", "eagle1")
    }
    # EAGLE-3 is the profile's own sft (shared with the chain's cached warm-up); EAGLE-1 differs
    # only in its objective
    feats = store.open(result["features"])
    assert drafter["eagle3"].ref == planned_ref(sft.STAGE, cfg.sft, {"features": feats}, ctx)
    assert drafter["eagle1"].config["stage"] == drafter["eagle3"].config["stage"] | {
        "objective": "eagle1"
    }
    # matched: the same optimizer steps over the same token rows; row-steps differ by ttt_steps
    tokens = {
        o: pl.read_parquet(ds.file(drafters.METRICS_FILE))
        .filter(pl.col("kind") == "train")["tokens"]
        .to_list()
        for o, ds in drafter.items()
    }
    assert tokens["eagle3"] == tokens["eagle1"] and len(tokens["eagle1"]) == cfg.sft.steps
    assert result["row_steps"] == {
        "eagle3": ttt * sum(tokens["eagle1"]),
        "eagle1": sum(tokens["eagle1"]),
    }
    assert set(runs["sft_steps"]) == {cfg.sft.steps}

    # each row is its eval's tau and per-offset alpha
    for run in runs.iter_rows(named=True):
        ev = store.open(run["eval"])
        assert ev.inputs == {"prompts": str(prompts.ref), "drafter": run["drafter"]}
        assert ev.config["stage"]["temperature"] == run["temperature"]
        assert run["tau"] == ev.meta["tau"]
        reached = [run[f"alpha_{i}"] for i in range(1, k + 1) if run[f"alpha_{i}"] is not None]
        assert reached == pytest.approx(ev.meta["alpha"])
        t = str(run["temperature"])
        assert result["tau"][run["objective"]][t]["per_seed"] == [run["tau"]]

    report = store.open(result["report"])
    assert report.manifest["stage"] == "experiment-objectives"
    assert set(report.shards()) == {
        "objectives.parquet",
        "acceptance_by_offset.parquet",
        "summary.parquet",
        "alpha_by_offset.png",
        "report.md",
    }
    table = pl.read_parquet(report.file("objectives.parquet"))
    assert [f"alpha_{i}" for i in range(1, k + 1)] == [c for c in table.columns if "alpha" in c]
    assert table.equals(runs)
    counts = pl.read_parquet(report.file("acceptance_by_offset.parquet"))
    assert counts.height == 4 * k
    hit = counts.filter(pl.col("reached") > 0)
    assert (hit["alpha"] == hit["accepted"] / hit["reached"]).all()
    assert report.file("alpha_by_offset.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = report.file("report.md").read_text()
    assert "![alpha by offset](alpha_by_offset.png)" in md and result["matched"] in md
    assert report.meta["tau"] == result["tau"]
    assert result["report_md"] == str(report.path / "report.md")

    # the CLI prints the same result (everything is cached now, the report too) as JSON
    r = CliRunner().invoke(
        cli,
        [
            "--root",
            str(store.root),
            "experiment",
            "objectives",
            "--recipe",
            write_recipe(store.root.parent, profile="tiny"),
            "--seeds",
            "1",
            "--prompts",
            str(prompts.ref),
            "--json",
        ],
    )
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout) == result


@pytest.mark.parametrize(
    ("sets", "seeds", "message"),
    [
        ([], 0, "--seeds must be >= 1"),
        (["sft.objective=eagle1"], 1, "drop --set sft.objective"),
        (['drafting.tree={"depth": 3, "top_k": 2, "budget": 6}'], 1, "drop drafting.tree"),
        # its table held lossy T=1 numbers, unmarked
        (["drafting.acceptance=typical"], 1, "drafting.acceptance=typical is lossy: drop it"),
        # it ran prompts and sft first, then failed on "no drafted tokens"
        (["drafter.kind=ngram"], 1, "ngram drafter needs no training, so the objectives"),
    ],
)
def test_objectives_refuses_bad_input_before_any_work(tiny, sets, seeds, message):
    store, ctx, _, prompts = tiny
    cfg = load_config("tiny", sets=sets)
    with pytest.raises(OpdError, match=message):
        objectives.objectives(cfg, ctx, seeds=seeds, prompts=prompts)
    assert not (store.root / "sft").exists()


def test_the_eagle1_run_drops_the_ttt_step_weighting_it_does_not_use():
    cfg = load_config("tiny", sets=["sft.step_decay=0.5"])
    assert objectives.sft_config(cfg, "eagle3", 3).step_decay == 0.5
    eagle1 = objectives.sft_config(cfg, "eagle1", 3)
    assert (eagle1.objective, eagle1.seed, eagle1.step_decay) == ("eagle1", 3, 0.8)
