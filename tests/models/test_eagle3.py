"""EAGLE-3 drafter: config, vocab map, forward vs an HF-parts reference, KV cache, TTT, save/load, overfit."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import (
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
    repeat_kv,
)

from models.chain import TTTCache, Unrolled, shift_left, ttt_acceptance, ttt_attention, ttt_unroll
from models.drafters import load_drafter, save_drafter
from models.eagle3.drafter import Eagle3Drafter
from models.eagle3.model import Eagle3Config
from models.kv import KVCache
from models.layers import rope_inv_freq
from models.losses import acceptance_rate, teacher_draft_probs, ttt_loss
from models.vocab import DraftVocab

DRAFT_VOCAB = 64


def make_drafter(target, *, draft_vocab_size: int = DRAFT_VOCAB, seed: int = 0, std: float = 0.0):
    """A drafter for `target`; std > 0 re-draws every trainable weight (incl. norms) at that scale."""
    torch.manual_seed(seed)
    vocab = DraftVocab.from_counts(torch.randint(0, 1000, (target.vocab_size,)), draft_vocab_size)
    config = Eagle3Config.from_target(target.config, draft_vocab_size, target.aux_layer_ids)
    drafter = Eagle3Drafter(config, target.embed_weight, vocab)
    if std:
        with torch.no_grad():
            for p in drafter.parameters():
                if p.requires_grad:
                    p.copy_(torch.randn_like(p) * std + (1.0 if p.dim() == 1 else 0.0))
    return drafter


def features(target, B: int = 2, T: int = 12, seed: int = 1):
    torch.manual_seed(seed)
    ids = torch.randint(0, target.vocab_size, (B, T))
    out = target(ids)
    return ids, out


def chain_logits(drafter, aux, ids, t, steps, step_tokens=None):
    """What speculative decoding computes: step 0 over rows 0..t into a KVCache, then a chain."""
    B = ids.shape[0]
    cache = KVCache()
    logits, hidden = drafter(
        ids[:, 1 : t + 2],
        drafter.fuse(aux[:, : t + 1]),
        torch.arange(t + 1).expand(B, -1),
        cache=cache,
    )
    out = [logits[:, t]]
    hidden = hidden[:, t : t + 1]
    for k in range(1, steps):
        token = step_tokens[k][:, t : t + 1] if step_tokens else ids[:, t + k + 1 : t + k + 2]
        logits, hidden = drafter(token, hidden, torch.full((B, 1), t + k), cache=cache)
        out.append(logits[:, 0])
    return out


# ----------------------------------------------------------------------------- config


def test_config_copies_target_and_round_trips_json(tiny_llama):
    config = Eagle3Config.from_target(tiny_llama.config, DRAFT_VOCAB, tiny_llama.aux_layer_ids)
    hf = tiny_llama.config
    assert (config.hidden_size, config.num_attention_heads, config.num_key_value_heads) == (
        hf.hidden_size,
        hf.num_attention_heads,
        hf.num_key_value_heads,
    )
    assert config.head_dim == hf.hidden_size // hf.num_attention_heads
    assert config.rope_parameters == dict(hf.rope_parameters)
    assert config.max_position_embeddings == hf.max_position_embeddings
    assert config.rms_norm_eps == hf.rms_norm_eps
    assert config.aux_layer_ids == tuple(tiny_llama.aux_layer_ids)
    restored = Eagle3Config.from_dict(json.loads(json.dumps(config.to_dict())))
    assert restored == config


def test_config_reads_transformers4_rope_keys_and_default_aux_ids():
    legacy = {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 12,
        "num_attention_heads": 4,
        "max_position_embeddings": 4096,
        "vocab_size": 100,
        "rope_theta": 500000.0,
        "rope_scaling": {"type": "linear", "factor": 2.0},
    }
    config = Eagle3Config.from_target(legacy, 50)
    assert config.rope_parameters == {"rope_type": "linear", "factor": 2.0, "rope_theta": 500000.0}
    assert config.aux_layer_ids == (2, 6, 9)
    assert config.num_key_value_heads == 4


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}},
            "rope_type 'yarn'",
        ),
        ({"aux_layer_ids": (1, 2, 4)}, "out of range"),
        ({"aux_layer_ids": (1, 2)}, "exactly 3"),
        ({"draft_vocab_size": 1000}, "exceeds the target vocab"),
        ({"num_key_value_heads": 3}, "multiple of"),
    ],
)
def test_config_refuses_bad_values(tiny_llama, change, message):
    base = Eagle3Config.from_target(
        tiny_llama.config, DRAFT_VOCAB, tiny_llama.aux_layer_ids
    ).to_dict()
    with pytest.raises(ValueError, match=message):
        Eagle3Config.from_dict({**base, **change})


def test_config_from_dict_refuses_unknown_and_missing_keys(tiny_llama):
    base = Eagle3Config.from_target(
        tiny_llama.config, DRAFT_VOCAB, tiny_llama.aux_layer_ids
    ).to_dict()
    with pytest.raises(ValueError, match="unknown Eagle3Config keys"):
        Eagle3Config.from_dict({**base, "tie_embeddings": True})
    del base["head_dim"]
    with pytest.raises(ValueError, match="missing keys"):
        Eagle3Config.from_dict(base)


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "default", "rope_theta": 10000.0},
        {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
        {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ],
)
def test_rope_frequencies_match_transformers(rope):
    hf = LlamaConfig(
        hidden_size=128, num_attention_heads=2, max_position_embeddings=4096, rope_parameters=rope
    )
    expected = LlamaRotaryEmbedding(hf).inv_freq
    torch.testing.assert_close(rope_inv_freq(rope, 64), expected, rtol=1e-6, atol=0)


def test_bf16_drafter_keeps_rope_frequencies_exact(tiny_llama):
    drafter = make_drafter(tiny_llama).to(torch.bfloat16)
    assert drafter.fc.weight.dtype == torch.bfloat16
    assert drafter.rotary.inv_freq.dtype == torch.float32
    assert torch.equal(drafter.rotary.inv_freq, rope_inv_freq(drafter.config.rope_parameters, 8))


# ----------------------------------------------------------------------------- vocab


def test_draft_vocab_from_counts_picks_top_n_with_low_id_ties():
    counts = torch.tensor([5, 9, 0, 9, 3, 5, 7, 1])
    vocab = DraftVocab.from_counts(counts, 4)
    # 9, 9, 7 are clear; 5 ties between ids 0 and 5 -> the lower id wins.
    assert vocab.draft_to_target_ids.tolist() == [0, 1, 3, 6]
    assert vocab.d2t.dtype == torch.int64 and vocab.t2d.dtype == torch.bool
    assert vocab.d2t.tolist() == [0, 0, 1, 3]
    assert int(vocab.t2d.sum()) == 4


def test_draft_vocab_maps_both_ways():
    torch.manual_seed(0)
    vocab = DraftVocab.from_counts(torch.randint(0, 50, (300,)), 40)
    targets = vocab.draft_to_target_ids
    assert (targets[1:] > targets[:-1]).all()
    assert int(vocab.t2d.sum()) == 40 and vocab.t2d[targets].all()
    draft_ids = torch.arange(40)
    assert torch.equal(vocab.to_draft(vocab.to_target(draft_ids)), draft_ids)
    outside = (~vocab.t2d).nonzero().squeeze(-1)
    assert (vocab.to_draft(outside) == -1).all()


def test_draft_vocab_refuses_inconsistent_maps():
    vocab = DraftVocab.from_counts(torch.arange(10), 4)  # targets 6..9
    with pytest.raises(ValueError, match="strictly increasing"):
        DraftVocab(torch.tensor([6, 6, 5, 5]), vocab.t2d)
    with pytest.raises(ValueError, match="outside the target vocab"):
        DraftVocab(torch.tensor([6, 7, 8, 9]), vocab.t2d)
    shifted = vocab.t2d.clone()
    shifted[9], shifted[0] = False, True
    with pytest.raises(ValueError, match="inconsistent"):
        DraftVocab(vocab.d2t, shifted)
    with pytest.raises(ValueError, match="marks 5 target ids"):
        DraftVocab(vocab.d2t, vocab.t2d | (torch.arange(10) == 0))
    with pytest.raises(ValueError, match="int64"):
        DraftVocab(vocab.d2t.int(), vocab.t2d)


# ----------------------------------------------------------------------------- forward


def reference_forward(drafter, input_ids, hidden, position_ids, hf_config):
    """EAGLE-3 layer as vLLM's llama_eagle3 computes it, from HF Llama parts and plain attention."""
    layer, c = drafter.midlayer, drafter.config

    def rms(x, norm):
        x32 = x.float()
        return norm.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + c.rms_norm_eps))

    B, T = input_ids.shape
    embeds = drafter.embed_tokens.weight[input_ids]
    x = torch.cat([rms(embeds, layer.input_layernorm), rms(hidden, layer.hidden_norm)], -1)
    attn = layer.self_attn
    q = (x @ attn.q_proj.weight.T).view(B, T, c.num_attention_heads, c.head_dim).transpose(1, 2)
    k = (x @ attn.k_proj.weight.T).view(B, T, c.num_key_value_heads, c.head_dim).transpose(1, 2)
    v = (x @ attn.v_proj.weight.T).view(B, T, c.num_key_value_heads, c.head_dim).transpose(1, 2)
    cos, sin = LlamaRotaryEmbedding(hf_config)(x, position_ids)
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    groups = c.num_attention_heads // c.num_key_value_heads
    k, v = repeat_kv(k, groups), repeat_kv(v, groups)
    scores = q @ k.transpose(-1, -2) / c.head_dim**0.5
    scores = scores.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
    out = (scores.softmax(-1) @ v).transpose(1, 2).reshape(B, T, -1) @ attn.o_proj.weight.T
    h = hidden + out  # residual = the raw hidden (norm_before_residual = False)
    mlp = layer.mlp
    y = rms(h, layer.post_attention_layernorm)
    h = (
        h
        + (torch.nn.functional.silu(y @ mlp.gate_proj.weight.T) * (y @ mlp.up_proj.weight.T))
        @ mlp.down_proj.weight.T
    )
    return rms(h, drafter.norm) @ drafter.lm_head.weight.T, h


