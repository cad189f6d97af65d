"""`opd run --nproc N` and external torchrun launches: one dataset from many ranks.

Every launch is a real one (torch's launcher, gloo on CPU) in subprocesses.
"""

import os
import socket
import subprocess
import sys
from pathlib import Path

import polars as pl
import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open
from safetensors.torch import load_file

from cli.main import cli
from pipeline.core import drafters, training
from pipeline.core.runner import RunContext, planned_ref, run_stage
from pipeline.core.targets import TargetLoader
from pipeline.profiles import load_config
from pipeline.stages import features, generate, rollout, score, sft
from storage import OpdError, Store
from tests.pipeline.conftest import write_prompts

pytestmark = pytest.mark.slow  # minutes: scheduled early by tests/conftest.py

REPO = Path(__file__).resolve().parents[2]


def opd(root: Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "cli.main", "--root", str(root), *args],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO,
        env=os.environ | {"OMP_NUM_THREADS": "1"} | (env or {}),
    )


def sums(store: Store, ref: str) -> dict[str, str]:
    return {s["path"]: s["sha256"] for s in store.open(ref).manifest["shards"]}


def test_n_processes_write_the_same_shards_as_one_and_idle_ranks_finish(tmp_path):
    one, many = Store(tmp_path / "one"), Store(tmp_path / "many")
    for store in (one, many):
        write_prompts(store)
    # generate: 2 shards for 3 ranks (rank 2 has nothing to do); features: 3 shards, 2 ranks
    for stage, name, nproc in (("generate", "trajectories", 3), ("features", "features", 2)):
        args = ["run", stage, "--profile", "tiny", "--no-progress"]
        args += ["--set", "generate.rows_per_shard=6"]
        single = opd(one.root, *args)
        assert single.returncode == 0, single.stderr[-2000:]
        ranked = opd(many.root, *args, "--nproc", str(nproc))
        assert ranked.returncode == 0, ranked.stderr[-3000:]
        assert f"[rank {nproc - 1}/{nproc}]" in ranked.stderr  # every rank ran and logged
        ref = str(one.resolve(f"{name}@latest"))
        assert str(many.resolve(f"{name}@latest")) == ref
        assert sums(many, ref) == sums(one, ref)
        assert len(sums(one, ref)) >= 2
        # committed once: no rank markers or per-shard metas left behind
        assert not [p for p in many.open(ref).path.glob(".*")]


def test_a_failed_rank_is_named_and_a_rerun_resumes_every_rank(tmp_path):
    store = Store(tmp_path / "data")
    prompts = write_prompts(store)
    cfg = load_config("tiny")
    ctx = RunContext(store=store, target_loader=TargetLoader(cfg.target), progress=False)
    ref = planned_ref(generate.STAGE, cfg.generate, {"prompts": prompts}, ctx)
    # rank 1 of 2 writes shard 1 (of 3); a directory in its place makes its write fail
    blocker = store.dataset_dir(ref.name, ref.version) / "part-00001.parquet"
    blocker.mkdir(parents=True)
    args = ["run", "generate", "--profile", "tiny", "--no-progress", "--nproc", "2"]
    failed = opd(store.root, *args)
    assert failed.returncode == 2
    last = failed.stderr.strip().splitlines()[-1]
    assert last.startswith("error: step generate failed on rank 1 of 2: could not write"), last
    assert not store.exists(ref)
    blocker.rmdir()
    done = opd(store.root, *args)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "resuming" in done.stderr  # rank 0's shards 0 and 2 were kept
    single = Store(tmp_path / "single")
    write_prompts(single)
    assert opd(single.root, *args[:-2]).returncode == 0
    assert sums(store, str(ref)) == sums(single, str(ref))


def test_bad_launches_are_one_line_errors_before_work(tmp_path):
    root = tmp_path / "data"
    out = CliRunner().invoke(cli, ["--root", str(root), "run", "generate", "--nproc", "0"])
    assert out.exit_code == 2 and "error: --nproc must be >= 1" in out.output
    out = CliRunner(env={"WORLD_SIZE": "2", "RANK": "0"}).invoke(
        cli, ["--root", str(root), "run", "generate", "--nproc", "2"]
    )
    assert out.exit_code == 2 and "leave --nproc out" in out.output
    assert not root.exists()


