"""`opd experiment sft-plateau` on the tiny profile: the runs, the report dataset, bad input."""

import json

import polars as pl
import pytest
from click.testing import CliRunner

from lab.cli import cli
from lab.experiments import sft_plateau
from pipeline.core import drafters
from pipeline.core.runner import planned_ref
from pipeline.profiles import load_config
from pipeline.stages import sft
from storage import OpdError
from tests.lab.conftest import write_recipe

EPOCHS = ["sft.steps=null", "sft.epochs=1", "sft.val_every=2"]  # the experiment sizes in epochs


def test_sft_plateau_trains_each_share_and_epochs_and_reports_the_curves(tiny):
    store, ctx, _, prompts = tiny
    cfg = load_config("tiny", sets=EPOCHS)
    result = sft_plateau.sft_plateau(
        cfg, ctx, data_shares=[0.5, 1.0], epochs=None, plateau_gain=0.01, prompts=prompts
    )
    runs = pl.DataFrame(result["runs"])
    # each share at the profile's epochs, then all the data at its epochs and twice them
    assert runs.select("share", "epochs").rows() == [(0.5, 1.0), (1.0, 1.0), (1.0, 2.0)]
    feats = store.open(result["features"])
    whole = runs.filter((pl.col("share") == 1.0) & (pl.col("epochs") == 1.0)).row(0, named=True)
    # all the data at the profile's epochs is the profile's own sft (shared with the chain)
    assert whole["drafter"] == str(planned_ref(sft.STAGE, cfg.sft, {"features": feats}, ctx))
    half, _, longer = runs.iter_rows(named=True)
    assert half["sequences"] == round(whole["sequences"] / 2)
    assert longer["sequences"] == whole["sequences"] and longer["steps"] == 2 * whole["steps"]
    assert store.open(half["drafter"]).config["stage"]["train_share"] == 0.5

    report = store.open(result["report"])
    curves = pl.read_parquet(report.file("curves.parquet"))
    for run in runs.iter_rows(named=True):
        m = pl.read_parquet(store.open(run["drafter"]).file(drafters.METRICS_FILE))
        train, val = (m.filter(pl.col("kind") == k) for k in ("train", "val"))
        assert run["tokens"] == train["tokens"].sum()
        assert run["row_steps"] == train["row_steps"].sum()
        assert (run["tau_t0"], run["tau_t1"]) == val.select("tau_sim", "tau_expected").row(-1)
        mine = curves.filter(pl.col("run") == run["run"])
        assert mine["step"].to_list() == val["step"].to_list()
        seen = train.select("step", pl.col("tokens").cum_sum()).rows()
        assert mine.select("step", "tokens_seen").rows() == [
            s for s in seen if s[0] in mine["step"]
        ]

    # gains: each step up against the run below it, on each axis
    (data,) = result["data_axis"]["gains"]
    assert (data["from"], data["to"]) == (0.5, 1.0)
    assert data["gain_t0"] == pytest.approx(whole["tau_t0"] - half["tau_t0"])
    (steps,) = result["steps_axis"]["gains"]
    assert steps["gain_t1"] == pytest.approx(longer["tau_t1"] - whole["tau_t1"])

    assert report.manifest["stage"] == "experiment-sft-plateau"
    assert set(report.shards()) == {"runs.parquet", "curves.parquet", "plateau.png", "report.md"}
    assert pl.read_parquet(report.file("runs.parquet")).equals(runs)
    assert report.file("plateau.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = report.file("report.md").read_text()
    assert result["data_axis"]["verdict"] in md and result["steps_axis"]["verdict"] in md
    assert report.meta["runs"] == result["runs"]

    # the CLI prints the same result (everything is cached now, the report too) as JSON
    recipe = write_recipe(store.root.parent, *EPOCHS)
    args = ["--root", str(store.root), "experiment", "sft-plateau", "--recipe", recipe]
    args += ["--data-shares", "0.5,1", "--prompts", str(prompts.ref), "--json"]
    r = CliRunner().invoke(cli, args)
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout) == result


