"""Drafter losses and acceptance math, as pure functions.

Conventions: q is the drafter's distribution over the draft vocab [.., Vd], p the target's.
Masks are bool [B, T] (True = this position counts). Masked positions are dropped before any
arithmetic, so whatever they hold (even NaN) changes neither the value nor the gradient. Scalar
losses are means over the unmasked positions; with none, the result is a graph-connected 0.

Draft logits may be a `models.head_loss.HeadLogits` (a head not yet applied to its hidden
states) or a `HeadSlots` (slots along dim -2 that each read their own head) wherever the soft
CE, the forward / reverse KL or Draft-OPD's losses read them: the loss is then the fused,
chunked `head_loss`, which never builds the [rows, Vd] logits whole; the same value and
gradients as on the materialized logits.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from models.head_loss import HeadLogits, HeadSlots, by_head, head_loss
from models.teacher import TeacherLogits
from models.vocab import DraftVocab


def _check_mask(mask: Tensor, shape: torch.Size, what: str) -> None:
    if mask.dtype != torch.bool:
        raise TypeError(f"{what} mask must be bool (True = position counts), got {mask.dtype}")
    if mask.shape != shape:
        raise ValueError(f"{what} mask has shape {tuple(mask.shape)}, expected {tuple(shape)}")


def _at_least_fp32(x: Tensor) -> Tensor:
    # bf16/fp16 logits are upcast for the softmax; fp64 stays fp64 (gradcheck).
    return x.to(torch.promote_types(x.dtype, torch.float32))


def masked_mean(values: Tensor, mask: Tensor) -> Tensor:
    """Mean of `values` [..] over positions where `mask` [..] is True (graph-connected 0 if none)."""
    _check_mask(mask, values.shape, "masked_mean")
    picked = values[mask]
    return picked.sum() / max(picked.numel(), 1)


def renormalised_teacher(draft_logits: Tensor, temperature: float) -> Tensor:
    """The training teacher from the target's logits at the draft ids [.., Vd]: softmax over
    them at `temperature`, a one-hot at their argmax at 0 (`teacher_draft_probs`'s
    renormalize=True, which needs no other logit)."""
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if temperature == 0:
        return F.one_hot(draft_logits.argmax(-1), draft_logits.shape[-1]).float()
    return (draft_logits.float() / temperature).softmax(-1)


def teacher_draft_probs(
    target_logits: Tensor | TeacherLogits,
    vocab: DraftVocab,
    temperature: float = 1.0,
    *,
    renormalize: bool = True,
) -> Tensor:
    """Target distribution on the draft vocab: [.., V] logits -> [.., Vd] fp32.

    renormalize=True (the training teacher, as EAGLE-3 does): p restricted to the draft vocab and
    renormalised, i.e. softmax over the draft ids' logits. The drafter can only put mass on draft
    ids, and among such q this teacher is the one cross-entropy / KL pull q towards: the argmin of
    KL(p || q) over q supported on the draft vocab is exactly p restricted and renormalised.

    renormalize=False: the FULL target distribution's mass on each draft id (sums to <= 1; the rest
    lies outside the draft vocab). Use it for acceptance: alpha = sum min(p, q) with q = 0 outside
    the draft vocab, so `acceptance_rate(q, teacher_draft_probs(.., renormalize=False))` is the true
    alpha against the full p, and the outside mass is the ceiling on it.

    temperature 0 is greedy: a one-hot at the argmax (of the draft ids' logits when renormalising;
    of the full vocab otherwise, which is all-zero on the draft vocab when that token is outside it).

    `target_logits` may be a `TeacherLogits` (the same logits reduced in vocabulary blocks; a
    renormalised teacher is then bit for bit the same when one block held the whole vocabulary).
    """
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if target_logits.shape[-1] != vocab.vocab_size:
        raise ValueError(
            f"target_logits last dim is {target_logits.shape[-1]}, the draft vocab maps a "
            f"{vocab.vocab_size}-token target vocab"
        )
    if isinstance(target_logits, TeacherLogits):
        draft = target_logits.draft
        if draft.shape[-1] != vocab.draft_vocab_size:
            raise ValueError(
                f"the teacher holds {draft.shape[-1]} draft ids, the draft vocab has "
                f"{vocab.draft_vocab_size}"
            )
        if renormalize:
            return renormalised_teacher(draft, temperature)
        if temperature == 0:
            top = vocab.to_draft(target_logits.top)  # -1: the argmax lies outside the draft vocab
            hot = F.one_hot(top.clamp_min(0), vocab.draft_vocab_size).float()
            return hot * (top >= 0)[..., None]
        return target_logits.full_mass(temperature)
    ids = vocab.draft_to_target_ids.to(target_logits.device)
    logits = target_logits.float()
    if renormalize:
        return renormalised_teacher(logits[..., ids], temperature)
    if temperature == 0:
        return F.one_hot(logits.argmax(-1), vocab.vocab_size).float()[..., ids]
    return (logits / temperature).softmax(-1)[..., ids]


def draft_to_target_probs(draft_probs: Tensor, vocab: DraftVocab) -> Tensor:
    """Scatter q [.., Vd] into the target vocab [.., V] with zeros outside the draft vocab."""
    out = draft_probs.new_zeros(*draft_probs.shape[:-1], vocab.vocab_size)
    return out.index_copy(-1, vocab.draft_to_target_ids.to(draft_probs.device), draft_probs)


def _rows(mask: Tensor, *tensors: Tensor) -> list[Tensor]:
    _check_mask(mask, tensors[0].shape[:-1], "loss")
    for t in tensors[1:]:
        if t.shape != tensors[0].shape:
            raise ValueError(f"shape mismatch: {tuple(tensors[0].shape)} vs {tuple(t.shape)}")
    return [t[mask] for t in tensors]


def _mean_rows(per_row: Tensor) -> Tensor:
    return per_row.sum() / max(per_row.numel(), 1)


Fused = HeadLogits | HeadSlots
Logits = Tensor | Fused


def _head_rows(
    mask: Tensor, logits: Fused, teacher: Tensor
) -> list[tuple[HeadLogits, tuple[Tensor, ...]]]:
    """The masked-in rows of each head [N, H] and their index into `teacher` (same leading
    shape as the logits): one head, or one per head of `HeadSlots` (slot k at index k of
    dim -2)."""
    _check_mask(mask, logits.shape[:-1], "loss")
    if teacher.shape != logits.shape:
        raise ValueError(f"shape mismatch: {tuple(logits.shape)} vs {tuple(teacher.shape)}")
    if isinstance(logits, HeadLogits):
        index = mask.nonzero(as_tuple=True)
        return [(logits[index], index)]
    groups = []
    for ks in by_head(logits.slots):
        hidden, index = [], []
        for k in ks:
            lead = mask[..., k].nonzero(as_tuple=True)  # [M_k] each
            hidden.append(logits.slots[k].hidden[lead])  # [M_k, H]
            index.append((*lead, torch.full_like(lead[0], k)))
        rows = replace(logits.slots[ks[0]], hidden=torch.cat(hidden))  # [sum M_k, H]
        groups.append((rows, tuple(torch.cat(ix) for ix in zip(*index, strict=True))))
    return groups


def _fused_sum(
    logits: Fused,
    teacher: Tensor,
    mask: Tensor,
    fwd: Tensor,
    rev: Tensor | None = None,
    *,
    entropy: bool = False,
) -> Tensor:
    """`head_loss` over the masked-in rows of every head; fwd, rev the rows' weights in the
    mask's shape."""
    total = [
        head_loss(
            rows, teacher, index, fwd[index], None if rev is None else rev[index], entropy=entropy
        )
        for rows, index in _head_rows(mask, logits, teacher)
    ]
    return total[0] if len(total) == 1 else torch.stack(total).sum()


