"""Stage `score`: anchors as configured, replays that are the drafter's own, exact teachers."""

import logging
import tempfile
from pathlib import Path

import numpy as np
import polars as pl
import pytest
import torch
from safetensors.torch import save as save_safetensors

from models.drafters import CONFIG_FILE, WEIGHTS_FILE, save_drafter
from models.kv import KVCache
from models.vocab import DraftVocab
from pipeline.core.drafters import load_drafter_dataset
from pipeline.core.runner import RunContext, run_stage
from pipeline.core.targets import TargetConfig, TargetLoader
from pipeline.stages import features, rollout, score, sft
from storage import OpdError, read_tensor_column
from tests.pipeline.stages.test_rollout import drafter_env, rollout_cfg


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """(store, ctx, drafter dataset, loaded drafter, rollout at T=0, rollout at T=1)."""
    store, ctx, prompts, drafter_ds = drafter_env(tmp_path_factory.mktemp("data"))
    inputs = {"prompts": prompts, "drafter": drafter_ds}
    greedy = run_stage(rollout.STAGE, rollout_cfg(), inputs, ctx).dataset
    sampled = run_stage(
        rollout.STAGE, rollout_cfg(temperature=1.0, max_prompts=5), inputs, ctx
    ).dataset
    target = ctx.target_loader.target
    drafter = load_drafter_dataset(drafter_ds, target, ctx.target_loader.identity)
    return store, ctx, drafter_ds, drafter, greedy, sampled


def replays_of(ds) -> pl.DataFrame:
    """All replay rows, teacher_hidden as one [R, K, H] tensor in the `teacher` attribute."""
    frames, hidden = [], []
    for shard in ds.shards("ipc"):
        table = ds.read_ipc(shard)
        values, off = read_tensor_column(
            table.column("teacher_hidden"), table.schema.field("teacher_hidden")
        )
        hidden += [values[off[i] : off[i + 1]] for i in range(table.num_rows)]
        frames.append(pl.from_arrow(table.drop_columns(["teacher_hidden"])))
    df = pl.concat(frames)
    return df.with_columns(pl.Series("teacher", [h.float().tolist() for h in hidden]))


def sequence_features(rollouts, shard: str, row: int) -> tuple[torch.Tensor, list[int]]:
    table = rollouts.read_ipc(shard)
    aux, off = read_tensor_column(table.column("aux_hidden"), table.schema.field("aux_hidden"))
    return aux[off[row] : off[row + 1]], table.column("input_ids")[row].as_py()


def log_positions(rollouts) -> dict[str, dict[str, set[int]]]:
    log = pl.scan_parquet(rollouts.path / "rejections-*.parquet").collect()
    out: dict[str, dict[str, set[int]]] = {}
    for seq_id, outcome, pos in log.select("seq_id", "outcome", "position").iter_rows():
        out.setdefault(seq_id, {}).setdefault(outcome, set()).add(pos)
    return out


@torch.no_grad()
def chain_alone(drafter, aux, ids, e: int, k: int, temperature: float, forced=None):
    """The reference: ONE chain from anchor e with a plain causal cache (no batching, no masks)."""
    cache = KVCache()
    dev = drafter.fc.weight.device
    ids = torch.tensor(ids, device=dev)
    hidden = drafter.fuse(aux[None, : e - 1].to(dev))
    logits, h = drafter(ids[None, 1:e], hidden, torch.arange(e - 1, device=dev)[None], cache=cache)
    logits, h = logits[:, -1:], h[:, -1:]
    tokens, logq = [], []
    for j in range(k):
        if j:
            step = torch.tensor([[tokens[-1]]], device=dev)
            logits, h = drafter(step, h, torch.tensor([[e - 2 + j]], device=dev), cache=cache)
        lq = torch.log_softmax(logits[0, -1] / (temperature or 1.0), -1)
        draft = (
            lq.argmax()
            if forced is None
            else drafter.vocab.to_draft(torch.tensor(forced[j], device=dev))
        )
        tokens.append(int(drafter.vocab.to_target(draft)))
        logq.append(float(lq[draft]))
    return tokens, logq


