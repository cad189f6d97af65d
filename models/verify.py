"""The verifier: lossless acceptance of drafted tokens, and the acceptance math the stages share.

Speculative sampling (Leviathan et al.): a draft x drawn from the drafter's q is accepted with
probability min(1, p(x)/q(x)), p the target's distribution at the temperature; on rejection the
emitted token is a sample of the residual norm(max(0, p - q)); after K accepted drafts a bonus
token is a sample of p at K+1. Then every emitted token has the law p. Greedy (T=0): p and q
are one-hot, so a draft is accepted while it equals the target's argmax, and the token after the
accepted prefix is the argmax there: the target's own greedy decoding.

Both proposal shapes (`models.drafter.Proposal`) are one rule: at a reached node with target
distribution p its children are tried in order, each with the proposal q it was drawn from; a
child x is accepted with probability min(1, r(x)/q(x)), r the residual (r = p at the first
child), and a rejection leaves r <- norm(max(0, r - q)). The first accepted child is descended
into; when none is, the emitted token is a sample of r (of p after the last drafted depth: the
bonus token).
  - a chain (or a DFlash block: a chain to the verifier) has one child per node, drawn from the
    drafter's q, so its tests run at once: offset k is reached iff every earlier draft was
    accepted (`reach`), and only the first rejected offset's residual is sampled; a chain
    without `dists` is one of point masses (q = 1 at each draft: prompt lookup), so a draft is
    accepted with p(x) and its rejection leaves p without x;
  - a tree's children are point masses (q = delta_x): a child is accepted with r(x), and a
    rejection removes x from r.

Typical acceptance (Medusa's, `Typical`) is the one lossy rule here, opt-in: a node x is
accepted when p(x) > min(epsilon, delta * exp(-H(p))) at its parent, the deepest path of accepted
nodes wins (ties: its likelihood), and the token after it is p's argmax. At T>0 this is not
p's law: every step emits the argmax after its path, and nothing in it is random (see
`accept_typical`). At T=0 it is greedy decoding, the lossless rule.

Used by the decoding loop (models/decoding.py: `accept`, `sample_target`, `ancestors`) and by the
stages that replay drafts offline: `score` writes each replayed draft's `accept_prob`
(`greedy_accept`, `accept_prob_of_logs`) and `reach` (`reach`); `opd` draws the outcomes of
those replays (`draw_outcomes`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from models.drafter import Proposal

# ---------------------------------------------------------------------------- per-draft math


def greedy_accept(tokens: Tensor, target_argmax: Tensor) -> Tensor:
    """T=0: a draft is accepted iff it equals the target's argmax at its position.

    tokens, target_argmax [N, K] -> bool [N, K] (as a float it is both p(draft) under the
    one-hot p and the acceptance probability min(1, p/q) with q one-hot at the draft).
    """
    return tokens == target_argmax


def accept_prob(p_token: Tensor, q_token: Tensor) -> Tensor:
    """T>0: min(1, p(x)/q(x)) of each draft x ~ q. p_token, q_token [N, K] -> [N, K]."""
    return (p_token / q_token).clamp(max=1.0)


def accept_prob_of_logs(log_p_token: Tensor, log_q_token: Tensor) -> Tensor:
    """`accept_prob` from log-probabilities: exp(min(0, log p - log q)). [N, K] -> [N, K].

    The same number as `accept_prob`, computed where the inputs are logs (the replayed drafts'
    scores) so that no exp of a tiny p underflows before the ratio is taken."""
    return (log_p_token - log_q_token).clamp(max=0).exp()


def reach(accept: Tensor) -> Tensor:
    """Probability (or, for 0/1 accepts, the indicator) that verification reaches each offset.

    accept [N, K] (acceptance probabilities, or drawn outcomes as 0/1) -> [N, K] with
    reach[:, k] = prod_{i<k} accept[:, i]: offset k+1 is tried only when every earlier draft was
    accepted, so reach[:, 0] = 1 and reach is non-increasing along k.
    """
    ones = torch.ones_like(accept[:, :1])
    return torch.cumprod(torch.cat([ones, accept[:, :-1]], 1), 1)


def draw_outcomes(accept_prob: Tensor, generator: torch.Generator) -> Tensor:
    """Accept each replayed draft with its probability, drawn on the host (the replays'
    generator is a CPU one, seeded per step so a resumed run draws the same); exact at 0 and 1.

    accept_prob [N, K] -> bool [N, K] on accept_prob's device."""
    drawn = torch.bernoulli(accept_prob.float().cpu(), generator=generator).bool()
    return drawn.to(accept_prob.device)


