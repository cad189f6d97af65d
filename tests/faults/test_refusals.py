"""A refused run leaves nothing behind: no dataset, no empty incomplete directory, no lock file."""

import shutil

import pytest
from click.testing import CliRunner

from cli.main import cli
from storage import Store


@pytest.mark.parametrize(
    "options, message",
    [
        # refused before the stage opens its output: no directory at all
        (["--k", "3", "--backend", "vllm"], "evaluate.backend=vllm needs a target directory"),
        # refused inside the stage, before its first shard: the empty directory is removed
        (["--k", "5"], "drafting depth 5 exceeds the 3 steps"),
    ],
)
def test_a_refused_evaluation_leaves_no_directory(reference, tmp_path, options, message):
    root = tmp_path / "root"
    shutil.copytree(reference.root, root)
    before = sorted(root.rglob("*"))
    args = ["--root", str(root), "eval", "--profile", "tiny", *options]
    r = CliRunner().invoke(cli, [*args, "--drafter", str(reference.results["sft"].ref)])
    assert r.exit_code == 2, r.output
    assert message in r.output.strip().splitlines()[-1]
    assert Store(root).listing("eval") == []
    after = sorted(p for p in root.rglob("*") if p != root / "eval")  # an empty name directory
    assert after == before, set(after) ^ set(before)  # was: the refused version's lock file
