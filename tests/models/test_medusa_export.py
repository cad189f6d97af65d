"""Medusa's vLLM export on the CPU alone: the layout vLLM's Medusa loads, a round trip to identical
logits, full-vocabulary heads whose argmax is the draft vocab's, and a corrupt export refused by
name (vLLM itself is exercised in tests/vllm/test_vllm_medusa.py)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from models.drafter import ExportTarget
from models.export import read_export, round_trip_diff, write_export
from models.export_format import CONFIG_FILE, PROVENANCE_KEY, WEIGHTS_FILE, ExportError
from models.medusa.drafter import MedusaDrafter
from models.medusa.export import export_medusa, read_medusa_export
from models.vocab import DraftVocab

DRAFT_VOCAB = 40
HEADS = 3


@pytest.fixture
def drafter(tiny_llama) -> MedusaDrafter:
    counts = torch.randperm(tiny_llama.vocab_size, generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    drafter = MedusaDrafter.new(
        tiny_llama, DraftVocab.from_counts(counts.float(), DRAFT_VOCAB), {"heads": HEADS}
    )
    with torch.no_grad():  # trained-looking: blocks off zero, heads apart
        for p in drafter.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    return drafter.eval()


def _export(drafter, target, path, k=HEADS):
    serves = ExportTarget(target.config, {"name": "tiny"}, target.embed_weight)
    return write_export(drafter, "medusa", path, serves, k=k)


def test_medusa_export_has_vllms_layout_and_round_trips_exactly(drafter, tiny_llama, tmp_path):
    _export(drafter, tiny_llama, tmp_path)
    config = json.loads((tmp_path / CONFIG_FILE).read_text())
    V, H = tiny_llama.vocab_size, tiny_llama.config.hidden_size
    assert config["architectures"] == ["MedusaModel"] and config["model_type"] == "medusa"
    assert (config["vocab_size"], config["truncated_vocab_size"], config["hidden_size"]) == (
        V,
        V,
        H,
    )
    assert (config["num_heads"], config["num_hidden_layers"]) == (HEADS, 1)
    assert config[PROVENANCE_KEY]["drafter_kind"] == "medusa"
    # vLLM's MedusaConfig renames every top-level key holding "num" and "heads" / "layers"
    assert [k for k in config if "num" in k] == ["num_heads", "num_hidden_layers"]
    tensors = load_file(str(tmp_path / WEIGHTS_FILE))
    assert {n: tuple(t.shape) for n, t in tensors.items() if n.startswith(("lm_", "blocks"))} == {
        **{f"lm_heads.{i}.weight": (V, H) for i in range(HEADS)},
        **{f"blocks.{i}.layers.0.weight": (H, H) for i in range(HEADS)},
    }
    back = read_export(tmp_path, tiny_llama.embed_weight)
    assert isinstance(back, MedusaDrafter)
    assert torch.equal(back.d2t, drafter.d2t) and torch.equal(back.t2d, drafter.t2d)
    assert round_trip_diff(drafter, tmp_path, tiny_llama.embed_weight) == 0.0


def test_full_vocab_heads_draft_the_draft_vocabs_argmax(drafter, tiny_llama, tmp_path):
    # vLLM takes each [V, H] head's argmax over the whole vocabulary: never a non-draft token.
    _export(drafter, tiny_llama, tmp_path)
    tensors = load_file(str(tmp_path / WEIGHTS_FILE))
    hidden = torch.randn(
        4096, tiny_llama.config.hidden_size, generator=torch.Generator().manual_seed(1)
    )
    with torch.no_grad():
        ours = drafter(hidden).argmax(-1)  # [S, N] draft ids
        for i, block in enumerate(drafter.blocks):
            theirs = (block(hidden) @ tensors[f"lm_heads.{i}.weight"].T).argmax(-1)  # target ids
            assert torch.equal(theirs, drafter.vocab.draft_to_target_ids[ours[:, i]])


def edit_config(path, change):
    config = json.loads((path / CONFIG_FILE).read_text())
    change(config)
    (path / CONFIG_FILE).write_text(json.dumps(config))


def edit_tensors(path, change):
    tensors = load_file(str(path / WEIGHTS_FILE))
    change(tensors)
    save_file(tensors, str(path / WEIGHTS_FILE))


def _bump_non_draft_row(tensors):
    head, t2d = tensors["lm_heads.1.weight"], tensors["t2d"]
    head[int((~t2d).nonzero()[0])] += 1.0


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda p: (p / CONFIG_FILE).write_text("{"), "config.json is not readable JSON"),
        (lambda p: edit_config(p, lambda c: c.update(architectures=["X"])), "is not Medusa"),
        (lambda p: edit_config(p, lambda c: c.pop("num_heads")), "no Medusa config"),
        (lambda p: edit_tensors(p, lambda t: t.pop("lm_heads.2.weight")), "lm_heads.2.weight"),
        (lambda p: edit_tensors(p, lambda t: t.pop("d2t")), r"missing tensors \['d2t'\]"),
        (
            lambda p: edit_tensors(p, lambda t: t.update({"lm_heads.0.bias": torch.zeros(96)})),
            r"unexpected tensors \['lm_heads.0.bias'\]",
        ),
        (
            lambda p: edit_tensors(
                p, lambda t: t.update({"blocks.1.layers.0.weight": torch.zeros(32, 16)})
            ),
            "'blocks.1.layers.0.weight' has shape",
        ),
        (lambda p: edit_tensors(p, _bump_non_draft_row), "'lm_heads.1.weight' is corrupt"),
        (
            lambda p: edit_tensors(p, lambda t: t["t2d"].copy_(~t["t2d"])),
            "draft vocab map",
        ),
    ],
)
def test_a_corrupt_medusa_export_is_refused_by_name(drafter, tiny_llama, tmp_path, edit, message):
    _export(drafter, tiny_llama, tmp_path)
    edit(tmp_path)
    with pytest.raises(ExportError, match=message):
        read_medusa_export(tmp_path)
    with pytest.raises(ExportError, match=message):
        read_export(tmp_path, tiny_llama.embed_weight)


def test_export_refuses_more_tokens_than_heads_and_a_foreign_target(drafter, tiny_llama, tmp_path):
    with pytest.raises(
        ExportError, match=f"4 drafted tokens need 4 heads, this drafter has {HEADS}"
    ):
        _export(drafter, tiny_llama, tmp_path / "a", k=HEADS + 1)
    other = ExportTarget({"vocab_size": 128, "hidden_size": 32}, None, tiny_llama.embed_weight)
    with pytest.raises(ExportError, match="vocab size: the drafter's is 96, the target's 128"):
        write_export(drafter, "medusa", tmp_path / "b", other, k=HEADS)


def test_a_bf16_export_reads_back_to_the_bf16_heads(drafter, tmp_path):
    export_medusa(drafter, tmp_path, dtype=torch.bfloat16)
    _, tensors = read_medusa_export(tmp_path)
    for i, head in enumerate(drafter.heads):
        assert torch.equal(tensors[f"heads.{i}.weight"], head.weight.detach().bfloat16())
    assert tensors["d2t"].dtype == torch.int64 and torch.equal(tensors["d2t"], drafter.d2t)
