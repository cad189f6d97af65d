"""Lossless speculative decoding on EAGLE-2 dynamic draft trees, batched, with a per-node log.

One round per active sequence (all rows of the batch advance together):
  1. draft a tree (EAGLE-2): the drafter's pass over the newly committed rows yields the root's
     distribution; its top-k tokens are depth 1. Each further depth runs the k most confident
     nodes of the previous depth as ONE drafter forward (each sees the committed rows, its own
     ancestors and itself) and keeps the top-k children of each, k*k candidates. A node's
     confidence is the product of the drafter's probabilities along its path (log-probs at
     T=1: the shape does not depend on the temperature). The `budget` most confident of all
     candidates become the tree; a child is never more confident than its parent, so the
     selection is closed under ancestors. Drafter forwards per step: `depth`, as a chain of K.
  2. the target verifies [last committed token, the budget nodes] in ONE forward whose mask
     lets each node see the committed slots, its ancestors and itself, at position
     last + depth(node).
  3. accept along the tree from the root. At a reached node with target distribution p (at the
     temperature; one-hot argmax at T=0), its children are tried in confidence order, each as
     a point-mass proposal: child x is accepted with probability r(x), r the residual (r = p at
     the first child); on rejection r <- r with x removed, renormalised. The first accepted
     child is descended into; when none is, the emitted token is a sample of r (of p when the
     node has no children: the bonus token). Whatever the tree, the emitted token's law is p
     (rejection sampling with proposal delta_x has residual norm(max(p - delta_x, 0)), which
     is r with x removed), so the output has the target's distribution; at T=0 the accepted
     child is exactly the one equal to argmax p, so the output is greedy decoding. The walk
     stops after an accepted EOS (nothing follows EOS) and at the row's depth budget
     (min(depth, remaining - 1) near `max_new_tokens`).

Only the root and the accepted path are read again, so both the target's and the drafter's
caches keep only those slots (the target's are packed in place, the drafter's tree keys are
dropped and the next round recomputes the committed rows as the chain decoder does).

Log: one record per node (see `TREE_RECORD_COLUMNS`): accepted = on the accepted path,
rejected = tried and rejected (a sibling tried before the accepted child, or every child of
the node where the path ended), not_reached = never tried. Sequence positions: a node at depth
d sits at anchor + d - 1, as offset d of a chain.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from models.drafter import DrafterCache, Eagle3Drafter
from models.speculative import (
    OUTCOMES,
    STEP_COLUMNS,
    SpecResult,
    _check_config,
    _check_drafter,
    _check_prompts,
    _eos_tensor,
    _extend_mask,
    _ForwardTimer,
    _prefill,
    _select_drafter_rows,
    _trim_slots,
    _valid_upto,
)
from models.target import Target

TREE_RECORD_COLUMNS = (
    "sequence",
    "step",
    "anchor",
    "node",  # 1-based index in the step's tree; nodes come in depth order, parents first
    "parent",  # the parent's node index, 0 = the root (the last committed token)
    "offset",  # the node's depth: its sequence position is anchor + offset - 1
    "token",
    "q",  # drafter probability of the token at its parent, at the temperature (1 at T=0)
    "p",  # target probability of the token at its parent, at the temperature (one-hot at T=0)
    "accept_prob",  # the residual's mass on it when tried; p when never tried
    "outcome",
    "target_token",  # what the target emitted at its position; -1 if never tried
    "confidence",  # max_v q_v of the drafter at its parent (q at the temperature, or T=1)
)
TREE_STEP_COLUMNS = (*STEP_COLUMNS, "depth")  # depth: the row's depth budget that step


@dataclass(frozen=True)
class TreeConfig:
    """Tree decoding settings (see the module docstring). `eos_token_ids` as in SpecConfig."""

    depth: int
    top_k: int
    budget: int
    min_confidence: float = 0.0
    """Stop expanding once no frontier node's joint drafter probability reaches it (0: always
    `depth` levels, as EAGLE-2); saves drafter forwards the verifier would rarely accept."""
    temperature: float = 0.0
    max_new_tokens: int = 64
    seed: int = 0
    eos_token_ids: tuple[int, ...] | None = None


def check_tree(depth: int, top_k: int, budget: int) -> None:
    """The tree's own constraints; one-line ValueErrors that name the fix."""
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


