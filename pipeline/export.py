"""`export`: write a trained drafter (an `sft` or `opd` dataset) as a directory vLLM loads.

Not a dataset stage: the output is a plain directory for serving (`--out`, or
`<root>/_exports/<drafter ref>/<format>` in the full chain). Every invariant of DESIGN §7 is
checked by `models.export` before a file is written, and the written directory is read back
and must give the trained module's logits (bit-exact in fp32) before the export is reported.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Literal

import torch

from models.export import CONFIG_FILE, ExportError, export_eagle3, export_speculators, load_export
from pipeline.drafters import load_drafter_dataset
from pipeline.targets import EMBEDDED_TARGET, TargetLoader
from storage import Dataset, OpdError

Format = Literal["eagle3", "speculators"]
# A hub id (`org/name`) as opposed to a filesystem path.
_HUB_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def _target_dir(loader: TargetLoader) -> Path | None:
    """The target's model directory (None for the in-process random target)."""
    path = loader.cfg.path
    if path == "random":
        return None
    return EMBEDDED_TARGET if path == "embedded" else Path(path).expanduser().resolve()


def _serve_dir(loader: TargetLoader) -> str:
    directory = _target_dir(loader)
    return "<target-model-dir>" if directory is None else str(directory)


def _is_hub_name(name: str) -> bool:
    return bool(_HUB_NAME.match(name)) and not Path(name).expanduser().exists()


def default_verifier(loader: TargetLoader) -> tuple[str, str | None]:
    """(verifier name_or_path, warning or None): the target's hub name when its config.json
    records one, else its local path, which only resolves on this machine."""
    directory = _target_dir(loader)
    if directory is None:
        return "<target-model-dir>", (
            "the target is an in-process random model: pass --verifier with the model vLLM will serve"
        )
    recorded = json.loads((directory / "config.json").read_text()).get("_name_or_path")
    if isinstance(recorded, str) and _is_hub_name(recorded):
        return recorded, None
    return str(directory), (
        f"the speculators config names the verifier by this machine's path {directory}; pass "
        "--verifier ORG/NAME (its hub name) or the path it will have where vLLM runs"
    )


TREE_NOTE = (
    "vLLM serves this EAGLE-3 drafter as a chain of num_speculative_tokens drafts; its only tree "
    "setting is a static speculative_token_tree (fixed shape, top-k per level, TREE_ATTN "
    "attention backend on GPU), not the dynamic EAGLE-2 trees of drafting.tree (README: draft "
    "trees)"
)


def vllm_command(target_dir: str, export_dir: Path, k: int) -> str:
    spec = {"method": "eagle3", "model": str(export_dir.resolve()), "num_speculative_tokens": k}
    return (
        f"vllm serve {shlex.quote(target_dir)} --speculative-config {shlex.quote(json.dumps(spec))}"
    )