def test_anchors_are_the_rejections_plus_the_configured_share(env):
    store, ctx, drafter_ds, drafter, greedy, sampled = env
    truth = log_positions(greedy)
    inputs = {"rollouts": greedy, "drafter": drafter_ds}
    only = replays_of(
        run_stage(score.STAGE, score.Config(k=3, accepted_share=0.0), inputs, ctx).dataset
    )
    got = {s: sorted(g["anchor"]) for (s,), g in only.group_by("seq_id")}
    want = {s: sorted(o["rejected"]) for s, o in truth.items() if o.get("rejected")}
    assert got == want and set(only["kind"]) == {"rejected"} and set(only["sample"]) == {0}
    # rows point at their sequence in the rollout's features
    for r in only.head(3).iter_rows(named=True):
        table = greedy.read_ipc(r["shard"])
        assert table.column("seq_id")[r["row"]].as_py() == r["seq_id"]

    mixed = replays_of(
        run_stage(score.STAGE, score.Config(k=3, accepted_share=1.0), inputs, ctx).dataset
    )
    for (seq_id,), g in mixed.group_by("seq_id"):
        kinds = dict(zip(g["anchor"], g["kind"], strict=True))
        rejected = {a for a, k in kinds.items() if k == "rejected"}
        accepted = {a for a, k in kinds.items() if k == "accepted"}
        assert rejected == truth[seq_id]["rejected"]
        assert accepted <= truth[seq_id].get("accepted", set())
        assert len(accepted) == min(len(rejected), len(truth[seq_id].get("accepted", ())))
    assert (mixed["kind"] == "accepted").any()  # the fixture has sequences with both

    capped = replays_of(
        run_stage(
            score.STAGE, score.Config(k=3, accepted_share=1.0, max_anchors_per_seq=2), inputs, ctx
        ).dataset
    )
    per_seq = capped.group_by("seq_id").agg(pl.col("anchor"))
    assert per_seq["anchor"].list.len().max() == 2
    for seq_id, anchors in per_seq.iter_rows():
        assert set(anchors) <= truth[seq_id].get("rejected", set()) | truth[seq_id].get(
            "accepted", set()
        )


def test_accepted_share_is_a_share_of_the_rejected_anchors():
    cfg = score.Config(accepted_share=0.5)
    counts = []
    for seed in range(400):
        chosen = score.select_anchors(
            [10, 20, 30], list(range(40, 60)), cfg, np.random.default_rng(seed)
        )
        assert [e for e, k in chosen if k == "rejected"] == [10, 20, 30]
        counts.append(sum(k == "accepted" for _, k in chosen))
    assert set(counts) == {1, 2} and abs(np.mean(counts) - 1.5) < 0.1  # stochastic rounding of 1.5
    assert score.select_anchors([], [5, 6], cfg, np.random.default_rng(0)) == []
    assert score.Config(temperature=0.0, samples=4).samples == 1  # greedy replays are identical


def test_greedy_replays_are_the_drafters_own_chains_and_teachers_are_exact(env):
    store, ctx, drafter_ds, drafter, greedy, sampled = env
    target = ctx.target_loader.target
    cfg = score.Config(k=4, accepted_share=1.0)
    ds = run_stage(score.STAGE, cfg, {"rollouts": greedy, "drafter": drafter_ds}, ctx).dataset
    assert (
        ds.file(features.VOCAB_FILE).read_bytes() == greedy.file(features.VOCAB_FILE).read_bytes()
    )
    df = replays_of(ds)
    assert ds.meta["anchors"] == len(df) > 0 and ds.meta["drafter"] == str(drafter_ds.ref)
    worst = 0.0
    for r in df.iter_rows(named=True):
        aux, ids = sequence_features(greedy, r["shard"], r["row"])
        e = r["anchor"]
        tokens, _ = chain_alone(drafter, aux, ids, e, cfg.k, 0.0)
        assert r["tokens"] == tokens  # the batched replay equals the drafter drafting alone
        assert r["logq"] == [0.0] * cfg.k
        out = target(torch.tensor([ids[:e] + tokens]))
        plain = torch.log_softmax(out.logits[0, e - 1 : e - 1 + cfg.k], -1).cpu()  # [K, V]
        teacher = target.logits_from_hidden(torch.tensor(r["teacher"], device=target.device))
        teacher = torch.log_softmax(teacher, -1).cpu()
        worst = max(worst, float((plain - teacher).abs().max()))
        hit = (plain.argmax(-1) == torch.tensor(tokens)).float().tolist()
        assert r["p_token"] == hit and r["accept_prob"] == hit
        assert r["reach_prob"] == np.cumprod([1.0, *hit[:-1]]).tolist()
    # teacher_hidden is bf16 (8 mantissa bits), so the log-probs carry its rounding
    assert worst < 0.05


def test_sampled_replays_carry_behaviour_logq_and_consistent_acceptance(env):
    store, ctx, drafter_ds, drafter, greedy, sampled = env
    target = ctx.target_loader.target
    cfg = score.Config(k=3, temperature=1.0, samples=2, accepted_share=0.5)
    ds = run_stage(score.STAGE, cfg, {"rollouts": sampled, "drafter": drafter_ds}, ctx).dataset
    df = replays_of(ds)
    assert set(df["sample"]) == {0, 1} and ds.meta["replays"] == len(df) == 2 * ds.meta["anchors"]
    pairs = df.group_by("seq_id", "anchor").agg(pl.col("tokens"))
    assert any(t[0] != t[1] for t in pairs["tokens"].to_list())  # samples are independent draws
    worst = 0.0
    for r in df.iter_rows(named=True):
        aux, ids = sequence_features(sampled, r["shard"], r["row"])
        e = r["anchor"]
        _, logq = chain_alone(drafter, aux, ids, e, cfg.k, 1.0, forced=r["tokens"])
        np.testing.assert_allclose(r["logq"], logq, atol=1e-4)  # the drafter's own probability
        out = target(torch.tensor([ids[:e] + r["tokens"]]))
        plain = torch.log_softmax(out.logits[0, e - 1 : e - 1 + cfg.k], -1).cpu()
        teacher = target.logits_from_hidden(torch.tensor(r["teacher"], device=target.device))
        teacher = torch.log_softmax(teacher, -1).cpu()
        worst = max(worst, float((plain - teacher).abs().max()))
        log_p = plain.gather(1, torch.tensor(r["tokens"])[:, None])[:, 0]
        np.testing.assert_allclose(r["p_token"], log_p.exp(), rtol=1e-3, atol=1e-7)
        accept = np.minimum(1.0, np.asarray(r["p_token"]) / np.exp(r["logq"]))
        np.testing.assert_allclose(r["accept_prob"], accept, rtol=1e-4)
        np.testing.assert_allclose(
            r["reach_prob"], np.cumprod([1.0, *r["accept_prob"][:-1]]), rtol=1e-5
        )
    assert worst < 0.05


