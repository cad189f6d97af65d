"""The fused, chunked head + loss (models/head_loss.py) against the same losses on the
materialized logits: values and gradients (hidden states, head weights, every trainable weight
of a drafter) equal in fp32, on every loss that reads a head and every kind's objective (the
chains' and the block drafters'). A control breaks the fused gradient (a term, a chunk) and the
same comparison must fail."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import models.head_loss as head_loss_module
from models import losses
from models.drafters import drafter_class
from models.features import Features
from models.head_loss import HeadLogits, HeadSlots
from models.target import Target
from models.vocab import DraftVocab

B, T, H, V = 3, 11, 16, 37


def _inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, T, H, generator=g)
    weight = torch.randn(V, H, generator=g) / H**0.5
    teacher = torch.softmax(3 * torch.randn(B, T, V, generator=g), -1)
    mask = torch.rand(B, T, generator=g) > 0.3
    accepted = torch.rand(B, T, generator=g) > 0.5
    return hidden, weight, teacher, mask, accepted


LOSSES = {
    "soft_ce": lambda q, p, m, a: losses.soft_cross_entropy(q, p, m),
    "forward_kl": lambda q, p, m, a: losses.forward_kl(q, p, m),
    "reverse_kl": lambda q, p, m, a: losses.reverse_kl(q, p, m),
    "draft_opd": lambda q, p, m, a: losses.draft_opd_loss(q, p, a, m, lambda_reject=0.7),
    "draft_opd_boundary": lambda q, p, m, a: losses.draft_opd_loss(q, p, a, m, fit_boundary=True),
    "block_opd": lambda q, p, m, a: losses.block_opd_loss(q, p, a, m, gamma=0.6),
    "ttt": lambda q, p, m, a: losses.sft_loss([q, q[:, 1:], q], [m, m[:, 1:], m], p, 0.8),
    "eagle1_ce": lambda q, p, m, a: losses.soft_cross_entropy(q[:, :-1], p[:, 1:], m[:, :-1]),
}


def _value_and_grads(loss_fn, fused: bool, chunk_elements: int = 2 * V):
    hidden, weight, teacher, mask, accepted = _inputs()
    hidden.requires_grad_(True)
    weight.requires_grad_(True)
    if fused:
        logits = HeadLogits(hidden, weight, torch.float32, chunk_elements=chunk_elements)
    else:
        logits = F.linear(hidden, weight)
    loss = loss_fn(logits, teacher, mask, accepted)
    (3 * loss).backward()  # a scale on the incoming gradient reaches both paths alike
    return loss.detach(), hidden.grad, weight.grad


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_fused_head_equals_the_unfused_loss_and_gradients(name: str):
    want = _value_and_grads(LOSSES[name], fused=False)
    got = _value_and_grads(LOSSES[name], fused=True)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert want[1].abs().sum() > 0 and want[2].abs().sum() > 0


@pytest.mark.parametrize("chunk", [1, V, 7 * V, 10**9])
def test_the_chunk_size_changes_nothing(chunk: int):
    want = _value_and_grads(LOSSES["draft_opd_boundary"], fused=False)
    got = _value_and_grads(LOSSES["draft_opd_boundary"], fused=True, chunk_elements=chunk)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    ("n", "vocab", "elements"), [(861, 49152, 1 << 22), (10, 7, 21), (0, 5, 5)]
)
def test_chunks_split_the_rows_evenly(n: int, vocab: int, elements: int):
    """No chunk above the budget, as few chunks as it allows, all of one size but the last,
    which is fewer than `chunks` rows short of the rest (861 rows of MTP's 49k-id head: ten
    of 79 and one of 71, not ten of 85 and one of 11)."""
    most = max(1, elements // vocab)
    rows = head_loss_module._chunk_rows(n, vocab, elements)
    sizes = [min(rows, n - i) for i in range(0, n, rows)]
    assert rows <= most and len(sizes) == -(-n // most)
    assert not sizes or max(sizes) - min(sizes) < len(sizes)


def _drop_the_teacher_term(z, p, fwd, rev, entropy):
    loss, grad, factor = CHUNK(z, p, fwd, rev, entropy)
    return loss, grad + p * (fwd / factor)[:, None], factor  # as if the CE's -p were missing


def _drop_the_second_chunk(z, p, fwd, rev, entropy):
    loss, grad, factor = CHUNK(z, p, fwd, rev, entropy)
    _drop_the_second_chunk.calls += 1
    return loss, grad * 0 if _drop_the_second_chunk.calls == 2 else grad, factor


CHUNK = head_loss_module.chunk_loss_and_grad


@pytest.mark.parametrize("broken", [_drop_the_teacher_term, _drop_the_second_chunk])
@pytest.mark.parametrize("name", ["soft_ce", "draft_opd"])
def test_a_broken_fused_gradient_fails_the_comparison(monkeypatch, broken, name: str):
    """The control: the equality above is a real check of the fused backward."""
    want = _value_and_grads(LOSSES[name], fused=False)
    _drop_the_second_chunk.calls = 0
    monkeypatch.setattr(head_loss_module, "chunk_loss_and_grad", broken)
    got = _value_and_grads(LOSSES[name], fused=True)
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-6)  # the value is intact
    with pytest.raises(AssertionError):
        torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-6)
    with pytest.raises(AssertionError):
        torch.testing.assert_close(got[2], want[2], rtol=1e-5, atol=1e-6)


def _slots_value_and_grads(loss_fn, fused: bool):
    """Slots that each read their own head (Medusa's replays): slot k of [B, K, V] is head
    k % 2 over hidden[:, k], so two slots share a head and the rest do not."""
    hidden, weight, teacher, mask, accepted = _inputs()
    heads = torch.stack([weight, weight.flip(0), weight.roll(1, -1)]).requires_grad_(True)
    hidden.requires_grad_(True)
    which = [0, 1, 0, 2] + [1] * (T - 4)
    if fused:
        logits = HeadSlots(
            tuple(
                HeadLogits(hidden[:, k], heads[w], torch.float32, chunk_elements=2 * V)
                for k, w in enumerate(which)
            )
        )
    else:
        logits = torch.stack([F.linear(hidden[:, k], heads[w]) for k, w in enumerate(which)], 1)
    loss = loss_fn(logits / 0.8, teacher, mask, accepted)
    (3 * loss).backward()
    return loss.detach(), hidden.grad, heads.grad


SLOT_LOSSES = ["draft_opd", "draft_opd_boundary", "block_opd", "soft_ce", "reverse_kl"]


@pytest.mark.parametrize("name", SLOT_LOSSES)
def test_slots_with_their_own_heads_have_the_unfused_gradients(name: str):
    want = _slots_value_and_grads(LOSSES[name], fused=False)
    got = _slots_value_and_grads(LOSSES[name], fused=True)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert all(float(g.abs().sum()) > 0 for g in want[2])  # every head has a gradient


def test_a_broken_fused_gradient_fails_the_slots_comparison(monkeypatch):
    want = _slots_value_and_grads(LOSSES["block_opd"], fused=False)
    monkeypatch.setattr(head_loss_module, "chunk_loss_and_grad", _drop_the_teacher_term)
    got = _slots_value_and_grads(LOSSES["block_opd"], fused=True)
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-6)
    for g, w in zip(got[1:], want[1:], strict=True):
        with pytest.raises(AssertionError):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


def test_slots_materialize_as_their_stacked_logits():
    hidden, weight, *_ = _inputs()
    slots = HeadSlots(tuple(HeadLogits(hidden[:, k], weight * k, torch.float32) for k in range(T)))
    plain = torch.stack([F.linear(hidden[:, k], weight * k) for k in range(T)], 1)
    assert slots.shape == plain.shape and slots.dim() == 3
    torch.testing.assert_close((slots / 0.7).materialize(), plain / 0.7)


def test_kl_is_zero_when_the_drafter_is_its_teacher():
    hidden, weight, _, mask, accepted = _inputs()
    logits = HeadLogits(hidden, weight, torch.float32, chunk_elements=V)
    teacher = torch.softmax(logits.materialize(), -1)
    for fn in (losses.forward_kl, losses.reverse_kl):
        assert abs(float(fn(logits, teacher, mask))) < 1e-5
    assert abs(float(losses.draft_opd_loss(logits, teacher, accepted, mask))) < 1e-5


def test_no_rows_give_a_graph_connected_zero():
    hidden, weight, teacher, mask, _ = _inputs()
    hidden.requires_grad_(True)
    logits = HeadLogits(hidden, weight, torch.float32)
    loss = losses.soft_cross_entropy(logits, teacher, torch.zeros_like(mask))
    loss.backward()
    assert float(loss.detach()) == 0 and float(hidden.grad.abs().sum()) == 0


def test_argmax_and_temperature_read_the_same_logits():
    hidden, weight, *_ = _inputs()
    logits = HeadLogits(hidden, weight, torch.float32, chunk_elements=V)
    plain = F.linear(hidden, weight)
    assert torch.equal(logits.argmax(-1), plain.argmax(-1))
    torch.testing.assert_close((logits / 0.7)[1:, 2:5].materialize(), plain[1:, 2:5] / 0.7)


def test_bf16_head_stays_near_the_unfused_bf16_head():
    """Under bf16 autocast both paths run the head's matmul in bf16 and the loss in fp32."""
    hidden, weight, teacher, mask, _ = _inputs()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        lazy = HeadLogits.of(hidden, weight)
        plain = F.linear(hidden, weight).float()
    assert lazy.dtype == torch.bfloat16
    got = losses.soft_cross_entropy(lazy, teacher, mask)
    torch.testing.assert_close(got, losses.soft_cross_entropy(plain, teacher, mask))


# -- every kind's objectives, through its real training unroll ------------------------------


def _drafter(target: Target, kind: str, settings: dict | None = None):
    torch.manual_seed(0)
    counts = torch.arange(target.vocab_size, 0, -1).float()
    vocab = DraftVocab.from_counts(counts, 48 if kind != "mtp" else target.vocab_size)
    drafter = drafter_class(kind).new(target, vocab, settings or {})
    with torch.no_grad():  # away from the initialisation's symmetric zeros
        for p in drafter.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * 0.05)
    return drafter


