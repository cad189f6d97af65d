"""Medusa through the pipeline: the whole chain on the tiny profile, Draft-OPD on its block form,
and typical acceptance opt-in, flagged lossy where it ran and refused where the target's law is
the product (rollout, score)."""

from __future__ import annotations

import json
import logging

import polars as pl
from click.testing import CliRunner

from cli.main import cli
from storage import Store

TYPICAL = "drafting.acceptance=typical"
TINY = ["--profile", "tiny", "--no-progress", "--set", "target.device=cpu"]


def _run(root, *args: str):
    return CliRunner().invoke(cli, ["--root", str(root), *args])


def test_the_full_chain_trains_and_evaluates_a_medusa_drafter(tmp_path):
    res = _run(tmp_path, "run", "full", *TINY, "--set", "drafter.kind=medusa")
    assert res.exit_code == 0, res.output
    store = Store(tmp_path)
    for name in ("sft", "opd"):
        ds = store.open(f"{name}@latest")
        assert json.loads((ds.path / "drafter_config.json").read_text())["kind"] == "medusa"
    rollouts = store.open("rollouts@latest")
    # the heads read the last hidden state alone: no cached feature shard stores aux layers
    for ds in (store.open("features@latest"), rollouts):
        shard = next(s for s in ds.shards("ipc") if s.startswith(("part-", "features-")))
        names = ds.read_ipc(shard).schema.names
        assert "last_hidden" in names and "aux_hidden" not in names, names
        assert ds.meta["hidden_states"] == ["last_hidden"]
    log = pl.read_parquet(rollouts.path / "rejections-*.parquet")
    assert set(log["drafter_kind"]) == {"medusa"}
    assert {"accepted", "rejected"} <= set(log["outcome"])
    evaluated = store.open("eval@latest").meta
    assert evaluated["tau"] >= 1.0 and "acceptance" not in evaluated  # lossless: the default
    assert evaluated["lossless_t0"] is True
    # Draft-OPD's block form: a loss that fits every replayed slot to a teacher that read a
    # rejected draft does not apply to heads that never read drafts, and says so in one line
    refused = _run(tmp_path, "run", "full", *TINY, "--set", "drafter.kind=medusa",
                   "--set", "opd.loss=tv")  # fmt: skip
    assert refused.exit_code != 0
    assert "does not apply to a block drafter" in refused.output.strip().splitlines()[-1]


def test_typical_acceptance_is_refused_for_rollout_and_score_before_any_work(tmp_path):
    for chain in ("full", "rollout", "score"):
        res = _run(tmp_path, "run", chain, *TINY, "--set", "drafter.kind=medusa",
                   "--set", "drafting.acceptance=typical")  # fmt: skip
        assert res.exit_code != 0
        last = res.output.strip().splitlines()[-1]
        assert "must keep the target's law" in last and "typical" in last, res.output
    assert not list(tmp_path.glob("*/*/manifest.json"))  # nothing was written


def test_typical_acceptance_in_evaluate_is_flagged_lossy(tmp_path, caplog):
    assert _run(tmp_path, "run", "sft-chain", *TINY, "--set", "drafter.kind=medusa").exit_code == 0
    sets = ["--set", "drafter.kind=medusa", "--set", "evaluate.temperature=1"]
    with caplog.at_level(logging.INFO, logger="opd"):
        plain = _run(tmp_path, "run", "evaluate", *TINY, *sets)
        assert plain.exit_code == 0, plain.output
        assert "[evaluate] tau=" in caplog.text and "LOSSY" not in caplog.text
        typical = _run(tmp_path, "run", "evaluate", *TINY, *sets, "--set", TYPICAL)
        assert typical.exit_code == 0, typical.output
        assert "(typical acceptance: LOSSY, not the target's law)" in caplog.text
    store = Store(tmp_path)
    versions = sorted(store.root.joinpath("eval").glob("*/manifest.json"))
    metas = [json.loads(p.read_text()) for p in versions]
    metas = [m for m in metas if m["config"]["stage"]["temperature"] == 1]
    assert len(metas) == 2  # typical acceptance is part of the version
    (lossy,) = [m["meta"] for m in metas if "acceptance" in m["meta"]]
    assert lossy["acceptance"] == "typical" and lossy["lossless"] is False
    assert (lossy["epsilon"], lossy["delta"]) == (0.09, 0.3)


def test_typical_thresholds_without_typical_acceptance_are_refused(tmp_path):
    res = _run(tmp_path, "run", "evaluate", *TINY, "--set", "drafting.typical.epsilon=0.05")
    assert res.exit_code != 0 and "drafting.acceptance=typical" in res.output


def test_more_drafts_than_heads_is_one_line_before_any_work(tmp_path):
    res = _run(tmp_path, "run", "sft-chain", *TINY, "--set", "drafter.kind=medusa",
               "--set", "drafter.heads=2")  # fmt: skip
    assert res.exit_code != 0
    last = res.output.strip().splitlines()[-1]
    assert "2" in last and "drafting" in last, res.output
