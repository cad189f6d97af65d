"""`features.mode=online`: sft and opd compute the target's hidden states inside their training
loop from a features dataset that holds only tokens and the vocab map, and the rollouts of such
a run hold tokens only too (score and opd compute their states); the same numbers as the cache
where the forward's padded width is the same, and an exact resume after a kill."""

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

from pipeline.core import drafters, featurize
from pipeline.core.checks import VOCAB_FILE
from pipeline.core.config import version_dict
from pipeline.core.featurize import is_online, token_schema
from pipeline.core.runner import RunContext, run_stage
from pipeline.core.targets import TargetLoader
from pipeline.core.trainer import TrainingStopped
from pipeline.profiles import load_config
from pipeline.stages import features, generate, opd, rollout, score, sft
from storage import DatasetNotFound, OpdError, Store, read_tensor_column
from tests.pipeline.conftest import write_prompts

REPO = Path(__file__).resolve().parents[3]
# One sequence per forward in both modes, so the cached and the online forward run at the same
# padded width and the two modes train on the same bytes (across widths the target's fp32
# attention sums round differently, and a bf16 rounding can flip: see FeatureSource).
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
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        # one thread, as this process (tests/conftest.py): bytes are compared across the two
        "OMP_NUM_THREADS": "1",
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


# -- online rollouts: rollout -> score -> opd with no hidden state on disk --------------------


def shard_sums(ds, prefix: str) -> dict[str, str]:
    return {s["path"]: s["sha256"] for s in ds.manifest["shards"] if s["path"].startswith(prefix)}


def feature_bytes(ds) -> int:
    return sum(s["bytes"] for s in ds.manifest["shards"] if s["path"].startswith("features-"))


def opd_round(ctx, cfg, drafter, *, rollout_update=None, opd_update=None) -> dict:
    """rollout -> score -> opd from `drafter` on the tiny profile, as the `full` chain wires it."""
    prompts = ctx.store.open("prompts@latest")
    r_cfg = cfg.rollout.model_copy(update=rollout_update or {})
    rolled = run_stage(rollout.STAGE, r_cfg, {"prompts": prompts, "drafter": drafter}, ctx).dataset
    scored = run_stage(score.STAGE, cfg.score, {"rollouts": rolled, "drafter": drafter}, ctx)
    given = {"replays": scored.dataset, "rollouts": rolled, "drafter": drafter}
    o_cfg = cfg.opd.model_copy(update=opd_update or {})
    return {
        "rollouts": rolled,
        "replays": scored.dataset,
        "opd": run_stage(opd.STAGE, o_cfg, given, ctx).dataset,
    }


@pytest.fixture(scope="module")
def chains(both):
    """The tiny chain from each features dataset, one sequence per target forward throughout
    (features, sft, rollout, opd), so both modes run the target at the same padded widths:
    {"cached" | "online": {"sft", "rollouts", "replays", "opd"}}."""
    store, ctx, cfg, traj, cached, online = both
    sft_cfg = cfg.sft.model_copy(update=ONE | {"steps": 4, "val_every": 4})
    out = {}
    for mode, feats in (("cached", cached), ("online", online)):
        drafter = run_stage(sft.STAGE, sft_cfg, {"features": feats}, ctx).dataset
        out[mode] = {"sft": drafter} | opd_round(
            ctx, cfg, drafter, rollout_update=ONE, opd_update=ONE
        )
    return out


def test_online_run_rolls_out_tokens_only_with_the_cached_sequences_and_log(both, chains):
    store, ctx, cfg, traj, cached, online = both
    ca, on = chains["cached"]["rollouts"], chains["online"]["rollouts"]
    # features.mode reaches the rollout through its drafter's data; no setting enters a version
    assert is_online(on) and not is_online(ca)
    assert on.meta["mode"] == "online" and on.meta["feature_batch_size"] == 1
    assert "mode" not in ca.meta and "features" not in ca.config["stage"]
    assert "features" not in on.config["stage"]
    assert "features" not in version_dict(rollout.Config())
    feats = sorted(s for s in on.shards("ipc") if s.startswith("features-"))
    assert feats == sorted(s for s in ca.shards("ipc") if s.startswith("features-"))
    tokens = token_schema().names
    for shard in feats:
        got = on.read_ipc(shard)
        assert got.schema.names == tokens  # no aux_hidden, no last_hidden
        assert got.to_pylist() == ca.read_ipc(shard).select(tokens).to_pylist()
    assert feature_bytes(on) * 10 < feature_bytes(ca)
    # the same drafter bytes decode the same sequences and log the same drafts
    assert shard_sums(on, "sequences-") == shard_sums(ca, "sequences-")
    assert shard_sums(on, "steps-") == shard_sums(ca, "steps-")
    log = lambda ds: pl.read_parquet(ds.path / "rejections-*.parquet").drop("drafter")  # noqa: E731
    assert log(on).equals(log(ca))
    assert on.meta["tau"] == ca.meta["tau"] and on.meta["alpha"] == ca.meta["alpha"]


