"""Lossless speculative decoding: ONE loop for every drafter kind and proposal shape, batched,
with a per-draft log.

One round per active sequence (all rows of the batch advance together):
  1. propose: the drafter's proposer reads the rows committed since the last round and drafts
     a chain (or a block, drafted in one forward: a chain to the loop) or a tree
     (`models.drafter.Proposal`), within each row's depth budget;
  2. verify: the target runs [last committed token, the drafted nodes] in ONE forward whose mask
     lets each node see the committed slots, its ancestors and itself (a chain's ancestors are
     the drafts before it), at position last + depth(node);
  3. accept, losslessly, from the root down (models/verify.py: Leviathan's test on a chain,
     point-mass sibling tests on a tree; the token after the accepted path is a correction or
     the bonus token, so every emitted token has the law p, and at T=0 the output is the
     target's greedy decoding). A path ends after an accepted EOS (nothing follows EOS) and at
     the row's depth budget, min(depth, remaining - 1) near `max_new_tokens`, so a verify step
     never emits past the budget;
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

import dataclasses
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
    Drafter,
    Proposal,
    Shape,
    TreeShape,
    confident_length,
    truncated,
)
from models.features import Features
from models.kv import extend_mask, trim_slots, valid_upto
from models.target import Target
from models.verify import Typical, Verdict, accept, ancestors, sample_target

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
    typical: Typical | None = None
    """Medusa's typical acceptance instead of the lossless rule at T>0 (LOSSY: the output no
    longer has the target's law; models/verify.py). Then every step's token after the accepted
    path, and the prefill's first token, is the target's argmax, as Medusa emits them. The
    result's stats say `acceptance: typical, lossless: false`."""
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
    first_temperature = 0.0 if cfg.typical is not None else cfg.temperature
    state, rows = _prefill(
        target, prompts, cfg.max_new_tokens + cfg.shape.depth + 1, first_temperature, gen, timer
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
        if chain and proposal.lengths is not None:  # rows that drafted fewer (a lookup)
            budget = torch.minimum(budget, proposal.lengths)
            proposal = truncated(proposal, budget)
        if chain and cfg.shape.stop_confidence > 0:
            budget = torch.minimum(budget, _confident(proposal, cfg.shape.stop_confidence))
            proposal = truncated(proposal, budget)
        depth = proposal.tokens.shape[1] if chain else int(budget.max())
        out, start = _verify(target, state, proposal, depth, timer)
        counts["verify"] += 1
        verdict = accept(
            proposal, out.logits, budget, depth, eos, cfg.temperature, gen, cfg.typical
        )
        entry = _step_log(state, len(logged), budget, proposal, verdict)
        if cfg.keep_teacher:  # input 0 is the last committed token: it predicts draft 1
            in_block = verdict.usable[..., None]  # [B, K, 1]: past a row's block, no teacher
            teacher = torch.where(in_block, out.last_hidden[:, :depth], 0.0)
            entry["teacher"] = teacher.to(torch.bfloat16).cpu()  # [B, K, H]
        rows, entry["path_tokens"], entry["emitted"] = _commit(
            target, state, proposal, verdict, out, start, eos
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
        token = sample_target(out.logits[:, -1], temperature, gen)
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
) -> tuple[_Batch, Features]:
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
    rows = torch.arange(len(prompts), device=device)
    with timer("target"):
        aux, last = target.forward_features(
            seq[:, :width], position_ids=positions, attention_mask=mask, cache=cache
        )
        # Only each prompt's last position is sampled from: the head there alone, not a
        # [B, P, V] fp32 tensor (4 GiB for 8 prompts of 1k tokens at a 128k vocabulary).
        logits = target.logits_from_hidden(last[rows, lengths - 1])
    first = sample_target(logits, temperature, gen)
    seq[rows, lengths] = first
    state = _Batch(seq, lengths + 1, lengths.clone(), cache, valid, target)
    # ids are a copy: later steps write into `seq` where short prompts end
    first_rows = Features(
        seq[:, 1 : width + 1].clone(), aux, last, positions, valid.clone(), seq[:, 0].clone()
    )
    return state, first_rows


# ---------------------------------------------------------------------------- verify, commit


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


def _commit(
    target: Target,
    state: _Batch,
    proposal: Proposal,
    verdict: Verdict,
    out: Any,
    start: int,
    eos: Tensor,
) -> tuple[Features, Tensor, Tensor]:
    """Write the path and the next token, keep the root and the path in the target's cache.
    Returns the committed rows for the drafter's next proposal, the tokens written [B, D+1]
    (the path, then the next token) and the tokens emitted per row [B]. `out` is the verify
    forward's output (aux_hidden [B, 1+N, F], last_hidden [B, 1+N, H])."""
    batch, device = state.batch, out.aux_hidden.device
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
    aux, last_hidden = out.aux_hidden, out.last_hidden
    if not proposal.is_chain:  # a chain's accepted drafts already follow the root in the cache
        kept = torch.cat([torch.zeros_like(last_tok), path], dim=1)  # [B, D+1] tree rows
        target.keep_cache_slots(state.cache, start, kept)
        aux, last_hidden = (
            t.gather(1, kept[..., None].expand(-1, -1, t.shape[-1])) for t in (aux, last_hidden)
        )
    state.seq_len += emitted
    state.n_gen += emitted
    # Valid target slots: the previous last token plus the accepted drafts.
    state.t_valid = torch.cat([state.t_valid, valid_upto(depth + 1, accepted, device)], dim=1)
    state.t_valid = trim_slots(state.t_valid, state.cache, crop=target.crop_cache)
    width = int(emitted.max())
    committed = Features(
        ids=tokens[:, :width],
        aux=aux[:, :width],
        last_hidden=last_hidden[:, :width],
        positions=positions[:, :width],
        valid=torch.arange(width, device=device)[None] < emitted[:, None],
    )
    return committed, tokens, emitted


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
    state: _Batch, step: int, budget: Tensor, proposal: Proposal, verdict: Verdict
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


def _acceptance(cfg: SpecConfig) -> dict[str, Any]:
    """Which rule accepted the drafts, and whether the output has the target's law."""
    if cfg.typical is None or cfg.temperature == 0:
        return {"acceptance": "lossless", "lossless": True}
    return {"acceptance": "typical", "lossless": False, **dataclasses.asdict(cfg.typical)}


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
        stats=_stats(merged, cfg.shape, counts, timer) | _acceptance(cfg),
        teacher=merged.get("teacher") if cfg.keep_teacher else None,
    )
