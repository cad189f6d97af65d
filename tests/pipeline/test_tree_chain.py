"""`drafting.tree` on the tiny profile: the full chain runs on tree rollouts, losslessly, with a
tree rejection log that score replays from, and chain datasets keep their versions."""

import polars as pl
import pytest
import torch

from pipeline import chains
from pipeline.core.config import version_dict
from pipeline.core.runner import RunContext, run_stage
from pipeline.core.targets import TargetLoader
from pipeline.profiles import load_config
from pipeline.stages import evaluate, rollout
from storage import OpdError, Store
from tests.pipeline.conftest import write_prompts

TREE = '{"depth": 3, "top_k": 3, "budget": 8}'
TREE_META = {"depth": 3, "top_k": 3, "budget": 8, "min_confidence": 0.0}


@pytest.fixture(scope="module")
def tree_chain(tmp_path_factory):
    store = Store(tmp_path_factory.mktemp("data"))
    cfg = load_config("tiny", sets=[f"drafting.tree={TREE}"])
    ctx = RunContext(store=store, target_loader=TargetLoader(cfg.target), progress=False)
    prompts = write_prompts(store)
    steps = chains.CHAINS["full"](cfg)[1:]  # the prompts come from the fixture
    results = chains.run_chain(steps, ctx, external={"prompts": prompts})
    return ctx, cfg, prompts, {k: r.dataset for k, r in results.items()}


def test_full_chain_runs_on_tree_rollouts(tree_chain):
    ctx, cfg, _, ds = tree_chain
    for r in (1, 2):
        meta = ds[f"rollout-r{r}"].meta
        assert meta["tree"] == TREE_META
        assert len(meta["alpha"]) == 3 and meta["tau"] >= 1.0
        assert ds[f"score-r{r}"].meta["k"] == 3  # replays are tree.depth deep
        assert ds[f"opd-r{r}"].meta["trained"]
    assert ds["score-r1"].meta["anchors"] > 0
    stats = ds["evaluate"].meta
    assert stats["tree"] == TREE_META
    assert stats["lossless_t0"] is True and stats["t0_mismatches"] == []
    assert ds["evaluate"].inputs["drafter"] == str(ds["opd-r2"].ref)


def test_tree_rejection_log_holds_the_path_and_the_rejected_siblings(tree_chain):
    ctx, _, _, ds = tree_chain
    roll = ds["rollout-r1"]
    log = pl.read_parquet(roll.path / "rejections-*.parquet")
    steps = pl.read_parquet(roll.path / "steps-*.parquet")
    seqs = pl.read_parquet(roll.path / "sequences-*.parquet")
    assert log.columns == rollout.TREE_REJECTIONS_SCHEMA.names
    assert steps.columns == rollout.TREE_STEPS_SCHEMA.names
    ids = dict(zip(seqs["seq_id"], seqs["input_ids"], strict=True))
    target = ctx.target_loader.target
    for row in seqs.iter_rows(named=True):  # lossless: the target's greedy tokens
        prompt = row["input_ids"][: row["prompt_len"]]
        want = target.model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=16,
            do_sample=False,
            pad_token_id=0,
        )[0].tolist()
        assert row["input_ids"] == want
    siblings = 0
    for (seq_id, step), nodes in log.group_by(["seq_id", "step"]):
        stats = steps.filter((pl.col("seq_id") == seq_id) & (pl.col("step") == step)).row(
            0, named=True
        )
        path = nodes.filter(pl.col("outcome") == "accepted").sort("offset")
        assert path["offset"].to_list() == list(range(1, stats["accepted"] + 1))
        accepted_nodes = {0, *path["node"].to_list()}
        assert set(path["parent"].to_list()) <= accepted_nodes
        seq = ids[seq_id]
        for r in nodes.filter(pl.col("outcome") != "not_reached").iter_rows(named=True):
            assert (
                r["parent"] in accepted_nodes and r["position"] == stats["anchor"] + r["offset"] - 1
            )
            assert r["target_token"] == seq[r["position"]]
        rejected = nodes.filter(pl.col("outcome") == "rejected")
        siblings += rejected.join(path, on="offset").height  # rejected beside an accepted node
    assert siblings > 0 and (log["outcome"] == "rejected").sum() > 0


def test_tree_off_keeps_chain_versions_and_bad_trees_fail_before_work(tree_chain, tmp_path):
    chain = load_config("tiny")
    assert "tree" not in version_dict(chain.rollout) and "tree" not in version_dict(chain.score)
    assert "tree" not in version_dict(chain.drafting)
    with pytest.raises(OpdError, match=r"tree budget \(2\) is smaller than its depth \(3\)"):
        load_config("tiny", sets=['drafting.tree={"depth": 3, "top_k": 2, "budget": 2}'])
    with pytest.raises(OpdError, match="drafting.tree.top_k"):
        load_config("tiny", sets=['drafting.tree={"depth": 2, "top_k": 0, "budget": 4}'])
    with pytest.raises(OpdError, match=r"drafting.ttt_steps \(3\) must be >= drafting.tree.depth"):
        load_config("tiny", sets=['drafting.tree={"depth": 4, "top_k": 2, "budget": 4}'])
    ctx, cfg, prompts, ds = tree_chain
    # the tiny target's context is 2048 positions; a budget of 2100 cannot fit in it
    big = load_config(
        "tiny", sets=['drafting.tree={"depth": 3, "top_k": 40, "budget": 2100}']
    ).evaluate
    with pytest.raises(OpdError, match="exceed the target's context of"):
        run_stage(evaluate.STAGE, big, {"prompts": prompts, "drafter": ds["sft"]}, ctx)
