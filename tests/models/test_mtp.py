"""MTP modules as a drafter kind: shapes and the module each depth runs, the per-depth loss's
invariants, the target's head and embedding kept frozen, lossless through the one loop (T=0
token for token on chains and trees, T=1 in law with broken-verifier controls), replays that
are what decoding drafts, and checkpoints."""

# ruff: noqa: F811 (the fixtures imported from test_decoding are parameters here)

from __future__ import annotations

import pytest
import torch

import models.verify as verify
from models.chain import TTTCache
from models.decoding import SpecConfig, speculative_generate
from models.drafter import ChainShape, TreeShape
from models.drafters import load_drafter, recorded_kind, save_drafter
from models.features import Features
from models.losses import soft_cross_entropy
from models.mtp.drafter import MTPDrafter
from models.mtp.model import MTPConfig
from models.mtp.train import depth_mean_loss
from models.target import Target
from models.vocab import DraftVocab
from tests.models.test_decoding import (  # noqa: F401 (fixtures)
    LAW_PROMPT,
    MAX_NEW,
    _accept_always,
    _resample_from_p,
    chi_square,
    exact_joint,
    greedy_case,
    law_case,
    random_prompts,
)


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def mtp(target: Target, modules: int = 1, seed: int = 0) -> MTPDrafter:
    torch.manual_seed(seed)
    # the features' pruned map is not read: the target's head covers every id
    return MTPDrafter.new(target, DraftVocab.full(target.vocab_size), {"modules": modules}).eval()


def sequences_features(target: Target, sequences: list[list[int]]):
    width = max(map(len, sequences))
    ids = torch.tensor([s + [0] * (width - len(s)) for s in sequences])
    mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in sequences]).bool()
    with torch.no_grad():
        out = target.forward(ids)
    return Features(ids, out.aux_hidden, out.last_hidden), mask, out


def fit_mtp(target: Target, sequences: list[list[int]], modules: int = 1, steps: int = 80):
    """MTP's SFT (per-depth soft CE against the target over 3 unrolled depths) on the target's
    own sequences, so drafts get accepted."""
    drafter = mtp(target, modules)
    features, mask, out = sequences_features(target, sequences)
    teacher = out.logits.softmax(-1)  # [B, T, V]: the full vocabulary
    opt = torch.optim.Adam([p for p in drafter.parameters() if p.requires_grad], lr=1e-2)
    drafter.train()
    for _ in range(steps):
        loss = drafter.sft_loss(drafter.unroll(features, mask, 3), teacher, None, decay=0.8)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return drafter.eval()


@pytest.fixture(scope="module")
def fitted_mtp(tiny_llama: Target, greedy_case):
    prompts, reference, _ = greedy_case
    return fit_mtp(tiny_llama, [p + r for p, r in zip(prompts, reference, strict=True)])


# ---------------------------------------------------------------------------- the network


def test_each_depth_runs_its_module_and_deeper_ones_reuse_the_last(tiny_llama: Target):
    drafter = mtp(tiny_llama, modules=2)
    with torch.no_grad():
        for layer in drafter.layers:  # modules that differ, so the one that ran shows
            layer.eh_proj.weight.normal_()
    ids = torch.randint(0, tiny_llama.vocab_size, (2, 5))
    hidden = torch.randn(2, 5, tiny_llama.hidden_size)
    pos = torch.arange(5).expand(2, 5)
    with torch.no_grad():
        outs = [drafter.chain_step(s, ids, hidden, pos)[1] for s in range(4)]
    assert outs[0].shape == (2, 5, tiny_llama.hidden_size)
    assert not torch.equal(outs[0], outs[1])
    assert torch.equal(outs[1], outs[2]) and torch.equal(outs[1], outs[3])
    logits, _ = drafter.chain_step(0, ids, hidden, pos)
    assert logits.shape == (2, 5, tiny_llama.vocab_size) and logits.dtype == torch.float32


def test_the_target_head_and_embedding_stay_frozen_through_training(
    tiny_llama: Target, greedy_case
):
    prompts, reference, _ = greedy_case
    drafter = fit_mtp(tiny_llama, [p + r for p, r in zip(prompts, reference, strict=True)][:4],
                      steps=3)  # fmt: skip
    assert torch.equal(drafter.lm_head.weight, tiny_llama.lm_head_weight)
    assert drafter.embed_tokens.weight.data_ptr() == tiny_llama.embed_weight.data_ptr()
    trained = {name for name, p in drafter.named_parameters() if p.requires_grad}
    assert trained and not {n for n in trained if n.startswith(("lm_head", "embed_tokens"))}
    assert drafter.vocab.is_full
    drafter.check_target(tiny_llama)
    with torch.no_grad():
        drafter.lm_head.weight[0, 0] += 1
    with pytest.raises(ValueError, match="lm_head is not the target's"):
        drafter.check_target(tiny_llama)


