import json

import pyarrow as pa
from click.testing import CliRunner

from cli.main import cli
from storage import Store


def _ds(root):
    w = Store(root).writer("prompts", stage="prompts", stage_version="1", config={"k": 1})
    with w:
        w.write_parquet("a.parquet", pa.table({"x": [1, 2, 3]}))
        return w.commit()


def test_ls_show_gc(tmp_path):
    ds = _ds(tmp_path)
    r = CliRunner().invoke(cli, ["--root", str(tmp_path), "ls"])
    assert r.exit_code == 0 and str(ds.ref) in r.output and "complete" in r.output
    r = CliRunner().invoke(cli, ["--root", str(tmp_path), "ls", "--json"])
    assert json.loads(r.output)[0]["rows"] == 3
    r = CliRunner().invoke(cli, ["--root", str(tmp_path), "show", "prompts", "--verify"])
    assert r.exit_code == 0 and "lineage" in r.output and "all verified" in r.output
    r = CliRunner().invoke(cli, ["--root", str(tmp_path), "gc", "--dry-run"])
    assert r.exit_code == 0 and "would remove 0" in r.output


def test_opd_home_env(tmp_path):
    ds = _ds(tmp_path)
    r = CliRunner().invoke(cli, ["ls"], env={"OPD_HOME": str(tmp_path)})
    assert str(ds.ref) in r.output


def test_user_errors_are_one_line_and_nonzero(tmp_path):
    _ds(tmp_path)
    for args, msg in (
        (["show", "sft"], "no dataset named 'sft'"),
        (["show", "prompts@abc$"], "bad dataset ref"),
        (["show", "bogus@latest"], "no dataset named 'bogus'"),
    ):
        r = CliRunner().invoke(cli, ["--root", str(tmp_path), *args])
        assert r.exit_code == 2, r.output
        assert r.output.startswith("error: ") and msg in r.output
        assert len(r.output.strip().splitlines()) == 1
