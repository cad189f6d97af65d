"""Teachers from the verification forward: `rollout.keep_teacher` keeps, per verify step, the
target's state at every drafted slot (conditioned on the drafter's own proposals), and
`score.source=logged` turns the logged blocks into replays with no further forward, for chains
(EAGLE-3) and blocks (DFlash); opd trains on them unchanged."""

import numpy as np
import polars as pl
import pytest
import torch
from pydantic import ValidationError
from safetensors.torch import load_file

from models.dflash import DFlashSettings
from models.features import Features
from pipeline.core.config import DraftTree
from pipeline.core.drafters import load_drafter_dataset
from pipeline.core.rollouts import shard_files, teacher_file
from pipeline.core.runner import run_stage
from pipeline.profiles import load_config
from pipeline.stages import opd, rollout, score, sft
from storage import OpdError, read_tensor_column
from tests.pipeline.stages.test_rollout import drafter_env, rollout_cfg
from tests.pipeline.stages.test_score import replays_of, sequence_features

K = 3


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """(store, ctx, prompts, {kind: drafter dataset}, {kind: rollout with teachers})."""
    store, ctx, prompts, eagle = drafter_env(tmp_path_factory.mktemp("data"))
    feats = store.open(eagle.inputs["features"])
    block_cfg = sft.Config(
        steps=20,
        batch_size=4,
        val_share=0.2,
        lr=1e-2,
        bf16=False,
        ttt_steps=K,
        tau_k=K,
        drafter=DFlashSettings(block_size=K + 1, layers=1),
    )
    block = run_stage(sft.STAGE, block_cfg, {"features": feats}, ctx).dataset
    drafters = {"eagle3": eagle, "dflash": block}
    kept = {
        kind: run_stage(
            rollout.STAGE,
            rollout_cfg(k=K, keep_teacher=True),
            {"prompts": prompts, "drafter": ds},
            ctx,
        ).dataset
        for kind, ds in drafters.items()
    }
    return store, ctx, prompts, drafters, kept


def teachers_of(ds, i: int) -> tuple[pl.DataFrame, torch.Tensor]:
    """Shard i's teacher rows and their hidden states [R, K, H]."""
    table = ds.read_ipc(teacher_file(i))
    values, off = read_tensor_column(
        table.column("teacher_hidden"), table.schema.field("teacher_hidden")
    )
    hidden = torch.stack([values[off[r] : off[r + 1]] for r in range(table.num_rows)])
    return pl.from_arrow(table.drop_columns(["teacher_hidden"])), hidden


def plain_log_probs(target, ids: list[int], anchor: int, drafts: list[int]) -> torch.Tensor:
    """The reference: the target's log-probs predicting each draft, one plain forward over the
    committed prefix y<anchor followed by the drafts, [len(drafts), V]."""
    out = target(torch.tensor([ids[:anchor] + drafts]))
    return torch.log_softmax(out.logits[0, anchor - 1 : anchor - 1 + len(drafts)], -1).cpu()


def hidden_log_probs(target, hidden: torch.Tensor) -> torch.Tensor:
    logits = target.logits_from_hidden(hidden.to(target.device))
    return torch.log_softmax(logits, -1).cpu()


@pytest.mark.parametrize("kind", ["eagle3", "dflash"])
def test_rollout_keeps_the_teacher_of_every_drafted_slot(env, kind):
    store, ctx, prompts, drafters, kept = env
    target = ctx.target_loader.target
    plain = run_stage(
        rollout.STAGE, rollout_cfg(k=K), {"prompts": prompts, "drafter": drafters[kind]}, ctx
    ).dataset
    # keeping teachers changes nothing the rollout wrote before: same decode, same log
    for name in shard_files(0):
        if name.endswith(".parquet"):
            assert pl.read_parquet(plain.file(name)).equals(pl.read_parquet(kept[kind].file(name)))
    assert teacher_file(0) not in plain.shards() and teacher_file(0) in kept[kind].shards()
    steps = pl.read_parquet(kept[kind].file(shard_files(0)[3]))
    rows, hidden = teachers_of(kept[kind], 0)
    assert rows.select("seq_id", "step", "anchor").equals(steps.select("seq_id", "step", "anchor"))
    assert hidden.shape[1:] == (K, target.hidden_size) and hidden.dtype == torch.bfloat16
    log = pl.read_parquet(kept[kind].file(shard_files(0)[2]))
    sequences = dict(
        pl.read_parquet(kept[kind].file(shard_files(0)[0]))
        .select("seq_id", "input_ids")
        .iter_rows()
    )
    worst, rejected_slots = 0.0, 0
    for r, (seq_id, step, anchor) in enumerate(rows.iter_rows()):
        block = log.filter((pl.col("seq_id") == seq_id) & (pl.col("step") == step)).sort("offset")
        drafts = block["token"].to_list()
        if not drafts:
            assert not hidden[r].any()  # no draft, no teacher
            continue
        rejected_slots += (block["outcome"] != "accepted").sum()
        want = plain_log_probs(target, sequences[seq_id], anchor, drafts)
        got = hidden_log_probs(target, hidden[r, : len(drafts)])
        worst = max(worst, float((want - got).abs().max()))
        assert not hidden[r, len(drafts) :].any()  # zeros past the block
    assert rejected_slots > 0  # the check covers slots that read a rejected draft
    assert worst < 0.05  # bf16 teacher (8 mantissa bits)


