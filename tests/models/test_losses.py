"""Losses against brute-force / torch.nn.functional references, masking, and gradient checks."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from models.chain import shift_left
from models.losses import (
    acceptance_rate,
    block_loss_error,
    block_opd_loss,
    ce_rollout_loss,
    draft_opd_loss,
    draft_to_target_probs,
    eagle1_loss,
    expected_accepted_length,
    feature_regression,
    forward_kl,
    masked_mean,
    replay_loss,
    reverse_kl,
    reverse_kl_sampled,
    sft_loss,
    soft_cross_entropy,
    tau_from_alphas,
    teacher_draft_probs,
    total_variation,
    ttt_loss,
)
from models.vocab import DraftVocab

V, VD, B, T = 12, 7, 2, 5


@pytest.fixture
def vocab() -> DraftVocab:
    return DraftVocab.from_counts(torch.tensor([3, 9, 1, 4, 4, 8, 0, 7, 2, 6, 5, 1]), VD)


def random_inputs(seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(B, T, VD, generator=g) * 2).to(dtype)
    teacher = (torch.randn(B, T, VD, generator=g) * 2).softmax(-1).to(dtype)
    mask = torch.rand(B, T, generator=g) > 0.4
    mask[0, 0] = True
    mask[1, -1] = False
    return logits, teacher, mask


def check_masked_rows_change_nothing(loss_fn, logits, *others, mask):
    """Garbage (even NaN) in masked rows changes neither the loss nor any gradient."""
    logits = logits.clone().requires_grad_(True)
    loss = loss_fn(logits, *others, mask)
    (grad,) = torch.autograd.grad(loss, logits)
    dirty = logits.detach().clone()
    dirty[~mask] = float("nan")
    dirty.requires_grad_(True)
    dirty_loss = loss_fn(dirty, *others, mask)
    (dirty_grad,) = torch.autograd.grad(dirty_loss, dirty)
    assert torch.equal(dirty_loss, loss)
    assert torch.equal(dirty_grad, grad)
    assert (grad[~mask] == 0).all() and grad[mask].abs().sum() > 0


# ----------------------------------------------------------------------------- teachers


def test_teacher_restricted_and_renormalised(vocab):
    torch.manual_seed(0)
    target_logits = torch.randn(B, T, V) * 3
    ids = vocab.draft_to_target_ids
    for temperature in (1.0, 0.5):
        p = (target_logits / temperature).softmax(-1)
        got = teacher_draft_probs(target_logits, vocab, temperature)
        torch.testing.assert_close(got, p[..., ids] / p[..., ids].sum(-1, keepdim=True))
        mass = teacher_draft_probs(target_logits, vocab, temperature, renormalize=False)
        torch.testing.assert_close(mass, p[..., ids])
        assert (mass.sum(-1) < 1).all()


def test_teacher_greedy_is_one_hot(vocab):
    target_logits = torch.full((1, V), -5.0)
    target_logits[0, 0] = 5.0  # argmax 0 is outside the draft vocab...
    target_logits[0, 5] = 4.0  # ...5 is the best inside it (draft id 3)
    restricted = teacher_draft_probs(target_logits, vocab, 0.0)
    assert restricted.tolist() == [[0, 0, 0, 1, 0, 0, 0]]
    assert teacher_draft_probs(target_logits, vocab, 0.0, renormalize=False).sum() == 0
    with pytest.raises(ValueError, match="12-token target vocab"):
        teacher_draft_probs(torch.zeros(1, V + 1), vocab)


# ----------------------------------------------------------------------------- cross-entropy / KL


def test_soft_cross_entropy_matches_torch_and_brute_force():
    logits, teacher, mask = random_inputs()
    got = soft_cross_entropy(logits, teacher, mask)
    torch.testing.assert_close(got, F.cross_entropy(logits[mask], teacher[mask]))
    rows = [
        -sum(teacher[b, t, v] * math.log(logits[b, t].softmax(-1)[v]) for v in range(VD))
        for b in range(B)
        for t in range(T)
        if mask[b, t]
    ]
    torch.testing.assert_close(got, torch.stack(rows).mean())


def test_ttt_loss_weights_steps_by_decay():
    steps = [random_inputs(seed) for seed in range(3)]
    got = ttt_loss([s[0] for s in steps], [s[1] for s in steps], [s[2] for s in steps], decay=0.8)
    want = sum(0.8**k * F.cross_entropy(lg[m], tc[m]) for k, (lg, tc, m) in enumerate(steps))
    torch.testing.assert_close(got, want)
    with pytest.raises(ValueError, match="one teacher and one mask per step"):
        ttt_loss([steps[0][0]], [], [steps[0][2]])


def test_forward_and_reverse_kl_match_references():
    logits, teacher, mask = random_inputs()
    logq = logits.log_softmax(-1)
    torch.testing.assert_close(
        forward_kl(logits, teacher, mask),
        F.kl_div(logq[mask], teacher[mask], reduction="batchmean"),
    )
    q = logq.exp()
    brute = (q * (logq - teacher.log())).sum(-1)[mask].mean()
    torch.testing.assert_close(reverse_kl(logits, teacher, mask), brute)
    torch.testing.assert_close(
        reverse_kl(logits, teacher, mask),
        F.kl_div(teacher.log()[mask], q[mask], reduction="batchmean"),
    )


@pytest.mark.parametrize("loss_fn", [soft_cross_entropy, forward_kl, reverse_kl])
def test_masked_rows_change_nothing_and_gradcheck(loss_fn):
    logits, teacher, mask = random_inputs()
    check_masked_rows_change_nothing(loss_fn, logits, teacher, mask=mask)
    logits64, teacher64, _ = random_inputs(dtype=torch.float64)
    assert torch.autograd.gradcheck(
        lambda x: loss_fn(x, teacher64, mask), logits64.requires_grad_(True)
    )


def test_empty_mask_gives_connected_zero():
    logits, teacher, _ = random_inputs()
    logits.requires_grad_(True)
    loss = soft_cross_entropy(logits, teacher, torch.zeros(B, T, dtype=torch.bool))
    loss.backward()
    assert loss.item() == 0 and (logits.grad == 0).all()
    with pytest.raises(TypeError, match="must be bool"):
        masked_mean(torch.ones(3), torch.ones(3))


# ----------------------------------------------------------------------------- sampled reverse KL


def exact_expectations(estimator, gradient):
    """E_{x~q}[value] and E_{x~q}[grad], enumerating every token x with weight q(x)."""
    g = torch.Generator().manual_seed(3)
    z = torch.randn(VD, generator=g, dtype=torch.float64).requires_grad_(True)
    logp = (torch.randn(VD, generator=g, dtype=torch.float64) * 2).log_softmax(-1)
    logq = z.log_softmax(-1)
    q = logq.exp().detach()
    one = torch.ones(1, 1, dtype=torch.bool)
    value, grad = 0.0, torch.zeros(VD, dtype=torch.float64)
    for x in range(VD):
        loss = reverse_kl_sampled(logq[x].view(1, 1), logp[x].view(1, 1), one, estimator, gradient)
        value = value + q[x] * loss.detach()
        grad = grad + q[x] * torch.autograd.grad(loss, z, retain_graph=True)[0]
    reverse = (logq.exp() * (logq - logp)).sum()
    forward = (logp.exp() * (logp - logq)).sum()
    return value, grad, reverse, forward, z


@pytest.mark.parametrize("estimator", ["k1", "k3"])
def test_sampled_reverse_kl_is_unbiased_with_score_gradient(estimator):
    value, grad, reverse, _, z = exact_expectations(estimator, "score")
    torch.testing.assert_close(value, reverse.detach())
    torch.testing.assert_close(grad, torch.autograd.grad(reverse, z)[0])


def test_k1_and_k3_train_identically_with_score_gradient():
    # why the ablation trains one reverse-KL row: per sample, not just in expectation, the
    # score-function gradient is sg(log q - log p) * grad log q for both estimators
    g = torch.Generator().manual_seed(1)
    z = torch.randn(4, 3, generator=g, requires_grad=True)
    logq = z.log_softmax(-1)[:, 0].view(2, 2)
    logp = torch.randn(4, 3, generator=g).log_softmax(-1)[:, 0].view(2, 2)
    mask = torch.tensor([[True, True], [True, False]])
    k1, k3 = (reverse_kl_sampled(logq, logp, mask, e) for e in ("k1", "k3"))
    assert not torch.allclose(k1, k3)  # the logged values differ
    grads = [torch.autograd.grad(v, z, retain_graph=True)[0] for v in (k1, k3)]
    torch.testing.assert_close(grads[0], grads[1])
    assert grads[0].abs().sum() > 0


def test_pathwise_gradients_are_what_the_docstring_says():
    _, grad_k1, _, _, _ = exact_expectations("k1", "pathwise")
    torch.testing.assert_close(grad_k1, torch.zeros_like(grad_k1))  # zero-mean: no signal
    _, grad_k3, _, forward, z = exact_expectations("k3", "pathwise")
    torch.testing.assert_close(grad_k3, torch.autograd.grad(forward, z)[0])  # forward KL's gradient


def test_k3_is_never_negative_and_masks_rows():
    g = torch.Generator().manual_seed(0)
    logq = torch.randn(B, T, generator=g) - 2
    logp = torch.randn(B, T, generator=g) - 2
    mask = torch.ones(B, T, dtype=torch.bool)
    single = torch.eye(B * T, dtype=torch.bool).view(-1, B, T)
    assert all(reverse_kl_sampled(logq, logp, m, "k3") >= 0 for m in single)
    assert any(reverse_kl_sampled(logq, logp, m, "k1") < 0 for m in single)
    mask[1] = False
    want = (logq - logp)[0].mean()
    dirty = logq.clone()
    dirty[1] = float("nan")
    torch.testing.assert_close(reverse_kl_sampled(dirty, logp, mask, "k1"), want)


# ----------------------------------------------------------------------------- acceptance


def test_total_variation_is_one_minus_alpha_against_full_target(vocab):
    torch.manual_seed(1)
    target_logits = torch.randn(B, T, V) * 2
    q = (torch.randn(B, T, VD) * 2).softmax(-1)
    p_full = target_logits.softmax(-1)
    q_full = draft_to_target_probs(q, vocab)
    assert (
        torch.equal(q_full[..., vocab.draft_to_target_ids], q)
        and (q_full.sum(-1) - 1).abs().max() < 1e-6
    )
    tv = total_variation(q_full, p_full)
    torch.testing.assert_close(tv, 0.5 * (p_full - q_full).abs().sum(-1))
    # On the draft support with the FULL p's mass (not renormalised) alpha is the same number.
    mass = teacher_draft_probs(target_logits, vocab, renormalize=False)
    torch.testing.assert_close(acceptance_rate(q, mass), 1 - tv)
    mask = torch.tensor([[True, False, True, True, False], [False] * 5])
    torch.testing.assert_close(masked_mean(tv, mask), tv[0, [0, 2, 3]].mean())
    renormalised = teacher_draft_probs(target_logits, vocab)
    assert (acceptance_rate(q, renormalised) > acceptance_rate(q, mass)).all()


def test_expected_accepted_length_and_tau_brute_force():
    g = torch.Generator().manual_seed(2)
    alphas = torch.rand(3, 4, generator=g, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [0, 0, 0, 0]], dtype=torch.bool)
    want = []
    for b in range(3):
        total, prod = 0.0, 1.0
        for k in range(4):
            if not mask[b, k]:
                break
            prod *= alphas[b, k].item()
            total += prod
        want.append(total)
    got = expected_accepted_length(alphas, mask)
    torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float64))
    torch.testing.assert_close(tau_from_alphas(alphas, mask), 1 + got)
    torch.testing.assert_close(tau_from_alphas(torch.ones(1, 5)), torch.tensor([6.0]))
    # Masked alphas change nothing, including the gradient; gradcheck the rest.
    a = alphas.clone().requires_grad_(True)
    (-expected_accepted_length(a, mask).mean()).backward()
    assert (a.grad[~mask] == 0).all() and (a.grad[mask] != 0).all()
    other = alphas.clone()
    other[~mask] = 0.123
    torch.testing.assert_close(expected_accepted_length(other, mask), got)
    assert torch.autograd.gradcheck(
        lambda x: expected_accepted_length(x, mask), alphas.clone().requires_grad_(True)
    )
    with pytest.raises(ValueError, match="prefix mask"):
        expected_accepted_length(alphas, torch.tensor([[1, 0, 1, 1]] * 3, dtype=torch.bool))


def test_alpha_gradient_flows_through_tv_into_drafter_logits(vocab):
    torch.manual_seed(4)
    p_mass = teacher_draft_probs(torch.randn(1, 3, V) * 2, vocab, renormalize=False).double()
    logits = torch.randn(1, 3, VD, dtype=torch.float64, requires_grad=True)

    def objective(x):
        return -expected_accepted_length(acceptance_rate(x.softmax(-1), p_mass)).mean()

    assert torch.autograd.gradcheck(objective, logits)


# ----------------------------------------------------------------------------- Draft-OPD


def test_draft_opd_loss_matches_brute_force_and_masks():
    logits, teacher, mask = random_inputs()
    g = torch.Generator().manual_seed(9)
    accepted = torch.rand(B, T, generator=g) > 0.5
    accepted[0, 0], accepted[0, 1] = True, False
    mask[0, 1] = True
    got = draft_opd_loss(
        logits, teacher, accepted, mask, gamma=0.8, lambda_accept=0.7, lambda_reject=1.3
    )
    total = 0.0
    for b in range(B):
        for k in range(T):
            if not mask[b, k]:
                continue
            q, p = logits[b, k].softmax(-1), teacher[b, k]
            if accepted[b, k]:
                total += 0.7 * (p * (p / q).log()).sum()
            else:
                total += 1.3 * 0.8**k * (q * (q / p).log()).sum()
    torch.testing.assert_close(got, total / mask.sum())

    def loss_fn(x, t, m):
        return draft_opd_loss(x, t, accepted, m)

    check_masked_rows_change_nothing(loss_fn, logits, teacher, mask=mask)
    logits64, teacher64, _ = random_inputs(dtype=torch.float64)
    assert torch.autograd.gradcheck(
        lambda x: loss_fn(x, teacher64, mask), logits64.requires_grad_(True)
    )
    with pytest.raises(TypeError, match="accepted mask must be bool"):
        draft_opd_loss(logits, teacher, accepted.float(), mask)


def test_draft_opd_fit_boundary_adds_forward_kl_at_the_first_rejected_draft_only():
    logits, teacher, mask = random_inputs(seed=5)
    mask[:] = True
    # row 0: boundary at 1 (draft 3 accepted after it, off the path); row 1: boundary at 0
    accepted = torch.tensor([[True, False, False, True, False], [False] * 5])
    base = draft_opd_loss(logits, teacher, accepted, mask)
    got = draft_opd_loss(logits, teacher, accepted, mask, fit_boundary=True)
    extra = 0.0
    for b, k in [(0, 1), (1, 0)]:
        q, p = logits[b, k].softmax(-1), teacher[b, k]
        extra += (p * (p / q).log()).sum()
    torch.testing.assert_close(got, base + extra / mask.sum())
    # every draft accepted: no boundary, the same loss
    all_in = torch.ones_like(accepted)
    torch.testing.assert_close(
        draft_opd_loss(logits, teacher, all_in, mask, fit_boundary=True),
        draft_opd_loss(logits, teacher, all_in, mask),
    )


def test_block_opd_loss_matches_brute_force_by_stream():
    """Forward KL on the accepted slots and the boundary, gamma^k reverse KL from the boundary
    on, whatever a later slot's own outcome."""
    logits, teacher, mask = random_inputs(seed=4)
    accepted = torch.tensor([[True, False, True, True, False], [True, True, True, True, True]])
    mask[:] = True
    mask[1, 3] = False
    got = block_opd_loss(
        logits, teacher, accepted, mask, gamma=0.5, lambda_accept=0.7, lambda_reject=1.3
    )
    total = 0.0
    for b in range(B):
        boundary = next((k for k in range(T) if not accepted[b, k]), T)
        for k in range(T):
            if not mask[b, k]:
                continue
            q, p = logits[b, k].softmax(-1), teacher[b, k]
            if k <= boundary:
                total += 0.7 * (p * (p / q).log()).sum()
            if k >= boundary:
                total += 1.3 * 0.5**k * (q * (q / p).log()).sum()
    torch.testing.assert_close(got, total / mask.sum())


