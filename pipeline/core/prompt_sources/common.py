"""What every prompt source shares: the row, ids cut from one tokenization, the split's seeded
sample."""

from __future__ import annotations

import hashlib
import json
import random
from collections import Counter
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from pipeline.core.prompt_sources.config import PromptsConfig


SPLITS = ("train", "heldout")
ROLES = frozenset({"system", "user", "assistant"})
_BATCH = 256  # source candidates tokenized per call


Row = dict


def _require_fast(tokenizer: PreTrainedTokenizerBase) -> None:
    if not tokenizer.is_fast:
        raise ValueError(
            f"{type(tokenizer).__name__} is a slow tokenizer; prompts need character offsets, "
            "load the tokenizer with use_fast=True (a tokenizer.json)"
        )


def _prompt_id(prompt_text: str, reference_ids: list[int]) -> str:
    h = hashlib.sha256(prompt_text.encode())
    h.update(json.dumps(reference_ids).encode())
    return h.hexdigest()[:16]


def _split_ids(
    ids: list[int], offsets: list[tuple[int, int]], boundary: int, max_reference_tokens: int
) -> tuple[list[int], list[int]]:
    """Prompt = the tokens ending at or before char `boundary`; the reference follows, capped."""
    k = 0
    while k < len(ids) and offsets[k][1] <= boundary:
        k += 1
    return ids[:k], ids[k : k + max_reference_tokens]


def _finish(
    rows: list[Row], skipped: Counter, cfg: PromptsConfig
) -> tuple[list[Row], dict[str, int]]:
    """Deduplicate by prompt text (held-out wins, so no prompt is in both splits), then take a
    seeded sample of at most the configured rows per split."""
    heldout_texts = {r["prompt_text"] for r in rows if r["split"] == "heldout"}
    seen: set[tuple[str, str]] = set()
    unique = []
    for r in rows:
        key = (r["split"], r["prompt_text"])
        if key in seen or (r["split"] == "train" and r["prompt_text"] in heldout_texts):
            skipped["duplicate"] += 1
            continue
        seen.add(key)
        unique.append(r)
    out = []
    for split, cap in (("train", cfg.max_train_rows), ("heldout", cfg.max_heldout_rows)):
        members = [r for r in unique if r["split"] == split]
        random.Random(f"{cfg.seed}:{split}").shuffle(members)
        out += members[:cap]
    return out, dict(skipped)
