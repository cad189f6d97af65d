"""A drafter's vocabulary head and its loss, fused: the [rows, V] logits are never whole.

A drafter's training forward ends in a head [V, H] over post-norm hidden states; each loss
then reads the logits' log-softmax against a teacher. Unfused, every unrolled step keeps its
[tokens, V] fp32 logits, their log-softmax and the pieces of the backward alive at once: at
4,096 tokens, a 32k draft vocabulary and 7 steps, several GB that are only ever read row by
row. `HeadLogits` stands in for such logits without computing them (post-norm hidden states
and the head's weight), and `head_loss` is one autograd function that walks it a chunk of rows
at a time: logits, log-softmax, the loss and its gradient with respect to those logits, which
two matmuls turn into the gradients of the hidden states and the head's weight. The loss is a
scalar, so its gradient is fixed up to the incoming scale: it is computed in the forward, with
the logits still at hand (no recomputation: the FLOPs of the unfused step), and the backward
only scales it. At most `HEAD_CHUNK_ELEMENTS` logits exist at once.

Per row n (logits z_n, q = softmax(z_n * scale), teacher p_n on the same vocabulary), with
weights a_n (forward) and b_n (reverse), the function returns sum_n of
    a_n * (-sum_v p log q  [+ sum_v p log p with `entropy`: the forward KL])
  + b_n * sum_v q (log q - log max(p, tiny))   (the reverse KL, `models.losses.reverse_kl`)
and its gradient with respect to z_n is scale * (a_n (sum(p) q - p) + b_n q (a - sum q a)),
a = log q - log p. `models.losses` builds the soft CE, the TTT loss, the forward / reverse KL
and Draft-OPD's losses on it whenever its logits are a `HeadLogits`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import Tensor

HEAD_CHUNK_ELEMENTS = 1 << 22
"""The most logits (rows x vocabulary) one chunk of `head_loss` computes: 16 MiB in fp32, with
four such temporaries a chunk. At SmolLM2's width that is 512 rows of an 8k draft vocabulary
(128 of 32k): a [rows, H] x [H, V] product still large enough to run at the matmul's speed,
while a chunk's temporaries stay far below the unfused [tokens, V] tensors of every step."""


@dataclass(frozen=True)
class HeadLogits:
    """Logits [.., V] = (hidden @ weight.T) * scale, not computed until a loss reads them.

    `hidden` [.., H] post-norm states (with their graph), `weight` [V, H] the head (a
    parameter, or frozen). `dtype` is the product's dtype: bf16 when the forward that made
    them ran under bf16 autocast, as the unfused head's matmul would have, else the inputs'.
    Indexing selects rows (any index but the last dimension's), as on a logits tensor.
    `chunk_elements`: the most logits a loss reading it computes at once.
    """

    hidden: Tensor
    weight: Tensor
    dtype: torch.dtype
    scale: float = 1.0
    chunk_elements: int = HEAD_CHUNK_ELEMENTS

    @classmethod
    def of(cls, hidden: Tensor, weight: Tensor) -> HeadLogits:
        """The head over `hidden` as a forward running now would compute it (autocast or not)."""
        device = hidden.device.type
        if torch.is_autocast_enabled(device):
            dtype = torch.get_autocast_dtype(device)
        else:
            dtype = torch.promote_types(hidden.dtype, weight.dtype)
        return cls(hidden, weight, dtype)

    @property
    def shape(self) -> torch.Size:
        return torch.Size((*self.hidden.shape[:-1], self.weight.shape[0]))

    @property
    def device(self) -> torch.device:
        return self.hidden.device

    def dim(self) -> int:
        return self.hidden.dim()

    def __getitem__(self, index: object) -> HeadLogits:
        return replace(self, hidden=self.hidden[index])

    def __truediv__(self, temperature: float) -> HeadLogits:
        return replace(self, scale=self.scale / temperature)

    def materialize(self) -> Tensor:
        """The logits themselves [.., V] fp32, as the unfused head returns them."""
        logits = F.linear(self.hidden.to(self.dtype), self.weight.to(self.dtype)).float()
        return logits * self.scale if self.scale != 1.0 else logits

    @torch.no_grad()
    def argmax(self, dim: int = -1) -> Tensor:
        """The argmax over the vocabulary [..], a chunk of rows at a time."""
        if dim not in (-1, self.hidden.dim() - 1):
            raise ValueError(f"a head's argmax is over the vocabulary (dim -1), got dim={dim}")
        flat = self.hidden.reshape(-1, self.hidden.shape[-1])  # [N, H]
        weight = self.weight.to(self.dtype)
        rows = _chunk_rows(len(flat), self.weight.shape[0], self.chunk_elements)
        top = [
            F.linear(flat[i : i + rows].to(self.dtype), weight).argmax(-1)
            for i in range(0, len(flat), rows)
        ]
        return (
            torch.cat(top).reshape(self.hidden.shape[:-1])
            if top
            else flat.new_zeros(self.hidden.shape[:-1], dtype=torch.long)
        )