def test_block_opd_loss_is_zero_at_the_teacher_and_never_negative():
    logits, teacher, mask = random_inputs(seed=5)
    g = torch.Generator().manual_seed(1)
    for _ in range(20):
        accepted = torch.rand(B, T, generator=g) > 0.5
        noisy = logits + torch.randn(logits.shape, generator=g)
        assert block_opd_loss(noisy, teacher, accepted, mask) >= 0
        at_teacher = block_opd_loss(teacher.log(), teacher, accepted, mask)
        torch.testing.assert_close(at_teacher, torch.tensor(0.0), atol=1e-6, rtol=0)


def test_block_opd_loss_decays_rejected_slots_by_position():
    """One rejected slot alone in the mask weighs gamma^k (its reverse KL is the same logits)."""
    g = torch.Generator().manual_seed(2)
    row = torch.randn(1, 1, VD, generator=g).expand(1, T, VD)
    p = torch.randn(1, 1, VD, generator=g).softmax(-1).expand(1, T, VD)
    accepted = torch.zeros(1, T, dtype=torch.bool)
    per_slot = []
    for k in range(1, T):
        mask = torch.zeros(1, T, dtype=torch.bool)
        mask[0, k] = True
        per_slot.append(float(block_opd_loss(row, p, accepted, mask, gamma=0.5)))
    for k in range(len(per_slot) - 1):
        assert per_slot[k] == pytest.approx(2 * per_slot[k + 1])


