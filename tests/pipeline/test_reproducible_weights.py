"""`opd run full --profile tiny` is reproducible on the machine that runs it: two runs in fresh
data roots write the same drafter weights, byte for byte, and the same dataset versions.

Floating-point sums depend on the kernels a CPU selects, on torch's version and on the thread
count, so bytes are compared between runs made here, never against hashes recorded on another
machine (two CPUs reporting the same torch capability were seen to sum in different orders).
A refactor that must not change a number is checked the same way: both versions of the code
run on one machine, and the hashes go in the change's note. Resuming after `kill -9` is checked
per stage in tests/faults/test_kill.py.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

STEPS = ("sft", "opd-r1", "opd-r2")


def _start(root: Path) -> subprocess.Popen:
    # One thread each: the two runs go side by side on two cores, and a run's sums do not
    # depend on how many cores the machine has. The CPU even where a GPU is seen.
    env = os.environ | {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPD_HOME": str(root)}
    cli = ["run", "full", "--profile", "tiny", "--no-progress", "--set", "target.device=cpu"]
    return subprocess.Popen(
        [sys.executable, "-m", "cli.main", *cli],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


def _written(root: Path) -> dict[str, tuple[str, str]]:
    runs = sorted((root / "_runs").glob("*.json"))
    assert runs, f"the run in {root} wrote no run record"
    record = json.loads(runs[-1].read_text())
    out = {}
    for step in STEPS:
        name, version = record["datasets"][step].split("@")
        weights = (root / name / version / "model.safetensors").read_bytes()
        out[step] = (version, hashlib.sha256(weights).hexdigest())
    return out


def test_two_runs_of_the_tiny_chain_write_identical_drafter_weights(tmp_path: Path):
    roots = [tmp_path / "a", tmp_path / "b"]
    runs = [_start(root) for root in roots]
    for run in runs:
        _, err = run.communicate(timeout=600)
        assert run.returncode == 0, err[-3000:]
    first, second = (_written(root) for root in roots)
    assert first == second
    # the weights differ between steps, so equal hashes above are not an empty-file accident
    assert len({digest for _, digest in first.values()}) == len(STEPS)
