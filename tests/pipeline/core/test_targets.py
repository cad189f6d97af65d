"""The target loader refuses what cannot fit before it allocates."""

from __future__ import annotations

import json
import shutil

import pytest
from click.testing import CliRunner

from cli.main import cli
from pipeline.core import targets
from pipeline.core.targets import TargetConfig, TargetLoader
from storage import OpdError

GIB = 1 << 30


class _Built(Exception):
    """Raised in place of building a shape: the loader got past its memory check."""


@pytest.fixture
def machine(monkeypatch):
    """A 24 GiB machine where no shape is ever allocated; returns a setter for its memory."""

    def never_build(*args, **kwargs):
        raise _Built

    monkeypatch.setattr(targets, "build_model", never_build)
    available = {"bytes": 24 * GIB}
    monkeypatch.setattr(targets, "available_memory", lambda: available["bytes"], raising=False)
    return available


def _load(**cfg) -> object:
    cfg = {"dtype": "float32"} | cfg  # the fp32 sizes below; `auto` is bf16 on some CPUs
    return TargetLoader(TargetConfig(path="shape:llama-3.1-8b", device="cpu", **cfg)).target


def test_a_shape_larger_than_the_memory_available_is_one_line_before_any_tensor(machine):
    # Llama-3.1-8B: 8.03B parameters, 29.9 GiB in fp32, on a machine with 24 GiB available
    with pytest.raises(OpdError, match=r"8\.03B parameters\) needs 29\.9 GiB .* 24\.0 GiB") as e:
        _load()
    assert "\n" not in str(e.value) and "target.shape.num_layers" in str(e.value)
    with pytest.raises(OpdError, match=r"10000 layers"):
        _load(shape={"num_layers": 10_000})
    # bf16 on the CPU: the fp32 build and its bf16 cast are held at once (6 bytes a parameter)
    with pytest.raises(OpdError, match=r"needs 44\.9 GiB .* fp32 and bfloat16 weights"):
        _load(dtype="bfloat16")
    with pytest.raises(_Built):  # 8 layers at width 512: 0.16B parameters fit
        _load(shape={"num_layers": 8, "hidden_size": 512})
    machine["bytes"] = None  # memory unknown (not Linux): nothing to refuse by
    with pytest.raises(_Built):
        _load()


def test_available_memory_reads_this_machine():
    free = targets.available_memory()
    assert free is None or free > 0


@pytest.mark.parametrize(
    "edit",
    ["chat_template.jinja", "config.json", "tokenizer.json", "tokenizer_config.json"],
)
def test_an_edit_to_any_file_that_changes_a_targets_outputs_changes_its_identity(tmp_path, edit):
    copy = tmp_path / "target"
    shutil.copytree(targets.EMBEDDED_TARGET, copy)
    before = TargetLoader(TargetConfig(path=str(copy))).identity
    path = copy / edit
    if edit.endswith(".json"):  # the same settings written out again: other bytes, still loads
        path.write_text(json.dumps(json.loads(path.read_text()), indent=3))
    else:
        path.write_text(path.read_text().replace("<|assistant|>", "<|assistant|> "))
    after = TargetLoader(TargetConfig(path=str(copy))).identity
    assert after["weights_sha256"] == before["weights_sha256"]
    assert after != before and after["settings_sha256"] != before["settings_sha256"]
    # a moved copy keeps it: the path is no part of it
    shutil.copytree(copy, tmp_path / "moved")
    assert TargetLoader(TargetConfig(path=str(tmp_path / "moved"))).identity == after


def test_prompts_rendered_with_an_old_chat_template_are_not_reused(tmp_path):
    copy = tmp_path / "target"
    shutil.copytree(targets.EMBEDDED_TARGET, copy)
    args = ["--root", str(tmp_path / "root"), "--threads", "1", "run", "prompts", "--profile"]
    args += ["tiny", "--no-progress", "--set", f"target.path={copy}"]
    first = CliRunner().invoke(cli, args)
    assert first.exit_code == 0, first.output
    template = copy / "chat_template.jinja"
    template.write_text(template.read_text().replace("<|assistant|>", "<|assistant|> "))
    second = CliRunner().invoke(cli, args)
    assert second.exit_code == 0, second.output
    made = [line.split()[1] for r in (first, second) for line in r.output.splitlines()]
    assert "(cached)" not in second.output and made[0] != made[1], (first.output, second.output)
