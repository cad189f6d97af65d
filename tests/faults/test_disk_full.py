"""ENOSPC at each kind of write: a one-line error naming the fix, then a clean resume."""

import pytest
from click.testing import CliRunner

from cli.main import cli
from storage import Store
from tests.faults.conftest import opd_args, sums
from tests.faults.inject import disk_full

# what fails -> (stage that writes it, a marker in the failing file's path)
CASES = {
    "shard": ("features", "part-00001.arrow"),
    "manifest": ("features", "manifest.json"),
    "checkpoint": ("sft", ".step-00000004.tmp-"),
    "LATEST": ("generate", ".LATEST.tmp-"),
}


@pytest.mark.parametrize("what", CASES)
def test_a_full_disk_is_one_line_naming_the_fix_then_a_rerun_resumes(
    reference, what, tmp_path, monkeypatch
):
    stage, marker = CASES[what]
    root = reference.copy_without(stage, tmp_path / "root")
    disk_full(monkeypatch, marker)
    r = CliRunner().invoke(cli, opd_args(root, stage))
    monkeypatch.undo()
    assert r.exit_code == 2, r.output
    error = r.output.strip().splitlines()[-1]
    assert error.startswith("error: disk full while writing ")
    assert error.endswith("free space or point --root/OPD_HOME at a larger disk"), error
    assert [p for p in root.rglob("*") if ".tmp-" in p.name] == []

    r = CliRunner().invoke(cli, opd_args(root, stage))
    assert r.exit_code == 0, r.output
    expected = reference.results[stage].dataset
    got = Store(root).open(f"{expected.ref.name}@latest")
    assert got.ref == expected.ref
    assert sums(got) == sums(expected)