def _fused_mean(
    logits: Fused, teacher: Tensor, mask: Tensor, *, forward: bool, entropy: bool = False
) -> Tensor:
    """Mean over masked-in rows of the soft CE (forward KL with `entropy`), or of the reverse KL."""
    _check_mask(mask, logits.shape[:-1], "loss")
    n = int(mask.sum())
    weight = torch.full(mask.shape, 1 / max(n, 1), device=mask.device)  # [..]
    if forward:
        return _fused_sum(logits, teacher, mask, weight, entropy=entropy)
    return _fused_sum(logits, teacher, mask, torch.zeros_like(weight), weight)


def soft_cross_entropy(draft_logits: Logits, teacher_probs: Tensor, mask: Tensor) -> Tensor:
    """Mean over masked-in rows of -sum_v p_v log q_v. draft_logits, teacher_probs [B, T, Vd]; mask [B, T]."""
    if isinstance(draft_logits, Fused):
        return _fused_mean(draft_logits, teacher_probs, mask, forward=True)
    logits, p = _rows(mask, draft_logits, teacher_probs)  # [N, Vd]
    return _mean_rows(-(p * _at_least_fp32(logits).log_softmax(-1)).sum(-1))


def materialized(logits: Logits) -> Tensor:
    """Logits as a tensor: a `HeadLogits` / `HeadSlots` computed whole (the unfused path), a
    tensor as is."""
    return logits if isinstance(logits, Tensor) else logits.materialize()


