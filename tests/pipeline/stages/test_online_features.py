"""`features.mode=online`: sft and opd compute the target's hidden states inside their training
loop from a features dataset that holds only tokens and the vocab map; the same numbers as the
cache where the forward's padded width is the same, and an exact resume after a kill."""

import hashlib
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import polars as pl
import pytest

from pipeline.core import drafters
from pipeline.core.checks import VOCAB_FILE
from pipeline.core.config import version_dict
from pipeline.core.featurize import is_online
from pipeline.core.runner import RunContext, run_stage
from pipeline.core.targets import TargetLoader
from pipeline.core.trainer import TrainingStopped
from pipeline.profiles import load_config
from pipeline.stages import features, generate, opd, rollout, score, sft
from storage import Store
from tests.pipeline.conftest import write_prompts

REPO = Path(__file__).resolve().parents[3]
# One sequence per forward in both modes, so the cached and the online forward run at the same
# padded width and the two modes train on the same bytes (across widths the target's fp32
# attention sums round differently, and a bf16 rounding can flip: see featurize_rows).
ONE = dict(batch_size=1)


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def losses(ds, kind="train") -> list[float]:
    m = pl.read_parquet(ds.file(drafters.METRICS_FILE)).filter(pl.col("kind") == kind)
    return m["loss"].to_list()


@pytest.fixture(scope="module")
def both(tmp_path_factory):
    """(store, ctx, cfg, trajectories, cached features, online features): features at batch 1."""
    store = Store(tmp_path_factory.mktemp("data"))
    cfg = load_config("tiny")
    ctx = RunContext(store=store, target_loader=TargetLoader(cfg.target), progress=False)
    traj = run_stage(generate.STAGE, cfg.generate, {"prompts": write_prompts(store)}, ctx).dataset
    base = cfg.features.model_copy(update=ONE)
    cached = run_stage(features.STAGE, base, {"trajectories": traj}, ctx).dataset
    online_cfg = features.Config.model_validate(base.model_dump() | {"mode": "online"})
    online = run_stage(features.STAGE, online_cfg, {"trajectories": traj}, ctx).dataset
    return store, ctx, cfg, traj, cached, online


def test_online_features_hold_the_tokens_and_the_vocab_map_and_no_hidden_states(both):
    store, ctx, cfg, traj, cached, online = both
    assert is_online(online) and not is_online(cached)
    assert online.ref != cached.ref and online.inputs == cached.inputs
    assert online.meta["mode"] == "online" and online.meta["trajectories"] == str(traj.ref)
    # the frozen map is made here in both modes, byte for byte
    assert online.file(VOCAB_FILE).read_bytes() == cached.file(VOCAB_FILE).read_bytes()
    tokens = ["seq_id", "input_ids", "loss_mask"]

    def rows(ds):
        return [b for shard in ds.shards("ipc") for b in ds.ipc_batches(shard)]

    got, want = rows(online), rows(cached)
    assert [b.schema.names for b in got] == [tokens] * len(want)
    assert [b.to_pylist() for b in got] == [b.select(tokens).to_pylist() for b in want]
    ipc = lambda ds: sum(s["bytes"] for s in ds.manifest["shards"] if s["path"].endswith(".arrow"))  # noqa: E731
    assert ipc(online) * 10 < ipc(cached)
    # `cached` named explicitly is the default, so no existing version moves
    named = features.Config(mode="cached")
    assert named.mode is None and version_dict(named) == version_dict(features.Config())
    assert "mode" not in version_dict(features.Config())


def test_online_sft_trains_the_same_drafter_as_cached_byte_for_byte(both):
    store, ctx, cfg, traj, cached, online = both
    sft_cfg = cfg.sft.model_copy(update=ONE | {"steps": 8, "val_every": 4})
    a = run_stage(sft.STAGE, sft_cfg, {"features": cached}, ctx).dataset
    b = run_stage(sft.STAGE, sft_cfg, {"features": online}, ctx).dataset
    assert a.ref != b.ref  # the inputs differ, so the versions do
    assert sha(b.file(drafters.WEIGHTS_FILE)) == sha(a.file(drafters.WEIGHTS_FILE))
    assert b.file(VOCAB_FILE).read_bytes() == a.file(VOCAB_FILE).read_bytes()
    assert losses(b) == losses(a) and losses(b, "val") == losses(a, "val")
    assert "online_features" not in a.meta
    info = b.meta["online_features"]
    assert info["trajectories"] == [str(traj.ref)] and info["features"] == [str(online.ref)]
    # one forward per training step (batch of one row) plus one per validation batch
    val_batches = b.meta["val_sequences"] * 2  # batch 1, validated after steps 4 and 8
    assert info["target_forwards_this_run"] == 8 + val_batches


