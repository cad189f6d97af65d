"""Real models' shapes with random weights: an 8B target's costs without a model hub.

A `ModelShape` holds what a public checkpoint's config.json says about its size (widths, heads,
KV heads, intermediate size, vocabulary, rope, norm epsilon, tied or untied head); `build_model`
makes a transformers model of that shape with random weights from a fixed seed, and
`synthetic_tokenizer` a tokenizer with exactly that many ids. Random weights make τ meaningless;
what such a target costs (time, memory, bytes per token) is the real model's.

`scaled` overrides depth and width so the shape runs on a CPU: the depth is any number of
layers; a narrower width keeps the head size and the query-to-KV head ratio and scales the
heads and the MLP with it, so what shrinks is only the matrices, never the vocabulary.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

ShapeName = Literal["llama-3.1-8b", "qwen3-8b"]


@dataclass(frozen=True)
class ModelShape:
    """A causal LM's size as its config.json states it (HF field names in the comments)."""

    name: str
    model_type: Literal["llama", "qwen3"]
    hidden_size: int  # hidden_size
    num_layers: int  # num_hidden_layers
    num_heads: int  # num_attention_heads
    num_kv_heads: int  # num_key_value_heads
    head_dim: int  # head_dim (Llama: hidden_size / num_attention_heads)
    intermediate_size: int  # intermediate_size
    vocab_size: int  # vocab_size
    rope: dict[str, Any]  # rope_parameters (transformers 5) / rope_theta + rope_scaling
    max_position_embeddings: int
    rms_norm_eps: float
    tie_word_embeddings: bool

    @property
    def parameters(self) -> int:
        """Parameter count: embeddings, head (unless tied), layers, norms."""
        h, q, kv = (
            self.hidden_size,
            self.num_heads * self.head_dim,
            self.num_kv_heads * self.head_dim,
        )
        attn = h * q + 2 * h * kv + q * h
        qk_norm = 2 * self.head_dim if self.model_type == "qwen3" else 0
        layer = attn + 3 * h * self.intermediate_size + 2 * h + qk_norm
        head = 0 if self.tie_word_embeddings else self.vocab_size * h
        return self.vocab_size * h + head + self.num_layers * layer + h


# From the public config.json files (meta-llama/Llama-3.1-8B, Qwen/Qwen3-8B).
SHAPES: dict[str, ModelShape] = {
    "llama-3.1-8b": ModelShape(
        name="llama-3.1-8b",
        model_type="llama",
        hidden_size=4096,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        intermediate_size=14336,
        vocab_size=128256,
        rope={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    ),
    "qwen3-8b": ModelShape(
        name="qwen3-8b",
        model_type="qwen3",
        hidden_size=4096,
        num_layers=36,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        intermediate_size=12288,
        vocab_size=151936,
        rope={"rope_type": "default", "rope_theta": 1000000.0},
        max_position_embeddings=40960,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    ),
}


def width_step(shape: ModelShape) -> int:
    """The widths `scaled` accepts are multiples of this: one KV head's group of query heads."""
    return shape.head_dim * (shape.num_heads // shape.num_kv_heads)


def scaled(
    shape: ModelShape, *, num_layers: int | None = None, hidden_size: int | None = None
) -> ModelShape:
    """`shape` at another depth and/or width (None keeps the shape's own).

    A narrower width keeps head_dim and the query heads per KV head, and scales the heads and the
    intermediate size by hidden_size / shape.hidden_size; the vocabulary is never scaled.
    """
    depth = shape.num_layers if num_layers is None else num_layers
    width = shape.hidden_size if hidden_size is None else hidden_size
    if depth < 1:
        raise ValueError(f"a {shape.name} shape needs at least 1 layer, got {depth}")
    step = width_step(shape)
    if width < step or width % step or width > shape.hidden_size:
        raise ValueError(
            f"{shape.name}'s width can be scaled to a multiple of {step} (head_dim "
            f"{shape.head_dim} x {shape.num_heads // shape.num_kv_heads} query heads per KV head) "
            f"up to {shape.hidden_size}, got {width}"
        )
    kv_heads = shape.num_kv_heads * width // shape.hidden_size
    return dataclasses.replace(
        shape,
        num_layers=depth,
        hidden_size=width,
        num_heads=kv_heads * (shape.num_heads // shape.num_kv_heads),
        num_kv_heads=kv_heads,
        intermediate_size=shape.intermediate_size * width // shape.hidden_size,
    )


def hf_config(shape: ModelShape, tokenizer: Any) -> Any:
    """The transformers config of `shape`, with the tokenizer's special ids."""
    from transformers import LlamaConfig, Qwen3Config

    fields = dict(
        vocab_size=shape.vocab_size,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_kv_heads,
        head_dim=shape.head_dim,
        max_position_embeddings=shape.max_position_embeddings,
        rms_norm_eps=shape.rms_norm_eps,
        rope_parameters=dict(shape.rope),
        tie_word_embeddings=shape.tie_word_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    if shape.model_type == "llama":
        return LlamaConfig(**fields, architectures=["LlamaForCausalLM"])
    return Qwen3Config(**fields, architectures=["Qwen3ForCausalLM"])


def build_model(shape: ModelShape, tokenizer: Any, seed: int) -> nn.Module:
    """A model of `shape` with random fp32 weights, a deterministic function of `seed`.

    Built on the CPU, so the same seed gives the same weights on any machine; move it after.
    """
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(hf_config(shape, tokenizer), attn_implementation="sdpa")


def synthetic_tokenizer(base_tokenizer_json: Path, vocab_size: int, chat_template: str) -> Any:
    """A fast tokenizer of exactly `vocab_size` ids: the base byte-level BPE tokenizer (so text
    tokenizes as with the base) with ids past its own filled by synthetic tokens `<xN>`.

    The synthetic tokens are in the BPE vocabulary without merges, so tokenizing text never
    yields them; a random model generates them, and they decode to their own text.
    """
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    spec = json.loads(base_tokenizer_json.read_text())
    vocab: dict[str, int] = spec["model"]["vocab"]
    specials = {t["content"]: t["id"] for t in spec["added_tokens"]}
    base = max([*vocab.values(), *specials.values()]) + 1
    if vocab_size < base:
        raise ValueError(f"vocab_size {vocab_size} is below the base tokenizer's {base} ids")
    vocab.update({f"<x{i}>": i for i in range(base, vocab_size)})
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(json.dumps(spec)),
        bos_token="<|bos|>",
        eos_token="<|eos|>",
        pad_token="<|pad|>",
    )
    tokenizer.chat_template = chat_template
    if len(tokenizer) != vocab_size:
        raise AssertionError(f"built a tokenizer of {len(tokenizer)} ids, not {vocab_size}")
    return tokenizer
