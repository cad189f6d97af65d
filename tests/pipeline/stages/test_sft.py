"""Stage `sft` end to end on tiny features from a random target."""

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import polars as pl
import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

from cli.main import cli
from lab.experiments import common
from models.drafters import KINDS, load_drafter
from models.features import Features
from models.losses import (
    feature_regression,
    soft_cross_entropy,
    teacher_draft_probs,
    ttt_loss,
)
from models.teacher import ArgmaxCache
from models.vocab import DraftVocab
from pipeline.core import drafters, targets, training, validation
from pipeline.core import trainer as trainer_module
from pipeline.core.config import version_dict
from pipeline.core.runner import RunContext, run_stage
from pipeline.core.targets import TargetConfig, TargetLoader
from pipeline.core.trainer import TrainingStopped
from pipeline.profiles import load_config
from pipeline.stages import evaluate, features, generate, sft
from storage import OpdError, Store
from tests.pipeline.conftest import write_prompts
from tests.pipeline.core.test_training import flip_tensor_byte

REPO = Path(__file__).resolve().parents[3]
# fp32 keeps the tiny runs fast; the resume test covers bf16 autocast.
FAST = dict(batch_size=4, val_share=0.2, val_every=4, lr=3e-3, bf16=False)


@pytest.fixture(scope="module")
def tiny_features(tmp_path_factory):
    """(store, ctx, features dataset): 12 trajectories of a random 4-layer target."""
    store = Store(tmp_path_factory.mktemp("data"))
    cfg = load_config("tiny")
    ctx = RunContext(store=store, target_loader=TargetLoader(cfg.target), progress=False)
    prompts = write_prompts(store)
    traj = run_stage(generate.STAGE, cfg.generate, {"prompts": prompts}, ctx).dataset
    return store, ctx, run_stage(features.STAGE, cfg.features, {"trajectories": traj}, ctx).dataset


def test_sft_trains_and_writes_a_loadable_drafter(tiny_features):
    store, ctx, feats = tiny_features
    cfg = sft.Config(steps=12, **FAST)
    ds = run_stage(sft.STAGE, cfg, {"features": feats}, ctx).dataset
    assert store.resolve("sft@latest") == ds.ref
    assert set(ds.shards()) == set(drafters.OUTPUT_FILES)
    # the vocab map is the features' own file, byte for byte
    assert ds.file(features.VOCAB_FILE).read_bytes() == feats.file(features.VOCAB_FILE).read_bytes()
    assert not (store.root / "_work" / "sft" / ds.ref.version).exists()  # checkpoints cleaned up

    m = pl.read_parquet(ds.file(drafters.METRICS_FILE))
    train = m.filter(pl.col("kind") == "train")
    val = m.filter(pl.col("kind") == "val")
    assert train["step"].to_list() == list(range(1, 13))
    assert val["step"].to_list() == [4, 8, 12]
    assert all(len(a) == cfg.ttt_steps for a in train["acc"].to_list())
    losses = train["loss"].to_list()
    assert sum(losses[-3:]) < sum(losses[:3])  # it learns
    assert val["loss"][-1] < val["loss"][0]
    assert train["lr"].to_list()[-1] == pytest.approx(cfg.lr * cfg.min_lr_ratio)
    assert ds.meta["val_sequences"] == 2 and ds.meta["train_sequences"] == 10
    assert ds.meta["validation"]["step"] == 12

    # reloading the drafter from the dataset reproduces the final validation exactly
    target = ctx.target_loader.target
    drafter = load_drafter(ds.path, target.embed_weight)
    assert torch.equal(drafter.d2t.cpu(), load_file(feats.file(features.VOCAB_FILE))["d2t"])
    index = training.FeatureIndex(feats, validation.FEATURE_COLUMNS)
    _, val_rows = training.holdout_split(index.keys, cfg.val_share, cfg.seed)
    loader = training.FeatureLoader(
        index, val_rows, batch_size=cfg.batch_size, max_tokens=cfg.max_tokens, shuffle=False
    )
    how = dict(
        ttt_steps=cfg.ttt_steps,
        tau_k=cfg.tau_k,
        temperature=cfg.temperature,
        step_decay=cfg.step_decay,
        bf16=cfg.bf16,
    )
    again = validation.validate(drafter, loader, target, **how)
    final = val.row(-1, named=True)
    for key in ("loss", "acc", "alpha", "tau_sim", "tau_expected", "tau_chain"):
        assert again[key] == final[key], key
    fresh = sft.new_drafter(target, drafter.vocab, cfg.seed)
    assert validation.validate(fresh, loader, target, **how)["loss"] > again["loss"]

    # a second run reuses the committed dataset
    assert run_stage(sft.STAGE, cfg, {"features": feats}, ctx).reused


