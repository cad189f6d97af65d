"""A kind that needs no training through the pipeline (the registry's free baseline, prompt
lookup): the sft chain featurizes nothing for it and writes its drafter untrained, evaluate,
rollout and tune take it, Draft-OPD refuses it in one line, and every other drafter's
evaluation reports it beside on the same prompts, decoded once per prompts and settings."""

from __future__ import annotations

import json

import pyarrow as pa
from click.testing import CliRunner

from cli.main import cli
from pipeline.core.drafters import baseline_kind
from storage import Store

TINY = ["--profile", "tiny", "--no-progress", "--set", "target.device=cpu"]
KIND = baseline_kind().name


def _run(root, *args: str):
    return CliRunner().invoke(cli, ["--root", str(root), *args])


def _last_line(res) -> str:
    return res.output.strip().splitlines()[-1]


def test_the_sft_chain_writes_it_untrained_and_others_are_read_beside_it(tmp_path):
    res = _run(tmp_path, "run", "sft-chain", *TINY, "--set", f"drafter.kind={KIND}")
    assert res.exit_code == 0, res.output
    store = Store(tmp_path)
    feats = store.open("features@latest")
    schema = pa.ipc.open_file(feats.path / "part-00000.arrow").schema
    assert not {"aux_hidden", "last_hidden"} & set(schema.names)  # it reads no target state
    drafter = store.open("sft@latest")
    assert drafter.meta["untrained"] is True and drafter.meta["drafter_kind"] == KIND
    assert json.loads((drafter.path / "drafter_config.json").read_text())["kind"] == KIND
    own = store.open("eval@latest").meta
    assert own["tau"] > 1.0  # the tiny target's greedy text repeats: lookups get accepted
    assert "free_baseline" not in own and "tau_untrained" not in own  # it is the baseline
    # a trained kind's evaluation on the same prompts and settings reports it beside
    assert _run(tmp_path, "run", "sft-chain", *TINY).exit_code == 0
    trained = store.open("eval@latest").meta
    assert trained["drafter"] != own["drafter"]
    free = trained["free_baseline"]
    assert free["kind"] == KIND and "cached" not in free
    assert (free["tau"], free["alpha"]) == (own["tau"], own["alpha"])
    assert free["speedup"] > 0
    again = _run(tmp_path, "eval", "--profile", "tiny", "--set", "target.device=cpu", "--force")
    assert again.exit_code == 0, again.output
    assert f"tau={own['tau']:.3f}" in again.output and "(cached)" in again.output
    # rollout and tune take it; it drafts deeper than the sft config's ttt_steps (untrained)
    sets = ["--set", f"drafter.kind={KIND}", "--input", f"drafter={drafter.ref}"]
    deeper = ["--set", "drafting.k=5", "--set", "drafting.ttt_steps=5"]  # sft@ had 3
    rolled = _run(tmp_path, "run", "rollout", *TINY, *sets, *deeper)
    assert rolled.exit_code == 0, rolled.output
    assert store.open("rollouts@latest").meta["drafter_kind"] == KIND
    tuned = _run(tmp_path, "tune", "--drafter", str(drafter.ref), "--profile", "tiny",
                 "--set", "target.device=cpu")  # fmt: skip
    assert tuned.exit_code == 0, tuned.output
    # Draft-OPD refuses it in one line, before any work
    scored = _run(tmp_path, "run", "score", *TINY, "--input", f"drafter={drafter.ref}")
    assert scored.exit_code != 0 and "needs no training" in _last_line(scored)
    assert not (tmp_path / "replays").exists()


def test_draft_opd_refuses_it_before_any_dataset(tmp_path):
    res = _run(tmp_path, "run", "full", *TINY, "--set", f"drafter.kind={KIND}")
    assert res.exit_code != 0
    assert "needs no training" in _last_line(res) and "Draft-OPD" in _last_line(res)
    assert not list(tmp_path.glob("*/*/manifest.json"))
