"""The verifier's kernels and acceptance math, on hand-made distributions: the emitted token's law
is the target's (exactly, and by sampling the kernels), T=0 is the target's argmax, and the
reach / acceptance numbers the stages write agree with the loop's."""

from __future__ import annotations

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