@dataclass
class _Tree:
    """One step's trees, [B, N] per node (N = tree size), nodes in depth order, parents first."""

    tokens: Tensor  # [B, N] target ids
    parent: Tensor  # [B, N] parent's node index, 0 = root (nodes are 1..N)
    depth: Tensor  # [B, N] 1-based
    q: Tensor  # [B, N] draft probability at the temperature (1 at T=0)
    confidence: Tensor  # [B, N] max draft probability at the parent
    levels: int  # drafter forwards spent: the committed rows' pass, then one per expanded depth


# ---------------------------------------------------------------------------- entry point


@torch.no_grad()
def tree_generate(
    target: Target, drafter: Eagle3Drafter, prompts: list[list[int]], cfg: TreeConfig
) -> SpecResult:
    """Speculative decoding of `prompts` on dynamic draft trees (see the module docstring)."""
    # Long on purpose, like `speculative_generate`: the draft -> verify -> accept -> commit loop
    # shares the batch state every phase updates; the phases are marked and read top to bottom.
    check_tree(cfg.depth, cfg.top_k, cfg.budget)
    if not 0 <= cfg.min_confidence < 1:
        raise ValueError(f"tree min_confidence must lie in [0, 1), got {cfg.min_confidence!r}")
    _check_config(cfg.depth, cfg.temperature, cfg.max_new_tokens)
    _check_prompts(prompts, target.vocab_size)
    check_tree_fits(target, max(map(len, prompts)), cfg.max_new_tokens, cfg.budget)
    _check_drafter(target, drafter)
    if cfg.top_k > drafter.config.draft_vocab_size:
        raise ValueError(
            f"tree top_k ({cfg.top_k}) exceeds the draft vocab ({drafter.config.draft_vocab_size})"
        )
    device = target.device
    gen = torch.Generator(device=device).manual_seed(cfg.seed)
    eos = _eos_tensor(target, cfg.eos_token_ids)
    timer = _ForwardTimer()
    state, prefill_aux = _prefill(
        target, prompts, cfg.max_new_tokens + cfg.depth + 1, cfg.temperature, gen, timer
    )
    logged: list[dict[str, Tensor]] = []
    dcache = DrafterCache()
    d_valid = torch.zeros(state.batch, 0, dtype=torch.bool, device=device)
    pend_aux, pend_valid = prefill_aux, state.t_valid.clone()
    pend_ids = state.seq[:, 1 : pend_valid.shape[1] + 1]
    pend_pos = torch.arange(pend_valid.shape[1], device=device).expand_as(pend_valid)
    counts = {"verify": 0, "drafter": 0}

    step = 0
    while True:
        keep = state.retire(cfg.max_new_tokens, eos)
        if keep is None:
            break
        if keep.numel() < len(pend_ids):
            _select_drafter_rows(dcache, keep)
            d_valid, pend_ids, pend_aux = d_valid[keep], pend_ids[keep], pend_aux[keep]
            pend_pos, pend_valid = pend_pos[keep], pend_valid[keep]
            d_valid = _trim_slots(d_valid, dcache)
        row_depth = (cfg.max_new_tokens - state.n_gen - 1).clamp(max=cfg.depth)  # [B]
        depth = int(row_depth.max())
        batch = state.batch
        rows = torch.arange(batch, device=device)

        # 1. draft the tree ---------------------------------------------------------------
        if depth > 0:
            with timer("drafter"):
                hidden = drafter.fuse(pend_aux)  # [B, Tp, H]
                logits, hidden_out = drafter(
                    pend_ids,
                    hidden,
                    pend_pos,
                    attention_mask=_extend_mask(d_valid, pend_valid),
                    cache=dcache,
                )
            d_valid = torch.cat([d_valid, pend_valid], dim=1)
            last = pend_valid.sum(1) - 1  # [B]
            tree = _draft_tree(
                drafter,
                dcache,
                d_valid,
                logits[rows, last],  # [B, Vd]
                hidden_out[rows, last][:, None],  # [B, 1, H]
                pend_pos[rows, last][:, None],  # [B, 1]
                depth,
                cfg,
                timer,
            )
            counts["drafter"] += tree.levels
        else:
            empty = torch.zeros(batch, 0, device=device)
            tree = _Tree(empty.long(), empty.long(), empty.long(), empty, empty, levels=0)
        size = tree.tokens.shape[1]

        # 2. verify the whole tree in one forward ----------------------------------------
        last_tok = state.seq.gather(1, (state.seq_len - 1)[:, None])  # [B, 1]
        parent = torch.cat([torch.zeros_like(last_tok), tree.parent], dim=1)  # [B, 1+N]
        node_depth = torch.cat([torch.zeros_like(last_tok), tree.depth], dim=1)  # [B, 1+N]
        verify_pos = (state.seq_len - 1)[:, None] + node_depth
        start = target.cache_length(state.cache)
        ancestors = _ancestors(parent, depth)  # [B, 1+N, 1+N]
        with timer("target"):
            out = target.forward(
                torch.cat([last_tok, tree.tokens], dim=1),
                position_ids=verify_pos,
                attention_mask=torch.cat(
                    [
                        state.t_valid[:, None].expand(-1, size + 1, -1),
                        ancestors,
                    ],
                    dim=2,
                ),  # [B, 1+N, S+1+N]
                cache=state.cache,
            )
        counts["verify"] += 1

        # 3. accept along the tree ---------------------------------------------------------
        usable = (node_depth <= row_depth[:, None]) & (node_depth > 0)  # [B, 1+N]
        if cfg.temperature == 0:
            walk = _walk_greedy(out.logits, tree, parent, usable, ancestors, depth, eos)
        else:
            walk = _walk(out.logits, tree, parent, usable, depth, eos, cfg.temperature, gen)
        accepted, path = walk["accepted"], walk["path"]  # [B], [B, depth] node indices
        tok_all = torch.cat([last_tok, tree.tokens], dim=1)  # [B, 1+N]
        path_tok = tok_all.gather(1, path)  # [B, depth]
        tokens = torch.cat([path_tok, torch.zeros_like(last_tok)], dim=1)  # [B, depth+1]
        last_accepted = tokens.gather(1, (accepted - 1).clamp(min=0)[:, None])[:, 0]
        ended_on_eos = (accepted > 0) & torch.isin(last_accepted, eos)
        emitted = accepted + 1 - ended_on_eos.long()
        tokens[rows, accepted] = torch.where(ended_on_eos, tokens[rows, accepted], walk["next"])

        # 4. log ---------------------------------------------------------------------------
        pad = cfg.budget - size
        node_target = tokens.gather(1, (node_depth[:, 1:] - 1).clamp(min=0))  # [B, N]
        logged.append(
            dict(
                sequence=state.row_ids,
                step=torch.full_like(state.row_ids, step),
                anchor=state.seq_len.clone(),
                drafted=usable.sum(1),
                accepted=accepted,
                emitted=emitted,
                depth=row_depth,
                **{
                    name: F.pad(value, (0, pad))
                    for name, value in dict(
                        tokens=tree.tokens,
                        parent=tree.parent,
                        node_depth=tree.depth,
                        usable=usable[:, 1:].long(),
                        q=tree.q,
                        p=walk["p"][:, 1:],
                        accept_prob=walk["accept_prob"][:, 1:],
                        outcome=walk["outcome"][:, 1:],
                        target_token=node_target,
                        confidence=tree.confidence,
                    ).items()
                },
            )
        )

        # 5. commit: keep the root and the accepted path in both caches --------------------
        write_at = state.seq_len[:, None] + torch.arange(depth + 1, device=device)
        state.seq.scatter_(1, write_at, tokens)
        kept = torch.cat([torch.zeros_like(last_tok), path], dim=1)  # [B, depth+1] tree rows
        target.keep_cache_slots(state.cache, start, kept)
        pend_aux = out.aux_hidden.gather(
            1, kept[..., None].expand(-1, -1, out.aux_hidden.shape[-1])
        )  # [B, depth+1, 3H]
        pend_pos = (state.seq_len - 1)[:, None] + torch.arange(depth + 1, device=device)
        state.seq_len += emitted
        state.n_gen += emitted
        state.t_valid = torch.cat([state.t_valid, _valid_upto(depth + 1, accepted, device)], 1)
        width = int(emitted.max())
        pend_ids, pend_aux, pend_pos = tokens[:, :width], pend_aux[:, :width], pend_pos[:, :width]
        pend_valid = torch.arange(width, device=device)[None] < emitted[:, None]
        state.t_valid = _trim_slots(state.t_valid, state.cache, crop=target.crop_cache)
        step += 1

    merged = {name: torch.cat([s[name] for s in logged]) for name in logged[0]} if logged else {}
    return SpecResult(
        sequences=state.results,
        finish_reasons=state.finish_reasons,
        records=_tree_records(merged),
        steps={name: merged[name].tolist() if logged else [] for name in TREE_STEP_COLUMNS},
        stats=_tree_stats(merged, cfg, counts, timer),
    )


