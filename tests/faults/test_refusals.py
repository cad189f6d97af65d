"""A refused run leaves nothing behind: no dataset, and no empty incomplete directory."""

import shutil

from click.testing import CliRunner

from cli.main import cli
from storage import Store


def test_a_refused_vllm_evaluation_leaves_no_directory(reference, tmp_path):
    root = tmp_path / "root"
    shutil.copytree(reference.root, root)
    args = ["--root", str(root), "eval", "--profile", "tiny", "--k", "3", "--backend", "vllm"]
    r = CliRunner().invoke(cli, [*args, "--drafter", str(reference.results["sft"].ref)])
    assert r.exit_code == 2, r.output
    assert "evaluate.backend=vllm needs a target directory" in r.output.strip().splitlines()[-1]
    assert Store(root).listing("eval") == []
    assert sorted(p.name for p in (root / "eval").iterdir() if not p.name.endswith(".lock")) == []