def ttt_loss(
    step_logits: Sequence[Logits],
    step_teachers: Sequence[Tensor],
    step_masks: Sequence[Tensor],
    decay: float = 0.8,
) -> Tensor:
    """EAGLE-3 training-time-test loss: sum_k decay^k * soft_cross_entropy(step k)."""
    if not len(step_logits) == len(step_teachers) == len(step_masks) > 0:
        raise ValueError(
            f"need one teacher and one mask per step: got {len(step_logits)} logits, "
            f"{len(step_teachers)} teachers, {len(step_masks)} masks"
        )
    return sum(
        decay**k * soft_cross_entropy(logits, teacher, mask)
        for k, (logits, teacher, mask) in enumerate(
            zip(step_logits, step_teachers, step_masks, strict=True)
        )
    )


def _forward_kl_rows(logits: Tensor, p: Tensor) -> Tensor:
    # xlogy gives 0 log 0 = 0 where the teacher has no mass.
    return (torch.xlogy(p, p) - p * _at_least_fp32(logits).log_softmax(-1)).sum(-1)


def _reverse_kl_rows(logits: Tensor, p: Tensor) -> Tensor:
    logq = _at_least_fp32(logits).log_softmax(-1)
    # Where p underflows to 0 the exact value is infinite; the clamp keeps it finite and large.
    logp = p.clamp_min(torch.finfo(p.dtype).tiny).log()
    return (logq.exp() * (logq - logp)).sum(-1)


def forward_kl(draft_logits: Logits, teacher_probs: Tensor, mask: Tensor) -> Tensor:
    """Mean KL(p || q) over masked-in rows (mass-covering; = soft CE minus the teacher's entropy)."""
    if isinstance(draft_logits, Fused):
        return _fused_mean(draft_logits, teacher_probs, mask, forward=True, entropy=True)
    logits, p = _rows(mask, draft_logits, teacher_probs)
    return _mean_rows(_forward_kl_rows(logits, p))


def reverse_kl(draft_logits: Logits, teacher_probs: Tensor, mask: Tensor) -> Tensor:
    """Exact mean KL(q || p) over the draft vocab (mode-seeking). p must be normalised on the draft
    vocab (teacher_draft_probs with renormalize=True) and temperature > 0, else the KL is infinite."""
    if isinstance(draft_logits, Fused):
        return _fused_mean(draft_logits, teacher_probs, mask, forward=False)
    logits, p = _rows(mask, draft_logits, teacher_probs)
    return _mean_rows(_reverse_kl_rows(logits, p))


