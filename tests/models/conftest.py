"""Tiny in-process targets shared by the models tests (random weights, CPU, fp32).

`tiny_hf_model` builds a raw HF model; the `tiny_llama` / `tiny_qwen3` fixtures wrap one in a
`Target`. The LM head is scaled up (`head_scale`) so next-token distributions are peaked: greedy
decoding then has clear winners (no near-ties that fp32 noise could flip) and drafts get accepted.
"""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from models.target import Target

ARCHITECTURES = ("llama", "qwen3")


def tiny_hf_model(
    arch: str = "llama",
    *,
    vocab_size: int = 96,
    hidden_size: int = 32,
    num_layers: int = 4,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    seed: int = 0,
    init_std: float = 0.2,
    head_scale: float = 4.0,
    attn_implementation: str = "sdpa",
) -> torch.nn.Module:
    """A random tiny Llama or Qwen3 causal LM in eval mode (GQA, untied head)."""
    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=512,
        initializer_range=init_std,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    torch.manual_seed(seed)
    if arch == "llama":
        config = LlamaConfig(**common)
        config._attn_implementation = attn_implementation
        model = LlamaForCausalLM(config)
    elif arch == "qwen3":
        config = Qwen3Config(**common, head_dim=hidden_size // num_heads)
        config._attn_implementation = attn_implementation
        model = Qwen3ForCausalLM(config)
    else:
        raise ValueError(f"unknown tiny architecture {arch!r}; use one of {ARCHITECTURES}")
    with torch.no_grad():
        model.lm_head.weight.mul_(head_scale)
    return model.eval()


def tiny_target(arch: str = "llama", *, aux_layer_ids=(1, 2, 3), **kwargs) -> Target:
    return Target.from_model(tiny_hf_model(arch, **kwargs), aux_layer_ids=aux_layer_ids)


@pytest.fixture(scope="session")
def tiny_llama() -> Target:
    return tiny_target("llama")


@pytest.fixture(scope="session")
def tiny_qwen3() -> Target:
    return tiny_target("qwen3")


@pytest.fixture(params=ARCHITECTURES)
def any_target(request, tiny_llama: Target, tiny_qwen3: Target) -> Target:
    return {"llama": tiny_llama, "qwen3": tiny_qwen3}[request.param]