# ---------------------------------------------------------------------------- drafting


def _draft_tree(
    drafter: Eagle3Drafter,
    cache: DrafterCache,
    valid: Tensor,
    root_logits: Tensor,
    root_hidden: Tensor,
    root_pos: Tensor,
    depth: int,
    cfg: TreeConfig,
    timer: _ForwardTimer,
) -> _Tree:
    """EAGLE-2 expansion and reranking (module docstring, step 1); leaves `cache` as it found it.

    valid [B, S] committed drafter slots, root_logits [B, Vd], root_hidden [B, 1, H],
    root_pos [B, 1] (the last committed row's position).
    """
    k, batch = cfg.top_k, len(root_logits)
    device = root_logits.device
    committed = cache.length
    to_target = drafter.vocab.draft_to_target_ids.to(device)
    score, ids, q, conf = _expand(root_logits[:, None], cfg.temperature, k)  # [B, 1, k] each
    # candidate lists, [B, M] once concatenated: joint log-confidence, target id, parent
    # candidate index (-1 = root), depth, q, confidence at the parent
    cands = dict(
        score=[score[:, 0]],
        token=[to_target[ids[:, 0]]],
        parent=[torch.full((batch, k), -1, device=device)],
        depth=[torch.ones(batch, k, dtype=torch.long, device=device)],
        q=[q[:, 0]],
        conf=[conf[:, 0].expand(-1, k)],
    )
    front = torch.arange(k, device=device).expand(batch, -1)  # [B, k] candidate indices
    front_score, front_tok = score[:, 0], to_target[ids[:, 0]]  # [B, k]
    front_hidden = root_hidden.expand(-1, k, -1)  # [B, k, H]
    front_anc = torch.zeros(batch, k, 0, dtype=torch.bool, device=device)  # [B, k, tree keys]
    eye = torch.eye(k, dtype=torch.bool, device=device)
    n_cands = k
    floor = math.log(cfg.min_confidence) if cfg.min_confidence > 0 else -math.inf
    levels = 1
    for d in range(2, depth + 1):
        if float(front_score.max()) < floor:  # no frontier path is likely enough to go deeper
            break
        levels = d
        mask = torch.cat(
            [valid[:, None].expand(-1, k, -1), front_anc, eye.expand(batch, -1, -1)], dim=2
        )  # [B, k, S + (d-2)k + k]
        with timer("drafter"):
            logits, hidden = drafter(
                front_tok,
                front_hidden,
                (root_pos + d - 1).expand(-1, k),
                attention_mask=mask,
                cache=cache,
            )  # [B, k, Vd], [B, k, H]
        score, ids, q, conf = _expand(logits, cfg.temperature, k)  # [B, k, k]
        score = (front_score[..., None] + score).reshape(batch, k * k)
        token = to_target[ids].reshape(batch, k * k)
        cands["score"].append(score)
        cands["token"].append(token)
        cands["parent"].append(front[..., None].expand(-1, -1, k).reshape(batch, k * k))
        cands["depth"].append(torch.full((batch, k * k), d, device=device))
        cands["q"].append(q.reshape(batch, k * k))
        cands["conf"].append(conf.expand(-1, -1, k).reshape(batch, k * k))
        if d < depth:
            pick = score.topk(k, dim=1).indices  # [B, k] among this depth's k*k
            src = pick // k  # [B, k] the frontier row that proposed it
            front = n_cands + pick
            front_score, front_tok = score.gather(1, pick), token.gather(1, pick)
            front_hidden = hidden.gather(1, src[..., None].expand(-1, -1, hidden.shape[-1]))
            anc = torch.cat([front_anc, eye.expand(batch, -1, -1)], dim=2)
            front_anc = anc.gather(1, src[..., None].expand(-1, -1, anc.shape[-1]))
        n_cands += k * k
    cache.crop(committed)  # tree keys were speculative; the next round recomputes

    cat = {name: torch.cat(parts, dim=1) for name, parts in cands.items()}  # [B, M]
    # Stable: a child ties its parent only when q = 1, and the parent comes first in the list.
    size = min(cfg.budget, n_cands)
    order = cat["score"].sort(dim=1, descending=True, stable=True).indices[:, :size]
    chosen = order.sort(dim=1).values  # [B, N] candidate indices, parents before children
    slot = torch.full_like(cat["parent"], -1).scatter_(
        1, chosen, torch.arange(1, size + 1, device=device).expand(batch, -1)
    )  # [B, M] candidate -> node index (1-based), -1 if not in the tree
    cand_parent = cat["parent"].gather(1, chosen)
    parent = torch.where(cand_parent >= 0, slot.gather(1, cand_parent.clamp(min=0)), 0)
    return _Tree(
        tokens=cat["token"].gather(1, chosen),
        parent=parent,
        depth=cat["depth"].gather(1, chosen),
        q=cat["q"].gather(1, chosen),
        confidence=cat["conf"].gather(1, chosen),
        levels=levels,
    )


