"""What every drafter kind's export shares: its file names, the provenance key in its
config.json, how its weights are cast and written, and the error it raises.

Below both models/export.py (the entry points, which reach the kinds through models/drafters.py)
and the kinds' own export modules, so neither imports the other.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import Tensor

PROVENANCE_KEY = "opd_pipeline"
WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"


class ExportError(ValueError):
    """An export (or an exported directory) violates an invariant vLLM silently depends on."""


def cast_weights(tensors: Mapping[str, Tensor], dtype: torch.dtype | None) -> dict[str, Tensor]:
    """The floating tensors cast to `dtype` (None: as they are); the vocab map's integer and
    bool buffers keep theirs."""
    return {
        name: t.to(dtype) if dtype is not None and t.is_floating_point() else t
        for name, t in tensors.items()
    }


def dtype_name(t: Tensor) -> str:
    """`torch_dtype` as HF configs spell it: "bfloat16", not "torch.bfloat16"."""
    return str(t.dtype).removeprefix("torch.")


def write_export_dir(
    out_dir: str | os.PathLike, config: Mapping[str, Any], tensors: dict[str, Tensor]
) -> Path:
    """Write `tensors` and `config` as the directory vLLM loads; each file lands whole (written
    beside, then renamed), so an interrupted export never leaves a half-written one."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for name, write in (
        (WEIGHTS_FILE, lambda p: save_file(tensors, str(p))),
        (CONFIG_FILE, lambda p: p.write_text(json.dumps(config, indent=2, sort_keys=True))),
    ):
        tmp = out / f"{name}.tmp"
        write(tmp)
        os.replace(tmp, out / name)
    return out
