"""What chain drafters share in training: a network that drafts one token per forward, reading
its own previous hidden state and draft (EAGLE-3, MTP), trained with training-time test (TTT),
so the teacher-forced unroll is the chain decoding drafts (models/chain_propose.py).

Row convention (shared by the proposer, the replays and every training unroll): row t reads
the target's states at sequence position t (turned into a hidden state by the network's
`start_hidden`) and token x_{t+1}, sits at rope position t and predicts x_{t+2}. A chain
continues row t at step k >= 1 with position t+k, its own previous hidden_out and token
x_{t+k+1}, and predicts x_{t+k+2}. The teacher for x_j is the target's distribution at
position j-1.

An unroll's outputs are per step k: logits [B, T, Vd] (row t drafts x_{t+k+2}), valid [B, T]
and hidden_out [B, T, H]; the teacher of step k's row t is the target's distribution at
position t+k+1. A training unroll's logits are `HeadLogits` (the head not yet applied), which
the losses read through the fused, chunked head of models/head_loss.py. The block drafters'
counterpart is models/blocks.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from models.acceptance import AcceptanceStats
from models.chain_propose import ChainProposer, replay_chain
from models.drafter import Proposer, Shape, TreeShape
from models.features import Features
from models.head_loss import HeadLogits
from models.kv import KVCache
from models.layers import RotaryEmbedding, apply_rope
from models.losses import (
    Logits,
    acceptance_rate,
    ce_rollout_loss,
    materialized,
    teacher_draft_probs,
)
from models.vocab import DraftVocab, VocabBuffers


class ChainNetwork(VocabBuffers):
    """A network that drafts a chain one forward per draft (module docstring): each step runs
    a decoder layer over the embedded token and the hidden state, then a norm and the head.
    A network says which target states it reads (`read_features`), what step 0's hidden state
    is (`start_hidden`) and which layer and norm a step runs (`step_layer`); `embed_tokens` is
    the target's frozen embedding."""

    embed_tokens: nn.Embedding
    rotary: RotaryEmbedding
    lm_head: nn.Linear

    def read_features(self, features: Features) -> Tensor:
        """The target states it reads at each row of `features`: [..., F]."""
        raise NotImplementedError

    def start_hidden(self, states: Tensor) -> Tensor:
        """Target states [..., F] -> the hidden state [..., H] step 0 reads."""
        raise NotImplementedError

    def step_layer(self, step: int) -> tuple[ChainLayer, nn.Module]:
        """Step `step`'s decoder layer and the norm its head reads through."""
        raise NotImplementedError

    def chain_step(
        self,
        step: int,
        input_ids: Tensor,
        hidden: Tensor,
        position_ids: Tensor,
        *,
        attention_mask: Tensor | None = None,
        cache: KVCache | TTTCache | None = None,
        head_at: Tensor | None = None,
        lazy_head: bool = False,
    ) -> tuple[Tensor | HeadLogits, Tensor]:
        """Draft step `step` (0: the rows that read the target's states) over input_ids [B, T],
        hidden [B, T, H], position_ids [B, T]; `attention_mask` bool [B, T, S] (S = cached keys
        + T; None: causal) -> (logits [B, T, Vd] fp32, hidden_out [B, T, H]). `head_at` [B]:
        one row of each batch row, the only logits computed ([B, Vd]). `lazy_head`: the logits
        as a `HeadLogits` (the post-norm states and the head's weight)."""
        self._check_inputs(input_ids, hidden, position_ids, attention_mask, cache)
        layer, norm = self.step_layer(step)
        embeds = self.embed_tokens(input_ids).to(hidden.dtype)  # [B, T, H]
        cos, sin = self.rotary(position_ids, hidden.dtype)  # [B, T, d]
        hidden_out = layer(embeds, hidden, cos, sin, attention_mask, cache)  # [B, T, H]
        read = hidden_out
        if head_at is not None:  # one row of each batch row: [B, H]
            read = hidden_out[torch.arange(len(head_at), device=head_at.device), head_at]
        if lazy_head:
            return HeadLogits.of(norm(read), self.lm_head.weight), hidden_out
        return self.lm_head(norm(read)).float(), hidden_out  # [B, T, Vd], or [B, Vd] at head_at

    def _check_inputs(
        self,
        input_ids: Tensor,
        hidden: Tensor,
        position_ids: Tensor,
        attention_mask: Tensor | None,
        cache: KVCache | TTTCache | None,
    ) -> None:
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [B, T], got shape {tuple(input_ids.shape)}")
        B, T = input_ids.shape
        H = self.embed_tokens.embedding_dim
        if tuple(hidden.shape) != (B, T, H):
            raise ValueError(
                f"hidden must be [B={B}, T={T}, H={H}], got {tuple(hidden.shape)}; pass "
                "start_hidden(states) at step 0 and the previous hidden_out after"
            )
        if tuple(position_ids.shape) != (B, T):
            raise ValueError(
                f"position_ids must be [B={B}, T={T}], got {tuple(position_ids.shape)}"
            )
        if attention_mask is None:
            return
        if isinstance(cache, TTTCache):
            raise ValueError("a TTTCache builds its own mask; do not pass attention_mask with it")
        S = T + (cache.length if cache is not None else 0)
        if attention_mask.dtype != torch.bool or tuple(attention_mask.shape) != (B, T, S):
            raise ValueError(
                f"attention_mask must be bool [B={B}, T={T}, S={S}] (S = cached keys + new rows), got "
                f"{attention_mask.dtype} {tuple(attention_mask.shape)}"
            )