def _expand(logits: Tensor, temperature: float, k: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Drafter logits [B, F, Vd] -> the top-k children of each of F nodes: (log-confidence at
    T=1, draft ids, q at the temperature (1 at T=0), max_v q_v [B, F, 1]), each [B, F, k]."""
    logp = torch.log_softmax(logits, dim=-1)
    score, ids = logp.topk(k, dim=-1)
    if temperature == 0:
        return score, ids, torch.ones_like(score), logp.amax(-1, keepdim=True).exp()
    q = torch.softmax(logits / temperature, dim=-1)
    return score, ids, q.gather(-1, ids), q.amax(-1, keepdim=True)


def _ancestors(parent: Tensor, depth: int) -> Tensor:
    """parent [B, 1+N] (the root is its own parent) -> bool [B, 1+N, 1+N]: j is i or an ancestor."""
    width = parent.shape[1]
    anc = torch.eye(width, dtype=torch.bool, device=parent.device).expand(len(parent), -1, -1)
    up = parent[..., None].expand(-1, -1, width)
    for _ in range(depth):
        anc = anc | anc.gather(1, up)
    return anc


# ---------------------------------------------------------------------------- acceptance


def _walk_greedy(
    logits: Tensor,
    tree: _Tree,
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

    ancestors [B, 1+N, 1+N] (see `_ancestors`); the rest as `_walk`.
    """
    batch, width = parent.shape
    rows = torch.arange(batch, device=logits.device)
    index = torch.arange(width, device=logits.device)
    tokens = torch.cat([torch.zeros_like(parent[:, :1]), tree.tokens], dim=1)  # [B, 1+N]
    greedy = logits.argmax(-1)  # [B, 1+N]
    p_node = (tokens == greedy.gather(1, parent)).float()  # [B, 1+N]
    good = (p_node > 0) & usable
    good[:, 0] = True  # the root is committed
    stops = torch.isin(tokens, eos) & usable  # an accepted EOS ends the path below it
    strict = ancestors & (index[:, None] != index)  # [B, 1+N, 1+N]: strict ancestors
    on_path = ~(strict & (~good | stops)[:, None, :]).any(-1) & good  # [B, 1+N]
    on_path[:, 0] = False
    accepted = on_path.sum(1)  # [B]
    node_depth = torch.cat([torch.zeros_like(parent[:, :1]), tree.depth], dim=1)
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
    tree: _Tree,
    parent: Tensor,
    usable: Tensor,
    depth: int,
    eos: Tensor,
    temperature: float,
    gen: torch.Generator,
) -> dict[str, Tensor]:
    """Accept along the tree at T > 0 (module docstring, step 3), one depth at a time.

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
    tokens = torch.cat([torch.zeros_like(parent[:, :1]), tree.tokens], dim=1)  # [B, 1+N]
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


# ---------------------------------------------------------------------------- results


def _tree_records(logged: dict[str, Tensor]) -> dict[str, list]:
    """One row per tree node within its row's depth budget, from the padded [R, budget] blocks."""
    if not logged:
        return {name: [] for name in TREE_RECORD_COLUMNS}
    width = logged["tokens"].shape[1]
    keep = logged["usable"].bool()
    node = torch.arange(1, width + 1, device=keep.device).expand(len(keep), -1)
    outcome = logged["outcome"]
    columns = {
        **{n: logged[n][:, None].expand(-1, width) for n in ("sequence", "step", "anchor")},
        "node": node,
        "parent": logged["parent"],
        "offset": logged["node_depth"],
        "token": logged["tokens"],
        "q": logged["q"],
        "p": logged["p"],
        "accept_prob": logged["accept_prob"],
        "outcome": outcome,
        "target_token": torch.where(outcome < 2, logged["target_token"], -1),
        "confidence": logged["confidence"],
    }
    out = {name: columns[name][keep].tolist() for name in TREE_RECORD_COLUMNS}
    out["outcome"] = [OUTCOMES[v] for v in out["outcome"]]
    return out