def test_forward_matches_reference_with_llama3_rope_and_gqa():
    rope = {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32,
    }
    hf = LlamaConfig(
        vocab_size=80,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        rope_parameters=rope,
    )
    torch.manual_seed(0)
    embed = torch.randn(80, 32)
    config = Eagle3Config.from_target(hf, 50)
    drafter = Eagle3Drafter(config, embed, DraftVocab.from_counts(torch.randint(0, 9, (80,)), 50))
    with torch.no_grad():
        for p in drafter.parameters():
            if p.requires_grad:
                p.copy_(torch.randn_like(p) * 0.3 + (1.0 if p.dim() == 1 else 0.0))
    ids = torch.randint(0, 80, (2, 9))
    hidden = torch.randn(2, 9, 32)
    positions = 300 + torch.arange(9).expand(2, -1)  # past the original context: scaling matters
    logits, hidden_out = drafter(ids, hidden, positions)
    ref_logits, ref_hidden = reference_forward(drafter, ids, hidden, positions, hf)
    assert logits.dtype == torch.float32 and logits.shape == (2, 9, 50)
    torch.testing.assert_close(hidden_out, ref_hidden, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)


def test_embedding_is_the_targets_and_frozen(tiny_llama):
    drafter = make_drafter(tiny_llama)
    names = [n for n, _ in drafter.named_parameters()]
    assert names == [
        "embed_tokens.weight",
        "fc.weight",
        "midlayer.input_layernorm.weight",
        "midlayer.hidden_norm.weight",
        "midlayer.self_attn.q_proj.weight",
        "midlayer.self_attn.k_proj.weight",
        "midlayer.self_attn.v_proj.weight",
        "midlayer.self_attn.o_proj.weight",
        "midlayer.post_attention_layernorm.weight",
        "midlayer.mlp.gate_proj.weight",
        "midlayer.mlp.up_proj.weight",
        "midlayer.mlp.down_proj.weight",
        "norm.weight",
        "lm_head.weight",
    ]
    assert drafter.embed_tokens.weight.data_ptr() == tiny_llama.embed_weight.data_ptr()
    assert not drafter.embed_tokens.weight.requires_grad
    H = tiny_llama.hidden_size
    assert drafter.midlayer.self_attn.q_proj.weight.shape[1] == 2 * H
    assert drafter.fc.weight.shape == (H, 3 * H)
    ids, out = features(tiny_llama)
    logits, _ = drafter(
        ids, drafter.fuse(out.aux_hidden), torch.arange(ids.shape[1]).expand_as(ids)
    )
    logits.sum().backward()
    assert drafter.embed_tokens.weight.grad is None
    assert drafter.fc.weight.grad is not None