def sample_target(logits: Tensor, temperature: float, gen: torch.Generator) -> Tensor:
    """[B, V] fp32 logits -> [B] token: argmax at T=0, else a sample of softmax(logits / T)."""
    if temperature == 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits / temperature, dim=-1)
    return torch.multinomial(probs, 1, generator=gen)[:, 0]


# ---------------------------------------------------------------------------- one verify step


@dataclass
class Verdict:
    """What verification made of one step's proposal, per batch row and per node [B, N]."""

    accepted: Tensor  # [B] accepted nodes (the path's length)
    path: Tensor  # [B, D] node index (1-based) of the accepted node at each depth, 0 past it
    next: Tensor  # [B] the token after the path: a correction, or the bonus token
    p: Tensor  # [B, N] the target's probability of each node's token at its parent
    accept_prob: Tensor  # [B, N]
    outcome: Tensor  # [B, N] index into models.decoding.OUTCOMES
    usable: Tensor  # [B, N] bool: the node lies within the row's budget
    reach: Tensor  # [B] the deepest offset the row could accept (acceptance's denominator)


@dataclass(frozen=True)
class Typical:
    """Medusa's typical acceptance thresholds (its defaults: epsilon 0.09, delta 0.3)."""

    epsilon: float = 0.09  # the hard floor on p(x) ...
    delta: float = 0.3  # ... lowered to delta * exp(-entropy) where p is flat

    def __post_init__(self) -> None:
        for name in ("epsilon", "delta"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and 0 < value <= 1):
                raise ValueError(f"typical acceptance {name} must lie in (0, 1], got {value!r}")


def accept(
    proposal: Proposal,
    logits: Tensor,
    budget: Tensor,
    depth: int,
    eos: Tensor,
    temperature: float,
    gen: torch.Generator,
    typical: Typical | None = None,
) -> Verdict:
    """The module docstring's acceptance rule on one verify forward's logits [B, 1+N, V] (row 0:
    the last committed token), within each row's depth budget [B]. A chain's tests run at once;
    a tree walks depth by depth. A path ends after an accepted EOS: nothing follows EOS.
    `typical` (T>0 only; lossy) takes `accept_typical` instead."""
    if typical is not None and temperature > 0:
        return accept_typical(proposal, logits, budget, depth, eos, temperature, typical)
    if proposal.is_chain:
        return accept_chain(proposal, logits, budget, eos, temperature, gen)
    parent = torch.cat([torch.zeros_like(budget[:, None]), proposal.parent], dim=1)  # [B, 1+N]
    node_depth = torch.cat([torch.zeros_like(budget[:, None]), proposal.depth], dim=1)
    usable = (node_depth <= budget[:, None]) & (node_depth > 0)  # [B, 1+N]
    if temperature == 0:
        walk = walk_tree_greedy(
            logits, proposal, parent, usable, ancestors(parent, depth), depth, eos
        )
    else:
        walk = walk_tree(logits, proposal, parent, usable, depth, eos, temperature, gen)
    return Verdict(
        accepted=walk["accepted"],
        path=walk["path"],
        next=walk["next"],
        p=walk["p"][:, 1:],
        accept_prob=walk["accept_prob"][:, 1:],
        outcome=walk["outcome"][:, 1:],
        usable=usable[:, 1:],
        reach=budget,
    )


# ---------------------------------------------------------------------------- chains