@dataclass(frozen=True)
class HeadSlots:
    """Logits [.., K, V] whose K slots each read their own head (Medusa's heads): slot k is
    `slots[k]` [.., V]. Stands in for the stacked logits where a loss reads them fused, one
    `head_loss` per head (`by_head`); `materialize` stacks them whole (the unfused path)."""

    slots: tuple[HeadLogits, ...]

    @property
    def shape(self) -> torch.Size:
        first = self.slots[0].shape
        return torch.Size((*first[:-1], len(self.slots), first[-1]))

    @property
    def device(self) -> torch.device:
        return self.slots[0].device

    def dim(self) -> int:
        return self.slots[0].dim() + 1

    def __truediv__(self, temperature: float) -> HeadSlots:
        return HeadSlots(tuple(x / temperature for x in self.slots))

    def materialize(self) -> Tensor:
        """The logits themselves [.., K, V] fp32."""
        return torch.stack([x.materialize() for x in self.slots], dim=-2)


def by_head(slots: Sequence[HeadLogits]) -> list[list[int]]:
    """The slots' indices grouped by the head they read alike (weight, dtype, scale, chunk):
    one `head_loss` a group keeps one head-gradient buffer for all of its slots."""
    groups: dict[tuple, list[int]] = {}
    for k, x in enumerate(slots):
        groups.setdefault((id(x.weight), x.dtype, x.scale, x.chunk_elements), []).append(k)
    return list(groups.values())


