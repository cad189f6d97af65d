"""Export any drafter kind for serving, and read an export back.

Each kind writes its own formats (its spec's `export_formats`; EAGLE-3's in models/eagle3/export.py)
and checks its invariants before a file is written; the file names, `PROVENANCE_KEY` and
`ExportError` they share are in models/export_format.py. Every export records its provenance, the
drafter kind included, under `PROVENANCE_KEY` in its config.json, so `read_export` knows which
kind reads it back; the round trip (`round_trip_diff`) then compares the exported drafter's logits
with the trained one's on a fixed probe input.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from torch import Tensor

from models.drafter import Drafter, ExportTarget, ServableDrafter, require
from models.drafters import DEFAULT_KIND, drafter_class
from models.export_format import CONFIG_FILE, PROVENANCE_KEY, ExportError


def write_export(
    drafter: Drafter,
    fmt: str,
    out_dir: str | os.PathLike,
    target: ExportTarget,
    *,
    k: int,
    verifier: str | None = None,
) -> Path:
    """Write `drafter` as `fmt` (one of its kind's `export_formats`) into `out_dir`, to serve
    `k` speculative tokens beside `target`."""
    formats = drafter.spec.export_formats
    if not isinstance(drafter, ServableDrafter) or fmt not in formats:
        given = " or ".join(formats) if formats else "nothing"
        raise ExportError(f"a {drafter.kind} drafter exports as {given}, not {fmt!r}")
    return drafter.write_export(fmt, Path(out_dir), target, k=k, verifier=verifier)


def exported_kind(export_dir: str | os.PathLike) -> str:
    """The drafter kind an export records (exports from before kinds existed are EAGLE-3)."""
    path = Path(export_dir) / CONFIG_FILE
    if not path.is_file():
        raise ExportError(f"{path} not found: not an export directory")
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ExportError(f"{path} is not readable JSON ({err}); re-export the drafter") from None
    provenance = config.get(PROVENANCE_KEY) if isinstance(config, dict) else None
    kind = (provenance or {}).get("drafter_kind", DEFAULT_KIND)
    if not isinstance(kind, str):
        raise ExportError(f"{path}: {PROVENANCE_KEY}.drafter_kind is {kind!r}, not a kind name")
    return kind


def read_export(export_dir: str | os.PathLike, embed_weight: Tensor | None) -> Drafter:
    """The drafter an export holds, read by the kind it records (refusing a broken export)."""
    kind = exported_kind(export_dir)
    try:
        cls = drafter_class(kind)
        require(cls, ServableDrafter, "be read from an export")
    except ValueError as err:
        raise ExportError(f"{export_dir}: {err}") from None
    drafter = cls.read_export(Path(export_dir), embed_weight)
    # beside the target: a speculators export reads its own embedding onto the host
    return drafter if embed_weight is None else drafter.to(embed_weight.device)


@torch.no_grad()
def round_trip_diff(drafter: Drafter, export_dir: str | os.PathLike, embed_weight: Tensor) -> float:
    """Max abs logit difference between `drafter` and its export read back, on the kind's fixed
    probe input (0.0: the export serves the trained weights exactly)."""
    back = read_export(export_dir, embed_weight).eval()
    if type(back) is not type(drafter):
        raise ExportError(f"{export_dir} holds a {back.kind} drafter, not a {drafter.kind} one")
    a, b = drafter.probe_logits(seed=0).float(), back.probe_logits(seed=0).float()
    return float((a - b).abs().max())