def test_block_opd_loss_masks_rows_and_sends_no_gradient_to_the_teacher():
    logits, teacher, mask = random_inputs(seed=6)
    accepted = torch.rand(B, T, generator=torch.Generator().manual_seed(3)) > 0.4
    accepted[0, 0] = False

    def loss_fn(x, t, m):
        return block_opd_loss(x, t, accepted, m)

    check_masked_rows_change_nothing(loss_fn, logits, teacher, mask=mask)
    teacher = teacher.clone().requires_grad_(True)
    loss = block_opd_loss(logits.clone().requires_grad_(True), teacher, accepted, mask)
    loss.backward()
    assert teacher.grad is None
    logits64, teacher64, _ = random_inputs(dtype=torch.float64)
    assert torch.autograd.gradcheck(
        lambda x: loss_fn(x, teacher64, mask), logits64.requires_grad_(True)
    )
    with pytest.raises(TypeError, match="accepted mask must be bool"):
        block_opd_loss(logits, teacher, accepted.float(), mask)


def test_block_opd_differs_from_the_chain_form_only_after_a_rejection():
    logits, teacher, mask = random_inputs(seed=7)
    all_accepted = torch.ones(B, T, dtype=torch.bool)
    torch.testing.assert_close(
        block_opd_loss(logits, teacher, all_accepted, mask),
        draft_opd_loss(logits, teacher, all_accepted, mask),
    )
    later_accept = all_accepted.clone()
    later_accept[:, 0] = False
    assert not torch.allclose(
        block_opd_loss(logits, teacher, later_accept, mask),
        draft_opd_loss(logits, teacher, later_accept, mask),
    )