def write_drafter_dataset(store, ctx, vocab: DraftVocab):
    """An `sft`-layout dataset holding a fresh drafter with the given vocab map."""
    target = ctx.target_loader.target
    drafter = sft.new_drafter(target, vocab, seed=0)
    w = store.writer(
        "sft",
        stage="test-drafter",
        stage_version="1",
        config={"target": ctx.target_loader.identity},
    )
    with w, tempfile.TemporaryDirectory() as tmp:
        save_drafter(drafter, tmp)
        for name in (WEIGHTS_FILE, CONFIG_FILE):
            w.write_file(name, Path(tmp) / name)
        w.write_bytes(features.VOCAB_FILE, save_safetensors({"d2t": vocab.d2t, "t2d": vocab.t2d}))
        return w.commit()


def test_refuses_another_drafter_and_another_target(env):
    store, ctx, drafter_ds, drafter, greedy, sampled = env
    counts = torch.randperm(drafter.config.vocab_size, generator=torch.Generator().manual_seed(1))
    foreign = write_drafter_dataset(
        store, ctx, DraftVocab.from_counts(counts, drafter.config.draft_vocab_size)
    )
    with pytest.raises(OpdError, match=rf"was made by {drafter_ds.ref}, not by {foreign.ref}"):
        run_stage(score.STAGE, score.Config(), {"rollouts": greedy, "drafter": foreign}, ctx)
    # another drafter with the same map is refused too: the rollouts are its predecessor's
    # states, not its own (on-policy data belongs to the drafter that made it)
    same = write_drafter_dataset(store, ctx, drafter.vocab)
    with pytest.raises(OpdError, match=rf"was made by {drafter_ds.ref}, not by {same.ref}"):
        run_stage(score.STAGE, score.Config(k=2), {"rollouts": greedy, "drafter": same}, ctx)
    assert all(r["complete"] for r in store.listing("replays"))  # refused before any directory

    other = TargetLoader(TargetConfig(path="random", random={"seed": 1}, aux_layer_ids=[1, 2, 3]))
    ctx2 = RunContext(store=store, target_loader=other, progress=False)
    with pytest.raises(OpdError, match="different target"):
        run_stage(score.STAGE, score.Config(), {"rollouts": greedy, "drafter": drafter_ds}, ctx2)


def test_empty_rejection_log_gives_empty_replays_with_a_message(env, caplog):
    store, ctx, drafter_ds, drafter, greedy, sampled = env
    prompts = store.open("prompts@latest")
    # One new token is the prefill's: no verify step ever drafts, so nothing is ever rejected.
    quiet = run_stage(
        rollout.STAGE,
        rollout_cfg(max_new_tokens=1),
        {"prompts": prompts, "drafter": drafter_ds},
        ctx,
    ).dataset
    assert quiet.meta["drafted"] == 0
    with caplog.at_level(logging.WARNING, logger="opd"):
        ds = run_stage(
            score.STAGE, score.Config(), {"rollouts": quiet, "drafter": drafter_ds}, ctx
        ).dataset
    assert ds.meta["anchors"] == 0 and ds.num_rows == 0
    assert "nothing to replay" in caplog.text and str(quiet.ref) in caplog.text
    assert ds.read_ipc("replays-00000.arrow").schema == score.replay_schema(
        drafter.config.hidden_size
    )


def test_progress_counts_every_sequence_of_the_rollout(env, capsys):
    store, ctx, drafter_ds, drafter, greedy, sampled = env
    target = ctx.target_loader.target
    counts = []
    score.score_shard(target, drafter, greedy, 0, score.Config(), counts.append)
    rows = greedy.read_ipc("features-00000.arrow").num_rows
    assert sum(counts) == rows and len(counts) == 1 + rows - counts[0]

    ctx.progress = True
    try:
        cfg = score.Config(seed=7)  # not a cached version
        run_stage(score.STAGE, cfg, {"rollouts": greedy, "drafter": drafter_ds}, ctx)
    finally:
        ctx.progress = False
    err = capsys.readouterr().err
    total = greedy.meta["sequences"]
    assert f"0/{total} [" in err and f"{total}/{total} [" in err and "seq/s" in err, err[-2000:]
