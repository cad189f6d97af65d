"""Export: both serving layouts round-trip to identical logits; every broken invariant is refused."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig

from models.eagle3.drafter import Eagle3Drafter
from models.eagle3.export import (
    ExportError,
    export_eagle3,
    export_speculators,
)
from models.eagle3.model import Eagle3Config
from models.vocab import DraftVocab

LAYER_TENSORS = [
    "input_layernorm.weight",
    "hidden_norm.weight",
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "post_attention_layernorm.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
]
DRAFT_VOCAB = 40


@pytest.fixture
def drafter(tiny_llama) -> Eagle3Drafter:
    torch.manual_seed(0)
    vocab = DraftVocab.from_counts(torch.randint(0, 1000, (tiny_llama.vocab_size,)), DRAFT_VOCAB)
    config = Eagle3Config.from_target(tiny_llama.config, DRAFT_VOCAB, tiny_llama.aux_layer_ids)
    model = Eagle3Drafter(config, tiny_llama.embed_weight, vocab)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.copy_(torch.randn_like(p) * 0.3 + (1.0 if p.dim() == 1 else 0.0))
    return model


def target_dict(target, **changes):
    return {**target.config.to_dict(), **changes}


def logits_of(drafter, target):
    torch.manual_seed(1)
    ids = torch.randint(0, target.vocab_size, (2, 9))
    out = target(ids)
    return drafter(ids, drafter.fuse(out.aux_hidden), torch.arange(9).expand(2, -1))[0]


def export_native(drafter, target, path):
    return export_eagle3(drafter, target.config, path, target_identity=target.identity)


def export_spec(drafter, target, path):
    return export_speculators(drafter, target.config, path, verifier_name_or_path="/models/tiny")


# ----------------------------------------------------------------------------- round trips


def test_native_export_layout_and_round_trip(drafter, tiny_llama, tmp_path):
    export_native(drafter, tiny_llama, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["model_type"] == "llama" and config["num_hidden_layers"] == 1
    assert config["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    assert config["eagle_config"] == {
        "eagle_aux_hidden_state_layer_ids": [1, 2, 3],
        "use_aux_hidden_state": True,
    }
    assert (
        config["draft_vocab_size"] == DRAFT_VOCAB and config["vocab_size"] == tiny_llama.vocab_size
    )
    assert config["target_hidden_size"] == config["hidden_size"] == tiny_llama.hidden_size
    assert config["norm_before_residual"] is False and config["tie_word_embeddings"] is False
    assert config["max_position_embeddings"] == tiny_llama.config.max_position_embeddings
    assert config["opd_pipeline"]["target"]["vocab_size"] == tiny_llama.vocab_size
    tensors = load_file(str(tmp_path / "model.safetensors"))
    expected = {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"} | {
        f"midlayer.{n}" for n in LAYER_TENSORS
    }
    assert set(tensors) == expected  # no embed_tokens: vLLM shares the target's
    assert tensors["lm_head.weight"].shape == (DRAFT_VOCAB, tiny_llama.hidden_size)
    assert tensors["fc.weight"].shape == (tiny_llama.hidden_size, 3 * tiny_llama.hidden_size)
    assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool
    assert int(tensors["t2d"].sum()) == DRAFT_VOCAB
    # vLLM parses config.json with transformers: the rope and context it sees must be the target's.
    parsed = LlamaConfig.from_dict(config)
    assert parsed.rope_parameters == tiny_llama.config.rope_parameters
    assert parsed.head_dim == drafter.config.head_dim
    loaded = Eagle3Drafter.read_export(tmp_path, tiny_llama.embed_weight)
    assert loaded.config == drafter.config
    assert torch.equal(logits_of(loaded, tiny_llama), logits_of(drafter, tiny_llama))


def test_speculators_export_layout_and_round_trip(drafter, tiny_llama, tmp_path):
    export_speculators(
        drafter,
        tiny_llama.config,
        tmp_path,
        verifier_name_or_path="/models/tiny",
        speculative_tokens=5,
    )
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["speculators_model_type"] == "eagle3"
    assert "norm_before_residual" in config and config["norm_before_residual"] is False
    assert config["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    assert config["draft_vocab_size"] == DRAFT_VOCAB
    spec = config["speculators_config"]
    assert spec["algorithm"] == "eagle3" and spec["default_proposal_method"] == "greedy"
    assert spec["proposal_methods"][0]["speculative_tokens"] == 5
    assert spec["verifier"]["name_or_path"] == "/models/tiny"
    layer = config["transformer_layer_config"]
    assert layer["model_type"] == "llama" and layer["num_hidden_layers"] == 1
    assert LlamaConfig.from_dict(layer).rope_parameters == tiny_llama.config.rope_parameters
    tensors = load_file(str(tmp_path / "model.safetensors"))
    expected = {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"} | {
        f"layers.0.{n}" for n in LAYER_TENSORS
    }
    # self-contained: the target's embedding travels with the drafter
    assert set(tensors) == expected | {"embed_tokens.weight"}
    assert torch.equal(tensors["embed_tokens.weight"], tiny_llama.embed_weight)
    loaded = Eagle3Drafter.read_export(tmp_path, tiny_llama.embed_weight)
    assert torch.equal(logits_of(loaded, tiny_llama), logits_of(drafter, tiny_llama))


def test_bf16_export_keeps_vocab_map_integral(drafter, tiny_llama, tmp_path):
    export_eagle3(drafter, tiny_llama.config, tmp_path, dtype=torch.bfloat16)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    assert tensors["fc.weight"].dtype == torch.bfloat16
    assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool
    assert json.loads((tmp_path / "config.json").read_text())["torch_dtype"] == "bfloat16"
    loaded = Eagle3Drafter.read_export(tmp_path, tiny_llama.embed_weight)
    assert loaded.fc.weight.dtype == torch.bfloat16
    want = logits_of(drafter.to(torch.bfloat16), tiny_llama)
    assert torch.equal(logits_of(loaded, tiny_llama), want)


# ----------------------------------------------------------------------------- export refusals


def corrupt_d2t(drafter, _):
    drafter.d2t[1] = drafter.d2t[0] - 1  # draft id 1 now maps onto draft id 0's target


def corrupt_t2d(drafter, _):
    drafter.t2d[drafter.vocab.draft_to_target_ids[0]] = False


@pytest.mark.parametrize(
    ("corrupt", "target_changes", "message"),
    [
        (None, {"num_hidden_layers": 3}, "aux layer ids"),
        (corrupt_d2t, {}, "draft vocab map.*strictly increasing"),
        (corrupt_t2d, {}, "draft vocab map"),
        (None, {"hidden_size": 48}, "fc input"),
        (None, {"vocab_size": 97}, "draft vocab map: t2d covers 96"),
        (None, {"rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}}, "rope"),
        (None, {"max_position_embeddings": 4096}, "max positions"),
        (None, {"model_type": "mistral"}, "refuses 'mistral' targets.*supports llama, qwen"),
    ],
)
def test_export_refuses_broken_invariants(
    drafter, tiny_llama, tmp_path, corrupt, target_changes, message
):
    if corrupt:
        corrupt(drafter, tiny_llama)
    target = target_dict(tiny_llama, **target_changes)
    for export in (
        lambda: export_eagle3(drafter, target, tmp_path / "native"),
        lambda: export_speculators(drafter, target, tmp_path / "spec", verifier_name_or_path="x"),
    ):
        with pytest.raises(ExportError, match=message):
            export()
    assert not any(tmp_path.iterdir())  # refused before anything was written


def test_export_refuses_a_foreign_embedding(drafter, tiny_llama, tmp_path):
    other = tiny_llama.embed_weight.clone()
    other[0, 0] += 1
    with pytest.raises(ExportError, match="not the target's own"):
        export_eagle3(drafter, tiny_llama.config, tmp_path, target_embed_weight=other)
    export_eagle3(drafter, tiny_llama.config, tmp_path, target_embed_weight=tiny_llama.embed_weight)


# ----------------------------------------------------------------------------- load refusals


def edit_config(path, change):
    config = json.loads((path / "config.json").read_text())
    change(config)
    (path / "config.json").write_text(json.dumps(config))


def edit_tensors(path, change):
    tensors = load_file(str(path / "model.safetensors"))
    change(tensors)
    save_file(tensors, str(path / "model.safetensors"))


def flip_t2d(tensors):
    t2d = tensors["t2d"]
    first_in, first_out = t2d.nonzero()[0, 0], (~t2d).nonzero()[0, 0]
    t2d[first_in], t2d[first_out] = False, True


@pytest.mark.parametrize(
    ("fmt", "edit", "message"),
    [
        ("native", lambda p: edit_tensors(p, lambda t: t.pop("d2t")), "'d2t' is missing"),
        ("spec", lambda p: edit_tensors(p, lambda t: t.pop("d2t")), "'d2t' is missing"),
        ("native", lambda p: edit_tensors(p, flip_t2d), "inconsistent"),
        ("native", lambda p: edit_tensors(p, lambda t: t.pop("lm_head.weight")), "missing tensors"),
        (
            "native",
            lambda p: edit_config(
                p, lambda c: (c.pop("eagle_aux_hidden_state_layer_ids"), c.pop("eagle_config"))
            ),
            "eagle_aux_hidden_state_layer_ids is missing",
        ),
        (
            "spec",
            lambda p: edit_config(p, lambda c: c.pop("eagle_aux_hidden_state_layer_ids")),
            "eagle_aux_hidden_state_layer_ids is missing",
        ),
        (
            "native",
            lambda p: edit_config(
                p, lambda c: c["eagle_config"].update(eagle_aux_hidden_state_layer_ids=[0, 1, 2])
            ),
            "differ between the top level",
        ),
        (
            "native",
            lambda p: edit_config(
                p, lambda c: c.update(eagle_aux_hidden_state_layer_ids=[2, 3, 4], eagle_config={})
            ),
            "out of range",
        ),
        (
            "native",
            lambda p: edit_config(
                p, lambda c: c.update(eagle_aux_hidden_state_layer_ids=[3, 2, 1], eagle_config={})
            ),
            "strictly increasing",
        ),
        (
            "spec",
            lambda p: edit_config(
                p, lambda c: c.update(eagle_aux_hidden_state_layer_ids=[1, 3, 3])
            ),
            "strictly increasing",
        ),
        (
            "spec",
            lambda p: edit_tensors(p, lambda t: t.pop("embed_tokens.weight")),
            "embed_tokens.weight is missing",
        ),
        (
            "spec",
            lambda p: edit_config(p, lambda c: c.pop("norm_before_residual")),
            "would assume true",
        ),
        (
            "native",
            lambda p: edit_config(p, lambda c: c.update(norm_before_residual=True)),
            "norm_before_residual is true",
        ),
        (
            "native",
            lambda p: edit_tensors(
                p, lambda t: t.update({"embed_tokens.weight": torch.randn(96, 32)})
            ),
            "not the target's",
        ),
    ],
)
def test_read_export_refuses_corruption(drafter, tiny_llama, tmp_path, fmt, edit, message):
    (export_native if fmt == "native" else export_spec)(drafter, tiny_llama, tmp_path)
    edit(tmp_path)
    with pytest.raises(ExportError, match=message):
        Eagle3Drafter.read_export(tmp_path, tiny_llama.embed_weight)


def test_read_export_accepts_the_targets_own_embedding_and_refuses_another_target(
    drafter, tiny_llama, tmp_path
):
    export_native(drafter, tiny_llama, tmp_path)
    edit_tensors(
        tmp_path, lambda t: t.update({"embed_tokens.weight": tiny_llama.embed_weight.clone()})
    )
    assert torch.equal(
        logits_of(Eagle3Drafter.read_export(tmp_path, tiny_llama.embed_weight), tiny_llama),
        logits_of(drafter, tiny_llama),
    )
    with pytest.raises(ExportError, match="hidden size 32"):
        Eagle3Drafter.read_export(tmp_path, torch.zeros(96, 64))


# ----------------------------------------------------------------------------- fresh loads


def test_a_fresh_load_of_each_export_gives_the_drafters_step0_logits(drafter, tiny_llama, tmp_path):
    want = logits_of(drafter, tiny_llama)
    export_native(drafter, tiny_llama, tmp_path / "native")
    native = Eagle3Drafter.read_export(tmp_path / "native", tiny_llama.embed_weight)
    assert torch.equal(logits_of(native, tiny_llama), want)
    with pytest.raises(ExportError, match="native EAGLE-3 export has no embedding"):
        Eagle3Drafter.read_export(tmp_path / "native", None)
    # the speculators export runs on its own embedding: no verifier embedding is handed in
    export_spec(drafter, tiny_llama, tmp_path / "spec")
    spec = Eagle3Drafter.read_export(tmp_path / "spec", None)
    assert torch.equal(logits_of(spec, tiny_llama), want)


def test_speculators_load_uses_the_embedding_stored_in_the_export(drafter, tiny_llama, tmp_path):
    export_spec(drafter, tiny_llama, tmp_path)
    edit_tensors(tmp_path, lambda t: t["embed_tokens.weight"].mul_(2.0))
    doubled = Eagle3Drafter.read_export(tmp_path, None)
    assert torch.equal(doubled.embed_tokens.weight, 2.0 * tiny_llama.embed_weight)
    assert not torch.equal(logits_of(doubled, tiny_llama), logits_of(drafter, tiny_llama))
    with pytest.raises(ExportError, match="not the target's"):
        Eagle3Drafter.read_export(tmp_path, tiny_llama.embed_weight)


@pytest.mark.parametrize("ids", [(5, 1, 3), (3, 3, 5), (0, 2, 4), (1, 3, 6)])
def test_drafter_config_refuses_unordered_repeated_or_out_of_range_aux_ids(tiny_llama, ids):
    config = target_dict(tiny_llama, num_hidden_layers=6)
    with pytest.raises(ValueError, match=r"strictly increasing and >= 1|out of range.*\[1, 6\)"):
        Eagle3Config.from_target(config, DRAFT_VOCAB, ids)
    Eagle3Config.from_target(config, DRAFT_VOCAB, (1, 3, 5))
