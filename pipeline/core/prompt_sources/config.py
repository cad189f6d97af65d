"""The prompts stage's config: where prompts come from and how Magpie samples them (below the
stage, so each source module reads it without importing the stage)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator

from pipeline.core.config import StrictConfig, optional_field
from pipeline.core.prompt_sources.heldout import HUMANEVAL, heldout_set_name
from pipeline.core.prompt_sources.hf_datasets import HF_PREFIX, HfSource


class MagpieConfig(StrictConfig):
    """`source=magpie`: how user turns are sampled from the target."""

    rows: int = Field(600, ge=1)
    """Distinct user turns to keep (sampling stops there): 600 chat answers of up to 256 tokens
    are ~100k training tokens, what vLLM's CPU build generates in ~10 minutes on 2 cores."""
    max_new_tokens: int = Field(96, ge=8)
    """A user turn longer than this is dropped: it did not end with the turn's end token."""
    temperature: float = Field(1.0, gt=0)
    """T=1 is the model's own distribution of requests; lower repeats the same few."""
    batch_size: int = Field(128, ge=1)
    """Draws per engine call (vLLM schedules them together; HF decodes them as one batch)."""
    max_draws: int = Field(4000, ge=1)
    """Stop after this many samples even if fewer rows passed the filter (a model that never
    ends a user turn would otherwise sample forever)."""
    systems: list[str] | None = optional_field(
        "system messages the draws rotate through, one per batch (unset: the template's default)"
    )
    """A small instruct model asked with its default system message writes mostly everyday chat
    requests; told it is a coding or a math assistant, it writes coding or math ones. They steer
    the requests only: the rows carry the user turn alone, so answers are generated (and
    drafters trained) under the template's default, as benchmarks ask. Unset leaves the
    versions made before this setting unchanged."""
    backend: Literal["auto", "vllm", "hf"] = "auto"
    """Sampling engine, as generate.backend: `auto` is vLLM where it is installed and takes the
    target, else HF; the resolved engine enters the version."""


class PromptsConfig(StrictConfig):
    source: str = "embedded"
    """"embedded", "magpie", a .jsonl / .parquet path, or hf:NAME[:CONFIG][@SPLIT]."""
    heldout_sets: list[str] | None = optional_field(
        "held-out benchmark sets: question.jsonl paths (each row's first turn) or `humaneval`; "
        "given, they are the held-out split (max_heldout_rows per set) and `source` only trains"
    )
    magpie: MagpieConfig | None = optional_field(
        "how `source=magpie` samples user turns (its defaults when unset)"
    )
    max_prompt_tokens: int = Field(256, ge=8)
    max_reference_tokens: int = Field(256, ge=1)
    max_train_rows: int = Field(4000, ge=1)
    max_heldout_rows: int = Field(400, ge=1)
    min_body_lines: int = Field(2, ge=1)  # non-blank reference lines a source prompt needs
    max_import_lines: int = Field(6, ge=0)
    continuation_lines: tuple[int, ...] = (12, 30, 60)  # file_continuation prompt lengths
    heldout_per_mille: int = Field(100, ge=0, le=1000)  # user rows without a `split` field
    max_chars: int = Field(200_000, ge=1)  # per user row, checked before tokenizing
    seed: int = 0

    @field_validator("source")
    @classmethod
    def _hf_syntax(cls, source: str) -> str:
        if source.startswith(HF_PREFIX):
            HfSource.parse(source)
        return source

    @model_validator(mode="after")
    def _magpie_settings(self) -> PromptsConfig:
        if self.magpie is not None and self.source != "magpie":
            raise ValueError(
                f"prompts.magpie sets how source=magpie samples, but prompts.source is "
                f"{self.source!r}: add --set prompts.source=magpie (or drop prompts.magpie)"
            )
        if self.source == "magpie" and self.magpie is None:
            object.__setattr__(self, "magpie", MagpieConfig())  # recorded in the version
        return self

    @field_validator("heldout_sets")
    @classmethod
    def _sets_exist(cls, sets: list[str] | None) -> list[str] | None:
        if sets is None:
            return None
        names = [heldout_set_name(s) for s in sets]
        for s in sets:
            if s != HUMANEVAL and not (Path(s).is_file() and s.endswith(".jsonl")):
                raise ValueError(
                    f"heldout set {s!r} is neither `humaneval` nor an existing .jsonl file "
                    "(EAGLE's question.jsonl format: one object a line with `turns`)"
                )
        if len(set(names)) != len(names):
            raise ValueError(f"heldout_sets {sets} repeat a set name ({names}); rename a file")
        return sets
