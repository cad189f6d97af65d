"""Named recipes: a profile, its overrides and the command that reproduces a finding.

A recipe is one TOML file in lab/recipes/ (torchtune's shape: the file holds the settings, the
command line names the recipe and what varies in a study: seeds, budget, factors, levels). Its
`set` entries are `--set` overrides on top of `profile`; `rollout_prompts` and `eval_prompts`
are further overrides of the prompts stage that make the prompts the Draft-OPD rounds draw on
and the prompts every evaluation decodes (versioned datasets like any other, so a second run
finds them cached). `opd experiment recipes NAME` prints one with the `opd run full` command
that trains its chain.
"""

from __future__ import annotations

import shlex
import tomllib
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from pipeline.profiles import PipelineConfig, load_config
from storage import OpdError

RECIPE_DIR = Path(__file__).resolve().parent / "recipes"


class Recipe(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    name: str
    description: str
    command: str  # what reproduces the recipe's finding, as a user types it
    profile: str
    set: list[str] = []
    # Prompts-stage overrides (on top of `set`) for the prompts the Draft-OPD rounds and
    # continued SFT's fresh sequences draw on: prompts the warm-up never trained on.
    rollout_prompts: list[str] | None = None
    # Prompts-stage overrides for the prompts every evaluation decodes (benchmark sets).
    eval_prompts: list[str] | None = None
    # Prompts per held-out set every evaluation decodes [default: evaluate.max_prompts, which
    # also sizes the held-out validation sequences: changing that one retrains the arms].
    eval_max_prompts: int | None = Field(default=None, ge=1)
    # The temperature continued SFT's fresh target sequences are sampled at [default: the
    # rollouts'].
    sft_data_temperature: float | None = Field(default=None, ge=0, allow_inf_nan=False)
    speed: bool = False  # opd-vs-sft also times the first seed's drafters against plain decoding
    # sft-plateau: an axis is at its plateau when its last step up raised τ by less than this.
    plateau_gain: float = Field(default=0.01, ge=0, allow_inf_nan=False)

    def config(self, *more: str) -> PipelineConfig:
        """The validated config: the profile, the recipe's overrides, then `more`."""
        return load_config(self.profile, None, [*self.set, *more])

    def check_prompts(self) -> None:
        """Refuse prompts overrides that make no valid config (a benchmark file not found from
        here), before anything runs."""
        for more in (self.rollout_prompts, self.eval_prompts):
            if more is not None:
                self.config(*more)

    def chain_command(self) -> str:
        """The `opd run full` command line that trains this recipe's chain."""
        sets = [a for s in self.set for a in ("--set", s)]
        return shlex.join(["opd", "run", "full", "--profile", self.profile, *sets])


def recipe_names() -> list[str]:
    return sorted(p.stem for p in RECIPE_DIR.glob("*.toml"))


def load_recipe(name: str) -> Recipe:
    """The recipe NAME (a file in lab/recipes/) or the recipe file at a path ending in .toml."""
    path = Path(name) if name.endswith(".toml") else RECIPE_DIR / f"{name}.toml"
    if not path.is_file():
        raise OpdError(
            f"unknown recipe {name!r}; available: {', '.join(recipe_names())} "
            "(or a path to a recipe file ending in .toml)"
        )
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        raise OpdError(f"cannot read recipe {path}: {e}") from None
    if "name" in data:
        raise OpdError(f"invalid recipe {path}: drop its `name`: the file's name names it")
    try:
        recipe = Recipe.model_validate({**data, "name": path.stem})
    except ValidationError as e:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc'])}: {err['msg']}" for err in e.errors()
        )
        raise OpdError(f"invalid recipe {path}: {problems}") from None
    recipe.config()  # its overrides must make a valid config before anything runs
    return recipe
