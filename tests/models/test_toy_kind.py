"""A new drafter kind is its package plus one registry line: the toy kind (tests/models/toy_kind)
runs the `sft-chain` on the tiny profile through the CLI, with no other change."""

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# Registered before the pipeline is imported: its `drafter` config union is built from KINDS.
RUN = """
import sys
from models.drafters import KINDS
from tests.models.toy_kind import SPEC
KINDS[SPEC.name] = SPEC  # the kind's one registry line
from cli.main import cli
cli(sys.argv[1:])
"""


def test_a_toy_kind_runs_the_sft_chain(tmp_path):
    env = os.environ | {"OPD_HOME": str(tmp_path), "OMP_NUM_THREADS": "1"}
    args = ["run", "sft-chain", "--profile", "tiny", "--no-progress"]
    args += ["--set", "drafter.kind=toy", "--set", "target.device=cpu"]
    done = subprocess.run(
        [sys.executable, "-c", RUN, *args], cwd=REPO, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-3000:]
    (sft_dir,) = (p.parent for p in (tmp_path / "sft").glob("*/drafter_config.json"))
    assert json.loads((sft_dir / "drafter_config.json").read_text())["kind"] == "toy"
    assert json.loads((sft_dir / "summary.json").read_text())["drafter_kind"] == "toy"
    # the chain's evaluation (a second one, at the K `opd tune` found fastest, may be beside it)
    record = json.loads((tmp_path / "_runs" / "default.json").read_text())
    eval_dir = tmp_path / "eval" / record["datasets"]["evaluate"].split("@")[1]
    manifest = json.loads((eval_dir / "manifest.json").read_text())
    assert manifest["inputs"]["drafter"].startswith("sft@")
    assert manifest["meta"]["tau"] >= 1.0


def test_an_unregistered_kind_is_refused_by_name():
    from pipeline.profiles import load_config
    from storage import OpdError

    try:
        load_config("tiny", sets=["drafter.kind=toy"])
    except OpdError as e:
        assert "toy" in str(e) and "eagle3" in str(e)
    else:
        raise AssertionError("an unregistered kind was accepted")
