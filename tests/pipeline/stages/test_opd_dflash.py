"""Draft-OPD over a DFlash drafter on the tiny profile: rollout logs its blocks in the one
rejection-log schema (with `drafter_kind`), score replays them, opd trains on them; data of
another drafter kind and losses that do not apply to blocks are refused before any work."""

import polars as pl
import pytest
import torch
from safetensors.torch import load_file

from models.dflash import DFlashSettings
from models.features import Features
from pipeline.core import drafters
from pipeline.core.drafters import load_drafter_dataset
from pipeline.core.runner import run_stage
from pipeline.stages import opd, rollout, score, sft
from storage import OpdError, read_tensor_column
from tests.pipeline.stages.test_rollout import drafter_env, rollout_cfg
from tests.pipeline.stages.test_score import replays_of

DFLASH = DFlashSettings(block_size=4, layers=1)
K = 3
OPD = dict(steps=6, batch_size=4, val_share=0.2, val_every=3, lr=3e-3, bf16=False, val_ttt_steps=K)


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """(store, ctx, eagle3 sft, dflash sft, their greedy rollouts, dflash replays)."""
    store, ctx, prompts, eagle = drafter_env(tmp_path_factory.mktemp("data"))
    feats = store.open(eagle.inputs["features"])
    cfg = sft.Config(
        steps=20,
        batch_size=4,
        val_share=0.2,
        lr=1e-2,
        bf16=False,
        ttt_steps=K,
        tau_k=K,
        drafter=DFLASH,
    )
    block = run_stage(sft.STAGE, cfg, {"features": feats}, ctx).dataset
    made = {
        ds.meta["drafter_kind"]: run_stage(
            rollout.STAGE, rollout_cfg(k=K), {"prompts": prompts, "drafter": ds}, ctx
        ).dataset
        for ds in (eagle, block)
    }
    replays = run_stage(
        score.STAGE, score.Config(k=K), {"rollouts": made["dflash"], "drafter": block}, ctx
    ).dataset
    return store, ctx, eagle, block, made, replays


def test_one_rejection_log_schema_for_both_kinds(env):
    *_, made, _ = env
    logs = {kind: pl.read_parquet(ds.path / "rejections-*.parquet") for kind, ds in made.items()}
    assert logs["eagle3"].schema == logs["dflash"].schema
    for kind, log in logs.items():
        assert set(log["drafter_kind"]) == {kind} and made[kind].meta["drafter_kind"] == kind
    # a block is logged as the chain the loop verified: accepted*, then one rejection, then
    # not reached, per verify step
    for outcomes in logs["dflash"].group_by("seq_id", "step").agg("outcome")["outcome"]:
        acc = outcomes.to_list().count("accepted")
        rest = outcomes.to_list()[acc:]
        assert rest[:1] in ([], ["rejected"]) and set(rest[1:]) <= {"not_reached"}
    assert (logs["dflash"]["outcome"] == "rejected").any()


def test_score_replays_blocks_as_the_drafter_drafts_them(env):
    store, ctx, _, block, made, replays = env
    assert replays.meta["drafter_kind"] == "dflash" and replays.meta["anchors"] > 0
    df = replays_of(replays)
    target = ctx.target_loader.target
    drafter = load_drafter_dataset(block, target, ctx.target_loader.identity)
    feats = made["dflash"].read_ipc(df["shard"][0])
    aux, off = read_tensor_column(feats.column("aux_hidden"), feats.schema.field("aux_hidden"))
    first = df.filter((pl.col("shard") == df["shard"][0]) & (pl.col("row") == df["row"][0]))
    r = first["row"][0]
    ids = torch.tensor(feats.column("input_ids")[r].as_py())
    features = Features(ids, aux[off[r] : off[r + 1]])
    again = drafter.replay(features, torch.tensor(first["anchor"].to_list()), K)
    assert again.tokens.tolist() == first["tokens"].to_list()


def test_opd_trains_a_dflash_drafter_on_its_replays(env):
    store, ctx, _, block, made, replays = env
    inputs = {"replays": replays, "rollouts": made["dflash"], "drafter": block}
    ds = run_stage(opd.STAGE, opd.Config(**OPD), inputs, ctx).dataset
    assert ds.meta["trained"] is True and ds.meta["drafter_kind"] == "dflash"
    before, after = (
        load_file(block.file("model.safetensors")),
        load_file(ds.file("model.safetensors")),
    )
    assert set(before) == set(after)
    assert any(not torch.equal(before[n], after[n]) for n in before)
    val = pl.read_parquet(ds.file(drafters.METRICS_FILE)).filter(pl.col("kind") == "val")
    assert len(val) >= 2 and all(torch.isfinite(torch.tensor(val["loss"].to_list())))
    assert all(len(a) == K for a in val["replay_acc"].to_list())


def test_another_kinds_data_and_losses_that_do_not_apply_are_refused(env):
    store, ctx, eagle, block, made, replays = env
    before = {name: len(store.listing(name)) for name in ("replays", "opd")}
    with pytest.raises(OpdError, match="drafted by a eagle3 drafter, but .* is a dflash drafter"):
        run_stage(
            score.STAGE, score.Config(k=K), {"rollouts": made["eagle3"], "drafter": block}, ctx
        )
    with pytest.raises(OpdError, match="drafted by a dflash drafter, but .* is a eagle3 drafter"):
        run_stage(
            opd.STAGE,
            opd.Config(**OPD),
            {"replays": replays, "rollouts": made["dflash"], "drafter": eagle},
            ctx,
        )
    inputs = {"replays": replays, "rollouts": made["dflash"], "drafter": block}
    with pytest.raises(OpdError, match=r"opd.loss=tv over all replayed positions does not apply"):
        run_stage(opd.STAGE, opd.Config(**OPD | {"loss": "tv"}), inputs, ctx)
    assert {name: len(store.listing(name)) for name in before} == before  # nothing committed


def test_a_target_head_runs_the_opd_loop_and_stays_the_targets(env):
    store, ctx, eagle, _, made, _ = env
    feats, prompts = (
        store.open(eagle.inputs["features"]),
        store.open(made["dflash"].inputs["prompts"]),
    )
    head = DFlashSettings(block_size=4, layers=1, head="target")
    how = dict(batch_size=4, val_share=0.2, lr=1e-2, bf16=False, ttt_steps=K, tau_k=K)
    block = run_stage(sft.STAGE, sft.Config(steps=4, drafter=head, **how), {"features": feats}, ctx)
    drafter = block.dataset
    rolled = run_stage(
        rollout.STAGE, rollout_cfg(k=K), {"prompts": prompts, "drafter": drafter}, ctx
    ).dataset
    # score checks the drafter's map against the rollouts' (the features' pruned one): an
    # identity map reads it
    replays = run_stage(
        score.STAGE, score.Config(k=K), {"rollouts": rolled, "drafter": drafter}, ctx
    ).dataset
    inputs = {"replays": replays, "rollouts": rolled, "drafter": drafter}
    ds = run_stage(opd.STAGE, opd.Config(**OPD), inputs, ctx).dataset
    assert ds.meta["trained"] is True
    before, after = (
        load_file(drafter.file("model.safetensors")),
        load_file(ds.file("model.safetensors")),
    )
    target = ctx.target_loader.target
    assert torch.equal(after["lm_head.weight"], target.lm_head_weight.cpu())
    assert not torch.equal(before["fc.weight"], after["fc.weight"])
