"""The DFlash block drafter: lossless decoding through the one loop (T=0 token-identical to the
target, T>0 the target's law with broken-verifier controls), one drafter forward per verify step,
the block attention's visibility rules, its training forward and loss, and checkpoints."""

from __future__ import annotations

import contextlib
import json

import pytest
import torch
from safetensors.torch import load_file
from torch import Tensor

import models.verify as verify
from models.blocks import block_loss
from models.decoding import SpecConfig, speculative_generate, target_generate
from models.dflash.drafter import DFlashDrafter
from models.dflash.export import export_dflash
from models.dflash.model import (
    DEFAULT_ANCHORS,
    DFlashConfig,
    DFlashModel,
    block_attention,
    default_mask_token,
)
from models.dflash.train import block_unroll, choose_anchors
from models.drafter import ChainShape, TreeShape
from models.drafters import load_drafter, recorded_kind, recorded_settings, save_drafter
from models.features import Features
from models.losses import soft_cross_entropy, teacher_draft_probs
from models.target import Target, load_target
from models.vocab import DraftVocab
from tests.models.conftest import tiny_target
from tests.models.test_decoding import (
    EMBEDDED,
    LAW_PROMPT,
    LAW_VOCAB,
    _accept_always,
    _resample_from_p,
    chi_square,
    exact_joint,
    hf_greedy,
    make_drafter,
    random_prompts,
)

MAX_NEW = 20


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def make_dflash(
    target: Target, draft_vocab_size: int, *, counts=None, seed: int = 0, **settings
) -> DFlashDrafter:
    if counts is None:  # a fixed, scattered draft vocab, so d2t offsets are not all zero
        counts = torch.randperm(
            target.vocab_size, generator=torch.Generator().manual_seed(0)
        ).float()
    torch.manual_seed(seed)
    vocab = DraftVocab.from_counts(counts, draft_vocab_size)
    return DFlashDrafter.new(target, vocab, settings).eval()


def fit_dflash(
    target: Target, sequences: list[list[int]], block_size: int = 5, head: str = "draft"
) -> DFlashDrafter:
    """A DFlash drafter overfit on the target's own greedy sequences, so blocks get accepted."""
    width = max(map(len, sequences))
    ids = torch.zeros(len(sequences), width, dtype=torch.long)
    valid = torch.zeros(len(sequences), width, dtype=torch.bool)
    for i, s in enumerate(sequences):
        ids[i, : len(s)], valid[i, : len(s)] = torch.tensor(s), True
    counts = torch.bincount(ids[valid], minlength=target.vocab_size).float()
    drafter = make_dflash(target, 64, counts=counts, block_size=block_size, head=head)
    out = target.forward(ids)  # right padding is harmless under a causal mask
    teacher = teacher_draft_probs(out.logits, drafter.vocab, 0.0)
    opt = torch.optim.Adam([p for p in drafter.parameters() if p.requires_grad], lr=1e-2)
    drafter.train()
    for _ in range(120):
        unrolled = drafter.unroll(Features(ids, out.aux_hidden), valid, block_size - 1)
        loss = drafter.sft_loss(unrolled, teacher, out.last_hidden, decay=0.8)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return drafter.eval()


@pytest.fixture(scope="module")
def greedy_case(tiny_llama: Target):
    torch.set_num_threads(1)
    prompts = random_prompts(12, tiny_llama.vocab_size, seed=0)
    reference = target_generate(tiny_llama, prompts, MAX_NEW, eos_token_ids=()).sequences
    fitted = fit_dflash(tiny_llama, [p + r for p, r in zip(prompts, reference, strict=True)])
    return prompts, reference, fitted


# ---------------------------------------------------------------------------- decoding


def greedy_blocks(target: Target, drafter, prompts, batch: int) -> tuple[list, list[int]]:
    """Greedy K=4 block decoding of `prompts` in batches: (sequences, accepted per step)."""
    cfg = SpecConfig(ChainShape(4), temperature=0.0, max_new_tokens=MAX_NEW, eos_token_ids=())
    got, accepted = [], []
    for i in range(0, len(prompts), batch):
        result = speculative_generate(target, drafter, prompts[i : i + batch], cfg)
        got += result.sequences
        accepted += result.steps["accepted"]
    return got, accepted


