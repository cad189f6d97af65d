"""Lossless speculative decoding with an EAGLE-3 drafter, batched, with a per-draft record log.

One round per active sequence (all rows of the batch advance together):
  1. the drafter runs the rows of the newly committed positions (target features from the last
     verify forward, or from the prefill) and the last of them yields draft 1; K-1 chain steps on
     its own hidden states and KV cache give drafts 2..K; the chain keys are then dropped again;
  2. the target verifies [last committed token, d_1..d_K] in ONE forward;
  3. greedy (T=0): accept while d_i == argmax p_i, then emit argmax p at the first mismatch (or the
     bonus after K accepts). T>0: accept d_i with prob min(1, p_i(d_i)/q_i(d_i)); on rejection emit a
     sample of norm(max(0, p_i - q_i)); after K accepts emit a bonus sample of p_{K+1}. p and q are
     softmax(logits / T); q lives on the draft vocab, mapped into the target vocab via d2t (tokens
     outside the draft vocab have q = 0).

Rows accept different lengths, so neither KV cache is cropped per row: each row carries a
slot-validity mask over its cache (rejected drafts stay as invalid slots) and its own positions,
and every forward gets a bool [B, T, S] mask built from that. Slots past the longest row are
cropped, and finished rows leave the batch.

Sequence positions count from the first prompt token. The prefill samples the first new token
straight from the target; each verify step then emits accepted + 1 tokens, except that a block
ends at an accepted EOS (no token follows EOS). Per-row budgets shrink the block near
`max_new_tokens` (K_b = min(K, remaining - 1)), so a verify step never emits past the budget.
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

from models.drafter import DrafterCache, Eagle3Drafter
from models.target import Target

OUTCOMES = ("accepted", "rejected", "not_reached")


@dataclass(frozen=True)
class SpecConfig:
    """Speculative decoding settings. `eos_token_ids=None` means the target's own EOS ids;
    an empty tuple never stops early."""

    k: int
    temperature: float = 0.0
    max_new_tokens: int = 64
    seed: int = 0
    eos_token_ids: tuple[int, ...] | None = None


@dataclass
class SpecResult:
    """Output of `speculative_generate`.

    sequences: generated tokens per prompt (prompt excluded; EOS included when emitted).
    records: columnar, one row per drafted token: sequence, step (verify step of that sequence,
      0-based), anchor (sequence position of the block's first draft), offset (1-based), token,
      q, p (token's draft / target probability at the temperature; one-hot at T=0),
      accept_prob (min(1, p/q); 1/0 at T=0), outcome (accepted / rejected / not_reached),
      (q, p and accept_prob exist for not-reached drafts too: the target scored the whole block,
      each draft conditioned on the drafts before it),
      target_token (accepted: the draft; rejected: the target's replacement; not_reached: -1).
    steps: columnar, one row per (sequence, verify step): sequence, step, anchor, drafted (block
      length), accepted, emitted (tokens committed by the step).
    stats: see `_stats`.
    """

    sequences: list[list[int]]
    finish_reasons: list[str]
    records: dict[str, list]
    steps: dict[str, list]
    stats: dict[str, Any] = field(default_factory=dict)


@dataclass
class GenerateResult:
    """Output of `target_generate`: generated tokens per prompt, why each stopped, forward calls."""

    sequences: list[list[int]]
    finish_reasons: list[str]
    target_forwards: int


# ---------------------------------------------------------------------------- public entry points


@torch.no_grad()
def speculative_generate(
    target: Target, drafter: Eagle3Drafter, prompts: list[list[int]], cfg: SpecConfig
) -> SpecResult:
    """Speculative decoding of `prompts` with `drafter` proposing and `target` verifying."""
    # One long function on purpose: the draft -> verify -> accept -> retire loop shares a dozen
    # pieces of batch state (caches, pending drafter rows, per-row budgets) that every phase
    # updates; the phases are marked below and read top to bottom like the algorithm.
    _check_config(cfg.k, cfg.temperature, cfg.max_new_tokens)
    _check_prompts(prompts, target.vocab_size)
    _check_drafter(target, drafter)
    device = target.device
    gen = torch.Generator(device=device).manual_seed(cfg.seed)
    eos = _eos_tensor(target, cfg.eos_token_ids)
    draft_to_target = drafter.vocab.draft_to_target_ids.to(device)  # [Vd]

    timer = _ForwardTimer()
    state, prefill_aux = _prefill(
        target, prompts, cfg.max_new_tokens + cfg.k + 1, cfg.temperature, gen, timer
    )
    steps: list[dict[str, Tensor]] = []
    dcache = DrafterCache()
    d_valid = torch.zeros(state.batch, 0, dtype=torch.bool, device=device)
    # The drafter's first pass of the next round: rows for the positions committed since the last.
    pend_aux, pend_valid = prefill_aux, state.t_valid.clone()
    pend_ids = state.seq[:, 1 : pend_valid.shape[1] + 1]
    pend_pos = torch.arange(pend_valid.shape[1], device=device).expand_as(pend_valid)
    verify_calls, drafter_calls = 0, 0

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
        budget = (cfg.max_new_tokens - state.n_gen - 1).clamp(max=cfg.k)  # [B]
        k_step = int(budget.max())
        batch = state.batch

        # 1. draft ------------------------------------------------------------------------
        drafts = torch.zeros(batch, k_step, dtype=torch.long, device=device)  # target ids
        q_tok = torch.ones(batch, k_step, device=device)
        q_draft = []  # per offset [B, Vd] draft-vocab probabilities (T > 0)
        if k_step > 0:
            with timer("drafter"):
                hidden = drafter.fuse(pend_aux)  # [B, Tp, H]
                mask = _extend_mask(d_valid, pend_valid)  # [B, Tp, S+Tp]
                logits, hidden_out = drafter(
                    pend_ids, hidden, pend_pos, attention_mask=mask, cache=dcache
                )
            drafter_calls += 1
            d_valid = torch.cat([d_valid, pend_valid], dim=1)
            committed_len = dcache.length
            last = pend_valid.sum(1) - 1  # [B]
            rows = torch.arange(batch, device=device)
            logits, hidden_out = (
                logits[rows, last],
                hidden_out[rows, last][:, None],
            )  # [B, Vd], [B, 1, H]
            position = pend_pos[rows, last][:, None]  # [B, 1]
            # chain step i sees the committed rows, the i-1 chain keys before it and itself
            chain_mask = torch.cat(
                [d_valid, torch.ones(batch, k_step, dtype=torch.bool, device=device)], dim=1
            )[:, None]  # [B, 1, S+K]
            for i in range(k_step):
                if i > 0:
                    with timer("drafter"):
                        logits, hidden_out = drafter(
                            drafts[:, i - 1 : i],
                            hidden_out,
                            position + i,
                            attention_mask=chain_mask[..., : committed_len + i],
                            cache=dcache,
                        )
                    drafter_calls += 1
                    logits = logits[:, 0]
                draft_id, q_probs, q_tok[:, i] = _draft(logits, cfg.temperature, gen)
                drafts[:, i] = draft_to_target[draft_id]
                q_draft.append(q_probs)
            dcache.crop(committed_len)  # chain keys were speculative; the next round recomputes

        # 2. verify -----------------------------------------------------------------------
        last_tok = state.seq.gather(1, (state.seq_len - 1)[:, None])  # [B, 1]
        verify_ids = torch.cat([last_tok, drafts], dim=1)  # [B, K+1]
        verify_pos = (state.seq_len - 1)[:, None] + torch.arange(k_step + 1, device=device)
        new_valid = torch.ones(batch, k_step + 1, dtype=torch.bool, device=device)
        with timer("target"):
            out = target.forward(
                verify_ids,
                position_ids=verify_pos,
                attention_mask=_extend_mask(state.t_valid, new_valid),
                cache=state.cache,
            )
        verify_calls += 1

        # 3. accept / reject --------------------------------------------------------------
        offsets = torch.arange(k_step, device=device)
        is_eos = torch.isin(drafts, eos)
        eos_before = torch.cumsum(is_eos.long(), dim=1) - is_eos.long()
        drafted = (offsets < budget[:, None]) & (eos_before == 0)  # [B, K]: the block
        block_len = drafted.sum(1)
        p_logits = out.logits  # [B, K+1, V]
        if cfg.temperature == 0:
            greedy = p_logits.argmax(-1)  # [B, K+1]
            accept = drafts == greedy[:, :k_step]
            p_tok = accept.float()
            accept_prob = p_tok
        else:
            p = torch.softmax(p_logits / cfg.temperature, dim=-1)  # [B, K+1, V]
            p_tok = p[:, :k_step].gather(-1, drafts[..., None])[..., 0]  # [B, K]
            accept, accept_prob = _accept(p_tok, q_tok, gen)
        accepted = torch.cumprod((accept & drafted).long(), dim=1).sum(1)  # [B]
        rows = torch.arange(batch, device=device)
        if cfg.temperature == 0:
            next_tok = greedy[rows, accepted]
        else:
            next_tok = _correction(p, q_draft, accepted, block_len, draft_to_target, gen)
        tokens = torch.cat([drafts, drafts.new_zeros(batch, 1)], dim=1)  # [B, K+1]
        # A block that ends on an accepted EOS emits nothing after it.
        last_accepted = tokens.gather(1, (accepted - 1).clamp(min=0)[:, None])[:, 0]
        ended_on_eos = (accepted > 0) & (accepted == block_len) & torch.isin(last_accepted, eos)
        emitted = accepted + 1 - ended_on_eos.long()  # [B]
        tokens[rows, accepted] = torch.where(ended_on_eos, tokens[rows, accepted], next_tok)

        # 4. log (records are built once at the end, from these padded [B, K] blocks) ----------
        pad = cfg.k - k_step
        steps.append(
            dict(
                sequence=state.row_ids,
                step=torch.full_like(state.row_ids, step),
                anchor=state.seq_len.clone(),
                drafted=block_len,
                accepted=accepted,
                emitted=emitted,
                next_token=next_tok,
                drafts=F.pad(drafts, (0, pad)),
                q=F.pad(q_tok, (0, pad)),
                p=F.pad(p_tok, (0, pad)),
                accept_prob=F.pad(accept_prob, (0, pad)),
            )
        )

        # 5. commit -----------------------------------------------------------------------
        write_at = state.seq_len[:, None] + torch.arange(k_step + 1, device=device)
        state.seq.scatter_(1, write_at, tokens)
        state.seq_len += emitted
        state.n_gen += emitted
        # Valid target slots: the previous last token plus the accepted drafts.
        state.t_valid = torch.cat([state.t_valid, _valid_upto(k_step + 1, accepted, device)], dim=1)
        width = int(emitted.max())
        pend_ids = tokens[:, :width]
        pend_aux = out.aux_hidden[:, :width]
        pend_pos = verify_pos[:, :width]
        pend_valid = torch.arange(width, device=device)[None] < emitted[:, None]
        state.t_valid = _trim_slots(state.t_valid, state.cache, crop=target.crop_cache)
        step += 1

    logged = {name: torch.cat([s[name] for s in steps]) for name in steps[0]} if steps else {}
    records = _records(logged) if steps else {name: [] for name in RECORD_COLUMNS}
    stats = _stats(logged, cfg.k, verify_calls, drafter_calls, timer)
    return SpecResult(
        sequences=state.results,
        finish_reasons=state.finish_reasons,
        records=records,
        steps={name: logged[name].tolist() if steps else [] for name in STEP_COLUMNS},
        stats=stats,
    )


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
    _check_config(1, temperature, max_new_tokens)
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
            attention_mask=_extend_mask(state.t_valid, one),
            cache=state.cache,
        )
        forwards += 1
        state.t_valid = torch.cat([state.t_valid, one], dim=1)
        token = _sample_target(out.logits[:, -1], temperature, gen)
        state.seq.scatter_(1, state.seq_len[:, None], token[:, None])
        state.seq_len += 1
        state.n_gen += 1
    return GenerateResult(state.results, state.finish_reasons, forwards)


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
            self.t_valid = _trim_slots(self.t_valid, self.cache, crop=self.target.crop_cache)
        return keep


def _prefill(
    target: Target,
    prompts: list[list[int]],
    extra: int,
    temperature: float,
    gen: torch.Generator,
    timer: _ForwardTimer,
) -> tuple[_Batch, Tensor]:
    """One target forward over the right-padded prompts; samples each row's first new token.

    Returns the batch state and the prompts' aux features [B, P, 3H] (the drafter's first rows).
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
    return _Batch(seq, lengths + 1, lengths.clone(), cache, valid, target), out.aux_hidden


# ---------------------------------------------------------------------------- sampling


def _sample_target(logits: Tensor, temperature: float, gen: torch.Generator) -> Tensor:
    """[B, V] fp32 logits -> [B] token: argmax at T=0, else a sample of softmax(logits / T)."""
    if temperature == 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits / temperature, dim=-1)
    return torch.multinomial(probs, 1, generator=gen)[:, 0]


def _draft(
    logits: Tensor, temperature: float, gen: torch.Generator
) -> tuple[Tensor, Tensor | None, Tensor]:
    """Draft logits [B, Vd] -> (draft id [B], q [B, Vd] or None at T=0, q(draft) [B])."""
    if temperature == 0:
        ids = logits.argmax(-1)
        return ids, None, torch.ones(len(ids), device=logits.device)
    q = torch.softmax(logits / temperature, dim=-1)  # [B, Vd]
    ids = torch.multinomial(q, 1, generator=gen)[:, 0]
    return ids, q, q.gather(1, ids[:, None])[:, 0]


def _accept(p_tok: Tensor, q_tok: Tensor, gen: torch.Generator) -> tuple[Tensor, Tensor]:
    """Leviathan's test per drafted token: accept with probability min(1, p/q)."""
    accept_prob = (p_tok / q_tok).clamp(max=1.0)
    u = torch.rand(p_tok.shape, generator=gen, device=p_tok.device)
    return u < accept_prob, accept_prob


def _correction(
    p: Tensor,
    q_draft: list[Tensor],
    accepted: Tensor,
    block_len: Tensor,
    draft_to_target: Tensor,
    gen: torch.Generator,
) -> Tensor:
    """The token after the accepted prefix: residual sample on rejection, bonus sample of p else."""
    batch = len(p)
    rows = torch.arange(batch, device=p.device)
    p_next = p[rows, accepted]  # [B, V]
    rejected = accepted < block_len
    if q_draft and bool(rejected.any()):
        q_stack = torch.stack(q_draft, dim=1)  # [B, K, Vd]
        q_at = q_stack[rows, accepted.clamp(max=len(q_draft) - 1)]  # [B, Vd]
        q_full = torch.zeros_like(p_next).index_copy_(1, draft_to_target, q_at)  # [B, V]
        residual = (p_next - q_full).clamp(min=0)
        mass = residual.sum(-1, keepdim=True)
        # A zero residual needs p == q, where rejection has probability 0; fp32 rounding can still
        # land here, and then p itself is the right law.
        residual = torch.where(mass > 0, residual / mass.clamp(min=1e-30), p_next)
        p_next = torch.where(rejected[:, None], residual, p_next)
    return torch.multinomial(p_next, 1, generator=gen)[:, 0]


# ---------------------------------------------------------------------------- masks and caches


def _extend_mask(valid: Tensor, new_valid: Tensor) -> Tensor:
    """bool [B, T, S+T]: new rows see the valid cached slots, earlier valid new rows and themselves."""
    batch, width = new_valid.shape
    device = valid.device
    causal = torch.ones(width, width, dtype=torch.bool, device=device).tril()
    new_part = (causal & new_valid[:, None, :]) | torch.eye(width, dtype=torch.bool, device=device)
    return torch.cat([valid[:, None, :].expand(-1, width, -1), new_part], dim=2)


def _valid_upto(width: int, accepted: Tensor, device: torch.device) -> Tensor:
    """bool [B, width]: slot j is valid iff j <= accepted (the fed last token + accepted drafts)."""
    return torch.arange(width, device=device)[None] <= accepted[:, None]


def _trim_slots(valid: Tensor, cache: Any, crop=None) -> Tensor:
    """Crop trailing cache slots that no row uses; returns the trimmed validity mask."""
    used = valid.any(0).nonzero()
    keep = int(used[-1]) + 1 if used.numel() else 0
    if keep < valid.shape[1]:
        if crop is None:
            cache.crop(keep)
        else:
            crop(cache, keep)
        valid = valid[:, :keep]
    return valid


def _select_drafter_rows(cache: DrafterCache, rows: Tensor) -> None:
    cache.keys = [k[rows] for k in cache.keys]
    cache.values = [v[rows] for v in cache.values]


# ---------------------------------------------------------------------------- checks


def _check_config(k: int, temperature: float, max_new_tokens: int) -> None:
    if not isinstance(k, int) or k <= 0:
        raise ValueError(f"k (drafted tokens per step) must be a positive int, got {k!r}")
    if (
        not (isinstance(temperature, (int, float)) and math.isfinite(temperature))
        or temperature < 0
    ):
        raise ValueError(
            f"temperature must be a finite number >= 0 (0 = greedy), got {temperature!r}"
        )
    if not isinstance(max_new_tokens, int) or max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")


def _check_prompts(prompts: list[list[int]], vocab_size: int) -> None:
    if not prompts:
        raise ValueError("no prompts given")
    for i, prompt in enumerate(prompts):
        if len(prompt) == 0:
            raise ValueError(f"prompt {i} is empty; every prompt needs at least one token")
        if min(prompt) < 0 or max(prompt) >= vocab_size:
            raise ValueError(f"prompt {i} has token ids outside the target vocab [0, {vocab_size})")


def _check_drafter(target: Target, drafter: Eagle3Drafter) -> None:
    """Refuse a drafter built for another target: it would load, run, and accept nothing."""
    cfg = drafter.config
    pairs = [
        ("vocab size", cfg.vocab_size, target.vocab_size),
        ("vocab map (t2d) size", drafter.t2d.numel(), target.vocab_size),
        ("hidden size", cfg.hidden_size, target.hidden_size),
        ("target hidden size (fc input / 3)", cfg.target_hidden_size, target.hidden_size),
        ("target layer count", cfg.target_num_layers, target.num_layers),
        ("aux layer ids", tuple(cfg.aux_layer_ids), tuple(target.aux_layer_ids)),
    ]
    for name, theirs, ours in pairs:
        if theirs != ours:
            raise ValueError(
                f"drafter does not match the target: drafter {name} is {theirs}, target's is "
                f"{ours}; use the drafter trained for this target (or load the target with the "
                "drafter's aux layer ids)"
            )
    embed = drafter.embed_tokens.weight
    if embed.data_ptr() != target.embed_weight.data_ptr() and not torch.equal(
        embed.to(target.embed_weight.device, target.embed_weight.dtype), target.embed_weight
    ):
        raise ValueError(
            "the drafter's embed_tokens is not the target's embedding; build or load the drafter "
            "with target.embed_weight"
        )


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


RECORD_COLUMNS = (
    "sequence",
    "step",
    "anchor",
    "offset",
    "token",
    "q",
    "p",
    "accept_prob",
    "outcome",
    "target_token",
)
STEP_COLUMNS = ("sequence", "step", "anchor", "drafted", "accepted", "emitted")


def _records(logged: dict[str, Tensor]) -> dict[str, list]:
    """One row per drafted token, from the per-step padded [R, K] blocks."""
    rows, width = logged["drafts"].shape
    offset = torch.arange(1, width + 1, device=logged["drafts"].device).expand(rows, -1)  # [R, K]
    accepted = logged["accepted"][:, None]
    outcome = torch.full_like(offset, 2)
    outcome[offset <= accepted] = 0
    outcome[offset == accepted + 1] = 1
    in_block = offset <= logged["drafted"][:, None]
    target_token = torch.where(outcome == 0, logged["drafts"], -1)
    target_token = torch.where(outcome == 1, logged["next_token"][:, None], target_token)
    per_row = {
        name: logged[name][:, None].expand(-1, width) for name in ("sequence", "step", "anchor")
    }
    columns = {
        **per_row,
        "offset": offset,
        "token": logged["drafts"],
        "q": logged["q"],
        "p": logged["p"],
        "accept_prob": logged["accept_prob"],
        "outcome": outcome,
        "target_token": target_token,
    }
    out = {name: columns[name][in_block].tolist() for name in RECORD_COLUMNS}
    out["outcome"] = [OUTCOMES[v] for v in out["outcome"]]
    return out


def _stats(
    logged: dict[str, Tensor],
    k: int,
    verify_calls: int,
    drafter_calls: int,
    timer: _ForwardTimer,
) -> dict[str, Any]:
    """tau = mean(accepted + 1) over (sequence, verify step) pairs, the EAGLE / vLLM way;
    target_forwards_per_token = those verify steps / tokens they emitted (1/tau unless a block
    ended on an accepted EOS); alpha[i] = accepted / reached at offset i+1 (n-alpha)."""
    n_steps = len(logged["accepted"]) if logged else 0
    emitted = int(logged["emitted"].sum()) if logged else 0
    stats: dict[str, Any] = {
        "verify_steps": n_steps,
        "tau": float((logged["accepted"] + 1).float().mean()) if n_steps else float("nan"),
        "verify_tokens": emitted,
        "target_forwards_per_token": n_steps / emitted if n_steps else float("nan"),
        "prefill_forwards": 1,
        "verify_forwards": verify_calls,  # batched target calls after the prefill
        "target_forwards": 1 + verify_calls,
        "drafter_forwards": drafter_calls,
        "target_forward_seconds": timer.seconds["target"],
        "drafter_forward_seconds": timer.seconds["drafter"],
    }
    if n_steps:
        offset = torch.arange(1, k + 1, device=logged["accepted"].device)[None]  # [1, K]
        accepted = logged["accepted"][:, None]
        reached = ((offset <= logged["drafted"][:, None]) & (offset <= accepted + 1)).sum(0)
        hits = (offset <= accepted).sum(0)
        stats["alpha"] = [
            a / r if r else float("nan")
            for a, r in zip(hits.tolist(), reached.tolist(), strict=True)
        ]
        stats["reached"] = reached.tolist()
    return stats


# -- replaying drafts from logged positions (rollout confidence, score) ----------------------


@dataclass
class Chains:
    """K drafts from each of C anchors (see `replay_drafts`)."""

    tokens: Tensor  # [C, K] int64 target ids
    logq: Tensor  # [C, K] fp32 log q(token) at the temperature; 0 at T=0 (q is one-hot)
    confidence: Tensor  # [C, K] fp32 max_v q_v, q at the temperature (at 1 when T = 0)


@torch.no_grad()
def replay_drafts(
    drafter: Eagle3Drafter,
    aux_hidden: Tensor,
    input_ids: Tensor,
    anchors: Tensor,
    k: int,
    *,
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
    forced: Tensor | None = None,
) -> Chains:
    """Draft K tokens from each anchor e of one sequence, as the decoder would from prefix y<e.

    aux_hidden [T, 3H_t] (target features of the sequence), input_ids [T], anchors [C] with
    2 <= e <= T (repeat an anchor for several samples). One drafter pass runs the prefix rows
    0..max(e)-2; chain c starts at row e_c - 2 and each later step runs all C chains as one
    forward whose mask lets chain c see the prefix rows <= e_c - 2 and its own earlier chain keys.
    T=0 drafts the argmax, T>0 samples q = softmax(logits / T) with `generator`. `forced` [C, K]
    (target ids in the draft vocab) feeds given drafts instead, to score a logged block.
    """
    device = drafter.fc.weight.device
    ids = torch.as_tensor(input_ids, dtype=torch.long, device=device).reshape(-1)  # [T]
    anchors = torch.as_tensor(anchors, dtype=torch.long, device=device).reshape(-1)  # [C]
    T, C = ids.numel(), anchors.numel()
    if aux_hidden.shape[0] != T:
        raise ValueError(f"aux_hidden has {aux_hidden.shape[0]} rows for {T} tokens")
    if C == 0 or k < 1:
        raise ValueError(f"need at least one anchor and k >= 1, got {C} anchors and k={k}")
    if int(anchors.min()) < 2 or int(anchors.max()) > T:
        raise ValueError(
            f"anchors must lie in [2, {T}] (anchor e needs drafter row e-2 and token e-1), "
            f"got {anchors.min().item()}..{anchors.max().item()}"
        )
    vocab = drafter.vocab
    if forced is not None:
        forced = vocab.to_draft(torch.as_tensor(forced, dtype=torch.long, device=device))
        if forced.shape != (C, k) or bool((forced < 0).any()):
            raise ValueError(f"forced must be [C={C}, K={k}] target ids inside the draft vocab")

    rows = anchors - 2  # [C]
    width = int(rows.max()) + 1
    cache = DrafterCache()
    hidden = drafter.fuse(aux_hidden[:width].to(device)[None])  # [1, L, H]
    positions = torch.arange(width, device=device)[None]  # [1, L]
    logits, hidden_out = drafter(ids[None, 1 : width + 1], hidden, positions, cache=cache)
    logits, hidden_out = logits[0, rows], hidden_out[:, rows]  # [C, Vd], [1, C, H]
    prefix_visible = torch.arange(width, device=device)[None] <= rows[:, None]  # [C, L]
    own = torch.eye(C, dtype=torch.bool, device=device)  # [C, C]: a chain sees only its own keys

    tokens, logq, confidence = [], [], []
    for j in range(k):
        if j > 0:
            mask = torch.cat([prefix_visible, own.repeat(1, j)], dim=1)[None]  # [1, C, L + C*j]
            logits, hidden_out = drafter(
                tokens[-1][None], hidden_out, (rows + j)[None], attention_mask=mask, cache=cache
            )
            logits = logits[0]  # [C, Vd]
        log_q = torch.log_softmax(logits / (temperature or 1.0), dim=-1)  # [C, Vd]
        if forced is not None:
            draft = forced[:, j]
        elif temperature == 0:
            draft = logits.argmax(-1)
        else:
            draft = torch.multinomial(log_q.exp(), 1, generator=generator)[:, 0]
        picked = log_q.gather(1, draft[:, None])[:, 0]
        logq.append(picked if temperature > 0 else torch.zeros_like(picked))
        confidence.append(log_q.max(-1).values.exp())
        tokens.append(vocab.to_target(draft))  # [C]
    return Chains(
        tokens=torch.stack(tokens, 1),
        logq=torch.stack(logq, 1),
        confidence=torch.stack(confidence, 1),
    )
