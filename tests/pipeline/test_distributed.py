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
from click.testing import CliRunner

from cli.main import cli
from pipeline import drafters, features, generate
from pipeline.profiles import load_config
from pipeline.runner import RunContext, planned_ref, run_stage
from pipeline.targets import TargetLoader
from storage import OpdError, Store
from tests.pipeline.conftest import write_prompts

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


def train_metrics(store: Store) -> pl.DataFrame:
    ds = store.open("sft@latest")
    return pl.read_parquet(ds.file(drafters.METRICS_FILE)).filter(pl.col("kind") == "train")


def test_two_gloo_ranks_train_the_schedule_and_losses_of_one_process(tiny):
    store, ctx, cfg, prompts = tiny
    traj = run_stage(generate.STAGE, cfg.generate, {"prompts": prompts}, ctx).dataset
    run_stage(features.STAGE, cfg.features, {"trajectories": traj}, ctx)
    args = ["run", "sft", "--profile", "tiny", "--no-progress", "--set", "sft.steps=24"]
    one = opd(store.root, *args)
    assert one.returncode == 0, one.stderr[-2000:]
    single = train_metrics(store)
    two = opd(store.root, *args, "--nproc", "2", "--force")
    assert two.returncode == 0, two.stderr[-3000:]
    ranked = train_metrics(store)
    assert ranked["step"].to_list() == single["step"].to_list() == list(range(1, 25))
    # the same global batches (each step's rows split over the ranks) and lr schedule
    assert ranked["tokens"].to_list() == single["tokens"].to_list()
    assert ranked["lr"].to_list() == pytest.approx(single["lr"].to_list(), rel=1e-12)
    # Tolerance: 0.1 % per step. The rank losses are per-unrolled-step means over each rank's
    # rows, weighted by token share: exact for step 0, within ~2e-4 relative for later steps
    # (measured over these 24 steps); consecutive steps, on other rows, differ by 1-3 %.
    assert ranked["loss"].to_list() == pytest.approx(single["loss"].to_list(), rel=1e-3)


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