@pytest.mark.parametrize("kind", ["eagle3", "dflash"])
def test_logged_replays_are_the_rollouts_blocks_with_their_verify_teachers(env, kind):
    store, ctx, prompts, drafters, kept = env
    target = ctx.target_loader.target
    cfg = score.Config(k=K, accepted_share=1.0, source="logged")
    inputs = {"rollouts": kept[kind], "drafter": drafters[kind]}
    ds = run_stage(score.STAGE, cfg, inputs, ctx).dataset
    assert ds.meta["source"] == "logged" and ds.meta["drafter_kind"] == kind
    df = replays_of(ds)
    order = df.select("shard", "row", "anchor")
    assert order.equals(order.sort("shard", "row", "anchor"))  # written as replays are
    log = pl.read_parquet(kept[kind].path / "rejections-*.parquet")
    blocks = log.group_by("seq_id", "anchor").agg(
        pl.col("token").sort_by("offset"),
        pl.col("p").sort_by("offset"),
        (pl.col("outcome") == "rejected").any().alias("rejected"),
    )
    # every step that rejected a draft is an anchor; accepted steps as many (share 1.0, capped)
    want_rejected = blocks.filter("rejected").select("seq_id", "anchor").sort("seq_id", "anchor")
    got_rejected = df.filter(pl.col("kind") == "rejected").select("seq_id", "anchor")
    assert got_rejected.sort("seq_id", "anchor").equals(want_rejected)
    per_seq = blocks.group_by("seq_id").agg(
        pl.col("rejected").sum().alias("rej"), (~pl.col("rejected")).sum().alias("acc")
    )
    n_accepted = int(per_seq.select(pl.min_horizontal("rej", "acc")).sum().item())
    assert (df["kind"] == "accepted").sum() == n_accepted > 0
    by_block = {(s, a): (t, p) for s, a, t, p, _ in blocks.iter_rows()}
    drafter = load_drafter_dataset(drafters[kind], target, ctx.target_loader.identity)
    worst, redrafted = 0.0, 0
    for r, row in enumerate(df.iter_rows(named=True)):
        tokens, p = by_block[(row["seq_id"], row["anchor"])]
        n = row["length"]
        assert n == len(tokens) and row["tokens"][:n] == tokens and row["p_token"][:n] == p
        assert row["logq"] == [0.0] * K  # greedy: q is one-hot
        assert row["accept_prob"][:n] == p  # 1/0 at T=0
        assert row["reach_prob"] == np.cumprod([1.0, *row["accept_prob"][:-1]]).tolist()
        aux, ids = sequence_features(kept[kind], row["shard"], row["row"])
        want = plain_log_probs(target, ids, row["anchor"], tokens)
        got = hidden_log_probs(target, torch.tensor(df["teacher"][r])[:n])
        worst = max(worst, float((want - got).abs().max()))
        if n == K:  # a replay from the same anchor drafts the very block the rollout logged
            again = drafter.replay(
                Features(torch.tensor(ids), aux), torch.tensor([row["anchor"]]), K
            )
            assert again.tokens[0].tolist() == tokens
            redrafted += 1
    assert worst < 0.05 and redrafted > 0


def test_opd_trains_on_logged_blocks(env):
    store, ctx, prompts, drafters, kept = env
    inputs = {"rollouts": kept["dflash"], "drafter": drafters["dflash"]}
    replays = run_stage(score.STAGE, score.Config(k=K, source="logged"), inputs, ctx).dataset
    cfg = opd.Config(
        steps=4, batch_size=4, val_share=0.2, val_every=2, lr=3e-3, bf16=False, val_ttt_steps=K
    )
    ds = run_stage(opd.STAGE, cfg, {"replays": replays, **inputs}, ctx).dataset
    before = load_file(drafters["dflash"].file("model.safetensors"))
    after = load_file(ds.file("model.safetensors"))
    assert ds.meta["trained"] is True
    assert any(not torch.equal(before[n], after[n]) for n in before)


def test_logged_replays_refuse_rollouts_they_cannot_read(env):
    store, ctx, prompts, drafters, kept = env
    eagle = drafters["eagle3"]
    plain = run_stage(
        rollout.STAGE, rollout_cfg(k=K), {"prompts": prompts, "drafter": eagle}, ctx
    ).dataset
    before = store.listing("replays")
    logged = score.Config(k=K, source="logged")
    with pytest.raises(OpdError, match=r"without rollout.keep_teacher.*score.source=logged"):
        run_stage(score.STAGE, logged, {"rollouts": plain, "drafter": eagle}, ctx)
    with pytest.raises(OpdError, match="drafted with temperature 0.0 and score asks for 1.0"):
        run_stage(
            score.STAGE,
            score.Config(k=K, source="logged", temperature=1.0),
            {"rollouts": kept["eagle3"], "drafter": eagle},
            ctx,
        )
    with pytest.raises(OpdError, match="drafted with k 3 and score asks for 2"):
        run_stage(
            score.STAGE,
            score.Config(k=2, source="logged"),
            {"rollouts": kept["eagle3"], "drafter": eagle},
            ctx,
        )
    assert store.listing("replays") == before  # refused before any directory
    with pytest.raises(ValidationError, match="set score.samples=1"):
        score.Config(source="logged", temperature=1.0, samples=2)
    tree = DraftTree(depth=2, top_k=2, budget=4)
    with pytest.raises(ValidationError, match="use score.source=replay"):
        score.Config(source="logged", tree=tree)
    with pytest.raises(ValidationError, match="use score.source=replay"):
        rollout.Config(keep_teacher=True, tree=tree)


def test_one_setting_asks_for_logged_replays_and_unset_changes_no_version():
    cfg = load_config("tiny", sets=["score.source=logged"])
    assert cfg.rollout.keep_teacher is True and cfg.score.source == "logged"
    plain = load_config("tiny")
    assert plain.rollout.keep_teacher is None and plain.score.source is None
    # the defaults, spelled out, are the unset versions
    spelled = load_config("tiny", sets=["score.source=replay", "rollout.keep_teacher=false"])
    assert spelled.rollout == plain.rollout and spelled.score == plain.score
