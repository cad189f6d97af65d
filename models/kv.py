"""KV caches of batched rows that accept different lengths, and the masks over them.

Rows of a batch commit different numbers of tokens per verify step, so no cache is cropped per
row: every row carries a slot-validity mask over its cache (rejected drafts stay as invalid
slots) and every forward gets a bool [B, T, S] mask built from it. Slots past the longest row
are cropped. The target's cache (transformers' DynamicCache) and every drafter's own cache
follow these rules.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor


class KVCache:
    """A drafter's own KV cache: per layer, k and v [B, n_kv, S, d]."""

    def __init__(self) -> None:
        self.keys: list[Tensor] = []
        self.values: list[Tensor] = []

    @property
    def length(self) -> int:
        return self.keys[0].shape[2] if self.keys else 0

    def append(self, k: Tensor, v: Tensor, layer: int = 0) -> tuple[Tensor, Tensor]:
        """Add new keys/values [B, n_kv, T, d] and return all of them [B, n_kv, S, d]."""
        if layer == len(self.keys):
            self.keys.append(k)
            self.values.append(v)
        else:
            self.keys[layer] = torch.cat([self.keys[layer], k], dim=2)
            self.values[layer] = torch.cat([self.values[layer], v], dim=2)
        return self.keys[layer], self.values[layer]

    def crop(self, n: int) -> None:
        """Keep the first n positions (drop the keys of rejected drafts)."""
        if not 0 <= n <= self.length:
            raise ValueError(f"cannot crop a cache of length {self.length} to {n}")
        self.keys = [k[:, :, :n] for k in self.keys]
        self.values = [v[:, :, :n] for v in self.values]

    def select_rows(self, rows: Tensor) -> None:
        """Keep batch rows `rows` [B'] (finished sequences leave the batch)."""
        self.keys = [k[rows] for k in self.keys]
        self.values = [v[rows] for v in self.values]


def extend_mask(valid: Tensor, new_valid: Tensor) -> Tensor:
    """bool [B, T, S+T]: new rows see the valid cached slots, earlier valid new rows and themselves.

    valid [B, S] cached slots, new_valid [B, T] which new rows are real (padding rows see only
    themselves, so their softmax is never empty).
    """
    batch, width = new_valid.shape
    device = valid.device
    causal = torch.ones(width, width, dtype=torch.bool, device=device).tril()
    new_part = (causal & new_valid[:, None, :]) | torch.eye(width, dtype=torch.bool, device=device)
    return torch.cat([valid[:, None, :].expand(-1, width, -1), new_part], dim=2)


def valid_upto(width: int, accepted: Tensor, device: torch.device) -> Tensor:
    """bool [B, width]: slot j is valid iff j <= accepted (the fed last token + accepted drafts)."""
    return torch.arange(width, device=device)[None] <= accepted[:, None]


def trim_slots(valid: Tensor, cache: Any, crop: Callable[[Any, int], None] | None = None) -> Tensor:
    """Crop trailing cache slots that no row uses; returns the trimmed validity mask [B, S']."""
    used = valid.any(0).nonzero()
    keep = int(used[-1]) + 1 if used.numel() else 0
    if keep < valid.shape[1]:
        if crop is None:
            cache.crop(keep)
        else:
            crop(cache, keep)
        valid = valid[:, :keep]
    return valid


class CachedRows:
    """A proposer's own KV cache with which of its slots are real per batch row; the base of the
    proposers that keep one across verify steps (`keep_rows` of the `Proposer` protocol)."""

    def __init__(self) -> None:
        self.cache = KVCache()
        self.valid: Tensor | None = None  # [B, S] which cached slots are real

    def keep_rows(self, rows: Tensor) -> None:
        if self.valid is None:  # rows finished before the first proposal: nothing cached yet
            return
        self.cache.select_rows(rows)
        self.valid = trim_slots(self.valid[rows], self.cache)
