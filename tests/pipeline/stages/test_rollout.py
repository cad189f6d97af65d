"""Stage `rollout` on the tiny profile: lossless sequences, a rejection log that adds up, polars."""

import polars as pl
import pytest
import torch
from click.testing import CliRunner

from cli.main import cli
from models.features import Features
from pipeline.core import drafters, featurize, rollouts
from pipeline.core.runner import RunContext, run_stage
from pipeline.core.targets import TargetLoader
from pipeline.profiles import load_config
from pipeline.stages import features, generate, rollout, sft
from storage import OpdError, Store, read_tensor_column
from tests.pipeline.conftest import write_prompts

MAX_NEW = 16


def drafter_env(root):
    """(store, ctx, prompts, sft drafter) from the real tiny chain: generate -> features -> sft."""
    store = Store(root)
    cfg = load_config("tiny")
    ctx = RunContext(store=store, target_loader=TargetLoader(cfg.target), progress=False)
    prompts = write_prompts(store)
    traj = run_stage(generate.STAGE, cfg.generate, {"prompts": prompts}, ctx).dataset
    feats = run_stage(features.STAGE, cfg.features, {"trajectories": traj}, ctx).dataset
    drafter = run_stage(sft.STAGE, cfg.sft, {"features": feats}, ctx).dataset
    return store, ctx, prompts, drafter


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    return drafter_env(tmp_path_factory.mktemp("data"))


def rollout_cfg(**over) -> rollout.Config:
    base = dict(max_prompts=8, k=3, max_new_tokens=MAX_NEW, batch_size=3, rows_per_shard=5)
    return rollout.Config(**(base | over))


@pytest.fixture(scope="module")
def greedy(env):
    store, ctx, prompts, drafter = env
    ctx.run_name = "test-run"
    return run_stage(
        rollout.STAGE, rollout_cfg(), {"prompts": prompts, "drafter": drafter}, ctx
    ).dataset


def test_rollout_writes_every_file_and_equals_greedy_decoding(env, greedy):
    store, ctx, prompts, drafter = env
    ds = greedy
    names = [n for i in range(2) for n in rollouts.shard_files(i)]  # 8 prompts, 5 a shard
    assert sorted(ds.shards()) == sorted([*names, features.VOCAB_FILE])
    vocab = ds.file(features.VOCAB_FILE).read_bytes()
    assert vocab == drafter.file(features.VOCAB_FILE).read_bytes()
    assert ds.meta["round"] == 1 and ds.meta["drafter"] == str(drafter.ref)
    assert ds.meta["target"] == ctx.target_loader.identity and ds.meta["sequences"] == 8

    seqs = pl.read_parquet([ds.file(f"sequences-{i:05d}.parquet") for i in range(2)])
    want = (
        prompts.scan().filter(pl.col("split") == "train").head(8).collect()["prompt_ids"].to_list()
    )
    target = ctx.target_loader.target
    for row, prompt in zip(seqs.iter_rows(named=True), want, strict=True):
        assert row["input_ids"][: row["prompt_len"]] == prompt
        ids = torch.tensor([prompt])
        ref = target.model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=MAX_NEW,
            do_sample=False,
            pad_token_id=0,
        )[0].tolist()
        assert row["input_ids"] == ref  # lossless: the target's own greedy tokens
        n_gen = len(ref) - len(prompt)
        assert row["loss_mask"] == [0] * len(prompt) + [1] * n_gen
        assert row["finish_reason"] == ("eos" if ref[-1] in target.eos_token_ids else "length")

    # features: the features stage's schema and one target forward over the decoded sequence
    table = ds.read_ipc("features-00000.arrow")
    assert table.schema == featurize.feature_schema(target.hidden_size)
    aux, off = read_tensor_column(table.column("aux_hidden"), table.schema.field("aux_hidden"))
    last, _ = read_tensor_column(table.column("last_hidden"), table.schema.field("last_hidden"))
    assert table.column("input_ids").to_pylist() == seqs["input_ids"].to_list()[:5]
    for i, ids in enumerate(table.column("input_ids").to_pylist()):
        out = target(torch.tensor([ids]))
        rows = slice(off[i], off[i + 1])
        torch.testing.assert_close(
            aux[rows].float(), out.aux_hidden[0].float().cpu(), atol=0.05, rtol=0.02
        )
        torch.testing.assert_close(
            last[rows].float(), out.last_hidden[0].float().cpu(), atol=0.05, rtol=0.02
        )

    again = run_stage(rollout.STAGE, rollout_cfg(), {"prompts": prompts, "drafter": drafter}, ctx)
    assert again.reused and again.ref == ds.ref
    other_round = rollout_cfg(round=2)
    assert (
        run_stage(rollout.STAGE, other_round, {"prompts": prompts, "drafter": drafter}, ctx).ref
        != ds.ref
    )