@pytest.mark.parametrize(("which", "batch"), [("random", 12), ("fitted", 1), ("fitted", 5)])
def test_greedy_equals_target_generate(tiny_llama: Target, greedy_case, which: str, batch: int):
    prompts, reference, fitted = greedy_case
    drafter = fitted if which == "fitted" else make_dflash(tiny_llama, 64, seed=1)
    got, accepted = greedy_blocks(tiny_llama, drafter, prompts, batch)
    assert got == reference
    if which == "fitted":  # the equality must also have been tested on accepted blocks
        assert sum(accepted) > 60 and accepted.count(4) >= 5, accepted


def test_a_target_head_is_the_targets_frozen_head_over_the_full_vocab(tiny_llama: Target):
    drafter = make_dflash(tiny_llama, 64, seed=1, head="target")
    assert drafter.config.head == "target" and drafter.vocab.is_full
    assert drafter.config.draft_vocab_size == tiny_llama.vocab_size
    assert torch.equal(drafter.lm_head.weight, tiny_llama.lm_head_weight)
    assert not drafter.lm_head.weight.requires_grad and drafter.fc.weight.requires_grad
    fresh = drafter.untrained()
    assert torch.equal(fresh.lm_head.weight, tiny_llama.lm_head_weight)
    assert not torch.equal(fresh.fc.weight, drafter.fc.weight)
    assert make_dflash(tiny_llama, 64, seed=1).lm_head.weight.requires_grad  # the default
    drafter.check_target(tiny_llama)
    with torch.no_grad():
        drafter.lm_head.weight[0, 0] += 1.0
    with pytest.raises(ValueError, match="frozen lm_head is not the target's"):
        drafter.check_target(tiny_llama)


@pytest.fixture(scope="module")
def target_head_case(tiny_llama: Target, greedy_case):
    prompts, reference, _ = greedy_case
    seqs = [p + r for p, r in zip(prompts, reference, strict=True)]
    return fit_dflash(tiny_llama, seqs, head="target")


@pytest.mark.parametrize(("which", "batch"), [("random", 12), ("fitted", 5)])
def test_target_head_greedy_equals_target_generate(
    tiny_llama: Target, greedy_case, target_head_case, which: str, batch: int
):
    prompts, reference, _ = greedy_case
    fitted = target_head_case
    drafter = fitted if which == "fitted" else make_dflash(tiny_llama, 64, seed=1, head="target")
    got, accepted = greedy_blocks(tiny_llama, drafter, prompts, batch)
    assert got == reference
    if which == "fitted":  # trained around the frozen head, whose weights never moved
        assert sum(accepted) > 60 and accepted.count(4) >= 5, accepted
        assert torch.equal(fitted.lm_head.weight, tiny_llama.lm_head_weight)


@pytest.mark.skipif(
    not (EMBEDDED / "model.safetensors").is_file(), reason="embedded target not trained yet"
)
def test_greedy_equals_target_on_the_embedded_target():
    """The embedded target (bf16, a pad token: the mask token is `<|pad|>`, id 2)."""
    target = load_target(EMBEDDED, aux_layer_ids=(1, 3, 5))
    prompts = random_prompts(8, target.vocab_size, seed=7, lengths=(14, 19))
    reference = hf_greedy(target, prompts, 16)
    drafter = make_dflash(target, min(1024, target.vocab_size))
    assert drafter.config.mask_token_id == 2
    cfg = SpecConfig(ChainShape(6), max_new_tokens=16, eos_token_ids=())
    assert speculative_generate(target, drafter, prompts, cfg).sequences == reference


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_one_drafter_forward_per_verify_step(
    tiny_llama: Target, greedy_case, monkeypatch, temperature: float
):
    prompts, _, fitted = greedy_case
    calls = [0]
    real = DFlashModel.forward

    def counting(self, *args, **kwargs):
        calls[0] += 1
        return real(self, *args, **kwargs)

    monkeypatch.setattr(DFlashModel, "forward", counting)
    cfg = SpecConfig(ChainShape(4), temperature=temperature, max_new_tokens=MAX_NEW, seed=2)
    stats = speculative_generate(tiny_llama, fitted, prompts[:5], cfg).stats
    # the last step of a row with one token left drafts nothing (budget 0): no forward then
    assert calls[0] == stats["drafter_forwards"]
    assert stats["verify_forwards"] - 1 <= calls[0] <= stats["verify_forwards"]
    assert stats["tau"] > (1.5 if temperature == 0 else 1.0)


