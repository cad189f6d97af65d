"""Lossless speculative decoding: ONE loop for every drafter kind and proposal shape, batched,
with a per-draft log.

One round per active sequence (all rows of the batch advance together):
  1. propose: the drafter's proposer reads the rows committed since the last round and drafts
     a chain (or a block, drafted in one forward: a chain to the loop) or a tree
     (`models.drafter.Proposal`), within each row's depth budget;
  2. verify: the target runs [last committed token, the drafted nodes] in ONE forward whose mask
     lets each node see the committed slots, its ancestors and itself (a chain's ancestors are
     the drafts before it), at position last + depth(node);
  3. accept, losslessly, from the root down: at a reached node with target distribution p (at
     the temperature; one-hot argmax at T=0) its children are tried in order, each with the
     proposal it was drawn from: a child x drawn from q is accepted with probability
     min(1, r(x)/q(x)), r the residual (r = p at the first child), and on rejection
     r <- norm(max(0, r - q)). A sampled chain node is drawn from the drafter's q (Leviathan's
     test; a rejection emits a sample of norm(max(0, p - q))); a tree's children are point
     masses (q = delta_x: accepted with r(x), a rejection removes x from r). The first accepted
     child is descended into; when none is, the emitted token is a sample of r (of p after the
     last drafted depth: the bonus token). So every emitted token has the law p, and at T=0
     the output is the target's greedy decoding. A path ends after an accepted EOS (nothing
     follows EOS) and at the row's depth budget, min(depth, remaining - 1) near
     `max_new_tokens`, so a verify step never emits past the budget;
  4. commit: the root and the accepted path stay in the target's cache (a tree's accepted
     nodes are packed in place; a chain's already are), and their target features become the
     drafter's next rows.

Rows accept different lengths, so no cache is cropped per row (models/kv.py). Sequence positions
count from the first prompt token; the prefill samples each row's first new token from the
target.

Log: one record per drafted node within its row's budget (RECORD_COLUMNS; trees add `node` and
`parent`, TREE_RECORD_COLUMNS): accepted = on the accepted path, rejected = tried and rejected,
not_reached = never tried. A node at depth d sits at sequence position anchor + d - 1.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from models.drafter import (
    ChainShape,
    CommittedRows,
    Drafter,
    Proposal,
    Shape,
    TreeShape,
    confident_length,
    truncated,
)
from models.kv import extend_mask, trim_slots, valid_upto
from models.target import Target

OUTCOMES = ("accepted", "rejected", "not_reached")
RECORD_COLUMNS = (
    "sequence",
    "step",  # verify step of that sequence, 0-based
    "anchor",  # sequence position of the step's first draft
    "offset",  # the node's depth (1-based): its sequence position is anchor + offset - 1
    "token",
    "q",  # drafter probability of the token at the temperature (1 at T=0)
    "p",  # target probability of the token at its parent, at the temperature (one-hot at T=0)
    "accept_prob",  # min(1, p/q) for a sampled chain draft; a tree node: the residual's mass on
    # it when tried (p when never tried); 1/0 at T=0
    "outcome",
    "target_token",  # what the target emitted at the node's position; -1 if never tried
    "confidence",  # max_v q_v of the drafter where it drafted the node (q at T, or at 1 at T=0)
)
TREE_RECORD_COLUMNS = (
    *RECORD_COLUMNS[:3],
    "node",  # 1-based index in the step's tree; nodes come in depth order, parents first
    "parent",  # the parent's node index, 0 = the root (the last committed token)
    *RECORD_COLUMNS[3:],
)
STEP_COLUMNS = ("sequence", "step", "anchor", "drafted", "accepted", "emitted")
TREE_STEP_COLUMNS = (*STEP_COLUMNS, "depth")  # depth: the row's depth budget that step


@dataclass(frozen=True)
class SpecConfig:
    """Speculative decoding settings. `eos_token_ids=None` means the target's own EOS ids;
    an empty tuple never stops early."""

    shape: Shape
    temperature: float = 0.0
    max_new_tokens: int = 64
    seed: int = 0
    eos_token_ids: tuple[int, ...] | None = None
    keep_teacher: bool = False
    """Keep each verify step's teacher: the target's post-norm last hidden at the state
    predicting each draft (chains only). It is conditioned on the drafts before it, so it is
    the teacher on-policy distillation wants, for free; it costs [N, H] bf16 per step."""


@dataclass
class SpecResult:
    """Output of `speculative_generate`.

    sequences: generated tokens per prompt (prompt excluded; EOS included when emitted).
    records: columnar, one row per drafted node (RECORD_COLUMNS, or TREE_RECORD_COLUMNS); q, p
      and accept_prob exist for not-reached nodes too: the target scored the whole proposal,
      each node conditioned on its ancestors.
    steps: columnar, one row per (sequence, verify step) (STEP_COLUMNS / TREE_STEP_COLUMNS):
      drafted = nodes within the row's budget (a chain's block length), emitted = tokens the
      step committed.
    stats: see `_stats`.
    teacher: with `keep_teacher`, [R, N, H] bf16 on the host, row r for steps' row r: the
      verify forward's last hidden at the state predicting node n (zeros past the block), so
      softmax(lm_head(teacher) / T) is the target's distribution there, given the drafts < n.
    """

    sequences: list[list[int]]
    finish_reasons: list[str]
    records: dict[str, list]
    steps: dict[str, list]
    stats: dict[str, Any] = field(default_factory=dict)
    teacher: Tensor | None = None


@dataclass
class GenerateResult:
    """Output of `target_generate`: generated tokens per prompt, why each stopped, forward calls."""

    sequences: list[list[int]]
    finish_reasons: list[str]
    target_forwards: int


# ---------------------------------------------------------------------------- public entry points


@torch.no_grad()
def speculative_generate(
    target: Target, drafter: Drafter, prompts: list[list[int]], cfg: SpecConfig
) -> SpecResult:
    """Speculative decoding of `prompts` with `drafter` proposing and `target` verifying."""
    _check_config(cfg.shape, cfg.temperature, cfg.max_new_tokens)
    if cfg.keep_teacher and not isinstance(cfg.shape, ChainShape):
        raise ValueError(
            "keep_teacher keeps a chain's teachers; a tree node's teacher sits at its parent"
        )
    _check_prompts(prompts, target.vocab_size)
    if isinstance(cfg.shape, TreeShape):
        check_tree_fits(target, max(map(len, prompts)), cfg.max_new_tokens, cfg.shape.budget)
    drafter.check_target(target)
    device = target.device
    gen = torch.Generator(device=device).manual_seed(cfg.seed)
    eos = _eos_tensor(target, cfg.eos_token_ids)
    timer = _ForwardTimer()
    proposer = drafter.proposer(cfg.shape, cfg.temperature, gen, timer)  # checks the shape
    state, rows = _prefill(
        target, prompts, cfg.max_new_tokens + cfg.shape.depth + 1, cfg.temperature, gen, timer
    )
    chain = isinstance(cfg.shape, ChainShape)
    logged: list[dict[str, Tensor]] = []
    counts = {"verify": 0, "drafter": 0}
    while (keep := state.retire(cfg.max_new_tokens, eos)) is not None:
        if keep.numel() < len(rows.ids):
            proposer.keep_rows(keep)
            rows = rows.select(keep)
        budget = (cfg.max_new_tokens - state.n_gen - 1).clamp(max=cfg.shape.depth)  # [B]
        if int(budget.max()) > 0:
            proposal = proposer.propose(rows, budget)
        else:
            proposal = Proposal.empty(state.batch, device, chain)
        counts["drafter"] += proposal.forwards
        if chain and cfg.shape.stop_confidence > 0:
            budget = torch.minimum(budget, _confident(proposal, cfg.shape.stop_confidence))
            proposal = truncated(proposal, budget)
        depth = proposal.tokens.shape[1] if chain else int(budget.max())
        out, start = _verify(target, state, proposal, depth, timer)
        counts["verify"] += 1
        verdict = _accept(proposal, out.logits, budget, depth, eos, cfg.temperature, gen)
        entry = _step_log(state, len(logged), budget, proposal, verdict)
        if cfg.keep_teacher:  # input 0 is the last committed token: it predicts draft 1
            in_block = verdict.usable[..., None]  # [B, K, 1]: past a row's block, no teacher
            teacher = torch.where(in_block, out.last_hidden[:, :depth], 0.0)
            entry["teacher"] = teacher.to(torch.bfloat16).cpu()  # [B, K, H]
        rows, entry["path_tokens"], entry["emitted"] = _commit(
            target, state, proposal, verdict, out.aux_hidden, start, eos
        )
        logged.append(entry)
    return _result(state, logged, cfg, counts, timer)


@torch.no_grad()
def target_generate(
    target: Target,
    prompts: list[list[int]],
    max_new_tokens: int,
    temperature: float = 0.0,
    seed: int = 0,
    eos_token_ids: tuple[int, ...] | None = None,
) -> GenerateResult:
    """Plain KV-cached decoding with the same batching and sampling code: the speed baseline."""
    _check_config(ChainShape(1), temperature, max_new_tokens)
    _check_prompts(prompts, target.vocab_size)
    device = target.device
    gen = torch.Generator(device=device).manual_seed(seed)
    eos = _eos_tensor(target, eos_token_ids)
    state, _ = _prefill(target, prompts, max_new_tokens, temperature, gen, _ForwardTimer())
    forwards = 1
    while state.retire(max_new_tokens, eos) is not None:
        last_tok = state.seq.gather(1, (state.seq_len - 1)[:, None])  # [B, 1]
        one = torch.ones(state.batch, 1, dtype=torch.bool, device=device)
        out = target.forward(
            last_tok,
            position_ids=(state.seq_len - 1)[:, None],
            attention_mask=extend_mask(state.t_valid, one),
            cache=state.cache,
        )
        forwards += 1
        state.t_valid = torch.cat([state.t_valid, one], dim=1)
        token = _sample_target(out.logits[:, -1], temperature, gen)
        state.seq.scatter_(1, state.seq_len[:, None], token[:, None])
        state.seq_len += 1
        state.n_gen += 1
    return GenerateResult(state.results, state.finish_reasons, forwards)


def _confident(proposal: Proposal, threshold: float) -> Tensor:
    """[B] drafts a chain proposes under its stop rule (a proposer may have stopped already)."""
    return confident_length(proposal.confidence, threshold, joint=proposal.joint_confidence)


# ---------------------------------------------------------------------------- batch state


class _Batch:
    """Active rows: committed tokens, the target's KV cache with per-row slot validity."""

    def __init__(
        self,
        seq: Tensor,
        seq_len: Tensor,
        prompt_len: Tensor,
        cache: Any,
        t_valid: Tensor,
        target: Target,
    ) -> None:
        self.seq = seq  # [B, cap] prompt + generated, right-padded
        self.seq_len = seq_len  # [B]
        self.prompt_len = prompt_len  # [B]
        self.n_gen = seq_len - prompt_len  # [B]
        self.cache = cache
        self.t_valid = t_valid  # [B, S] which target cache slots are real
        self.row_ids = torch.arange(len(seq), device=seq.device)  # [B] index into the prompts
        self.target = target
        self.results: list[list[int]] = [[] for _ in range(len(seq))]
        self.finish_reasons: list[str] = ["" for _ in range(len(seq))]

    @property
    def batch(self) -> int:
        return len(self.seq)

    def retire(self, max_new_tokens: int, eos: Tensor) -> Tensor | None:
        """Move finished rows to the results; return the kept row indices, None when all done."""
        last = self.seq.gather(1, (self.seq_len - 1)[:, None])[:, 0]
        hit_eos = torch.isin(last, eos)
        done = hit_eos | (self.n_gen >= max_new_tokens)
        if bool(done.any()):
            idx = done.nonzero()[:, 0]
            columns = (self.row_ids, self.prompt_len, self.seq_len, hit_eos)
            for tokens, row, start, end, by_eos in zip(
                self.seq[idx].tolist(), *(c[idx].tolist() for c in columns), strict=True
            ):
                self.results[row] = tokens[start:end]
                self.finish_reasons[row] = "eos" if by_eos else "length"
        keep = (~done).nonzero()[:, 0]
        if keep.numel() == 0:
            return None
        if keep.numel() < self.batch:
            self.seq, self.seq_len = self.seq[keep], self.seq_len[keep]
            self.prompt_len, self.n_gen = self.prompt_len[keep], self.n_gen[keep]
            self.row_ids, self.t_valid = self.row_ids[keep], self.t_valid[keep]
            self.target.select_cache_rows(self.cache, keep)
            self.t_valid = trim_slots(self.t_valid, self.cache, crop=self.target.crop_cache)
        return keep


