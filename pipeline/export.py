"""`export`: write a trained drafter (an `sft` or `opd` dataset) as a directory vLLM loads.

Not a dataset stage: the output is a plain directory for serving (`--out`, or
`<root>/_exports/<drafter ref>/<format>` in the full chain). Every invariant of DESIGN §7 is
checked by `models.export` before a file is written, and the written directory is read back
and must give the trained module's logits (bit-exact in fp32) before the export is reported.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Literal

import torch

from models.export import CONFIG_FILE, ExportError, export_eagle3, export_speculators, load_export
from pipeline.drafters import load_drafter_dataset
from pipeline.targets import EMBEDDED_TARGET, TargetLoader
from storage import Dataset, OpdError

Format = Literal["eagle3", "speculators"]


def _target_dir(loader: TargetLoader) -> str:
    path = loader.cfg.path
    if path == "random":
        return "<target-model-dir>"
    return str(EMBEDDED_TARGET if path == "embedded" else Path(path).resolve())


def vllm_command(target_dir: str, export_dir: Path, k: int) -> str:
    spec = {"method": "eagle3", "model": str(export_dir.resolve()), "num_speculative_tokens": k}
    return (
        f"vllm serve {shlex.quote(target_dir)} --speculative-config {shlex.quote(json.dumps(spec))}"
    )


@torch.no_grad()
def _round_trip(drafter, out: Path, embed: torch.Tensor) -> float:
    """Max abs logit difference between the module and its reloaded export on a fixed input."""
    back = load_export(out, embed).eval()
    g = torch.Generator().manual_seed(0)
    cfg = drafter.config
    ids = torch.randint(0, cfg.vocab_size, (2, 9), generator=g)
    aux = torch.randn(2, 9, 3 * cfg.target_hidden_size, generator=g)
    pos = torch.arange(9).expand(2, 9)
    a, _ = drafter(ids, drafter.fuse(aux), pos)
    b, _ = back(ids, back.fuse(aux), pos)
    return float((a - b).abs().max())


def export_drafter(
    drafter_ds: Dataset, loader: TargetLoader, fmt: Format, out: Path, k: int = 6
) -> dict:
    """Export, verify the round trip, and return {path, format, max_logit_diff, vllm_command}."""
    target = loader.target
    drafter = load_drafter_dataset(drafter_ds, target, loader.identity)
    target_dir = _target_dir(loader)
    try:
        if fmt == "eagle3":
            path = export_eagle3(
                drafter,
                target.config,
                out,
                target_identity=loader.identity,
                target_embed_weight=target.embed_weight,
            )
        elif fmt == "speculators":
            path = export_speculators(
                drafter,
                target.config,
                out,
                verifier_name_or_path=target_dir,
                speculative_tokens=k,
                target_identity=loader.identity,
                target_embed_weight=target.embed_weight,
            )
        else:
            raise OpdError(f"unknown export format {fmt!r}; use eagle3 or speculators")
        diff = _round_trip(drafter, path, target.embed_weight)
    except ExportError as e:
        raise OpdError(f"export of {drafter_ds.ref} refused: {e}") from None
    if diff != 0.0:
        raise OpdError(
            f"export of {drafter_ds.ref} does not reproduce the drafter (max logit diff {diff})"
        )
    return {
        "drafter": str(drafter_ds.ref),
        "format": fmt,
        "path": str(path),
        "max_logit_diff": diff,
        "vllm_command": vllm_command(target_dir, path, k),
    }


def export_chain_result(results: dict, loader: TargetLoader, root: Path, k: int) -> dict | None:
    """The `export` step of the full chain: the last drafter a chain produced, in both formats,
    under <root>/_exports/<NAME@VERSION>/. Returns the eagle3 export's info (None: no drafter)."""
    drafters = [
        r.dataset
        for r in results.values()
        if r.dataset is not None and r.ref.name in ("sft", "opd")
    ]
    if not drafters:
        return None
    last = drafters[-1]
    base = root / "_exports" / str(last.ref).replace("@", "-")
    info = export_drafter(last, loader, "eagle3", base / "eagle3", k)
    export_drafter(last, loader, "speculators", base / "speculators", k)
    return info


def ensure_export(
    drafter_ds: Dataset, loader: TargetLoader, root: Path, fmt: Format = "eagle3"
) -> Path:
    """The drafter's export under <root>/_exports/<NAME-VERSION>/<fmt> (the full chain's place),
    written now unless a complete one is there (its config.json is written last)."""
    path = root / "_exports" / str(drafter_ds.ref).replace("@", "-") / fmt
    if not (path / CONFIG_FILE).exists():
        export_drafter(drafter_ds, loader, fmt, path)
    return path
