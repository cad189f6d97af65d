"""A DFlash drafter trained by the sft stage, exported in vLLM's dflash format, served by vLLM's
CPU engine: lossless at T=0, and its tau close to the project's own decoder's on the same prompts
(a format mistake, e.g. off-by-one target layer ids or the wrong rope, loads fine and shows up
only as a tau collapse)."""

from __future__ import annotations

import json

import pytest

from models import vllm_engine
from models.decoding import SpecConfig, speculative_generate
from models.dflash.export import export_dflash
from models.drafter import ChainShape
from models.drafters import load_drafter
from pipeline.core.runner import run_stage
from pipeline.profiles import load_config
from pipeline.stages import features, sft
from tests.vllm.conftest import SETS, UNAVAILABLE, Embedded, K

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(UNAVAILABLE is not None, reason=str(UNAVAILABLE)),
]


def test_a_dflash_export_speculates_losslessly_in_vllm(embedded: Embedded, generated, tmp_path):
    # a block of K+1: vLLM feeds [bonus, K mask tokens], the block the drafter was trained on
    cfg = load_config(
        "default", None, [*SETS, "drafter.kind=dflash", f"drafter.block_size={K + 1}"]
    )
    ctx = embedded.ctx
    feats = run_stage(features.STAGE, cfg.features, {"trajectories": generated}, ctx).dataset
    ds = run_stage(sft.STAGE, cfg.sft, {"features": feats}, ctx).dataset
    target = embedded.target
    drafter = load_drafter(ds.path, target.embed_weight, kind="dflash").eval()
    out = export_dflash(drafter, tmp_path / "dflash")

    prompts = embedded.heldout()
    n = cfg.evaluate.max_new_tokens
    ours = speculative_generate(
        target, drafter, prompts, SpecConfig(ChainShape(K), max_new_tokens=n)
    ).stats["tau"]
    plain = embedded.plain
    spec = vllm_engine.EngineSpec(plain.model, plain.dtype, str(out), K, method="dflash")
    with vllm_engine.running(spec):
        outs, spent = vllm_engine.speculate(
            spec, prompts, max_new_tokens=n, stop_ids=target.eos_token_ids
        )
    reference = vllm_engine.generate(
        plain, prompts, max_new_tokens=n, stop_ids=target.eos_token_ids
    )
    same = sum(a == list(b) for a, (b, _) in zip(outs, reference, strict=True))
    print(json.dumps({"tau_project": ours, "tau_vllm": spent.tau, "identical": same}))
    assert same == len(prompts)
    assert spent.drafts > 0 and ours > 1.2
    assert abs(spent.tau - ours) <= 0.1 * ours