def _prefill(
    target: Target,
    prompts: list[list[int]],
    extra: int,
    temperature: float,
    gen: torch.Generator,
    timer: _ForwardTimer,
) -> tuple[_Batch, CommittedRows]:
    """One target forward over the right-padded prompts; samples each row's first new token.

    Returns the batch state and the prompts as the drafter's first rows.
    """
    device = target.device
    lengths = torch.tensor([len(p) for p in prompts], device=device)
    width = int(lengths.max())
    padded = [prompt + [0] * (width + extra + 1 - len(prompt)) for prompt in prompts]
    seq = torch.tensor(padded, dtype=torch.long, device=device)  # [B, cap]
    valid = torch.arange(width, device=device)[None] < lengths[:, None]  # [B, P]
    mask = torch.ones(width, width, dtype=torch.bool, device=device).tril() & valid[:, None, :]
    mask |= torch.eye(width, dtype=torch.bool, device=device)  # pad rows see themselves: no NaN
    cache = target.new_cache()
    positions = torch.arange(width, device=device).expand(len(prompts), -1)
    with timer("target"):
        out = target.forward(
            seq[:, :width], position_ids=positions, attention_mask=mask, cache=cache
        )
    rows = torch.arange(len(prompts), device=device)
    first = _sample_target(out.logits[rows, lengths - 1], temperature, gen)
    seq[rows, lengths] = first
    state = _Batch(seq, lengths + 1, lengths.clone(), cache, valid, target)
    # ids are a copy: later steps write into `seq` where short prompts end
    first_rows = CommittedRows(
        seq[:, 1 : width + 1].clone(), out.aux_hidden, positions, valid.clone()
    )
    return state, first_rows


