"""Medusa heads as a drafter kind: lossless through the one loop (T=0 token for token, T>0 in law,
on chains and static trees), typical acceptance measurably lossy, and the training forms agree
with what decoding drafts."""

# ruff: noqa: F811 (the fixtures imported from test_decoding are parameters here)

from __future__ import annotations

import pytest
import torch

import models.verify as verify
from lab.benchmarks.bench_typical_law import EMBEDDED, fit_drafter, measure, prefix_ids
from models.blocks import block_acceptance
from models.decoding import SpecConfig, speculative_generate
from models.drafter import ChainShape, TreeShape
from models.drafters import load_drafter, recorded_kind, save_drafter
from models.features import Features
from models.medusa.drafter import MedusaDrafter
from models.medusa.propose import static_tree
from models.target import Target, load_target
from models.verify import Typical
from models.vocab import DraftVocab
from tests.models.test_decoding import (  # noqa: F401 (fixtures)
    LAW_PROMPT,
    MAX_NEW,
    _accept_always,
    _accept_child_always,
    _resample_from_p,
    chi_square,
    exact_joint,
    greedy_case,
    law_case,
    random_prompts,
)


def medusa(target: Target, draft_vocab_size: int, *, heads: int = 4, counts=None, seed: int = 0):
    """A Medusa drafter started as Medusa starts (every head the target's own head), with its
    residual blocks nudged off zero so the heads differ from each other."""
    if counts is None:
        counts = torch.randperm(target.vocab_size, generator=torch.Generator().manual_seed(0))
    vocab = DraftVocab.from_counts(counts.float(), draft_vocab_size)
    torch.manual_seed(seed)
    drafter = MedusaDrafter.new(target, vocab, {"heads": heads})
    with torch.no_grad():
        for block in drafter.blocks:
            for layer in block:
                layer.linear.weight.normal_(0, 0.3)
    return drafter.eval()


def fit_medusa(target: Target, sequences: list[list[int]], draft_vocab_size: int, steps=200):
    """Medusa's SFT (per-head CE against the target, models/blocks.py) on the target's own
    sequences, so drafts get accepted."""
    drafter = medusa(target, draft_vocab_size)
    width = max(map(len, sequences))
    ids = torch.tensor([s + [0] * (width - len(s)) for s in sequences])
    mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in sequences]).bool()
    with torch.no_grad():
        out = target.forward(ids)
        teacher = torch.softmax(out.logits[..., drafter.vocab.draft_to_target_ids], -1)
    features = Features(ids, out.aux_hidden, out.last_hidden)
    opt = torch.optim.Adam(drafter.parameters(), lr=1e-2)
    drafter.train()
    for _ in range(steps):
        unrolled = drafter.unroll(features, mask, drafter.config.num_heads)
        loss = drafter.sft_loss(unrolled, teacher, out.last_hidden, decay=0.8)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return drafter.eval()


@pytest.fixture(scope="module")
def fitted_medusa(tiny_llama: Target, greedy_case):
    prompts, reference, _ = greedy_case
    return fit_medusa(tiny_llama, [p + r for p, r in zip(prompts, reference, strict=True)], 64)


# ---------------------------------------------------------------------------- T = 0


@pytest.mark.parametrize("shape", [ChainShape(3), TreeShape(3, 3, 10), TreeShape(4, 4, 24)])
def test_greedy_equals_the_targets_greedy(tiny_llama: Target, greedy_case, fitted_medusa, shape):
    prompts, reference, _ = greedy_case
    cfg = SpecConfig(shape, temperature=0.0, max_new_tokens=MAX_NEW, eos_token_ids=())
    result = speculative_generate(tiny_llama, fitted_medusa, prompts, cfg)
    assert result.sequences == reference
    assert result.stats["tau"] > 1.3  # drafts were accepted, so the accept path ran
    assert result.stats["lossless"] is True


def test_typical_acceptance_at_t0_is_greedy(tiny_llama: Target, greedy_case, fitted_medusa):
    prompts, reference, _ = greedy_case
    cfg = SpecConfig(
        TreeShape(3, 3, 10), max_new_tokens=MAX_NEW, eos_token_ids=(), typical=Typical()
    )
    assert speculative_generate(tiny_llama, fitted_medusa, prompts, cfg).sequences == reference


# ---------------------------------------------------------------------------- T > 0


def law_medusa(law_case) -> tuple[Target, MedusaDrafter]:
    target, _ = law_case
    counts = torch.tensor([0.0, 5, 5, 0, 5, 5, 5, 5])  # q = 0 on ids 0 and 3
    return target, medusa(target, 6, counts=counts, seed=3)


def draw(target, drafter, shape, n: int, seed: int = 0, typical=None, temperature=1.0):
    cfg = SpecConfig(
        shape,
        temperature=temperature,
        max_new_tokens=shape.depth + 2,
        seed=seed,
        eos_token_ids=(),
        typical=typical,
    )
    return speculative_generate(target, drafter, [LAW_PROMPT] * n, cfg)