def _kind_grads(
    target: Target,
    kind: str,
    objective: str | None,
    fused: bool,
    replays: bool,
    settings: dict | None = None,
    *,
    rollout_ce: bool = True,
):
    drafter = _drafter(target, kind, settings)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, target.vocab_size, (2, 10), generator=g)
    with torch.no_grad():
        out = target(ids)
    features = Features(ids, out.aux_hidden, out.last_hidden)
    mask = torch.ones_like(ids, dtype=torch.bool)
    mask[1, 7:] = False
    vocab = drafter.vocab
    teacher = losses.teacher_draft_probs(out.logits, vocab, 1.0)  # [B, T, Vd]
    item, anchor = torch.tensor([0, 1, 1]), torch.tensor([4, 3, 6])
    tokens = vocab.to_target(torch.randint(0, vocab.draft_vocab_size, (3, 3), generator=g))
    unrolled = drafter.unroll(features, mask, 3, (item, anchor, tokens) if replays else None)
    assert all(isinstance(h, HeadLogits) for h in unrolled.logits)
    if not fused:
        unrolled.logits = [losses.materialized(h) for h in unrolled.logits]
    if replays:
        accepted = torch.rand(3, 3, generator=g) > 0.4
        replay_mask = torch.ones(3, 3, dtype=torch.bool)
        target_logits = out.logits[item, anchor - 2][:, None].expand(3, 3, -1) + torch.randn(
            3, 3, out.logits.shape[-1], generator=g
        )
        loss = losses.replay_loss(
            "draft_opd",
            drafter.replay_logits(unrolled, item, anchor, lazy=fused),
            target_logits,
            tokens,
            accepted,
            replay_mask,
            vocab,
            temperature=0.8,
            fit_boundary=True,
            blocks=drafter.drafts_blocks,
        )
        if rollout_ce:
            loss = loss + drafter.rollout_ce_loss(unrolled, teacher, item, anchor, 0.8)
    else:
        loss = drafter.sft_loss(unrolled, teacher, out.last_hidden, decay=0.8, objective=objective)
    loss.backward()
    # a Medusa head past the unrolled offsets gets none on either path
    grads = {n: p.grad for n, p in drafter.named_parameters() if p.grad is not None}
    return loss.detach(), grads


