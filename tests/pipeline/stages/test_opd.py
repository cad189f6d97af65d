"""Stage `opd` (Draft-OPD training) on hand-made replays over tiny rollout features."""

import json
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import polars as pl
import pyarrow as pa
import pytest
import torch
from safetensors.torch import load_file, save_file

from models.drafters import load_drafter
from models.kv import KVCache
from models.losses import replay_loss
from models.vocab import DraftVocab
from pipeline.core import budget, drafters, training
from pipeline.core.config import version_dict
from pipeline.core.drafters import load_drafter_dataset
from pipeline.core.runner import RunContext, run_stage
from pipeline.core.targets import TargetLoader
from pipeline.core.trainer import TrainingStopped
from pipeline.profiles import load_config
from pipeline.stages import features, generate, opd, sft
from storage import OpdError, Store, tensor_array, tensor_field
from tests.pipeline.conftest import write_prompts

K = 3
REPO = Path(__file__).resolve().parents[3]
FAST = dict(batch_size=4, val_share=0.2, val_every=4, lr=3e-3, bf16=False, checkpoint_every=2)
PURE = dict(FAST, ce_lambda=0.0)  # the replay loss alone


def _copy_as_rollouts(store: Store, feats) -> object:
    """A `rollouts` dataset holding the features' shards and vocab (the layout opd reads)."""
    w = store.writer(
        "rollouts", stage="test-rollout", stage_version="1", config={"of": str(feats.ref)}
    )
    with w:
        for i, shard in enumerate(feats.shards("ipc")):
            w.write_ipc(f"features-{i:05d}.arrow", feats.read_ipc(shard))
        w.write_file(features.VOCAB_FILE, feats.file(features.VOCAB_FILE))
        return w.commit()


def make_replays(
    store, target, drafter_ds, rollouts, *, anchors_per_seq=2, seed=0, vocab_file=None
):
    """Replays in the contract's schema: tokens drafted at random from the draft vocab, scored by
    the real target (score_tree), accept_prob = greedy agreement (a T=0 replay)."""
    gen = torch.Generator().manual_seed(seed)
    on_device = load_drafter(drafter_ds.path, target.embed_weight).vocab
    vocab = DraftVocab(on_device.d2t.cpu(), on_device.t2d.cpu())  # drafted on the host
    index = training.FeatureIndex(rollouts, ["input_ids", "loss_mask"])
    rows = []
    for r, seq_id in enumerate(index.keys):
        b = index.collate([r])
        ids, mask = b["input_ids"][0], b["loss_mask"][0].bool()
        generated = torch.nonzero(mask)[:, 0]
        candidates = generated[(generated >= 2)].tolist()
        if len(candidates) < anchors_per_seq:
            continue
        pick = torch.randperm(len(candidates), generator=gen)[:anchors_per_seq]
        anchors = sorted(candidates[i] for i in pick.tolist())
        branches = []
        for e in anchors:
            draft = torch.randint(0, vocab.draft_vocab_size, (K,), generator=gen)
            draft[0] = vocab.to_draft(ids[e : e + 1])[0].clamp_min(0)  # often accepted at k=1
            branches.append((e, vocab.to_target(draft)))
        scores = target.score_tree(ids, branches)
        for (e, tokens), hidden, lp in zip(branches, scores.hidden, scores.log_probs, strict=True):
            hidden, lp = hidden.cpu(), lp.cpu()  # the reference math runs on the host
            accept = (lp[:-1].argmax(-1) == tokens).float()
            reach = torch.cat([torch.ones(1), torch.cumprod(accept, 0)[:-1]])
            rows.append(
                {
                    "seq_id": seq_id,
                    "feature_row": r,
                    "anchor": e,
                    "sample": 0,
                    "tokens": tokens.tolist(),
                    "logq": [0.0] * K,
                    "p_token": lp[:-1].gather(-1, tokens[:, None])[:, 0].exp().tolist(),
                    "accept_prob": accept.tolist(),
                    "reach_prob": reach.tolist(),
                    "teacher_hidden": hidden[:-1].to(torch.bfloat16),
                }
            )
    return write_replay_rows(
        store, rows, target.hidden_size, rollouts, drafter_ds, vocab_file=vocab_file
    )


