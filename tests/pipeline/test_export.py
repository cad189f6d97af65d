"""`opd export` and the commands that read existing datasets, on a target in a local directory.

The drafter is trained (tiny settings) for a random target saved as an HF directory, so the
target's own files exist to be protected, and its path is what the datasets record.
"""

import hashlib
import json
import os
import re
import shlex
import shutil
import stat
import subprocess
import sys

import pytest
from click.testing import CliRunner

from cli.main import cli
from pipeline.core.export import default_verifier, ensure_export, verify_export
from pipeline.core.runner import RunContext, run_stage
from pipeline.core.targets import (
    EMBEDDED_TARGET,
    TargetConfig,
    TargetLoader,
    resolve_dtype,
    target_for,
    target_spec,
)
from pipeline.profiles import load_config
from pipeline.stages import features, generate, sft
from storage import OpdError, Store
from tests.pipeline.conftest import write_prompts

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def _sha(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(root, target dir, sft ref): an sft drafter for a target loaded from a local directory."""
    base = tmp_path_factory.mktemp("export")
    cfg = load_config("tiny")
    target_dir = base / "models" / "tiny-coder"
    TargetLoader(cfg.target).target.model.save_pretrained(target_dir)
    for name in TOKENIZER_FILES:
        shutil.copy(EMBEDDED_TARGET / name, target_dir / name)
    # fp32 as the tiny profile's: `auto` would be bf16 on a CPU that runs it natively
    target = TargetConfig(path=str(target_dir), aux_layer_ids=[1, 2, 3], dtype="float32")
    loader = TargetLoader(target)
    store = Store(base / "data")
    ctx = RunContext(store=store, target_loader=loader, progress=False)
    traj = run_stage(generate.STAGE, cfg.generate, {"prompts": write_prompts(store)}, ctx).dataset
    feats = run_stage(features.STAGE, cfg.features, {"trajectories": traj}, ctx).dataset
    drafter = run_stage(sft.STAGE, cfg.sft, {"features": feats}, ctx).dataset
    return store.root, target_dir, str(drafter.ref)


def opd(root, *args):
    return CliRunner().invoke(cli, ["--root", str(root), *args])


def named(target_dir):
    """The target stated on the command line (independent of what the datasets record)."""
    sets = [f"target.path={target_dir}", "target.aux_layer_ids=[1,2,3]", "target.dtype=float32"]
    return [arg for s in sets for arg in ("--set", s)]


def one_line_error(result, message):
    assert result.exit_code == 2, result.output
    # transformers' weight-loading progress bar may precede the error
    lines = [line for line in result.output.strip().splitlines() if "Loading weights" not in line]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    assert message in lines[0], result.output


# ----------------------------------------------------------------------------- where --out may be


def test_export_refuses_a_non_empty_out_and_keeps_its_files(trained, tmp_path):
    root, target_dir, ref = trained
    copy = tmp_path / "copy-of-target"
    shutil.copytree(target_dir, copy)
    weights = _sha(copy / "model.safetensors")
    one_line_error(
        opd(root, "export", *named(target_dir), "--drafter", ref, "--out", str(copy)),
        "is not empty",
    )
    assert _sha(copy / "model.safetensors") == weights
    assert sorted(p.name for p in copy.iterdir()) == sorted(p.name for p in target_dir.iterdir())


def test_export_never_writes_into_the_targets_directory(trained):
    root, target_dir, ref = trained
    weights = _sha(target_dir / "model.safetensors")
    for out in (target_dir, target_dir.parent, root):
        r = opd(
            root, "export", *named(target_dir), "--drafter", ref, "--out", str(out), "--overwrite"
        )
        one_line_error(r, "refused even with --overwrite")
    assert _sha(target_dir / "model.safetensors") == weights


def test_export_never_writes_inside_the_data_root_or_the_target(trained):
    root, target_dir, ref = trained
    version = ref.split("@")[1]
    before = sorted(str(p.relative_to(root)) for p in root.rglob("*") if "_cache" not in p.parts)
    inside = [
        root / "sft",
        root / "sft" / version,
        root / "_runs",
        root / "newdir",
        root / "sft" / version / "deeper",
        target_dir / "sub",
    ]
    for out in inside:
        r = opd(
            root, "export", *named(target_dir), "--drafter", ref, "--out", str(out), "--overwrite"
        )
        one_line_error(r, "lies inside")
    after = sorted(str(p.relative_to(root)) for p in root.rglob("*") if "_cache" not in p.parts)
    assert after == before  # not a dataset, LATEST or lock lost, nothing new created
    assert not (target_dir / "sub").exists()
    assert opd(root, "show", ref).exit_code == 0


def test_export_overwrite_replaces_the_directory_whole(trained, tmp_path):
    root, target_dir, ref = trained
    out = tmp_path / "drafter"
    out.mkdir()
    (out / "stale.txt").write_text("from an older export")
    # a failing export (not a drafter) leaves the existing directory as it was
    one_line_error(
        opd(
            root,
            "export",
            *named(target_dir),
            "--drafter",
            "features@latest",
            "--out",
            str(out),
            "--overwrite",
        ),
        "is not a drafter",
    )
    assert [p.name for p in out.iterdir()] == ["stale.txt"]
    r = opd(root, "export", *named(target_dir), "--drafter", ref, "--out", str(out), "--overwrite")
    assert r.exit_code == 0, r.output
    files = ["config.json", "model.safetensors", "opd_drafter.json", "opd_export.json"]
    assert sorted(p.name for p in out.iterdir()) == files
    assert [p.name for p in tmp_path.iterdir()] == ["drafter"]  # no staging leftovers


def test_an_export_carries_checksums_that_verify_finds_a_flipped_byte_with(trained, tmp_path):
    root, target_dir, ref = trained
    out = tmp_path / "drafter"
    assert (
        opd(root, "export", *named(target_dir), "--drafter", ref, "--out", str(out)).exit_code == 0
    )
    umask = os.umask(0o022)
    os.umask(umask)
    for path in out.iterdir():  # the weights too (safetensors writes them 0600)
        assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~umask, path
    record = json.loads((out / "opd_export.json").read_text())
    assert record["drafter"] == ref
    assert record["files"]["model.safetensors"]["sha256"] == _sha(out / "model.safetensors")
    r = opd(root, "export", "--verify", str(out))
    assert r.exit_code == 0 and "all 3 files match" in r.output, r.output
    weights = out / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0x01
    weights.write_bytes(bytes(data))
    one_line_error(opd(root, "export", "--verify", str(out)), "model.safetensors fails its sha256")
    (out / "opd_export.json").unlink()
    one_line_error(opd(root, "export", "--verify", str(out)), "has no opd_export.json")


def test_a_cached_export_that_fails_its_checksums_is_written_again(trained, caplog):
    root, target_dir, ref = trained
    store = Store(root)
    drafter = store.open(ref)
    loader = TargetLoader(target_for([drafter], load_config("tiny").target, stated=False))
    path = ensure_export(drafter, loader, root, 3)
    weights = path / "model.safetensors"
    good = _sha(weights)
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0x01
    weights.write_bytes(bytes(data))
    with caplog.at_level("WARNING", logger="opd"):
        assert ensure_export(drafter, loader, root, 3) == path
    assert "model.safetensors fails its sha256 check" in caplog.text
    assert _sha(weights) == good and verify_export(path) == 3
    caplog.clear()
    assert ensure_export(drafter, loader, root, 3) == path  # a good one is reused silently
    assert caplog.text == ""


def _dead_pid():
    return int(
        subprocess.run(
            [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
        ).stdout
    )


def _leftovers(parent, name, contents):
    """What a killed export of `name` leaves in `parent`: {kind: PID-suffixed sibling}."""
    made = {}
    for kind, text in contents.items():
        made[kind] = parent / f".{name}.{kind}-{_dead_pid()}"
        made[kind].mkdir(parents=True)
        (made[kind] / "config.json").write_text(text)
    return made


def test_a_killed_exports_leftovers_are_cleaned_and_its_old_export_restored(trained, tmp_path):
    root, target_dir, ref = trained
    out = tmp_path / "drafter"
    # killed between the overwrite's two renames: the old export lives only in .replaced-PID
    made = _leftovers(tmp_path, "drafter", {"export": "half-written", "replaced": "old export"})
    live = tmp_path / f".drafter.export-{os.getppid()}"  # a live process's: not ours to take
    live.mkdir()
    r = opd(root, "export", *named(target_dir), "--drafter", ref, "--out", str(out))
    assert r.exit_code == 2 and "is not empty" in r.output, r.output
    assert (out / "config.json").read_text() == "old export"  # restored, then kept
    assert not made["export"].exists() and not made["replaced"].exists() and live.is_dir()
    # killed after the swap: the old export beside the new one is removed
    made = _leftovers(tmp_path, "drafter", {"replaced": "older export"})
    r = opd(root, "export", *named(target_dir), "--drafter", ref, "--out", str(out), "--overwrite")
    assert r.exit_code == 0, r.output
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["drafter", live.name])
    assert opd(root, "export", "--verify", str(out)).exit_code == 0
    live.rmdir()


def test_gc_cleans_what_killed_exports_left_under_the_data_root(trained, tmp_path):
    root, target_dir, ref = trained
    base = shutil.copytree(root, tmp_path / "root")
    parent = base / "_exports" / "sft-0123456789ab"
    (parent / "speculators").mkdir(parents=True)
    gone = _leftovers(parent, "eagle3", {"export": "half-written", "replaced": "old export"})
    stale = _leftovers(parent, "speculators", {"replaced": "superseded"})
    dry = opd(base, "gc", "--dry-run")
    assert dry.exit_code == 0 and "would be restored" in dry.output, dry.output
    assert all(p.exists() for p in [*gone.values(), *stale.values()])
    r = opd(base, "gc")
    assert r.exit_code == 0 and "3 export leftover(s)" in r.output, r.output
    assert sorted(p.name for p in parent.iterdir()) == ["eagle3", "speculators"]
    assert (parent / "eagle3" / "config.json").read_text() == "old export"


def test_export_out_naming_a_file_and_bad_k_are_one_line_errors(trained, tmp_path):
    root, target_dir, ref = trained
    file = tmp_path / "drafter.json"
    file.write_text("{}")
    one_line_error(
        opd(root, "export", *named(target_dir), "--drafter", ref, "--out", str(file)), "is a file"
    )
    assert file.read_text() == "{}"
    for k in ("0", "-2"):
        r = opd(
            root,
            "export",
            *named(target_dir),
            "--drafter",
            ref,
            "--out",
            str(tmp_path / "d"),
            "--k",
            k,
        )
        one_line_error(r, "--k must be >= 1")
    assert not (tmp_path / "d").exists()


# ----------------------------------------------------------------------------- the verifier's name


def test_speculators_verifier_is_named_by_the_user_or_falls_back_with_a_warning(trained, tmp_path):
    root, target_dir, ref = trained
    out = tmp_path / "spec"
    r = opd(
        root,
        "export",
        *named(target_dir),
        "--drafter",
        ref,
        "--format",
        "speculators",
        "--out",
        str(out),
    )
    assert r.exit_code == 0, r.output
    assert "warning: the speculators config names the verifier by this machine's path" in r.output
    verifier = json.loads((out / "config.json").read_text())["speculators_config"]["verifier"]
    assert verifier["name_or_path"] == str(target_dir.resolve())
    r = opd(
        root, "export", *named(target_dir), "--drafter", ref, "--format", "speculators",
        "--out", str(out),
        "--overwrite", "--verifier", "acme/tiny-coder",
    )  # fmt: skip
    assert r.exit_code == 0 and "warning" not in r.output, r.output
    verifier = json.loads((out / "config.json").read_text())["speculators_config"]["verifier"]
    assert verifier["name_or_path"] == "acme/tiny-coder"


def test_default_verifier_is_the_hub_name_the_targets_config_records(tmp_path):
    target = tmp_path / "m"
    target.mkdir()
    config = {"model_type": "llama", "_name_or_path": "acme/tiny-coder"}
    (target / "config.json").write_text(json.dumps(config))
    assert default_verifier(TargetLoader(TargetConfig(path=str(target)))) == (
        "acme/tiny-coder",
        None,
    )
    (target / "config.json").write_text(json.dumps(config | {"_name_or_path": "/train/m"}))
    name, warning = default_verifier(TargetLoader(TargetConfig(path=str(target))))
    assert name == str(target.resolve()) and "pass --verifier" in warning


# ----------------------------------------------------------------------------- target from the data


def test_export_takes_the_target_its_drafter_was_made_with(trained, tmp_path):
    root, target_dir, ref = trained
    r = opd(root, "export", "--drafter", ref, "--out", str(tmp_path / "a"))
    assert r.exit_code == 0, r.output
    assert f"vllm serve {target_dir.resolve()}" in r.output
    assert r.output.count("no draft-tree setting") == 1  # what vLLM takes for trees, said once
    # restating the same target is fine; so is a copy of it elsewhere (the weights are compared)
    r = opd(root, "export", "--drafter", ref, "--out", str(tmp_path / "b"),
            "--set", f"target.path={target_dir}", "--set", "target.aux_layer_ids=[1,2,3]")  # fmt: skip
    assert r.exit_code == 0, r.output
    moved = tmp_path / "moved"
    shutil.copytree(target_dir, moved)
    r = opd(root, "export", "--drafter", ref, "--out", str(tmp_path / "c"),
            "--set", f"target.path={moved}", "--set", "target.aux_layer_ids=[1,2,3]")  # fmt: skip
    assert r.exit_code == 0 and f"vllm serve {moved}" in r.output, r.output


def test_a_conflicting_explicit_target_is_an_error_naming_both(trained, tmp_path):
    root, target_dir, ref = trained
    r = opd(root, "export", "--drafter", ref, "--out", str(tmp_path / "a"), "--profile", "default")
    one_line_error(r, "made with a different target than this command names")
    assert f"target.path: '{target_dir.resolve()}' ({ref}) vs 'embedded' (this command)" in r.output
    r = opd(root, "export", "--drafter", ref, "--out", str(tmp_path / "a"),
            "--set", "target.dtype=bfloat16")  # fmt: skip
    one_line_error(r, "target.dtype: 'float32'")  # the fixture's, pinned
    assert not (tmp_path / "a").exists()


def test_eval_and_analyze_use_the_datasets_target_without_restating_it(trained):
    root, _, ref = trained
    r = opd(root, "eval", "--drafter", ref, "--set", "evaluate.max_new_tokens=6", "--json")
    assert r.exit_code == 0, r.output
    r = opd(root, "analyze", "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["report"].startswith("report@")


def test_a_single_stage_run_takes_the_target_of_its_inputs(trained):
    root, target_dir, _ = trained
    r = opd(root, "run", "features", "--no-progress", "--set", "features.draft_vocab_size=256")
    assert r.exit_code == 0, r.output
    recorded = Store(root).open("features@latest").meta["target_config"]
    assert recorded == {
        "path": str(target_dir.resolve()),
        "dtype": "float32",  # the inputs' (the fixture pins it), not this machine's `auto`
        "aux_layer_ids": [1, 2, 3],
    }


def _recorded(store, name, spec):
    w = store.writer(name, stage=name, stage_version="1", config={"spec": spec})
    with w:
        return w.commit(meta={} if spec is None else {"target_config": spec})


def test_target_for_rules(tmp_path):
    store = Store(tmp_path)
    tiny = load_config("tiny").target
    random = _recorded(store, "trajectories", target_spec(tiny))
    embedded = _recorded(store, "features", target_spec(TargetConfig(aux_layer_ids=[1, 3, 5])))
    unrecorded = _recorded(store, "prompts", None)
    default = load_config("default").target
    assert target_for([unrecorded], default, stated=False) == default
    # the recorded target, with the dtype it was made in (`auto` resolved)
    got = target_for([unrecorded, random], default, stated=False)
    assert target_spec(got) == target_spec(tiny) and got.dtype == resolve_dtype(tiny)
    assert target_for([random], tiny, stated=True) == tiny
    with pytest.raises(OpdError, match="were made with different targets.*target.path: 'random'"):
        target_for([random, embedded], default, stated=False)
    # the embedded model named by its directory is the embedded target
    assert target_spec(TargetConfig(path=str(EMBEDDED_TARGET)))["path"] == "embedded"


# ------------------------------------------------------------- issue #40: what export trusts


DEEP = "[" * 100_000 + "]" * 100_000


def _tune_record(root, ref, serve):
    path = root / "_tune" / f"{ref.replace('@', '-')}.json"
    path.parent.mkdir(exist_ok=True)
    text = serve if isinstance(serve, str) else json.dumps({"T=0.0": {"serve": serve}})
    path.write_text(text)
    return path


SERVE = {"k": 2, "speedup_vs_plain": 1.5, "prompts": 4, "drafter_depth": 3}


@pytest.mark.parametrize(
    "record",
    [
        SERVE | {"k": 999},
        SERVE | {"k": 4},  # one deeper than the drafter was trained
        SERVE | {"k": 2.5},
        SERVE | {"k": True},
        SERVE | {"k": 0},
        SERVE | {"speedup_vs_plain": "fast"},
        SERVE | {"prompts": -1},
        '{"T=0.0": {"serve": 3}}',
        "{not json",
        DEEP,
    ],
)
def test_a_tampered_or_unreadable_tune_record_is_refused(trained, tmp_path, record):
    root, target_dir, ref = trained
    base = shutil.copytree(root, tmp_path / "root")
    path = _tune_record(base, ref, record)
    r = opd(base, "export", *named(target_dir), "--drafter", ref, "--out", str(tmp_path / "d"))
    one_line_error(r, str(path))
    assert "re-run `opd tune" in r.output and "delete the file" in r.output
    assert not (tmp_path / "d").exists()


def test_a_valid_tune_record_and_set_drafting_k_pick_the_served_k(trained, tmp_path):
    root, target_dir, ref = trained
    base = shutil.copytree(root, tmp_path / "root")
    _tune_record(base, ref, SERVE)
    r = opd(base, "export", *named(target_dir), "--drafter", ref, "--out", str(tmp_path / "a"))
    assert r.exit_code == 0 and "num_speculative_tokens 2: measured by `opd tune`" in r.output
    args = ["--drafter", ref, "--set", "drafting.k=1", "--out", str(tmp_path / "b")]
    r = opd(base, "export", *named(target_dir), *args)
    assert r.exit_code == 0 and "num_speculative_tokens 1: --set drafting.k" in r.output, r.output
    assert json.loads((tmp_path / "b" / "config.json").read_text())


def test_export_refuses_a_k_deeper_than_the_drafter_was_trained(trained, tmp_path):
    root, target_dir, ref = trained
    for k in ("4", "50"):
        args = ["--drafter", ref, "--k", k, "--out", str(tmp_path / "d")]
        one_line_error(opd(root, "export", *named(target_dir), *args), "exceeds the 3 steps")
    assert not (tmp_path / "d").exists()


def test_verify_checks_files_in_subdirectories_too(tmp_path):
    from pipeline.core.export import write_checksums

    export = tmp_path / "export"
    (export / "sub").mkdir(parents=True)
    (export / "config.json").write_text("{}")
    (export / "sub" / "weights.bin").write_bytes(b"\x00" * 64)
    write_checksums(export, drafter="sft@0123456789ab", fmt="eagle3")
    assert verify_export(export) == 2
    (export / "sub" / "weights.bin").write_bytes(b"\x00" * 63 + b"\x01")
    with pytest.raises(OpdError, match="sub/weights.bin fails its sha256 check"):
        verify_export(export)
    (export / "sub" / "weights.bin").write_bytes(b"\x00" * 64)
    (export / "sub" / "added.bin").write_bytes(b"x")
    with pytest.raises(OpdError, match="sub/added.bin is not one of the files"):
        verify_export(export)


def test_an_unreadable_checksums_file_is_one_line_and_a_cached_one_is_rewritten(
    trained, tmp_path, caplog
):
    root, target_dir, ref = trained
    base = shutil.copytree(root, tmp_path / "root")
    out = tmp_path / "drafter"
    assert (
        opd(base, "export", *named(target_dir), "--drafter", ref, "--out", str(out)).exit_code == 0
    )
    (out / "opd_export.json").write_text(DEEP)
    one_line_error(opd(base, "export", "--verify", str(out)), "opd_export.json is unreadable")
    drafter = Store(base).open(ref)
    loader = TargetLoader(target_for([drafter], load_config("tiny").target, stated=False))
    path = ensure_export(drafter, loader, base, 3)
    (path / "opd_export.json").write_text(DEEP)
    with caplog.at_level("WARNING", logger="opd"):
        assert ensure_export(drafter, loader, base, 3) == path
    assert "nested too deeply" in caplog.text and verify_export(path) == 3


def test_export_never_replaces_a_dataset_of_another_data_root(trained, tmp_path):
    root, target_dir, ref = trained
    other = shutil.copytree(root, tmp_path / "other")  # another root, holding the same version
    version = ref.split("@")[1]
    before = {str(p.relative_to(other)) for p in other.rglob("*")}
    for out in (
        other / "sft" / version,
        other / "sft" / version / "deeper",
        other / "sft",
        other,
        other / "newdir",
        tmp_path,  # holds the other root
    ):
        r = opd(
            root, "export", *named(target_dir), "--drafter", ref, "--out", str(out), "--overwrite"
        )
        one_line_error(r, "refused even with --overwrite")
        assert "data root" in r.output or "dataset" in r.output
    assert {str(p.relative_to(other)) for p in other.rglob("*")} == before
    assert opd(other, "show", ref, "--verify").exit_code == 0


# ----------------------------------------------------------------------------- hints on vLLM


def test_every_vllm_setting_the_serving_hints_name_is_one_the_installed_vllm_has(tmp_path):
    """The export's serve command and each kind's note on trees name vLLM's speculative
    settings; each must be a field of the installed vLLM's `SpeculativeConfig` (and each serve
    method one it accepts), so a hint never sends a user to a setting vLLM does not have."""
    config = pytest.importorskip("vllm.config", reason="vLLM is not installed (make vllm)")
    import dataclasses
    import typing

    from models.drafters import KINDS
    from models.vocab import DraftVocab
    from pipeline.core.export import vllm_command

    fields = {f.name for f in dataclasses.fields(config.SpeculativeConfig)}
    methods = {
        m for arg in typing.get_args(config.SpeculativeConfig.__dataclass_fields__["method"].type)
        for m in typing.get_args(arg)
    }  # fmt: skip
    target = TargetLoader(load_config("tiny").target).target
    served_kinds = [spec for spec in KINDS.values() if spec.serve_method is not None]
    assert served_kinds
    for spec in served_kinds:  # a kind that is not served names no vLLM setting
        drafter = spec.drafter.new(target, DraftVocab.full(target.vocab_size), {})
        command = vllm_command("target", drafter.speculative_config(tmp_path, 3))
        served = json.loads(shlex.split(command)[-1])
        assert set(served) <= fields, (spec.name, set(served) - fields)
        assert served["method"] in methods, spec.name
        # snake_case words in a note name vLLM settings (the project's own are dotted)
        named = set(re.findall(r"(?<![\w.])[a-z]+(?:_[a-z]+)+(?![\w.])", spec.tree_note or ""))
        assert named <= fields, (spec.name, named - fields)
