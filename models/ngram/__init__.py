"""Prompt lookup, the drafter kind that needs no training: vLLM's `ngram` speculative method
(match the text's last tokens against the prompt and the text so far, propose what followed),
decoded by the project's loop and measured beside every trained drafter (`SPEC` describes it to
the registry, models/drafters.py)."""

from typing import Annotated, Literal

from pydantic import Field, model_validator

from models.kind import KindSettings, KindSpec, Reads, optional_setting
from models.ngram.drafter import SETTINGS, NgramDrafter


class NgramSettings(KindSettings):
    """The n-gram range, each None = the default vLLM runs in this project
    (models/ngram/drafter.py PROMPT_LOOKUP_SIZES)."""

    kind: Literal["ngram"] = "ngram"
    prompt_lookup_min: Annotated[int, Field(ge=1)] | None = optional_setting(
        "ngram: the shortest suffix n-gram looked up (vLLM's prompt_lookup_min; default 2)"
    )
    prompt_lookup_max: Annotated[int, Field(ge=1)] | None = optional_setting(
        "ngram: the longest suffix n-gram looked up, tried first (vLLM's prompt_lookup_max; "
        "default 4)"
    )

    @model_validator(mode="after")
    def _range(self) -> "NgramSettings":
        given = SETTINGS | self.settings()
        if given["prompt_lookup_min"] > given["prompt_lookup_max"]:
            raise ValueError(
                f"drafter.prompt_lookup_min ({given['prompt_lookup_min']}) exceeds "
                f"drafter.prompt_lookup_max ({given['prompt_lookup_max']}): lower the first or "
                "raise the second"
            )
        return self


SPEC = KindSpec(
    name="ngram",
    title="n-gram lookup",
    settings=NgramSettings,
    drafter=NgramDrafter,
    export_formats=("ngram",),
    serve_method="ngram",
    reads=Reads(),  # the text alone: no target state is stored or computed for it
    baseline=True,
)