def reverse_kl_sampled(
    logq_of_sample: Tensor,
    logp_of_sample: Tensor,
    mask: Tensor,
    estimator: Literal["k1", "k3"] = "k1",
    gradient: Literal["score", "pathwise"] = "score",
) -> Tensor:
    """Single-sample estimate of KL(q || p) from tokens x ~ q: inputs are log q(x), log p(x) [B, T].

    Values (both unbiased for KL(q || p) under x ~ q, when p is supported inside q's support):
      k1 = log q - log p: can be negative per token, high variance.
      k3 = (r - 1) - log r, r = p/q: never negative, lower variance.
    Gradients w.r.t. the drafter (x is a sample, so it carries no gradient itself):
      "pathwise" differentiates the estimator as written. For k1 that is grad log q(x), whose
        expectation under q is 0: pure noise. For k3 it is (1 - r) grad log q(x), whose expectation
        is grad KL(p || q): the FORWARD KL's gradient, not the reverse one.
      "score" (default) keeps the chosen estimator's value but gives the score-function gradient
        sg(log q - log p) * grad log q(x), unbiased for grad KL(q || p) (on-policy distillation).
    """
    if estimator not in ("k1", "k3"):
        raise ValueError(f"estimator must be 'k1' or 'k3', got {estimator!r}")
    if gradient not in ("score", "pathwise"):
        raise ValueError(f"gradient must be 'score' or 'pathwise', got {gradient!r}")
    _check_mask(mask, logq_of_sample.shape, "reverse_kl_sampled")
    if logp_of_sample.shape != logq_of_sample.shape:
        raise ValueError(
            f"log p {tuple(logp_of_sample.shape)} and log q {tuple(logq_of_sample.shape)} differ"
        )
    logq, logp = _at_least_fp32(logq_of_sample[mask]), _at_least_fp32(logp_of_sample[mask])  # [N]
    log_r = logp - logq
    value = -log_r if estimator == "k1" else log_r.exp() - 1 - log_r
    if gradient == "score":
        value = value.detach() + (logq - logq.detach()) * (-log_r).detach()
    return _mean_rows(value)


def acceptance_rate(q: Tensor, p: Tensor) -> Tensor:
    """alpha = sum_v min(p_v, q_v) [..]: the chance a draft x ~ q survives verification against p."""
    if q.shape != p.shape:
        raise ValueError(f"q {tuple(q.shape)} and p {tuple(p.shape)} must be over the same vocab")
    return torch.minimum(q, p).sum(-1)


def total_variation(q_full: Tensor, p_full: Tensor) -> Tensor:
    """TV(p, q) = 1 - alpha per position [..]. Both over the same support: the full target vocab, or
    the draft vocab with p = teacher_draft_probs(.., renormalize=False) (q is 0 outside it anyway)."""
    return 1 - acceptance_rate(q_full, p_full)


def _fused_opd(
    logits: Fused,
    teacher: Tensor,
    mask: Tensor,
    fitted: Tensor,
    rejected: Tensor,
    weights: Tensor,
    lambda_accept: float,
    lambda_reject: float,
) -> Tensor:
    """One fused pass of Draft-OPD's sum over masked-in rows: forward KL on `fitted`, the
    `weights`-decayed reverse KL on `rejected` (all [B, K]), over the masked-in count."""
    denom = max(int(mask.sum()), 1)
    fwd = lambda_accept * fitted.float() / denom  # [B, K]
    rev = lambda_reject * (weights * rejected.float()) / denom  # [B, K]
    return _fused_sum(logits, teacher, mask, fwd, rev, entropy=True)


