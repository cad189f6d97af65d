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
from pipeline.stages import evaluate, features, generate, rollout, score, sft
from pipeline.stages import opd as opd_stage
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


def test_n_processes_write_the_same_shards_as_one_a_failed_rank_is_named_and_resumed(tmp_path):
    one, many = Store(tmp_path / "one"), Store(tmp_path / "many")
    # generate: 2 shards for 3 ranks (rank 2 has nothing to do); features: 3 shards, 2 ranks
    sets = ["generate.rows_per_shard=6"]
    cfg = load_config("tiny", None, sets)
    loader = TargetLoader(cfg.target)
    # one process: this one, with the settings the launched ranks get (one thread each)
    ctx = RunContext(store=one, target_loader=loader, progress=False)
    traj = run_stage(generate.STAGE, cfg.generate, {"prompts": write_prompts(one)}, ctx).dataset
    run_stage(features.STAGE, cfg.features, {"trajectories": traj}, ctx)
    prompts = write_prompts(many)
    ctx = RunContext(store=many, target_loader=loader, progress=False)
    planned = planned_ref(generate.STAGE, cfg.generate, {"prompts": prompts}, ctx)
    # rank 1 of 3 writes shard 1 (of 2); a directory in its place makes its write fail
    blocker = many.dataset_dir(planned.name, planned.version) / "part-00001.parquet"
    blocker.mkdir(parents=True)
    for stage, name, nproc in (("generate", "trajectories", 3), ("features", "features", 2)):
        args = ["run", stage, "--profile", "tiny", "--no-progress"]
        args += [a for s in sets for a in ("--set", s)]
        ranked = opd(many.root, *args, "--nproc", str(nproc))
        if stage == "generate":
            assert ranked.returncode == 2
            last = ranked.stderr.strip().splitlines()[-1]
            assert last.startswith("error: step generate failed on rank 1 of 3: could not write")
            assert not many.exists(planned)
            # Rank 0's shard is kept if it was written before the launcher stopped the ranks;
            # on a loaded machine rank 1 can fail first, and then there is nothing to resume.
            kept = (blocker.parent / "part-00000.parquet").exists()
            blocker.rmdir()
            ranked = opd(many.root, *args, "--nproc", str(nproc))
            if kept:
                assert "resuming" in ranked.stderr  # what the failed launch wrote was kept
        assert ranked.returncode == 0, ranked.stderr[-3000:]
        assert f"[rank {nproc - 1}/{nproc}]" in ranked.stderr  # every rank ran and logged
        ref = str(one.resolve(f"{name}@latest"))
        assert str(many.resolve(f"{name}@latest")) == ref
        assert sums(many, ref) == sums(one, ref)
        assert len(sums(one, ref)) >= 2
        # committed once: no rank markers or per-shard metas left behind
        assert not [p for p in many.open(ref).path.glob(".*")]
    assert str(planned) == str(many.resolve("trajectories@latest"))


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


SFT_ARGS = ["run", "sft", "--profile", "tiny", "--no-progress", "--set", "sft.steps=24"]
# fsdp on in every run: one process logs it and trains unsharded (the reference), two shard;
# no periodic checkpoints, so the one a stopped run writes is the one it resumes from.
SFT_ARGS += ["--set", "sft.fsdp=true", "--set", "sft.checkpoint_every=100"]


@pytest.fixture(scope="module")
def one_process_sft(tmp_path_factory):
    """(store, ctx, the one-process run's stderr and train metrics) on the tiny features; the
    tests below launch ranks on the same store with --force and compare against it."""
    store = Store(tmp_path_factory.mktemp("sft") / "data")
    cfg = load_config("tiny")
    ctx = RunContext(store=store, target_loader=TargetLoader(cfg.target), progress=False)
    prompts = write_prompts(store)
    traj = run_stage(generate.STAGE, cfg.generate, {"prompts": prompts}, ctx).dataset
    run_stage(features.STAGE, cfg.features, {"trajectories": traj}, ctx)
    one = opd(store.root, *SFT_ARGS)
    assert one.returncode == 0, one.stderr[-2000:]
    return store, ctx, one.stderr, train_metrics(store)


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_two_gloo_ranks_train_the_schedule_and_losses_of_one_process(one_process_sft, mode):
    store, ctx, _, single = one_process_sft
    sharding = [] if mode == "fsdp" else ["--set", "sft.fsdp=false"]
    two = opd(store.root, *SFT_ARGS, *sharding, "--nproc", "2", "--force")
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


