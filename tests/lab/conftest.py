"""The stage tests' fixtures, and recipe files written for a test."""

import json
import math
from pathlib import Path

from tests.pipeline.conftest import tiny  # noqa: F401  (a fixture: pytest finds it by name)


def write_recipe(directory: Path, *sets: str, profile: str = "tiny", **fields) -> str:
    """A recipe file of `sets` on `profile` (plus top-level `fields`); its path, for --recipe."""
    data = {"description": "a test's", "command": "opd experiment ...", "profile": profile}
    data |= {"set": list(sets), **fields}
    path = Path(directory) / f"recipe-{len(list(Path(directory).glob('recipe-*')))}.toml"
    path.write_text("".join(f"{k} = {_toml(v)}\n" for k, v in data.items()))
    return str(path)


def _toml(value) -> str:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # nan, inf, -inf: TOML's spelling, not JSON's
    return json.dumps(value)  # JSON's strings, numbers, booleans and arrays are TOML's too