def draft_opd_loss(
    draft_logits: Logits,
    teacher_probs: Tensor,
    accepted: Tensor,
    mask: Tensor,
    *,
    gamma: float = 0.8,
    lambda_accept: float = 1.0,
    lambda_reject: float = 1.0,
    fit_boundary: bool = False,
) -> Tensor:
    """Draft-OPD on replayed blocks: forward KL on accepted drafts + gamma^k-decayed reverse KL on rejected.

    draft_logits, teacher_probs [B, K, Vd] (block position k = 0..K-1, teacher renormalised on the
    draft vocab); accepted, mask [B, K] bool. Accepted positions pull q to cover p (forward KL);
    rejected ones push q's mass off tokens p does not want (reverse KL), weighted gamma^k so early
    errors, which cut the accepted length most, dominate. One mean over all masked-in positions
    keeps the accepted/rejected balance the data's.

    `fit_boundary`: the first rejected draft of each replay also takes forward KL, as in
    `block_opd_loss`. Every draft before it was accepted, so its context is on the target's path
    and its teacher is the distribution it should match: the state SFT trains (at the replay's
    first position, the target's own prefix), which reverse KL alone only sharpens toward.
    """
    _check_mask(accepted, mask.shape, "accepted")
    if draft_logits.dim() != 3:
        raise ValueError(f"draft_logits must be [B, K, Vd], got {tuple(draft_logits.shape)}")
    K = draft_logits.shape[1]
    weights = gamma ** torch.arange(K, device=draft_logits.device, dtype=torch.float32)  # [K]
    weights = weights.expand(mask.shape)
    # [B, K] the accepted drafts, and with fit_boundary the first rejected one as well
    fitted = accepted | _on_path(accepted)[0] if fit_boundary else accepted
    if isinstance(draft_logits, Fused):
        return _fused_opd(
            draft_logits,
            teacher_probs,
            mask,
            fitted,
            ~accepted,
            weights,
            lambda_accept,
            lambda_reject,
        )
    fkl_rows = _forward_kl_rows(*_rows(mask & fitted, draft_logits, teacher_probs))
    rkl_rows = _reverse_kl_rows(*_rows(mask & ~accepted, draft_logits, teacher_probs))
    total = (
        lambda_accept * fkl_rows.sum()
        + lambda_reject * (weights[mask & ~accepted] * rkl_rows).sum()
    )
    return total / max(int(mask.sum()), 1)


def _on_path(accepted: Tensor) -> tuple[Tensor, Tensor]:
    """accepted [B, K] -> (on the target's path: every earlier draft accepted, so the accepted
    prefix and the boundary, the first rejected draft; all accepted up to and including k),
    both [B, K] bool."""
    all_before = torch.cumprod(accepted.long(), dim=1).bool()
    on_path = torch.cat([torch.ones_like(accepted[:, :1]), all_before[:, :-1]], dim=1)
    return on_path, all_before


def block_opd_loss(
    draft_logits: Logits,
    teacher_probs: Tensor,
    accepted: Tensor,
    mask: Tensor,
    *,
    gamma: float = 0.8,
    lambda_accept: float = 1.0,
    lambda_reject: float = 1.0,
) -> Tensor:
    """Draft-OPD on a replayed block whose slots do not read the drafts before them (DFlash).

    Shapes and teacher as `draft_opd_loss`. Verification walks the block left to right: the
    accepted slots and the boundary (the first rejected slot) are on the target's path, so
    their teacher (conditioned on the drafted prefix, all accepted) is the distribution the slot
    must match: forward KL there. The boundary and every slot after it are rejected proposals:
    gamma^k-decayed reverse KL pushes q's mass off what p does not want. Unlike a chain, a slot
    after the boundary never saw the rejected draft its teacher read, so it gets no forward KL
    even where its own token happened to be acceptable. The teacher carries no gradient. One
    mean over all masked-in slots, as `draft_opd_loss`.
    """
    _check_mask(accepted, mask.shape, "accepted")
    if draft_logits.dim() != 3:
        raise ValueError(f"draft_logits must be [B, K, Vd], got {tuple(draft_logits.shape)}")
    K = draft_logits.shape[1]
    teacher = teacher_probs.detach()
    on_path, all_before = _on_path(accepted)
    rejected = ~all_before  # [B, K] the boundary and every slot after it
    weights = gamma ** torch.arange(K, device=draft_logits.device, dtype=torch.float32)
    weights = weights.expand(mask.shape)  # [B, K]
    if isinstance(draft_logits, Fused):
        return _fused_opd(
            draft_logits, teacher, mask, on_path, rejected, weights, lambda_accept, lambda_reject
        )
    fkl_rows = _forward_kl_rows(*_rows(mask & on_path, draft_logits, teacher))
    rkl_rows = _reverse_kl_rows(*_rows(mask & rejected, draft_logits, teacher))
    total = (
        lambda_accept * fkl_rows.sum() + lambda_reject * (weights[mask & rejected] * rkl_rows).sum()
    )
    return total / max(int(mask.sum()), 1)


