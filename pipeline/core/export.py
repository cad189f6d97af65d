"""Write a trained drafter (an `sft` or `opd` dataset) as a directory vLLM loads.

Not a dataset stage, and below the stages: `opd export`, the full chain's export step
(`pipeline.chains.export_chain_result`) and evaluate's vLLM backend (`ensure_export`) all call
it. The output is a plain directory for serving (`--out`, or
`<root>/_exports/<drafter ref>/<format>` in the full chain). Every invariant of DESIGN §7 is
checked by `models.export` before a file is written, and the written directory is read back
and must give the trained module's logits (bit-exact in fp32) before the export is reported.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shlex
import shutil
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from models.drafter import ExportTarget
from models.drafters import CONFIG_FILE as DRAFTER_CONFIG
from models.drafters import kind_spec
from models.export import ExportError, round_trip_diff, write_export
from pipeline.core.drafters import (
    check_drafting_depth,
    drafter_kind,
    load_drafter_dataset,
    trained_depth,
)
from pipeline.core.targets import TargetLoader, target_spec
from pipeline.core.trajectory_files import target_fingerprint
from pipeline.core.tuning import trained_k
from storage import Dataset, OpdError
from storage.fingerprint import VERSION_LEN
from storage.jsonfile import UnreadableJson, read_json_object
from storage.layout import MANIFEST

log = logging.getLogger("opd")

CHECKSUMS_FILE = "opd_export.json"
"""Size and sha256 of every file of an export, written last (`opd export --verify DIR`)."""

DRAFTER_RECORD = "opd_drafter.json"
"""What `opd data import-drafter` needs beside the served files, in every export format: the
drafter's own config, the depth and K it was trained for, the target it serves (how to load
it and its fingerprint: weights, shape, tokenizer and chat template) and where it came from
(its dataset and lineage, its training summary). vLLM reads only config.json and the weights."""

EXPORTS_DIR = "_exports"
"""Under the data root: the chain's exports (`ensure_export`), the one place exports may go."""

# A hub id (`org/name`) as opposed to a filesystem path.
_HUB_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def _target_dir(loader: TargetLoader) -> Path | None:
    """The target's model directory (None for the in-process random and shape targets)."""
    return loader.directory


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


def vllm_command(target_dir: str, spec: Mapping[str, Any]) -> str:
    """`vllm serve` of the target with a drafter's `--speculative-config` (its
    `ServableDrafter.speculative_config`)."""
    return (
        f"vllm serve {shlex.quote(target_dir)} --speculative-config {shlex.quote(json.dumps(spec))}"
    )


def check_out_dir(out: Path, protected: Sequence[Path], exports: Path | None = None) -> None:
    """Refuse an `out` that is, holds or lies inside a `protected` directory (the data root,
    the target's weights), even with --overwrite: a rename there replaces datasets or weights.
    Only the chain's own export area (`exports`, under the data root) may hold exports."""
    resolved = out.resolve()
    area = exports.resolve() if exports is not None else None
    in_area = area is not None and area in resolved.parents
    for keep in protected:
        keep = keep.resolve()
        if resolved == keep or resolved in keep.parents:
            raise OpdError(
                f"--out {out} holds {keep}; exporting there would replace it (refused even with "
                "--overwrite): choose another directory"
            )
        if keep in resolved.parents and not (in_area and keep in area.parents):
            raise OpdError(
                f"--out {out} lies inside {keep}; exporting there could replace what it holds "
                "(refused even with --overwrite): choose a directory outside it"
            )
    if not in_area and (part := _data_root_part(resolved)) is not None:
        raise OpdError(
            f"--out {out} {part}; exporting there could replace datasets (refused even with "
            "--overwrite): choose a directory outside every data root"
        )


_VERSION = re.compile(rf"[0-9a-f]{{{VERSION_LEN}}}")


def _is_version(d: Path) -> bool:
    """A dataset version of some data root: `<root>/<name>/<version>/manifest.json`."""
    return bool(_VERSION.fullmatch(d.name)) and (d / MANIFEST).is_file()