def write_replay_rows(store, rows, hidden, rollouts, drafter_ds, *, vocab_file=None, tag="0"):
    th = tensor_field("teacher_hidden", torch.bfloat16, hidden)
    floats = pa.list_(pa.float32())
    schema = pa.schema(
        [
            ("seq_id", pa.string()),
            ("feature_row", pa.int64()),
            ("anchor", pa.int32()),
            ("sample", pa.int32()),
            ("tokens", pa.list_(pa.int32())),
            ("logq", floats),
            ("p_token", floats),
            ("accept_prob", floats),
            ("reach_prob", floats),
            th,
        ]
    )
    w = store.writer(
        "replays",
        stage="test-score",
        stage_version="1",
        config={"n": len(rows), "tag": tag},
        inputs={"rollouts": rollouts.ref, "drafter": drafter_ds.ref},
    )
    with w:
        if rows:
            cols = [pa.array([r[n] for r in rows], schema.field(n).type) for n in schema.names[:-1]]
            cols.append(tensor_array([r["teacher_hidden"] for r in rows], th))
            w.write_ipc("replays-00000.arrow", pa.table(cols, schema=schema))
        w.write_file(features.VOCAB_FILE, vocab_file or drafter_ds.file(features.VOCAB_FILE))
        return w.commit()


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """store, ctx, features, a briefly trained sft drafter, rollouts and replays on a random target."""
    store = Store(tmp_path_factory.mktemp("data"))
    # on the host in fp32 on every machine: the references below are exact host math (a GPU
    # would give bf16 and two devices); tests/gpu and the chain runs cover CUDA
    cfg = load_config("tiny", sets=["target.device=cpu"])
    ctx = RunContext(store=store, target_loader=TargetLoader(cfg.target), progress=False)
    prompts = write_prompts(store)
    traj = run_stage(generate.STAGE, cfg.generate, {"prompts": prompts}, ctx).dataset
    feats = run_stage(features.STAGE, cfg.features, {"trajectories": traj}, ctx).dataset
    drafter = run_stage(
        sft.STAGE, sft.Config(steps=6, ttt_steps=3, tau_k=3, **FAST), {"features": feats}, ctx
    ).dataset
    rollouts = _copy_as_rollouts(store, feats)
    replays = make_replays(store, ctx.target_loader.target, drafter, rollouts)
    return dict(
        store=store, ctx=ctx, feats=feats, drafter=drafter, rollouts=rollouts, replays=replays
    )


def _inputs(w, **over):
    return {"replays": w["replays"], "rollouts": w["rollouts"], "drafter": w["drafter"]} | over


def _direct_chain_logits(drafter, aux, ids, e, tokens):
    """Draft from prefix y<e as speculative decoding does: prefix rows 0..e-2 with a cache, then
    chain steps on the drafter's own hidden state and the given tokens. -> [K, Vd]."""
    cache = KVCache()
    n = e - 1
    logits, hidden = drafter(
        ids[None, 1 : n + 1], drafter.fuse(aux[None, :n]), torch.arange(n)[None], cache=cache
    )
    out, h = [logits[0, -1]], hidden[:, -1:]
    for k in range(1, len(tokens)):
        logits, h = drafter(tokens[None, k - 1 : k], h, torch.tensor([[n - 1 + k]]), cache=cache)
        out.append(logits[0, 0])
    return torch.stack(out)


def _direct_loss(name, q_logits, p_logits, tokens, accepted, vocab, T, gamma=0.8):
    """The objectives written out per replay position from their definitions."""
    total, count = torch.zeros(()), 0
    lengths = []
    for j in range(len(q_logits)):
        chain, alive = 0.0, 1.0
        for k in range(K):
            q = (q_logits[j][k] / T).softmax(-1)
            ids = vocab.draft_to_target_ids
            p = (p_logits[j][k][ids] / T).softmax(-1)  # renormalised on the draft vocab
            p_full = (p_logits[j][k] / T).softmax(-1)[ids]
            d = int(vocab.to_draft(tokens[j][k : k + 1])[0])
            if name == "draft_opd":
                if accepted[j][k]:
                    total = total + (p * (p.log() - q.log())).sum()
                else:
                    total = total + gamma**k * (q * (q.log() - p.log())).sum()
            elif name == "reverse_kl_k1":
                total = total + (q[d].log() - p[d].log())
            elif name == "reverse_kl_k3":
                r = p[d] / q[d]
                total = total + (r - 1 - r.log())
            elif name == "tv":
                total = total + 1 - torch.minimum(q, p_full).sum()
            alive = alive * torch.minimum(q, p_full).sum()
            chain = chain + alive
            count += 1
        lengths.append(chain)
    if name == "expected_length":
        return -torch.stack(lengths).mean()
    return total / count