def expected_accepted_length(alphas: Tensor, mask: Tensor | None = None) -> Tensor:
    """sum_k prod_{i<=k} alpha_i per row [B] for alphas [B, K]; maximise it (loss = -mean).

    `mask` [B, K] must be a prefix mask (valid positions first): positions past the replayed block
    contribute nothing and get no gradient.
    """
    if mask is None:
        mask = torch.ones_like(alphas, dtype=torch.bool)
    _check_mask(mask, alphas.shape, "expected_accepted_length")
    if (mask[:, 1:] & ~mask[:, :-1]).any():
        raise ValueError("mask must be a prefix mask per row (True positions first, then False)")
    # The product runs over 1 (not 0) at masked positions so no gradient path crosses them.
    kept = torch.where(mask, alphas, torch.ones_like(alphas))
    return (torch.cumprod(kept, dim=-1) * mask).sum(-1)


def tau_from_alphas(alphas: Tensor, mask: Tensor | None = None) -> Tensor:
    """Expected tokens per target forward, tau = 1 + sum_k prod_{i<=k} alpha_i, per row [B]."""
    return 1 + expected_accepted_length(alphas, mask)


# -- the stages' objectives, composed from the pieces above ---------------------------------


def sft_loss(
    step_logits: Sequence[Logits], step_valid: Sequence[Tensor], teacher: Tensor, decay: float
) -> Tensor:
    """EAGLE-3 TTT soft-CE on teacher-forced rows: step k's row t is scored against the teacher
    at position t+k+1.

    step_logits[k] [B, T, Vd], step_valid[k] [B, T] bool, teacher [B, T, Vd]. Rows past T-k-2
    have no teacher; they are never valid, so slicing them off (views, not shifted copies) is
    exact.
    """
    T = teacher.shape[1]
    spans = [max(T - k - 1, 0) for k in range(len(step_logits))]
    if _one_head(step_logits):
        return _fused_steps(step_logits, step_valid, teacher, spans, decay)
    return ttt_loss(
        [logits[:, :n] for logits, n in zip(step_logits, spans, strict=True)],
        [teacher[:, T - n :] for n in spans],
        [valid[:, :n] for valid, n in zip(step_valid, spans, strict=True)],
        decay,
    )


def _one_head(step_logits: Sequence[Logits]) -> bool:
    """Every step's logits a `HeadLogits` of the same head, read alike (EAGLE-3's, MTP's)."""
    if not step_logits or not all(isinstance(x, HeadLogits) for x in step_logits):
        return False
    first = step_logits[0]
    return all(
        x.weight is first.weight
        and (x.dtype, x.scale, x.chunk_elements) == (first.dtype, first.scale, first.chunk_elements)
        for x in step_logits
    )