# ChainShape(2): Leviathan's test on each head's own q; trees: point-mass sibling tests.
@pytest.mark.parametrize("shape", [ChainShape(2), TreeShape(2, 2, 4), TreeShape(2, 3, 6)])
def test_rejection_sampling_keeps_the_targets_law(law_case, shape):
    target, drafter = law_medusa(law_case)
    result = draw(target, drafter, shape, n=20_000)
    stat, critical, tv = chi_square(result.sequences, exact_joint(target, LAW_PROMPT, 1.0))
    assert stat < critical, (stat, critical, tv)
    outcomes = result.records["outcome"]
    assert outcomes.count("accepted") > 2000 and outcomes.count("rejected") > 2000


@pytest.mark.parametrize(
    ("shape", "name", "broken"),
    [
        (ChainShape(2), "accept_drafts", _accept_always),
        (ChainShape(2), "correction", _resample_from_p),
        (TreeShape(2, 3, 6), "accept_children", _accept_child_always),
    ],
)
def test_the_law_test_catches_a_broken_verifier(law_case, monkeypatch, shape, name, broken):
    target, drafter = law_medusa(law_case)
    monkeypatch.setattr(verify, name, broken)
    result = draw(target, drafter, shape, n=8_000)
    stat, critical, _ = chi_square(result.sequences, exact_joint(target, LAW_PROMPT, 1.0))
    assert stat > critical


def test_typical_acceptance_is_lossy_by_at_least_one_minus_max_p(law_case):
    target, drafter = law_medusa(law_case)
    result = draw(target, drafter, TreeShape(2, 3, 6), n=8_000, typical=Typical())
    joint = exact_joint(target, LAW_PROMPT, 1.0)
    stat, critical, _ = chi_square(result.sequences, joint)
    assert stat > critical  # the law test that passes for rejection sampling fails here
    first = torch.tensor([s[0] for s in result.sequences])
    p1 = joint.sum((1, 2))  # the target's law of the first token
    empirical = torch.bincount(first, minlength=len(p1)).double() / len(first)
    tv = 0.5 * float((empirical - p1).abs().sum())
    # the first token is the argmax every time, so TV is exactly 1 - max p (no sampling noise)
    assert first.unique().tolist() == [int(p1.argmax())]
    assert tv == pytest.approx(1 - float(p1.max()), abs=1e-9)
    assert result.stats["acceptance"] == "typical" and result.stats["lossless"] is False
    # and it did accept drafts (it is a verifier, not plain greedy decoding)
    assert result.records["outcome"].count("accepted") > 1000


def test_typical_acceptance_takes_the_deepest_passing_path():
    # root -> node 1 (p high) -> node 3 (p high); node 2 (p high, depth 1) has no child:
    # the deepest passing path is 1 -> 3, and the token after it is p's argmax at node 3.
    V = 5
    logits = torch.full((1, 4, V), -10.0)
    logits[0, 0, 1] = logits[0, 0, 2] = 5.0  # root: tokens 1 and 2 likely
    logits[0, 1, 3] = 5.0  # after node 1 (token 1): token 3
    logits[0, 3, 4] = 5.0  # after node 3: token 4 is the argmax
    from models.drafter import Proposal

    proposal = Proposal(
        tokens=torch.tensor([[1, 2, 3]]),
        q=torch.ones(1, 3),
        confidence=torch.ones(1, 3),
        forwards=1,
        parent=torch.tensor([[0, 0, 1]]),
        depth=torch.tensor([[1, 1, 2]]),
    )
    v = verify.accept_typical(
        proposal, logits, torch.tensor([2]), 2, torch.tensor([], dtype=torch.long), 1.0, Typical()
    )
    assert v.accepted.tolist() == [2] and v.path.tolist() == [[1, 3]] and v.next.tolist() == [4]
    assert v.outcome.tolist() == [[0, 1, 0]]  # node 2: tried and not taken


# ---------------------------------------------------------------------------- training forms


def test_replays_are_what_the_proposer_drafts(tiny_llama: Target, greedy_case, fitted_medusa):
    """A replay from anchor e reads h_{e-2}: the same drafts decoding proposed after y<e."""
    prompts, _, _ = greedy_case
    cfg = SpecConfig(ChainShape(3), max_new_tokens=MAX_NEW, eos_token_ids=())
    result = speculative_generate(tiny_llama, fitted_medusa, prompts[:4], cfg)
    rec = result.records
    checked = 0
    for s, prompt in enumerate(prompts[:4]):
        seq = torch.tensor(prompt + result.sequences[s])
        out = tiny_llama.forward(seq[None])
        features = Features(seq, out.aux_hidden[0], out.last_hidden[0])
        rows = [i for i in range(len(rec["sequence"])) if rec["sequence"][i] == s]
        anchors = sorted({rec["anchor"][i] for i in rows})
        replayed = fitted_medusa.replay(features, torch.tensor(anchors), 3)
        for a, anchor in enumerate(anchors):
            drafted = [rec["token"][i] for i in rows if rec["anchor"][i] == anchor]
            assert replayed.tokens[a, : len(drafted)].tolist() == drafted
            checked += 1
    assert checked > 20