# ---------------------------------------------------------------------------- verify, accept, commit


def _verify(
    target: Target, state: _Batch, proposal: Proposal, depth: int, timer: _ForwardTimer
) -> tuple[Any, int]:
    """The target over [last committed token, the nodes] in one forward; returns its output
    (logits [B, 1+N, V], aux_hidden [B, 1+N, F]) and the cache length before it."""
    last_tok = state.seq.gather(1, (state.seq_len - 1)[:, None])  # [B, 1]
    width = proposal.tokens.shape[1] + 1
    if proposal.is_chain:
        node_depth = torch.arange(width, device=last_tok.device)[None]  # [1, 1+K]
        local = torch.ones(width, width, dtype=torch.bool, device=last_tok.device).tril()
        local = local.expand(state.batch, -1, -1)  # a draft sees the drafts before it
    else:
        parent = torch.cat([torch.zeros_like(last_tok), proposal.parent], dim=1)  # [B, 1+N]
        node_depth = torch.cat([torch.zeros_like(last_tok), proposal.depth], dim=1)
        local = ancestors(parent, depth)  # [B, 1+N, 1+N]
    start = target.cache_length(state.cache)
    mask = torch.cat([state.t_valid[:, None].expand(-1, width, -1), local], dim=2)
    with timer("target"):
        out = target.forward(
            torch.cat([last_tok, proposal.tokens], dim=1),
            position_ids=(state.seq_len - 1)[:, None] + node_depth,
            attention_mask=mask,  # [B, 1+N, S+1+N]
            cache=state.cache,
        )
    return out, start