def test_resumed_run_matches_uninterrupted_bit_for_bit(tiny_features):
    store, ctx, feats = tiny_features
    # bf16 autocast set explicitly (`auto` is fp32 on most CPUs): it must resume exactly too
    cfg = sft.Config(
        steps=8, batch_size=4, val_share=0.2, val_every=3, ttt_steps=3, tau_k=3, bf16=True
    )
    work = store.root / "_work" / "sft"

    stop = cfg.model_copy(update={"stop_after_steps": 5, "checkpoint_every": 2})
    with pytest.raises(TrainingStopped, match="after step 5"):
        run_stage(sft.STAGE, stop, {"features": feats}, ctx)
    (version,) = [p.name for p in work.iterdir()]
    ckpts = training.Checkpointer(work / version)
    assert ckpts.latest() == 5
    assert not (store.root / "sft" / version / "manifest.json").exists()  # nothing committed
    # simulate a kill between checkpoints: the newest is lost, the run resumes from step 4
    shutil.rmtree(ckpts.path(5))
    resumed = run_stage(sft.STAGE, cfg, {"features": feats}, ctx).dataset
    assert resumed.ref.version == version  # the stop knob is not part of the version
    weights = load_file(resumed.file("model.safetensors"))
    metrics = pl.read_parquet(resumed.file(drafters.METRICS_FILE))

    fresh = run_stage(sft.STAGE, cfg, {"features": feats}, ctx, force=True).dataset
    fresh_weights = load_file(fresh.file("model.safetensors"))
    assert weights.keys() == fresh_weights.keys()
    for name, t in fresh_weights.items():
        assert torch.equal(weights[name], t), name
    fresh_metrics = pl.read_parquet(fresh.file(drafters.METRICS_FILE))
    cols = ["kind", "step", "loss", "lr", "grad_norm", "acc", "tau_sim", "tau_chain"]
    assert metrics.select(cols).equals(fresh_metrics.select(cols))
    assert len(metrics.filter(pl.col("kind") == "train")) == 8


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_saves_a_checkpoint_at_the_end_of_its_step_and_the_run_resumes_exactly(
    tiny_features, monkeypatch, sig
):
    store, ctx, feats = tiny_features
    # a version of its own per signal, so each test starts without checkpoints
    cfg = sft.Config(steps=6, seed=20 + int(sig), ttt_steps=3, tau_k=3, **FAST)
    calls, step = [], sft.train_step

    def signalled_step(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:  # mid step 3: the loop must finish it, then save and stop
            signal.raise_signal(sig)
        return step(*args, **kwargs)

    monkeypatch.setattr(sft, "train_step", signalled_step)
    handler = signal.getsignal(sig)
    with pytest.raises(TrainingStopped, match=f"after step 3 of 6 \\({sig.name}\\)"):
        run_stage(sft.STAGE, cfg, {"features": feats}, ctx)
    assert signal.getsignal(sig) is handler  # restored for whatever runs next
    (work,) = [
        p for p in (store.root / "_work" / "sft").iterdir() if (p / "step-00000003").is_dir()
    ]
    assert training.Checkpointer(work).latest() == 3  # checkpoint_every (100) was not reached
    assert not (store.root / "sft" / work.name / "manifest.json").exists()

    monkeypatch.setattr(sft, "train_step", step)
    resumed = run_stage(sft.STAGE, cfg, {"features": feats}, ctx).dataset
    fresh = run_stage(sft.STAGE, cfg, {"features": feats}, ctx, force=True).dataset
    weights, fresh_weights = (load_file(d.file("model.safetensors")) for d in (resumed, fresh))
    for name, t in fresh_weights.items():
        assert torch.equal(weights[name], t), name


def test_train_share_trains_on_a_nested_share_and_keeps_the_validation_split(tiny_features):
    store, ctx, feats = tiny_features
    base = sft.Config(steps=2, seed=31, **FAST)
    assert sft.Config(steps=2, seed=31, train_share=1.0, **FAST) == base  # all = unset
    with pytest.raises(ValueError, match=r"train_share must be in \(0, 1\]"):
        sft.Config(steps=2, train_share=1.5)
    full, half = (
        run_stage(sft.STAGE, c, {"features": feats}, ctx).dataset
        for c in (base, base.model_copy(update={"train_share": 0.5}))
    )
    assert full.ref.version != half.ref.version
    assert half.meta["train_sequences"] == round(full.meta["train_sequences"] / 2)
    assert half.meta["val_sequences"] == full.meta["val_sequences"]
    assert half.manifest["config"]["stage"]["train_share"] == 0.5


def test_a_corrupted_checkpoint_is_reported_and_the_previous_one_resumed(tiny_features, caplog):
    store, ctx, feats = tiny_features
    cfg = sft.Config(steps=7, batch_size=4, val_share=0.2, val_every=3, ttt_steps=3, tau_k=3)
    stop = cfg.model_copy(update={"stop_after_steps": 4, "checkpoint_every": 2})
    with pytest.raises(TrainingStopped):
        run_stage(sft.STAGE, stop, {"features": feats}, ctx)
    (work,) = [
        p for p in (store.root / "_work" / "sft").iterdir() if (p / "step-00000004").is_dir()
    ]
    ckpts = training.Checkpointer(work)
    assert ckpts._steps() == [2, 4]
    # a flipped byte in the frozen vocab map: loads fine, trains, and ships a wrong d2t
    flip_tensor_byte(ckpts.path(4) / "tensors.safetensors", "model/d2t")
    with caplog.at_level("INFO", logger="opd"):
        resumed = run_stage(sft.STAGE, cfg, {"features": feats}, ctx).dataset
    assert "step-00000004 is corrupted: tensors.safetensors fails its sha256" in caplog.text
    assert "resuming from step 2" in caplog.text
    assert resumed.ref.version == work.name
    fresh = run_stage(sft.STAGE, cfg, {"features": feats}, ctx, force=True).dataset
    sums = lambda ds: {s["path"]: s["sha256"] for s in ds.manifest["shards"]}  # noqa: E731
    for name in ("model.safetensors", features.VOCAB_FILE):
        assert sums(resumed)[name] == sums(fresh)[name], name


def test_a_validation_log_line_prints_4_significant_digits_and_the_metrics_keep_all(
    tiny_features, caplog
):
    store, ctx, feats = tiny_features
    cfg = sft.Config(steps=2, seed=11, **FAST | {"val_every": 2})  # a version of its own
    with caplog.at_level("INFO", logger="opd"):
        ds = run_stage(sft.STAGE, cfg, {"features": feats}, ctx).dataset
    (line,) = [r.getMessage() for r in caplog.records if "[sft] step 2: val" in r.getMessage()]
    numbers = re.findall(r"\d+\.\d+(?:e[-+]\d+)?", line)
    assert len(numbers) == 3 + cfg.ttt_steps, line  # loss, acc per step, tau_sim, tau_chain
    assert all(len(n.split("e")[0].replace(".", "").lstrip("0")) <= 4 for n in numbers), line
    val = pl.read_parquet(ds.file(drafters.METRICS_FILE)).filter(pl.col("kind") == "val")
    loss = val.filter(pl.col("step") == 2)["loss"][0]
    assert f"val loss {loss:.4g}," in line and repr(loss) != f"{loss:.4g}"


def test_more_features_are_trained_on_and_must_share_the_vocab_map(tiny_features, tmp_path):
    store, ctx, feats = tiny_features
    cfg = load_config("tiny")
    # a second features dataset of the same target: other prompts' trajectories
    more_prompts = write_prompts(store, n_train=8, n_heldout=2, vocab=300)
    traj = run_stage(generate.STAGE, cfg.generate, {"prompts": more_prompts}, ctx).dataset
    more = run_stage(features.STAGE, cfg.features, {"trajectories": traj}, ctx).dataset
    one = training.FeatureIndex(feats, validation.FEATURE_COLUMNS)
    both = training.FeatureIndex([feats, more], validation.FEATURE_COLUMNS)
    assert len(both) == len(one) + len(training.FeatureIndex(more, validation.FEATURE_COLUMNS))
    assert both.keys[: len(one)] == one.keys

    assert not torch.equal(  # other sequences, other token frequencies
        load_file(more.file(features.VOCAB_FILE))["d2t"],
        load_file(feats.file(features.VOCAB_FILE))["d2t"],
    )
    scfg = sft.Config(steps=2, **FAST)
    with pytest.raises(OpdError, match="another draft-vocab map"):
        run_stage(sft.STAGE, scfg, {"features": feats, "more_features": more}, ctx)
    # the features' own copy shares the map: rows of both are trained on
    copy = store.writer(
        "features", stage="copy", stage_version="1", config={}, inputs={"of": feats.ref}
    )
    with copy:
        ipc = feats.shards("ipc")
        for name in feats.shards():
            copy.write_file(name, feats.file(name), fmt="ipc" if name in ipc else "file")
        twin = copy.commit(meta=feats.meta)
    ds = run_stage(sft.STAGE, scfg, {"features": feats, "more_features": twin}, ctx).dataset
    assert ds.meta["more_features"] == [str(twin.ref)]
    assert ds.meta["train_sequences"] + ds.meta["val_sequences"] == 2 * len(one)


def test_sft_refuses_features_of_another_target(tiny_features):
    store, _, feats = tiny_features
    other = TargetLoader(TargetConfig(path="random", random={"seed": 1}, aux_layer_ids=[1, 2, 3]))
    ctx2 = RunContext(store=store, target_loader=other, progress=False)
    complete = lambda: [r["version"] for r in store.listing() if r["complete"]]  # noqa: E731
    before = complete()
    with pytest.raises(OpdError, match="different target"):
        run_stage(sft.STAGE, sft.Config(steps=2, **FAST), {"features": feats}, ctx2)
    assert complete() == before


def test_config_is_strict_and_checked():
    with pytest.raises(ValueError, match="tau_k"):
        sft.Config(ttt_steps=3, tau_k=6)
    with pytest.raises(ValueError, match="extra"):
        sft.Config(learning_rate=1e-3)
    # run-time knobs do not change the dataset version; training knobs do
    base = version_dict(sft.Config())
    assert version_dict(sft.Config(stop_after_steps=3, checkpoint_every=7, threads=1)) == base
    assert version_dict(sft.Config(lr=1e-4)) != base


def test_the_objective_leaves_default_versions_unchanged_and_refuses_ttt_only_settings():
    # unset (EAGLE-3) is not in the hashed config, so every existing sft version stays valid
    base = version_dict(sft.Config())
    assert "objective" not in base
    assert "objective" not in version_dict(load_config("default").sft)
    assert "objective" not in version_dict(load_config("tiny").sft)
    # naming the default explicitly is the default
    assert sft.Config(objective="eagle3").objective is None
    assert version_dict(sft.Config(objective="eagle3")) == base
    assert version_dict(load_config("tiny", sets=["sft.objective=eagle3"]).sft) == version_dict(
        load_config("tiny").sft
    )
    eagle1 = sft.Config(objective="eagle1")
    assert version_dict(eagle1) == base | {"objective": "eagle1"}
    assert (eagle1.unroll_depth, sft.Config().unroll_depth) == (1, sft.Config().ttt_steps)
    with pytest.raises(ValueError, match="drop the step_decay setting"):
        sft.Config(objective="eagle1", step_decay=0.5)
    with pytest.raises(OpdError, match="drop the step_decay setting"):
        load_config("tiny", sets=["sft.objective=eagle1", "sft.step_decay=0.5"])
    with pytest.raises(OpdError, match="'eagle3' or 'eagle1'"):
        load_config("tiny", sets=["sft.objective=eagle2"])


def test_eagle1_trains_one_step_on_the_next_positions_state_and_its_drafter_evaluates(
    tiny_features,
):
    store, ctx, feats = tiny_features
    target = ctx.target_loader.target
    cfg = sft.Config(steps=12, objective="eagle1", ttt_steps=3, tau_k=3, **FAST)

    # one batch by hand: step 0's hidden_out at row t regresses onto last_hidden at t+1
    v = load_file(feats.file(features.VOCAB_FILE))
    drafter = sft.new_drafter(target, DraftVocab(v["d2t"], v["t2d"]), seed=0)
    index = training.FeatureIndex(feats, validation.FEATURE_COLUMNS)
    batch = index.collate([0, 3, 5])
    out = sft.train_step(
        drafter.training_module(),
        drafter,
        batch,
        target,
        cfg,
        ArgmaxCache(target.lm_head_weight, drafter.vocab.draft_to_target_ids),
    )
    assert out.row_steps == out.tokens == batch.num_tokens  # one unrolled step per row
    assert len(out.extra["acc"]) == 1
    b = validation.to_device(batch, target.device)
    step0 = drafter.unroll(Features(b["input_ids"], b["aux_hidden"]), b["loss_mask"], 1)
    teacher = teacher_draft_probs(target.logits_from_hidden(b["last_hidden"]), drafter.vocab)
    rows = step0.valid[0][:, :-1]
    want = feature_regression(
        step0.hidden[0][:, :-1], b["last_hidden"][:, 1:], rows
    ) + 0.1 * soft_cross_entropy(step0.logits[0][:, :-1], teacher[:, 1:], rows)
    torch.testing.assert_close(out.loss, want)

    ds = run_stage(sft.STAGE, cfg, {"features": feats}, ctx).dataset
    assert ds.config["stage"]["objective"] == "eagle1" and ds.meta["objective"] == "eagle1"
    m = pl.read_parquet(ds.file(drafters.METRICS_FILE))
    train, val = m.filter(pl.col("kind") == "train"), m.filter(pl.col("kind") == "val")
    assert train["row_steps"].to_list() == train["tokens"].to_list()
    assert common.sft_budget(ds) == int(train["tokens"].sum())  # not x ttt_steps
    assert all(len(a) == 1 for a in train["acc"].to_list())
    # validation unrolls ttt_steps, so it shows acceptance down the chain
    assert all(len(a) == cfg.ttt_steps for a in val["acc"].to_list())
    losses = train["loss"].to_list()
    assert sum(losses[-3:]) < sum(losses[:3])  # it learns
    # the validation loss is EAGLE-1's, as reloading the drafter reproduces
    fit_rows, val_rows = training.holdout_split(index.keys, cfg.val_share, cfg.seed)
    loaders = {
        name: training.FeatureLoader(
            index, rows, batch_size=cfg.batch_size, max_tokens=cfg.max_tokens, shuffle=False
        )
        for name, rows in (("train", fit_rows), ("val", val_rows))
    }
    how = dict(ttt_steps=3, tau_k=3, temperature=1.0, step_decay=0.8, bf16=False)
    trained = load_drafter(ds.path, target.embed_weight)
    again = validation.validate(trained, loaders["val"], target, objective="eagle1", **how)
    assert again["loss"] == val["loss"][-1]
    assert validation.validate(trained, loaders["val"], target, **how)["loss"] != again["loss"]
    # it fits its training rows (a random target's next state does not generalise to 2
    # held-out sequences, so the held-out loss is no test of learning here)
    fit = {
        name: validation.validate(d, loaders["train"], target, objective="eagle1", **how)["loss"]
        for name, d in (("fresh", drafter), ("trained", trained))
    }
    assert fit["trained"] < fit["fresh"]

    prompts = store.open(store.open(feats.inputs["trajectories"]).inputs["prompts"])
    ecfg = evaluate.Config(k=3, max_prompts=3, max_new_tokens=8, batch_size=3)
    ev = run_stage(evaluate.STAGE, ecfg, {"prompts": prompts, "drafter": ds}, ctx).dataset
    assert ev.meta["drafter"] == str(ds.ref) and 1 <= ev.meta["tau"] <= 4


def test_sft_loss_scores_step_k_against_the_teacher_at_t_plus_k_plus_1(tiny_features):
    _, ctx, feats = tiny_features
    target = ctx.target_loader.target
    v = load_file(feats.file(features.VOCAB_FILE))
    drafter = sft.new_drafter(target, DraftVocab(v["d2t"], v["t2d"]), seed=0)
    index = training.FeatureIndex(feats, validation.FEATURE_COLUMNS)
    b = validation.to_device(index.collate([0, 3, 5]), target.device)
    mask = b["loss_mask"].bool()
    out = drafter.unroll(Features(b["input_ids"], b["aux_hidden"]), mask, 4)
    teacher = teacher_draft_probs(target.logits_from_hidden(b["last_hidden"]), drafter.vocab)
    got = drafter.sft_loss(out, teacher, b["last_hidden"], decay=0.8, objective=None)
    # the reference aligns step k's row t with full-size copies of the teacher at t+k+1
    shifted = [torch.cat([teacher[:, k + 1 :], teacher[:, : k + 1] * 0], 1) for k in range(4)]
    torch.testing.assert_close(got, ttt_loss(out.logits, shifted, out.valid, 0.8))
    # and a misaligned teacher gives another value (the check can fail)
    assert not torch.isclose(got, ttt_loss(out.logits, [teacher] * 4, out.valid, 0.8))


_DDP_WORKER = r"""
import os, sys, torch.distributed as dist
sys.path.insert(0, sys.argv[1])
from pipeline.stages import sft
from pipeline.profiles import load_config
from pipeline.core.runner import RunContext, run_stage
from pipeline.core.targets import TargetLoader
from storage import Store
root, rank, port, features_ref = sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
store = Store(root)
ctx = RunContext(store=store, target_loader=TargetLoader(load_config("tiny").target), progress=False)
cfg = sft.Config(steps=4, batch_size=4, val_share=0.2, val_every=2, bf16=False, ttt_steps=3, tau_k=3)
res = run_stage(sft.STAGE, cfg, {"features": store.open(features_ref)}, ctx, rank=rank, world_size=2)
print("COMMITTED" if res.dataset is not None else "WAITED", flush=True)
dist.barrier()  # see test_training's _DDP_WORKER
dist.destroy_process_group()
os._exit(0)
"""


def test_sft_under_ddp_with_two_gloo_ranks_commits_once(tiny_features, tmp_path):
    store, ctx, feats = tiny_features
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    script = tmp_path / "worker.py"
    script.write_text(_DDP_WORKER)
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(REPO), str(store.root), str(r), port, str(feats.ref)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(2)
    ]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [o[1][-2000:] for o in outs]
    # rank 0 writes everything and is the only one that commits
    assert [o[0].strip().splitlines()[-1] for o in outs] == ["COMMITTED", "WAITED"]
    ds = store.open("sft@latest")
    assert set(ds.shards()) == set(drafters.OUTPUT_FILES)
    ds.verify_all()
    m = pl.read_parquet(ds.file(drafters.METRICS_FILE)).filter(pl.col("kind") == "train")
    # each step is one process's step, split over both ranks: its tokens are summed over them
    assert m["step"].to_list() == [1, 2, 3, 4]
    index = training.FeatureIndex(feats, validation.FEATURE_COLUMNS)
    train_rows, _ = training.holdout_split(index.keys, 0.2, 0)
    one = training.FeatureLoader(index, train_rows, batch_size=4, max_tokens=4096)
    plan = (one.plan(0) + one.plan(1))[:4]
    assert m["tokens"].to_list() == [sum(int(index.lengths[r]) for r in b) for b in plan]
    assert (
        load_drafter(ds.path, ctx.target_loader.target.embed_weight).lm_head.weight.shape[0] == 512
    )


