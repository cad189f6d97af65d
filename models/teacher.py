"""The training teacher, recomputed from stored hidden states in bounded memory.

Training reads three things from the target's logits at a cached post-norm hidden state: the
logits at the draft-vocab ids (the teacher on the draft vocab), the full vocabulary's argmax (T=0
acceptance) and its log-normaliser at a temperature (the full distribution's mass on the draft
ids, for acceptance and the TV / expected-length losses). At a 128k vocabulary the [rows, V]
fp32 logits of a batch are 0.5 MB a row (16 GB for 16 x 2k tokens), so `teacher_logits` runs
the LM head over blocks of vocabulary columns and keeps only those three reductions: at most
`BLOCK_ELEMENTS` logits exist at once, plus the [rows, Vd] draft logits training needs anyway.
When one block covers the whole vocabulary, the draft logits are bit for bit the plain head's.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

BLOCK_ELEMENTS = 1 << 26
"""The most target logits (rows x vocabulary columns) one block holds: 256 MiB in fp32."""


@dataclass
class TeacherLogits:
    """The target's logits over the full vocabulary, reduced to what training reads.

    It stands in for the [.., V] logits tensor where the pipeline reads only these views
    (`models.losses.teacher_draft_probs`, the drafters' acceptance statistics): `shape` is the
    full logits' shape, `argmax(-1)` the full vocabulary's argmax.
    """

    draft: Tensor  # [.., Vd] fp32: logits at the draft ids, in draft-id order
    top: Tensor  # [..] int64: argmax over the full vocabulary (a target id)
    # T -> [..] fp32: logsumexp over the full vocabulary of logits/T (empty from `ArgmaxCache`)
    log_norm: dict[float, Tensor]
    vocab_size: int

    @property
    def shape(self) -> torch.Size:
        return torch.Size((*self.top.shape, self.vocab_size))

    @property
    def device(self) -> torch.device:
        return self.draft.device

    def argmax(self, dim: int = -1) -> Tensor:
        if dim not in (-1, len(self.top.shape)):
            raise ValueError(f"a teacher's argmax is over the vocabulary (dim -1), got dim={dim}")
        return self.top

    def full_mass(self, temperature: float) -> Tensor:
        """The full softmax(logits / T)'s mass on each draft id: [.., Vd] (sums to <= 1)."""
        if temperature not in self.log_norm:
            raise ValueError(
                f"this teacher was computed for temperatures {sorted(self.log_norm)}, not "
                f"{temperature}: pass it to teacher_logits(..., temperatures=...)"
            )
        return (self.draft / temperature - self.log_norm[temperature][..., None]).exp()


@torch.no_grad()
def teacher_logits(
    last_hidden: Tensor,
    lm_head_weight: Tensor,
    draft_ids: Tensor,
    temperatures: Iterable[float] = (),
    *,
    block_elements: int = BLOCK_ELEMENTS,
) -> TeacherLogits:
    """`TeacherLogits` of post-norm hidden states [.., H] through the head [V, H].

    draft_ids [Vd]: strictly increasing target ids (`DraftVocab.draft_to_target_ids`). The
    log-normaliser is kept at T = 1 and at every positive temperature in `temperatures`.
    """
    vocab, width = lm_head_weight.shape
    lead = last_hidden.shape[:-1]
    hidden = last_hidden.reshape(-1, width).to(lm_head_weight)  # [N, H]
    rows = hidden.shape[0]
    ids = draft_ids.to(lm_head_weight.device)
    columns = max(1, block_elements // max(rows, 1))  # vocabulary columns per block
    temps = sorted({1.0, *(float(t) for t in temperatures if t > 0)})
    draft = torch.empty(rows, ids.numel(), dtype=torch.float32, device=hidden.device)
    top_value = torch.full((rows,), -torch.inf, device=hidden.device)
    top = torch.zeros(rows, dtype=torch.int64, device=hidden.device)
    norms = {t: torch.full((rows,), -torch.inf, device=hidden.device) for t in temps}
    bounds = torch.searchsorted(ids, torch.arange(0, vocab + columns, columns, device=ids.device))
    for i, start in enumerate(range(0, vocab, columns)):
        block = F.linear(hidden, lm_head_weight[start : start + columns]).float()  # [N, c]
        lo, hi = int(bounds[i]), int(bounds[i + 1])
        draft[:, lo:hi] = block[:, ids[lo:hi] - start]
        value, index = block.max(-1)
        better = value > top_value  # strict: the first maximum wins, as argmax does
        top_value = torch.where(better, value, top_value)
        top = torch.where(better, index + start, top)
        for t in temps:
            norms[t] = torch.logaddexp(norms[t], (block / t).logsumexp(-1))
        del block
    return TeacherLogits(
        draft.reshape(*lead, -1),
        top.reshape(lead),
        {t: n.reshape(lead) for t, n in norms.items()},
        vocab,
    )


@torch.no_grad()
def draft_logits(last_hidden: Tensor, lm_head_weight: Tensor, draft_ids: Tensor) -> Tensor:
    """The target's logits at the draft ids only: post-norm hidden [.., H] -> [.., Vd] fp32, at
    Vd/V of the whole head's cost. All that a renormalised training teacher reads
    (`models.losses.renormalised_teacher`); equal to `teacher_logits(..).draft` up to the float
    rounding of a product of another shape."""
    # a draft vocabulary of every id (MTP's) is the head itself: no [V, H] copy a step
    whole = len(draft_ids) == lm_head_weight.shape[0]  # strictly increasing ids: 0..V-1
    weight = lm_head_weight if whole else lm_head_weight[draft_ids.to(lm_head_weight.device)]
    return F.linear(last_hidden.to(lm_head_weight), weight).float()


class ArgmaxCache:
    """The full vocabulary's argmax at every position of the sequences one training run reads,
    computed the first time a sequence is read and kept for the epochs after it.

    An SFT step reads two things from the target's logits (`pipeline.stages.sft.train_step`):
    the draft ids' logits (its loss, through the renormalised teacher) and the full vocabulary's
    argmax (its T=0 acceptance). The first is a [Vd, H] product; the second needs the whole
    [V, H] head: 6x the draft head at SmolLM2's 49k / 8k ids, 4x at Llama 3's 128k / 32k, and on
    this project's CPUs most of an SFT step's teacher time, paid again every epoch for the same
    hidden states. The argmax is the same in every epoch, so it is kept (4 bytes a token) and
    later epochs run only the draft head. Rows are keyed by their row id in one
    `pipeline.core.training.FeatureIndex`; a row read again with another length is refused.
    """

    def __init__(self, lm_head_weight: Tensor, draft_ids: Tensor) -> None:
        self.weight = lm_head_weight  # [V, H]
        self.draft_ids = draft_ids  # [Vd] strictly increasing target ids
        self._top: dict[int, Tensor] = {}  # row id -> [length] int32, on the CPU

    def __len__(self) -> int:
        return len(self._top)

    @torch.no_grad()
    def teacher(self, last_hidden: Tensor, rows: Tensor, lengths: Tensor) -> TeacherLogits:
        """`TeacherLogits` without log-normalisers of post-norm states [B, T, H] of index rows
        `rows` [B] of `lengths` [B] (right-padded): the draft logits at every position, the full
        argmax from the cache (0 past each length)."""
        B, T, _ = last_hidden.shape
        hidden = last_hidden.to(self.weight)
        draft = draft_logits(hidden, self.weight, self.draft_ids)  # [B, T, Vd]
        ids, sizes = rows.tolist(), lengths.tolist()
        for row, n in zip(ids, sizes, strict=True):
            if row in self._top and len(self._top[row]) != n:
                raise ValueError(
                    f"row {row} was read with {len(self._top[row])} tokens and now with {n}: "
                    "an ArgmaxCache serves the rows of one FeatureIndex only"
                )
        missing = [i for i, row in enumerate(ids) if row not in self._top]
        if missing:
            full = teacher_logits(hidden[missing], self.weight, self.draft_ids)  # top [M, T]
            for j, i in enumerate(missing):
                self._top[ids[i]] = full.top[j, : sizes[i]].to("cpu", torch.int32)
        top = torch.zeros(B, T, dtype=torch.int64)
        for i, row in enumerate(ids):
            top[i, : sizes[i]] = self._top[row]
        return TeacherLogits(draft, top.to(draft.device), {}, self.weight.shape[0])