def accept_chain(
    proposal: Proposal,
    logits: Tensor,
    budget: Tensor,
    eos: Tensor,
    temperature: float,
    gen: torch.Generator,
) -> Verdict:
    """Leviathan's test on a chain: greedy at T=0 (accept while draft == argmax p); at T>0
    accept d_i with prob min(1, p_i(d_i)/q_i(d_i)), on rejection emit a sample of
    norm(max(0, p_i - q_i)), after every accept a bonus sample of p. The chain stops after a
    drafted EOS (a decoder ends the block there). logits [B, K+1, V]."""
    drafts = proposal.tokens  # [B, K]
    batch, k = drafts.shape
    device = drafts.device
    offsets = torch.arange(k, device=device)
    is_eos = torch.isin(drafts, eos)
    eos_before = torch.cumsum(is_eos.long(), dim=1) - is_eos.long()
    drafted = (offsets < budget[:, None]) & (eos_before == 0)  # [B, K]: the block
    block_len = drafted.sum(1)
    rows = torch.arange(batch, device=device)
    if temperature == 0:
        greedy = logits.argmax(-1)  # [B, K+1]
        accepts = greedy_accept(drafts, greedy[:, :k])
        p_tok = accepts.float()
        prob = p_tok
    else:
        p = torch.softmax(logits / temperature, dim=-1)  # [B, K+1, V]
        p_tok = p[:, :k].gather(-1, drafts[..., None])[..., 0]  # [B, K]
        accepts, prob = accept_drafts(p_tok, proposal.q, gen)
    accepted = torch.cumprod((accepts & drafted).long(), dim=1).sum(1)  # [B]
    if temperature == 0:
        next_tok = greedy[rows, accepted]
    else:
        next_tok = correction(p, proposal, accepted, block_len, gen)
    outcome = torch.full_like(drafts, 2)
    outcome[offsets[None] < accepted[:, None]] = 0
    outcome[(offsets[None] == accepted[:, None]) & drafted] = 1
    return Verdict(
        accepted=accepted,
        path=(offsets + 1).expand(batch, -1),
        next=next_tok,
        p=p_tok,
        accept_prob=prob,
        outcome=outcome,
        usable=drafted,
        reach=block_len,
    )


def accept_drafts(p_tok: Tensor, q_tok: Tensor, gen: torch.Generator) -> tuple[Tensor, Tensor]:
    """Leviathan's test per drafted token x ~ q: accepted with probability min(1, p(x)/q(x)).
    p_tok, q_tok [B, K] -> (accepted bool [B, K], that probability [B, K])."""
    prob = accept_prob(p_tok, q_tok)
    u = torch.rand(p_tok.shape, generator=gen, device=p_tok.device)
    return u < prob, prob


def correction(
    p: Tensor, proposal: Proposal, accepted: Tensor, block_len: Tensor, gen: torch.Generator
) -> Tensor:
    """The token after a chain's accepted prefix [B]: a sample of the residual
    norm(max(0, p - q)) at the first rejected offset, else the bonus sample of p after the
    block. p [B, K+1, V]; q is the proposal's `dists` [B, Vd] per offset, in draft ids, or,
    without `dists`, the point mass at each draft (a lookup's drafts): its residual is p
    without the rejected draft, as a tree's rejected child leaves it."""
    rows = torch.arange(len(p), device=p.device)
    p_next = p[rows, accepted]  # [B, V]
    rejected = accepted < block_len
    if not bool(rejected.any()):
        return torch.multinomial(p_next, 1, generator=gen)[:, 0]
    at = accepted.clamp(max=proposal.tokens.shape[1] - 1)  # [B] the first rejected offset
    if proposal.dists is None:
        draft = proposal.tokens.gather(1, at[:, None])  # [B, 1]
        p_next = residual_without(p_next, draft, rejected[:, None])
    else:
        q_at = torch.stack(proposal.dists, dim=1)[rows, at]  # [B, Vd]
        vocab_map = proposal.vocab_map.to(p.device)
        q_full = torch.zeros_like(p_next).index_copy_(1, vocab_map, q_at)  # [B, V]
        p_next = torch.where(rejected[:, None], residual(p_next, q_full), p_next)
    return torch.multinomial(p_next, 1, generator=gen)[:, 0]


def residual(p: Tensor, q: Tensor) -> Tensor:
    """The law of the token emitted when a draft x ~ q is rejected: norm(max(0, p - q)).
    p, q [B, V] -> [B, V]."""
    rest = (p - q).clamp(min=0)
    mass = rest.sum(-1, keepdim=True)
    # A zero residual needs p == q, where rejection has probability 0; fp32 rounding can still
    # land here, and then p itself is the right law.
    return torch.where(mass > 0, rest / mass.clamp(min=1e-30), p)


# ---------------------------------------------------------------------------- trees