@pytest.mark.parametrize(
    "name", ["draft_opd", "reverse_kl_k1", "reverse_kl_k3", "tv", "expected_length"]
)
def test_loss_on_hand_made_replays_equals_a_direct_computation(world, name):
    target = world["ctx"].target_loader.target
    drafter = load_drafter(world["drafter"].path, target.embed_weight)
    index = opd.ReplayIndex(world["replays"], world["rollouts"], full_sequences=False)
    b = index.collate([0, 1, 2])
    assert len(b.item) == 6  # two anchors per item, trained in one unroll per item
    [out] = drafter.training_module()((b.features, b.loss_mask, (b.item, b.anchor, b.tokens), K))
    logits = drafter.replay_logits(out, b.item, b.anchor)
    target_logits = target.logits_from_hidden(b.teacher_hidden)
    accepted, mask = opd.replay_outcomes(b.accept_prob, b.replay_length, "all", torch.Generator())
    assert accepted.any() and (~accepted).any()
    got = replay_loss(
        name, logits, target_logits, b.tokens, accepted, mask, drafter.vocab, temperature=0.7
    )

    direct_q = []
    for item, e, tokens in zip(b.item.tolist(), b.anchor.tolist(), b.tokens, strict=True):
        n = int(b.lengths[item])
        aux, ids = b.aux_hidden[item, :n], b.input_ids[item, :n]
        direct_q.append(_direct_chain_logits(drafter, aux, ids, e, tokens))
    want = _direct_loss(name, direct_q, target_logits, b.tokens, accepted, drafter.vocab, 0.7)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    # the reference is sensitive: the teacher of the wrong position gives another value
    shifted = target_logits.roll(1, dims=1)
    other = replay_loss(
        name, logits, shifted, b.tokens, accepted, mask, drafter.vocab, temperature=0.7
    )
    assert (other - want).abs() > 20 * (got - want).abs() + 1e-6


def test_fit_boundary_reaches_the_loss_and_off_is_the_unset_version(world):
    assert version_dict(opd.Config(fit_boundary=False)) == version_dict(opd.Config())
    assert version_dict(opd.Config(fit_boundary=True))["fit_boundary"] is True
    target = world["ctx"].target_loader.target
    drafter = load_drafter(world["drafter"].path, target.embed_weight)
    index = opd.ReplayIndex(world["replays"], world["rollouts"], full_sequences=False)
    b = index.collate([0, 1, 2])
    [out] = drafter.training_module()((b.features, b.loss_mask, (b.item, b.anchor, b.tokens), K))
    logits = drafter.replay_logits(out, b.item, b.anchor)
    target_logits = target.logits_from_hidden(b.teacher_hidden)
    accepted, mask = opd.replay_outcomes(b.accept_prob, b.replay_length, "all", torch.Generator())
    assert (mask & ~accepted).any()
    args = (logits, target_logits, b.tokens, accepted, mask, drafter)
    plain = opd._replay_loss(opd.Config(), *args)
    fitted = opd._replay_loss(opd.Config(fit_boundary=True), *args)
    want = replay_loss("draft_opd", *args[:-1], drafter.vocab, temperature=1.0, fit_boundary=True)
    torch.testing.assert_close(fitted, want)
    assert fitted > plain  # the boundary's forward KL is added, and it is positive here