LAW_COUNTS = torch.tensor([0.0, 5, 5, 0, 5, 5, 5, 5])  # q = 0 on ids 0 and 3


@pytest.fixture(scope="module")
def law_case():
    target = tiny_target(
        "llama",
        vocab_size=LAW_VOCAB,
        hidden_size=16,
        num_layers=4,
        num_heads=2,
        num_kv_heads=1,
        head_scale=1.0,
    )
    return target, make_dflash(target, 6, counts=LAW_COUNTS, seed=3, block_size=3)


def sample_first_three(target, drafter, k: int, temperature: float, n: int, seed: int = 0):
    cfg = SpecConfig(
        ChainShape(k), temperature=temperature, max_new_tokens=k + 2, seed=seed, eos_token_ids=()
    )
    return speculative_generate(target, drafter, [LAW_PROMPT] * n, cfg)


@pytest.mark.parametrize(("k", "temperature"), [(1, 1.0), (2, 1.0), (2, 0.7)])
def test_sampling_law_equals_target(law_case, k: int, temperature: float):
    target, drafter = law_case
    result = sample_first_three(target, drafter, k, temperature, n=20_000)
    stat, critical, tv = chi_square(result.sequences, exact_joint(target, LAW_PROMPT, temperature))
    assert stat < critical, (stat, critical, tv)
    outcomes = result.records["outcome"]
    assert outcomes.count("accepted") > 2000 and outcomes.count("rejected") > 2000


@pytest.mark.parametrize(
    ("name", "broken"), [("accept_drafts", _accept_always), ("correction", _resample_from_p)]
)
def test_sampling_law_catches_a_broken_verifier(law_case, monkeypatch, name: str, broken):
    target, drafter = law_case
    monkeypatch.setattr(verify, name, broken)
    result = sample_first_three(target, drafter, 2, 1.0, n=8_000)
    stat, critical, _ = chi_square(result.sequences, exact_joint(target, LAW_PROMPT, 1.0))
    assert stat > critical


def test_blocks_refuse_trees_and_too_long_chains(tiny_llama: Target):
    drafter = make_dflash(tiny_llama, 64, block_size=4)
    for shape in (ChainShape(4), TreeShape(2, 2, 4)):
        with pytest.raises(ValueError, match="block|tree"):
            drafter.proposer(shape, 0.0, torch.Generator(), None)


# ---------------------------------------------------------------------------- the block mask