def test_cache_chain_equals_one_causal_pass_and_crop_rewinds(tiny_llama):
    drafter = make_drafter(tiny_llama, std=0.3)
    ids, out = features(tiny_llama, T=10)
    hidden = drafter.fuse(out.aux_hidden)
    positions = torch.arange(10).expand(2, -1)
    full, _ = drafter(ids, hidden, positions)
    cache = KVCache()
    parts = [
        drafter(ids[:, a:b], hidden[:, a:b], positions[:, a:b], cache=cache)[0]
        for a, b in ((0, 4), (4, 5), (5, 10))
    ]
    assert cache.length == 10 and cache.keys[0].shape == (2, 2, 10, 8)
    torch.testing.assert_close(torch.cat(parts, 1), full, rtol=1e-5, atol=1e-5)
    cache.crop(5)
    again, _ = drafter(ids[:, 5:10], hidden[:, 5:10], positions[:, 5:10], cache=cache)
    torch.testing.assert_close(again, parts[2], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="cannot crop"):
        cache.crop(11)


def test_explicit_mask_equals_causal_and_blocks_what_it_says(tiny_llama):
    drafter = make_drafter(tiny_llama, std=0.3)
    ids, out = features(tiny_llama, T=6)
    hidden = drafter.fuse(out.aux_hidden)
    positions = torch.arange(6).expand(2, -1)
    causal = torch.ones(6, 6, dtype=torch.bool).tril().expand(2, 6, 6)
    torch.testing.assert_close(
        drafter(ids, hidden, positions, attention_mask=causal)[0],
        drafter(ids, hidden, positions)[0],
    )
    # Row 5 blind to key 2: changing row 2's inputs must not move row 5, but does move row 3.
    blocked = causal.clone()
    blocked[:, 5, 2] = False
    base = drafter(ids, hidden, positions, attention_mask=blocked)[0]
    other = hidden.clone()
    other[:, 2] += 1.0
    moved = drafter(ids, other, positions, attention_mask=blocked)[0]
    torch.testing.assert_close(moved[:, 5], base[:, 5])
    assert (moved[:, 3] - base[:, 3]).abs().max() > 1e-3