def _is_dataset(d: Path) -> bool:
    """A dataset of some data root: `<root>/<name>/LATEST` naming a version."""
    latest = d / "LATEST"
    try:
        return latest.is_file() and bool(_VERSION.fullmatch(latest.read_text().strip()))
    except (OSError, UnicodeDecodeError):
        return False


def _data_root_part(resolved: Path) -> str | None:
    """How `resolved` is, holds or lies inside a dataset of any data root (None: it does
    not): an overwrite there takes a version's files away, and gc then removes the rest."""
    for d in (resolved, *resolved.parents):
        if _is_version(d) or _is_dataset(d):
            return f"is or lies inside the dataset {d}"
        if any(_is_dataset(c.parent) for c in d.glob("*/LATEST")):
            return f"is or lies inside the data root {d}"
    if resolved.is_dir():
        below = [p.parent for p in (*resolved.glob("*/*"), *resolved.glob("*/*/*"))]
        if held := next((d for d in below if _is_version(d) or _is_dataset(d)), None):
            return f"holds the dataset {held}"
    return None


# What `staged_out_dir` leaves beside `--out` when killed: `.NAME.export-PID` (an unverified
# copy being written) and `.NAME.replaced-PID` (the old export, set aside during an overwrite).
_LEFTOVER = re.compile(r"^\.(?P<name>.+)\.(?P<kind>export|replaced)-(?P<pid>\d+)$")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True  # someone else's process: not ours to judge
    return True


def tidy_export_leftovers(
    parent: Path, name: str | None = None, *, dry_run: bool = False
) -> list[str]:
    """Clean what killed exports left in `parent` (beside the export `name`, or any): a staging
    copy is removed; an old export set aside by an overwrite is put back where its export is
    missing, else removed. Only dead processes' leftovers. Returns one line per action."""
    actions = []
    for path in sorted(parent.glob(".*")) if parent.is_dir() else []:
        m = _LEFTOVER.fullmatch(path.name)
        if m is None or not path.is_dir() or (name is not None and m["name"] != name):
            continue
        if _alive(int(m["pid"])):
            continue
        out = parent / m["name"]
        if m["kind"] == "replaced" and not out.exists():
            actions.append(f"restored {out} from {path.name}")
            if not dry_run:
                path.rename(out)
            continue
        actions.append(f"removed {path}")
        if dry_run:
            continue
        if path.is_symlink():  # never followed: what it leads to is not the export's
            path.unlink()
        else:
            shutil.rmtree(path)
    return actions


def tidy_exports(root: Path, *, dry_run: bool = False) -> list[str]:
    """`tidy_export_leftovers` over the chain's export area `<root>/_exports` (`opd gc`)."""
    area = root / EXPORTS_DIR
    parents = [area, *(p for p in area.glob("*") if p.is_dir() and not p.name.startswith("."))]
    return [a for p in parents for a in tidy_export_leftovers(p, dry_run=dry_run)]


@contextmanager
def staged_out_dir(
    out: Path, *, overwrite: bool, protected: Sequence[Path], exports: Path | None = None
) -> Iterator[Path]:
    """A temporary sibling of `out` to write into; on success it is renamed into place.

    Refuses `out` when it is a file, when it is, holds or lies in a `protected` directory (see
    `check_out_dir`), and when it is a non-empty directory unless `overwrite`. Until the
    rename, an existing `out` is untouched, so a failed export loses nothing.
    """
    out = Path(out).expanduser().absolute()
    if out.exists() and not out.is_dir():
        raise OpdError(f"--out {out} is a file; name a directory (new or empty) to export into")
    check_out_dir(out, protected, exports)
    for action in tidy_export_leftovers(out.parent, out.name):
        log.warning("an earlier export of %s was killed: %s", out, action)
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


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _current_umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def share_as_umask_allows(export_dir: Path) -> None:
    """Give every file of an export the mode a plain file gets under the user's umask: the
    safetensors writer creates weights 0600, which a serving user other than the exporter
    cannot read."""
    mode = 0o666 & ~_current_umask()
    for path in _export_files(export_dir).values():
        path.chmod(mode)


