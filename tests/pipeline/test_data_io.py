"""Trajectories and drafters in and out of a data root (`opd data export / import /
import-drafter`, `generate.source`) on the tiny profile: round trips into fresh data roots, and
the refusals (another tokenizer, template or target; a corrupted file or directory)."""

import json
import shutil

import pyarrow.parquet as pq
import pytest
import torch
from click.testing import CliRunner

from cli.main import cli
from models.drafters import CONFIG_FILE
from pipeline.core.drafters import load_drafter_dataset
from pipeline.core.runner import RunContext, run_stage
from pipeline.core.targets import TargetLoader
from pipeline.core.trajectory_files import META_KEY, TRAJECTORY_SCHEMA
from pipeline.profiles import load_config
from pipeline.stages import features, generate, opd, rollout, score, sft
from storage import OpdError, Store, sha256_file
from tests.pipeline.conftest import write_prompts

# The tiny profile's random target is fp32; a drafter's record leaves the dtype to the importing
# machine, and where `auto` is bf16 the random target built in bf16 is another target.
FP32 = ("--set", "target.dtype=float32")


def run_opd(root, *args):
    return CliRunner().invoke(cli, ["--root", str(root), *args])


def one_line_error(result, message):
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.strip().splitlines() if "Loading weights" not in line]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    assert message in lines[0], result.output


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """(root, trajectories ref, sft ref, exported drafter dir, trajectories file) on tiny."""
    base = tmp_path_factory.mktemp("io")
    cfg = load_config("tiny")
    store = Store(base / "data")
    ctx = RunContext(store=store, target_loader=TargetLoader(cfg.target), progress=False)
    traj = run_stage(generate.STAGE, cfg.generate, {"prompts": write_prompts(store)}, ctx).dataset
    feats = run_stage(features.STAGE, cfg.features, {"trajectories": traj}, ctx).dataset
    drafter = run_stage(sft.STAGE, cfg.sft, {"features": feats}, ctx).dataset
    out = base / "export"
    r = run_opd(store.root, "export", "--drafter", str(drafter.ref), "--out", str(out))
    assert r.exit_code == 0, r.output
    file = base / "traj.parquet"
    r = run_opd(store.root, "data", "export", str(traj.ref), "--out", str(file))
    assert r.exit_code == 0, r.output
    return store.root, str(traj.ref), str(drafter.ref), out, file


def _rewrite_meta(src, dst, **changes):
    table = pq.read_table(src)
    meta = json.loads(table.schema.metadata[META_KEY]) | changes
    pq.write_table(table.replace_schema_metadata({META_KEY: json.dumps(meta).encode()}), dst)


# ------------------------------------------------------------------------------ trajectories


def test_trajectories_round_trip_through_a_file_into_a_fresh_root(made, tmp_path):
    root, traj_ref, _, _, file = made
    meta = json.loads(pq.read_schema(file).metadata[META_KEY])
    assert meta["rows"] == 12 and meta["source"]["dataset"] == traj_ref
    assert (
        meta["target"]["path"] == "random" and meta["generation"]["stage"]["max_new_tokens"] == 16
    )
    assert pq.read_schema(file).remove_metadata() == TRAJECTORY_SCHEMA
    r = run_opd(tmp_path / "fresh", "data", "import", str(file))
    assert r.exit_code == 0, r.output
    fresh = Store(tmp_path / "fresh").open("trajectories@latest")
    original = Store(root).open(traj_ref)
    assert fresh.read_table().to_pylist() == original.read_table().to_pylist()
    # the version holds the file's content hash; the lineage names the file and its sha256
    sha = sha256_file(file)
    assert fresh.config["source_sha256"] == sha and fresh.config["stage"]["source"] == file.name
    assert Store(tmp_path / "fresh").lineage(fresh.ref)["source"]["sha256"] == sha
    r = run_opd(tmp_path / "fresh", "show", str(fresh.ref))
    assert f"source: traj.parquet (sha256 {sha})" in r.output
    # the same file again is the same version; a moved copy too
    moved = tmp_path / "elsewhere" / file.name
    moved.parent.mkdir()
    shutil.copy(file, moved)
    r = run_opd(tmp_path / "fresh", "data", "import", str(moved))
    assert r.exit_code == 0 and f"{fresh.ref}  (existed)" in r.output, r.output
    # and it exports again to the same rows, its lineage naming the first file
    again = tmp_path / "again.parquet"
    assert run_opd(tmp_path / "fresh", "data", "export", "--out", str(again)).exit_code == 0
    assert pq.read_table(again).to_pylist() == pq.read_table(file).to_pylist()
    lineage = json.loads(pq.read_schema(again).metadata[META_KEY])["source"]["lineage"]
    assert lineage["source"]["sha256"] == sha


