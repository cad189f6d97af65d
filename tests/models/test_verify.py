"""The verifier's kernels and acceptance math, on hand-made distributions: the emitted token's law
is the target's (exactly, and by sampling the kernels), T=0 is the target's argmax, and the
reach / acceptance numbers the stages write agree with the loop's."""

from __future__ import annotations

import math

import pytest
import torch

from models import verify
from models.drafter import Proposal

V = 6


def _dist(seed: int, n: int = 1, sharp: float = 1.5) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(sharp * torch.randn(n, V, generator=g, dtype=torch.float64), -1)


@pytest.mark.parametrize("seed", range(5))
def test_accepted_or_corrected_token_has_law_p_exactly(seed: int):
    # P(x) = q(x) min(1, p(x)/q(x)) + (1 - alpha) residual(x), alpha = sum_v q_v min(1, p_v/q_v)
    p, q = _dist(seed), _dist(seed + 100)
    accept = verify.accept_prob(p, q)  # for every candidate draft x at once
    alpha = (q * accept).sum(-1, keepdim=True)
    law = q * accept + (1 - alpha) * verify.residual(p, q)
    torch.testing.assert_close(law, p)
    torch.testing.assert_close(alpha, torch.minimum(p, q).sum(-1, keepdim=True))  # 1 - TV


def test_residual_of_equal_laws_falls_back_to_p():
    p = _dist(0)
    torch.testing.assert_close(verify.residual(p, p.clone()), p)


@pytest.mark.parametrize("seed", range(3))
def test_tree_sibling_tests_give_law_p_exactly(seed: int):
    # Point-mass children x_1..x_k tried in order: sibling j is reached after j-1 rejections and
    # accepted with r_j(x_j) = p(x_j) / (1 - S_{j-1}); after all, a sample of p without them.
    p = _dist(seed)
    kids = torch.tensor([[4, 1, 3]])
    px = p.gather(1, kids)
    test = px / (1 - (px.cumsum(1) - px))
    reached = verify.reach(1 - test)  # reached sibling j: every earlier one was rejected
    law = torch.zeros_like(p).scatter_add(1, kids, reached * test)
    rejected_all = reached[:, -1:] * (1 - test[:, -1:])
    rest = verify.residual_without(p, kids, torch.ones_like(kids, dtype=torch.bool))
    torch.testing.assert_close(law + rejected_all * rest, p)


def _chain_of_one(p: torch.Tensor, q: torch.Tensor, n: int, seed: int):
    """n rows, one draft each drawn from q [V], target law p [V] at the draft and after it."""
    g = torch.Generator().manual_seed(seed)
    drafts = torch.multinomial(q.expand(n, -1), 1, replacement=True, generator=g)  # [n, 1]
    proposal = Proposal(
        tokens=drafts,
        q=q[drafts],
        confidence=q.max().expand(n, 1),
        forwards=1,
        dists=[q.expand(n, -1)],
        vocab_map=torch.arange(V),
    )
    logits = p.log().expand(n, 2, -1)  # [n, K+1, V]: the draft's position, then the bonus
    budget = torch.ones(n, dtype=torch.long)
    eos = torch.tensor([], dtype=torch.long)
    return drafts[:, 0], verify.accept_chain(proposal, logits, budget, eos, 1.0, g)


def test_accept_chain_samples_the_target_law():
    p, q = _dist(1)[0].float(), _dist(2)[0].float()
    n = 40_000
    drafts, verdict = _chain_of_one(p, q, n, seed=0)
    first = torch.where(verdict.accepted == 1, drafts, verdict.next)
    freq = torch.bincount(first, minlength=V).double() / n
    assert float((freq - p.double()).abs().sum()) / 2 < 0.015  # TV; sampling noise ~0.005
    # the logged acceptance probability is min(1, p/q) of each row's draft
    torch.testing.assert_close(verdict.accept_prob[:, 0], (p[drafts] / q[drafts]).clamp(max=1))
    rate = float((verdict.accepted == 1).double().mean())
    assert abs(rate - float(torch.minimum(p, q).sum())) < 0.01


def _pearson(counts: torch.Tensor, expected: torch.Tensor) -> tuple[float, float]:
    """Pearson's statistic of counts [C] against expected counts [C] (cells expected below 5
    pooled into one) and its 1e-6 critical value (Wilson-Hilferty's chi-square quantile)."""
    big = expected >= 5
    stat = ((counts[big] - expected[big]) ** 2 / expected[big]).sum()
    rest = expected[~big].sum()
    if rest > 0:
        stat += (counts[~big].sum() - rest) ** 2 / rest
    df = int(big.sum()) - (0 if rest > 0 else 1)
    critical = df * (1 - 2 / (9 * df) + 4.753 * math.sqrt(2 / (9 * df))) ** 3
    return float(stat), critical


