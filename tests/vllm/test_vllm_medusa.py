"""A Medusa drafter trained by the sft stage, exported in vLLM's Medusa format (full-vocabulary
heads: vLLM 0.32 cannot load a pruned one, models/medusa/export.py), served by vLLM's CPU engine:
lossless at T=0, and its tau close to the project's own decoder's on the same prompts (a head
offset one off, or the wrong hidden state, loads fine and shows up only as a tau collapse)."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from cli.main import cli
from pipeline.core.runner import run_stage
from pipeline.profiles import load_config
from pipeline.stages import features, sft
from storage import Dataset
from tests.vllm.conftest import SETS, UNAVAILABLE, Embedded

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(UNAVAILABLE is not None, reason=str(UNAVAILABLE)),
]

HEADS = 4  # vLLM serves one drafted token per head
# The heads start as the target's own head, so a few steps at a high rate already draft well:
# tau 1.70 after 12 steps (8 s here), 1.76 after 16, 1.12 after 10 at the default rate.
MEDUSA = [
    "drafter.kind=medusa",
    f"drafter.heads={HEADS}",
    f"drafting.k={HEADS}",
    f"drafting.ttt_steps={HEADS}",
    "sft.steps=12",
    "sft.lr=0.01",
]


@pytest.fixture(scope="module")
def medusa_sft(embedded: Embedded, generated: Dataset) -> Dataset:
    cfg = load_config("default", None, [*SETS, *MEDUSA])
    ctx = embedded.ctx
    feats = run_stage(features.STAGE, cfg.features, {"trajectories": generated}, ctx).dataset
    return run_stage(sft.STAGE, cfg.sft, {"features": feats}, ctx).dataset


def test_a_medusa_export_speculates_losslessly_in_vllm(embedded: Embedded, medusa_sft: Dataset):
    # `opd eval --backend vllm`'s path: export (medusa format, checksummed), engine, counters.
    sets = [a for s in [*SETS, *MEDUSA] for a in ("--set", s)]
    cmd = ["--root", str(embedded.store.root), "eval", "--drafter", str(medusa_sft.ref)]
    args = ["--k", str(HEADS), "--temperature", "0", "--json", "--backend", "vllm"]
    res = CliRunner().invoke(cli, [*cmd, *args, *sets])
    assert res.exit_code == 0, res.output
    stats = json.loads(res.stdout)
    keys = ("tau", "tau_vllm", "vllm_lossless", "vllm_matches_project")
    print(json.dumps({k: stats[k] for k in keys}))
    assert stats["vllm_lossless"] == 1.0  # vLLM's speculative output equals its plain greedy
    assert stats["vllm_matches_project"] >= 0.9
    assert stats["vllm_drafts"] > 0 and stats["tau"] > 1.4  # heads' drafts get accepted
    assert abs(stats["tau_vllm"] / stats["tau"] - 1) <= 0.10