def test_generate_reads_no_prompts_from_a_source_file(made, tmp_path):
    _, _, _, _, file = made
    cfg = load_config("tiny")
    store = Store(tmp_path / "d")
    ctx = RunContext(store=store, target_loader=TargetLoader(cfg.target), progress=False)
    section = cfg.generate.model_copy(update={"source": str(file)})
    with pytest.raises(OpdError, match="does not read"):
        run_stage(generate.STAGE, section, {"prompts": write_prompts(store)}, ctx)
    res = run_stage(generate.STAGE, section, {}, ctx)
    assert res.dataset.inputs == {} and res.dataset.num_rows == 12


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"tokenizer_sha256": "0" * 64}, "was made with another tokenizer"),
        ({"chat_template_sha256": "0" * 64}, "was made with another chat template"),
    ],
)
def test_a_file_for_another_tokenizer_or_template_is_refused(made, tmp_path, change, message):
    other = tmp_path / "other.parquet"
    _rewrite_meta(made[4], other, **change)
    r = run_opd(tmp_path / "fresh", "data", "import", str(other))
    one_line_error(r, message)
    assert not (tmp_path / "fresh" / "trajectories").exists()


def test_a_corrupted_or_edited_file_is_refused(made, tmp_path):
    file = made[4]
    edited = tmp_path / "edited.parquet"
    table = pq.read_table(file)
    rows = table.to_pylist()
    rows[3]["input_ids"][-1] = (rows[3]["input_ids"][-1] + 1) % 500
    pq.write_table(
        type(table)
        .from_pylist(rows, schema=TRAJECTORY_SCHEMA)
        .replace_schema_metadata(table.schema.metadata),
        edited,
    )
    one_line_error(run_opd(tmp_path / "a", "data", "import", str(edited)), "content sha256")
    truncated = tmp_path / "truncated.parquet"
    truncated.write_bytes(file.read_bytes()[: file.stat().st_size // 2])
    one_line_error(run_opd(tmp_path / "a", "data", "import", str(truncated)), "not a readable")
    no_meta = tmp_path / "plain.parquet"
    pq.write_table(table.replace_schema_metadata(None), no_meta)
    one_line_error(run_opd(tmp_path / "a", "data", "import", str(no_meta)), "no opd-trajectories")
    assert Store(tmp_path / "a").listing("trajectories") == []  # nothing committed


def test_chat_jsonl_is_rendered_with_the_targets_template(tmp_path):
    chat = tmp_path / "chat.jsonl"
    conversations = [
        [{"role": "user", "content": "def add(a, b):"}, {"role": "assistant", "content": "return a + b"}],
        [
            {"role": "user", "content": "x = 1"},
            {"role": "assistant", "content": "y = 2"},
            {"role": "user", "content": "z"},
            {"role": "assistant", "content": "print(z)"},
        ],
    ]  # fmt: skip
    chat.write_text("".join(json.dumps({"messages": c}) + "\n" for c in conversations))
    r = run_opd(tmp_path / "d", "data", "import", str(chat), "--profile", "tiny")
    assert r.exit_code == 0, r.output
    rows = Store(tmp_path / "d").open("trajectories@latest").read_table().to_pylist()
    tok = TargetLoader(load_config("tiny").target).tokenizer
    assert [r["prompt_id"] for r in rows] == ["chat:1", "chat:2"]
    for row, conv in zip(rows, conversations, strict=True):
        whole = tok.apply_chat_template(conv, tokenize=True, return_dict=False)
        assert row["input_ids"] == list(whole)
        masked = [t for t, m in zip(row["input_ids"], row["loss_mask"], strict=True) if m]
        said = [m["content"] for m in conv if m["role"] == "assistant"]
        assert tok.decode(masked, skip_special_tokens=True).replace("\n", "") == "".join(said)
        assert masked.count(tok.eos_token_id) == len(said)  # each turn ends at its end token
        assert row["finish_reason"] == "eos" and not any(row["loss_mask"][: row["prompt_len"]])
    # a JSONL file names no target: the command needs one
    one_line_error(run_opd(tmp_path / "e", "data", "import", str(chat)), "names no target")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"messages": [{"role": "user", "content": "x"}]}) + "\n")
    one_line_error(
        run_opd(tmp_path / "e", "data", "import", str(bad), "--profile", "tiny"),
        "needs a user turn followed by an assistant turn",
    )


