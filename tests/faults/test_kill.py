"""kill -9 at a seeded random write of each stage, then a plain re-run: the same bytes."""

import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from cli.main import cli
from storage import Store
from tests.faults.conftest import STAGES, opd_args, sums

SEED = 14
REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("stage", STAGES)
def test_kill_9_at_a_random_write_then_rerun_gives_identical_shards(reference, stage, tmp_path):
    root = reference.copy_without(stage, tmp_path / "root")
    writes = reference.writes[stage]
    rng = random.Random(f"{SEED}:{stage}")
    n, phase = rng.randrange(len(writes)) + 1, rng.choice(["mid", "after"])
    where = f"{phase} write {n} of {len(writes)} ({writes[n - 1]})"
    killed = subprocess.run(
        [sys.executable, "-m", "tests.faults.killer", str(n), phase, "--", *opd_args(root, stage)],
        env=os.environ
        | {"PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert killed.returncode == -signal.SIGKILL, f"not killed {where}:\n{killed.stderr[-3000:]}"

    rerun = CliRunner().invoke(cli, opd_args(root, stage))
    assert rerun.exit_code == 0, f"killed {where}; re-run:\n{rerun.output}"
    expected = reference.results[stage].dataset
    store = Store(root)
    got = store.open(f"{expected.ref.name}@latest")
    assert got.ref == expected.ref, where
    got.verify_all(rehash=True)
    assert sums(got) == sums(expected), where
    assert store.gc(dry_run=True) == [], where
