import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from models.tiny_target.train import TrainConfig, has_cxx_compiler, lr_at, sample_batch, train

from .conftest import tiny_config


def test_resume_continues_exactly_where_the_run_stopped(tiny_corpus, tiny_target, tmp_path):
    root, _ = tiny_corpus
    reference_dir, cfg, reference = tiny_target
    out, work = tmp_path / "out", tmp_path / "work"

    partial = train(cfg, out, work, stop_after=2)
    assert len(partial["train_loss"]) == 2 and not out.exists()
    resumed = train(cfg, out, work)

    assert resumed["train_loss_every_50"] == reference["train_loss_every_50"]
    assert resumed["eval"] == reference["eval"]
    a = load_file(reference_dir / "model.safetensors")
    b = load_file(out / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_training_lowers_the_loss(tiny_corpus, tmp_path):
    root, _ = tiny_corpus
    record = train(tiny_config(root, steps=30, warmup_steps=3), tmp_path / "o", tmp_path / "w")
    losses = json.loads((tmp_path / "o" / "opd_target.json").read_text())["training"]
    assert losses["steps"] == 30
    assert record["eval"][-1]["val_loss"] < np.log(300) - 1.0


def test_export_is_a_plain_hf_directory(tiny_target):
    out, cfg, _ = tiny_target
    model = AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    assert type(model).__name__ == "LlamaForCausalLM" and model.dtype == torch.bfloat16
    fp32 = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, local_files_only=True)
    tok = AutoTokenizer.from_pretrained(out, local_files_only=True)
    ids = tok("def f(x):\n", return_tensors="pt")["input_ids"]
    logits = fp32(input_ids=ids).logits
    assert logits.shape == (1, ids.shape[1], len(tok)) and torch.isfinite(logits).all()
    assert fp32.config.bos_token_id == tok.bos_token_id == fp32.generation_config.bos_token_id
    assert fp32.config.eos_token_id == tok.eos_token_id == fp32.generation_config.eos_token_id
    assert fp32.config.pad_token_id == tok.pad_token_id

    meta = json.loads((out / "opd_target.json").read_text())
    splits = meta["corpus"]["splits"]
    assert set(splits) == {"train", "validation", "heldout"}
    assert all(len(s["content_sha256"]) == 64 and s["modules"] for s in splits.values())
    assert meta["train_config"] == cfg.model_dump()


def test_checkpoint_of_another_config_is_refused(tiny_corpus, tmp_path):
    root, _ = tiny_corpus
    cfg = tiny_config(root)
    train(cfg, tmp_path / "o", tmp_path / "w", stop_after=1)
    ckpt = next((tmp_path / "w" / "runs").iterdir()) / "last.pt"
    state = torch.load(ckpt, weights_only=True)
    state["config"] = tiny_config(root, lr=0.5).model_dump_json()
    torch.save(state, ckpt)
    with pytest.raises(ValueError, match="different config"):
        train(cfg, tmp_path / "o", tmp_path / "w")


def test_schedule_warms_up_then_ends_at_min_lr():
    cfg = TrainConfig(steps=100, warmup_steps=10, lr=1e-3, min_lr_ratio=0.1)
    assert lr_at(0, cfg) == pytest.approx(1e-4)
    assert lr_at(9, cfg) == pytest.approx(1e-3)
    assert lr_at(10, cfg) == pytest.approx(1e-3)
    assert lr_at(100, cfg) == pytest.approx(1e-4)
    lrs = [lr_at(s, cfg) for s in range(10, 101)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:], strict=False))


def test_batches_are_a_function_of_seed_and_step():
    ids = np.arange(1000, dtype=np.uint16)
    a = sample_batch(ids, 4, 16, seed=0, step=5)
    assert torch.equal(a, sample_batch(ids, 4, 16, seed=0, step=5))
    assert not torch.equal(a, sample_batch(ids, 4, 16, seed=0, step=6))
    assert a.shape == (4, 17) and torch.equal(
        a[:, 1:] - a[:, :-1], torch.ones(4, 16, dtype=torch.long)
    )
    with pytest.raises(ValueError, match="fewer than seq_len"):
        sample_batch(ids[:10], 1, 16, seed=0, step=0)


def test_unknown_config_key_is_an_error():
    with pytest.raises(ValueError, match="extra"):
        TrainConfig(stepz=10)


@pytest.mark.skipif(not has_cxx_compiler(), reason="torch inductor needs a C++ compiler")
def test_compiled_training_matches_eager(tiny_corpus, tiny_target, tmp_path):
    # The real target trains compiled; the tiny fp32 run must follow the eager run's losses.
    root, _ = tiny_corpus
    _, cfg, eager = tiny_target
    compiled = train(cfg.model_copy(update={"compile": True}), tmp_path / "o", tmp_path / "w")
    assert compiled["eval"][-1]["val_loss"] == pytest.approx(
        eager["eval"][-1]["val_loss"], abs=1e-3
    )
    assert compiled["train_loss_every_50"] == pytest.approx(eager["train_loss_every_50"], abs=1e-3)


def test_compile_without_a_cxx_compiler_is_a_clear_error(tiny_corpus, tmp_path, monkeypatch):
    root, _ = tiny_corpus
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("CXX", raising=False)
    with pytest.raises(ValueError, match="C\\+\\+ compiler.*compile"):
        train(tiny_config(root, compile=True), tmp_path / "o", tmp_path / "w")
    assert not (tmp_path / "o").exists() and not (tmp_path / "w").exists()
