"""The committed EAGLE-3 drafter for SmolLM2 (`assets/smollm2/eagle3`): imported into a fresh
data root with `opd data import-drafter`, it decodes SmolLM2 in fp32 at T=0 exactly as plain
greedy decoding does, accepting drafts (τ above 1).

The drafter is an asset of the repository: missing, the test fails (it is never skipped).
`OPD_TEST_SMOLLM2_DRAFTER=DIR` points it at another export of a SmolLM2 drafter."""

import os
from pathlib import Path

import pytest
from click.testing import CliRunner

from cli.main import cli
from models import smollm2
from models.decoding import target_generate
from pipeline.core.decoders import decoder
from pipeline.core.drafters import load_drafter_dataset
from pipeline.core.targets import TargetConfig, TargetLoader
from pipeline.core.tuning import trained_k
from storage import Store

REPO = Path(__file__).resolve().parents[2]
DRAFTER = Path(os.environ.get("OPD_TEST_SMOLLM2_DRAFTER", REPO / "assets" / "smollm2" / "eagle3"))
ASKS = (
    "Write a Python function that returns the sum of the squares of a list of numbers.",
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in "
    "May. How many clips did Natalia sell altogether in April and May?",
)


@pytest.mark.slow
def test_the_committed_drafter_decodes_smollm2_losslessly_and_accepts_drafts(tmp_path, monkeypatch):
    if not (DRAFTER / "config.json").is_file():
        pytest.fail(
            f"the committed SmolLM2 drafter is missing: {DRAFTER} has no config.json (it is "
            "an asset of the repository: restore assets/smollm2/eagle3)"
        )
    root = tmp_path / "data"
    monkeypatch.setenv("OPD_HOME", str(root))
    smollm2.get(root, say=lambda _: None)
    fp32 = ["--set", "target.path=smollm2", "--set", "target.dtype=float32"]
    r = CliRunner().invoke(
        cli, ["--root", str(root), "data", "import-drafter", str(DRAFTER), *fp32]
    )
    assert r.exit_code == 0, r.output
    loader = TargetLoader(TargetConfig(path="smollm2", dtype="float32"))
    ds = Store(root).open("sft@latest")
    drafter = load_drafter_dataset(ds, loader.target, loader.identity)
    tok = loader.tokenizer
    prompts = [
        list(
            tok.apply_chat_template(
                [{"role": "user", "content": ask}],
                tokenize=True,
                add_generation_prompt=True,
                return_dict=False,
            )
        )
        for ask in ASKS
    ]
    k = trained_k(ds) or 3
    spec = decoder(k, None, 0.0, 48, 0)(loader.target, drafter, prompts)
    plain = target_generate(loader.target, prompts, 48, 0.0, 0)
    assert spec.sequences == plain.sequences
    accepted = spec.steps["accepted"]
    tau = 1 + sum(accepted) / len(accepted)
    assert tau > 1.0, f"tau {tau:.3f} at K={k}: the drafter accepted nothing"