def test_block_losses_that_do_not_apply_are_named():
    for loss in ("draft_opd", "expected_length"):
        assert block_loss_error(loss, "all") is None
    for loss in ("tv", "reverse_kl_k1", "reverse_kl_k3"):
        assert block_loss_error(loss, "reached") is None
        error = block_loss_error(loss, "all")
        assert error is not None and f"opd.loss={loss}" in error and "\n" not in error


# ----------------------------------------------------------------------------- stage losses


def _unroll(steps: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    logits = [torch.randn(B, T, VD, generator=g) for _ in range(steps)]
    valid = [torch.rand(B, T, generator=g) > 0.3 for _ in range(steps)]
    teacher = torch.randn(B, T, VD, generator=g).softmax(-1)
    return logits, valid, teacher


def test_sft_loss_scores_step_k_against_the_teacher_k_plus_1_rows_later():
    logits, valid, teacher = _unroll(3)
    want_terms = []
    for k in range(3):
        n = T - k - 1
        want_terms.append(
            soft_cross_entropy(logits[k][:, :n], teacher[:, k + 1 :], valid[k][:, :n])
        )
    got = sft_loss(logits, valid, teacher, 0.8)
    want = ttt_loss(
        [lg[:, : T - k - 1] for k, lg in enumerate(logits)],
        [teacher[:, k + 1 :] for k in range(3)],
        [v[:, : T - k - 1] for k, v in enumerate(valid)],
        0.8,
    )
    torch.testing.assert_close(got, want)
    # rows past T-k-2 have no teacher: garbage there changes nothing
    dirty = [lg.clone() for lg in logits]
    for k in range(3):
        dirty[k][:, T - k - 1 :] = float("nan")
    torch.testing.assert_close(sft_loss(dirty, valid, teacher, 0.8), got)
    # and the alignment matters: the unshifted teacher gives another value
    assert not torch.isclose(got, ttt_loss(logits, [teacher] * 3, valid, 0.8))


# ----------------------------------------------------------------------------- EAGLE-1


H = 4


def _features(seed=0, dtype=torch.float32):
    """(hidden_out, target_hidden [B, T, H], step-0 valid mask [B, T]) with errors on both
    sides of smooth-L1's beta = 1."""
    g = torch.Generator().manual_seed(seed)
    pred = (torch.randn(B, T, H, generator=g) * 1.5).to(dtype)
    target = (torch.randn(B, T, H, generator=g) * 1.5).to(dtype)
    valid = torch.rand(B, T, generator=g) > 0.3
    valid[:, -2:] = False  # row t is valid only if x_{t+2} exists
    valid[0, 0] = True
    return pred, target, valid


def _smooth_l1(d: float) -> float:
    return 0.5 * d * d if abs(d) < 1 else abs(d) - 0.5


def test_feature_regression_matches_brute_force_and_is_zero_at_a_perfect_prediction():
    pred, target, mask = _features()
    rows = [
        sum(_smooth_l1(float(pred[b, t, h] - target[b, t, h])) for h in range(H)) / H
        for b in range(B)
        for t in range(T)
        if mask[b, t]
    ]
    got = feature_regression(pred, target, mask)
    torch.testing.assert_close(got, torch.tensor(sum(rows) / len(rows)))
    assert feature_regression(target, target, mask).item() == 0
    # bf16 features are compared in fp32
    assert feature_regression(pred.bfloat16(), target.bfloat16(), mask).dtype == torch.float32


def test_feature_regression_is_quadratic_for_small_errors_and_linear_for_large_ones():
    target = torch.zeros(1, 1, H)
    mask = torch.ones(1, 1, dtype=torch.bool)
    small, large = torch.full((1, 1, H), 0.2), torch.full((1, 1, H), 3.0)
    reg = lambda x: feature_regression(x, target, mask)  # noqa: E731
    torch.testing.assert_close(reg(2 * small), 4 * reg(small))  # 0.5 d^2 below beta
    torch.testing.assert_close(reg(2 * large) - reg(large), large[0, 0, 0])  # |d| - 0.5 above


def test_feature_regression_masks_rows_and_sends_no_gradient_to_the_target():
    pred, target, mask = _features(1)
    check_masked_rows_change_nothing(feature_regression, pred, target, mask=mask)
    target = target.clone().requires_grad_(True)
    feature_regression(pred.requires_grad_(True), target, mask).backward()
    assert target.grad is None and pred.grad.abs().sum() > 0
    pred64, target64, _ = _features(2, dtype=torch.float64)
    assert torch.autograd.gradcheck(
        lambda x: feature_regression(x, target64, mask), pred64.requires_grad_(True)
    )


def test_eagle1_loss_scores_row_t_against_position_t_plus_1_with_ce_weight_0_1():
    logits, teacher, _ = random_inputs(3)
    pred, target, valid = _features(3)
    got = eagle1_loss(logits, pred, valid, teacher, target)
    # brute force: row t's hidden vs the target state at t+1, its logits vs the teacher at t+1
    reg_rows, ce_rows = [], []
    for b in range(B):
        for t in range(T - 1):
            if valid[b, t]:
                d = pred[b, t] - target[b, t + 1]
                reg_rows.append(sum(_smooth_l1(float(x)) for x in d) / H)
                ce_rows.append(-(teacher[b, t + 1] * logits[b, t].log_softmax(-1)).sum())
    want = sum(reg_rows) / len(reg_rows) + 0.1 * torch.stack(ce_rows).mean()
    torch.testing.assert_close(got, want)
    # the CE weight is EAGLE-1's 0.1: the parts add up with that weight and no other
    n = T - 1
    reg = feature_regression(pred[:, :n], target[:, 1:], valid[:, :n])
    ce = soft_cross_entropy(logits[:, :n], teacher[:, 1:], valid[:, :n])
    torch.testing.assert_close(got, reg + 0.1 * ce)
    torch.testing.assert_close(eagle1_loss(logits, pred, valid, teacher, target, 1.0), reg + ce)
    # and the alignment matters: regressing onto the same position gives another value
    assert not torch.isclose(got, feature_regression(pred, target, valid) + 0.1 * ce)


def test_eagle1_loss_is_zero_at_a_perfect_prediction_and_ignores_invalid_rows():
    _, _, valid = _features(4)
    target = torch.randn(B, T, H, generator=torch.Generator().manual_seed(4))
    perfect = shift_left(target, 1)  # row t predicts the state at t+1
    token = torch.randint(VD, (B, T), generator=torch.Generator().manual_seed(5))
    teacher = F.one_hot(token, VD).float()
    logits = 50 * shift_left(teacher, 1)  # all mass on the token the teacher at t+1 wants
    assert eagle1_loss(logits, perfect, valid, teacher, target).item() == pytest.approx(0, abs=1e-6)
    # garbage in rows that are not valid (and in the last row, which has no t+1) changes nothing
    dirty_h, dirty_l = perfect.clone(), logits.clone()
    dirty_h[~valid], dirty_l[~valid] = float("nan"), float("nan")
    dirty_h[:, -1], dirty_l[:, -1] = float("nan"), float("nan")
    assert eagle1_loss(dirty_l, dirty_h, valid, teacher, target).item() == pytest.approx(
        0, abs=1e-6
    )


def test_ce_rollout_loss_drops_anchor_rows_after_step_zero_only():
    logits, valid, teacher = _unroll(3, seed=1)
    anchors = torch.zeros(B, T, dtype=torch.bool)
    anchors[:, 1] = True
    got = ce_rollout_loss(logits, valid, teacher, anchors, 0.8)
    by_hand = [valid[0]] + [v & ~anchors for v in valid[1:]]
    torch.testing.assert_close(got, sft_loss(logits, by_hand, teacher, 0.8))
    # without anchors it is plain sft_loss; with them it differs
    none = torch.zeros_like(anchors)
    torch.testing.assert_close(
        ce_rollout_loss(logits, valid, teacher, none, 0.8), sft_loss(logits, valid, teacher, 0.8)
    )
    assert not torch.isclose(got, sft_loss(logits, valid, teacher, 0.8))


def _replay_inputs(vocab: DraftVocab, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    N, K = 4, 3
    logits = torch.randn(N, K, VD, generator=g)
    target_logits = torch.randn(N, K, V, generator=g) * 2
    tokens = vocab.to_target(torch.randint(0, VD, (N, K), generator=g))
    accepted = torch.rand(N, K, generator=g) > 0.5
    mask = torch.ones(N, K, dtype=torch.bool)
    mask[0, 2] = False
    return logits, target_logits, tokens, accepted, mask


def test_replay_loss_families_equal_their_primitives(vocab):
    logits, target_logits, tokens, accepted, mask = _replay_inputs(vocab)
    temp = 0.7
    q = (logits / temp).softmax(-1)
    teacher = teacher_draft_probs(target_logits, vocab, temp)
    p_full = teacher_draft_probs(target_logits, vocab, temp, renormalize=False)

    def loss(name):
        return replay_loss(
            name, logits, target_logits, tokens, accepted, mask, vocab, temperature=temp
        )

    torch.testing.assert_close(
        loss("draft_opd"), draft_opd_loss(logits / temp, teacher, accepted, mask, gamma=0.8)
    )
    torch.testing.assert_close(
        replay_loss(
            "draft_opd",
            logits,
            target_logits,
            tokens,
            accepted,
            mask,
            vocab,
            temperature=temp,
            blocks=True,
        ),
        block_opd_loss(logits / temp, teacher, accepted, mask, gamma=0.8),
    )
    torch.testing.assert_close(loss("tv"), masked_mean(total_variation(q, p_full), mask))
    torch.testing.assert_close(
        loss("expected_length"),
        -expected_accepted_length(acceptance_rate(q, p_full), mask).mean(),
    )
    ids = vocab.to_draft(tokens)[..., None]
    logq = (logits / temp).log_softmax(-1).gather(-1, ids)[..., 0]
    logp = teacher.gather(-1, ids)[..., 0].log()
    for est in ("k1", "k3"):
        torch.testing.assert_close(
            loss(f"reverse_kl_{est}"), reverse_kl_sampled(logq, logp, mask, estimator=est)
        )
    with pytest.raises(ValueError, match="unknown loss"):
        loss("nonsense")


def test_replay_loss_ignores_masked_positions(vocab):
    logits, target_logits, tokens, accepted, mask = _replay_inputs(vocab, seed=3)
    for name in ("draft_opd", "reverse_kl_k1", "reverse_kl_k3", "tv", "expected_length"):
        clean = replay_loss(
            name, logits, target_logits, tokens, accepted, mask, vocab, temperature=1.0
        )
        dirty_logits = logits.clone()
        dirty_logits[~mask] = 1e3 * torch.randn_like(dirty_logits[~mask])
        dirty = replay_loss(
            name, dirty_logits, target_logits, tokens, accepted, mask, vocab, temperature=1.0
        )
        torch.testing.assert_close(dirty, clean, msg=name)
