"""`opd experiment opd-vs-sft` and `opd experiment ablate` on the tiny profile: the JSON, the
budgets, the arms' lineage, the held-out curves and the report datasets."""

import json
import typing

import polars as pl
import pytest
from click.testing import CliRunner

from lab.cli import cli
from lab.experiments import ablate, common
from lab.experiments import opd_vs_sft as opd_vs_sft_experiment
from models.draft_length import tau_from_alpha
from models.losses import ReplayLoss
from pipeline.core import drafters
from pipeline.core.config import version_dict
from pipeline.profiles import load_config
from pipeline.stages import rollout
from storage import OpdError
from tests.lab.conftest import write_recipe


@pytest.fixture(scope="module")
def opd_vs_sft(tmp_path_factory):
    """One 2-seed run of opd-vs-sft (1 round, half the warm-up's budget) on the tiny profile."""
    from pipeline.core.runner import RunContext
    from pipeline.core.targets import TargetLoader
    from storage import Store
    from tests.pipeline.conftest import write_prompts

    store = Store(tmp_path_factory.mktemp("data"))
    cfg = load_config("tiny", sets=["rounds=1"])
    ctx = RunContext(store=store, target_loader=TargetLoader(cfg.target), progress=False)
    prompts = write_prompts(store)
    result = opd_vs_sft_experiment.opd_vs_sft(
        cfg,
        ctx,
        seeds=2,
        budget_ratio=0.5,
        prompts=common.WarmupPrompts(prompts),
        command="opd experiment ...",
    )
    return store, ctx, prompts, result


def test_opd_vs_sft_leads_with_means_over_seeds_and_matches_budgets(opd_vs_sft):
    store, _, prompts, result = opd_vs_sft
    for s in ("", "_t1"):
        t = "0.0" if s == "" else "1.0"
        for arm in ("sft_continued", "opd"):
            per_seed = result[f"tau_{arm}{s}_per_seed"]
            assert per_seed == [r[arm]["tau"][t] for r in result["runs"]]
            assert result[f"tau_{arm}{s}"] == pytest.approx(sum(per_seed) / 2)
            assert result[f"tau_{arm}{s}_std"] >= 0
        assert result[f"opd_over_sft_continued{s}"] == pytest.approx(
            result[f"tau_opd{s}"] / result[f"tau_sft_continued{s}"]
        )
        assert len(result[f"opd_over_sft_continued{s}_per_seed"]) == 2
        assert result[f"tau_sft_warmup{s}"] == result["warmup"]["tau"][t]
    assert list(result)[:4] == [
        "experiment",
        "tau_sft_continued",
        "tau_sft_continued_per_seed",
        "tau_sft_continued_std",
    ]
    assert "row-steps" in result["budget_unit"]
    budget = result["budget_row_steps"]
    assert budget == round(0.5 * result["warmup"]["budget_row_steps"])
    assert json.loads(open(result["saved_to"]).read()) == result
    assert result["seeds"] == [0, 1]

    heldout = store.open(result["heldout_sequences"])
    # the held-out sequences are the target's greedy continuations of evaluate's prompts
    assert heldout.config["stage"]["split"] == "heldout"
    assert heldout.config["stage"]["temperature"] == 0.0
    assert heldout.config["stage"]["max_prompts"] == 4  # tiny's evaluate.max_prompts
    for seed, run in zip((0, 1), result["runs"], strict=True):
        assert run["seed"] == seed
        cont, opd_arm = run["sft_continued"], run["opd"]
        # continued SFT: the fewest steps reaching the budget, from the warm-up drafter
        ds = store.open(cont["drafter"])
        warm = store.open(result["warmup"]["drafter"])
        assert ds.inputs == {
            "features": cont["data"],
            "more_features": warm.inputs["features"],  # the original features too
            "drafter": str(warm.ref),
            "heldout": str(heldout.ref),
        }
        spent = pl.read_parquet(ds.file(drafters.METRICS_FILE)).filter(pl.col("kind") == "train")
        last = int(spent["tokens"][-1]) * ds.config["stage"]["ttt_steps"]
        assert budget <= cont["budget_row_steps"] < budget + last
        # Draft-OPD: the same budget (one round here), starting from the same warm-up
        assert budget <= opd_arm["budget_row_steps"]
        opd_ds = store.open(opd_arm["drafter"])
        assert opd_ds.inputs["drafter"] == result["warmup"]["drafter"]
        assert opd_ds.inputs["heldout"] == str(heldout.ref)
        # by default both arms train on the same target sequences: OPD's first rollout
        assert opd_ds.inputs["rollouts"] == cont["data"]
        assert cont["val"] and all("tau_sim" in v for v in cont["val"])

        # the held-out curves: both start at the warm-up drafter, on the same sequences
        sft_curve, opd_curve = cont["heldout_curve"], opd_arm["heldout_curve"]
        warm_budget = result["warmup"]["budget_row_steps"]
        assert sft_curve[0]["step"] == opd_curve[0]["step"] == 0
        assert sft_curve[0]["row_steps"] == opd_curve[0]["row_steps"] == warm_budget
        assert sft_curve[0]["tau_sim"] == pytest.approx(opd_curve[0]["tau_sim"])
        assert sft_curve[-1]["row_steps"] == warm_budget + cont["budget_row_steps"]
        assert opd_curve[-1]["row_steps"] == warm_budget + opd_arm["budget_row_steps"]
        for curve in (sft_curve, opd_curve):
            assert [p["row_steps"] for p in curve] == sorted(p["row_steps"] for p in curve)
            assert all(1 <= p["tau_sim"] <= 1 + result["k"] for p in curve)
        # ~10 validations over continued SFT (fewer when it runs fewer steps), a few per round
        assert len(sft_curve) == 1 + min(common.SFT_VALIDATIONS, cont["steps"])
        assert len(opd_curve) >= 1 + min(common.OPD_VALIDATIONS, opd_arm["steps"][0])
    # the seeds really are different runs of both arms
    runs = result["runs"]
    assert runs[0]["opd"]["drafter"] != runs[1]["opd"]["drafter"]
    assert runs[0]["sft_continued"]["drafter"] != runs[1]["sft_continued"]["drafter"]