def test_later_steps_never_read_target_activations_past_the_prefix(world):
    target = world["ctx"].target_loader.target
    drafter = load_drafter(world["drafter"].path, target.embed_weight)
    # full sequences: the unroll covers rows past every anchor, so the check is not trivial
    index = opd.ReplayIndex(world["replays"], world["rollouts"], full_sequences=True)
    b = index.collate([0])
    e1, e2 = b.anchor.tolist()
    assert e1 < e2

    def chains(batch):
        replays = (batch.item, batch.anchor, batch.tokens)
        [out] = drafter.training_module()((batch.features, batch.loss_mask, replays, K))
        return drafter.replay_logits(out, batch.item, batch.anchor)

    before = chains(b)
    g = torch.Generator().manual_seed(1)
    aux = b.aux_hidden.clone()
    aux[:, e1 - 1 :] = torch.randn(aux[:, e1 - 1 :].shape, generator=g).to(aux.dtype)
    ids = b.input_ids.clone()
    # (later steps of non-anchor rows read ground truth from input_ids: perturbed too)
    ids[:, e1:] = torch.randint(0, 400, ids[:, e1:].shape, generator=g)
    perturbed = chains(opd.ReplayBatch(**(b.__dict__ | {"aux_hidden": aux, "input_ids": ids})))
    torch.testing.assert_close(
        perturbed[0], before[0], rtol=0, atol=1e-6
    )  # all K steps of anchor e1
    assert not torch.allclose(perturbed[1], before[1], atol=1e-3)  # e2's prefix did change


def _training_loss(drafter, index, rows, target):
    b = index.collate(rows)
    with torch.no_grad():
        [out] = drafter.training_module()(
            (b.features, b.loss_mask, (b.item, b.anchor, b.tokens), K)
        )
        logits = drafter.replay_logits(out, b.item, b.anchor)
        accepted, mask = opd.replay_outcomes(
            b.accept_prob, b.replay_length, "all", torch.Generator()
        )
        return float(
            replay_loss(
                "draft_opd",
                logits,
                target.logits_from_hidden(b.teacher_hidden),
                b.tokens,
                accepted,
                mask,
                drafter.vocab,
                temperature=1.0,
            )
        )


def test_opd_steps_reduce_the_loss_and_write_an_sft_shaped_drafter(world):
    store, ctx = world["store"], world["ctx"]
    target = ctx.target_loader.target
    cfg = opd.Config(steps=10, **PURE)
    ds = run_stage(opd.STAGE, cfg, _inputs(world), ctx).dataset
    assert ds.ref.name == "opd" and set(ds.shards()) == set(drafters.OUTPUT_FILES)
    assert not (store.root / "_work" / "opd" / ds.ref.version).exists()
    # the vocab map is the drafter's, byte for byte, and the weights carry the same d2t/t2d
    src = world["drafter"]
    assert ds.file(features.VOCAB_FILE).read_bytes() == src.file(features.VOCAB_FILE).read_bytes()
    trained = load_drafter_dataset(ds, target, ctx.target_loader.identity)
    start = load_drafter_dataset(src, target, ctx.target_loader.identity)
    assert torch.equal(trained.d2t, start.d2t) and torch.equal(trained.t2d, start.t2d)

    index = opd.ReplayIndex(world["replays"], world["rollouts"], full_sequences=False)
    rows = list(range(len(index)))
    assert _training_loss(trained, index, rows, target) < 0.9 * _training_loss(
        start, index, rows, target
    )

    m = pl.read_parquet(ds.file(drafters.METRICS_FILE))
    train = m.filter(pl.col("kind") == "train")
    assert train["step"].to_list() == list(range(1, 11))
    # budget accounting: rows unrolled x K per step, exactly what the plan predicts
    assert (train["row_steps"] == train["tokens"] * K).all()
    val = m.filter(pl.col("kind") == "val")
    assert val["step"].to_list() == [0, 4, 8, 10]
    assert all(len(a) == K for a in val["replay_acc"].to_list())
    assert all(len(a) == 6 for a in val["acc"].to_list())  # teacher-forced, val_ttt_steps
    summary = json.loads(ds.file(drafters.SUMMARY_FILE).read_text())
    assert summary["trained"] and summary["budget_row_steps"] == int(train["row_steps"].sum())
    assert summary["drafter"] == str(src.ref)
    assert run_stage(opd.STAGE, cfg, _inputs(world), ctx).reused


