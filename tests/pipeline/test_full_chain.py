"""The `full` chain on the tiny profile: SFT warm-up, two Draft-OPD rounds, evaluation."""

import pytest

from pipeline import chains
from pipeline.profiles import load_config
from pipeline.stages import opd, rollout, score
from storage import OpdError

ROUND_KEYS = ["rollout-r1", "score-r1", "opd-r1", "rollout-r2", "score-r2", "opd-r2"]


def _full(cfg):
    # the prompts come from the fixture (the embedded corpus is tested with the prompts stage)
    steps = chains.CHAINS["full"](cfg)
    assert steps[0].key == "prompts"
    return steps[1:]


def test_full_chain_runs_caches_and_recomputes_exactly_what_a_change_touches(tiny):
    store, ctx, cfg, prompts = tiny
    assert cfg.rounds == 2
    steps = _full(cfg)
    assert [s.key for s in steps] == ["generate", "features", "sft", *ROUND_KEYS, "evaluate"]
    first = chains.run_chain(steps, ctx, external={"prompts": prompts})
    assert not any(r.reused for r in first.values())

    # lineage: each round drafts with the previous round's drafter, evaluate takes the last one
    ref = {k: str(r.ref) for k, r in first.items()}
    ds = {k: r.dataset for k, r in first.items()}
    assert ds["rollout-r1"].inputs["drafter"] == ref["sft"]
    assert ds["score-r1"].inputs == {"rollouts": ref["rollout-r1"], "drafter": ref["sft"]}
    assert ds["opd-r1"].inputs == {
        "replays": ref["score-r1"],
        "rollouts": ref["rollout-r1"],
        "drafter": ref["sft"],
    }
    assert ds["rollout-r2"].inputs["drafter"] == ref["opd-r1"]
    assert ds["opd-r2"].inputs["drafter"] == ref["opd-r1"]
    assert ds["evaluate"].inputs["drafter"] == ref["opd-r2"]
    assert [ds[f"opd-r{r}"].config["stage"]["round"] for r in (1, 2)] == [1, 2]
    assert ds["rollout-r1"].ref != ds["rollout-r2"].ref  # the round is part of the version
    assert ds["opd-r2"].meta["trained"] and ds["evaluate"].meta["tau"] >= 1.0

    again = chains.run_chain(steps, ctx, external={"prompts": prompts})
    assert all(r.reused for r in again.values())
    assert {k: str(r.ref) for k, r in again.items()} == ref

    # forcing score-r1 recomputes it; its output version is unchanged, so nothing else reruns
    forced = chains.run_chain(steps, ctx, external={"prompts": prompts}, force={"score-r1"})
    assert [k for k, r in forced.items() if not r.reused] == ["score-r1"]
    assert {k: str(r.ref) for k, r in forced.items()} == ref

    # a changed score setting: score-r1 and everything downstream of it, nothing upstream
    changed = cfg.model_copy(update={"score": cfg.score.model_copy(update={"accepted_share": 0.5})})
    third = chains.run_chain(_full(changed), ctx, external={"prompts": prompts})
    rerun = [k for k, r in third.items() if not r.reused]
    assert rerun == ["score-r1", "opd-r1", "rollout-r2", "score-r2", "opd-r2", "evaluate"]
    assert all(str(third[k].ref) != ref[k] for k in rerun)
    assert third["rollout-r2"].dataset.inputs["drafter"] == str(third["opd-r1"].ref)


def test_round_steps_by_name_and_zero_rounds():
    cfg = load_config("tiny")
    step = chains.single_step("score-r2", cfg)
    assert step.stage is score.STAGE and step.cfg.round == 2 and step.key == "score-r2"
    assert chains.single_step("opd", cfg).cfg.round == 1
    assert chains.single_step("rollout-r3", cfg).stage is rollout.STAGE
    with pytest.raises(OpdError, match="unknown stage"):
        chains.single_step("score-rx", cfg)
    # without rounds the chain evaluates the SFT drafter; with the features anchor opd reads them
    none = chains.CHAINS["full"](load_config("tiny", sets=["rounds=0"]))
    assert [s.key for s in none][-2:] == ["sft", "evaluate"]
    assert none[-1].inputs["drafter"] == "sft"
    anchored = chains.CHAINS["full"](
        load_config("tiny", sets=["opd.ce_lambda=0.1", "opd.ce_source=features"])
    )
    opd_steps = [s for s in anchored if s.stage is opd.STAGE]
    assert [s.inputs.get("features") for s in opd_steps] == ["features", "features"]