def test_rejection_log_has_one_row_per_draft_and_agrees_with_the_steps(greedy):
    ds = greedy
    log = pl.scan_parquet(ds.path / "rejections-*.parquet").collect()
    steps = pl.scan_parquet(ds.path / "steps-*.parquet").collect()
    seqs = pl.scan_parquet(ds.path / "sequences-*.parquet").collect()
    ids = dict(zip(seqs["seq_id"], seqs["input_ids"].to_list(), strict=True))
    assert set(log["run"]) == {"test-run"} and set(log["round"]) == {1}
    assert set(log["outcome"]) == {"accepted", "rejected", "not_reached"}  # the fixture covers all
    assert len(log) == steps["drafted"].sum() == ds.meta["drafted"]

    blocks = log.group_by("seq_id", "step", maintain_order=True).agg(pl.all())
    by_step = {(r["seq_id"], r["step"]): r for r in steps.iter_rows(named=True)}
    # A step with one token of budget left drafts nothing: the target just emits that token.
    idle = steps.filter(pl.col("drafted") == 0)
    assert idle["accepted"].to_list() == [0] * len(idle) and set(idle["emitted"]) <= {1}
    assert len(blocks) == len(by_step) - len(idle)
    for b in blocks.iter_rows(named=True):
        st = by_step[(b["seq_id"], b["step"])]
        n, acc = st["drafted"], st["accepted"]
        assert b["offset"] == list(range(1, n + 1)) and set(b["anchor"]) == {st["anchor"]}
        assert b["position"] == [st["anchor"] + o - 1 for o in b["offset"]]
        outcome = ["accepted"] * acc + ["rejected"] * (acc < n) + ["not_reached"] * (n - acc - 1)
        assert b["outcome"] == outcome
        seq = ids[b["seq_id"]]
        for pos, tok, out, tt, a in zip(
            b["position"],
            b["token"],
            b["outcome"],
            b["target_token"],
            b["accept_prob"],
            strict=True,
        ):
            if out == "accepted":  # committed: the sequence holds the draft
                assert seq[pos] == tok == tt and a == 1.0
            elif out == "rejected":  # the target's replacement is what the sequence holds
                assert seq[pos] == tt != tok and a == 0.0
            else:
                assert tt == -1
        assert 0 < min(b["confidence"]) and max(b["confidence"]) <= 1 + 1e-6
    # steps chain up: each anchor follows the previous step's emitted tokens
    for seq_id, group in steps.group_by("seq_id"):
        g = group.sort("step")
        assert g["anchor"].to_list()[1:] == (g["anchor"] + g["emitted"]).to_list()[:-1]
        prompt_len = seqs.filter(pl.col("seq_id") == seq_id[0])["prompt_len"][0]
        assert g["anchor"][0] == prompt_len + 1  # the prefill emits one token before any step
        assert 1 + g["emitted"].sum() == len(ids[seq_id[0]]) - prompt_len