def test_online_sft_at_the_tiny_profiles_batching_matches_cached_losses_closely(both):
    """Training batches of 4 run the target at other padded widths than the features stage's
    batches did: not the same bytes, the same losses to within bf16 rounding of a few states."""
    store, ctx, cfg, traj, cached, online = both
    sft_cfg = cfg.sft.model_copy(update={"steps": 6})
    a = run_stage(sft.STAGE, sft_cfg, {"features": cached}, ctx).dataset
    b = run_stage(sft.STAGE, sft_cfg, {"features": online}, ctx).dataset
    assert losses(b) == pytest.approx(losses(a), rel=1e-3)
    assert losses(b, "val") == pytest.approx(losses(a, "val"), rel=1e-3)


def test_online_sft_resumes_bit_for_bit(both):
    store, ctx, cfg, traj, cached, online = both
    sft_cfg = cfg.sft.model_copy(update={"steps": 6, "seed": 3, "bf16": True})
    whole = run_stage(sft.STAGE, sft_cfg, {"features": online}, ctx).dataset
    weights = sha(whole.file(drafters.WEIGHTS_FILE))
    stop = sft_cfg.model_copy(update={"stop_after_steps": 3, "checkpoint_every": 2})
    with pytest.raises(TrainingStopped, match="after step 3"):
        run_stage(sft.STAGE, stop, {"features": online}, ctx, force=True)
    resumed = run_stage(sft.STAGE, sft_cfg, {"features": online}, ctx, force=True).dataset
    assert resumed.ref == whole.ref
    assert sha(resumed.file(drafters.WEIGHTS_FILE)) == weights


def test_online_opd_anchor_trains_on_no_features_cache_as_on_the_cache(both):
    """opd's soft-CE anchor on features (ce_source=features): the same drafter from an online
    features dataset as from the cache, at one sequence per forward."""
    store, ctx, cfg, traj, cached, online = both
    sft_cfg = cfg.sft.model_copy(update=ONE | {"steps": 4, "val_every": 4})
    drafter = run_stage(sft.STAGE, sft_cfg, {"features": cached}, ctx).dataset
    prompts = store.open("prompts@latest")
    rolled = run_stage(rollout.STAGE, cfg.rollout, {"prompts": prompts, "drafter": drafter}, ctx)
    scored = run_stage(
        score.STAGE, cfg.score, {"rollouts": rolled.dataset, "drafter": drafter}, ctx
    ).dataset
    opd_cfg = cfg.opd.model_copy(update=ONE | {"ce_source": "features", "steps": 4})
    given = {"replays": scored, "rollouts": rolled.dataset, "drafter": drafter}
    a = run_stage(opd.STAGE, opd_cfg, given | {"features": cached}, ctx).dataset
    b = run_stage(opd.STAGE, opd_cfg, given | {"features": online}, ctx).dataset
    assert a.ref != b.ref
    assert sha(b.file(drafters.WEIGHTS_FILE)) == sha(a.file(drafters.WEIGHTS_FILE))
    assert losses(b) == losses(a)
    assert b.meta["online_features"]["target_forwards_this_run"] == 4  # one anchor batch a step


def _opd_cli(root: Path, *args: str) -> subprocess.Popen:
    env = os.environ | {
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    }
    return subprocess.Popen(
        [sys.executable, "-m", "cli.main", "--root", str(root), *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def test_online_sft_killed_mid_training_resumes_to_the_same_weights(tmp_path):
    """kill -9 once the run has a checkpoint, then a plain re-run: the uninterrupted weights."""
    sets = ["features.mode=online", "sft.steps=12", "sft.checkpoint_every=2", "sft.val_every=6"]
    cfg = load_config("tiny", None, sets)
    whole_root, killed_root = tmp_path / "whole", tmp_path / "killed"
    store = Store(whole_root)
    ctx = RunContext(store=store, target_loader=TargetLoader(cfg.target), progress=False)
    traj = run_stage(generate.STAGE, cfg.generate, {"prompts": write_prompts(store)}, ctx).dataset
    feats = run_stage(features.STAGE, cfg.features, {"trajectories": traj}, ctx).dataset
    shutil.copytree(whole_root, killed_root)
    whole = run_stage(sft.STAGE, cfg.sft, {"features": feats}, ctx).dataset
    assert "online_features" in whole.meta

    args = [
        "run",
        "sft",
        "--profile",
        "tiny",
        "--no-progress",
        *(a for s in sets for a in ("--set", s)),
    ]
    proc = _opd_cli(killed_root, *args)
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        if list(killed_root.glob("_work/sft/*/step-00000004")):
            proc.send_signal(signal.SIGKILL)
            break
        time.sleep(0.005)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, "sft finished before it could be killed"
    again = _opd_cli(killed_root, *args)
    out = again.communicate(timeout=600)[0]
    assert again.returncode == 0, out
    assert "resuming from step" in out
    resumed = Store(killed_root).open("sft@latest")
    assert resumed.ref == whole.ref
    assert sha(resumed.file(drafters.WEIGHTS_FILE)) == sha(whole.file(drafters.WEIGHTS_FILE))
    assert losses(resumed) == losses(whole)
