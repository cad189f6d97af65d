"""`opd experiment opd-vs-sft` on the tiny profile: the JSON, the budgets and the arms' lineage."""

import json

import polars as pl
from click.testing import CliRunner

from cli.main import cli
from pipeline import drafters, experiment, rollout
from pipeline.profiles import load_config


def test_opd_vs_sft_matches_budgets_and_reports_every_arm(tiny):
    store, ctx, _, prompts = tiny
    cfg = load_config("tiny", sets=["rounds=1"])
    result = experiment.opd_vs_sft(cfg, ctx, seeds=2, budget_ratio=0.5, prompts=prompts)

    for key in ("tau_sft_warmup", "tau_sft_continued", "tau_opd", "opd_over_sft_continued"):
        assert set(result[key]) == {"0.0", "1.0"}, key
    for arm in ("tau_sft_continued", "tau_opd"):
        for t in ("0.0", "1.0"):
            s = result[arm][t]
            assert len(s["per_seed"]) == 2 and s["min"] <= s["mean"] <= s["max"] and s["std"] >= 0
    assert "row-steps" in result["budget_unit"]
    budget = result["budget_row_steps"]
    assert budget == round(0.5 * result["warmup"]["budget_row_steps"])
    assert json.loads(open(result["saved_to"]).read()) == result

    for seed, run in zip((0, 1), result["seeds"], strict=True):
        assert run["seed"] == seed
        cont, opd_arm = run["sft_continued"], run["opd"]
        # continued SFT: the fewest steps reaching the budget, from the warm-up drafter
        ds = store.open(cont["drafter"])
        warm = store.open(result["warmup"]["drafter"])
        assert ds.inputs == {
            "features": cont["data"],
            "more_features": warm.inputs["features"],  # the original features too
            "drafter": str(warm.ref),
        }
        spent = pl.read_parquet(ds.file(drafters.METRICS_FILE)).filter(pl.col("kind") == "train")
        last = int(spent["tokens"][-1]) * ds.config["stage"]["ttt_steps"]
        assert budget <= cont["budget_row_steps"] < budget + last
        # Draft-OPD: the same budget (one round here), starting from the same warm-up
        assert budget <= opd_arm["budget_row_steps"]
        opd_ds = store.open(opd_arm["drafter"])
        assert opd_ds.inputs["drafter"] == result["warmup"]["drafter"]
        # by default both arms train on the same target sequences: OPD's first rollout
        assert opd_ds.inputs["rollouts"] == cont["data"]
        assert cont["val"] and all("tau_sim" in v for v in cont["val"])
    # the seeds really are different runs of both arms
    assert result["seeds"][0]["opd"]["drafter"] != result["seeds"][1]["opd"]["drafter"]
    assert (
        result["seeds"][0]["sft_continued"]["drafter"]
        != result["seeds"][1]["sft_continued"]["drafter"]
    )

    # the CLI prints the same result (everything is cached now) as JSON
    r = CliRunner().invoke(
        cli,
        [
            "--root",
            str(store.root),
            "experiment",
            "opd-vs-sft",
            "--profile",
            "tiny",
            "--set",
            "rounds=1",
            "--seeds",
            "2",
            "--budget",
            str(budget),
            "--prompts",
            str(prompts.ref),
            "--json",
        ],
    )
    assert r.exit_code == 0, r.output
    printed = json.loads(r.output)
    assert printed["tau_opd"] == result["tau_opd"] and printed["budget_row_steps"] == budget

    # another process may run seed 1 alone against the same root: the same (cached) datasets
    r = CliRunner().invoke(
        cli,
        ["--root", str(store.root), "experiment", "opd-vs-sft", "--profile", "tiny"]
        + ["--set", "rounds=1", "--seeds", "1", "--first-seed", "1", "--budget", str(budget)]
        + ["--prompts", str(prompts.ref), "--json"],
    )
    assert r.exit_code == 0, r.output
    alone = json.loads(r.output)["seeds"]
    assert [s["seed"] for s in alone] == [1]
    assert alone[0]["opd"]["drafter"] == result["seeds"][1]["opd"]["drafter"]
    assert alone[0]["sft_continued"]["drafter"] == result["seeds"][1]["sft_continued"]["drafter"]


def test_continued_sft_data_covers_every_prompt_the_opd_rounds_draft_on():
    cfg = load_config(
        "tiny",
        sets=[
            "rounds=3",
            "rollout.max_prompts=4",
            "rollout.skip_prompts=2",
            "rollout.new_prompts_each_round=true",
        ],
    )

    def span(c: rollout.Config) -> range:
        first = rollout.first_prompt(c)
        return range(first, first + c.max_prompts)

    rounds = [cfg.rollout.model_copy(update={"round": r}) for r in (1, 2, 3)]
    opd_prompts = [i for c in rounds for i in span(c)]
    data = experiment.sft_data_config(cfg, seed=1, temperature=None)
    assert list(span(data)) == opd_prompts == list(range(2, 14))
    assert data.temperature == cfg.rollout.temperature
    # without new prompts each round, every round (and the SFT data) drafts on the same prompts
    same = cfg.model_copy(
        update={"rollout": cfg.rollout.model_copy(update={"new_prompts_each_round": False})}
    )
    assert list(span(experiment.sft_data_config(same, 1, None))) == list(range(2, 6))
    sampled = experiment.sft_data_config(cfg, seed=1, temperature=1.0)
    assert sampled.temperature == 1.0 and sampled.seed == 1