def test_forward_refuses_bad_shapes(tiny_llama):
    drafter = make_drafter(tiny_llama)
    ids = torch.zeros(1, 4, dtype=torch.long)
    pos = torch.arange(4)[None]
    with pytest.raises(ValueError, match="hidden must be"):
        drafter(ids, torch.zeros(1, 4, 7), pos)
    with pytest.raises(ValueError, match="attention_mask must be bool"):
        drafter(
            ids, torch.zeros(1, 4, 32), pos, attention_mask=torch.ones(1, 4, 5, dtype=torch.bool)
        )
    with pytest.raises(ValueError, match="aux_hidden last dim"):
        drafter.fuse(torch.zeros(1, 4, 32))
    with pytest.raises(ValueError, match="embedding has shape"):
        Eagle3Drafter(drafter.config, torch.zeros(10, 32), drafter.vocab)


# ----------------------------------------------------------------------------- training-time test


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_ttt_steps_equal_chain_decoding(arch, tiny_llama, tiny_qwen3):
    target = {"llama": tiny_llama, "qwen3": tiny_qwen3}[arch]
    drafter = make_drafter(target, std=0.3)
    steps, T = 4, 12
    ids, out = features(target, T=T)
    unrolled = ttt_unroll(drafter, out.aux_hidden, ids, steps=steps)
    for t in range(T - steps):
        for k, logits in enumerate(chain_logits(drafter, out.aux_hidden, ids, t, steps)):
            torch.testing.assert_close(unrolled[k].logits[:, t], logits, rtol=1e-5, atol=1e-5)