def test_fewer_unrolled_depths_than_modules_are_refused(tiny_llama: Target):
    drafter = mtp(tiny_llama, modules=3)
    features, mask, _ = sequences_features(tiny_llama, [[1, 2, 3, 4, 5]])
    with pytest.raises(ValueError, match="raise drafting.ttt_steps or lower drafter.modules"):
        drafter.unroll(features, mask, 2)


# ---------------------------------------------------------------------------- the loss


def test_the_depth_loss_is_the_mean_of_every_depths_soft_ce():
    torch.manual_seed(0)
    B, T, V, S = 2, 7, 11, 3
    logits = [torch.randn(B, T, V) for _ in range(S)]
    valid = [torch.rand(B, T) > 0.3 for _ in range(S)]
    teacher = torch.randn(B, T, V).softmax(-1)
    per_depth = []
    for k in range(S):
        n = T - k - 1  # step k's row t is scored against the teacher at t+k+1
        per_depth.append(soft_cross_entropy(logits[k][:, :n], teacher[:, k + 1 :], valid[k][:, :n]))
    assert torch.allclose(depth_mean_loss(logits, valid, teacher), sum(per_depth) / S)
    # rows masked out change nothing, whatever they hold
    poisoned = [
        torch.where(v[..., None], lg, torch.nan) for lg, v in zip(logits, valid, strict=True)
    ]
    assert torch.allclose(depth_mean_loss(poisoned, valid, teacher), sum(per_depth) / S)


def test_the_depth_loss_is_zero_gradient_free_of_masked_rows():
    logits = [torch.randn(1, 4, 5, requires_grad=True) for _ in range(2)]
    valid = [torch.zeros(1, 4, dtype=torch.bool) for _ in range(2)]
    loss = depth_mean_loss(logits, valid, torch.full((1, 4, 5), 0.2))
    loss.backward()
    assert loss.item() == 0 and all(float(lg.grad.abs().sum()) == 0 for lg in logits)


# ---------------------------------------------------------------------------- decoding


@pytest.mark.parametrize("shape", [ChainShape(3), ChainShape(5), TreeShape(3, 3, 10)])
def test_greedy_equals_the_targets_greedy(tiny_llama: Target, greedy_case, fitted_mtp, shape):
    prompts, reference, _ = greedy_case
    cfg = SpecConfig(shape, temperature=0.0, max_new_tokens=MAX_NEW, eos_token_ids=())
    result = speculative_generate(tiny_llama, fitted_mtp, prompts, cfg)
    assert result.sequences == reference
    assert result.stats["tau"] > 1.3  # drafts were accepted, so the accept path ran
    assert result.stats["lossless"] is True


def test_two_modules_decode_losslessly_in_batches(tiny_llama: Target, greedy_case):
    prompts, reference, _ = greedy_case
    drafter = fit_mtp(tiny_llama, [p + r for p, r in zip(prompts, reference, strict=True)],
                      modules=2, steps=40)  # fmt: skip
    cfg = SpecConfig(ChainShape(4), max_new_tokens=MAX_NEW, eos_token_ids=())
    got = []
    for i in range(0, len(prompts), 7):
        got += speculative_generate(tiny_llama, drafter, prompts[i : i + 7], cfg).sequences
    assert got == reference


@pytest.fixture(scope="module")
def law_mtp(law_case):
    target, _ = law_case
    return target, mtp(target, modules=2, seed=3)


def draw(target, drafter, shape, n: int, seed: int = 0):
    cfg = SpecConfig(
        shape, temperature=1.0, max_new_tokens=shape.depth + 2, seed=seed, eos_token_ids=()
    )
    return speculative_generate(target, drafter, [LAW_PROMPT] * n, cfg)


# ChainShape(2): Leviathan's test and the residual at both offsets; trees: point-mass siblings.
@pytest.mark.parametrize("shape", [ChainShape(2), TreeShape(2, 2, 4)])
def test_rejection_sampling_keeps_the_targets_law(law_mtp, shape):
    target, drafter = law_mtp
    result = draw(target, drafter, shape, n=20_000)
    stat, critical, tv = chi_square(result.sequences, exact_joint(target, LAW_PROMPT, 1.0))
    assert stat < critical, (stat, critical, tv)
    outcomes = result.records["outcome"]
    assert outcomes.count("accepted") > 2000 and outcomes.count("rejected") > 2000


@pytest.mark.parametrize(
    ("name", "broken"), [("accept_drafts", _accept_always), ("correction", _resample_from_p)]
)
def test_the_law_test_catches_a_broken_verifier(law_mtp, monkeypatch, name, broken):
    target, drafter = law_mtp
    monkeypatch.setattr(verify, name, broken)
    result = draw(target, drafter, ChainShape(2), n=8_000)
    stat, critical, _ = chi_square(result.sequences, exact_joint(target, LAW_PROMPT, 1.0))
    assert stat > critical


# ---------------------------------------------------------------------------- training forms