# ------------------------------------------------------------------------------ drafters


def _logits(store, ref, loader):
    d = load_drafter_dataset(store.open(ref), loader.target, loader.identity)
    return d.probe_logits(seed=0)


def test_a_drafter_round_trips_through_its_export_and_every_stage_takes_it(made, tmp_path):
    root, _, sft_ref, out, file = made
    record = json.loads((out / "opd_drafter.json").read_text())
    assert record["drafter"] == sft_ref and record["trained_depth"] == 3
    assert (
        record["target"]["path"] == "random" and "tokenizer_sha256" in record["target_fingerprint"]
    )
    fresh = tmp_path / "fresh"
    r = run_opd(fresh, "data", "import-drafter", str(out), *FP32)
    assert r.exit_code == 0, r.output
    imported = Store(fresh).open("sft@latest")
    assert imported.manifest["stage"] == "import-drafter"
    assert imported.meta["imported"]["drafter"] == sft_ref
    assert (
        Store(fresh).lineage(imported.ref)["source"]["sha256"]
        == imported.config["stage"]["source_sha256"]
    )
    assert imported.config["stage"]["ttt_steps"] == 3 and imported.config["stage"]["tau_k"] == 3
    original = Store(root).open(sft_ref)
    assert json.loads(imported.file(CONFIG_FILE).read_text()) == json.loads(
        original.file(CONFIG_FILE).read_text()
    )
    cfg = load_config("tiny")
    loader = TargetLoader(cfg.target)
    assert torch.equal(
        _logits(Store(root), sft_ref, loader), _logits(Store(fresh), str(imported.ref), loader)
    )
    assert (
        run_opd(fresh, "data", "import-drafter", str(out), *FP32)
        .output.strip()
        .endswith("(existed)")
    )

    store = Store(fresh)
    prompts = write_prompts(store)
    # evaluate, and SFT continued on the same trajectories (the features' map is the drafter's)
    r = run_opd(fresh, "eval", "--drafter", str(imported.ref), "--json", "--set",
                "evaluate.max_new_tokens=6")  # fmt: skip
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["lossless_t0"] is True
    ctx = RunContext(store=store, target_loader=loader, progress=False)
    traj = run_stage(generate.STAGE, cfg.generate.model_copy(update={"source": str(file)}), {}, ctx)
    feats = run_stage(features.STAGE, cfg.features, {"trajectories": traj.dataset}, ctx).dataset
    more = run_stage(sft.STAGE, cfg.sft, {"features": feats, "drafter": imported}, ctx).dataset
    assert more.inputs["drafter"] == str(imported.ref) and more.meta["steps"] == 6
    # and a Draft-OPD round from it
    rolled = run_stage(rollout.STAGE, cfg.rollout, {"prompts": prompts, "drafter": imported}, ctx)
    scored = run_stage(
        score.STAGE, cfg.score, {"rollouts": rolled.dataset, "drafter": imported}, ctx
    )
    inputs = {"replays": scored.dataset, "rollouts": rolled.dataset, "drafter": imported}
    trained = run_stage(opd.STAGE, cfg.opd, inputs, ctx).dataset
    assert trained.ref.name == "opd" and trained.meta["drafter_kind"] == "eagle3"


def test_a_drafter_dataset_directory_imports_as_well(made, tmp_path):
    root, _, sft_ref, _, _ = made
    src = Store(root).open(sft_ref).path
    r = run_opd(tmp_path / "fresh", "data", "import-drafter", str(src), *FP32)
    assert r.exit_code == 0, r.output
    imported = Store(tmp_path / "fresh").open("sft@latest")
    loader = TargetLoader(load_config("tiny").target)
    assert torch.equal(
        _logits(Store(root), sft_ref, loader), _logits(imported.store, str(imported.ref), loader)
    )