def test_fsdp_resumes_exactly_and_is_a_logged_no_op_in_one_process(one_process_sft):
    store, _, one_stderr, _ = one_process_sft
    assert "fsdp is on but this is one process: training unsharded" in one_stderr
    whole = opd(store.root, *SFT_ARGS, "--nproc", "2", "--force")
    assert whole.returncode == 0, whole.stderr[-3000:]
    numbers = ["step", "loss", "lr", "grad_norm", "tokens"]  # not the wall-clock tokens_per_s
    uninterrupted, metrics = weights_sha(store), train_metrics(store).select(numbers)
    stop = ["--set", "sft.stop_after_steps=5"]
    stopped = opd(store.root, *SFT_ARGS, *stop, "--nproc", "2", "--force")
    assert stopped.returncode != 0 and "stopped after step 5 of 24" in stopped.stderr
    # the checkpoint holds whole tensors, as without FSDP
    ckpt = training.Checkpointer(store.root / "_work" / "sft" / store.resolve("sft@latest").version)
    assert ckpt.latest() == 5
    with safe_open(str(ckpt.path(5) / "tensors.safetensors"), "pt") as f:
        assert f.get_tensor("model/fc.weight").shape == drafter_weights(store)["fc.weight"].shape
    resumed = opd(store.root, *SFT_ARGS, "--nproc", "2", "--force")
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
    drafter = run_stage(sft.STAGE, cfg.sft, {"features": feats}, ctx).dataset
    timed = (
        "tokens_per_s",
        "baseline_tokens_per_s",
        "plain_tokens_per_s",
        "speedup",
        "decode_overhead_share",
    )

    def written() -> tuple[dict[str, str], dict, dict]:
        ds = store.open("eval@latest")
        assert [s["path"] for s in ds.manifest["shards"]] == ["drafts.parquet", "steps.parquet"]
        assert not (ds.path / "ranks").exists()
        numbers = {k: v for k, v in ds.meta.items() if k not in timed}
        free = numbers.pop("free_baseline")  # the n-gram lookup beside it: counts, then times
        numbers["free_baseline"] = {k: v for k, v in free.items() if k not in timed}
        return sums(store, str(ds.ref)), numbers, ds.meta

    run_stage(evaluate.STAGE, cfg.evaluate, {"prompts": prompts, "drafter": drafter}, ctx)
    one_sums, one, _ = written()  # one process: this one
    # 3 ranks, 4 prompts in batches of 2: one batch for each of ranks 1 and 2, none for rank 0
    args = ["run", "evaluate", "--profile", "tiny", "--no-progress", "--nproc", "3", "--force"]
    done = opd(store.root, *args)
    assert done.returncode == 0, done.stderr[-3000:]
    ranked_sums, ranked, ranked_meta = written()
    assert one["prompts"] == 4 and one["lossless_t0"] is True and one["verify_steps"] > 4
    assert ranked_sums == one_sums  # the same rows, byte for byte
    # tau, alpha, lossless_t0, the untrained contrast and every count: equal, not close
    assert ranked == one
    assert all(ranked_meta[k] > 0 for k in ("tokens_per_s", "baseline_tokens_per_s", "speedup"))


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
    inputs = {"replays": replays.dataset, "rollouts": rolled.dataset, "drafter": drafter}
    run_stage(opd_stage.STAGE, cfg.opd.model_copy(update={"steps": 24}), inputs, ctx)
    single = train_metrics(store, "opd")  # one process: this one
    args = ["run", "opd", "--profile", "tiny", "--no-progress", "--set", "opd.steps=24"]
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
