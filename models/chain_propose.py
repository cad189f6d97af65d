"""A chain network's drafts for the decoding loop (K-chains and EAGLE-2 dynamic trees) and its
replays (EAGLE-3, MTP: the `models.chain.ChainNetwork`s).

Every verify step starts with ONE drafter pass over the rows committed since the last step
(target features from the last verify forward, or from the prefill); its last row yields the
first draft distribution. Then:
  - chain: K-1 more forwards, each on the drafter's own hidden state and previous draft;
  - tree (EAGLE-2): the root's top-k tokens are depth 1; each further depth runs the k most
    confident nodes of the previous depth as ONE forward (each sees the committed rows, its own
    ancestors and itself) and keeps the top-k children of each, k*k candidates. A node's
    confidence is the product of the drafter's probabilities along its path (log-probs at T=1:
    the shape does not depend on the temperature). The `budget` most confident of all
    candidates become the tree; a child is never more confident than its parent, so the
    selection is closed under ancestors. `min_confidence` stops expanding once no frontier
    path reaches it.
The speculative keys of both are dropped again: the next step recomputes the committed rows.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from models.drafter import (
    ChainShape,
    Proposal,
    Replayed,
    Shape,
    TreeShape,
    confident_length,
)
from models.features import Features, replay_inputs
from models.kv import CachedRows, KVCache, extend_mask

if TYPE_CHECKING:
    from models.chain import ChainNetwork


class ChainProposer(CachedRows):
    """Chains or trees from a chain network, with the drafter's own KV cache."""

    def __init__(
        self,
        drafter: ChainNetwork,
        shape: Shape,
        temperature: float,
        generator: torch.Generator,
        timer: Any,
    ) -> None:
        self.drafter, self.shape = drafter, shape
        self.temperature, self.gen, self.timer = temperature, generator, timer
        super().__init__()
        self.to_target = drafter.vocab.draft_to_target_ids

    def propose(self, rows: Features, budget: Tensor) -> Proposal:
        if self.valid is None:
            self.valid = torch.zeros(len(rows.ids), 0, dtype=torch.bool, device=rows.ids.device)
            self.to_target = self.to_target.to(rows.ids.device)
        last = rows.valid.sum(1) - 1  # [B]
        batch = torch.arange(len(last), device=last.device)
        with self.timer("drafter"):
            hidden = self.drafter.start_hidden(self.drafter.read_features(rows))  # [B, W, H]
            mask = extend_mask(self.valid, rows.valid)  # [B, W, S+W]
            # Only each row's last position drafts: the head there alone, not [B, W, Vd] fp32
            # over a prompt's every position (4 GiB for 8 prompts of 1k tokens at a 128k head).
            logits, hidden_out = self.drafter.chain_step(
                0,
                rows.ids,
                hidden,
                rows.positions,
                attention_mask=mask,
                cache=self.cache,
                head_at=last,
            )  # [B, Vd], [B, W, H]
        self.valid = torch.cat([self.valid, rows.valid], dim=1)
        root = (
            logits,  # [B, Vd]
            hidden_out[batch, last][:, None],  # [B, 1, H]
            rows.positions[batch, last][:, None],  # [B, 1]
        )
        depth = int(budget.max())
        if isinstance(self.shape, TreeShape):
            return self._tree(*root, depth)
        return self._chain(*root, depth)

    def _chain(self, logits: Tensor, hidden_out: Tensor, position: Tensor, k: int) -> Proposal:
        """K drafts, one forward each; logits [B, Vd], hidden_out [B, 1, H], position [B, 1]."""
        batch, device = len(logits), logits.device
        drafts = torch.zeros(batch, k, dtype=torch.long, device=device)  # target ids
        q_tok = torch.ones(batch, k, device=device)
        confidence = torch.ones(batch, k, device=device)
        dists = []  # per offset [B, Vd] draft-vocab probabilities (T > 0)
        committed = self.cache.length
        # chain step i sees the committed rows, the i-1 chain keys before it and itself
        chain_mask = torch.cat(
            [self.valid, torch.ones(batch, k, dtype=torch.bool, device=device)], dim=1
        )[:, None]  # [B, 1, S+K]
        for i in range(k):
            if i > 0:
                with self.timer("drafter"):
                    logits, hidden_out = self.drafter.chain_step(
                        i,
                        drafts[:, i - 1 : i],
                        hidden_out,
                        position + i,
                        attention_mask=chain_mask[..., : committed + i],
                        cache=self.cache,
                    )
                logits = logits[:, 0]
            draft_id, q, q_tok[:, i], confidence[:, i] = _draft(logits, self.temperature, self.gen)
            drafts[:, i] = self.to_target[draft_id]
            dists.append(q)
            if self._all_stopped(confidence[:, : i + 1]):
                break
        self.cache.crop(committed)  # chain keys were speculative; the next step recomputes
        n = len(dists)
        return Proposal(
            tokens=drafts[:, :n],
            q=q_tok[:, :n],
            confidence=confidence[:, :n],
            forwards=n,
            dists=dists if self.temperature > 0 else None,
            vocab_map=self.to_target,
        )

    def _all_stopped(self, confidence: Tensor) -> bool:
        """Every row's stop rule already ended its chain: a further forward would go unverified
        (the loop drops the drafts past each row's stop; see `ChainShape.stop_confidence`)."""
        threshold = self.shape.stop_confidence if isinstance(self.shape, ChainShape) else 0.0
        if threshold <= 0:
            return False
        return bool((confident_length(confidence, threshold) < confidence.shape[1]).all())

    def _tree(
        self, root_logits: Tensor, root_hidden: Tensor, root_pos: Tensor, depth: int
    ) -> Proposal:
        """EAGLE-2 expansion and reranking (module docstring); leaves the cache as it found it.

        root_logits [B, Vd], root_hidden [B, 1, H], root_pos [B, 1] (the last committed row's
        position).
        """
        shape, valid = self.shape, self.valid
        k, batch = shape.top_k, len(root_logits)
        device = root_logits.device
        committed = self.cache.length
        to_target = self.to_target
        score, ids, q, conf = _expand(root_logits[:, None], self.temperature, k)  # [B, 1, k] each
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
        floor = math.log(shape.min_confidence) if shape.min_confidence > 0 else -math.inf
        levels = 1
        for d in range(2, depth + 1):
            if float(front_score.max()) < floor:  # no frontier path is likely enough to go deeper
                break
            levels = d
            mask = torch.cat(
                [valid[:, None].expand(-1, k, -1), front_anc, eye.expand(batch, -1, -1)], dim=2
            )  # [B, k, S + (d-2)k + k]
            with self.timer("drafter"):
                logits, hidden = self.drafter.chain_step(
                    d - 1,
                    front_tok,
                    front_hidden,
                    (root_pos + d - 1).expand(-1, k),
                    attention_mask=mask,
                    cache=self.cache,
                )  # [B, k, Vd], [B, k, H]
            score, ids, q, conf = _expand(logits, self.temperature, k)  # [B, k, k]
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
        self.cache.crop(committed)  # tree keys were speculative; the next step recomputes

        cat = {name: torch.cat(parts, dim=1) for name, parts in cands.items()}  # [B, M]
        # Stable: a child ties its parent only when q = 1, and the parent comes first in the list.
        size = min(shape.budget, n_cands)
        order = cat["score"].sort(dim=1, descending=True, stable=True).indices[:, :size]
        chosen = order.sort(dim=1).values  # [B, N] candidate indices, parents before children
        slot = torch.full_like(cat["parent"], -1).scatter_(
            1, chosen, torch.arange(1, size + 1, device=device).expand(batch, -1)
        )  # [B, M] candidate -> node index (1-based), -1 if not in the tree
        cand_parent = cat["parent"].gather(1, chosen)
        parent = torch.where(cand_parent >= 0, slot.gather(1, cand_parent.clamp(min=0)), 0)
        return Proposal(
            tokens=cat["token"].gather(1, chosen),
            q=cat["q"].gather(1, chosen),
            confidence=cat["conf"].gather(1, chosen),
            forwards=levels,
            parent=parent,
            depth=cat["depth"].gather(1, chosen),
        )