def _chunk_rows(n: int, vocab: int, chunk_elements: int) -> int:
    """Rows a chunk of n: at most chunk_elements // vocab, the n split into equal chunks. Each
    chunk's product reads the whole head, so a short last chunk (11 rows after ten of 85, for
    MTP's 49k-id head) costs nearly a full chunk's time."""
    if chunk_elements < 1:
        raise ValueError(f"chunk_elements must be >= 1, got {chunk_elements}")
    most = max(1, chunk_elements // vocab)
    chunks = max(1, -(-n // most))
    return max(1, -(-n // chunks))


def chunk_loss_and_grad(
    z: Tensor, p: Tensor, fwd: Tensor, rev: Tensor | None, entropy: bool
) -> tuple[Tensor, Tensor, Tensor]:
    """One chunk's weighted loss rows [c], and the gradient of their sum w.r.t. the scaled
    logits z [c, V] fp32 as (g [c, V], row factor [c]): g * factor[:, None]. p [c, V] the
    teacher, fwd / rev [c] the rows' weights (module docstring). The [c, V] passes are
    memory-bound, so the CE's gradient is built in place and its row weights are left to
    the [c, H] side of the matmuls."""
    logq = z.log_softmax(-1)  # [c, V]
    loss = -torch.bmm(p[:, None, :], logq[:, :, None]).view(-1)  # [c]: -sum_v p log q
    if entropy:
        loss = loss + torch.xlogy(p, p).sum(-1)
    mass = p.sum(-1, keepdim=True)  # [c, 1]
    if rev is None:
        g = logq.exp_().mul_(mass).sub_(p)  # sum(p) q - p
        return fwd * loss, g, fwd
    q = logq.exp()
    a = logq.sub_(p.clamp_min(torch.finfo(p.dtype).tiny).log())  # [c, V] log q - log p
    rkl = torch.bmm(q[:, None, :], a[:, :, None]).view(-1)  # [c]
    g = q * (fwd[:, None] * mass) - p * fwd[:, None]
    g += q * a.sub_(rkl[:, None]) * rev[:, None]
    return fwd * loss + rev * rkl, g, torch.ones_like(fwd)


class _HeadLoss(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        hidden: Tensor,  # [N, H]
        weight: Tensor,  # [V, H]
        teacher: Tensor,  # [M, V]
        teacher_rows: Tensor,  # [N] the row of `teacher` each row is scored against
        fwd: Tensor,  # [N]
        rev: Tensor | None,  # [N]
        dtype: torch.dtype,
        scale: float,
        entropy: bool,
        chunk_elements: int,
    ) -> Tensor:
        wants_hidden, wants_weight = ctx.needs_input_grad[:2]
        w = weight.to(dtype)
        rows = _chunk_rows(hidden.shape[0], weight.shape[0], chunk_elements)
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad_hidden = torch.zeros_like(hidden, dtype=torch.float32) if wants_hidden else None
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if wants_weight else None
        for i in range(0, hidden.shape[0], rows):
            h = hidden[i : i + rows].to(dtype)  # [c, H]
            z = F.linear(h, w).float()  # [c, V]
            if scale != 1.0:
                z = z * scale
            p = teacher.index_select(0, teacher_rows[i : i + rows]).float()  # [c, V]
            r = rev[i : i + rows] if rev is not None else None
            loss, g, factor = chunk_loss_and_grad(z, p, fwd[i : i + rows], r, entropy)
            total += loss.sum()
            if grad_hidden is None and grad_weight is None:
                continue
            g = g.to(dtype)  # [c, V]
            factor = (factor * scale)[:, None]  # [c, 1]
            if grad_hidden is not None:
                grad_hidden[i : i + rows] = (g @ w).float() * factor  # [c, H]
            if grad_weight is not None:
                grad_weight += (g.T @ (h.float() * factor).to(dtype)).float()  # [V, H]
        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.dtypes = (hidden.dtype, weight.dtype)
        return total

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        grad_hidden, grad_weight = ctx.saved_tensors
        hidden_dtype, weight_dtype = ctx.dtypes
        gh = (grad_hidden * grad_out).to(hidden_dtype) if grad_hidden is not None else None
        gw = (grad_weight * grad_out).to(weight_dtype) if grad_weight is not None else None
        return gh, gw, None, None, None, None, None, None, None, None


def head_loss(
    logits: HeadLogits,
    teacher: Tensor,
    teacher_rows: tuple[Tensor, ...],
    fwd: Tensor,
    rev: Tensor | None = None,
    *,
    entropy: bool = False,
) -> Tensor:
    """sum_n of the rows' weighted losses (module docstring), fused and chunked.

    logits: the rows' head [N, V] (a `HeadLogits` of 2-d hidden states); teacher [.., V] (no
    gradient; contiguous, else copied) and teacher_rows, one [N] non-negative index per
    leading dim of it: the row each logits row is scored against, read a chunk at a time so
    that shifted teachers are never copied whole; fwd, rev [N] the rows' weights on the soft
    CE (forward KL with `entropy`) and on the reverse KL (None: 0).
    """
    if logits.hidden.dim() != 2:
        raise ValueError(f"head_loss reads [N, H] rows, got {tuple(logits.hidden.shape)}")
    n = logits.hidden.shape[0]
    if teacher.dim() != len(teacher_rows) + 1 or teacher.shape[-1] != logits.weight.shape[0]:
        raise ValueError(
            f"teacher {tuple(teacher.shape)} must be [{len(teacher_rows)} leading dims, "
            f"{logits.weight.shape[0]}] (one index per leading dim; the head's vocab)"
        )
    for name, t in (*(("teacher_rows", ix) for ix in teacher_rows), ("fwd", fwd), ("rev", rev)):
        if t is not None and tuple(t.shape) != (n,):
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected ({n},)")
    grads = torch.is_grad_enabled()  # else no gradient is computed, not even in the forward
    # one flat row index: index_select copies a chunk's rows faster than a tuple index does
    # (5.4 against 7.5 ms for MTP's [85, 49152] chunk on this project's Xeon, fp32)
    teacher = teacher.detach().contiguous()  # the teachers the losses pass are: no copy
    flat = torch.zeros(n, dtype=torch.long, device=teacher.device)  # [N]
    for size, ix in zip(teacher.shape[:-1], teacher_rows, strict=True):
        flat = flat * size + ix
    return _HeadLoss.apply(
        logits.hidden if grads else logits.hidden.detach(),
        logits.weight if grads else logits.weight.detach(),
        teacher.view(-1, teacher.shape[-1]),
        flat,
        fwd.float(),
        None if rev is None else rev.float(),
        logits.dtype,
        logits.scale,
        entropy,
        logits.chunk_elements,
    )