# ------------------------------------------------------------- refusals before any work


@pytest.fixture(scope="module")
def two_kinds(tiny_features, tmp_path_factory):
    """(root, DFlash sft ref, EAGLE-3 sft ref): the tiny features copied into a root of their
    own (the other tests' datasets stay out of its listings), one drafter of each kind on them."""
    store, _, feats = tiny_features
    root = tmp_path_factory.mktemp("kinds")
    for name in ("prompts", "trajectories", "features"):
        shutil.copytree(store.root / name, root / name)
    own = Store(root)
    cfg = load_config("tiny", sets=["drafter.kind=dflash", *DFLASH_SETS])
    ctx = RunContext(store=own, target_loader=TargetLoader(cfg.target), progress=False)
    feats = own.open(str(feats.ref))
    dflash = run_stage(sft.STAGE, cfg.sft, {"features": feats}, ctx).dataset
    eagle3 = run_stage(sft.STAGE, load_config("tiny").sft, {"features": feats}, ctx).dataset
    return root, str(dflash.ref), str(eagle3.ref)


DFLASH_SETS = ["drafter.block_size=4", "drafter.layers=1"]


def _sft_error(root: Path, *args: str) -> str:
    """The one line `opd run sft ARGS` ends with (exit 2), checking that nothing was written."""
    before = sorted(p.relative_to(root) for p in root.rglob("*") if not p.name.endswith(".lock"))
    cli_args = ["--root", str(root), "run", "sft", "--profile", "tiny", "--no-progress", *args]
    r = CliRunner().invoke(cli, cli_args)
    assert r.exit_code == 2, r.output
    lines = r.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), r.output
    after = sorted(p.relative_to(root) for p in root.rglob("*") if not p.name.endswith(".lock"))
    assert after == before, set(after) - set(before)  # no dataset, no empty directory
    return lines[0]