def _draft(
    logits: Tensor, temperature: float, gen: torch.Generator
) -> tuple[Tensor, Tensor | None, Tensor, Tensor]:
    """Draft logits [B, Vd] -> (draft id [B], q [B, Vd] or None at T=0, q(draft) [B],
    max_v q_v [B] (at T=1 when T=0))."""
    if temperature == 0:
        ids = logits.argmax(-1)
        confidence = logits.softmax(-1).amax(-1)
        return ids, None, torch.ones(len(ids), device=logits.device), confidence
    q = torch.softmax(logits / temperature, dim=-1)  # [B, Vd]
    ids = torch.multinomial(q, 1, generator=gen)[:, 0]
    return ids, q, q.gather(1, ids[:, None])[:, 0], q.amax(-1)


def _expand(logits: Tensor, temperature: float, k: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Drafter logits [B, F, Vd] -> the top-k children of each of F nodes: (log-confidence at
    T=1, draft ids, q at the temperature (1 at T=0), max_v q_v [B, F, 1]), each [B, F, k]."""
    logp = torch.log_softmax(logits, dim=-1)
    score, ids = logp.topk(k, dim=-1)
    if temperature == 0:
        return score, ids, torch.ones_like(score), logp.amax(-1, keepdim=True).exp()
    q = torch.softmax(logits / temperature, dim=-1)
    return score, ids, q.gather(-1, ids), q.amax(-1, keepdim=True)


@torch.no_grad()
def replay_chain(
    drafter: ChainNetwork,
    features: Features,
    anchors: Tensor,
    k: int,
    *,
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
) -> Replayed:
    """Draft K tokens from each anchor e of one sequence, as the decoder would from prefix y<e.

    features: ids [T] and the states the network reads ([T, F]); anchors [C] with
    2 <= e <= T (repeat an anchor for several samples). One drafter pass runs the prefix rows
    0..max(e)-2; chain c starts at row e_c - 2 and each later step runs all C chains as one
    forward whose mask lets chain c see the prefix rows <= e_c - 2 and its own earlier chain keys.
    T=0 drafts the argmax, T>0 samples q = softmax(logits / T) with `generator`.
    """
    device = drafter.vocab.d2t.device
    ids, _, anchors = replay_inputs(features, anchors, k, device)
    states = drafter.read_features(features)  # [T, F]
    C = anchors.numel()
    vocab = drafter.vocab

    rows = anchors - 2  # [C]
    width = int(rows.max()) + 1
    cache = KVCache()
    hidden = drafter.start_hidden(states[:width].to(device)[None])  # [1, L, H]
    positions = torch.arange(width, device=device)[None]  # [1, L]
    logits, hidden_out = drafter.chain_step(
        0, ids[None, 1 : width + 1], hidden, positions, cache=cache
    )
    logits, hidden_out = logits[0, rows], hidden_out[:, rows]  # [C, Vd], [1, C, H]
    prefix_visible = torch.arange(width, device=device)[None] <= rows[:, None]  # [C, L]
    own = torch.eye(C, dtype=torch.bool, device=device)  # [C, C]: a chain sees only its own keys

    tokens, logq, confidence = [], [], []
    for j in range(k):
        if j > 0:
            mask = torch.cat([prefix_visible, own.repeat(1, j)], dim=1)[None]  # [1, C, L + C*j]
            logits, hidden_out = drafter.chain_step(
                j, tokens[-1][None], hidden_out, (rows + j)[None], attention_mask=mask, cache=cache
            )
            logits = logits[0]  # [C, Vd]
        log_q = torch.log_softmax(logits / (temperature or 1.0), dim=-1)  # [C, Vd]
        if temperature == 0:
            draft = logits.argmax(-1)
        else:
            draft = torch.multinomial(log_q.exp(), 1, generator=generator)[:, 0]
        picked = log_q.gather(1, draft[:, None])[:, 0]
        logq.append(picked if temperature > 0 else torch.zeros_like(picked))
        confidence.append(log_q.max(-1).values.exp())
        tokens.append(vocab.to_target(draft))  # [C]
    return Replayed(
        tokens=torch.stack(tokens, 1),
        logq=torch.stack(logq, 1),
        confidence=torch.stack(confidence, 1),
    )