def _export_files(export_dir: Path) -> dict[str, Path]:
    """Every file of an export, subdirectories' too, by its path relative to `export_dir`
    (a link is listed as what it is, never followed out of the export)."""
    files = (p for p in export_dir.rglob("*") if p.is_file() or p.is_symlink())
    return {p.relative_to(export_dir).as_posix(): p for p in sorted(files)}


def write_checksums(export_dir: Path, **about: str) -> None:
    """Record every file's size and sha256 in `CHECKSUMS_FILE`, written last: an export is
    complete, and verifiable, only once it is there."""
    listed = {
        name: {"bytes": p.stat().st_size, "sha256": _sha256(p)}
        for name, p in _export_files(export_dir).items()
    }
    record = {"format_version": 1, **about, "files": listed}
    (export_dir / CHECKSUMS_FILE).write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")


def _listed_files(record_path: Path) -> dict[str, tuple[int, str]]:
    """name -> (bytes, sha256) as `CHECKSUMS_FILE` lists them; ValueError when it cannot."""
    try:
        files = read_json_object(record_path)["files"]
        listed = {str(n): (int(f["bytes"]), str(f["sha256"])) for n, f in files.items()}
    except UnreadableJson as e:
        raise ValueError(e.reason) from None
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(str(e)) from None
    if bad := [n for n in listed if Path(n).is_absolute() or ".." in Path(n).parts]:
        raise ValueError(f"it lists {bad[0]!r}, a path outside the export")
    return listed


def export_problem(export_dir: Path, *, extra_ok: bool = False) -> str | None:
    """What is wrong with an export directory against its checksums (None: every file matches).
    `extra_ok`: files it was not exported with (notes added beside it) are no problem."""
    record_path = export_dir / CHECKSUMS_FILE
    if not record_path.is_file():
        return f"it has no {CHECKSUMS_FILE} (not an export, an unfinished one, or an older one)"
    try:
        expected = _listed_files(record_path)
    except ValueError as e:
        return f"its {CHECKSUMS_FILE} is unreadable ({e})"
    present = set(_export_files(export_dir)) - {CHECKSUMS_FILE}
    if not extra_ok and (extra := sorted(present - set(expected))):
        return f"{extra[0]} is not one of the files it was exported with"
    for name, (size, sha) in expected.items():
        path = export_dir / name
        if path.is_symlink():
            return f"{name} is a link, not the file it was exported as"
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != size or _sha256(path) != sha:
            return f"{name} fails its sha256 check (changed since the export)"
    return None


def verify_export(export_dir: Path) -> int:
    """The number of files checked; an OpdError naming the first problem."""
    export_dir = Path(export_dir).expanduser()
    if not export_dir.is_dir():
        raise OpdError(f"{export_dir} is not a directory: name an `opd export --out` directory")
    problem = export_problem(export_dir)
    if problem is not None:
        raise OpdError(f"export {export_dir} fails verification: {problem}; export it again")
    return len(_listed_files(export_dir / CHECKSUMS_FILE))


def export_formats(drafter_ds: Dataset) -> tuple[str, ...]:
    """The formats the drafter in `drafter_ds` exports as (its kind's; the first the default),
    refusing a kind that is not served."""
    spec = kind_spec(drafter_kind(drafter_ds))
    if not spec.export_formats:
        why = f": {spec.export_note}" if spec.export_note else ""
        raise OpdError(f"{drafter_ds.ref} holds a {spec.name} drafter, which exports nothing{why}")
    return spec.export_formats


_SUMMARY_KEYS = ("steps", "epochs", "validation", "objective", "features", "untrained")


def drafter_record(drafter_ds: Dataset, loader: TargetLoader) -> dict[str, Any]:
    """`DRAFTER_RECORD`'s content for the drafter in `drafter_ds`."""
    return {
        "format_version": 1,
        "drafter": str(drafter_ds.ref),
        "drafter_kind": drafter_kind(drafter_ds),
        "drafter_config": json.loads(drafter_ds.file(DRAFTER_CONFIG).read_text()),
        "trained_depth": trained_depth(drafter_ds),
        "trained_k": trained_k(drafter_ds),
        "target": target_spec(loader.cfg),
        "target_fingerprint": target_fingerprint(loader),
        "lineage": drafter_ds.store.lineage(drafter_ds.ref),
        "summary": {k: drafter_ds.meta[k] for k in _SUMMARY_KEYS if k in drafter_ds.meta},
    }