def test_a_block_sees_only_earlier_context_and_its_own_slots(tiny_llama: Target):
    """Changing context at or after a block's anchor, or another block, leaves its logits
    alone; changing a later slot of its own block changes an earlier slot (bidirectional)."""
    drafter = make_dflash(tiny_llama, 64, seed=4)
    T, B = 16, drafter.config.block_size
    ids = torch.randint(
        0, tiny_llama.vocab_size, (1, T), generator=torch.Generator().manual_seed(1)
    )
    aux = tiny_llama.forward(ids).aux_hidden
    positions = torch.arange(T)[None]
    anchors = torch.tensor([[3, 9]])
    visible = positions[:, None, :] < anchors[..., None]  # [1, 2, T]

    def run(aux, blocks):
        return drafter(blocks, anchors, drafter.context_kv(aux, positions), visible)

    blocks = drafter.block_tokens(ids.gather(1, anchors))
    base = run(aux, blocks)
    later = aux.clone()
    later[:, 3:] += 1.0  # context from block 0's anchor on
    assert torch.allclose(run(later, blocks)[:, 0], base[:, 0], atol=1e-5)
    assert not torch.allclose(run(later, blocks)[:, 1], base[:, 1], atol=1e-3)
    other = blocks.clone()
    other[0, 1, 0] = (other[0, 1, 0] + 1) % tiny_llama.vocab_size  # block 1's anchor token
    assert torch.allclose(run(aux, other)[:, 0], base[:, 0], atol=1e-5)
    own = blocks.clone()
    own[0, 0, B - 1] = 7  # the last slot of block 0
    assert not torch.allclose(run(aux, own)[0, 0, 0], base[0, 0, 0], atol=1e-4)  # slot 1


def test_training_blocks_equal_the_decoding_block(tiny_llama: Target):
    """The many-anchor training forward gives each anchor the logits a proposer's single block
    forward gives from the prefix before it."""
    drafter = make_dflash(tiny_llama, 64, seed=5)
    T = 14
    ids = torch.randint(
        0, tiny_llama.vocab_size, (2, T), generator=torch.Generator().manual_seed(2)
    )
    aux = tiny_llama.forward(ids).aux_hidden
    out = block_unroll(drafter, Features(ids, aux), None, drafter.config.block_size - 1)
    for row in range(2):
        for j in (0, 5, 11):
            a = int(out.anchors[row, j])
            alone = drafter(
                drafter.block_tokens(ids[row : row + 1, a : a + 1]),
                torch.tensor([[a]]),
                drafter.context_kv(aux[row : row + 1, :a], torch.arange(a)[None]),
                torch.ones(1, 1, a, dtype=torch.bool),
            )[0, 0]
            assert torch.allclose(out.stacked()[row, j], alone, atol=1e-5)


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2)])
def test_a_single_blocks_fused_attention_equals_the_per_block_path(heads: int, kv_heads: int):
    """Decoding's one-block attention (one SDPA call) equals the training path's per-block
    scores, with grouped keys and context slots the block may not read."""
    g = torch.Generator().manual_seed(0)
    N, B, S, d = 3, 8, 37, 16
    q = torch.randn(N, heads, 1, B, d, generator=g)
    k_ctx, v_ctx = torch.randn(2, N, kv_heads, S, d, generator=g)
    k_blk, v_blk = torch.randn(2, N, kv_heads, 1, B, d, generator=g)
    visible = torch.rand(N, 1, S, generator=g) > 0.3
    fused = block_attention(q, k_ctx, v_ctx, k_blk, v_blk, visible)
    twice = block_attention(  # two copies of the block take the per-block path
        q.repeat(1, 1, 2, 1, 1),
        k_ctx,
        v_ctx,
        k_blk.repeat(1, 1, 2, 1, 1),
        v_blk.repeat(1, 1, 2, 1, 1),
        visible.repeat(1, 2, 1),
    )
    assert torch.allclose(fused, twice[:, :, :1], atol=1e-5)
    assert torch.allclose(fused, twice[:, :, 1:], atol=1e-5)


def test_anchors_cover_trained_positions_without_repeats():
    mask = torch.zeros(2, 12, dtype=torch.bool)
    mask[0, 4:] = True
    mask[1, 2:7] = True
    anchors, real = choose_anchors(mask, cap=64, sample=False)
    assert anchors[0][real[0]].tolist() == list(range(3, 11))  # x_{a+1} trained, a+1 < T
    assert anchors[1][real[1]].tolist() == list(range(1, 6))
    torch.manual_seed(0)
    sampled, real = choose_anchors(torch.ones(3, 40, dtype=torch.bool), cap=5, sample=True)
    assert sampled.shape == (3, 5) and bool(real.all())
    assert all(len(set(r)) == 5 and r == sorted(r) for r in sampled.tolist())