def _sets(*sets: str) -> list[str]:
    return [a for s in sets for a in ("--set", s)]


def test_continuing_a_drafter_refuses_another_kind_or_architecture_before_any_work(two_kinds):
    root, dflash, eagle3 = two_kinds
    continued = ["--input", f"drafter={dflash}"]
    for setting, value, recorded in (
        ("block_size", 5, 4),
        ("layers", 2, 1),
        ("anchors", 7, 256),
        ("mask_token_id", 9, 2),
        ("head", "target", "draft"),
    ):
        sets = _sets("drafter.kind=dflash", f"drafter.{setting}={value}")
        error = _sft_error(root, *continued, *sets)
        assert f"drafter.{setting}={value}" in error and f"{dflash} has {recorded}" in error, error
        assert "drop the setting or train a fresh drafter" in error, error
    # A kind other than the continued drafter's, either way, and the default kind (EAGLE-3).
    for args in (continued, [*continued, *_sets("drafter.kind=eagle3")]):
        error = _sft_error(root, *args)
        assert f"{dflash} holds a dflash drafter, but drafter.kind is eagle3" in error, error
        assert "--set drafter.kind=dflash" in error, error
    error = _sft_error(root, "--input", f"drafter={eagle3}", *_sets("drafter.kind=dflash"))
    assert f"{eagle3} holds a eagle3 drafter, but drafter.kind is dflash" in error, error
    # Offsets deeper than its block drafts (its block_size 4 drafts 3).
    error = _sft_error(root, *continued, *_sets("drafter.kind=dflash", "drafting.ttt_steps=4"))
    assert f"drafting.ttt_steps (4) trained offsets do not fit {dflash}" in error, error
    # Its own settings (or none) continue it.
    sets = _sets("drafter.kind=dflash", *DFLASH_SETS, "sft.steps=1")
    r = CliRunner().invoke(
        cli, ["--root", str(root), "run", "sft", "--profile", "tiny", *continued, *sets]
    )
    assert r.exit_code == 0, r.output