@dataclass
class _Verdict:
    """What verification made of one step's proposal, per batch row and per node [B, N]."""

    accepted: Tensor  # [B] accepted nodes (the path's length)
    path: Tensor  # [B, D] node index (1-based) of the accepted node at each depth, 0 past it
    next: Tensor  # [B] the token after the path: a correction, or the bonus token
    p: Tensor  # [B, N] the target's probability of each node's token at its parent
    accept_prob: Tensor  # [B, N]
    outcome: Tensor  # [B, N] index into OUTCOMES
    usable: Tensor  # [B, N] bool: the node lies within the row's budget
    reach: Tensor  # [B] the deepest offset the row could accept (acceptance's denominator)


def _accept(
    proposal: Proposal,
    logits: Tensor,
    budget: Tensor,
    depth: int,
    eos: Tensor,
    temperature: float,
    gen: torch.Generator,
) -> _Verdict:
    """The module docstring's acceptance rule. A chain has one child per node, so its tests
    run at once: node i is reached iff nodes < i were accepted (a cumulative product), and
    only the first rejected node's residual is sampled; a tree walks depth by depth."""
    if proposal.is_chain:
        return _accept_chain(proposal, logits, budget, eos, temperature, gen)
    parent = torch.cat([torch.zeros_like(budget[:, None]), proposal.parent], dim=1)  # [B, 1+N]
    node_depth = torch.cat([torch.zeros_like(budget[:, None]), proposal.depth], dim=1)
    usable = (node_depth <= budget[:, None]) & (node_depth > 0)  # [B, 1+N]
    if temperature == 0:
        walk = _walk_greedy(logits, proposal, parent, usable, ancestors(parent, depth), depth, eos)
    else:
        walk = _walk(logits, proposal, parent, usable, depth, eos, temperature, gen)
    return _Verdict(
        accepted=walk["accepted"],
        path=walk["path"],
        next=walk["next"],
        p=walk["p"][:, 1:],
        accept_prob=walk["accept_prob"][:, 1:],
        outcome=walk["outcome"][:, 1:],
        usable=usable[:, 1:],
        reach=budget,
    )


