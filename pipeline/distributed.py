"""Many processes, one run: every stage under torchrun, and one rank's share of a stage.

`opd run STAGE|CHAIN --nproc N` starts N copies of the same command through torch's own
launcher (`torch.distributed.run`); an external `torchrun --nnodes ... --nproc-per-node ...`
starts them the same way. Each process reads RANK / WORLD_SIZE / LOCAL_RANK, joins the process
group (NCCL on CUDA, gloo on CPU), takes the GPU of its LOCAL_RANK and runs the chain with every
other rank, step by step:

- sharded stages (generate, features, rollout, score, evaluate): rank r writes shards r, r + N,
  ... (evaluate: its share of the prompts); the last rank to finish commits the one dataset
  version;
- training stages (sft, opd): every rank trains (DDP, or FSDP with `fsdp`), rank 0 writes and
  commits;
- the others (prompts, analyze): rank 0 runs them.

After each step the ranks meet at a barrier, so the next step reads a committed dataset. The
Prefect flow reuses `run_rank` for its fan-out: one task per rank, each in its own process.
"""

from __future__ import annotations

import datetime
import functools
import hashlib
import json
import logging
import os
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from pipeline.chains import Step, run_chain
from pipeline.core.runner import RunContext, StageResult, planned_ref, run_stage
from pipeline.core.targets import TargetConfig, TargetLoader
from storage import Dataset, OpdError, Store

log = logging.getLogger("opd")


BARRIER_TIMEOUT = datetime.timedelta(hours=6)
"""How long a rank waits at a collective. Ranks wait at a barrier while rank 0 alone runs
prompts or analyze, or while the slowest rank finishes its shards: the 10-30 min defaults of
NCCL/gloo would kill healthy long stages. A crashed rank does not leave the others waiting
this long: torchrun stops them all."""


@dataclass(frozen=True)
class Ranks:
    rank: int
    world_size: int
    local_rank: int


def env_ranks() -> Ranks | None:
    """This process's place in a torchrun launch (RANK / WORLD_SIZE / LOCAL_RANK); None outside one."""
    if "WORLD_SIZE" not in os.environ:
        return None
    try:
        rank, world = int(os.environ.get("RANK", "0")), int(os.environ["WORLD_SIZE"])
        local = int(os.environ.get("LOCAL_RANK", str(rank)))
    except ValueError:
        raise OpdError(
            "RANK / WORLD_SIZE / LOCAL_RANK must be integers (torchrun sets them): unset them "
            "or launch with torchrun"
        ) from None
    if not 0 <= rank < world:
        raise OpdError(f"RANK={rank} is not in [0, WORLD_SIZE={world}): launch with torchrun")
    return Ranks(rank, world, local)


def init(ranks: Ranks) -> str:
    """Join the process group torchrun set up (MASTER_ADDR/PORT in the environment); returns the
    backend. The rank's GPU becomes the current device, so `cuda` and `auto` devices mean it."""
    if torch.cuda.is_available():
        gpus = torch.cuda.device_count()
        if ranks.local_rank >= gpus:  # NCCL refuses two ranks on one GPU, and says it obscurely
            raise OpdError(
                f"LOCAL_RANK {ranks.local_rank} but this node has {gpus} GPU(s): start at most "
                f"{gpus} processes per node (--nproc / torchrun --nproc-per-node)"
            )
        torch.cuda.set_device(ranks.local_rank)
        backend = "nccl"
    else:
        backend = "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=BARRIER_TIMEOUT)
    return backend


def finish() -> None:
    """Leave the process group, if this process joined one (also after a failure)."""
    if dist.is_initialized():
        dist.destroy_process_group()


def check_same_config(fingerprint: str) -> None:
    """Refuse, on every rank and before any work, a launch whose ranks were given other configs:
    they would compute other versions and wait for each other forever."""
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, fingerprint)
    differ = [r for r, f in enumerate(gathered) if f != gathered[0]]
    if differ:
        raise OpdError(
            f"ranks {differ} were started with another config than rank 0 (profile, --set, "
            "--config, --input or code differ): start every rank with the same command"
        )


def fingerprint(*parts: Any) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


