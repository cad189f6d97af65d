import json
import os

import pyarrow as pa
import torch
from click.testing import CliRunner

from lab.cli import cli
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


def test_threads_sets_torch_and_the_launched_processes_threads(tmp_path, monkeypatch):
    _ds(tmp_path)
    before = torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)  # restored after the test
    try:
        torch.set_num_threads(3)  # not 1 on any machine, so the option must change it
        r = CliRunner().invoke(cli, ["--root", str(tmp_path), "--threads", "1", "ls"])
        assert r.exit_code == 0, r.output
        assert torch.get_num_threads() == 1
        assert os.environ["OMP_NUM_THREADS"] == "1"
        r = CliRunner().invoke(cli, ["--root", str(tmp_path), "--threads", "0", "ls"])
        assert r.exit_code == 2 and "'--threads': 0 is not in the range x>=1" in r.output
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


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


def _one_line_error(root, *args: str) -> str:
    r = CliRunner().invoke(cli, ["--root", str(root), *args])
    assert r.exit_code == 2, r.output
    assert r.output.startswith("error: ") and len(r.output.strip().splitlines()) == 1, r.output
    return r.output


def test_bad_names_and_values_are_one_line_errors_before_any_work(tmp_path):
    root = tmp_path / "root"
    _ds(root)
    listed = sorted(p.relative_to(root) for p in root.rglob("*"))
    assert "at least 4 of the version's 12 hex digits" in _one_line_error(
        root, "show", "prompts@ab"
    )
    for args in (["run", "prompts", "--run-name", "../x"], ["analyze", "--run", "../../x"]):
        assert "invalid run name" in _one_line_error(root, *args, "--profile", "tiny")
    as_list = tmp_path / "list.json"
    as_list.write_text('[{"sft": {"lr": 0.1}}]')
    out = _one_line_error(root, "run", "sft", "--profile", "tiny", "--config", str(as_list))
    assert "holds a JSON list; it must be an object of sections" in out
    deep = tmp_path / "deep.json"
    for nested in ("[" * 100_000 + "]" * 100_000, '{"a":' * 100_000 + "1" + "}" * 100_000):
        deep.write_text(nested)
        out = _one_line_error(root, "run", "sft", "--profile", "tiny", "--config", str(deep))
        assert f"cannot read config file {deep}: its JSON is nested too deeply" in out
    out = _one_line_error(root, "run", "sft", "--profile", "tiny", "--set", "sft.lr=" + "[" * 10**5)
    assert "--set sft.lr=...: the value is nested too deeply" in out
    for args in (
        ["eval", "--temperature", "inf"],
        ["eval", "--temperature", "nan"],
        ["eval", "--set", "evaluate.temperature=Infinity"],
        ["run", "sft", "--set", "sft.lr=NaN"],
        ["run", "sft", "--set", "sft.lr=-Infinity"],
    ):
        assert "finite number" in _one_line_error(root, *args, "--profile", "tiny"), args
    assert sorted(p.relative_to(root) for p in root.rglob("*")) == listed  # nothing written


def test_show_verify_hashes_every_byte(tmp_path):
    ds = _ds(tmp_path)
    r = CliRunner().invoke(cli, ["--root", str(tmp_path), "show", "prompts", "--verify"])
    assert "all verified" in r.output
    shard = ds.path / "a.parquet"
    st = shard.stat()
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x04
    shard.write_bytes(bytes(data))
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))  # size and mtime as the cache knows
    out = _one_line_error(tmp_path, "show", "prompts", "--verify")
    assert f"{ds.ref}: shard 'a.parquet' fails its sha256 check" in out


def test_an_option_out_of_its_range_is_one_line_not_clicks_usage_block(tmp_path):
    root = tmp_path / "root"
    for args, message in (
        (["experiment", "opd-vs-sft", "--seeds", "0"], "'--seeds': 0 is not in the range x>=1"),
        (["experiment", "opd-vs-sft", "--budget", "-1"], "'--budget': -1 is not in the range"),
        (["experiment", "ablate", "--seeds", "0"], "'--seeds': 0 is not in the range x>=1"),
        (["experiment", "ablate", "--budget", "0"], "'--budget': 0 is not in the range x>=1"),
        (["experiment", "objectives", "--seeds", "0"], "'--seeds': 0 is not in the range"),
        (["--threads", "0", "ls"], "'--threads': 0 is not in the range x>=1"),
    ):
        args = args if args[0] == "--threads" else [*args, "--recipe", "tiny-eagle3-t0"]
        assert message in _one_line_error(root, *args), args
    assert not root.exists()  # nothing written


def test_a_data_root_inside_a_dataset_version_is_refused(tmp_path):
    version = tmp_path / "root" / "prompts" / "0123456789ab"
    version.mkdir(parents=True)
    (version / "manifest.json").write_text("{}")
    for inner in (version, version / "deeper"):
        before = sorted(version.rglob("*"))
        result = CliRunner().invoke(
            cli, ["--root", str(inner), "run", "prompts", "--profile", "tiny"]
        )
        assert result.exit_code == 2, result.output
        assert (
            result.output.startswith("error: --root/OPD_HOME")
            and "inside the dataset" in result.output
        )
        assert sorted(version.rglob("*")) == before  # nothing written into the version
    ok = CliRunner().invoke(cli, ["--root", str(tmp_path / "root"), "ls"])
    assert ok.exit_code == 0, ok.output