def test_polars_answers_acceptance_by_offset_and_top_rejected_tokens(env, greedy):
    store, ctx, prompts, drafter = env
    ds = greedy
    by_offset = (
        pl.scan_parquet(ds.path / "rejections-*.parquet")
        .filter(pl.col("outcome") != "not_reached")
        .group_by("offset")
        .agg((pl.col("outcome") == "accepted").mean().alias("alpha"), pl.len().alias("reached"))
        .sort("offset")
        .collect()
    )
    assert by_offset["offset"].to_list() == [1, 2, 3]
    assert by_offset["alpha"].to_list() == pytest.approx(ds.meta["alpha"])
    steps = pl.scan_parquet(ds.path / "steps-*.parquet").collect()
    # offset 1 is reached by every step that drafted
    assert by_offset["reached"][0] == steps.filter(pl.col("drafted") > 0).height
    assert ds.meta["tau"] == pytest.approx(float((steps["accepted"] + 1).mean()))

    top = (
        pl.scan_parquet(ds.path / "rejections-*.parquet")
        .filter(pl.col("outcome") == "rejected")
        .group_by("token")
        .agg(pl.len().alias("n"), pl.col("target_token").mode().first().alias("instead"))
        .sort(["n", "token"], descending=[True, False])
        .head(5)
        .collect()
    )
    tok = ctx.target_loader.tokenizer
    table = top.with_columns(
        pl.col("token")
        .map_elements(lambda t: tok.decode([t]), return_dtype=pl.String)
        .alias("text")
    )
    assert table["n"].sum() <= ds.meta["rejected"] and table["n"][0] >= table["n"][-1]
    assert table["text"].to_list() == [tok.decode([t]) for t in top["token"]]


def test_run_name_from_the_cli_reaches_the_rejection_log(env):
    store, ctx, prompts, drafter = env
    args = ["--root", str(store.root), "run", "rollout", "--profile", "tiny", "--no-progress"]
    args += ["--run-name", "nightly", "--input", f"drafter={drafter.ref}"]
    args += ["--set", "rollout.max_prompts=2", "--set", "rollout.max_new_tokens=6"]
    r = CliRunner().invoke(cli, args)
    assert r.exit_code == 0, r.output
    ds = store.open("rollouts@run:nightly")
    runs = pl.read_parquet(ds.path / "rejections-*.parquet")["run"].unique().to_list()
    assert runs == ["nightly"]


def test_sampled_rollout_logs_what_the_drafter_proposed(env):
    store, ctx, prompts, drafter_ds = env
    cfg = rollout_cfg(temperature=1.0, max_prompts=4, rows_per_shard=4)
    ds = run_stage(rollout.STAGE, cfg, {"prompts": prompts, "drafter": drafter_ds}, ctx).dataset
    log = pl.read_parquet(ds.file("rejections-00000.parquet"))
    reached = log.filter(pl.col("outcome") != "not_reached")
    ratio = (reached["p"] / reached["q"]).clip(upper_bound=1.0)
    assert (reached["accept_prob"] - ratio).abs().max() < 1e-5
    # Running each logged block through the drafter's training unroll (on the stored features,
    # the block's drafts fed at its anchor) gives back the q and confidence the decoder logged:
    # the unroll sees the same prefix rows and the block's own drafts.
    target = ctx.target_loader.target
    from pipeline.core.drafters import load_drafter_dataset

    drafter = load_drafter_dataset(drafter_ds, target, ctx.target_loader.identity)
    table = ds.read_ipc("features-00000.arrow")
    aux, off = read_tensor_column(table.column("aux_hidden"), table.schema.field("aux_hidden"))
    first = table.column("seq_id")[0].as_py()
    rows = log.filter(pl.col("seq_id") == first)
    blocks = rows.group_by("step", maintain_order=True).agg("anchor", "token", "q")
    full = [b for b in blocks.iter_rows(named=True) if len(b["token"]) == cfg.k]
    dev = target.device
    ids = torch.tensor(table.column("input_ids")[0].as_py(), device=dev)[None]
    anchors = torch.tensor([b["anchor"][0] for b in full], device=dev)
    tokens = torch.tensor([b["token"] for b in full], device=dev)
    item = torch.zeros(len(full), dtype=torch.long, device=dev)
    aux = aux[off[0] : off[1]][None].to(dev)
    with torch.no_grad():
        out = drafter.unroll(Features(ids, aux), None, cfg.k, (item, anchors, tokens))
        q = torch.softmax(drafter.replay_logits(out, item, anchors), -1).cpu()  # [N, K, Vd] T=1
    logged_q = torch.tensor([b["q"] for b in full])
    drafted_q = q.gather(-1, drafter.vocab.to_draft(tokens).cpu()[..., None])[..., 0]
    torch.testing.assert_close(drafted_q, logged_q, rtol=0.05, atol=1e-6)
    logged = rows.filter(pl.col("step").is_in([b["step"] for b in full]))["confidence"]
    assert (logged.to_torch() >= logged_q.reshape(-1) - 1e-6).all()
    torch.testing.assert_close(logged.to_torch(), q.amax(-1).reshape(-1), rtol=0.05, atol=1e-6)


