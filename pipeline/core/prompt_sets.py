"""Which prompts of a `prompts` dataset a stage decodes (generate, rollout)."""

from __future__ import annotations

import polars as pl

from storage import Dataset, OpdError


def select_prompts(prompts: Dataset, split: str, max_prompts: int, skip: int = 0) -> list[dict]:
    """Prompts `skip` .. `skip + max_prompts` of `split`, in the dataset's order."""
    lf = prompts.scan().filter(pl.col("split") == split).slice(skip, max_prompts)
    rows = lf.select("prompt_id", "prompt_ids").collect().to_dicts()
    if not rows:
        there = prompts.scan().filter(pl.col("split") == split).select(pl.len()).collect()
        raise OpdError(
            f"{prompts.ref} has no {split!r} prompts past the first {skip} "
            f"(it has {there.item()}): build prompts with that split (`opd run prompts`), "
            "choose another split, or skip fewer prompts"
        )
    return rows