def ancestors(parent: Tensor, depth: int) -> Tensor:
    """parent [B, 1+N] (the root is its own parent) -> bool [B, 1+N, 1+N]: j is i or an ancestor."""
    width = parent.shape[1]
    anc = torch.eye(width, dtype=torch.bool, device=parent.device).expand(len(parent), -1, -1)
    up = parent[..., None].expand(-1, -1, width)
    for _ in range(depth):
        anc = anc | anc.gather(1, up)
    return anc


def walk_tree_greedy(
    logits: Tensor,
    proposal: Proposal,
    parent: Tensor,
    usable: Tensor,
    ancestors: Tensor,
    depth: int,
    eos: Tensor,
) -> dict[str, Tensor]:
    """`walk_tree` at T=0, without a loop: p is one-hot at argmax, so a node is accepted iff it
    and every ancestor equal the target's greedy token at their parent (siblings are distinct
    tokens, so at most one child of a node does) and no strict ancestor is an accepted EOS; a
    child of the root or of an accepted node is rejected iff it ranks before the accepted
    sibling (or none was accepted), as the sequential test would have tried it first.

    ancestors [B, 1+N, 1+N] (see `ancestors`); the rest as `walk_tree`.
    """
    batch, width = parent.shape
    rows = torch.arange(batch, device=logits.device)
    index = torch.arange(width, device=logits.device)
    tokens = torch.cat([torch.zeros_like(parent[:, :1]), proposal.tokens], dim=1)  # [B, 1+N]
    greedy = logits.argmax(-1)  # [B, 1+N]
    p_node = greedy_accept(tokens, greedy.gather(1, parent)).float()  # [B, 1+N]
    good = (p_node > 0) & usable
    good[:, 0] = True  # the root is committed
    stops = torch.isin(tokens, eos) & usable  # an accepted EOS ends the path below it
    strict = ancestors & (index[:, None] != index)  # [B, 1+N, 1+N]: strict ancestors
    on_path = ~(strict & (~good | stops)[:, None, :]).any(-1) & good  # [B, 1+N]
    on_path[:, 0] = False
    accepted = on_path.sum(1)  # [B]
    node_depth = torch.cat([torch.zeros_like(parent[:, :1]), proposal.depth], dim=1)
    path = torch.zeros(batch, depth + 1, dtype=torch.long, device=logits.device)
    path.scatter_(1, torch.where(on_path, node_depth, 0), torch.where(on_path, index, 0))
    path[:, 0] = 0  # it took every off-path node's scatter; it is the root (depth 0)
    reached = torch.zeros_like(on_path)
    reached[:, 0] = True
    reached |= on_path & ~stops  # nodes whose children the walk tries
    tried_under = reached.gather(1, parent) & usable  # children of reached nodes
    taken = torch.full_like(parent, width).scatter_reduce(
        1, parent, torch.where(on_path, index, width), reduce="amin"
    )  # [B, 1+N]: per node, the index of its accepted child (width: none)
    rejected = tried_under & ~on_path & (index < taken.gather(1, parent))
    outcome = torch.full_like(parent, 2)
    outcome[rejected] = 1
    outcome[on_path] = 0
    cur = path.gather(1, accepted[:, None])[:, 0]  # the last accepted node, or the root
    return dict(
        accepted=accepted,
        path=path[:, 1:],
        next=greedy[rows, cur],
        p=p_node,
        accept_prob=p_node,
        outcome=outcome,
    )