# ---------------------------------------------------------------------------- the loss


def test_block_loss_is_the_decayed_sum_of_per_slot_soft_ce():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 3, 4, 10, generator=gen)
    teacher = torch.randn(2, 3, 4, 10, generator=gen).softmax(-1)
    valid = torch.rand(2, 3, 4, generator=gen) > 0.3
    want = sum(
        0.8**k * soft_cross_entropy(logits[:, :, k], teacher[:, :, k], valid[:, :, k])
        for k in range(4)
    )
    assert torch.allclose(block_loss(logits, teacher, valid, 0.8), want)
    # masked-out slots never matter; a teacher-matching drafter pays only the teacher's entropy
    noisy = torch.where(valid[..., None], logits, torch.randn_like(logits) * 100)
    assert torch.allclose(block_loss(noisy, teacher, valid, 0.8), want)
    entropy = block_loss(teacher.log(), teacher, valid, 1.0)
    assert entropy <= block_loss(logits, teacher, valid, 1.0)
    with pytest.raises(ValueError, match="decay"):
        block_loss(logits, teacher, valid, 0.0)


def test_later_slots_weigh_less():
    teacher = torch.full((1, 1, 3, 4), 0.25)
    logits = torch.zeros(1, 1, 3, 4)
    per_slot = []
    for k in range(3):
        valid = torch.zeros(1, 1, 3, dtype=torch.bool)
        valid[..., k] = True
        per_slot.append(float(block_loss(logits, teacher, valid, 0.5)))
    assert per_slot[0] == pytest.approx(2 * per_slot[1]) and per_slot[1] == pytest.approx(
        2 * per_slot[2]
    )


def test_training_raises_teacher_forced_acceptance(tiny_llama: Target, greedy_case):
    prompts, reference, fitted = greedy_case
    seqs = [p + r for p, r in zip(prompts, reference, strict=True)]
    width = max(map(len, seqs))
    ids = torch.tensor([s + [0] * (width - len(s)) for s in seqs])
    mask = torch.tensor([[i < len(s) for i in range(width)] for s in seqs])
    out = tiny_llama.forward(ids)
    taus = []
    for drafter in (fitted.untrained(), fitted):
        unrolled = drafter.unroll(Features(ids, out.aux_hidden), mask, 4)
        taus.append(drafter.acceptance(unrolled, out.logits, chain_k=4).summary()["tau_chain"])
    assert taus[1] > taus[0] + 1.0, taus


# ---------------------------------------------------------------------------- replays


def _proposed_block(drafter: DFlashDrafter, ids: Tensor, aux: Tensor, e: int, k: int) -> Tensor:
    """What the decoding loop's proposer drafts after committing y<e (one sequence)."""
    proposer = drafter.proposer(
        ChainShape(k), 0.0, torch.Generator(), lambda _: contextlib.nullcontext()
    )
    rows = Features(
        ids=ids[1:e][None],
        aux=aux[: e - 1][None],
        positions=torch.arange(e - 1)[None],
        valid=torch.ones(1, e - 1, dtype=torch.bool),
    )
    return proposer.propose(rows, torch.tensor([k])).tokens[0]


def test_replay_drafts_what_the_decoding_loop_drafts(tiny_llama: Target, greedy_case):
    """Anchors of one sequence replayed in one forward draft, each, the proposer's block after
    the prefix y<e (a repeated anchor drafts it twice)."""
    prompts, reference, fitted = greedy_case
    ids = torch.tensor(prompts[0] + reference[0])
    aux = tiny_llama.forward(ids[None]).aux_hidden[0]
    anchors = torch.tensor([2, 7, 7, len(ids)])
    out = fitted.replay(Features(ids, aux), anchors, 3)
    assert out.tokens.shape == (4, 3) and torch.equal(out.logq, torch.zeros(4, 3))
    for c, e in enumerate(anchors.tolist()):
        assert torch.equal(out.tokens[c], _proposed_block(fitted, ids, aux, e, 3)), e
    assert ((out.confidence > 0) & (out.confidence <= 1)).all()