def test_opd_vs_sft_writes_a_report_dataset(opd_vs_sft):
    store, _, _, result = opd_vs_sft
    report = store.open(result["report"])
    assert report.ref.name == "experiment"
    assert {"tau.parquet", "heldout_curve.parquet", "tau.png", "plateau.png", "report.md"} <= set(
        report.shards()
    )
    tau = pl.read_parquet(report.file("tau.parquet"))
    # the warm-up once per temperature, then 2 arms x 2 seeds x 2 temperatures
    assert tau.height == 2 + 8
    opd0 = tau.filter((pl.col("arm") == "opd") & (pl.col("temperature") == 0.0))
    assert sorted(opd0["tau"]) == sorted(result["tau_opd_per_seed"])
    curves = pl.read_parquet(report.file("heldout_curve.parquet"))
    assert set(curves["arm"]) == {"sft_continued", "opd"} and set(curves["seed"]) == {0, 1}
    # acceptance by draft offset: one row per arm and temperature, the mean of the seeds' evals
    alpha = pl.read_parquet(report.file("alpha.parquet"))
    assert alpha.height == 3 * 2 and "alpha_1" in alpha.columns
    for t in (0.0, 1.0):
        got = alpha.filter((pl.col("arm") == "opd") & (pl.col("temperature") == t))["alpha_1"]
        seeds = [r["opd"]["alpha"][str(t)][0] for r in result["runs"]]
        assert got.item() == pytest.approx(sum(seeds) / len(seeds), abs=1e-3)
    warm_first = result["warmup"]["alpha"]["0.0"][0]
    assert 0.0 <= warm_first <= 1.0
    # the change of tau between arms, split over offsets: the shares add up to the change of
    # the tau the mean alphas give, and the first offset's share is its alpha change weighed
    # by everything after it
    changes = pl.read_parquet(report.file("tau_changes.parquet"))
    assert changes.height == 3 * 2
    k = result["k"]

    def mean_alphas(arm: str, t: float) -> list[float]:
        if arm == "sft_warmup":
            seeds = [result["warmup"]["alpha"][str(t)]]
        else:
            seeds = [r[arm]["alpha"][str(t)] for r in result["runs"]]
        padded = [[*a, *[0.0] * (k - len(a))] for a in seeds]
        return [sum(col) / len(col) for col in zip(*padded, strict=True)]

    for t in (0.0, 1.0):
        row = changes.filter(
            (pl.col("temperature") == t) & (pl.col("change") == "Draft-OPD − continued SFT")
        ).row(0, named=True)
        opd, cont = mean_alphas("opd", t), mean_alphas("sft_continued", t)
        shares = [row[f"offset_{i}"] for i in range(1, k + 1)]
        whole = tau_from_alpha(opd, k) - tau_from_alpha(cont, k)
        assert sum(shares) == pytest.approx(whole, abs=1e-3) and row["total"] == pytest.approx(
            whole, abs=1e-4
        )
        after_first = tau_from_alpha(cont[1:], k - 1)
        assert shares[0] == pytest.approx((opd[0] - cont[0]) * after_first, abs=1e-4)
    for png in ("tau.png", "plateau.png"):
        assert report.file(png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = report.file("report.md").read_text()
    assert "![held-out tau vs row-steps](plateau.png)" in md and "opd experiment ..." in md
    assert "## Acceptance by draft offset" in md and "alpha_1" in md
    assert "Draft-OPD − continued SFT" in md and "offset_1" in md
    assert f"{result['opd_over_sft_continued']:.3f}" in md
    assert report.meta["tau_opd"] == result["tau_opd"]
    # the training-free baseline beside the arms, on the same prompts at each temperature
    free = result["warmup"]["free_baseline"]
    assert set(free) == {"0.0", "1.0"} and all(f["tau"] >= 1.0 for f in free.values())
    assert f"(needs no training) on the same prompts: τ {free['0.0']['tau']:.3f} at T=0" in md


def test_opd_vs_sft_cli_prints_the_cached_result(opd_vs_sft):
    store, _, prompts, result = opd_vs_sft
    recipe = write_recipe(store.root.parent, "rounds=1")
    args = ["--root", str(store.root), "experiment", "opd-vs-sft", "--recipe", recipe]
    args += ["--seeds", "2", "--budget", str(result["budget_row_steps"])]
    r = CliRunner().invoke(cli, [*args, "--prompts", str(prompts.ref), "--json"])
    assert r.exit_code == 0, r.output
    printed = json.loads(r.stdout)
    for key in ("tau_opd", "tau_opd_t1", "tau_sft_continued", "tau_sft_continued_t1"):
        assert printed[key] == result[key]
    assert printed["report"] == result["report"]  # everything was cached, the report too
    # --seeds defaults to 3
    seeds = next(
        p for p in cli.commands["experiment"].commands["opd-vs-sft"].params if p.name == "seeds"
    )
    assert seeds.default == 3
    text = opd_vs_sft_experiment.summary_text(result)
    assert "OPD/SFT" in text and f"{result['opd_over_sft_continued']:>8.3f}" in text

    # another process may run seed 1 alone against the same root: the same (cached) datasets
    args[args.index("--seeds") + 1] = "1"
    args += ["--first-seed", "1"]
    r = CliRunner().invoke(cli, [*args, "--prompts", str(prompts.ref), "--json"])
    assert r.exit_code == 0, r.output
    alone = json.loads(r.stdout)
    assert alone["seeds"] == [1]
    for arm in ("opd", "sft_continued"):
        assert alone["runs"][0][arm]["drafter"] == result["runs"][1][arm]["drafter"]


def _benchmark_prompts(store, prompts, split_of_sets: str):
    """A prompts dataset whose held-out split holds two named sets, a and b, taken from
    `prompts`' rows of `split_of_sets` (its held-out rows: never trained on; its train rows: the
    case the experiment refuses)."""
    import pyarrow as pa

    from pipeline.core.stage import HELDOUT_SETS

    rows = [r for r in prompts.read_table().to_pylist() if r["split"] == split_of_sets][:4]
    sources = ["a:1", "b:1", "a:2", "b:2"]
    table = [r | {"split": "heldout", "source": s} for r, s in zip(rows, sources, strict=True)]
    w = store.writer(
        "prompts", stage="test-prompts", stage_version="1", config={"of": split_of_sets}
    )
    with w:
        w.write_parquet("part-00000.parquet", pa.Table.from_pylist(table))
        return w.commit(meta={HELDOUT_SETS: ["a", "b"]})


def test_opd_vs_sft_evaluates_other_prompts_per_set_and_retrains_nothing(opd_vs_sft):
    store, ctx, prompts, result = opd_vs_sft
    bench = _benchmark_prompts(store, prompts, "heldout")
    other = opd_vs_sft_experiment.opd_vs_sft(
        load_config("tiny", sets=["rounds=1"]),
        ctx,
        seeds=2,
        budget=result["budget_row_steps"],
        prompts=common.WarmupPrompts(prompts, eval_prompts=bench, eval_max_prompts=2),
    )
    assert other["eval_prompts"] == str(bench.ref) and result["eval_prompts"] == str(prompts.ref)
    assert other["heldout_prompts"] == 2  # of each set, while the arms validate on tiny's 4
    # the same drafters, trained and validated as before: only the evaluations are new
    assert other["warmup"]["drafter"] == result["warmup"]["drafter"]
    for new, old in zip(other["runs"], result["runs"], strict=True):
        for arm in ("opd", "sft_continued"):
            assert new[arm]["drafter"] == old[arm]["drafter"]
            assert new[arm]["heldout_curve"] == old[arm]["heldout_curve"]
    assert other["heldout_sequences"] == result["heldout_sequences"]
    for t, s in (("0.0", ""), ("1.0", "_t1")):
        sets = other["by_set"][t]
        assert sorted(sets) == ["a", "b"]
        assert all(run["opd"]["by_set"][t] for run in other["runs"])
        for name, row in sets.items():
            for arm in ("opd", "sft_continued"):
                per_seed = [run[arm]["by_set"][t][name] for run in other["runs"]]
                assert row[f"{arm}_per_seed"] == per_seed
                assert row[arm] == pytest.approx(sum(per_seed) / 2)
            assert row["opd_over_sft_continued"] == pytest.approx(row["opd"] / row["sft_continued"])
            assert row["sft_warmup"] == other["warmup"]["by_set"][t][name]
        # both sets' prompts together: τ lies between the sets' own
        lo, hi = sorted(sets[n]["opd"] for n in sets)
        assert lo - 1e-9 <= other[f"tau_opd{s}"] <= hi + 1e-9
    report = store.open(other["report"])
    md = report.file("report.md").read_text()
    assert "## τ per held-out set" in md and f"`{bench.ref}`" in md
    assert "the lines and the squares are on different prompts" in md
    by_set = pl.read_parquet(report.file("tau_by_set.parquet"))
    assert by_set.height == 2 * 2 and set(by_set["set"]) == {"a", "b"}
    # one set only (the default prompts name none): no per-set section
    own = store.open(result["report"]).file("report.md").read_text()
    assert "## τ per held-out set" not in own and "of the prompts evaluate decodes" in own


def test_opd_vs_sft_refuses_eval_prompts_it_trains_on(opd_vs_sft):
    store, _, prompts, result = opd_vs_sft
    trained_on = _benchmark_prompts(store, prompts, "train")
    cfg = load_config("tiny", sets=["rounds=1"])
    _, ctx, _, _ = opd_vs_sft
    with pytest.raises(OpdError, match=r"4 of the 4 prompts .* are training prompts of"):
        opd_vs_sft_experiment.opd_vs_sft(
            cfg, ctx, seeds=1, budget=1, prompts=common.WarmupPrompts(prompts, trained_on)
        )
    recipe = write_recipe(store.root.parent, "rounds=1")
    r = CliRunner().invoke(
        cli,
        ["--root", str(store.root), "experiment", "opd-vs-sft", "--recipe", recipe]
        + ["--prompts", result["warmup"]["drafter"]],
    )
    assert r.exit_code != 0 and "--prompts" in r.output and "not a prompts" in r.output


def _prompts_of(store, rows: list[dict], tag: str):
    """A prompts dataset whose train split holds `rows`."""
    import pyarrow as pa

    from tests.pipeline.conftest import PROMPTS_SCHEMA

    table = [
        {"prompt_id": f"{r['prompt_id']}-{tag}", "split": "train", "prompt_ids": r["prompt_ids"]}
        for r in rows
    ]
    w = store.writer("prompts", stage="test-prompts", stage_version="1", config={"tag": tag})
    with w:
        w.write_parquet("part-00000.parquet", pa.Table.from_pylist(table, schema=PROMPTS_SCHEMA))
        return w.commit()


def test_opd_vs_sft_drafts_on_fresh_prompts_and_refuses_trained_or_evaluated_ones(opd_vs_sft):
    store, ctx, prompts, result = opd_vs_sft
    rows = prompts.read_table().to_pylist()
    # the training prompts' tokens reversed: prompts the warm-up never saw
    unseen = [r | {"prompt_ids": r["prompt_ids"][::-1]} for r in rows if r["split"] == "train"]
    fresh = _prompts_of(store, unseen, "fresh")
    cfg = load_config("tiny", sets=["rounds=1"])
    budget = result["budget_row_steps"]
    other = opd_vs_sft_experiment.opd_vs_sft(
        cfg,
        ctx,
        seeds=1,
        budget=budget,
        prompts=common.WarmupPrompts(prompts, rollout_prompts=fresh),
    )
    assert result["rollout_prompts"] == str(prompts.ref)  # the default: the warm-up's own
    assert other["rollout_prompts"] == str(fresh.ref)
    # the same warm-up and held-out sequences; both arms train on the fresh prompts' sequences
    assert other["warmup"]["drafter"] == result["warmup"]["drafter"]
    assert other["heldout_sequences"] == result["heldout_sequences"]
    new, old = other["runs"][0], result["runs"][0]
    data = store.open(new["sft_continued"]["data"])
    assert data.inputs["prompts"] == str(fresh.ref)
    assert store.open(new["opd"]["drafter"]).inputs["rollouts"] == str(data.ref)
    decoded = pl.read_parquet(data.path / "sequences-*.parquet")["prompt_id"]
    assert decoded.len() > 0
    assert set(decoded) <= {r["prompt_id"] + "-fresh" for r in unseen}
    for arm in ("opd", "sft_continued"):
        assert new[arm]["drafter"] != old[arm]["drafter"]
    md = store.open(other["report"]).file("report.md").read_text()
    assert f"`{fresh.ref}`, prompts the warm-up never trained on" in md

    # refused before any stage: prompts the warm-up trained on, prompts evaluate decodes, and a
    # dataset with no train split
    trained = _prompts_of(store, [r for r in rows if r["split"] == "train"], "trained")
    evaluated = _prompts_of(store, [r for r in rows if r["split"] == "heldout"], "evaluated")
    heldout_only = _benchmark_prompts(store, prompts, "heldout")
    for bad, message in (
        (trained, r"12 of the 12 train prompts .* are training prompts of the warm-up's"),
        (evaluated, r"4 of the 4 train prompts .* are prompts evaluate decodes from"),
        (heldout_only, r"has no 'train' split rows"),
    ):
        with pytest.raises(OpdError, match=message):
            opd_vs_sft_experiment.opd_vs_sft(
                cfg,
                ctx,
                seeds=1,
                budget=budget,
                prompts=common.WarmupPrompts(prompts, rollout_prompts=bad),
            )


def test_heldout_input_and_validations_leave_default_versions_unchanged():
    cfg = load_config("tiny")
    assert "validations" not in version_dict(cfg.sft) and "validations" not in version_dict(cfg.opd)
    every = cfg.sft.val_every
    assert cfg.sft.validation_steps(10 * every + 1) == {every * i for i in range(1, 11)} | {
        10 * every + 1
    }
    ten = cfg.sft.model_copy(update={"validations": 10})
    assert ten.validation_steps(95) == {10, 19, 29, 38, 48, 57, 67, 76, 86, 95}
    assert ten.validation_steps(3) == {1, 2, 3}


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
    data = common.sft_data_config(cfg, seed=1, temperature=None)
    assert list(span(data)) == opd_prompts == list(range(2, 14))
    assert data.temperature == cfg.rollout.temperature
    # without new prompts each round, every round (and the SFT data) drafts on the same prompts
    same = cfg.model_copy(
        update={"rollout": cfg.rollout.model_copy(update={"new_prompts_each_round": False})}
    )
    assert list(span(common.sft_data_config(same, 1, None))) == list(range(2, 6))
    sampled = common.sft_data_config(cfg, seed=1, temperature=1.0)
    assert sampled.temperature == 1.0 and sampled.seed == 1


def test_ablation_variants_vary_one_factor_around_the_defaults():
    cfg = load_config("tiny")
    factors = ["loss", "replays", "rounds", "samples", "anchors", "gamma"]
    variants = ablate.ablation_variants(cfg, factors)
    by_factor: dict[str, list] = {}
    for v in variants:
        by_factor.setdefault(v.factor, []).append(v)
    # every loss family but reverse_kl_k3, whose training is reverse_kl_k1's
    losses = [loss for loss in typing.get_args(ReplayLoss) if loss != "reverse_kl_k3"]
    assert [v.level for v in by_factor["loss"]] == losses
    assert [v.cfg.opd.loss for v in by_factor["loss"]] == losses
    greedy, sampled = by_factor["replays"]
    assert (greedy.cfg.rollout.temperature, greedy.cfg.score.temperature) == (0.0, 0.0)
    assert (sampled.cfg.rollout.temperature, sampled.cfg.score.temperature) == (1.0, 1.0)
    assert [v.cfg.rounds for v in by_factor["rounds"]] == [1, 2, 3, 4]
    assert [v.cfg.score.samples for v in by_factor["samples"]] == [1, 2, 4]
    assert all(v.cfg.score.temperature == 1.0 for v in by_factor["samples"])
    assert [v.cfg.score.accepted_share for v in by_factor["anchors"]] == [0.0, 0.1, 1.0]
    assert [v.level for v in by_factor["anchors"]] == [
        "accepted 0x",
        "accepted 0.1x",
        "accepted 1x",
    ]
    assert [v.cfg.opd.gamma for v in by_factor["gamma"]] == [0.5, 0.8, 1.0]
    # the baseline (tiny: draft_opd, greedy, 2 rounds, 0.1 accepted anchors per rejected one,
    # gamma 0.8) is the default level of each
    defaults = {v.factor: v.level for v in variants if v.default}
    assert defaults == {
        "loss": "draft_opd",
        "replays": "greedy",
        "rounds": "2",
        "anchors": "accepted 0.1x",
        "gamma": "0.8",
    }
    for v in variants:  # one factor at a time: everything else is the baseline
        assert v.cfg.opd.lr == cfg.opd.lr and v.cfg.drafting == cfg.drafting
    with pytest.raises(OpdError, match="unknown ablation factor.*--factors"):
        ablate.ablation_variants(cfg, ["lr"])
    # --levels: a subset in the factors' order; a label is the level's in every factor with it
    some = ablate.ablation_variants(cfg, ["anchors", "rounds"], ["accepted 1x", "accepted 0x"])
    assert [(v.factor, v.level) for v in some] == [
        ("anchors", "accepted 0x"),
        ("anchors", "accepted 1x"),
    ]
    assert [v.cfg for v in some] == [by_factor["anchors"][0].cfg, by_factor["anchors"][2].cfg]
    both = ablate.ablation_variants(cfg, ["rounds", "gamma"], ["1"])
    assert [(v.factor, v.level) for v in both] == [("rounds", "1"), ("gamma", "1")]
    with pytest.raises(OpdError, match=r"unknown level\(s\) \['accepted 2x'\].*accepted 0x, "):
        ablate.ablation_variants(cfg, ["anchors"], ["accepted 0x", "accepted 2x"])
    with pytest.raises(OpdError, match="pass --levels as a comma-separated subset"):
        ablate.ablation_variants(cfg, ["anchors"], [])


def test_ablate_writes_a_table_and_plot_of_every_variant(tiny):
    store, ctx, _, prompts = tiny
    cfg = load_config("tiny", sets=["rounds=1"])
    result = ablate.ablate(
        cfg,
        ctx,
        factors=["replays", "gamma"],
        seeds=1,
        budget_ratio=0.5,
        prompts=common.WarmupPrompts(prompts),
    )
    levels = [(r["factor"], r["level"]) for r in result["rows"]]
    assert levels == [
        ("replays", "greedy"),
        ("replays", "sampled"),
        ("gamma", "0.5"),
        ("gamma", "0.8"),
        ("gamma", "1"),
    ]
    rows = {(r["factor"], r["level"]): r for r in result["rows"]}
    # the default variant of each factor is the same config: the same (cached) drafter
    assert (
        rows["replays", "greedy"]["runs"][0]["drafter"]
        == rows["gamma", "0.8"]["runs"][0]["drafter"]
    )
    assert rows["gamma", "0.5"]["runs"][0]["drafter"] != rows["gamma", "0.8"]["runs"][0]["drafter"]
    sampled = store.open(rows["replays", "sampled"]["runs"][0]["drafter"])
    replays = store.open(sampled.inputs["replays"])
    assert replays.config["stage"]["temperature"] == 1.0
    # the anchors scoring took, as its dataset counted them
    (anchors,) = rows["replays", "sampled"]["runs"][0]["anchors"]
    assert anchors == {
        "rejected": replays.meta["rejected_anchors"],
        "accepted": replays.meta["accepted_anchors"],
    }
    assert anchors["rejected"] > 0
    # validated on opd-vs-sft's held-out sequences, so the default variant is its OPD arm
    assert store.open(sampled.inputs["heldout"]).config["stage"]["temperature"] == 0.0
    for r in result["rows"]:
        assert r["tau_std"] == 0.0 and len(r["tau_t1_per_seed"]) == 1
        assert r["runs"][0]["budget_row_steps"] >= result["budget_row_steps"]

    report = store.open(result["report"])
    table = pl.read_parquet(report.file("ablation.parquet"))
    assert table.height == 5 * 2  # variants x temperatures (1 seed)
    assert table.filter(pl.col("default"))["level"].unique().sort().to_list() == ["0.8", "greedy"]
    summary = pl.read_parquet(report.file("ablation_summary.parquet"))
    assert summary.height == 10 and set(summary["seeds"]) == {1}
    assert report.file("ablation.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = report.file("report.md").read_text()
    assert "![tau per variant](ablation.png)" in md and "| gamma | 0.8 * |" in md
    # acceptance per offset: each seed's evaluation, as its eval dataset recorded it
    alpha = pl.read_parquet(report.file("ablation_alpha.parquet"))
    sampled_run = rows["replays", "sampled"]["runs"][0]
    for t in (0.0, 1.0):
        recorded = alpha.filter((pl.col("level") == "sampled") & (pl.col("temperature") == t)).sort(
            "offset"
        )
        assert recorded["alpha"].to_list() == sampled_run["alpha"][str(t)]
    assert "## Acceptance per draft offset (mean over seeds)" in md
    first = " | ".join(f"{a:.3f}" for a in sampled_run["alpha"]["0.0"])
    assert f"| replays | sampled | 0 | {first}" in md
    seed = sampled_run["seed"]
    assert "## Replay anchors (per seed, all rounds)" in md
    assert (
        f"| replays | sampled | {seed} | {anchors['rejected']:,} | {anchors['accepted']:,} |" in md
    )

    # the CLI: the same (cached) result as JSON
    recipe = write_recipe(store.root.parent, "rounds=1")
    args = ["--root", str(store.root), "experiment", "ablate", "--recipe", recipe]
    args += ["--factors", "replays,gamma", "--seeds", "1"]
    args += ["--budget", str(result["budget_row_steps"]), "--prompts", str(prompts.ref), "--json"]
    r = CliRunner().invoke(cli, args)
    assert r.exit_code == 0, r.output
    printed = json.loads(r.stdout)
    assert printed["rows"] == json.loads(json.dumps(result["rows"]))
    assert printed["rollout_prompts"] == str(prompts.ref)
    # --levels: only those levels (found cached), in the report and its quoted command
    r = CliRunner().invoke(cli, [*args, "--levels", "sampled,0.5"])
    assert r.exit_code == 0, r.output
    some = json.loads(r.stdout)
    assert [(x["factor"], x["level"]) for x in some["rows"]] == [
        ("replays", "sampled"),
        ("gamma", "0.5"),
    ]
    assert some["rows"] == [printed["rows"][1], printed["rows"][2]]
    assert some["report"] != printed["report"]
    some_md = store.open(some["report"]).file("report.md").read_text()
    assert "--levels sampled,0.5" in some_md and "| gamma | 0.8" not in some_md
    # --first-seed: another process's seeds, from the same (cached) warm-up
    r = CliRunner().invoke(cli, [*args, "--levels", "0.5", "--first-seed", "1"])
    assert r.exit_code == 0, r.output
    seed1 = json.loads(r.stdout)
    assert seed1["seeds"] == [1] and seed1["warmup"] == printed["warmup"]
    (run1,) = seed1["rows"][0]["runs"]
    assert run1["seed"] == 1 and run1["drafter"] != rows["gamma", "0.5"]["runs"][0]["drafter"]
    assert store.open(run1["drafter"]).config["stage"]["seed"] == 1
    bad = CliRunner().invoke(cli, [*args[:-1], "--factors", "lr"])
    assert bad.exit_code != 0 and "unknown ablation factor" in bad.output


def test_opd_vs_sft_runs_for_the_dflash_student(tmp_path):
    """A DFlash recipe: every arm trains a DFlash drafter, the JSON keeps its keys."""
    from models.drafters import recorded_kind
    from storage import Store
    from tests.pipeline.conftest import write_prompts

    store = Store(tmp_path / "data")
    prompts = write_prompts(store)
    dflash = ("rounds=1", "drafter.kind=dflash")
    args = ["--root", str(tmp_path / "data"), "experiment", "opd-vs-sft", "--seeds", "1"]
    args += ["--budget-ratio", "0.5", "--prompts", str(prompts.ref), "--json"]
    r = CliRunner().invoke(cli, [*args, "--recipe", write_recipe(tmp_path, *dflash)])
    assert r.exit_code == 0, r.output
    plain = json.loads(r.stdout)
    assert "speed" not in plain
    speed_recipe = write_recipe(tmp_path, *dflash, speed=True)
    r = CliRunner().invoke(cli, [*args, "--recipe", speed_recipe])  # arms cached, timing not
    assert r.exit_code == 0, r.output
    result = json.loads(r.stdout)
    assert result["drafter_kind"] == "dflash" and result["report"] != plain["report"]
    # --speed: every arm's drafter timed against plain decoding at both temperatures; its tau
    # is the same decoding's as the arm's evaluation (same prompts, K, seed)
    speed = result["speed"]
    assert speed["seed"] == 0 and set(speed["arms"]) == {"sft_warmup", "sft_continued", "opd"}
    for arm, by_t in speed["arms"].items():
        assert set(by_t) == {"0.0", "1.0"}
        for t, m in by_t.items():
            assert m["speedup"] == pytest.approx(m["tokens_per_s"] / m["baseline_tokens_per_s"])
            evaluated = result["warmup"] if arm == "sft_warmup" else result["runs"][0][arm]
            assert m["tau"] == pytest.approx(evaluated["tau"][t])
    report = store.open(result["report"])
    table = pl.read_parquet(report.file("speed.parquet"))
    assert table.height == 3 * 2 and set(table["arm"]) == set(speed["arms"])
    for arm, t, speedup in table.select("arm", "temperature", "speedup").iter_rows():
        assert speedup == speed["arms"][arm][str(t)]["speedup"]  # this run's measurement
    assert "## Speed-up over plain decoding" in report.file("report.md").read_text()
    assert f"--recipe {speed_recipe}" in report.file("report.md").read_text()
    for key in ("tau_opd", "tau_opd_t1", "tau_sft_continued", "tau_sft_continued_t1"):
        assert result[key] >= 1.0
    refs = [result["warmup"]["drafter"]] + [
        result["runs"][0][arm]["drafter"] for arm in ("sft_continued", "opd")
    ]
    assert {recorded_kind(store.open(ref).path) for ref in refs} == {"dflash"}
    # per block slot, up to the deepest slot decoding reached (the tiny drafter may reach few)
    alpha = result["runs"][0]["opd"]["alpha"]["0.0"]
    assert 1 <= len(alpha) <= result["k"] and all(0.0 <= a <= 1.0 for a in alpha)


TYPICAL = "drafting.acceptance=typical"
LOSSY_ROLLOUT = "rollout must keep the target's law, and drafting.acceptance=typical is lossy"


@pytest.mark.parametrize(
    ("options", "recipe", "message"),
    [
        (
            ["--budget-ratio", "inf"],
            {},
            "--budget-ratio must be a finite number in (0, 1000], got inf",
        ),
        (
            ["--budget-ratio", "nan"],
            {},
            "--budget-ratio must be a finite number in (0, 1000], got nan",
        ),
        (
            ["--budget-ratio", "-1"],
            {},
            "--budget-ratio must be a finite number in (0, 1000], got -1",
        ),
        (["--budget-ratio", "1e308"], {}, "--budget-ratio must be a finite number in (0, 1000]"),
        ([], {"sft_data_temperature": -1.0}, "sft_data_temperature: Input should be greater than"),
        (
            [],
            {"sft_data_temperature": "nan"},
            "sft_data_temperature: Input should be a valid number",
        ),
        ([], {"speed": "yes"}, "speed: Input should be a valid boolean"),
        ([], {"seeds": 2}, "seeds: Extra inputs are not permitted"),
        ([], {"set": ["sft.lr=-1"]}, "sft.lr: Input should be greater than 0"),
        (["--first-seed", str(2**64)], {}, "--first-seed and --seeds must keep every seed below"),
        (["--first-seed", "-1"], {}, "--first-seed and --seeds must keep every seed"),
        (
            [],
            {"set": ["drafter.kind=dflash", "drafter.mask_token_id=4096"]},
            "mask_token_id 4096 is outside the target vocab",
        ),
        (
            [],
            {"set": ["drafter.kind=dflash", "drafter.layers=0"]},
            "drafter.layers: Input should be greater than or equal to 1",
        ),
        # its rounds' rollout refused it only after the warm-up and the whole SFT arm
        ([], {"set": [TYPICAL]}, LOSSY_ROLLOUT),
        (["--recipe", "no-such-recipe"], {}, "unknown recipe 'no-such-recipe'; available: "),
    ],
)
def test_bad_opd_vs_sft_options_are_one_line_errors_before_any_stage(
    tmp_path, options, recipe, message
):
    _one_line_experiment_error(tmp_path, ["opd-vs-sft", *options], recipe, message)


@pytest.mark.parametrize(
    ("options", "recipe", "message"),
    [
        (
            ["--budget-ratio", "inf"],
            {},
            "--budget-ratio must be a finite number in (0, 1000], got inf",
        ),
        (
            ["--budget-ratio", "nan"],
            {},
            "--budget-ratio must be a finite number in (0, 1000], got nan",
        ),
        (["--budget-ratio", "0"], {}, "--budget-ratio must be a finite number in (0, 1000], got 0"),
        ([], {"set": [TYPICAL]}, LOSSY_ROLLOUT),  # it refused only after the warm-up
        (["--first-seed", "-1"], {}, "--first-seed and --seeds must keep every seed"),
        (
            ["--factors", "anchors", "--levels", "accepted 0x,accepted 2x"],
            {},
            "unknown level(s) ['accepted 2x'] of --factors anchors; pass --levels as",
        ),
    ],
)
def test_bad_ablate_options_are_one_line_errors_before_any_stage(
    tmp_path, options, recipe, message
):
    _one_line_experiment_error(tmp_path, ["ablate", *options], recipe, message)


def _one_line_experiment_error(tmp_path, args: list[str], recipe: dict, message: str) -> None:
    """`opd experiment ARGS` with a tiny-profile recipe (rounds=1 and `recipe`'s fields) is a
    one-line error (exit 2) naming `message`, and writes nothing besides the prompts given."""
    from storage import Store
    from tests.pipeline.conftest import write_prompts

    root = tmp_path / "data"
    prompts = write_prompts(Store(root))
    before = sorted(root.rglob("*"))
    cmd, *options = args
    fields = {k: v for k, v in recipe.items() if k != "set"}
    path = write_recipe(tmp_path, "rounds=1", *recipe.get("set", []), **fields)
    full = ["--root", str(root), "experiment", cmd, "--recipe", path]
    r = CliRunner().invoke(cli, [*full, "--prompts", str(prompts.ref), *options])
    assert r.exit_code == 2, r.output
    lines = r.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), r.output
    assert message in lines[0], r.output
    assert sorted(p for p in root.rglob("*") if not p.name.endswith(".lock")) == [
        p for p in before if not p.name.endswith(".lock")
    ]