def test_replays_are_what_the_proposer_drafts(tiny_llama: Target, greedy_case, fitted_mtp):
    prompts, _, _ = greedy_case
    cfg = SpecConfig(ChainShape(3), max_new_tokens=MAX_NEW, eos_token_ids=())
    result = speculative_generate(tiny_llama, fitted_mtp, prompts[:4], cfg)
    rec = result.records
    checked = 0
    for s, prompt in enumerate(prompts[:4]):
        seq = torch.tensor(prompt + result.sequences[s])
        out = tiny_llama.forward(seq[None])
        features = Features(seq, out.aux_hidden[0], out.last_hidden[0])
        rows = [i for i in range(len(rec["sequence"])) if rec["sequence"][i] == s]
        anchors = sorted({rec["anchor"][i] for i in rows})
        replayed = fitted_mtp.replay(features, torch.tensor(anchors), 3)
        for a, anchor in enumerate(anchors):
            drafted = [rec["token"][i] for i in rows if rec["anchor"][i] == anchor]
            assert replayed.tokens[a, : len(drafted)].tolist() == drafted
            checked += 1
    assert checked > 20


def test_the_unroll_along_a_replay_is_the_replays_chain(tiny_llama: Target, fitted_mtp):
    """Draft-OPD's training forward along replayed drafts gives the logits the replay drafted
    from (its argmax is each next replayed token)."""
    seq = torch.tensor(random_prompts(1, tiny_llama.vocab_size, seed=5, lengths=(14, 15))[0])
    features, _, _ = sequences_features(tiny_llama, [seq.tolist()])
    anchors = torch.tensor([3, 7, 10])
    one = Features(seq, features.aux[0], features.last_hidden[0])
    replayed = fitted_mtp.replay(one, anchors, 3)
    item = torch.zeros(3, dtype=torch.long)
    with torch.no_grad():
        out = fitted_mtp.unroll(features, None, 3, (item, anchors, replayed.tokens))
    logits = fitted_mtp.replay_logits(out, item, anchors)  # [N, K, V]
    assert torch.equal(logits.argmax(-1), replayed.tokens)
    assert torch.allclose(logits.softmax(-1).amax(-1), replayed.confidence, atol=1e-5)


def test_every_depth_sees_only_the_context_before_its_row(tiny_llama: Target):
    """The one TTT context every module attends to (models.chain): a change at a later row
    leaves the earlier rows' outputs unchanged at every depth."""
    target = tiny_llama
    drafter = mtp(target, modules=2)
    ids = torch.randint(0, target.vocab_size, (1, 8))
    hidden = torch.randn(1, 8, target.hidden_size)
    moved = hidden.clone()
    moved[:, 5:] += 1
    pos = torch.arange(8)[None]
    with torch.no_grad():
        outs = []
        for h in (hidden, moved):
            cache, x, steps = TTTCache(), h, []
            for s in range(3):
                _, x = drafter.chain_step(s, ids, x, pos + s, cache=cache)
                steps.append(x)
            outs.append(steps)
    for a, b in zip(*outs, strict=True):
        assert torch.equal(a[:, :5], b[:, :5]) and not torch.equal(a[:, 5:], b[:, 5:])


# ---------------------------------------------------------------------------- checkpoints


def test_a_checkpoint_round_trips_with_its_kind(tiny_llama: Target, fitted_mtp, tmp_path):
    save_drafter(fitted_mtp, tmp_path)
    assert recorded_kind(tmp_path) == fitted_mtp.kind
    saved = fitted_mtp.tensors()
    assert not [n for n in saved if n.startswith("embed_tokens")]  # the target's, never saved
    loaded = load_drafter(tmp_path, tiny_llama.embed_weight)
    assert isinstance(loaded, MTPDrafter) and loaded.config == fitted_mtp.config
    assert not loaded.lm_head.weight.requires_grad
    ids = torch.randint(0, tiny_llama.vocab_size, (1, 6))
    hidden, pos = torch.randn(1, 6, tiny_llama.hidden_size), torch.arange(6)[None]
    with torch.no_grad():
        assert torch.equal(
            loaded.chain_step(0, ids, hidden, pos)[0], fitted_mtp.chain_step(0, ids, hidden, pos)[0]
        )


def test_bad_configs_are_one_line_errors(tiny_llama: Target):
    cfg = MTPConfig.from_target(tiny_llama.config).to_dict()
    with pytest.raises(ValueError, match="num_modules must be positive"):
        MTPConfig.from_dict(cfg | {"num_modules": 0})
    with pytest.raises(ValueError, match="unknown MTPConfig keys"):
        MTPConfig.from_dict(cfg | {"draft_vocab_size": 3})
    tensors = mtp(tiny_llama).tensors()
    del tensors["lm_head.weight"]
    with pytest.raises(ValueError, match="'lm_head.weight'"):
        MTPDrafter.from_tensors(cfg, tiny_llama.embed_weight, tensors, "ckpt")