def test_ranks_started_with_other_configs_are_refused_before_work(tmp_path):
    store = Store(tmp_path / "data")
    write_prompts(store)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    procs = []
    for rank in range(2):  # what an external launcher (torchrun, a scheduler) sets per rank
        env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "WORLD_SIZE": "2"}
        env |= {"RANK": str(rank), "LOCAL_RANK": str(rank), "OMP_NUM_THREADS": "1"}
        seed = ["--set", "generate.seed=7"] if rank == 1 else []
        cmd = [sys.executable, "-m", "cli.main", "--root", str(store.root), "run", "generate"]
        procs.append(
            subprocess.Popen(
                [*cmd, "--profile", "tiny", "--no-progress", *seed],
                cwd=REPO,
                env=os.environ | env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [2, 2], [o[1][-2000:] for o in outs]
    for rank, (_, err) in enumerate(outs):
        last = err.strip().splitlines()[-1]
        assert last.startswith(f"error: opd run failed on rank {rank} of 2: ranks [1] were")
    assert not (store.root / "trajectories").exists()


def train_metrics(store: Store, name: str = "sft") -> pl.DataFrame:
    ds = store.open(f"{name}@latest")
    return pl.read_parquet(ds.file(drafters.METRICS_FILE)).filter(pl.col("kind") == "train")


def drafter_weights(store: Store) -> dict[str, torch.Tensor]:
    return load_file(store.open("sft@latest").file(drafters.WEIGHTS_FILE))


def weights_sha(store: Store, name: str = "sft") -> str:
    return sums(store, f"{name}@latest")[drafters.WEIGHTS_FILE]


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_two_gloo_ranks_train_the_schedule_and_losses_of_one_process(tiny, mode):
    store, ctx, cfg, prompts = tiny
    traj = run_stage(generate.STAGE, cfg.generate, {"prompts": prompts}, ctx).dataset
    run_stage(features.STAGE, cfg.features, {"trajectories": traj}, ctx)
    args = ["run", "sft", "--profile", "tiny", "--no-progress", "--set", "sft.steps=24"]
    one = opd(store.root, *args)
    assert one.returncode == 0, one.stderr[-2000:]
    single = train_metrics(store)
    sharding = ["--set", "sft.fsdp=true"] if mode == "fsdp" else []
    two = opd(store.root, *args, *sharding, "--nproc", "2", "--force")
    assert two.returncode == 0, two.stderr[-3000:]
    assert ("FSDP: drafter weights" in two.stderr) == (mode == "fsdp")
    ranked = train_metrics(store)
    assert ranked["step"].to_list() == single["step"].to_list() == list(range(1, 25))
    # the same global batches (each step's rows split over the ranks) and lr schedule
    assert ranked["tokens"].to_list() == single["tokens"].to_list()
    assert ranked["lr"].to_list() == pytest.approx(single["lr"].to_list(), rel=1e-12)
    # Tolerance: 0.1 % per step. The rank losses are per-unrolled-step means over each rank's
    # rows, weighted by token share: within 1.7e-4 relative (measured over these 24 steps, step
    # 1 by 1.0e-4; DDP and FSDP alike: FSDP's reduce-scatter sums the same gradients in another
    # order, within 7e-8 of DDP's losses); consecutive steps, on other rows, differ by 1-3 %.
    assert ranked["loss"].to_list() == pytest.approx(single["loss"].to_list(), rel=1e-3)
    # whatever the mode, the output is a plain drafter dataset the normal loader reads
    drafter = drafters.load_drafter_dataset(
        store.open("sft@latest"), ctx.target_loader.target, ctx.target_loader.identity
    )
    assert not any(type(p) is not torch.nn.Parameter for p in drafter.parameters())


def test_fsdp_resumes_exactly_and_is_a_logged_no_op_in_one_process(tiny):
    store, ctx, cfg, prompts = tiny
    traj = run_stage(generate.STAGE, cfg.generate, {"prompts": prompts}, ctx).dataset
    run_stage(features.STAGE, cfg.features, {"trajectories": traj}, ctx)
    args = ["run", "sft", "--profile", "tiny", "--no-progress", "--set", "sft.steps=12"]
    args += ["--set", "sft.fsdp=true", "--set", "sft.checkpoint_every=100"]
    one = opd(store.root, *args)
    assert one.returncode == 0, one.stderr[-2000:]
    assert "fsdp is on but this is one process: training unsharded" in one.stderr
    whole = opd(store.root, *args, "--nproc", "2", "--force")
    assert whole.returncode == 0, whole.stderr[-3000:]
    numbers = ["step", "loss", "lr", "grad_norm", "tokens"]  # not the wall-clock tokens_per_s
    uninterrupted, metrics = weights_sha(store), train_metrics(store).select(numbers)
    stop = ["--set", "sft.stop_after_steps=5"]
    stopped = opd(store.root, *args, *stop, "--nproc", "2", "--force")
    assert stopped.returncode != 0 and "stopped after step 5 of 12" in stopped.stderr
    # the checkpoint holds whole tensors, as without FSDP
    ckpt = training.Checkpointer(store.root / "_work" / "sft" / store.resolve("sft@latest").version)
    assert ckpt.latest() == 5
    with safe_open(str(ckpt.path(5) / "tensors.safetensors"), "pt") as f:
        assert f.get_tensor("model/fc.weight").shape == drafter_weights(store)["fc.weight"].shape
    resumed = opd(store.root, *args, "--nproc", "2", "--force")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming from step 5" in resumed.stderr
    assert weights_sha(store) == uninterrupted  # bit for bit
    assert train_metrics(store).select(numbers).equals(metrics)


def test_a_fan_out_rank_refuses_another_version_and_names_itself_when_it_fails(tiny):
    from pipeline import distributed
    from pipeline.chains import single_step

    store, ctx, cfg, prompts = tiny
    step = single_step("generate", cfg)
    ref = planned_ref(generate.STAGE, cfg.generate, {"prompts": prompts}, ctx)
    kw = dict(root=str(store.root), target=cfg.target, run_name="default", force=False)
    refs = {"prompts": str(prompts.ref)}
    with pytest.raises(OpdError, match="rank 0 of 2: this worker computes .* flow planned"):
        distributed.run_rank(step, refs, **kw, rank=0, world_size=2, expected="trajectories@0")
    assert not (store.root / "trajectories").exists()  # refused before any work
    blocker = store.dataset_dir(ref.name, ref.version) / "part-00001.parquet"
    blocker.mkdir(parents=True)
    with pytest.raises(OpdError, match="step generate failed on rank 1 of 2: could not write"):
        distributed.run_rank(step, refs, **kw, rank=1, world_size=2, expected=str(ref))
    blocker.rmdir()
    assert distributed.run_rank(step, refs, **kw, rank=0, world_size=2, expected=str(ref)) is None
    done = distributed.run_rank(step, refs, **kw, rank=1, world_size=2, expected=str(ref))
    assert done == str(ref) and store.open(done).num_rows == 12  # the last rank committed


def test_sharded_evaluate_gives_the_rows_and_numbers_of_one_process(tiny):
    store, ctx, cfg, prompts = tiny
    traj = run_stage(generate.STAGE, cfg.generate, {"prompts": prompts}, ctx).dataset
    feats = run_stage(features.STAGE, cfg.features, {"trajectories": traj}, ctx).dataset
    run_stage(sft.STAGE, cfg.sft, {"features": feats}, ctx)
    args = ["run", "evaluate", "--profile", "tiny", "--no-progress"]
    timed = ("tokens_per_s", "baseline_tokens_per_s", "speedup", "decode_overhead_share")
    runs = []
    # 4 prompts in batches of 2: one batch per rank; with 3 ranks rank 0 has none
    for nproc in (1, 2, 3):
        launch = ["--nproc", str(nproc), "--force"] if nproc > 1 else []
        done = opd(store.root, *args, *launch)
        assert done.returncode == 0, done.stderr[-3000:]
        ds = store.open("eval@latest")
        assert [s["path"] for s in ds.manifest["shards"]] == ["drafts.parquet", "steps.parquet"]
        assert not (ds.path / "ranks").exists()
        numbers = {k: v for k, v in ds.meta.items() if k not in timed}
        runs.append((sums(store, str(ds.ref)), numbers, ds.meta))
    (one_sums, one, one_meta), *ranked = runs
    assert one["prompts"] == 4 and one["lossless_t0"] is True and one["verify_steps"] > 4
    for shard_sums, numbers, meta in ranked:
        assert shard_sums == one_sums  # the same rows, byte for byte
        # tau, alpha, lossless_t0, the untrained contrast and every count: equal, not close
        assert numbers == one
        assert all(meta[k] > 0 for k in ("tokens_per_s", "baseline_tokens_per_s", "speedup"))


def test_two_gloo_ranks_train_opd_with_the_losses_of_one_process(tiny):
    store, ctx, cfg, prompts = tiny
    traj = run_stage(generate.STAGE, cfg.generate, {"prompts": prompts}, ctx).dataset
    feats = run_stage(features.STAGE, cfg.features, {"trajectories": traj}, ctx).dataset
    drafter = run_stage(sft.STAGE, cfg.sft, {"features": feats}, ctx).dataset
    rolled = run_stage(rollout.STAGE, cfg.rollout, {"prompts": prompts, "drafter": drafter}, ctx)
    replays = run_stage(
        score.STAGE, cfg.score, {"rollouts": rolled.dataset, "drafter": drafter}, ctx
    )
    assert replays.dataset.num_rows > 0  # greedy rollouts: acceptances are exactly 0 or 1
    args = ["run", "opd", "--profile", "tiny", "--no-progress", "--set", "opd.steps=24"]
    one = opd(store.root, *args)
    assert one.returncode == 0, one.stderr[-2000:]
    single = train_metrics(store, "opd")
    two = opd(store.root, *args, "--nproc", "2", "--force")
    assert two.returncode == 0, two.stderr[-3000:]
    ranked = train_metrics(store, "opd")
    assert ranked["step"].to_list() == single["step"].to_list() == list(range(1, 25))
    for same in ("tokens", "row_steps"):  # the same global batches, split over the ranks
        assert ranked[same].to_list() == single[same].to_list()
    assert ranked["lr"].to_list() == pytest.approx(single["lr"].to_list(), rel=1e-12)
    # Tolerance: 2 % per step, and a median under 0.1 %. The replay loss is a mean over each
    # rank's replayed positions, weighted (as its gradient is) by the rank's share of the
    # step's tokens: where the two shares differ most a step's loss differs by up to 0.92 %
    # (measured over these 24 steps; the median step by 3.8e-4, step 1 by 2.2e-4). The steps
    # after such a step are back within 1e-3, so the weights do not drift apart; consecutive
    # steps, on other batches, differ by 2-5 %.
    rel = ((ranked["loss"] - single["loss"]) / single["loss"]).abs()
    assert rel.max() < 2e-2 and rel.median() < 1e-3, rel.to_list()