def shift_left(x: Tensor, n: int, fill: float | bool = 0) -> Tensor:
    """out[:, t] = x[:, t + n], `fill` past the end. Used to align step-k rows with tokens and teachers."""
    if n == 0:
        return x
    out = torch.full_like(x, fill)
    if n < x.shape[1]:
        out[:, : x.shape[1] - n] = x[:, n:]
    return out


class TTTCache:
    """Keys of a training-time-test unroll: step-0 keys of all rows, then each row's own chain keys.

    Step k's query at row t sees step-0 keys at rows <= t (causal) and the step 1..k keys of row t
    only: exactly the cache a chain drafting from row t would hold. Chain keys are kept per row
    ([B, n_kv, T, k, d]) so attention costs T*T + T*k scores, never a dense [T*k, T*k] mask.
    """

    def __init__(self) -> None:
        self.context: tuple[Tensor, Tensor] | None = None
        self.chain_keys: list[Tensor] = []
        self.chain_values: list[Tensor] = []


def ttt_attention(q: Tensor, k: Tensor, v: Tensor, cache: TTTCache) -> Tensor:
    """q [B, h, T, d], k/v [B, n_kv, T, d] -> [B, h, T, d]; adds this step's keys to `cache`.

    Past step 0 the context keys are the cached step-0 ones, never recomputed. A query head's
    group shares its kv head: the group's queries are stacked along the rows ([B, n_kv, g*T,
    d]) and read the kv heads as they are, not copied once per query head; scale and causal
    mask enter the scores' matmul itself (baddbmm)."""
    B, h, T, d = q.shape
    kv = k.shape[1]
    if cache.context is None:
        cache.context = (k, v)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=h > kv)
    cache.chain_keys.append(k)
    cache.chain_values.append(v)
    g = h // kv
    q = q.contiguous()  # rope keeps the [B, T, h, d] layout of the projection
    ctx_k, ctx_v = cache.context  # [B, kv, T, d]
    own_k = torch.stack(cache.chain_keys, dim=3)  # [B, kv, T, k, d]
    own_v = torch.stack(cache.chain_values, dim=3)
    qg = q.reshape(B * kv, g * T, d)  # head kv*g + j reads kv head kv
    causal = torch.full((T, T), float("-inf"), dtype=q.dtype, device=q.device).triu(1)
    ctx_scores = torch.baddbmm(
        causal.repeat(g, 1), qg, ctx_k.reshape(B * kv, T, d).transpose(1, 2), alpha=d**-0.5
    ).view(B, kv, g, T, T)
    own_scores = (q.view(B, kv, g, T, 1, d) * own_k[:, :, None]).sum(-1) * d**-0.5  # [.., T, k]
    probs = torch.cat([ctx_scores, own_scores], dim=-1).float().softmax(-1).to(q.dtype)
    # The context's values padded with zeros under the own keys' columns: the matmul reads
    # the probabilities whole, so backward keeps the one [.., T, T + k] tensor softmax saved
    # rather than a copy of its context columns as well.
    padded = F.pad(ctx_v, (0, 0, 0, own_k.shape[3])).reshape(B * kv, -1, d)  # [B*kv, T+k, d]
    ctx_out = probs.view(B * kv, g * T, -1) @ padded  # [B*kv, g*T, d]
    own_out = (probs[..., T:, None] * own_v[:, :, None]).sum(-2)  # [B, kv, g, T, d]
    return ctx_out.view(B, h, T, d) + own_out.view(B, h, T, d)


