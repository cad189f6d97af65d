"""A corrupted artifact of each kind is an error (or, for a checkpoint, a warning) naming it."""

import os
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from cli.main import cli
from pipeline.core.targets import EMBEDDED_TARGET, TargetConfig, TargetLoader
from storage import OpdError, Store
from tests.faults.conftest import opd_args, sums
from tests.pipeline.core.test_training import flip_tensor_byte


def flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def one_line_error(args: list[str]) -> str:
    r = CliRunner().invoke(cli, args)
    assert r.exit_code == 2, r.output
    lines = r.output.strip().splitlines()
    assert lines[-1].startswith("error: "), r.output
    return lines[-1]


@pytest.mark.parametrize(
    "artifact", ["part-00001.arrow", "draft_vocab.safetensors", "manifest.json"]
)
def test_a_corrupted_features_artifact_stops_its_reader_naming_it(reference, tmp_path, artifact):
    root = reference.copy_without("sft", tmp_path / "root")
    feats = reference.results["features"].dataset
    flip(root / "features" / feats.ref.version / artifact)
    error = one_line_error(opd_args(root, "sft"))
    named = "manifest.json" if artifact == "manifest.json" else f"shard '{artifact}'"
    assert f"{feats.ref}: {named} " in error
    assert "re-run its stage" in error
    assert list((root / "sft").glob("*/manifest.json")) == []


def test_a_corrupted_checkpoint_is_named_and_the_one_before_resumed(reference, tmp_path, caplog):
    root = reference.copy_without("sft", tmp_path / "root")
    stop = [*opd_args(root, "sft"), "--set", "sft.stop_after_steps=4"]
    assert "stopped after step 4" in one_line_error(stop)
    (work,) = (root / "_work" / "sft").iterdir()
    newest = work / "step-00000004" / "tensors.safetensors"
    flip_tensor_byte(newest, "model/fc.weight")
    with caplog.at_level("INFO", logger="opd"):
        r = CliRunner().invoke(cli, opd_args(root, "sft"))
    assert r.exit_code == 0, r.output
    assert f"checkpoint {newest.parent} is corrupted: tensors.safetensors" in caplog.text
    assert "resuming from step 2" in caplog.text
    expected = reference.results["sft"].dataset
    assert sums(Store(root).open("sft@latest")) == sums(expected)


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_a_corrupted_target_weights_file_is_an_error_naming_it(tmp_path, damage):
    target = tmp_path / "target"
    shutil.copytree(EMBEDDED_TARGET, target)
    weights = target / "model.safetensors"
    if damage == "flip":
        flip(weights)
    else:
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(OpdError, match="model.safetensors"):
        _ = TargetLoader(TargetConfig(path=str(target))).identity


def test_a_byte_flipped_in_place_is_found_by_a_forced_training_run(reference, tmp_path):
    root = tmp_path / "root"
    shutil.copytree(reference.root, root)
    feats = Store(root).open(str(reference.results["features"].ref))
    feats.verify_all()  # the verify cache vouches for every shard's size and mtime
    shard = feats.path / "part-00001.arrow"
    st = shard.stat()
    flip(shard)
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))
    error = one_line_error([*opd_args(root, "sft"), "--force"])
    assert f"{feats.ref}: shard 'part-00001.arrow' fails its sha256 check" in error
    sft = reference.results["sft"].dataset
    assert sums(Store(root).open(str(sft.ref))) == sums(sft)  # the committed drafter is kept