def _assert_grads_close(got: dict, want: dict) -> None:
    """A weight's gradient element sums terms as large as the tensor's largest elements, so
    fp32 rounding is relative to those, not to the element: where the terms cancel to a small
    element, another CPU's summation order moves it by more than 1e-4 of itself (MTP's eh_proj
    on an AMD EPYC: 2.6e-6 on 3e-3 in a tensor reaching 5.7). A broken backward is off by the
    gradient's own size."""
    for name, w in want.items():
        scale = max(1.0, float(w.abs().max()))
        torch.testing.assert_close(got[name], w, rtol=1e-4, atol=1e-5 * scale, msg=name)


KIND_CASES = [
    ("eagle3", None, False, None),
    ("eagle3", "eagle1", False, None),
    ("eagle3", None, True, None),
    ("mtp", None, False, None),
    ("mtp", None, True, None),
    ("dflash", None, False, None),
    ("dflash", None, True, None),
    ("dflash", None, False, {"head": "target"}),  # a frozen head over the full vocabulary
    ("medusa", None, False, None),
    ("medusa", None, True, None),
]


@pytest.mark.parametrize(("kind", "objective", "replays", "settings"), KIND_CASES)
def test_every_kinds_objective_has_the_unfused_gradients(
    tiny_llama: Target, kind: str, objective: str | None, replays: bool, settings: dict | None
):
    want_loss, want = _kind_grads(tiny_llama, kind, objective, False, replays, settings)
    got_loss, got = _kind_grads(tiny_llama, kind, objective, True, replays, settings)
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-5, atol=1e-6)
    assert got.keys() == want.keys()
    _assert_grads_close(got, want)
    assert sum(float(g.abs().sum()) for g in want.values()) > 0