def _fused_steps(
    step_logits: Sequence[HeadLogits],
    step_valid: Sequence[Tensor],
    teacher: Tensor,
    spans: Sequence[int],
    decay: float,
) -> Tensor:
    """`sft_loss` as one fused pass over every step's rows: one head-gradient buffer for the
    whole unroll (not one a step), every step's teacher read in place at position t+k+1."""
    T = teacher.shape[1]
    if len(step_valid) != len(step_logits):
        raise ValueError(
            f"need one mask per step: got {len(step_logits)} logits, {len(step_valid)} masks"
        )
    hidden, items, positions, weights = [], [], [], []
    for k, (logits, valid, n) in enumerate(zip(step_logits, step_valid, spans, strict=True)):
        _check_mask(valid, logits.shape[:-1], "loss")
        if logits.shape[-1] != teacher.shape[-1]:
            raise ValueError(f"shape mismatch: {tuple(logits.shape)} vs {tuple(teacher.shape)}")
        b, t = valid[:, :n].nonzero(as_tuple=True)  # [N_k] each
        hidden.append(logits.hidden[b, t])  # [N_k, H]
        items.append(b)
        positions.append(t + T - n)
        weights.append(torch.full((len(b),), decay**k / max(len(b), 1), device=valid.device))
    rows = replace(step_logits[0], hidden=torch.cat(hidden))  # [sum N_k, H]
    return head_loss(rows, teacher, (torch.cat(items), torch.cat(positions)), torch.cat(weights))


EAGLE1_CE_WEIGHT = 0.1
"""EAGLE-1's weight of the token loss beside feature regression (its training script's p_w)."""


def feature_regression(pred_hidden: Tensor, target_hidden: Tensor, mask: Tensor) -> Tensor:
    """EAGLE-1's L_reg: mean over masked-in rows of the per-dimension mean smooth-L1 (beta 1).

    pred_hidden, target_hidden [B, T, H]; mask [B, T]. The target carries no gradient (it is the
    target model's cached state).
    """
    pred, target = _rows(mask, pred_hidden, target_hidden)  # [N, H]
    per_row = F.smooth_l1_loss(
        _at_least_fp32(pred), _at_least_fp32(target.detach()), reduction="none"
    ).mean(-1)  # [N]
    return _mean_rows(per_row)


def eagle1_loss(
    logits: Logits,
    hidden_out: Tensor,
    valid: Tensor,
    teacher: Tensor,
    target_hidden: Tensor,
    ce_weight: float = EAGLE1_CE_WEIGHT,
) -> Tensor:
    """EAGLE-1's objective on one teacher-forced (not unrolled) drafter step:
    L_reg(h_t, f_{t+1}) + ce_weight * soft-CE(q_t, p_{t+1}).

    Row t reads the target feature at position t and token x_{t+1} and predicts x_{t+2}. In a
    chain, its hidden_out h_t is what the next step reads at position t+1 in place of a target
    feature, so it regresses onto the target's state at t+1 (`target_hidden`, whose LM head
    gives p_{t+1}, the teacher of x_{t+2}); the token loss is the one `sft_loss` puts on step 0.

    logits [B, T, Vd], hidden_out [B, T, H], valid [B, T] bool (row t valid iff x_{t+2} is
    trained on), teacher [B, T, Vd], target_hidden [B, T, H]; teacher and target_hidden are per
    sequence position. Rows past T-2 have no position t+1 and are never valid, so slicing them
    off is exact.
    """
    n = max(teacher.shape[1] - 1, 0)
    rows = valid[:, :n]
    reg = feature_regression(hidden_out[:, :n], target_hidden[:, 1:], rows)
    ce = soft_cross_entropy(logits[:, :n], teacher[:, 1:], rows)
    return reg + ce_weight * ce


