"""Issue #40: `opd tune` refuses, before any work, options it would otherwise record as
measured (or trip over): one-line errors, exit 2."""

import pyarrow as pa
import pytest
from click.testing import CliRunner

from cli.main import cli
from storage import Store


def _fake(root, name: str) -> str:
    w = Store(root).writer(name, stage=name, stage_version="1", config={})
    with w:
        w.write_parquet("a.parquet", pa.table({"x": [1]}))
        return str(w.commit().ref)


def _one_line_error(result, message: str) -> None:
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    assert message in lines[0], result.output


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--max-prompts", "0"], "--max-prompts must be >= 1, got 0"),
        (["--max-prompts", "-1"], "--max-prompts must be >= 1, got -1"),
        (["--temperature", "nan"], "--temperature must be a finite number >= 0"),
        (["--temperature", "inf"], "--temperature must be a finite number >= 0"),
        (["--temperature", "-1"], "--temperature must be a finite number >= 0"),
        # was ignored: tune timed lossless decoding and recorded it for this setting
        (["--set", "drafting.acceptance=typical"], "drafting.acceptance=typical is lossy: drop"),
    ],
)
def test_bad_tune_options_are_one_line_errors_before_any_work(tmp_path, args, message):
    r = CliRunner().invoke(cli, ["--root", str(tmp_path), "tune", *args])
    _one_line_error(r, message)
    assert not tmp_path.exists() or not any(tmp_path.iterdir())  # nothing opened or written


def test_tune_prompts_that_are_not_a_prompts_dataset_is_one_line(tmp_path):
    drafter, features = _fake(tmp_path, "sft"), _fake(tmp_path, "features")
    r = CliRunner().invoke(
        cli, ["--root", str(tmp_path), "tune", "--drafter", drafter, "--prompts", features]
    )
    _one_line_error(r, f"--prompts {features} is a features dataset, not a prompts dataset")
