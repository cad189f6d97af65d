"""`drafting.stop_confidence` and the drafting depth on the stages that decode: versions stay
put while it is unset, bad settings are one-line errors before work, evaluate runs with it."""

import polars as pl
import pytest

from pipeline.core.config import version_dict
from pipeline.core.drafters import trained_depth
from pipeline.core.runner import run_stage
from pipeline.profiles import load_config
from pipeline.stages import evaluate, features, generate, opd, rollout, score, sft
from storage import OpdError


def test_unset_leaves_versions_and_set_reaches_the_decoding_stages():
    plain = load_config("tiny")
    for stage in (evaluate, rollout):
        assert "stop_confidence" not in version_dict(getattr(plain, stage.STAGE.name))
    stopped = load_config("tiny", sets=["drafting.stop_confidence=0.3"])
    assert stopped.evaluate.stop_confidence == 0.3 and stopped.rollout.stop_confidence == 0.3
    assert version_dict(stopped.evaluate)["stop_confidence"] == 0.3
    assert version_dict(stopped.score) == version_dict(plain.score)  # replays are unchanged


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (
            ["drafting.stop_confidence=1.0"],
            r"drafting.stop_confidence: Input should be less than 1",
        ),
        (["drafting.stop_confidence=-0.2"], r"drafting.stop_confidence: Input should be greater"),
        (
            ["drafting.stop_confidence=0.2", 'drafting.tree={"depth": 3, "top_k": 2, "budget": 4}'],
            r"stop_confidence stops chains; .* drafting.tree.min_confidence",
        ),
        (["evaluate.stop_confidence=0.2"], r"use --set drafting.stop_confidence=0.2"),
    ],
)
def test_bad_settings_are_one_line_errors(sets, message):
    with pytest.raises(OpdError, match=message) as err:
        load_config("tiny", sets=sets)
    assert "\n" not in str(err.value)


@pytest.fixture
def drafted(tiny):
    store, ctx, cfg, prompts = tiny
    traj = run_stage(generate.STAGE, cfg.generate, {"prompts": prompts}, ctx).dataset
    feats = run_stage(features.STAGE, cfg.features, {"trajectories": traj}, ctx).dataset
    drafter = run_stage(sft.STAGE, cfg.sft, {"features": feats}, ctx).dataset
    return ctx, cfg, prompts, drafter


def test_evaluate_stops_drafting_and_stays_lossless(drafted):
    ctx, cfg, prompts, drafter = drafted
    ecfg = cfg.evaluate.model_copy(update={"stop_confidence": 0.05})
    ds = run_stage(evaluate.STAGE, ecfg, {"prompts": prompts, "drafter": drafter}, ctx).dataset
    assert ds.meta["lossless_t0"] is True and ds.meta["stop_confidence"] == 0.05
    steps = pl.read_parquet(ds.file("steps.parquet"))
    assert steps["drafted"].max() <= ecfg.k


def test_drafting_deeper_than_trained_is_refused_before_work(drafted, monkeypatch):
    ctx, cfg, prompts, drafter = drafted
    assert trained_depth(drafter) == cfg.sft.ttt_steps == 3
    deeper = cfg.evaluate.model_copy(update={"k": 4})
    monkeypatch.setattr(evaluate, "_decode", lambda *a, **k: pytest.fail("decoded"))
    with pytest.raises(OpdError, match=r"drafting depth 4 exceeds the 3 steps sft@\w+ was trained"):
        run_stage(evaluate.STAGE, deeper, {"prompts": prompts, "drafter": drafter}, ctx)


def test_opd_drafter_depth_follows_its_lineage(drafted):
    ctx, cfg, prompts, drafter = drafted
    roll = run_stage(
        rollout.STAGE, cfg.rollout, {"prompts": prompts, "drafter": drafter}, ctx
    ).dataset
    replays = run_stage(score.STAGE, cfg.score, {"rollouts": roll, "drafter": drafter}, ctx).dataset
    trained = run_stage(
        opd.STAGE,
        cfg.opd,
        {"replays": replays, "rollouts": roll, "drafter": drafter},
        ctx,
    ).dataset
    assert trained_depth(trained) == 3