def test_bad_dflash_settings_are_one_line_errors_before_any_work(two_kinds, monkeypatch, tmp_path):
    root, _, _ = two_kinds
    dflash = _sets("drafter.kind=dflash", "sft.steps=1")
    for sets, message in (
        (["drafter.block_size=100000"], "drafter.block_size: Input should be less than or equal"),
        (["drafter.layers=0"], "drafter.layers: Input should be greater than or equal to 1"),
        (["drafter.anchors=0"], "drafter.anchors: Input should be greater than or equal to 1"),
        (["drafter.mask_token_id=-1"], "drafter.mask_token_id: Input should be greater than or"),
        (["drafter.mask_token_id=4096"], "mask_token_id 4096 is outside the target vocab"),
        (["drafter.mask_token_id=99999"], "mask_token_id 99999 is outside the target vocab"),
        (["drafter.layers=5"], "a 5-layer drafter is deeper than the target (4 layers)"),
    ):
        error = _sft_error(root, *dflash, *_sets(*sets))
        assert message in error, (sets, error)
    # A chain refuses them before its first stage.
    empty = tmp_path / "empty"
    args = ["--root", str(empty), "run", "sft-chain", "--profile", "tiny", *dflash]
    r = CliRunner().invoke(cli, [*args, *_sets("drafter.mask_token_id=4096")])
    assert r.exit_code == 2 and r.output.strip().splitlines() == [
        "error: drafter settings do not fit the target: DFlash mask_token_id 4096 is outside "
        "the target vocab [0, 4096); change that drafter.* setting or leave it unset (the kind's "
        "default)"
    ], r.output
    assert not empty.exists() or not any(empty.rglob("*.parquet"))
    # A target with fewer positions than a block spans (the tiny one has 2,048).
    build = targets._build_random

    def short(*args):
        model = build(*args)
        model.config.max_position_embeddings = 32
        return model

    monkeypatch.setattr(targets, "_build_random", short)
    error = _sft_error(root, *dflash, *_sets("drafter.block_size=33"))
    assert "block_size 33 exceeds the target's 32 positions" in error, error