def test_ttt_with_drafted_tokens_equals_chain_on_those_tokens(tiny_llama):
    drafter = make_drafter(tiny_llama, std=0.3)
    steps, T = 3, 10
    ids, out = features(tiny_llama, T=T)
    torch.manual_seed(5)
    drafted = [None] + [
        torch.randint(0, tiny_llama.vocab_size, ids.shape) for _ in range(steps - 1)
    ]
    unrolled = ttt_unroll(drafter, out.aux_hidden, ids, steps=steps, step_tokens=drafted)
    ground_truth = ttt_unroll(drafter, out.aux_hidden, ids, steps=steps)
    assert (unrolled[1].logits - ground_truth[1].logits).abs().max() > 1e-3
    for t in range(T - steps):
        for k, logits in enumerate(chain_logits(drafter, out.aux_hidden, ids, t, steps, drafted)):
            torch.testing.assert_close(unrolled[k].logits[:, t], logits, rtol=1e-5, atol=1e-5)


def test_ttt_never_sees_target_features_past_the_prefix(tiny_llama):
    drafter = make_drafter(tiny_llama, std=0.3)
    steps, T, t = 4, 12, 5
    ids, out = features(tiny_llama, T=T)
    base = ttt_unroll(drafter, out.aux_hidden, ids, steps=steps)
    future = out.aux_hidden.clone()
    future[:, t + 1 :] = torch.randn_like(future[:, t + 1 :]) * 5
    perturbed = ttt_unroll(drafter, future, ids, steps=steps)
    for k in range(steps):
        torch.testing.assert_close(perturbed[k].logits[:, : t + 1], base[k].logits[:, : t + 1])
        assert (perturbed[k].logits[:, t + 1 :] - base[k].logits[:, t + 1 :]).abs().max() > 1e-3
    # The test can fail: a change inside the prefix does reach row t at every step.
    past = out.aux_hidden.clone()
    past[:, t - 2] += 3.0
    moved = ttt_unroll(drafter, past, ids, steps=steps)
    for k in range(steps):
        assert (moved[k].logits[:, t] - base[k].logits[:, t]).abs().max() > 1e-3


def test_ttt_unroll_reports_validity_and_refuses_bad_step_tokens(tiny_llama):
    drafter = make_drafter(tiny_llama)
    ids, out = features(tiny_llama, T=8)
    loss_mask = torch.ones_like(ids, dtype=torch.bool)
    loss_mask[:, :4] = False
    loss_mask[1, 2:4] = True
    unrolled = ttt_unroll(drafter, out.aux_hidden, ids, steps=3, loss_mask=loss_mask)
    assert unrolled[0].valid[0].tolist() == [False, False, True, True, True, True, False, False]
    # Row t at step k predicts x_{t+k+2}: valid iff it exists and the loss mask is set there.
    for k, step in enumerate(unrolled):
        for b, prompt in enumerate((4, 2)):
            assert step.valid[b].tolist() == [prompt <= t + k + 2 < 8 for t in range(8)]
    with pytest.raises(ValueError, match=r"step_tokens\[0\] must be None"):
        ttt_unroll(drafter, out.aux_hidden, ids, steps=2, step_tokens=[ids, ids])
    with pytest.raises(ValueError, match="one per step"):
        ttt_unroll(drafter, out.aux_hidden, ids, steps=3, step_tokens=[None, ids])


# ----------------------------------------------------------------------------- save / load


