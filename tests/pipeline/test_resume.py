"""A stage killed with SIGKILL mid-run resumes to the same bytes as an uninterrupted run."""

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from pipeline.core.runner import run_stage
from pipeline.stages import features, generate
from storage import Store

ONE_ROW_SHARDS = {"rows_per_shard": 1, "batch_size": 1}
SETS = [a for k, v in ONE_ROW_SHARDS.items() for a in ("--set", f"features.{k}={v}")]


def _opd(root: Path, *args: str) -> subprocess.Popen:
    """`opd` in a process of its own, on one thread as this one: its bytes are this process's."""
    repo = str(Path(__file__).resolve().parents[2])
    env = os.environ | {"PYTHONPATH": os.pathsep.join([repo, os.environ.get("PYTHONPATH", "")])}
    env["OMP_NUM_THREADS"] = "1"
    return subprocess.Popen(
        [sys.executable, "-m", "cli.main", "--root", str(root), *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def test_features_killed_mid_run_resume_to_identical_checksums(tiny, tmp_path):
    store, ctx, cfg, prompts = tiny
    run_stage(generate.STAGE, cfg.generate, {"prompts": prompts}, ctx)
    crash_root = tmp_path / "crash"
    shutil.copytree(store.root, crash_root)

    traj = store.open("trajectories@latest")
    cfg_features = cfg.features.model_copy(update=ONE_ROW_SHARDS)
    reference = run_stage(features.STAGE, cfg_features, {"trajectories": traj}, ctx).dataset

    proc = _opd(crash_root, "run", "features", "--profile", "tiny", "--no-progress", *SETS)
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        if list(crash_root.glob("features/*/part-00002.arrow")):
            proc.send_signal(signal.SIGKILL)
            break
        time.sleep(0.005)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, "the stage finished before it could be killed"
    crashed = Store(crash_root)
    assert [r["complete"] for r in crashed.listing("features")] == [False]

    again = _opd(crash_root, "run", "features", "--profile", "tiny", "--no-progress", *SETS)
    out = again.communicate(timeout=600)[0]
    assert again.returncode == 0, out
    assert "resuming" in out
    resumed = crashed.open("features@latest")
    assert resumed.ref == reference.ref
    sums = lambda ds: {s["path"]: s["sha256"] for s in ds.manifest["shards"]}  # noqa: E731
    assert sums(resumed) == sums(reference)
    assert features.VOCAB_FILE in sums(resumed)


def test_force_killed_mid_stage_keeps_the_old_dataset_until_the_new_one_commits(tiny):
    store, ctx, cfg, prompts = tiny
    run_stage(generate.STAGE, cfg.generate, {"prompts": prompts}, ctx)
    args = ("run", "features", "--profile", "tiny", "--no-progress", *SETS)
    traj = store.open("trajectories@latest")
    cfg_features = cfg.features.model_copy(update=ONE_ROW_SHARDS)
    old = run_stage(features.STAGE, cfg_features, {"trajectories": traj}, ctx).dataset
    sums = lambda ds: {s["path"]: s["sha256"] for s in ds.manifest["shards"]}  # noqa: E731
    reference = sums(old)
    old_inode = (old.path / "part-00002.arrow").stat().st_ino

    proc = _opd(store.root, *args, "--force")
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        new = [
            p
            for p in store.root.glob("features/*/part-00002.arrow")
            if p.stat().st_ino != old_inode
        ]
        if new:  # the recompute is past its third shard
            proc.send_signal(signal.SIGKILL)
            break
        time.sleep(0.005)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, "the stage finished before it could be killed"

    after = Store(store.root)
    assert after.resolve("features@latest") == old.ref  # LATEST still names a complete dataset
    kept = after.open("features@latest")
    kept.verify_all(rehash=True)
    assert sums(kept) == reference
    assert [r["complete"] for r in after.listing("features")] == [True]

    again = _opd(store.root, *args, "--force")
    out = again.communicate(timeout=600)[0]
    assert again.returncode == 0, out
    assert "resuming" in out  # from the shards the killed recompute staged
    assert sums(after.open("features@latest")) == reference
    beside = [p.name for p in (store.root / "features").iterdir() if p.name.startswith(".")]
    assert beside == [f".{old.ref.version}.lock"]
    assert after.gc(dry_run=True) == []