def export_drafter(
    drafter_ds: Dataset,
    loader: TargetLoader,
    fmt: str | None,
    out: Path,
    k: int,
    *,
    overwrite: bool = False,
    verifier: str | None = None,
    dtype: str | None = None,
) -> dict:
    """Export, verify the round trip, and return {path, format, max_logit_diff, vllm_command,
    warnings}. Writes into a temporary sibling of `out` and renames it into place only when the
    export reloads to identical logits (see `staged_out_dir` for what `out` may be). `dtype`
    (float32, bfloat16) casts the drafter's weights first (None: as trained); the round trip
    then compares the cast drafter."""
    if k < 1:
        raise OpdError(f"--k must be >= 1 (tokens drafted per step), got {k}")
    check_drafting_depth(drafter_ds, k)  # vLLM would draft the offsets it never learned
    formats = export_formats(drafter_ds)
    fmt = fmt or formats[0]
    if fmt not in formats:
        raise OpdError(
            f"{drafter_ds.ref} exports as {' or '.join(formats)}, not {fmt!r}: pick one with --format"
        )
    warnings = []
    if fmt == "speculators" and verifier is None:
        verifier, warning = default_verifier(loader)
        warnings += [warning] if warning else []
    target_dir = _target_dir(loader)
    root = drafter_ds.store.root
    protected = [root] + ([target_dir] if target_dir is not None else [])
    with staged_out_dir(
        Path(out), overwrite=overwrite, protected=protected, exports=root / EXPORTS_DIR
    ) as staging:
        target = loader.target
        drafter = load_drafter_dataset(drafter_ds, target, loader.identity)
        if dtype is not None:
            drafter.to(dtype=getattr(torch, dtype))
            # `.to()` casts the shared embedding too: the drafter keeps reading the target's
            drafter.embed_tokens.weight = torch.nn.Parameter(
                target.embed_weight, requires_grad=False
            )
        try:
            serves = ExportTarget(target.config, target_fingerprint(loader), target.embed_weight)
            write_export(drafter, fmt, staging, serves, k=k, verifier=verifier)
            diff = round_trip_diff(drafter, staging, target.embed_weight)
        except ExportError as e:
            raise OpdError(f"export of {drafter_ds.ref} refused: {e}") from None
        if diff != 0.0:
            raise OpdError(
                f"export of {drafter_ds.ref} does not reproduce the drafter (max logit diff {diff})"
            )
        record = drafter_record(drafter_ds, loader)
        (staging / DRAFTER_RECORD).write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
        write_checksums(staging, drafter=str(drafter_ds.ref), fmt=fmt)
        share_as_umask_allows(staging)
    path = Path(out).expanduser().absolute()
    return {
        "drafter": str(drafter_ds.ref),
        "format": fmt,
        "path": str(path),
        "max_logit_diff": diff,
        "num_speculative_tokens": drafter.served_tokens(k),
        "vllm_command": vllm_command(_serve_dir(loader), drafter.speculative_config(path, k)),
        "tree_note": drafter.spec.tree_note,  # only a kind that drafts trees has one
        "warnings": warnings,
    }


def ensure_export(
    drafter_ds: Dataset, loader: TargetLoader, root: Path, k: int, fmt: str | None = None
) -> Path:
    """The drafter's export under <root>/_exports/<NAME-VERSION>/<fmt> (the full chain's place;
    `fmt` None: its kind's first format), written now unless a complete one is there (its
    checksums are checked: one that fails them is written again, with a warning)."""
    fmt = fmt or export_formats(drafter_ds)[0]
    path = root / EXPORTS_DIR / str(drafter_ds.ref).replace("@", "-") / fmt
    if path.exists():
        problem = export_problem(path)
        if problem is None:
            return path
        log.warning("cached export %s is not reused: %s; exporting it again", path, problem)
    export_drafter(drafter_ds, loader, fmt, path, k, overwrite=True)
    return path
