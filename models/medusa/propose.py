"""Medusa's drafts for the decoding loop: one pass of the heads per verify step, no cache.

The heads read the last committed row's last hidden state h (the state that predicted the token
the target just emitted) and head k drafts the k-th token after that one. Two shapes:
  - chain (`ChainShape(k)`, k <= heads): head i's draft is node i; at T>0 each is drawn from its
    own q_i, which does not depend on the drafts before it, so the loop's Leviathan test on each
    is exact (as for a DFlash block);
  - static tree (`TreeShape(depth, top_k, budget)`): Medusa's tree of top-k candidates per head.
    A node is a path of ranks (r_1, ..., r_d): its token is head d's rank-r_d candidate, its
    parent the path without r_d. The tree is the same for every step (only its tokens change):
    the `budget` paths of at most `depth` heads and ranks < top_k with the highest prior
    prod_i 1 / (1 + r_i), that is, a candidate of rank r counted as right 1/(1+r) as often as a
    head's top-1, deeper paths first among equals. Medusa calibrates these weights per head on
    held-out data; this prior needs none and keeps the top-1 chain (prior 1) in every tree.
    Every node is a point mass (its token is fixed by the heads), so the loop's sibling tests
    keep the output lossless at any temperature.
"""

from __future__ import annotations

import heapq
from typing import Any

import torch
from torch import Tensor

from models.blocks import block_chain
from models.drafter import Proposal, Shape, TreeShape
from models.features import Features
from models.medusa.model import MedusaHeads


def static_tree(depth: int, top_k: int, budget: int) -> list[tuple[int, ...]]:
    """The tree's nodes as rank paths, parents before children (module docstring). A child's
    prior never exceeds its parent's and ties go to the shallower path, so taking the best
    frontier node `budget` times gives a set closed under parents."""
    frontier = [(-1.0 / (1 + r), 1, (r,)) for r in range(top_k)]
    heapq.heapify(frontier)
    chosen: list[tuple[int, ...]] = []
    while frontier and len(chosen) < budget:
        neg_prior, length, path = heapq.heappop(frontier)
        chosen.append(path)
        if length < depth:
            for r in range(top_k):
                heapq.heappush(frontier, (neg_prior / (1 + r), length + 1, (*path, r)))
    return sorted(chosen, key=lambda p: (len(p), p))


class MedusaProposer:
    """Chains or static trees from Medusa heads; stateless between steps."""

    def __init__(
        self,
        drafter: MedusaHeads,
        shape: Shape,
        temperature: float,
        generator: torch.Generator,
        timer: Any,
    ) -> None:
        heads = drafter.config.num_heads
        if shape.depth > heads:
            raise ValueError(
                f"{shape.depth} drafts deep exceed the drafter's {heads} Medusa heads; lower "
                "drafting.k (or drafting.tree.depth) or train more heads (drafter.heads)"
            )
        if isinstance(shape, TreeShape):
            if shape.min_confidence > 0:
                raise ValueError(
                    "a Medusa tree is static: it has no expansion to stop at "
                    "drafting.tree.min_confidence; leave it at 0"
                )
            if shape.top_k > drafter.config.draft_vocab_size:
                raise ValueError(
                    f"tree top_k ({shape.top_k}) exceeds the draft vocab "
                    f"({drafter.config.draft_vocab_size})"
                )
            self.tree = static_tree(shape.depth, shape.top_k, shape.budget)
        else:
            self.tree = None
        self.drafter, self.temperature, self.gen, self.timer = (
            drafter,
            temperature,
            generator,
            timer,
        )
        self.to_target = drafter.vocab.draft_to_target_ids

    def keep_rows(self, rows: Tensor) -> None:
        """Nothing to keep: the heads read only the rows of each step."""

    def propose(self, rows: Features, budget: Tensor) -> Proposal:
        if rows.last_hidden is None:
            raise ValueError("Medusa heads read the target's last hidden state: rows carry none")
        batch, device = len(rows.ids), rows.ids.device
        self.to_target = self.to_target.to(device)
        last = rows.valid.sum(1) - 1  # [B] the last committed row
        hidden = rows.last_hidden[torch.arange(batch, device=device), last]  # [B, H]
        depth = int(budget.max())
        if self.tree is not None:
            depth = min(depth, len(self.tree[-1]))  # the loop verifies no deeper than its budget
        with self.timer("drafter"):
            logits = self.drafter(hidden, depth).float()  # [B, K, Vd]
        if self.tree is None:
            return block_chain(logits, self.temperature, self.gen, self.to_target)
        return self._tree(logits, [path for path in self.tree if len(path) <= depth])

    def _tree(self, logits: Tensor, tree: list[tuple[int, ...]]) -> Proposal:
        """Logits [B, K, Vd] -> the static tree's N nodes (`tree`, rank paths of at most K
        heads) per row, each a point mass."""
        batch, device = logits.shape[0], logits.device
        top_k = 1 + max(max(path) for path in tree)
        q = torch.softmax(logits / (self.temperature or 1.0), dim=-1)  # [B, K, Vd]
        top_q, top_ids = q.topk(top_k, dim=-1)  # [B, K, k] the heads' candidates by rank
        head = torch.tensor([len(p) - 1 for p in tree], device=device)  # [N] 0-based head
        rank = torch.tensor([p[-1] for p in tree], device=device)  # [N]
        index = {path: i + 1 for i, path in enumerate(tree)}  # 1-based; 0 = the root
        parent = torch.tensor([index.get(p[:-1], 0) for p in tree], device=device)  # [N]
        q_tok = top_q[:, head, rank]  # [B, N]
        return Proposal(
            tokens=self.to_target[top_ids[:, head, rank]],
            q=q_tok if self.temperature else torch.ones_like(q_tok),
            confidence=q.amax(-1)[:, head],  # [B, N]: max_v q_v of the node's head
            forwards=1,
            parent=parent.expand(batch, -1),
            depth=(head + 1).expand(batch, -1),
        )