def walk_tree(
    logits: Tensor,
    proposal: Proposal,
    parent: Tensor,
    usable: Tensor,
    depth: int,
    eos: Tensor,
    temperature: float,
    gen: torch.Generator,
) -> dict[str, Tensor]:
    """Accept along a tree of point-mass proposals at T > 0, one depth at a time.

    logits [B, 1+N, V] (row 0: the root), parent / usable [B, 1+N]. Returns accepted [B],
    path [B, depth] (node index at each accepted depth, 0 past it), next [B] (the token after
    the path), and per node [B, 1+N]: p (target probability of the node's token at its parent),
    accept_prob, outcome (index into models.decoding.OUTCOMES).

    The sequential sibling tests are done at once: after rejecting siblings 1..j-1 the residual
    is p without their tokens, so sibling j is accepted with r_j(x_j) = p(x_j) / (1 - S_{j-1}),
    S_{j-1} = p(x_1) + ... + p(x_{j-1}); the first sibling whose test passes is the one taken.
    """
    batch, width = parent.shape
    device = logits.device
    rows = torch.arange(batch, device=device)
    tokens = torch.cat([torch.zeros_like(parent[:, :1]), proposal.tokens], dim=1)  # [B, 1+N]
    p_rows = torch.softmax(logits / temperature, dim=-1)  # [B, 1+N, V]
    p_node = p_rows[rows[:, None], parent, tokens]  # [B, 1+N]
    probs = p_node.clone()
    outcome = torch.full((batch, width), 2, dtype=torch.long, device=device)
    # children[b, n, j]: node index of n's j-th usable child in confidence order, -1 past the last
    is_child = (parent[:, None, :] == torch.arange(width, device=device)[:, None]) & usable[:, None]
    k = int(is_child.sum(2).max()) if width > 1 else 0
    rank = torch.where(is_child, is_child.long().cumsum(2) - 1, k)  # [B, 1+N (parent), 1+N]
    children = torch.full((batch, width, k + 1), -1, dtype=torch.long, device=device)
    children.scatter_(2, rank, torch.arange(width, device=device).expand(batch, width, -1).clone())
    children = children[..., :k]  # column k collected the non-children
    sibling = torch.arange(k, device=device)

    cur = torch.zeros(batch, dtype=torch.long, device=device)
    active = torch.ones(batch, dtype=torch.bool, device=device)
    accepted = torch.zeros(batch, dtype=torch.long, device=device)
    path = torch.zeros(batch, depth, dtype=torch.long, device=device)
    final = p_rows[:, 0].clone()  # [B, V] law of the next token
    for d in range(depth):
        kids = children[rows, cur]  # [B, k]
        live = (kids >= 0) & active[:, None]
        node = kids.clamp(min=0)
        px = p_node.gather(1, node) * live  # [B, k] p of each sibling's token at cur
        before = px.cumsum(1) - px  # S_{j-1}
        test = (px / (1 - before).clamp(min=1e-30)).clamp(max=1.0)  # r_j(x_j)
        passed = live & accept_children(test, gen)
        first = torch.where(passed, sibling, k).min(1).values  # [B], k: none passed
        moved = first < k
        tried = live & (sibling <= first[:, None])
        taken = kids.gather(1, first.clamp(max=k - 1)[:, None])[:, 0] if k else cur
        probs.scatter_(1, node, torch.where(tried, test, probs.gather(1, node)))
        verdict = torch.where(sibling == first[:, None], 0, 1)  # accepted / rejected
        outcome.scatter_(1, node, torch.where(tried, verdict, outcome.gather(1, node)))
        stop = active & ~moved  # the residual after all of cur's children is the law
        rest = residual_without(p_rows[rows, cur], tokens.gather(1, node), live)
        final = torch.where(stop[:, None], rest, final)
        cur = torch.where(moved, taken, cur)
        path[:, d] = torch.where(moved, taken, 0)
        accepted += moved.long()
        active = moved & ~torch.isin(tokens[rows, cur], eos)
    # rows still active accepted up to their depth budget: the bonus token, a sample of p
    final = torch.where(active[:, None], p_rows[rows, cur], final)
    nxt = torch.multinomial(final, 1, generator=gen)[:, 0]
    return dict(
        accepted=accepted,
        path=path,
        next=nxt,
        p=p_node,
        accept_prob=probs,
        outcome=outcome,
    )


def accept_children(test: Tensor, gen: torch.Generator) -> Tensor:
    """The siblings' tests [B, k] at once: sibling j passes with its probability r_j(x_j)."""
    return torch.rand(test.shape, generator=gen, device=test.device) < test


def residual_without(p: Tensor, tokens: Tensor, rejected: Tensor) -> Tensor:
    """The residual after rejecting `tokens` [B, k] where `rejected`: rejecting a point mass x
    leaves norm(max(r - delta_x, 0)), r with x removed, so all of them: p without them,
    renormalised. p [B, V] -> [B, V]."""
    removed = p.scatter(1, tokens, torch.where(rejected, 0.0, p.gather(1, tokens)))
    mass = removed.sum(-1, keepdim=True)
    # mass 0 needs the rejected tokens to hold all of p, and then one of them was accepted
    return torch.where(mass > 0, removed / mass.clamp(min=1e-30), p)