@pytest.mark.parametrize("kind", ["eagle3", "mtp", "dflash", "medusa"])
@pytest.mark.parametrize("replays", [False, True])
def test_a_broken_fused_gradient_fails_every_kinds_comparison(
    monkeypatch, tiny_llama: Target, kind: str, replays: bool
):
    """The control for the kinds: their fused training path does run the fused backward, so
    breaking it changes the drafter's gradients (and not the loss's value). With replays the
    loss is the Draft-OPD replay loss alone: the replays themselves are read fused."""
    want_loss, want = _kind_grads(tiny_llama, kind, None, False, replays, rollout_ce=False)
    monkeypatch.setattr(head_loss_module, "chunk_loss_and_grad", _drop_the_teacher_term)
    got_loss, got = _kind_grads(tiny_llama, kind, None, True, replays, rollout_ce=False)
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-5, atol=1e-6)
    with pytest.raises(AssertionError):
        _assert_grads_close(got, want)


@pytest.mark.parametrize("kind", ["dflash", "medusa"])
def test_block_acceptance_reads_lazy_heads_as_their_logits(tiny_llama: Target, kind: str):
    drafter = _drafter(tiny_llama, kind)
    ids = torch.randint(
        0, tiny_llama.vocab_size, (2, 10), generator=torch.Generator().manual_seed(1)
    )
    with torch.no_grad():
        out = tiny_llama(ids)
        unrolled = drafter.unroll(Features(ids, out.aux_hidden, out.last_hidden), None, 3)
    lazy = drafter.acceptance(unrolled, out.logits, chain_k=3).summary()
    unrolled.logits = [losses.materialized(h) for h in unrolled.logits]
    assert drafter.acceptance(unrolled, out.logits, chain_k=3).summary() == lazy


def test_acceptance_reads_a_lazy_head_as_its_logits(tiny_llama: Target):
    drafter = _drafter(tiny_llama, "eagle3")
    ids = torch.randint(
        0, tiny_llama.vocab_size, (2, 10), generator=torch.Generator().manual_seed(1)
    )
    with torch.no_grad():
        out = tiny_llama(ids)
        unrolled = drafter.unroll(Features(ids, out.aux_hidden, out.last_hidden), None, 3)
    mask = torch.ones_like(ids, dtype=torch.bool)
    mask[0, :4] = False  # a prompt: rows the acceptance does not count
    unrolled.valid = [v & mask for v in unrolled.valid]
    lazy = drafter.acceptance(unrolled, out.logits, chain_k=3).summary()
    unrolled.logits = [losses.materialized(h) for h in unrolled.logits]
    assert drafter.acceptance(unrolled, out.logits, chain_k=3).summary() == lazy
