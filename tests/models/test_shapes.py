"""Real models' shapes with random weights (`models.shapes`) and the config that names them."""

from __future__ import annotations

import pytest
from pydantic import ValidationError
from transformers import AutoTokenizer

from models.shapes import SHAPES, scaled, synthetic_tokenizer
from pipeline.core.targets import EMBEDDED_TARGET, TargetConfig, target_shape, target_spec


def test_the_shapes_are_the_public_checkpoints():
    llama, qwen = SHAPES["llama-3.1-8b"], SHAPES["qwen3-8b"]
    assert (llama.hidden_size, llama.num_layers, llama.num_heads, llama.num_kv_heads) == (
        4096,
        32,
        32,
        8,
    )
    assert (llama.intermediate_size, llama.vocab_size, llama.rope["rope_theta"]) == (
        14336,
        128256,
        500000.0,
    )
    assert (qwen.num_layers, qwen.intermediate_size, qwen.vocab_size, qwen.head_dim) == (
        36,
        12288,
        151936,
        128,
    )
    assert not llama.tie_word_embeddings and not qwen.tie_word_embeddings
    # the model cards' parameter counts: 8.03B and 8.19B
    assert round(llama.parameters / 1e9, 2) == 8.03
    assert round(qwen.parameters / 1e9, 2) == 8.19


def test_a_narrower_width_keeps_head_size_and_kv_grouping():
    small = scaled(SHAPES["llama-3.1-8b"], num_layers=4, hidden_size=1024)
    assert (small.num_layers, small.num_heads, small.num_kv_heads, small.head_dim) == (4, 8, 2, 128)
    assert small.intermediate_size == 3584 and small.vocab_size == 128256
    for width in (256, 768, 8192):
        with pytest.raises(ValueError, match="multiple of 512"):
            scaled(SHAPES["qwen3-8b"], hidden_size=width)


def test_the_synthetic_tokenizer_has_the_shapes_vocabulary_and_the_embedded_bpe():
    template = (EMBEDDED_TARGET / "chat_template.jinja").read_text()
    tok = synthetic_tokenizer(EMBEDDED_TARGET / "tokenizer.json", 151936, template)
    base = AutoTokenizer.from_pretrained(EMBEDDED_TARGET, local_files_only=True)
    text = "def add(a, b):\n    return a + b\n"
    assert len(tok) == 151936
    assert tok(text)["input_ids"] == base(text)["input_ids"]
    assert tok.decode([151935]) == "<x151935>"
    assert (tok.bos_token_id, tok.eos_token_id) == (base.bos_token_id, base.eos_token_id)


def test_the_target_config_names_a_shape_and_its_overrides():
    cfg = TargetConfig(path="shape:qwen3-8b", shape={"num_layers": 8, "hidden_size": 512})
    shape = target_shape(cfg)
    assert (shape.model_type, shape.num_layers, shape.hidden_size) == ("qwen3", 8, 512)
    assert target_spec(cfg)["shape"] == {"num_layers": 8, "hidden_size": 512, "seed": 0}
    assert "shape" not in target_spec(TargetConfig())
    assert target_shape(TargetConfig(path="shape:llama-3.1-8b")).num_layers == 32
    with pytest.raises(ValidationError, match="names no known shape"):
        TargetConfig(path="shape:llama-70b")
    with pytest.raises(ValidationError, match="greater than or equal to 4"):
        TargetConfig(path="shape:llama-3.1-8b", shape={"num_layers": 3})
    with pytest.raises(ValidationError, match="out of range"):
        TargetConfig(path="shape:llama-3.1-8b", shape={"num_layers": 4}, aux_layer_ids=[2, 3, 4])
    with pytest.raises(ValidationError, match="target.path=shape:NAME"):
        TargetConfig(path="embedded", shape={"num_layers": 4})