def _step_ranks(step: Step, ranks: Ranks) -> tuple[int, int] | None:
    """(rank, world_size) this process runs `step` as; None when another rank runs it alone."""
    if step.stage.sharded or step.stage.ddp:
        return ranks.rank, ranks.world_size
    return (0, 1) if ranks.rank == 0 else None


def run_steps(
    steps: list[Step],
    ctx: RunContext,
    ranks: Ranks,
    *,
    external: dict[str, Dataset],
    force: set[str],
) -> dict[str, StageResult]:
    """This rank's part of `steps` (inside an initialised process group); every rank returns
    every step's committed dataset."""

    def execute(step: Step, inputs: dict[str, Dataset]) -> StageResult:
        t0 = time.perf_counter()
        res = None
        as_ranks = _step_ranks(step, ranks)
        try:
            if as_ranks is not None:
                rank, world = as_ranks
                res = run_stage(
                    step.stage, step.cfg, inputs, ctx, force=step.key in force, rank=rank,
                    world_size=world,
                )  # fmt: skip
        except Exception as e:
            raise failed(f"step {step.key}", ranks.rank, ranks.world_size, e) from e
        dist.barrier()  # the last rank has committed: every rank may read the dataset now
        if res is not None and res.dataset is not None:
            return res
        ref = planned_ref(step.stage, step.cfg, inputs, ctx)
        return StageResult(ctx.store.open(ref), False, time.perf_counter() - t0)

    return run_chain(steps, ctx, external=external, execute=execute)


class RankFailed(OpdError):
    """One rank's failure, naming the rank (and the step, where one was running)."""


def failed(where: str, rank: int, world_size: int, e: BaseException) -> RankFailed:
    """The one-line error of a rank's failure; under torchrun it is also what the launcher
    reports (torchelastic's error file), so the parent names the rank and the cause."""
    if isinstance(e, RankFailed):
        return e
    err = RankFailed(f"{where} failed on rank {rank} of {world_size}: {e}")
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path:
        with open(path, "w") as f:
            json.dump({"message": str(err), "timestamp": int(time.time())}, f)
    return err


def launch(nproc: int, argv: list[str]) -> None:
    """Run `opd <argv>` as `nproc` local processes through torch's launcher; waits for all.

    A failing rank stops the others (torchrun's policy) and becomes one error naming it."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    # --standalone: a rendezvous on a free local port, so launches side by side do not collide.
    args = get_args_parser().parse_args(
        ["--standalone", f"--nproc-per-node={nproc}", "--module", "cli.main", *argv]
    )
    # Threads per rank: torchrun's default of 1 when unset, the user's value otherwise.
    try:
        run(args)
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        message = failure.message if isinstance(failure.message, str) else ""
        if f"failed on rank {rank} of" not in message:  # killed, or died outside our code
            message = f"rank {rank} of {nproc} exited with code {failure.exitcode} ({message})"
        raise OpdError(message) from None


@functools.cache
def _loader(target_json: str) -> TargetLoader:
    """One loader per target config and process: a worker loads its target once, however many
    rank tasks it runs."""
    return TargetLoader(TargetConfig.model_validate_json(target_json))


def run_rank(
    step: Step,
    input_refs: dict[str, str],
    *,
    root: str,
    target: TargetConfig,
    run_name: str,
    force: bool,
    rank: int,
    world_size: int,
    expected: str,
) -> str | None:
    """Rank `rank` of `world_size` of one sharded step, in any process (a Prefect task on a Dask
    worker); the ref it committed when it finished last, else None.

    Takes refs and the target's config, never datasets or models, and refuses to work when
    this process computes another version than `expected` (other code or another target)."""
    store = Store(root)
    ctx = RunContext(store=store, target_loader=_loader(target.model_dump_json()), progress=False)
    ctx.run_name = run_name
    inputs = {role: store.open(ref) for role, ref in input_refs.items()}
    try:
        mine = str(planned_ref(step.stage, step.cfg, inputs, ctx))
        if mine != expected:
            raise OpdError(
                f"this worker computes {mine} where the flow planned {expected}: every worker "
                f"must run the same code and target as the flow ({sys.executable})"
            )
        res = run_stage(
            step.stage, step.cfg, inputs, ctx, force=force, rank=rank, world_size=world_size
        )
    except Exception as e:
        raise failed(f"step {step.key}", rank, world_size, e) from e
    return str(res.ref) if res.dataset is not None else None