@contextmanager
def staged_out_dir(out: Path, *, overwrite: bool, protected: Sequence[Path]) -> Iterator[Path]:
    """A temporary sibling of `out` to write into; on success it is renamed into place.

    Refuses `out` when it is a file, when it is or contains a `protected` directory (the target's
    weights, the data root; even with `overwrite`), and when it is a non-empty directory unless
    `overwrite`. Until the rename, an existing `out` is untouched, so a failed export loses nothing.
    """
    out = Path(out).expanduser().absolute()
    if out.exists() and not out.is_dir():
        raise OpdError(f"--out {out} is a file; name a directory (new or empty) to export into")
    resolved = out.resolve()
    for keep in protected:
        keep = keep.resolve()
        if resolved == keep or resolved in keep.parents:
            raise OpdError(
                f"--out {out} holds {keep}; exporting there would replace it (refused even with "
                "--overwrite): choose another directory"
            )
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise OpdError(
            f"--out {out} is not empty; pass --overwrite to replace its contents, or choose a new "
            "or empty directory"
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = out.with_name(f".{out.name}.export-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    try:
        yield staging
        if out.exists():
            old = out.with_name(f".{out.name}.replaced-{os.getpid()}")
            out.rename(old)
            try:
                staging.rename(out)
            except OSError:
                old.rename(out)
                raise
            shutil.rmtree(old)
        else:
            staging.rename(out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


@torch.no_grad()
def _round_trip(drafter, out: Path, embed: torch.Tensor | None) -> float:
    """Max abs logit difference between the module and its reloaded export on a fixed input.

    `embed` None: the export must run on the embedding it carries (speculators)."""
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
    drafter_ds: Dataset,
    loader: TargetLoader,
    fmt: Format,
    out: Path,
    k: int,
    *,
    overwrite: bool = False,
    verifier: str | None = None,
) -> dict:
    """Export, verify the round trip, and return {path, format, max_logit_diff, vllm_command,
    warnings}. Writes into a temporary sibling of `out` and renames it into place only when the
    export reloads to identical logits (see `staged_out_dir` for what `out` may be)."""
    if k < 1:
        raise OpdError(f"--k must be >= 1 (tokens drafted per step), got {k}")
    if fmt not in ("eagle3", "speculators"):
        raise OpdError(f"unknown export format {fmt!r}; use eagle3 or speculators")
    warnings = []
    if fmt == "speculators" and verifier is None:
        verifier, warning = default_verifier(loader)
        warnings += [warning] if warning else []
    target_dir = _target_dir(loader)
    protected = [drafter_ds.store.root] + ([target_dir] if target_dir is not None else [])
    with staged_out_dir(Path(out), overwrite=overwrite, protected=protected) as staging:
        target = loader.target
        # both formats are EAGLE-3's: a DFlash drafter is refused by name (models/dflash/export.py)
        drafter = load_drafter_dataset(drafter_ds, target, loader.identity, kind="eagle3")
        try:
            if fmt == "eagle3":
                export_eagle3(
                    drafter,
                    target.config,
                    staging,
                    target_identity=loader.identity,
                    target_embed_weight=target.embed_weight,
                )
            else:
                export_speculators(
                    drafter,
                    target.config,
                    staging,
                    verifier_name_or_path=verifier,
                    speculative_tokens=k,
                    target_identity=loader.identity,
                    target_embed_weight=target.embed_weight,
                )
            diff = _round_trip(drafter, staging, target.embed_weight if fmt == "eagle3" else None)
        except ExportError as e:
            raise OpdError(f"export of {drafter_ds.ref} refused: {e}") from None
        if diff != 0.0:
            raise OpdError(
                f"export of {drafter_ds.ref} does not reproduce the drafter (max logit diff {diff})"
            )
    path = Path(out).expanduser().absolute()
    return {
        "drafter": str(drafter_ds.ref),
        "format": fmt,
        "path": str(path),
        "max_logit_diff": diff,
        "vllm_command": vllm_command(_serve_dir(loader), path, k),
        "tree_note": TREE_NOTE,
        "warnings": warnings,
    }


def export_chain_result(results: dict, loader: TargetLoader, root: Path, k: int) -> dict | None:
    """The `export` step of the full chain: the last drafter a chain produced, in both formats,
    under <root>/_exports/<NAME@VERSION>/ (replaced when the chain runs again). Returns the
    eagle3 export's info (None: no drafter)."""
    drafters = [
        r.dataset
        for r in results.values()
        if r.dataset is not None and r.ref.name in ("sft", "opd")
    ]
    if not drafters:
        return None
    last = drafters[-1]
    base = root / "_exports" / str(last.ref).replace("@", "-")
    info = export_drafter(last, loader, "eagle3", base / "eagle3", k, overwrite=True)
    export_drafter(last, loader, "speculators", base / "speculators", k, overwrite=True)
    return info


def ensure_export(
    drafter_ds: Dataset, loader: TargetLoader, root: Path, k: int, fmt: Format = "eagle3"
) -> Path:
    """The drafter's export under <root>/_exports/<NAME-VERSION>/<fmt> (the full chain's place),
    written now unless a complete one is there (its config.json is written last)."""
    path = root / "_exports" / str(drafter_ds.ref).replace("@", "-") / fmt
    if not (path / CONFIG_FILE).exists():
        export_drafter(drafter_ds, loader, fmt, path, k)
    return path