def test_online_chain_scores_and_trains_the_cached_chains_bytes(chains):
    """score computes each replayed sequence's states in the rollout's batches and opd in its
    training batches: at one sequence a forward, the replays and the opd drafter are the
    cached chain's byte for byte."""
    ca, on = chains["cached"], chains["online"]
    assert sha(on["sft"].file(drafters.WEIGHTS_FILE)) == sha(ca["sft"].file(drafters.WEIGHTS_FILE))
    assert on["replays"].meta["replays"] > 0
    assert shard_sums(on["replays"], "replays-") == shard_sums(ca["replays"], "replays-")
    forwards = on["replays"].meta["online_features"]
    assert forwards["rollouts"] == str(on["rollouts"].ref)
    assert 0 < forwards["target_forwards_this_run"] <= on["rollouts"].meta["sequences"]
    assert "online_features" not in ca["replays"].meta
    assert on["opd"].ref != ca["opd"].ref
    assert sha(on["opd"].file(drafters.WEIGHTS_FILE)) == sha(ca["opd"].file(drafters.WEIGHTS_FILE))
    assert losses(on["opd"]) == losses(ca["opd"])
    assert losses(on["opd"], "val") == losses(ca["opd"], "val")
    info = on["opd"].meta["online_features"]
    assert info["features"] == [str(on["rollouts"].ref)]
    assert info["trajectories"] == [str(on["rollouts"].ref)]  # rollouts are their own sequences
    assert info["target_forwards_this_run"] >= on["opd"].meta["steps"]  # one a training batch
    assert "online_features" not in ca["opd"].meta


def test_the_next_rounds_rollout_of_an_online_opd_drafter_is_online(both, chains):
    store, ctx, cfg, traj, cached, online = both
    prompts = store.open("prompts@latest")
    for mode in ("cached", "online"):
        r2 = cfg.rollout.model_copy(update={"round": 2, "max_prompts": 3})
        given = {"prompts": prompts, "drafter": chains[mode]["opd"]}
        assert is_online(run_stage(rollout.STAGE, r2, given, ctx).dataset) == (mode == "online")


def test_rollout_features_setting_overrides_the_drafters_lineage(both, chains):
    store, ctx, cfg, traj, cached, online = both
    prompts = store.open("prompts@latest")
    few = {"max_prompts": 3}
    for mode, setting, want in (("online", "cached", False), ("cached", "online", True)):
        r_cfg = rollout.Config.model_validate(
            cfg.rollout.model_dump() | few | {"features": setting}
        )
        given = {"prompts": prompts, "drafter": chains[mode]["sft"]}
        ds = run_stage(rollout.STAGE, r_cfg, given, ctx).dataset
        assert is_online(ds) == want and ds.config["stage"]["features"] == setting
        names = ds.read_ipc("features-00000.arrow").schema.names
        assert ("aux_hidden" in names) == (not want)


def test_online_score_at_the_tiny_profiles_batching_replays_the_cached_bytes(both, chains):
    """Rollout batches of 4: score featurizes each sequence in the batch the cached rollout ran
    it in, so the replays are still identical; opd's batches of 4 run the target at its own
    padded widths, so its losses match the cached chain's to within bf16 rounding."""
    store, ctx, cfg, traj, cached, online = both
    assert cfg.rollout.batch_size == 4 and cfg.opd.batch_size == 4
    ca = opd_round(ctx, cfg, chains["cached"]["sft"])
    on = opd_round(ctx, cfg, chains["online"]["sft"])
    assert is_online(on["rollouts"]) and on["rollouts"].meta["feature_batch_size"] == 4
    assert ca["replays"].meta["replays"] > 0
    assert shard_sums(on["replays"], "replays-") == shard_sums(ca["replays"], "replays-")
    assert losses(on["opd"]) == pytest.approx(losses(ca["opd"]), rel=1e-3)
    assert losses(on["opd"], "val") == pytest.approx(losses(ca["opd"], "val"), rel=1e-3)