def test_empty_split_is_refused(env):
    store, ctx, prompts, drafter = env
    empty = Store(store.root.parent / "empty-split")
    no_heldout = write_prompts(empty, n_train=3, n_heldout=0)
    ctx2 = RunContext(store=empty, target_loader=ctx.target_loader, progress=False)
    with pytest.raises(OpdError, match="no 'heldout' prompts"):
        run_stage(
            rollout.STAGE,
            rollout_cfg(split="heldout"),
            {"prompts": no_heldout, "drafter": drafter},
            ctx2,
        )
    assert not any(r["complete"] for r in empty.listing("rollouts"))


def test_skip_and_new_prompts_each_round_select_fresh_prompts(env):
    store, ctx, prompts, drafter = env
    train = prompts.scan().filter(pl.col("split") == "train").collect()["prompt_id"].to_list()
    cases = [  # (config, the prompts the rollout must draft on)
        (dict(max_prompts=3, skip_prompts=4), train[4:7]),
        (dict(max_prompts=3, skip_prompts=2, new_prompts_each_round=True, round=2), train[5:8]),
        (dict(max_prompts=3, skip_prompts=2, round=2), train[2:5]),  # same prompts every round
        (dict(max_prompts=5, skip_prompts=9), train[9:12]),  # the split ends first
    ]
    for over, want in cases:
        ds = run_stage(
            rollout.STAGE, rollout_cfg(**over), {"prompts": prompts, "drafter": drafter}, ctx
        )
        files = sorted(f for f in ds.dataset.shards("parquet") if f.startswith("sequences-"))
        seqs = pl.read_parquet([ds.dataset.file(f) for f in files])
        assert seqs["prompt_id"].to_list() == want, over
    with pytest.raises(OpdError, match="past the first 12"):
        run_stage(
            rollout.STAGE,
            rollout_cfg(max_prompts=2, skip_prompts=12),
            {"prompts": prompts, "drafter": drafter},
            ctx,
        )
    with pytest.raises(ValueError, match="new_prompts_each_round needs max_prompts"):
        rollout_cfg(max_prompts=None, new_prompts_each_round=True)


def test_two_ranks_write_the_same_bytes_as_one(env, greedy, tmp_path):
    store, ctx, prompts, drafter = env
    other = Store(tmp_path / "ranks")
    ctx2 = RunContext(
        store=other, target_loader=ctx.target_loader, progress=False, run_name="test-run"
    )
    inputs = {"prompts": write_prompts(other), "drafter": drafter}
    # rank 1 first: rank 0 waits for the other ranks' shards before it summarises and commits
    assert (
        run_stage(rollout.STAGE, rollout_cfg(), inputs, ctx2, rank=1, world_size=2).dataset is None
    )
    ds = run_stage(rollout.STAGE, rollout_cfg(), inputs, ctx2, rank=0, world_size=2).dataset
    assert ds.ref == greedy.ref
    assert {s["path"]: s["sha256"] for s in ds.manifest["shards"]} == {
        s["path"]: s["sha256"] for s in greedy.manifest["shards"]
    }
    assert ds.meta == greedy.meta


def test_progress_counts_sequences_batch_by_batch(env, capsys):
    store, ctx, prompts, drafter = env
    cfg = rollout_cfg(max_prompts=7)  # 5 a shard, 3 a batch
    chosen = rollout.select_prompts(prompts, cfg.split, cfg.max_prompts, 0)
    target = ctx.target_loader.target
    loaded = drafters.load_drafter_dataset(drafter, target, ctx.target_loader.identity)
    counts = []
    rollout.rollout_shard(target, loaded, chosen[:5], 0, cfg, counts.append)
    assert counts == [3, 2]

    ctx.progress = True
    try:
        run_stage(rollout.STAGE, cfg, {"prompts": prompts, "drafter": drafter}, ctx)
    finally:
        ctx.progress = False
    err = capsys.readouterr().err
    assert "0/7 [" in err and "7/7 [" in err and "seq/s" in err, err[-2000:]