def test_a_validation_log_line_prints_4_significant_digits_and_the_metrics_keep_all(world, caplog):
    cfg = opd.Config(steps=1, seed=7, **PURE)  # a seed of its own: a new version, so it runs
    with caplog.at_level("INFO", logger="opd"):
        ds = run_stage(opd.STAGE, cfg, _inputs(world), world["ctx"]).dataset
    (line,) = [r.getMessage() for r in caplog.records if "[opd] step 0: val" in r.getMessage()]
    numbers = re.findall(r"\d+\.\d+(?:e[-+]\d+)?", line)
    assert len(numbers) == 2 + K, line  # loss, K replay acc, tau_sim (no held-out prompts)
    assert all(len(n.split("e")[0].replace(".", "").lstrip("0")) <= 4 for n in numbers), line
    val = pl.read_parquet(ds.file(drafters.METRICS_FILE)).filter(pl.col("kind") == "val")
    loss = val.filter(pl.col("step") == 0)["loss"][0]
    assert f"val replay loss {loss:.4g}," in line and repr(loss) != f"{loss:.4g}"


def test_budget_sets_the_steps_and_every_loss_and_anchor_trains(world):
    ctx = world["ctx"]
    for over, inputs in (
        (dict(loss="expected_length", positions="reached", ce_lambda=0.0), {}),
        (dict(loss="reverse_kl_k3", ce_lambda=0.5), {}),  # CE on the rollout's own rows
        (
            dict(loss="tv", ce_lambda=0.5, ce_source="features", ce_ttt_steps=2),
            {"features": world["feats"]},
        ),
    ):
        cfg = opd.Config(budget_row_steps=700, **FAST | over)
        ds = run_stage(opd.STAGE, cfg, _inputs(world, **inputs), ctx).dataset
        spent = pl.read_parquet(ds.file(drafters.METRICS_FILE)).filter(pl.col("kind") == "train")[
            "row_steps"
        ]
        assert spent.sum() >= 700 > spent.sum() - spent[-1], over  # the fewest steps reaching it
        assert ds.meta["ce_anchor"] == (
            None if over["ce_lambda"] == 0 else ("features" if inputs else "rollouts")
        )
        assert torch.isfinite(torch.tensor(ds.meta["final_train_loss"]))


def test_resumed_run_matches_uninterrupted_bit_for_bit(world):
    store, ctx = world["store"], world["ctx"]
    # bf16 autocast set explicitly (`auto` is fp32 on most CPUs): a resume is exact in it too
    cfg = opd.Config(
        steps=7,
        batch_size=3,
        val_share=0.2,
        val_every=3,
        lr=3e-3,
        checkpoint_every=2,
        seed=3,
        bf16=True,
    )
    stop = cfg.model_copy(update={"stop_after_steps": 5})
    with pytest.raises(TrainingStopped, match="after step 5"):
        run_stage(opd.STAGE, stop, _inputs(world), ctx)
    work = store.root / "_work" / "opd"
    (version,) = [p.name for p in work.iterdir()]
    ckpts = training.Checkpointer(work / version)
    assert ckpts.latest() == 5
    shutil.rmtree(ckpts.path(5))  # killed between checkpoints: resumes from step 4
    resumed = run_stage(opd.STAGE, cfg, _inputs(world), ctx).dataset
    assert resumed.ref.version == version
    cols = ["kind", "step", "loss", "lr", "grad_norm", "row_steps", "replay_acc"]
    weights = load_file(resumed.file("model.safetensors"))
    metrics = pl.read_parquet(resumed.file(drafters.METRICS_FILE)).select(cols)
    fresh = run_stage(opd.STAGE, cfg, _inputs(world), ctx, force=True).dataset
    fresh_weights = load_file(fresh.file("model.safetensors"))
    assert weights.keys() == fresh_weights.keys()
    assert all(torch.equal(weights[k], fresh_weights[k]) for k in weights)
    assert metrics.equals(pl.read_parquet(fresh.file(drafters.METRICS_FILE)).select(cols))
    assert metrics.filter(pl.col("kind") == "train").height == 7