def test_save_load_round_trip_without_embedding(tiny_llama, tmp_path):
    drafter = make_drafter(tiny_llama, std=0.3)
    save_drafter(drafter, tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    assert not any(name.startswith("embed_tokens") for name in tensors)
    assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool
    loaded = load_drafter(tmp_path, tiny_llama.embed_weight)
    assert loaded.config == drafter.config
    ids, out = features(tiny_llama)
    pos = torch.arange(ids.shape[1]).expand_as(ids)
    want = drafter(ids, drafter.fuse(out.aux_hidden), pos)[0]
    got = loaded(ids, loaded.fuse(out.aux_hidden), pos)[0]
    assert torch.equal(got, want)


def test_load_refuses_mismatched_target_and_broken_checkpoint(tiny_llama, tmp_path):
    drafter = make_drafter(tiny_llama)
    save_drafter(drafter, tmp_path)
    V, H = tiny_llama.embed_weight.shape
    with pytest.raises(ValueError, match="hidden size 32"):
        load_drafter(tmp_path, torch.zeros(V, H + 8))
    with pytest.raises(ValueError, match="vocab 96"):
        load_drafter(tmp_path, torch.zeros(V + 1, H))
    tensors = load_file(str(tmp_path / "model.safetensors"))
    del tensors["d2t"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="'d2t' is missing"):
        load_drafter(tmp_path, tiny_llama.embed_weight)
    with pytest.raises(FileNotFoundError, match="save_drafter"):
        load_drafter(tmp_path / "nowhere", tiny_llama.embed_weight)


# ----------------------------------------------------------------------------- learning


def test_drafter_overfits_a_handful_of_sequences(tiny_llama):
    torch.manual_seed(0)
    steps, T = 3, 16
    ids = torch.randint(0, tiny_llama.vocab_size, (4, T))
    out = tiny_llama(ids)
    drafter = make_drafter(tiny_llama, draft_vocab_size=tiny_llama.vocab_size)
    # Sharpened teacher (T=0.25) so the reachable loss is small and a large drop is meaningful.
    teacher = teacher_draft_probs(out.logits, drafter.vocab, temperature=0.25)
    opt = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=1e-2)

    def loss_and_accuracy():
        unrolled = ttt_unroll(drafter, out.aux_hidden, ids, steps=steps)
        teachers = [shift_left(teacher, k + 1) for k in range(steps)]
        loss = ttt_loss([s.logits for s in unrolled], teachers, [s.valid for s in unrolled])
        hits = unrolled[0].logits.argmax(-1) == teachers[0].argmax(-1)
        return loss, hits[unrolled[0].valid].float().mean().item()

    first, first_acc = loss_and_accuracy()
    for _ in range(300):
        loss, _ = loss_and_accuracy()
        opt.zero_grad()
        loss.backward()
        opt.step()
    last, acc = loss_and_accuracy()
    print(
        f"overfit: ttt loss {first.item():.4f} -> {last.item():.4f}, step-0 accuracy {first_acc:.3f} -> {acc:.3f}"
    )
    assert last.item() < first.item() / 10, (first.item(), last.item())
    assert first_acc < 0.5 and acc > 0.97, (first_acc, acc)


# ----------------------------------------------------------------------------- acceptance metrics

# --------------------------------------------------------------------


def _vocab() -> DraftVocab:
    # target vocab 8, draft vocab = target ids {1, 3, 4, 6}
    t2d = torch.zeros(8, dtype=torch.bool)
    t2d[[1, 3, 4, 6]] = True
    return DraftVocab(torch.tensor([1, 2, 2, 3]), t2d)


def test_ttt_acceptance_against_a_reference():
    vocab = _vocab()
    B, T, K = 2, 7, 3
    g = torch.Generator().manual_seed(0)
    target_logits = torch.randn(B, T, 8, generator=g) * 3
    target_choice = target_logits.argmax(-1)
    step_logits, step_valid = [], []
    for k in range(K):
        logits = torch.randn(B, T, 4, generator=g)
        # make about half of the drafts agree with the target's argmax (when it is a draft token)
        for b in range(B):
            for t in range(T - k - 1):
                d = vocab.to_draft(target_choice[b, t + k + 1 : t + k + 2])
                if d.item() >= 0 and (b + t + k) % 2 == 0:
                    logits[b, t, d.item()] += 10
        valid = torch.zeros(B, T, dtype=torch.bool)
        valid[:, : T - k - 2] = True
        valid[1, 0] = False
        step_logits.append(logits)
        step_valid.append(valid)
    stats = ttt_acceptance(Unrolled(step_logits, step_valid, []), target_logits, vocab, chain_k=2)

    # reference, one row at a time
    p_full = F.softmax(target_logits, -1)[..., vocab.draft_to_target_ids]
    hits = torch.zeros(K)
    alpha = torch.zeros(K)
    chain_rows, chain_len = 0, 0
    for b in range(B):
        for t in range(T):
            row_hits = []
            for k in range(K):
                if not step_valid[k][b, t]:
                    row_hits.append(None)
                    continue
                drafted = vocab.to_target(step_logits[k][b, t].argmax())
                h = int(drafted == target_choice[b, t + k + 1])
                hits[k] += h
                alpha[k] += torch.minimum(
                    step_logits[k][b, t].softmax(-1), p_full[b, t + k + 1]
                ).sum()
                row_hits.append(h)
            if all(h is not None for h in row_hits[:2]):
                chain_rows += 1
                chain_len += row_hits[0] + row_hits[0] * row_hits[1]
    valid = torch.tensor([float(v.sum()) for v in step_valid])
    s = stats.summary()
    assert stats.hits.tolist() == hits.tolist() and stats.valid.tolist() == valid.tolist()
    assert 0 < hits.sum() < valid.sum()  # the case is not degenerate
    assert s["acc"] == pytest.approx((hits / valid).tolist())
    assert s["alpha"] == pytest.approx((alpha / valid).tolist(), rel=1e-5)
    acc = hits / valid
    assert s["tau_sim"] == pytest.approx(1 + acc[0] + acc[0] * acc[1])
    a = alpha / valid
    assert s["tau_expected"] == pytest.approx(float(1 + a[0] + a[0] * a[1]), rel=1e-5)
    assert s["tau_chain"] == pytest.approx(1 + chain_len / chain_rows)
    # the expected alpha is B's acceptance_rate against the full target distribution
    q = step_logits[0][0, 0].softmax(-1)
    ref = acceptance_rate(
        q, teacher_draft_probs(target_logits[0, 1], vocab, 1.0, renormalize=False)
    )
    assert float(ref) <= 1
    # sums add over batches (and ranks)
    both = stats + stats
    assert (
        both.summary()["acc"] == pytest.approx(s["acc"])
        and both.hits.tolist() == (2 * hits).tolist()
    )