def test_online_score_interrupted_after_a_shard_resumes_to_the_same_bytes(
    both, chains, monkeypatch
):
    store, ctx, cfg, traj, cached, online = both
    rolled, drafter = chains["online"]["rollouts"], chains["online"]["sft"]
    assert is_online(rolled) and len([s for s in rolled.shards() if "features-" in s]) == 2
    s_cfg = cfg.score.model_copy(update={"seed": 7, "accepted_share": 0.5})
    given = {"rollouts": rolled, "drafter": drafter}
    real = score.score_shard

    def dies_on_the_second(target, drafter, rollouts, i, cfg, on_sequences=None):
        if i == 1:
            raise RuntimeError("killed")
        return real(target, drafter, rollouts, i, cfg, on_sequences)

    monkeypatch.setattr(score, "score_shard", dies_on_the_second)
    with pytest.raises(RuntimeError, match="killed"):
        run_stage(score.STAGE, s_cfg, given, ctx)
    monkeypatch.setattr(score, "score_shard", real)
    resumed = run_stage(score.STAGE, s_cfg, given, ctx).dataset
    fresh = run_stage(score.STAGE, s_cfg, given, ctx, force=True).dataset
    assert resumed.ref == fresh.ref
    assert shard_sums(resumed, "replays-") == shard_sums(fresh, "replays-")
    assert len(shard_sums(fresh, "replays-")) == 2
    # the resumed run featurized only the second shard's sequences
    part = resumed.meta["online_features"]["target_forwards_this_run"]
    assert 0 < part < fresh.meta["online_features"]["target_forwards_this_run"]
    # and the teachers it wrote are the target's, not zeros
    table = fresh.read_ipc("replays-00001.arrow")
    teacher, _ = read_tensor_column(
        table.column("teacher_hidden"), table.schema.field("teacher_hidden")
    )
    assert teacher.float().abs().sum() > 0


def test_online_opd_on_online_rollouts_resumes_bit_for_bit(chains, both, caplog):
    store, ctx, cfg, traj, cached, online = both
    on = chains["online"]
    assert is_online(on["rollouts"])
    given = {"replays": on["replays"], "rollouts": on["rollouts"], "drafter": on["sft"]}
    opd_cfg = cfg.opd.model_copy(update={"steps": 6, "seed": 3, "bf16": True})
    whole = run_stage(opd.STAGE, opd_cfg, given, ctx).dataset
    weights, trained, validated = (
        sha(whole.file(drafters.WEIGHTS_FILE)),
        losses(whole),
        losses(whole, "val"),
    )
    stop = opd_cfg.model_copy(update={"stop_after_steps": 3, "checkpoint_every": 2})
    with pytest.raises(TrainingStopped, match="after step 3"):
        run_stage(opd.STAGE, stop, given, ctx, force=True)
    with caplog.at_level("INFO", logger="opd"):
        resumed = run_stage(opd.STAGE, opd_cfg, given, ctx, force=True).dataset
    assert "resuming from step 3" in caplog.text
    assert resumed.ref == whole.ref
    assert sha(resumed.file(drafters.WEIGHTS_FILE)) == weights
    assert losses(resumed) == trained and losses(resumed, "val") == validated
    assert resumed.meta["online_features"]["features"] == [str(on["rollouts"].ref)]


def test_a_drafter_whose_training_data_is_gone_asks_for_the_rollout_setting(chains, monkeypatch):
    drafter = chains["online"]["sft"]
    assert featurize.trained_online(drafter) and not featurize.trained_online(
        chains["cached"]["opd"]
    )

    def gone(self, ref):
        raise DatasetNotFound(f"dataset {ref} does not exist")

    monkeypatch.setattr(Store, "open", gone)
    with pytest.raises(OpdError, match="set rollout.features=online or rollout.features=cached"):
        featurize.trained_online(drafter)