def _accept_chain(
    proposal: Proposal,
    logits: Tensor,
    budget: Tensor,
    eos: Tensor,
    temperature: float,
    gen: torch.Generator,
) -> _Verdict:
    """Leviathan's test on a chain: greedy at T=0 (accept while draft == argmax p); at T>0
    accept d_i with prob min(1, p_i(d_i)/q_i(d_i)), on rejection emit a sample of
    norm(max(0, p_i - q_i)), after every accept a bonus sample of p. The chain stops after a
    drafted EOS (a decoder ends the block there)."""
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
        accept = drafts == greedy[:, :k]
        p_tok = accept.float()
        accept_prob = p_tok
    else:
        p = torch.softmax(logits / temperature, dim=-1)  # [B, K+1, V]
        p_tok = p[:, :k].gather(-1, drafts[..., None])[..., 0]  # [B, K]
        accept, accept_prob = _accept_draft(p_tok, proposal.q, gen)
    accepted = torch.cumprod((accept & drafted).long(), dim=1).sum(1)  # [B]
    if temperature == 0:
        next_tok = greedy[rows, accepted]
    else:
        next_tok = _correction(p, proposal, accepted, block_len, gen)
    outcome = torch.full_like(drafts, 2)
    outcome[offsets[None] < accepted[:, None]] = 0
    outcome[(offsets[None] == accepted[:, None]) & drafted] = 1
    return _Verdict(
        accepted=accepted,
        path=(offsets + 1).expand(batch, -1),
        next=next_tok,
        p=p_tok,
        accept_prob=accept_prob,
        outcome=outcome,
        usable=drafted,
        reach=block_len,
    )


def _accept_draft(p_tok: Tensor, q_tok: Tensor, gen: torch.Generator) -> tuple[Tensor, Tensor]:
    """Leviathan's test per drafted token: accept with probability min(1, p/q)."""
    accept_prob = (p_tok / q_tok).clamp(max=1.0)
    u = torch.rand(p_tok.shape, generator=gen, device=p_tok.device)
    return u < accept_prob, accept_prob


def _correction(
    p: Tensor, proposal: Proposal, accepted: Tensor, block_len: Tensor, gen: torch.Generator
) -> Tensor:
    """The token after a chain's accepted prefix: residual sample on rejection, bonus sample of
    p else. p [B, K+1, V]."""
    rows = torch.arange(len(p), device=p.device)
    p_next = p[rows, accepted]  # [B, V]
    rejected = accepted < block_len
    dists = proposal.dists
    if dists and bool(rejected.any()):
        q_stack = torch.stack(dists, dim=1)  # [B, K, Vd]
        q_at = q_stack[rows, accepted.clamp(max=len(dists) - 1)]  # [B, Vd]
        vocab_map = proposal.vocab_map.to(p.device)
        q_full = torch.zeros_like(p_next).index_copy_(1, vocab_map, q_at)  # [B, V]
        residual = (p_next - q_full).clamp(min=0)
        mass = residual.sum(-1, keepdim=True)
        # A zero residual needs p == q, where rejection has probability 0; fp32 rounding can still
        # land here, and then p itself is the right law.
        residual = torch.where(mass > 0, residual / mass.clamp(min=1e-30), p_next)
        p_next = torch.where(rejected[:, None], residual, p_next)
    return torch.multinomial(p_next, 1, generator=gen)[:, 0]


def ancestors(parent: Tensor, depth: int) -> Tensor:
    """parent [B, 1+N] (the root is its own parent) -> bool [B, 1+N, 1+N]: j is i or an ancestor."""
    width = parent.shape[1]
    anc = torch.eye(width, dtype=torch.bool, device=parent.device).expand(len(parent), -1, -1)
    up = parent[..., None].expand(-1, -1, width)
    for _ in range(depth):
        anc = anc | anc.gather(1, up)
    return anc


def _walk_greedy(
    logits: Tensor,
    proposal: Proposal,
    parent: Tensor,
    usable: Tensor,
    ancestors: Tensor,
    depth: int,
    eos: Tensor,
) -> dict[str, Tensor]:
    """`_walk` at T=0, without a loop: p is one-hot at argmax, so a node is accepted iff it and
    every ancestor equal the target's greedy token at their parent (siblings are distinct
    tokens, so at most one child of a node does) and no strict ancestor is an accepted EOS; a
    child of the root or of an accepted node is rejected iff it ranks before the accepted
    sibling (or none was accepted), as the sequential test would have tried it first.

    ancestors [B, 1+N, 1+N] (see `ancestors`); the rest as `_walk`.
    """
    batch, width = parent.shape
    rows = torch.arange(batch, device=logits.device)
    index = torch.arange(width, device=logits.device)
    tokens = torch.cat([torch.zeros_like(parent[:, :1]), proposal.tokens], dim=1)  # [B, 1+N]
    greedy = logits.argmax(-1)  # [B, 1+N]
    p_node = (tokens == greedy.gather(1, parent)).float()  # [B, 1+N]
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