def depth_alpha(accepted: Tensor, depth: Tensor, max_depth: int) -> list[float]:
    """alpha[d-1] = P(accepted >= d | accepted >= d-1, the row could reach depth d)."""
    out = []
    for d in range(1, max_depth + 1):
        reached = (accepted >= d - 1) & (depth >= d)
        n = int(reached.sum())
        out.append(float((accepted[reached] >= d).float().mean()) if n else float("nan"))
    return out


def _tree_stats(
    logged: dict[str, Tensor], cfg: TreeConfig, counts: dict[str, int], timer: _ForwardTimer
) -> dict[str, Any]:
    """As `speculative._stats`; alpha per depth (`depth_alpha`); tree_nodes: mean tree size."""
    n_steps = len(logged["accepted"]) if logged else 0
    emitted = int(logged["emitted"].sum()) if logged else 0
    stats: dict[str, Any] = {
        "verify_steps": n_steps,
        "tau": float((logged["accepted"] + 1).float().mean()) if n_steps else float("nan"),
        "verify_tokens": emitted,
        "target_forwards_per_token": n_steps / emitted if n_steps else float("nan"),
        "prefill_forwards": 1,
        "verify_forwards": counts["verify"],
        "target_forwards": 1 + counts["verify"],
        "drafter_forwards": counts["drafter"],
        "target_forward_seconds": timer.seconds["target"],
        "drafter_forward_seconds": timer.seconds["drafter"],
    }
    if n_steps:
        stats["alpha"] = depth_alpha(logged["accepted"], logged["depth"], cfg.depth)
        stats["tree_nodes"] = float(logged["drafted"].float().mean())
    return stats