def ce_rollout_loss(
    step_logits: Sequence[Logits],
    step_valid: Sequence[Tensor],
    teacher: Tensor,
    anchor_rows: Tensor,
    decay: float,
) -> Tensor:
    """`sft_loss` on the rows of a replay unroll that read ground truth: every row at step 0,
    and at later steps every row but the anchors (which read replayed tokens).

    anchor_rows [B, T] bool; the rest as in `sft_loss`.
    """
    valid = [v if k == 0 else v & ~anchor_rows for k, v in enumerate(step_valid)]
    return sft_loss(step_logits, valid, teacher, decay)


ReplayLoss = Literal["draft_opd", "reverse_kl_k1", "reverse_kl_k3", "tv", "expected_length"]


def replay_loss(
    loss: ReplayLoss,
    logits: Logits,
    target_logits: Tensor,
    tokens: Tensor,
    accepted: Tensor,
    mask: Tensor,
    vocab: DraftVocab,
    *,
    temperature: float,
    gamma: float = 0.8,
    lambda_accept: float = 1.0,
    lambda_reject: float = 1.0,
    fit_boundary: bool = False,
    blocks: bool = False,
) -> Tensor:
    """The Draft-OPD objective on replayed blocks.

    logits [N, K, Vd]: the drafter along each replay; target_logits [N, K, V]: the target's
    logits at the state predicting each replayed token; tokens [N, K]: the replayed target ids
    (drafted, so inside the draft vocab); accepted, mask [N, K] bool. `blocks`: the drafter's
    slots do not read earlier drafts (`Drafter.drafts_blocks`): draft_opd is then its block
    form (`block_opd_loss`); callers refuse what `block_loss_error` names before any work.
    """
    scaled = logits / temperature
    if loss != "draft_opd":  # the replays' few rows: these losses read q whole
        scaled = materialized(scaled)
    if loss == "draft_opd":
        teacher = teacher_draft_probs(target_logits, vocab, temperature)
        weights = {"gamma": gamma, "lambda_accept": lambda_accept, "lambda_reject": lambda_reject}
        if blocks:  # the block form always fits the boundary
            return block_opd_loss(scaled, teacher, accepted, mask, **weights)
        return draft_opd_loss(scaled, teacher, accepted, mask, fit_boundary=fit_boundary, **weights)
    if loss in ("reverse_kl_k1", "reverse_kl_k3"):
        draft_ids = vocab.to_draft(tokens)[..., None]  # [N, K, 1]
        logq = scaled.log_softmax(-1).gather(-1, draft_ids)[..., 0]
        teacher = teacher_draft_probs(target_logits, vocab, temperature)
        logp = (
            teacher.gather(-1, draft_ids)[..., 0].clamp_min(torch.finfo(torch.float32).tiny).log()
        )
        return reverse_kl_sampled(logq, logp, mask, estimator=loss[-2:])
    q = scaled.softmax(-1)
    p_full = teacher_draft_probs(target_logits, vocab, temperature, renormalize=False)
    if loss == "tv":
        return masked_mean(total_variation(q, p_full), mask)
    if loss == "expected_length":
        return -expected_accepted_length(acceptance_rate(q, p_full), mask).mean()
    raise ValueError(f"unknown loss {loss!r}")


def block_loss_error(loss: ReplayLoss, positions: str) -> str | None:
    """Why `loss` over all replayed positions does not apply to a block drafter, or None.

    tv and the sampled reverse KLs fit every slot to its teacher alike; after the first
    rejection that teacher read a rejected draft which a block's slot never saw, so they would
    pull the slot towards a distribution verification never tests it against. draft_opd (its
    block form: only decayed reverse KL there) and expected_length (each slot weighted by the
    chance verification reaches it) apply, as does any loss on the reached positions only."""
    if positions == "reached" or loss in ("draft_opd", "expected_length"):
        return None
    return (
        f"opd.loss={loss} over all replayed positions does not apply to a block drafter (a "
        "slot after the first rejection never saw the draft its teacher read); use "
        "opd.loss=draft_opd or expected_length, or opd.positions=reached"
    )
