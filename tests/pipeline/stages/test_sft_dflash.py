"""Stage `sft` training a DFlash drafter (`drafter.kind=dflash`) on tiny features: it learns,
records its kind, resumes bit for bit, and EAGLE-3 versions stay what they were."""

import shutil

import polars as pl
import pytest
import torch
from safetensors.torch import load_file

from models.dflash import DFlashSettings
from models.dflash.drafter import DFlashDrafter
from models.drafters import load_drafter, recorded_kind
from pipeline.core import drafters, training, validation
from pipeline.core.checks import vocab_of
from pipeline.core.config import version_dict
from pipeline.core.export import export_drafter
from pipeline.core.runner import run_stage
from pipeline.core.trainer import TrainingStopped
from pipeline.profiles import load_config
from pipeline.stages import sft
from storage import OpdError
from tests.pipeline.stages.test_sft import tiny_features  # noqa: F401 (a fixture)

DFLASH = DFlashSettings(block_size=4, layers=1)
FAST = dict(batch_size=4, val_share=0.2, ttt_steps=3, tau_k=3, bf16=False, drafter=DFLASH)


def test_dflash_sft_raises_validation_tau_over_an_untrained_drafter(tiny_features):  # noqa: F811
    store, ctx, feats = tiny_features
    cfg = sft.Config(steps=40, val_every=20, lr=1e-2, **FAST)
    ds = run_stage(sft.STAGE, cfg, {"features": feats}, ctx).dataset
    assert recorded_kind(ds.path) == "dflash" and ds.meta["drafter_kind"] == "dflash"
    target = ctx.target_loader.target
    drafter = load_drafter(ds.path, target.embed_weight, kind="dflash")
    assert isinstance(drafter, DFlashDrafter) and drafter.config.block_size == 4

    index = training.FeatureIndex(feats, validation.FEATURE_COLUMNS)
    _, val_rows = training.holdout_split(index.keys, cfg.val_share, cfg.seed)
    loader = training.FeatureLoader(index, val_rows, batch_size=4, max_tokens=4096, shuffle=False)
    how = dict(ttt_steps=3, tau_k=3, temperature=1.0, step_decay=0.8, bf16=False)
    trained = sft.validate(drafter, loader, target, **how)
    fresh = sft.validate(drafter.untrained(), loader, target, **how)
    val = pl.read_parquet(ds.file(drafters.METRICS_FILE)).filter(pl.col("kind") == "val")
    assert val["tau_chain"][-1] == trained["tau_chain"]  # the stage validated this drafter
    # The tiny profile's random target is near-uniform to any drafter: 40 steps of EAGLE-3 reach
    # the same expected tau (1.149 vs dflash's 1.149); tests/models/test_dflash.py checks a
    # large rise of the greedy tau on a peaked target.
    assert trained["loss"] < fresh["loss"]
    assert trained["tau_expected"] > fresh["tau_expected"], (trained, fresh)


