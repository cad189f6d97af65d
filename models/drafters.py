"""The registry of drafter kinds (built from each kind's `SPEC`), and saving / loading a drafter
of any kind with its kind recorded. Adding a kind is its package plus its line below.

A checkpoint directory holds `model.safetensors` (the kind's `tensors()`, never the target's
weights) and `drafter_config.json` (the kind's config plus `"kind"`). Directories written before
kinds existed have no `"kind"`: they are EAGLE-3, the only kind there was.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from safetensors.torch import load_file, save_file
from torch import Tensor

from models import dflash, eagle3, medusa, mtp, ngram
from models.drafter import Drafter
from models.kind import KindSpec

KINDS: dict[str, KindSpec] = {
    spec.name: spec for spec in (eagle3.SPEC, dflash.SPEC, medusa.SPEC, ngram.SPEC, mtp.SPEC)
}
DEFAULT_KIND = "eagle3"  # what `drafter.kind` unset means, and what a kind-less record holds
CONFIG_FILE = "drafter_config.json"
WEIGHTS_FILE = "model.safetensors"
KIND_KEY = "kind"


def kind_spec(kind: str) -> KindSpec:
    if kind not in KINDS:
        raise ValueError(f"unknown drafter kind {kind!r}; kinds: {', '.join(KINDS)}")
    return KINDS[kind]


def drafter_class(kind: str) -> type[Drafter]:
    return kind_spec(kind).drafter


def _write_atomic(path: Path, write: Callable[[Path], object]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    write(tmp)
    os.replace(tmp, path)


def save_drafter(drafter: Drafter, directory: str | os.PathLike) -> Path:
    """Write `model.safetensors` and `drafter_config.json` (with the kind) into `directory`."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = drafter.tensors()
    _write_atomic(directory / WEIGHTS_FILE, lambda p: save_file(tensors, str(p)))
    config = {KIND_KEY: drafter.kind, **drafter.config.to_dict()}
    text = json.dumps(config, indent=2, sort_keys=True)
    _write_atomic(directory / CONFIG_FILE, lambda p: p.write_text(text))
    return directory


def _recorded_config(directory: str | os.PathLike) -> dict[str, Any]:
    path = Path(directory) / CONFIG_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} not found: is {directory} a directory written by save_drafter?"
        )
    return json.loads(path.read_text())


def recorded_kind(directory: str | os.PathLike) -> str:
    """The kind a `save_drafter` directory records (EAGLE-3 when it predates kinds)."""
    return _recorded_config(directory).get(KIND_KEY, DEFAULT_KIND)


def recorded_settings(directory: str | os.PathLike) -> dict[str, Any]:
    """The kind's settings a `save_drafter` directory's drafter was built with
    (`Drafter.settings_of`), without loading its weights."""
    config = _recorded_config(directory)
    return drafter_class(config.pop(KIND_KEY, DEFAULT_KIND)).settings_of(config)


def load_drafter(
    directory: str | os.PathLike, embed_weight: Tensor, *, kind: str | None = None
) -> Drafter:
    """Load a `save_drafter` directory with the target's embedding re-attached; `kind` refuses
    a drafter of another kind."""
    directory = Path(directory)
    config_path, weights_path = directory / CONFIG_FILE, directory / WEIGHTS_FILE
    for path in (config_path, weights_path):
        if not path.is_file():
            raise FileNotFoundError(
                f"{path} not found: is {directory} a directory written by save_drafter?"
            )
    config = json.loads(config_path.read_text())
    found = config.pop(KIND_KEY, DEFAULT_KIND)
    if kind is not None and found != kind:
        raise ValueError(f"{directory} holds a {found} drafter, not a {kind} one")
    cls = drafter_class(found)
    return cls.from_tensors(config, embed_weight, load_file(str(weights_path)), str(directory))