def _walk(
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
    accept_prob, outcome (index into OUTCOMES).

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
    accept_prob = p_node.clone()
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
        passed = live & _accept_child(test, gen)
        first = torch.where(passed, sibling, k).min(1).values  # [B], k: none passed
        moved = first < k
        tried = live & (sibling <= first[:, None])
        taken = kids.gather(1, first.clamp(max=k - 1)[:, None])[:, 0] if k else cur
        accept_prob.scatter_(1, node, torch.where(tried, test, accept_prob.gather(1, node)))
        verdict = torch.where(sibling == first[:, None], 0, 1)  # accepted / rejected
        outcome.scatter_(1, node, torch.where(tried, verdict, outcome.gather(1, node)))
        stop = active & ~moved  # the residual after all of cur's children is the law
        residual = _without(p_rows[rows, cur], tokens.gather(1, node), live)
        final = torch.where(stop[:, None], residual, final)
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
        accept_prob=accept_prob,
        outcome=outcome,
    )


def _accept_child(test: Tensor, gen: torch.Generator) -> Tensor:
    """The siblings' rejection tests [B, k]: each passes with its probability r_j(x_j)."""
    return torch.rand(test.shape, generator=gen, device=test.device) < test


def _without(p: Tensor, tokens: Tensor, rejected: Tensor) -> Tensor:
    """The residual after rejecting `tokens` [B, k] where `rejected`: rejecting a point mass x
    leaves norm(max(r - delta_x, 0)), r with x removed, so all of them: p without them,
    renormalised. p [B, V]."""
    removed = p.scatter(1, tokens, torch.where(rejected, 0.0, p.gather(1, tokens)))
    mass = removed.sum(-1, keepdim=True)
    # mass 0 needs the rejected tokens to hold all of p, and then one of them was accepted
    return torch.where(mass > 0, removed / mass.clamp(min=1e-30), p)


def _commit(
    target: Target,
    state: _Batch,
    proposal: Proposal,
    verdict: _Verdict,
    aux_hidden: Tensor,
    start: int,
    eos: Tensor,
) -> tuple[CommittedRows, Tensor, Tensor]:
    """Write the path and the next token, keep the root and the path in the target's cache.
    Returns the committed rows for the drafter's next proposal, the tokens written [B, D+1]
    (the path, then the next token) and the tokens emitted per row [B]."""
    batch, device = state.batch, aux_hidden.device
    rows = torch.arange(batch, device=device)
    accepted, path = verdict.accepted, verdict.path  # [B], [B, D]
    depth = path.shape[1]
    last_tok = state.seq.gather(1, (state.seq_len - 1)[:, None])  # [B, 1]
    tokens = torch.cat([last_tok, proposal.tokens], dim=1).gather(1, path)  # [B, D]
    tokens = torch.cat([tokens, torch.zeros_like(last_tok)], dim=1)  # [B, D+1]
    last_accepted = tokens.gather(1, (accepted - 1).clamp(min=0)[:, None])[:, 0]
    ended_on_eos = (accepted > 0) & torch.isin(last_accepted, eos)  # nothing follows EOS
    emitted = accepted + 1 - ended_on_eos.long()  # [B]
    tokens[rows, accepted] = torch.where(ended_on_eos, tokens[rows, accepted], verdict.next)

    write_at = state.seq_len[:, None] + torch.arange(depth + 1, device=device)
    state.seq.scatter_(1, write_at, tokens)
    positions = (state.seq_len - 1)[:, None] + torch.arange(depth + 1, device=device)
    if proposal.is_chain:  # the accepted drafts already follow the root in the cache
        aux = aux_hidden
    else:
        kept = torch.cat([torch.zeros_like(last_tok), path], dim=1)  # [B, D+1] tree rows
        target.keep_cache_slots(state.cache, start, kept)
        aux = aux_hidden.gather(1, kept[..., None].expand(-1, -1, aux_hidden.shape[-1]))
    state.seq_len += emitted
    state.n_gen += emitted
    # Valid target slots: the previous last token plus the accepted drafts.
    state.t_valid = torch.cat([state.t_valid, valid_upto(depth + 1, accepted, device)], dim=1)
    state.t_valid = trim_slots(state.t_valid, state.cache, crop=target.crop_cache)
    width = int(emitted.max())
    committed = CommittedRows(
        ids=tokens[:, :width],
        aux=aux[:, :width],
        positions=positions[:, :width],
        valid=torch.arange(width, device=device)[None] < emitted[:, None],
    )
    return committed, tokens, emitted


# ---------------------------------------------------------------------------- sampling


def _sample_target(logits: Tensor, temperature: float, gen: torch.Generator) -> Tensor:
    """[B, V] fp32 logits -> [B] token: argmax at T=0, else a sample of softmax(logits / T)."""
    if temperature == 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits / temperature, dim=-1)
    return torch.multinomial(probs, 1, generator=gen)[:, 0]


# ---------------------------------------------------------------------------- checks