def test_dflash_sft_resumes_bit_for_bit(tiny_features):  # noqa: F811
    store, ctx, feats = tiny_features
    cfg = sft.Config(steps=6, val_every=3, **FAST)
    stop = cfg.model_copy(update={"stop_after_steps": 4, "checkpoint_every": 2})
    with pytest.raises(TrainingStopped):
        run_stage(sft.STAGE, stop, {"features": feats}, ctx)
    work = store.root / "_work" / "sft"
    (version,) = [p.name for p in work.iterdir()]
    shutil.rmtree(training.Checkpointer(work / version).path(4))  # resume from step 2
    resumed = run_stage(sft.STAGE, cfg, {"features": feats}, ctx).dataset
    fresh = run_stage(sft.STAGE, cfg, {"features": feats}, ctx, force=True).dataset
    a, b = load_file(resumed.file("model.safetensors")), load_file(fresh.file("model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_the_drafter_section_leaves_eagle3_versions_unchanged_and_is_strict():
    plain = load_config("tiny")
    assert "drafter" not in version_dict(plain.sft)
    named = load_config("tiny", sets=["drafter.kind=eagle3"])
    assert version_dict(named.sft) == version_dict(plain.sft)
    dflash = load_config("tiny", sets=["drafter.kind=dflash", "drafter.block_size=8"])
    assert version_dict(dflash.sft)["drafter"]["kind"] == "dflash"
    assert version_dict(dflash.sft) != version_dict(plain.sft)
    assert "head" not in version_dict(dflash.sft)["drafter"]  # unset: versions stay as they were
    target_head = load_config("tiny", sets=["drafter.kind=dflash", "drafter.head=target"])
    assert version_dict(target_head.sft)["drafter"]["head"] == "target"
    bad = (
        (["drafter.block_size=8"], "DFlash setting"),
        (["drafter.head=target"], "drafter.head is a DFlash setting"),
        (["drafter.kind=dflash", "drafter.head=shared"], "head"),
        (["drafter.kind=dflash", "drafter.block_size=3"], "raise drafter.block_size"),
        (["drafter.kind=dflash", "drafter.blocks=3"], "blocks"),
        (["drafter.kind=nosuchkind"], "kind"),
        # with no kind named, a setting is the default kind's (not "unable to extract tag")
        (["drafter.nosuchsetting=1"], "drafter.nosuchsetting: Extra inputs are not permitted"),
    )
    for sets, message in bad:
        with pytest.raises(Exception, match=message):
            load_config("tiny", sets=sets)


def test_a_dflash_drafter_exports_in_its_own_format_only(tiny_features, tmp_path):  # noqa: F811
    store, ctx, feats = tiny_features
    ds = run_stage(sft.STAGE, sft.Config(steps=2, **FAST), {"features": feats}, ctx).dataset
    for fmt in ("eagle3", "speculators"):
        with pytest.raises(OpdError, match=f"exports as dflash, not '{fmt}'"):
            export_drafter(ds, ctx.target_loader, fmt, tmp_path / fmt, 3)
        assert not (tmp_path / fmt).exists()
    # its kind's format is the default; vLLM drafts a whole block whatever K was asked for
    info = export_drafter(ds, ctx.target_loader, None, tmp_path / "out", 2)
    assert info["format"] == "dflash" and info["max_logit_diff"] == 0.0
    assert '"method": "dflash"' in info["vllm_command"]
    assert f'"num_speculative_tokens": {DFLASH.block_size - 1}' in info["vllm_command"]
    assert info["tree_note"] is None  # EAGLE-3's note on trees does not apply to a block


def test_sft_never_moves_a_target_head(tiny_features, tmp_path):  # noqa: F811
    store, ctx, feats = tiny_features
    head = DFlashSettings(block_size=4, layers=1, head="target")
    cfg = sft.Config(steps=3, lr=1e-2, **(FAST | {"drafter": head}))
    ds = run_stage(sft.STAGE, cfg, {"features": feats}, ctx).dataset
    target = ctx.target_loader.target
    trained = load_drafter(ds.path, target.embed_weight, kind="dflash")
    assert trained.config.head == "target" and not trained.lm_head.weight.requires_grad
    assert torch.equal(trained.lm_head.weight, target.lm_head_weight)  # bit for bit
    fresh = sft.new_drafter(target, trained.vocab, cfg.seed, head)
    assert not torch.equal(trained.fc.weight, fresh.fc.weight)  # the rest did train
    # Its identity map reads data made with the features' pruned one (continued SFT, export).
    assert vocab_of(feats)["d2t"].numel() < target.vocab_size
    more = cfg.model_copy(update={"steps": 1})
    run_stage(sft.STAGE, more, {"features": feats, "drafter": ds}, ctx)
    info = export_drafter(ds, ctx.target_loader, None, tmp_path / "out", 3)
    assert info["format"] == "dflash" and info["max_logit_diff"] == 0.0
