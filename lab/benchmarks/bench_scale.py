"""Scaling out on this machine: 1 vs 2 processes, and what a Dask fan-out task costs.

1. generate + features (tiny profile, more prompts and small shards so there is work to
   split) as `opd run STAGE` in one process and as `opd run STAGE --nproc 2` (torchrun, gloo),
   each from a fresh data root; the wall time of the commands, start-up included.
2. The Prefect fan-out on a local Dask cluster of 2 worker processes (started once, kept warm):
   the prompts -> generate -> features chain run by the fan-out flow, then re-run with every
   dataset committed, so each sharded step is 2 rank tasks that find their dataset and return.
   The same re-run as in-process Prefect tasks gives the baseline; the difference per rank task
   is the fan-out's per-task overhead (scheduling, shipping config and refs, opening the store).

Prints JSON with both measurements and their ratios; both run side by side in one invocation.

    python -m lab.benchmarks.bench_scale [--prompts 48] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from distributed import LocalCluster

from flows.pipeline import dask_runner, fan_out_flow, run_steps_flow
from pipeline.chains import sft_chain
from pipeline.core.runner import RunContext
from pipeline.core.targets import TargetLoader
from pipeline.profiles import load_config
from storage import Store

REPO = Path(__file__).resolve().parents[2]


def _opd(root: Path, *args: str) -> float:
    t0 = time.perf_counter()
    cmd = [sys.executable, "-m", "cli.main", "--root", str(root), *args, "--no-progress"]
    subprocess.run(cmd, check=True, cwd=REPO, capture_output=True)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    sets = [
        f"prompts.max_train_rows={args.prompts}",
        f"generate.max_prompts={args.prompts}",
        "generate.max_new_tokens=24",
        "generate.rows_per_shard=8",
        "features.rows_per_shard=8",
    ]
    profile = ["--profile", "tiny", *(a for s in sets for a in ("--set", s))]
    out: dict = {"prompts": args.prompts, "cpus": os.cpu_count()}
    with tempfile.TemporaryDirectory() as tmp:
        seconds = {}
        for nproc in (1, 2):
            root = Path(tmp) / f"n{nproc}"
            _opd(root, "run", "prompts", *profile)
            launch = ["--nproc", str(nproc)] if nproc > 1 else []
            seconds[nproc] = sum(
                _opd(root, "run", stage, *profile, *launch) for stage in ("generate", "features")
            )
        out["generate_features_s"] = {"1_process": seconds[1], "2_processes": seconds[2]}
        out["speedup_2_over_1"] = seconds[1] / seconds[2]

        cfg = load_config("tiny", None, sets)
        steps = sft_chain(cfg)[:3]  # prompts, generate, features
        store = Store(Path(tmp) / "dask")
        ctx = RunContext(store=store, target_loader=TargetLoader(cfg.target), progress=False)
        with LocalCluster(n_workers=2, threads_per_worker=1, processes=True) as cluster:
            runner, ranks = dask_runner(None, cluster.scheduler_address)
            chain = fan_out_flow.with_options(task_runner=runner)
            t0 = time.perf_counter()
            chain(steps, ctx, set(), ranks, [])
            out["dask_first_run_s"] = time.perf_counter() - t0
            cached_dask, cached_local = [], []
            for _ in range(args.repeats):  # alternated, so load changes hit both alike
                t0 = time.perf_counter()
                chain(steps, ctx, set(), ranks, [])
                cached_dask.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                run_steps_flow(steps, ctx, {}, set())
                cached_local.append(time.perf_counter() - t0)
        rank_tasks = ranks * sum(s.stage.sharded for s in steps)
        dask_s, local_s = min(cached_dask), min(cached_local)
        out["cached_chain_s"] = {"dask_fan_out": dask_s, "in_process": local_s}
        out["rank_tasks_per_run"] = rank_tasks
        out["fan_out_overhead_per_task_s"] = (dask_s - local_s) / rank_tasks
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
