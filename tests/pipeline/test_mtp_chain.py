"""MTP through the pipeline: the whole chain on the tiny profile (SFT, Draft-OPD rounds on its
chain form, evaluate), its export refused in one line, and more modules than the unrolled
depths refused in one line."""

from __future__ import annotations

import json

import polars as pl
from click.testing import CliRunner

from cli.main import cli
from pipeline.profiles import load_config
from storage import Store

TINY = ["--profile", "tiny", "--no-progress", "--set", "target.device=cpu"]
MTP = ["--set", "drafter.kind=mtp"]


def _run(root, *args: str):
    return CliRunner().invoke(cli, ["--root", str(root), *args])


def test_the_full_chain_trains_and_evaluates_an_mtp_drafter(tmp_path):
    res = _run(tmp_path, "run", "full", *TINY, *MTP)
    assert res.exit_code == 0, res.output
    store = Store(tmp_path)
    for name in ("sft", "opd"):
        ds = store.open(f"{name}@latest")
        assert json.loads((ds.path / "drafter_config.json").read_text())["kind"] == "mtp"
    log = pl.read_parquet(store.open("rollouts@latest").path / "rejections-*.parquet")
    assert set(log["drafter_kind"]) == {"mtp"}
    assert log["offset"].max() == 3  # K = 3 drafts from one module: the last one reused
    evaluated = store.open("eval@latest").meta
    assert evaluated["tau"] >= 1.0 and evaluated["lossless_t0"] is True
    refused = _run(tmp_path, "export", "--drafter", "opd@latest", "--out", str(tmp_path / "x"))
    assert refused.exit_code != 0
    lines = refused.output.strip().splitlines()
    assert len(lines) == 1 and "exports nothing: vLLM" in lines[0], refused.output


def test_more_modules_than_unrolled_depths_are_refused_before_any_dataset(tmp_path):
    res = _run(tmp_path, "run", "sft-chain", *TINY, *MTP, "--set", "drafter.modules=4")
    assert res.exit_code != 0
    last = res.output.strip().splitlines()[-1]
    assert "drafting.ttt_steps (3)" in last and "raise drafting.ttt_steps" in last
    assert not list(tmp_path.glob("*/*/manifest.json"))
    fits = load_config("tiny", sets=["drafter.kind=mtp", "drafter.modules=3"])  # 3 depths
    assert fits.sft.drafter.trained_depth() == fits.sft.ttt_steps == 3