# ---------------------------------------------------------------------------- typical (lossy)


def accept_typical(
    proposal: Proposal,
    logits: Tensor,
    budget: Tensor,
    depth: int,
    eos: Tensor,
    temperature: float,
    typical: Typical,
) -> Verdict:
    """Medusa's typical acceptance on a chain or tree (LOSSY at T > 0; the loop's default is
    lossless): node x passes when p(x) > min(epsilon, delta * exp(-H(p))), p = softmax(logits
    / T) at its parent and H its entropy; of the nodes whose whole path passes (and follows no
    accepted EOS) the deepest is taken, ties to the higher sum of log p along the path, then to
    the lower node index; the token after it is p's argmax there. No draw is made: the output
    is a function of the prompt, and the token after each path is p's mode, so the emitted law
    puts no mass off the mode where nothing passes (total variation to p at least 1 - max p).
    logits [B, 1+N, V]; the Verdict as `accept`'s (accept_prob: 1 / 0 for a pass / fail)."""
    batch, n = proposal.tokens.shape
    device = logits.device
    rows = torch.arange(batch, device=device)
    index = torch.arange(n + 1, device=device)
    root = torch.zeros(batch, 1, dtype=torch.long, device=device)
    if proposal.is_chain:  # node i continues node i-1
        parent = index[:-1].expand(batch, -1)  # [B, N]
        node_depth = index[1:].expand(batch, -1)
        is_eos = torch.isin(proposal.tokens, eos)
        after_eos = (torch.cumsum(is_eos.long(), dim=1) - is_eos.long()) > 0
        in_budget = (node_depth <= budget[:, None]) & ~after_eos  # [B, N] the block
    else:
        parent, node_depth = proposal.parent, proposal.depth
        in_budget = node_depth <= budget[:, None]
    parent = torch.cat([root, parent], dim=1)  # [B, 1+N]
    node_depth = torch.cat([root, node_depth], dim=1)
    usable = torch.cat([torch.zeros_like(root, dtype=torch.bool), in_budget], dim=1)
    tokens = torch.cat([root, proposal.tokens], dim=1)  # [B, 1+N]

    p_rows = torch.softmax(logits.float() / temperature, dim=-1)  # [B, 1+N, V]
    entropy = -(p_rows * p_rows.clamp_min(torch.finfo(torch.float32).tiny).log()).sum(-1)
    floor = torch.clamp(typical.delta * torch.exp(-entropy), max=typical.epsilon)  # [B, 1+N]
    p_node = p_rows[rows[:, None], parent, tokens]  # [B, 1+N] p of each node at its parent
    passed = (p_node > floor.gather(1, parent)) & usable
    passed[:, 0] = True  # the root is committed
    anc = ancestors(parent, max(depth, 1))  # [B, 1+N, 1+N]
    strict = anc & (index[:, None] != index)
    stops = torch.isin(tokens, eos) & usable
    whole = ~(strict & (~passed | stops)[:, None, :]).any(-1) & passed  # [B, 1+N]
    loglik = (anc.double() * p_node.double().clamp_min(1e-300).log()[:, None, :]).sum(-1)
    deepest = torch.where(whole, node_depth, -1).amax(1, keepdim=True)  # [B, 1]
    best = torch.where(whole & (node_depth == deepest), loglik, -torch.inf).argmax(1)  # [B]
    on_path = anc[rows, best] & (index > 0)  # [B, 1+N]
    accepted = node_depth[rows, best]
    path = torch.zeros(batch, depth + 1, dtype=torch.long, device=device)
    path.scatter_(1, torch.where(on_path, node_depth, 0), torch.where(on_path, index, 0))
    reached = on_path & ~stops
    reached[:, 0] = True
    tried = reached.gather(1, parent) & usable  # children of the root or of a path node
    outcome = torch.full_like(parent, 2)
    outcome[tried & ~on_path] = 1
    outcome[on_path] = 0
    return Verdict(
        accepted=accepted,
        path=path[:, 1:],
        next=p_rows[rows, best].argmax(-1),
        p=p_node[:, 1:],
        accept_prob=passed[:, 1:].float(),
        outcome=outcome[:, 1:],
        usable=usable[:, 1:],
        reach=in_budget.sum(1) if proposal.is_chain else budget,
    )
