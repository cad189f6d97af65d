"""One uninterrupted tiny chain (prompts .. opd-r1) that every fault test compares against."""

import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest

from pipeline.chains import CHAINS, run_chain
from pipeline.core.runner import RunContext, StageResult, run_stage
from pipeline.core.targets import TargetLoader
from pipeline.profiles import load_config
from storage import Dataset, Store
from tests.faults.inject import instrument

STAGES = ("generate", "features", "sft", "rollout-r1", "score-r1", "opd-r1")
# Checkpoints during the short tiny trainings, so kills can land between and inside them.
SETS = ("rounds=1", "sft.checkpoint_every=2", "opd.checkpoint_every=1")
# Timings of the run, not its results: every other shard must match to the byte.
TIMING_SHARDS = {"metrics.parquet", "summary.json"}


def sums(ds: Dataset) -> dict[str, str]:
    return {s["path"]: s["sha256"] for s in ds.manifest["shards"] if s["path"] not in TIMING_SHARDS}


def opd_args(root: Path, stage: str) -> list[str]:
    sets = [a for s in SETS for a in ("--set", s)]
    return ["--root", str(root), "run", stage, "--profile", "tiny", "--no-progress", *sets]


@dataclass
class Reference:
    root: Path
    results: dict[str, StageResult]
    writes: dict[str, list[str]]  # stage -> its durable writes, in order

    def copy_without(self, stage: str, dest: Path) -> Path:
        """The reference root as it was before `stage` ran (later datasets do not matter)."""
        shutil.copytree(self.root, dest)
        ref = self.results[stage].ref
        shutil.rmtree(dest / ref.name / ref.version)
        (dest / ref.name / "LATEST").unlink()
        for scratch in ("_work", "_cache", "_runs"):
            shutil.rmtree(dest / scratch, ignore_errors=True)
        return dest


@pytest.fixture(scope="session")
def reference(tmp_path_factory) -> Reference:
    root = tmp_path_factory.mktemp("reference")
    cfg = load_config("tiny", None, list(SETS))
    ctx = RunContext(store=Store(root), target_loader=TargetLoader(cfg.target), progress=False)
    steps = [s for s in CHAINS["full"](cfg) if s.key in ("prompts", *STAGES)]
    writes: dict[str, list[str]] = {}
    log: list[str] = []

    def execute(step, inputs):
        log.clear()
        result = run_stage(step.stage, step.cfg, inputs, ctx)
        writes[step.key] = list(log)
        return result

    with pytest.MonkeyPatch.context() as mp:
        instrument(mp, lambda label: log.append(label))
        results = run_chain(steps, ctx, execute=execute)
    return Reference(root, results, writes)