class ChainAttention(nn.Module):
    """Llama attention (GQA, rope) of a chain network's layer, over its own KV cache (decoding:
    committed rows, then each step's chain or tree keys under the caller's mask) or a
    `TTTCache` (training); q/k/v read an `in_features`-wide input."""

    def __init__(
        self, in_features: int, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int
    ) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_proj = nn.Linear(in_features, num_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(in_features, num_kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(in_features, num_kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=False)

    def forward(
        self,
        x: Tensor,
        cos: Tensor,
        sin: Tensor,
        attention_mask: Tensor | None,
        cache: KVCache | TTTCache | None,
    ) -> Tensor:
        B, T, _ = x.shape  # [B, T, in_features]
        q = self.q_proj(x).view(B, T, self.num_heads, self.head_dim).transpose(1, 2)  # [B, h, T, d]
        # k, v: [B, kv, T, d]
        k = self.k_proj(x).view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if isinstance(cache, TTTCache):
            out = ttt_attention(q, k, v, cache)
        else:
            past = cache.length if cache is not None else 0
            if cache is not None:
                k, v = cache.append(k, v)  # [B, kv, S, d]
            if attention_mask is None:
                # Plain causal over cache + new: new row i sits at key index past + i.
                S = past + T
                attention_mask = torch.ones(T, S, dtype=torch.bool, device=x.device).tril(
                    diagonal=past
                )
            else:
                attention_mask = attention_mask[:, None]  # [B, 1, T, S]
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=attention_mask, enable_gqa=self.num_heads != self.num_kv_heads
            )
        return self.o_proj(out.transpose(1, 2).reshape(B, T, self.num_heads * self.head_dim))


class ChainLayer(nn.Module):
    """A chain network's Llama decoder layer over a step's embedded token and hidden state. The
    kinds differ only in what its attention reads and the residual that adds to
    (`attention_input`); `self_attn`, `post_attention_layernorm` and `mlp` are the kind's."""

    self_attn: ChainAttention
    post_attention_layernorm: nn.Module
    mlp: nn.Module

    def attention_input(self, embeds: Tensor, hidden: Tensor) -> tuple[Tensor, Tensor]:
        """embeds, hidden [B, T, H] -> (what attention reads [B, T, in_features], the residual
        [B, T, H])."""
        raise NotImplementedError

    def forward(
        self,
        embeds: Tensor,
        hidden: Tensor,
        cos: Tensor,
        sin: Tensor,
        attention_mask: Tensor | None,
        cache: KVCache | TTTCache | None,
    ) -> Tensor:
        x, residual = self.attention_input(embeds, hidden)
        h = residual + self.self_attn(x, cos, sin, attention_mask, cache)  # [B, T, H]
        return h + self.mlp(self.post_attention_layernorm(h))  # [B, T, H]


@dataclass
class TTTStep:
    """One unrolled step k: row t predicts x_{t+k+2}; its teacher is the target at position t+k+1."""

    logits: Logits  # [B, T, Vd] fp32, or its `HeadLogits`
    valid: Tensor  # [B, T] bool
    hidden_out: Tensor  # [B, T, H]


def ttt_unroll(
    network: ChainNetwork,
    states: Tensor,
    input_ids: Tensor,
    *,
    steps: int = 7,
    step_tokens: Sequence[Tensor | None] | None = None,
    loss_mask: Tensor | None = None,
    lazy_head: bool = False,
) -> list[TTTStep]:
    """Training-time test: run the network `steps` times over every row, feeding back its own hidden.

    states [B, T, F] (the target states it reads at positions 0..T-1), input_ids [B, T].
    Step 0 row t reads (start_hidden(states)_t, x_{t+1}); step k >= 1 reads step k-1's hidden_out
    of row t and token `step_tokens[k][:, t]` if given (drafter-sampled, OPD) else ground truth
    x_{t+k+1} (SFT). `step_tokens[0]` must be None: step 0 always reads the committed token.
    Row t at step k is valid iff x_{t+k+2} exists and, when `loss_mask` [B, T] is given, it is set there.
    Teachers align with `shift_left(teacher, k + 1)`. `lazy_head`: each step's logits as a
    `HeadLogits`, for the fused loss.
    """
    if input_ids.dim() != 2 or states.shape[:2] != input_ids.shape:
        raise ValueError(
            f"states {tuple(states.shape)} and input_ids {tuple(input_ids.shape)} must share [B, T]"
        )
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    if step_tokens is not None:
        if len(step_tokens) != steps:
            raise ValueError(
                f"step_tokens has {len(step_tokens)} entries, expected one per step ({steps})"
            )
        if step_tokens[0] is not None:
            raise ValueError(
                "step_tokens[0] must be None: step 0 reads the committed token x_{t+1}"
            )
    if loss_mask is not None and (
        loss_mask.shape != input_ids.shape or loss_mask.dtype != torch.bool
    ):
        raise ValueError(
            f"loss_mask must be bool {tuple(input_ids.shape)}, got {loss_mask.dtype} {tuple(loss_mask.shape)}"
        )

    B, T = input_ids.shape
    positions = torch.arange(T, device=input_ids.device).expand(B, T)
    keep = loss_mask if loss_mask is not None else torch.ones_like(input_ids, dtype=torch.bool)
    cache = TTTCache()
    hidden = network.start_hidden(states)  # [B, T, H]
    out = []
    for k in range(steps):
        given = step_tokens[k] if step_tokens is not None else None
        tokens = given if given is not None else shift_left(input_ids, k + 1)
        logits, hidden = network.chain_step(
            k, tokens, hidden, positions + k, cache=cache, lazy_head=lazy_head
        )
        out.append(
            TTTStep(logits=logits, valid=shift_left(keep, k + 2, fill=False), hidden_out=hidden)
        )
    return out


@dataclass
class Unrolled:
    """One unroll's per-step outputs (module docstring)."""

    logits: list[Logits]  # [K] of [B, T, Vd]: `HeadLogits` from `chain_unroll`
    valid: list[Tensor]  # [K] of [B, T] bool
    hidden: list[Tensor]  # [K] of [B, T, H]


def chain_unroll(
    network: ChainNetwork,
    features: Features,
    loss_mask: Tensor | None,
    steps: int,
    replays: tuple[Tensor, Tensor, Tensor] | None = None,
) -> Unrolled:
    """`ttt_unroll` over every row; with replays (item [N], anchor [N], tokens [N, K]) the row
    e-2 of each anchor e reads the replayed drafts at steps >= 1 instead of ground truth, so
    that row is exactly the chain the decoder drafted from the prefix y<e. Its logits are
    `HeadLogits`: the losses compute them a chunk at a time (models/head_loss.py)."""
    input_ids = features.ids
    step_tokens = None
    if replays is not None:
        item, anchor, tokens = replays
        row = anchor - 2
        step_tokens = [None]
        for k in range(1, steps):
            given = shift_left(input_ids, k + 1)  # [B, T] ground truth x_{t+k+1}
            given[item, row] = tokens[:, k - 1]
            step_tokens.append(given)
    out = ttt_unroll(
        network,
        network.read_features(features),
        input_ids,
        steps=steps,
        step_tokens=step_tokens,
        loss_mask=loss_mask,
        lazy_head=True,
    )
    return Unrolled([s.logits for s in out], [s.valid for s in out], [s.hidden_out for s in out])


def replay_logits(out: Unrolled, item: Tensor, anchor: Tensor) -> Logits:
    """The drafter's logits along each replay: step k at (item, anchor row) -> [N, K, Vd]
    (a `HeadLogits` when the unroll's are and every step shares one head, as EAGLE-3's and
    MTP's do)."""
    row = anchor - 2
    heads = out.logits
    if all(isinstance(h, HeadLogits) for h in heads) and len({id(h.weight) for h in heads}) == 1:
        rows = torch.stack([h.hidden[item, row] for h in heads], dim=1)  # [N, K, H]
        return replace(heads[0], hidden=rows)
    return torch.stack([materialized(logits[item, row]) for logits in heads], dim=1)


def rollout_ce_loss(
    out: Unrolled, teacher: Tensor, item: Tensor, anchor: Tensor, decay: float
) -> Tensor:
    """The TTT soft-CE on the replay unroll's rows that read ground truth (all but the anchors)."""
    anchor_rows = torch.zeros(teacher.shape[:2], dtype=torch.bool, device=teacher.device)
    anchor_rows[item, anchor - 2] = True
    return ce_rollout_loss(out.logits, out.valid, teacher, anchor_rows, decay)


@torch.no_grad()
def ttt_acceptance(
    out: Unrolled,
    target_logits: Tensor,
    vocab: DraftVocab,
    *,
    chain_k: int,
    expected: bool = True,
) -> AcceptanceStats:
    """AcceptanceStats of one unrolled batch; target_logits [B, T, V] at every position.
    `expected` also computes sum_v min(p, q) at T=1 (one [B, T, V] softmax per step)."""
    K = len(out.logits)
    if not 1 <= chain_k <= K:
        raise ValueError(f"chain_k must be in [1, {K}] (the unrolled steps), got {chain_k}")
    B, T, _ = target_logits.shape
    stats = AcceptanceStats.zeros(K, chain_k, target_logits.device)
    target_choice = target_logits.argmax(-1)  # [B, T]
    p_full = teacher_draft_probs(target_logits, vocab, 1.0, renormalize=False) if expected else None
    chain_alive = torch.ones(B, T, dtype=torch.bool, device=target_logits.device)
    chain_valid = torch.ones_like(chain_alive)
    chain_len = torch.zeros(B, T, dtype=torch.float64, device=target_logits.device)
    for k, (logits, valid) in enumerate(zip(out.logits, out.valid, strict=True)):
        n = T - k - 1  # rows whose target position t+k+1 exists
        hit = torch.zeros_like(valid)
        if n > 0:
            if isinstance(logits, HeadLogits):  # the head on the rows that count only
                b, t = valid[:, :n].nonzero(as_tuple=True)
                drafted = vocab.to_target(logits[b, t].argmax(-1))  # [N]
                hit[b, t] = drafted == target_choice[b, t + k + 1]
            else:
                drafted = vocab.to_target(logits[:, :n].argmax(-1))  # [B, n]
                hit[:, :n] = (drafted == target_choice[:, k + 1 :]) & valid[:, :n]
            if p_full is not None:
                q = materialized(logits[:, :n]).float().softmax(-1)  # [B, n, Vd]
                alpha = acceptance_rate(q, p_full[:, k + 1 :])  # [B, n]
                stats.alpha_sum[k] = alpha[valid[:, :n]].double().sum()
        stats.hits[k] = hit.sum()
        stats.valid[k] = valid.sum()
        if k < chain_k:
            chain_valid &= valid
            chain_alive &= hit
            chain_len += chain_alive
    stats.chain_rows = chain_valid.sum().double()
    stats.chain_len = chain_len[chain_valid].sum()
    return stats


class ChainDrafter:
    """The drafting and training roles of a `ChainNetwork` drafter (EAGLE-3, MTP), mixed in
    before `TrainableDrafter`: K-chains and EAGLE-2 trees (models/chain_propose.py), replays,
    the TTT unroll, acceptance, and Draft-OPD's logits along replays and its CE anchor (the
    TTT soft-CE, `sft.step_decay`^k per step). `sft_loss` is each kind's own (EAGLE-3's
    objectives, MTP's per-depth mean)."""

    vocab: DraftVocab

    def proposer(
        self, shape: Shape, temperature: float, generator: torch.Generator, timer: Any
    ) -> Proposer:
        if isinstance(shape, TreeShape) and shape.top_k > self.vocab.draft_vocab_size:
            raise ValueError(
                f"tree top_k ({shape.top_k}) exceeds the draft vocab ({self.vocab.draft_vocab_size})"
            )
        return ChainProposer(self, shape, temperature, generator, timer)

    replay = replay_chain
    unroll = chain_unroll

    def acceptance(
        self, out: Unrolled, target_logits: Tensor, *, chain_k: int, expected: bool = True
    ) -> AcceptanceStats:
        return ttt_acceptance(out, target_logits, self.vocab, chain_k=chain_k, expected=expected)

    def replay_logits(
        self, out: Unrolled, item: Tensor, anchor: Tensor, *, lazy: bool = False
    ) -> Logits:
        logits = replay_logits(out, item, anchor)
        return logits if lazy else materialized(logits)

    def rollout_ce_loss(
        self, out: Unrolled, teacher: Tensor, item: Tensor, anchor: Tensor, decay: float
    ) -> Tensor:
        return rollout_ce_loss(out, teacher, item, anchor, decay)