def _point_mass_chain(p: torch.Tensor, draft: int, n: int, seed: int):
    """n rows drafting the one token `draft` as a point mass (q = 1, no `dists`: a lookup's
    draft) against the target law p [V] at T=1; returns each row's first emitted token."""
    proposal = Proposal(
        tokens=torch.full((n, 1), draft),
        q=torch.ones(n, 1),
        confidence=torch.ones(n, 1),
        forwards=0,
    )
    logits = p.log().expand(n, 2, -1)  # [n, K+1, V]: the draft's position, then the bonus
    budget = torch.ones(n, dtype=torch.long)
    g = torch.Generator().manual_seed(seed)
    verdict = verify.accept_chain(proposal, logits, budget, torch.tensor([]), 1.0, g)
    return torch.where(verdict.accepted == 1, draft, verdict.next)


# p(draft) = 0.5 under q(draft) = 1: accepted half the time, and a rejection must emit a
# sample of p without the draft, so the draft is the first token with probability 0.5.
POINT_MASS_P = torch.tensor([0.1, 0.05, 0.5, 0.15, 0.12, 0.08])


def test_a_point_mass_chain_at_t1_samples_the_target_law():
    n = 20_000
    first = _point_mass_chain(POINT_MASS_P, 2, n, seed=0)
    counts = torch.bincount(first, minlength=V).double()
    stat, critical = _pearson(counts, POINT_MASS_P.double() * n)
    assert stat < critical, (stat, critical, (counts / n).tolist())
    assert abs(float(counts[2]) / n - 0.5) < 0.02


def _resample_from_p(p, proposal, accepted, block_len, gen):  # the residual ignored
    rows = torch.arange(len(p))
    return torch.multinomial(p[rows, accepted], 1, generator=gen)[:, 0]


def test_the_point_mass_law_test_catches_a_correction_sampled_from_p(monkeypatch):
    # the verifier before the fix: the draft comes first with 0.5 + 0.5 x 0.5 = 0.75
    monkeypatch.setattr(verify, "correction", _resample_from_p)
    n = 20_000
    first = _point_mass_chain(POINT_MASS_P, 2, n, seed=0)
    counts = torch.bincount(first, minlength=V).double()
    stat, critical = _pearson(counts, POINT_MASS_P.double() * n)
    assert stat > critical
    assert abs(float(counts[2]) / n - 0.75) < 0.02


def test_greedy_chain_accepts_while_draft_is_argmax():
    logits = torch.full((2, 4, V), -5.0)
    greedy = torch.tensor([[1, 2, 3, 4], [5, 0, 1, 2]])
    logits.scatter_(2, greedy[..., None], 5.0)
    drafts = torch.tensor([[1, 2, 0], [0, 0, 1]])  # row 0: two hits then a miss; row 1: a miss
    proposal = Proposal(drafts, torch.ones(2, 3), torch.ones(2, 3), forwards=1)
    budget = torch.tensor([3, 3])
    verdict = verify.accept_chain(proposal, logits, budget, torch.tensor([]), 0.0, None)
    assert verdict.accepted.tolist() == [2, 0]
    assert verdict.next.tolist() == [3, 5]  # the argmax where the first miss sits
    assert verdict.accept_prob.tolist() == [[1, 1, 0], [0, 1, 1]]
    assert verdict.outcome.tolist() == [[0, 0, 1], [1, 2, 2]]


def test_greedy_accept_is_equality_with_the_argmax():
    tokens, argmax = torch.tensor([[3, 1, 2]]), torch.tensor([[3, 0, 2]])
    assert verify.greedy_accept(tokens, argmax).tolist() == [[True, False, True]]


def test_accept_prob_of_logs_equals_the_ratio_form():
    p, q = _dist(3, n=4).float(), _dist(4, n=4).float()
    torch.testing.assert_close(
        verify.accept_prob_of_logs(p.log(), q.log()), verify.accept_prob(p, q)
    )
    assert float(verify.accept_prob(p, q).max()) <= 1.0


def test_reach_is_the_cumulative_product_of_earlier_accepts():
    accept = torch.rand(5, 6, generator=torch.Generator().manual_seed(0))
    r = verify.reach(accept)
    assert torch.equal(r[:, 0], torch.ones(5))
    torch.testing.assert_close(r[:, 1:], accept[:, :-1].cumprod(1))
    assert bool((r[:, 1:] <= r[:, :-1]).all())  # non-increasing along the chain
    outcomes = torch.tensor([[1, 1, 0, 1], [0, 1, 1, 1]])
    assert verify.reach(outcomes).tolist() == [[1, 1, 1, 0], [1, 0, 0, 0]]


def test_draw_outcomes_is_exact_at_0_and_1_and_follows_the_probability():
    g = torch.Generator().manual_seed(0)
    exact = torch.tensor([[1.0, 0.0, 1.0]])
    assert verify.draw_outcomes(exact, g).tolist() == [[True, False, True]]
    half = torch.full((20_000, 1), 0.3)
    assert abs(float(verify.draw_outcomes(half, g).double().mean()) - 0.3) < 0.015


def test_sample_target_is_argmax_at_t0():
    logits = torch.tensor([[0.1, 2.0, -1.0], [3.0, 0.0, 0.0]])
    assert verify.sample_target(logits, 0.0, None).tolist() == [1, 0]