def test_sampled_replays_carry_their_log_q(tiny_llama: Target):
    drafter = make_dflash(tiny_llama, 64, seed=3)
    ids = torch.randint(0, tiny_llama.vocab_size, (12,), generator=torch.Generator().manual_seed(1))
    aux = tiny_llama.forward(ids[None]).aux_hidden[0]
    gen = torch.Generator().manual_seed(0)
    out = drafter.replay(
        Features(ids, aux), torch.tensor([4, 9]), 4, temperature=0.7, generator=gen
    )
    blocks = drafter.unroll(
        Features(ids[None], aux[None]),
        None,
        4,
        replays=(torch.zeros(2, dtype=torch.long), torch.tensor([4, 9]), out.tokens),
    )
    logq = (drafter.replay_logits(blocks, None, torch.tensor([4, 9])) / 0.7).log_softmax(-1)
    drafted = drafter.vocab.to_draft(out.tokens)
    assert torch.allclose(out.logq, logq.gather(-1, drafted[..., None])[..., 0], atol=1e-5)


def test_unroll_with_replays_gives_each_replay_its_block(tiny_llama: Target, greedy_case):
    """The training forward along a replay is the block at its anchor (no slot reads a draft):
    at T=0 its argmax is the replay, the teacher-forced blocks are those of an unroll without
    replays, and the gradient reaches the drafter through the replayed logits."""
    prompts, reference, fitted = greedy_case
    seqs = [torch.tensor(p + r) for p, r in zip(prompts[:2], reference[:2], strict=True)]
    width = max(len(s) for s in seqs)
    ids = torch.zeros(2, width, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = s
    aux = tiny_llama.forward(ids).aux_hidden
    item, anchor = torch.tensor([1, 0, 1, 0]), torch.tensor([5, 3, 9, 12])
    tokens = torch.stack(
        [
            fitted.replay(Features(ids[i], aux[i]), anchor[n : n + 1], 4).tokens[0]
            for n, i in enumerate(item)
        ]
    )
    out = fitted.unroll(Features(ids, aux), None, 4, replays=(item, anchor, tokens))
    logits = fitted.replay_logits(out, item, anchor)  # [R, K, Vd]
    assert torch.equal(fitted.vocab.to_target(logits.argmax(-1)), tokens)
    plain = fitted.unroll(Features(ids, aux), None, 4)
    assert torch.allclose(out.stacked(), plain.stacked(), atol=1e-5)
    assert torch.equal(out.valid, plain.valid)
    logits.sum().backward()
    assert fitted.lm_head.weight.grad is not None and fitted.lm_head.weight.grad.abs().sum() > 0
    fitted.zero_grad()


# ---------------------------------------------------------------------------- checkpoints


def test_save_load_round_trip_records_the_kind(tiny_llama: Target, greedy_case, tmp_path):
    _, _, fitted = greedy_case
    save_drafter(fitted, tmp_path)
    assert recorded_kind(tmp_path) == "dflash"
    loaded = load_drafter(tmp_path, tiny_llama.embed_weight, kind="dflash")
    assert isinstance(loaded, DFlashDrafter) and loaded.config == fitted.config
    for name, t in fitted.tensors().items():
        assert torch.equal(loaded.tensors()[name], t), name
    with pytest.raises(ValueError, match="dflash drafter, not a eagle3"):
        load_drafter(tmp_path, tiny_llama.embed_weight, kind="eagle3")


def test_target_head_checkpoint_round_trip_keeps_it_frozen(
    tiny_llama: Target, target_head_case, tmp_path
):
    save_drafter(target_head_case, tmp_path)
    loaded = load_drafter(tmp_path, tiny_llama.embed_weight, kind="dflash")
    assert loaded.config == target_head_case.config and loaded.config.head == "target"
    for name, t in target_head_case.tensors().items():
        assert torch.equal(loaded.tensors()[name], t), name
    assert torch.equal(loaded.lm_head.weight, tiny_llama.lm_head_weight)
    assert not loaded.lm_head.weight.requires_grad
    loaded.check_target(tiny_llama)


def test_configs_saved_before_the_head_choice_load_as_draft_heads(tiny_llama: Target):
    old = make_dflash(tiny_llama, 64).config.to_dict()
    del old["head"]
    assert DFlashConfig.from_dict(old).head == "draft"


def test_bad_heads_are_one_line_errors(tiny_llama: Target):
    with pytest.raises(ValueError, match="head must be one of"):
        make_dflash(tiny_llama, 64, head="shared")
    full = make_dflash(tiny_llama, 64, head="target").config
    with pytest.raises(ValueError, match="target head covers the full vocab"):
        DFlashConfig.from_dict(full.to_dict() | {"draft_vocab_size": 64})


def test_bad_settings_are_one_line_errors(tiny_llama: Target):
    with pytest.raises(ValueError, match="block_size must be >= 2"):
        make_dflash(tiny_llama, 64, block_size=1)
    with pytest.raises(ValueError, match="mask_token_id"):
        make_dflash(tiny_llama, 64, mask_token_id=tiny_llama.vocab_size)
    with pytest.raises(ValueError, match="unknown DFlash drafter settings"):
        make_dflash(tiny_llama, 64, ttt_steps=3)


def test_settings_beyond_the_target_are_refused_before_any_tensor(tiny_llama: Target, tmp_path):
    # tiny_llama: 4 layers, 512 positions, 96 ids
    for settings, message in (
        ({"block_size": 513}, "block_size 513 exceeds the target's 512 positions"),
        ({"layers": 5}, r"a 5-layer drafter is deeper than the target \(4 layers\)"),
        ({"mask_token_id": 96}, "mask_token_id 96 is outside the target vocab"),
        ({"blocks": 3}, "unknown DFlash drafter settings"),
    ):
        with pytest.raises(ValueError, match=message):
            DFlashDrafter.check_settings(settings, tiny_llama)
        with pytest.raises(ValueError, match=message):
            make_dflash(tiny_llama, 64, **settings)
    DFlashDrafter.check_settings({"block_size": 512, "layers": 4, "head": "target"}, tiny_llama)
    # what a saved drafter was built with, by setting name (continuing it must not contradict it)
    save_drafter(make_dflash(tiny_llama, 64, block_size=3, layers=1, mask_token_id=7), tmp_path)
    assert recorded_settings(tmp_path) == {
        "block_size": 3,
        "layers": 1,
        "anchors": DEFAULT_ANCHORS,
        "mask_token_id": 7,
        "head": "draft",
        "target_layers": 3,
    }


def test_target_layers_is_a_setting_the_target_captures_as_many_of(tiny_llama: Target, tmp_path):
    """Five target layers (the public DFlash recipe's count): the context reads five states,
    saved and recorded as such; a target capturing another count is refused in one line."""
    from tests.models.conftest import tiny_hf_model

    target = Target.from_model(tiny_hf_model(num_layers=8), aux_layers=5)
    assert target.aux_layer_ids == (2, 3, 4, 5, 6)  # spread over layer 1's to layer 5's output
    drafter = make_dflash(target, 64, target_layers=5)
    assert drafter.config.target_layer_ids == (2, 3, 4, 5, 6)
    assert drafter.fc.in_features == 5 * target.hidden_size
    assert drafter.reads.target_layers == 5 and drafter.reads.last_hidden
    ids = torch.randint(0, target.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    out = target.forward(ids)
    assert out.aux_hidden.shape[-1] == 5 * target.hidden_size
    unrolled = drafter.unroll(Features(ids, out.aux_hidden), None, 3)
    teacher = teacher_draft_probs(out.logits, drafter.vocab, 0.0)
    assert torch.isfinite(drafter.sft_loss(unrolled, teacher, out.last_hidden, decay=0.8))
    save_drafter(drafter, tmp_path)
    assert recorded_settings(tmp_path)["target_layers"] == 5
    with pytest.raises(ValueError, match="reading 5 target layers .* captures 3") as err:
        DFlashDrafter.check_settings({"target_layers": 5}, tiny_llama)
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="does not match the target"):
        load_drafter(tmp_path, target.embed_weight).check_target(
            Target.from_model(
                tiny_hf_model(num_layers=8), aux_layer_ids=(2, 3, 4, 5, 7), aux_layers=5
            )
        )


def test_mask_token_is_the_pad_token_else_the_last_id():
    assert default_mask_token({"pad_token_id": 2, "eos_token_id": 1, "vocab_size": 4096}) == 2
    assert default_mask_token({"pad_token_id": 1, "eos_token_id": 1, "vocab_size": 4096}) == 4095
    assert default_mask_token({"pad_token_id": None, "vocab_size": 96}) == 95


# ---------------------------------------------------------------------------- export


@pytest.mark.parametrize("draft_vocab", [64, 96])
def test_export_round_trips_in_vllms_dflash_format(tiny_llama: Target, tmp_path, draft_vocab):
    drafter = make_dflash(tiny_llama, draft_vocab, seed=6)
    out = export_dflash(drafter, tmp_path)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["model_type"] == "qwen3"
    assert config["dflash_config"] == {
        "target_layer_ids": [0, 1, 2],  # vLLM's layer-output ids: aux ids (1, 2, 3) minus one
        "mask_token_id": drafter.config.mask_token_id,
        "block_size": drafter.config.block_size,
        "use_aux_hidden_state": True,
    }
    assert config["rope_parameters"]["rope_theta"] == 10000.0
    names = set(load_file(str(out / "model.safetensors")))
    assert "fc.weight" in names and "layers.1.self_attn.k_norm.weight" in names
    assert not any(n.startswith(("model.", "embed_tokens")) for n in names)
    assert ("d2t" in names) == (draft_vocab < tiny_llama.vocab_size)
    back = DFlashDrafter.read_export(out, tiny_llama.embed_weight)
    assert back.config == drafter.config
    prompts = random_prompts(3, tiny_llama.vocab_size, seed=7)
    cfg = SpecConfig(ChainShape(4), max_new_tokens=10, eos_token_ids=())
    a = speculative_generate(tiny_llama, drafter, prompts, cfg)
    b = speculative_generate(tiny_llama, back, prompts, cfg)
    assert a.records == b.records


def test_a_target_head_exports_its_head_and_no_vocab_map(
    tiny_llama: Target, target_head_case, tmp_path
):
    out = export_dflash(target_head_case, tmp_path)
    config = json.loads((out / "config.json").read_text())
    assert config["draft_vocab_size"] == config["vocab_size"] == tiny_llama.vocab_size
    assert config["opd_pipeline"]["head"] == "target"
    shipped = load_file(str(out / "model.safetensors"))
    assert "d2t" not in shipped and "t2d" not in shipped
    # vLLM shares the target's head when the shipped one equals it: the same head either way.
    assert torch.equal(shipped["lm_head.weight"], tiny_llama.lm_head_weight)
    back = DFlashDrafter.read_export(out, tiny_llama.embed_weight)
    assert back.config == target_head_case.config and not back.lm_head.weight.requires_grad
    assert torch.equal(back.probe_logits(3), target_head_case.probe_logits(3))
    prompts = random_prompts(3, tiny_llama.vocab_size, seed=7)
    cfg = SpecConfig(ChainShape(4), max_new_tokens=10, eos_token_ids=())
    a = speculative_generate(tiny_llama, target_head_case, prompts, cfg)
    b = speculative_generate(tiny_llama, back, prompts, cfg)
    assert a.records == b.records


def test_only_dflash_drafters_export_as_dflash(tiny_llama: Target, tmp_path):
    eagle = make_drafter(tiny_llama, 64)
    with pytest.raises(ValueError, match="eagle3 drafter cannot be exported in the dflash"):
        export_dflash(eagle, tmp_path)