def test_foreign_vocab_and_foreign_rollouts_are_refused(world, tmp_path):
    store, ctx = world["store"], world["ctx"]
    complete = lambda: [r["version"] for r in store.listing("opd") if r["complete"]]  # noqa: E731
    before = complete()
    v = load_file(world["drafter"].file(features.VOCAB_FILE))
    t2d = v["t2d"].clone()
    first_in, first_out = int(t2d.nonzero()[0]), int((~t2d).nonzero()[0])
    t2d[first_in], t2d[first_out] = False, True  # swap one member: another map, same size
    ids = torch.nonzero(t2d)[:, 0]
    save_file(
        {"d2t": ids - torch.arange(len(ids)), "t2d": t2d, "counts": v["counts"]},
        tmp_path / "v.safetensors",
    )
    foreign = write_replay_rows(
        store,
        [],
        64,
        world["rollouts"],
        world["drafter"],
        vocab_file=tmp_path / "v.safetensors",
        tag="foreign",
    )
    with pytest.raises(OpdError, match="another draft-vocab map"):
        run_stage(opd.STAGE, opd.Config(steps=2, **FAST), _inputs(world, replays=foreign), ctx)
    # replays scored on another rollout cannot be placed on this one
    w = store.writer("rollouts", stage="test-rollout", stage_version="1", config={"other": True})
    with w:
        w.write_ipc(
            "features-00000.arrow", world["feats"].read_ipc(world["feats"].shards("ipc")[0])
        )
        w.write_file(features.VOCAB_FILE, world["feats"].file(features.VOCAB_FILE))
        elsewhere = w.commit()
    with pytest.raises(OpdError, match="was scored on"):
        run_stage(opd.STAGE, opd.Config(steps=2, **FAST), _inputs(world, rollouts=elsewhere), ctx)
    assert complete() == before  # nothing committed
    assert all(r["complete"] for r in store.listing("opd"))  # and no empty directory left


def _copy_dataset(store, ds, name, inputs=None):
    """`ds`'s files as another version of `name` (same bytes, another ref and lineage)."""
    w = store.writer(
        name, stage="test-copy", stage_version="1", config={"of": str(ds.ref)}, inputs=inputs
    )
    with w:
        for shard in ds.shards():
            w.write_file(shard, ds.file(shard), fmt=ds._shards[shard]["format"])
        return w.commit()


def test_rollouts_and_replays_of_another_drafter_are_refused_before_any_work(world):
    store, ctx = world["store"], world["ctx"]
    versions = lambda: [(r["version"], r["complete"]) for r in store.listing("opd")]  # noqa: E731
    before = versions()
    other = _copy_dataset(store, world["drafter"], "sft")
    # the replays were made by world["drafter"], not by `other`
    with pytest.raises(OpdError, match=rf"was made by {world['drafter'].ref}, not by {other.ref}"):
        run_stage(opd.STAGE, opd.Config(steps=2, **FAST), _inputs(world, drafter=other), ctx)
    # rollouts decoded by `other`, replayed and trained with world["drafter"]
    theirs = _copy_dataset(store, world["rollouts"], "rollouts", {"drafter": other.ref})
    with pytest.raises(OpdError, match=rf"{theirs.ref} was made by {other.ref}"):
        run_stage(opd.STAGE, opd.Config(steps=2, **FAST), _inputs(world, rollouts=theirs), ctx)
    assert versions() == before  # nothing committed, no empty directory


def test_empty_replays_are_a_clear_no_op(world, caplog):
    store, ctx = world["store"], world["ctx"]
    empty = write_replay_rows(store, [], 64, world["rollouts"], world["drafter"], tag="empty")
    assert empty.num_rows == 0
    with caplog.at_level("WARNING", logger="opd"):
        ds = run_stage(
            opd.STAGE, opd.Config(steps=3, **FAST), _inputs(world, replays=empty), ctx
        ).dataset
    assert "nothing to train on" in caplog.text
    assert ds.meta["trained"] is False and ds.meta["steps"] == 0
    src = world["drafter"]
    for name in ("model.safetensors", "drafter_config.json", features.VOCAB_FILE):
        assert ds.file(name).read_bytes() == src.file(name).read_bytes()
    target = ctx.target_loader.target
    assert load_drafter(ds.path, target.embed_weight).lm_head.weight.shape[0] == 512