def test_perfect_drafter_reaches_tau_k_plus_one():
    vocab = _vocab()
    T, K = 10, 4
    target_ids = torch.tensor([1, 3, 4, 6])[torch.arange(T) % 4]
    target_logits = F.one_hot(target_ids, 8).float()[None] * 20  # [1, T, 8]
    logits = [
        F.one_hot(vocab.to_draft(target_ids).roll(-(k + 1)), 4).float()[None] * 20 for k in range(K)
    ]
    valid = [torch.arange(T)[None] < T - k - 2 for k in range(K)]
    s = ttt_acceptance(Unrolled(logits, valid, []), target_logits, vocab, chain_k=3).summary()
    assert s["acc"] == [1.0] * K
    assert s["tau_sim"] == pytest.approx(4.0) and s["tau_chain"] == pytest.approx(4.0)
    assert s["tau_expected"] == pytest.approx(4.0, abs=1e-3)


def test_ttt_attention_is_attention_over_the_context_and_the_rows_own_chain():
    """Each unrolled step's query at row t attends to the cached step-0 keys at rows <= t and to
    row t's own keys of steps 1..k: the same as attention over those keys written out whole
    (a dense mask), in value and in gradient, with grouped kv heads and a strided q."""
    B, h, kv, T, d, steps = 2, 6, 2, 5, 8, 4
    g = torch.Generator().manual_seed(0)
    qs = [torch.randn(B, T, h, d, generator=g).transpose(1, 2) for _ in range(steps)]
    ks = [torch.randn(B, kv, T, d, generator=g) for _ in range(steps)]
    vs = [torch.randn(B, kv, T, d, generator=g) for _ in range(steps)]
    for x in qs + ks + vs:
        x.requires_grad_(True)
    cache = TTTCache()
    got = [ttt_attention(q, k, v, cache) for q, k, v in zip(qs, ks, vs, strict=True)]
    want = []
    for s in range(steps):
        keys = torch.cat(ks[: s + 1], dim=2).repeat_interleave(h // kv, dim=1)  # [B, h, T*(s+1), d]
        values = torch.cat(vs[: s + 1], dim=2).repeat_interleave(h // kv, dim=1)
        rows = torch.arange(T)
        mask = torch.zeros(T, T * (s + 1), dtype=torch.bool)
        mask[:, :T] = rows[None] <= rows[:, None]  # step 0: causal over the context
        for j in range(1, s + 1):
            mask[rows, j * T + rows] = True  # step j: the row's own key only
        want.append(F.scaled_dot_product_attention(qs[s], keys, values, attn_mask=mask))
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    grads_got = torch.autograd.grad(sum((o * o).sum() for o in got), qs + ks + vs)
    grads_want = torch.autograd.grad(sum((o * o).sum() for o in want), qs + ks + vs)
    for a, b in zip(grads_got, grads_want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