def _check_config(shape: Shape, temperature: float, max_new_tokens: int) -> None:
    if isinstance(shape, TreeShape):
        check_tree(shape.depth, shape.top_k, shape.budget)
        if not 0 <= shape.min_confidence < 1:
            raise ValueError(
                f"tree min_confidence must lie in [0, 1), got {shape.min_confidence!r}"
            )
    elif not isinstance(shape.k, int) or isinstance(shape.k, bool) or shape.k <= 0:
        raise ValueError(f"k (drafted tokens per step) must be a positive int, got {shape.k!r}")
    elif not 0 <= shape.stop_confidence < 1:
        raise ValueError(
            f"stop_confidence must lie in [0, 1) (0 = never stop), got {shape.stop_confidence!r}"
        )
    if (
        not (isinstance(temperature, (int, float)) and math.isfinite(temperature))
        or temperature < 0
    ):
        raise ValueError(
            f"temperature must be a finite number >= 0 (0 = greedy), got {temperature!r}"
        )
    if not isinstance(max_new_tokens, int) or max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")


def check_tree(depth: int, top_k: int, budget: int) -> None:
    """A tree's own constraints; one-line ValueErrors that name the fix."""
    for name, value in (("depth", depth), ("top_k", top_k), ("budget", budget)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"tree {name} must be an int >= 1, got {value!r}")
    if budget < depth:
        raise ValueError(
            f"tree budget ({budget}) is smaller than its depth ({depth}): a tree of that budget "
            f"can never reach depth {depth}; raise the budget or lower the depth"
        )
    most = top_k + (depth - 1) * top_k * top_k
    if budget > most:
        raise ValueError(
            f"tree budget ({budget}) exceeds the {most} candidates depth {depth} x top-k {top_k} "
            "drafts; lower the budget or raise top_k"
        )


def check_tree_fits(target: Target, longest_prompt: int, max_new_tokens: int, budget: int) -> None:
    """A verify step holds the committed tokens plus `budget` + 1 tree tokens; refuse a setting
    that would run past the target's context (max_position_embeddings)."""
    context = getattr(target.config, "max_position_embeddings", None)
    need = longest_prompt + max_new_tokens + budget + 1
    if context is not None and need > context:
        raise ValueError(
            f"tree budget {budget}: the longest prompt ({longest_prompt}) + max_new_tokens "
            f"({max_new_tokens}) + budget + 1 = {need} tokens exceed the target's context of "
            f"{context}; lower the tree budget or max_new_tokens"
        )


def _check_prompts(prompts: list[list[int]], vocab_size: int) -> None:
    if not prompts:
        raise ValueError("no prompts given")
    for i, prompt in enumerate(prompts):
        if len(prompt) == 0:
            raise ValueError(f"prompt {i} is empty; every prompt needs at least one token")
        if min(prompt) < 0 or max(prompt) >= vocab_size:
            raise ValueError(f"prompt {i} has token ids outside the target vocab [0, {vocab_size})")


def _eos_tensor(target: Target, eos_token_ids: tuple[int, ...] | None) -> Tensor:
    ids = target.eos_token_ids if eos_token_ids is None else tuple(eos_token_ids)
    return torch.tensor(ids, dtype=torch.long, device=target.device)


# ---------------------------------------------------------------------------- results


class _ForwardTimer:
    """Wall time inside model forwards, to measure the decoder's own overhead."""

    def __init__(self) -> None:
        self.seconds = {"drafter": 0.0, "target": 0.0}
        self._sync = torch.cuda.synchronize if torch.cuda.is_available() else lambda: None

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        self._sync()
        start = time.perf_counter()
        yield
        self._sync()
        self.seconds[name] += time.perf_counter() - start


def _step_log(
    state: _Batch, step: int, budget: Tensor, proposal: Proposal, verdict: _Verdict
) -> dict[str, Tensor]:
    """One verify step's log entry; `_commit` adds what it wrote (path_tokens, emitted)."""
    n = proposal.tokens.shape[1]
    if proposal.is_chain:
        node_depth = torch.arange(1, n + 1, device=budget.device).expand(len(budget), -1)
        parent = node_depth - 1
    else:
        node_depth, parent = proposal.depth, proposal.parent
    return dict(
        sequence=state.row_ids,
        step=torch.full_like(state.row_ids, step),
        anchor=state.seq_len.clone(),
        drafted=verdict.usable.sum(1),
        accepted=verdict.accepted,
        reach=verdict.reach,
        depth=budget,
        verdict=verdict,
        tokens=proposal.tokens,
        parent=parent,
        node_depth=node_depth,
        q=proposal.q,
        confidence=proposal.confidence,
    )