def test_config_is_strict():
    with pytest.raises(ValueError, match="extra"):
        opd.Config(learning_rate=1e-3)
    with pytest.raises(ValueError, match="loss"):
        opd.Config(loss="forward_kl")
    with pytest.raises(ValueError, match="steps, budget_row_steps or epochs"):
        opd.Config(epochs=None)


def test_replay_outcomes_mask_unverified_and_unreached_positions():
    accept = torch.tensor([[1.0, 0.0, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0], [0.0, 1.0, 1.0, 1.0]])
    length = torch.tensor([4, 2, 4])  # the second replay drafted EOS at position 2
    accepted, mask = opd.replay_outcomes(accept, length, "all", torch.Generator())
    assert torch.equal(accepted, accept.bool())  # 0/1 probabilities are drawn exactly
    assert mask.tolist() == [[True] * 4, [True, True, False, False], [True] * 4]
    _, reached = opd.replay_outcomes(accept, length, "reached", torch.Generator())
    assert reached.tolist() == [
        [True, True, False, False],  # the first rejection is trained, nothing after it
        [True, True, False, False],
        [True, False, False, False],
    ]
    # at T > 0 acceptance is drawn from the probability with the given generator (resumable)
    half = torch.full((2000, 4), 0.25)
    a1, _ = opd.replay_outcomes(
        half, torch.full((2000,), 4), "all", torch.Generator().manual_seed(5)
    )
    a2, _ = opd.replay_outcomes(
        half, torch.full((2000,), 4), "all", torch.Generator().manual_seed(5)
    )
    assert torch.equal(a1, a2) and 0.2 < a1.float().mean() < 0.3


_DDP_WORKER = r"""
import os, sys, torch.distributed as dist
sys.path.insert(0, sys.argv[1])
from pipeline.stages import opd
from pipeline.profiles import load_config
from pipeline.core.runner import RunContext, run_stage
from pipeline.core.targets import TargetLoader
from storage import Store
root, rank, port = sys.argv[2], int(sys.argv[3]), sys.argv[4]
refs = dict(zip(("replays", "rollouts", "drafter"), sys.argv[5:8]))
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
store = Store(root)
target = load_config("tiny", sets=["target.device=cpu"]).target  # as the world's
ctx = RunContext(store=store, target_loader=TargetLoader(target), progress=False)
cfg = opd.Config(steps=3, batch_size=2, val_share=0.2, val_every=2, bf16=False, seed=11)
inputs = {role: store.open(ref) for role, ref in refs.items()}
res = run_stage(opd.STAGE, cfg, inputs, ctx, rank=rank, world_size=2)
print("COMMITTED" if res.dataset is not None else "WAITED", flush=True)
dist.barrier()  # see test_training's _DDP_WORKER
dist.destroy_process_group()
os._exit(0)
"""


def test_opd_under_ddp_with_two_gloo_ranks_commits_once(world, tmp_path):
    store = world["store"]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    script = tmp_path / "worker.py"
    script.write_text(_DDP_WORKER)
    refs = [str(world[k].ref) for k in ("replays", "rollouts", "drafter")]
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(REPO), str(store.root), str(r), port, *refs],
            env=os.environ | {"OMP_NUM_THREADS": "1"},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(2)
    ]
    try:
        outs = [p.communicate(timeout=180) for p in procs]
    finally:  # a rank stuck in a collective must not outlive the test
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0], [o[1][-2000:] for o in outs]
    assert [o[0].strip().splitlines()[-1] for o in outs] == ["COMMITTED", "WAITED"]
    ds = store.open("opd@latest")
    assert ds.meta["trained"] and ds.meta["steps"] == 3
    m = pl.read_parquet(ds.file(drafters.METRICS_FILE)).filter(pl.col("kind") == "train")
    # each step's row-steps are summed over both ranks' batches: exactly what the plan says
    index = opd.ReplayIndex(world["replays"], world["rollouts"], full_sequences=True)
    _, val = training.holdout_split(index.features.keys, 0.2, 11)
    held = {index.features.keys[i] for i in val}
    items = [i for i, key in enumerate(index.keys) if key not in held]
    cfg = opd.Config(steps=3, batch_size=2, seed=11)
    plan = budget.step_costs(index.lengths, items, steps_per_row=K, epoch=0, cfg=cfg, world_size=2)
    assert m["row_steps"].to_list() == plan[:3]