def test_sft_plateau_sizes_runs_in_steps_when_the_profile_does(tiny):
    store, ctx, _, prompts = tiny
    cfg = load_config("tiny", sets=["sft.val_every=2"])  # the tiny profile trains 6 steps
    result = sft_plateau.sft_plateau(
        cfg, ctx, data_shares=[0.5, 1.0], steps=[6, 9], plateau_gain=0.01, prompts=prompts
    )
    runs = pl.DataFrame(result["runs"])
    # every share for the profile's steps, then all the data for each of --steps
    assert runs.select("share", "steps").rows() == [(0.5, 6), (1.0, 6), (1.0, 9)]
    assert runs["run"].to_list() == ["share0.5:steps6", "share1:steps6", "share1:steps9"]
    feats = store.open(result["features"])
    half, whole, longer = runs.iter_rows(named=True)
    assert whole["drafter"] == str(planned_ref(sft.STAGE, cfg.sft, {"features": feats}, ctx))
    stage = store.open(longer["drafter"]).config["stage"]
    assert (stage["steps"], stage.get("train_share")) == (9, None)
    assert store.open(half["drafter"]).config["stage"]["train_share"] == 0.5
    # a run sized in steps reports the epochs it reached: the half share passes over its
    # sequences more often in the same steps
    for run in (half, whole, longer):
        reached = store.open(run["drafter"]).meta["epochs"]
        assert run["epochs"] == round(reached, 2)
    assert half["sequences"] < whole["sequences"] and half["epochs"] > whole["epochs"]

    assert result["sized_in"] == "steps" and result["profile_size"] == 6
    (data,) = result["data_axis"]["gains"]
    assert (data["from"], data["to"]) == (0.5, 1.0)
    assert data["gain_t1"] == pytest.approx(whole["tau_t1"] - half["tau_t1"])
    (steps,) = result["steps_axis"]["gains"]
    assert (steps["from"], steps["to"]) == (6, 9)
    assert steps["gain_t0"] == pytest.approx(longer["tau_t0"] - whole["tau_t0"])
    report = store.open(result["report"])
    curves = pl.read_parquet(report.file("curves.parquet"))
    assert sorted(set(curves["steps"].to_list())) == [6, 9]
    assert "each share for 6 steps" in report.file("report.md").read_text()
    assert report.file("plateau.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    recipe = write_recipe(store.root.parent, "sft.val_every=2")
    args = ["--root", str(store.root), "experiment", "sft-plateau", "--recipe", recipe]
    args += ["--data-shares", "0.5,1", "--steps", "6,9"]
    r = CliRunner().invoke(cli, [*args, "--prompts", str(prompts.ref), "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout) == result


def test_the_verdict_names_the_last_step_up_and_whether_it_paid():
    gains = [
        {"from": 0.25, "to": 0.5, "gain_t0": 0.05, "gain_t1": 0.04},
        {"from": 0.5, "to": 1.0, "gain_t0": 0.004, "gain_t1": -0.002},
    ]
    assert sft_plateau._verdict(gains, 0.01).startswith("plateau: 0.5 -> 1 raised")
    assert sft_plateau._verdict(gains, 0.001) == (
        "still rising: 0.5 -> 1 raised tau by +0.004 (T=0), -0.002 (T=1)"
    )
    assert sft_plateau._verdict(gains[:0], 0.01).startswith("not measured")


@pytest.mark.parametrize(
    ("sets", "shares", "epochs", "steps", "message"),
    [
        ([], [1.0], [2.0], None, "give --steps instead of --epochs"),  # the tiny profile: steps
        (EPOCHS, [1.0], None, [12.0], "needs --set sft.steps=N"),
        ([], [1.0], None, [4.5], "--steps must be whole numbers > 0"),
        ([], [1.0], None, [0.0], "--steps must be whole numbers > 0"),
        ([*EPOCHS, "sft.train_share=0.5"], [1.0], None, None, "sets sft.train_share itself"),
        (EPOCHS, [0.0, 1.0], None, None, r"--data-shares must be in \(0, 1\]"),
        (EPOCHS, [1.0], [0.0], None, "--epochs must be > 0"),
        # it ran sft first, then failed on "val_share must be above 0"
        ([*EPOCHS, "drafter.kind=ngram"], [1.0], None, None, "ngram drafter needs no training"),
    ],
)
def test_sft_plateau_refuses_bad_input_before_any_work(tiny, sets, shares, epochs, steps, message):
    store, ctx, _, prompts = tiny
    cfg = load_config("tiny", sets=sets)
    with pytest.raises(OpdError, match=message):
        sft_plateau.sft_plateau(
            cfg, ctx, data_shares=shares, epochs=epochs, steps=steps, prompts=prompts
        )
    assert not (store.root / "sft").exists()