def test_a_drafter_for_another_target_or_a_tampered_one_is_refused(made, tmp_path):
    out = made[3]
    other = ["--set", "target.random.seed=1"]
    r = run_opd(tmp_path / "a", "data", "import-drafter", str(out), "--profile", "tiny", *other)
    one_line_error(r, "was made for another target (weights_sha256")
    tampered = tmp_path / "tampered"
    shutil.copytree(out, tampered)
    (tampered / "PROVENANCE.md").write_text("corpus, steps, held-out tau\n")  # notes are fine
    assert run_opd(tmp_path / "b", "data", "import-drafter", str(tampered), *FP32).exit_code == 0
    weights = tampered / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-5] ^= 0xFF
    weights.write_bytes(bytes(data))
    one_line_error(
        run_opd(tmp_path / "a", "data", "import-drafter", str(tampered), *FP32),
        "fails its checksums",
    )
    one_line_error(
        run_opd(tmp_path / "a", "data", "import-drafter", str(tmp_path), *FP32),
        "neither an `opd export`",
    )
    assert not (tmp_path / "a" / "sft").exists()


def test_a_bf16_export_imports_and_decodes_losslessly_beside_the_fp32_target(made, tmp_path):
    root, _, sft_ref, _, _ = made
    out = tmp_path / "bf16"
    r = run_opd(root, "export", "--drafter", sft_ref, "--out", str(out), "--dtype", "bfloat16")
    assert r.exit_code == 0 and "round trip: identical logits" in r.output, r.output
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    r = run_opd(tmp_path / "fresh", "data", "import-drafter", str(out), *FP32)
    assert r.exit_code == 0, r.output
    store = Store(tmp_path / "fresh")
    stored = json.loads(store.open("sft@latest").file(CONFIG_FILE).read_text())
    loader = TargetLoader(load_config("tiny").target)
    loaded = load_drafter_dataset(store.open("sft@latest"), loader.target, loader.identity)
    assert loaded.fc.weight.dtype == torch.float32  # upcast (exactly) beside the fp32 target
    assert stored["kind"] == "eagle3"
    write_prompts(store)
    r = run_opd(tmp_path / "fresh", "eval", "--json", "--set", "evaluate.max_new_tokens=6")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["lossless_t0"] is True


def test_sft_continues_an_imported_drafter_on_new_trajectories_with_its_map(made, tmp_path):
    out = made[3]
    fresh = tmp_path / "fresh"
    assert run_opd(fresh, "data", "import-drafter", str(out), *FP32).exit_code == 0
    chat = tmp_path / "new.jsonl"
    asks = [("x = 1", "y = x + 1"), ("def f():", "return 2"), ("a", "b = a"), ("for i", "in x:")]
    chat.write_text(
        "".join(
            json.dumps(
                {"messages": [{"role": "user", "content": u}, {"role": "assistant", "content": a}]}
            )
            + "\n"
            for u, a in asks
        )
    )
    assert run_opd(fresh, "data", "import", str(chat), "--profile", "tiny").exit_code == 0
    store = Store(fresh)
    imported = store.open("sft@latest")
    cfg = load_config("tiny")
    ctx = RunContext(store=store, target_loader=TargetLoader(cfg.target), progress=False)
    traj = store.open("trajectories@latest")
    own = run_stage(features.STAGE, cfg.features, {"trajectories": traj}, ctx).dataset
    with pytest.raises(OpdError, match="another draft-vocab map"):
        run_stage(sft.STAGE, cfg.sft, {"features": own, "drafter": imported}, ctx)
    inputs = {"trajectories": traj, "drafter": imported}
    feats = run_stage(features.STAGE, cfg.features, inputs, ctx).dataset
    assert (
        feats.file("draft_vocab.safetensors").read_bytes()
        == imported.file("draft_vocab.safetensors").read_bytes()
    )
    more = run_stage(sft.STAGE, cfg.sft, {"features": feats, "drafter": imported}, ctx).dataset
    assert more.inputs["drafter"] == str(imported.ref)