def test_a_dflash_summary_names_the_objective_it_trained(two_kinds):
    root, dflash, eagle3 = two_kinds
    store = Store(root)
    assert store.open(dflash).meta["objective"] == "dflash"
    assert store.open(eagle3).meta["objective"] == "eagle3"


def test_a_drafter_too_shallow_for_its_trained_offsets_names_its_own_kinds_setting():
    # A Medusa drafter too shallow was told to raise drafter.block_size (DFlash's setting),
    # which Medusa refuses: each kind's message names its own setting and no other kind's.
    settings = {
        spec.name: spec.settings.depth_setting
        for spec in KINDS.values()
        if spec.settings_of({}).max_draft_depth() is not None
    }
    assert len(set(settings.values())) > 1  # else naming another kind's setting cannot happen
    for spec in KINDS.values():
        depth = spec.settings_of({}).max_draft_depth()
        if depth is None:
            continue
        setting = settings[spec.name]
        assert setting in spec.settings.model_fields, spec.name
        with pytest.raises(OpdError) as e:
            load_config(
                "tiny", sets=[f"drafter.kind={spec.name}", f"drafting.ttt_steps={depth + 1}"]
            )
        message = str(e.value)
        assert (
            f"{spec.name} drafter drafting {depth} per step; raise drafter.{setting} or lower"
            in message
        )
        assert not [s for s in settings.values() if s != setting and s in message]


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_during_the_starting_validation_stops_before_the_first_step(
    tiny_features, monkeypatch, sig
):
    # The starting validation (step 0, with held-out sequences) runs before the first step: a
    # stop request landing there must stop the run cleanly too, not be lost or kill it.
    _, ctx, feats = tiny_features
    cfg = sft.Config(steps=4, seed=40 + int(sig), ttt_steps=3, tau_k=3, **FAST)
    validator, train = sft._validator, trainer_module.Trainer.train

    def signalling_validator(*args, **kwargs):
        inner = validator(*args, **kwargs)

        def validation(model, step):
            if step == 0:
                signal.raise_signal(sig)
            return inner(model, step)

        return validation

    def train_validating_at_start(self, loss_step, validate, *, validate_at_start=False):
        return train(self, loss_step, validate, validate_at_start=True)

    monkeypatch.setattr(sft, "_validator", signalling_validator)
    monkeypatch.setattr(trainer_module.Trainer, "train", train_validating_at_start)
    handler = signal.getsignal(sig)
    with pytest.raises(TrainingStopped, match=f"before step 1 of 4 \\({sig.name}\\)"):
        run_stage(sft.STAGE, cfg, {"features": feats}, ctx)
    assert signal.getsignal(sig) is handler

    monkeypatch.setattr(sft, "_validator", validator)
    done = run_stage(sft.STAGE, cfg, {"features": feats}, ctx).dataset
    metrics = pl.read_parquet(done.file(drafters.METRICS_FILE))
    assert len(metrics.filter(pl.col("kind") == "train")) == 4
    assert metrics.filter(pl.col("kind") == "val")["step"].to_list()[0] == 0