def test_teacher_forced_acceptance_is_greedy_decodings(tiny_llama: Target, greedy_case):
    """Each position's leading head hits = what greedy verification accepts from there."""
    prompts, reference, _ = greedy_case
    drafter = medusa(tiny_llama, 64)
    seqs = [p + r for p, r in zip(prompts, reference, strict=True)][:4]
    for seq in seqs:
        ids = torch.tensor([seq])
        out = tiny_llama.forward(ids)
        unrolled = drafter.unroll(Features(ids, out.aux_hidden, out.last_hidden), None, 3)
        stats = block_acceptance(unrolled, out.logits, drafter.vocab, chain_k=3, expected=False)
        greedy = out.logits[0].argmax(-1)  # [T]
        drafts = drafter.vocab.to_target(drafter(out.last_hidden[0], 3).argmax(-1))  # [T, 3]
        hits = 0
        for t in range(len(seq) - 4):  # every head's label inside the sequence
            for k in range(3):
                if int(drafts[t, k]) != int(greedy[t + 1 + k]):
                    break
                hits += 1
        full = len(seq) - 4
        assert stats.chain_rows.item() == full
        assert stats.chain_len.item() == hits


def test_a_static_tree_is_closed_under_parents_and_keeps_the_top1_chain():
    tree = static_tree(4, 3, 20)
    assert len(tree) == 20 == len(set(tree))
    assert all(len(p) == 1 or p[:-1] in tree for p in tree)
    assert all((0,) * d in tree for d in range(1, 5))
    assert tree == sorted(tree, key=lambda p: (len(p), p))  # parents before children


def test_deeper_than_its_heads_or_a_confidence_floor_is_refused(tiny_llama: Target):
    drafter = medusa(tiny_llama, 64, heads=2)
    gen = torch.Generator()
    with pytest.raises(ValueError, match="exceed the drafter's 2 Medusa heads"):
        drafter.proposer(ChainShape(3), 0.0, gen, None)
    with pytest.raises(ValueError, match="static"):
        drafter.proposer(TreeShape(2, 2, 4, min_confidence=0.1), 0.0, gen, None)
    with pytest.raises(ValueError, match="at most 2"):
        drafter.unroll(Features(torch.zeros(1, 4).long(), torch.zeros(1, 4, 1)), None, 3)


def test_a_checkpoint_round_trips_with_its_kind(tiny_llama: Target, tmp_path):
    drafter = medusa(tiny_llama, 64, heads=3)
    save_drafter(drafter, tmp_path)
    assert recorded_kind(tmp_path) == "medusa"
    loaded = load_drafter(tmp_path, tiny_llama.embed_weight, kind="medusa")
    h = torch.randn(2, tiny_llama.hidden_size)
    assert torch.equal(loaded(h), drafter(h))
    with pytest.raises(ValueError, match="holds a medusa drafter"):
        load_drafter(tmp_path, tiny_llama.embed_weight, kind="eagle3")


def test_random_prompts_decode_in_batches_like_one_by_one(tiny_llama: Target, fitted_medusa):
    prompts = random_prompts(6, tiny_llama.vocab_size, seed=7)
    cfg = SpecConfig(TreeShape(3, 2, 8), temperature=0.0, max_new_tokens=12, eos_token_ids=())
    batched = speculative_generate(tiny_llama, fitted_medusa, prompts, cfg).sequences
    single = [
        speculative_generate(tiny_llama, fitted_medusa, [p], cfg).sequences[0] for p in prompts
    ]
    assert batched == single


# ---------------------------------------------------------------------------- embedded target


@pytest.fixture(scope="module")
def embedded_law():
    """The embedded target, two fixed code prefixes and a briefly fitted Medusa drafter."""
    target = load_target(EMBEDDED, aux_layer_ids=(1, 3, 5))
    prompts = prefix_ids()[:1]
    return target, fit_drafter(target, prompts, "medusa", steps=30, samples=8), prompts


def test_on_the_embedded_target_only_typical_acceptance_leaves_the_law(embedded_law):
    target, drafter, prompts = embedded_law
    rows = measure(target, drafter, prompts, n=2000, shape=TreeShape(2, 3, 6), top=32)
    for row in rows:
        for mode in ("plain", "rejection"):
            law = row[mode]
            assert law["chi2_first"] < law["critical_first"], (mode, row)
            assert law["chi2_first_two"] < law["critical_first_two"], (mode, row)
        typical = row["typical"]
        assert typical["chi2_first"] > typical["critical_first"]
        assert typical["chi2_first_two"] > typical["critical_first_two"]
        # its first token is the argmax every time: TV = 1 - max p, the claim's bound, exactly
        assert typical["tv_first"] == pytest.approx(row["one_minus_max_p"], abs=1e-9)


def test_on_the_embedded_target_the_law_test_catches_a_broken_verifier(embedded_law, monkeypatch):
    target, drafter, prompts = embedded_law
    monkeypatch.setattr(verify, "accept_children", _accept_child_always)
    shape = TreeShape(2, 3, 6)
    (row,) = measure(target, drafter, prompts, n=2000, shape=shape, top=32, modes=("rejection",))
    law = row["rejection"]
    assert law["chi2_first_two"] > law["critical_first_two"], row