def _padded(logged: list[dict[str, Any]]) -> dict[str, Tensor]:
    """The steps' rows as one [R] or [R, N_max] tensor per column (nodes right-padded)."""
    width = max(s["tokens"].shape[1] for s in logged)
    merged: dict[str, list[Tensor]] = {}
    for s in logged:
        v = s["verdict"]
        node_depth = s["node_depth"]
        emitted_at = s["path_tokens"].gather(1, (node_depth - 1).clamp(min=0))  # [B, N]
        cols = dict(
            emitted=s["emitted"],
            tokens=s["tokens"],
            parent=s["parent"],
            node_depth=node_depth,
            usable=v.usable.long(),
            q=s["q"],
            p=v.p,
            accept_prob=v.accept_prob,
            outcome=v.outcome,
            target_token=torch.where(v.outcome < 2, emitted_at, -1),
            confidence=s["confidence"],
        )
        row = {
            k: s[k] for k in ("sequence", "step", "anchor", "drafted", "accepted", "reach", "depth")
        }
        for name, value in cols.items():
            if value.dim() == 2:
                value = F.pad(value, (0, width - value.shape[1]))
            row[name] = value
        if "teacher" in s:
            row["teacher"] = F.pad(s["teacher"], (0, 0, 0, width - s["teacher"].shape[1]))
        for name, value in row.items():
            merged.setdefault(name, []).append(value)
    return {name: torch.cat(parts) for name, parts in merged.items()}


def _records(logged: dict[str, Tensor], tree: bool) -> dict[str, list]:
    """One row per node within its row's budget, from the padded [R, N] blocks."""
    columns = TREE_RECORD_COLUMNS if tree else RECORD_COLUMNS
    if not logged:
        return {name: [] for name in columns}
    width = logged["tokens"].shape[1]
    keep = logged["usable"].bool()
    table = {
        **{n: logged[n][:, None].expand(-1, width) for n in ("sequence", "step", "anchor")},
        "node": torch.arange(1, width + 1, device=keep.device).expand(len(keep), -1),
        "parent": logged["parent"],
        "offset": logged["node_depth"],
        "token": logged["tokens"],
        **{n: logged[n] for n in ("q", "p", "accept_prob", "outcome", "target_token")},
        "confidence": logged["confidence"],
    }
    out = {name: table[name][keep].tolist() for name in columns}
    out["outcome"] = [OUTCOMES[v] for v in out["outcome"]]
    return out


def depth_alpha(accepted: Tensor, reach: Tensor, max_depth: int) -> list[float]:
    """alpha[d-1] = P(accepted >= d | accepted >= d-1, the row could reach depth d)."""
    out = []
    for d in range(1, max_depth + 1):
        reached = (accepted >= d - 1) & (reach >= d)
        n = int(reached.sum())
        out.append(float((accepted[reached] >= d).float().mean()) if n else float("nan"))
    return out


def _stats(
    logged: dict[str, Tensor], shape: Shape, counts: dict[str, int], timer: _ForwardTimer
) -> dict[str, Any]:
    """tau = mean(accepted + 1) over (sequence, verify step) pairs, the EAGLE / vLLM way;
    target_forwards_per_token = those verify steps / tokens they emitted (1/tau unless a path
    ended on an accepted EOS); alpha[d-1] = accepted / reached at depth d (n-alpha; a chain's
    reach ends at its block, a tree's at its depth budget); tree_nodes: mean nodes verified."""
    n_steps = len(logged["accepted"]) if logged else 0
    emitted = int(logged["emitted"].sum()) if logged else 0
    stats: dict[str, Any] = {
        "verify_steps": n_steps,
        "tau": float((logged["accepted"] + 1).float().mean()) if n_steps else float("nan"),
        "verify_tokens": emitted,
        "target_forwards_per_token": n_steps / emitted if n_steps else float("nan"),
        "prefill_forwards": 1,
        "verify_forwards": counts["verify"],  # batched target calls after the prefill
        "target_forwards": 1 + counts["verify"],
        "drafter_forwards": counts["drafter"],
        "target_forward_seconds": timer.seconds["target"],
        "drafter_forward_seconds": timer.seconds["drafter"],
    }
    if n_steps:
        stats["alpha"] = depth_alpha(logged["accepted"], logged["reach"], shape.depth)
        if isinstance(shape, TreeShape):
            stats["tree_nodes"] = float(logged["drafted"].float().mean())
    return stats


def _result(
    state: _Batch,
    logged: list[dict[str, Any]],
    cfg: SpecConfig,
    counts: dict[str, int],
    timer: _ForwardTimer,
) -> SpecResult:
    tree = isinstance(cfg.shape, TreeShape)
    merged = _padded(logged) if logged else {}
    step_columns = TREE_STEP_COLUMNS if tree else STEP_COLUMNS
    return SpecResult(
        sequences=state.results,
        finish_reasons=state.finish_reasons,
        records=_records(merged, tree),
        steps={name: merged[name].tolist() if logged else [] for name in step_columns},
        stats=_stats(merged, cfg.shape, counts, timer),
        teacher=merged.get("teacher") if cfg.keep_teacher else None,
    )
