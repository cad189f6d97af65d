"""The versioned dataset store.

Layout under the data root (``--root`` / ``OPD_HOME``, default ``./opd-data``)::

    <root>/<name>/<version>/            one dataset; a directory without manifest.json is not one
        manifest.json                   written last, atomically: the commit point
        <shard files>                   Parquet (tabular), Arrow IPC (tensors) or plain files
        .<shard>.meta.json              per-shard rows/bytes/sha256 while the dataset is incomplete
    <root>/<name>/LATEST                the version the newest commit (or reuse) produced
    <root>/_runs/<run>.json             a run: which version each stage produced
    <root>/_tune/<NAME-VERSION>.json    `opd tune`'s measurements (pipeline.core.tuning)
    <root>/_baseline/<key>.json         evaluate's free baseline (pipeline/stages/evaluate.py)
    <root>/_cache/verified/...          which shards were checksummed already (size + mtime)
    <root>/<name>/.<version>.staging/   a forced recompute of a committed version, until it commits

Writers take an exclusive lock per (name, version), so two processes writing the same version
end with one complete dataset: the second one waits, then finds it committed. A shard is
written under a temporary name, fsynced, its checksum recorded, and renamed into place; a
crash at any point leaves only invisible temporaries or complete shards, and a re-run skips
the complete ones. A writer in replace mode (`--force` on a committed version) writes into the
staging directory and swaps it with the committed one at commit, so until then the old dataset
stays readable and LATEST stays valid, whenever the writer is killed.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

from storage.dataset import Dataset
from storage.errors import CorruptDataset, DatasetNotFound, OpdError
from storage.fingerprint import VERSION_LEN
from storage.gc import StoreGc
from storage.jsonfile import UnreadableJson, read_json_object
from storage.layout import (
    _MIN_PREFIX,
    _NAME_RE,
    _REF_FORMS,
    _VERSION_RE,
    MANIFEST,
    DatasetRef,
    _complete,
    _fsync_dir,
    _identity_problem,
    _outside_root,
    atomic_write_text,
    check_run_name,
    default_root,
    disk_error,
)
from storage.provenance import now_iso
from storage.writer import DatasetWriter


class Store(StoreGc):
    """The data root: resolves refs, opens datasets, creates writers, lists and cleans."""

    def __init__(self, root: str | Path | None = None):
        self.root = Path(root) if root is not None else default_root()

    def check_name(self, name: str) -> None:
        """Dataset names are whatever the stages call their outputs (`pipeline.stages`); the
        store only requires them to be plain directory names."""
        if not _NAME_RE.fullmatch(name):
            raise OpdError(
                f"{name!r} is not a dataset name: lowercase letters, digits, '-' and '_', "
                "starting with a letter"
            )

    def __repr__(self) -> str:
        return f"Store({str(self.root)!r})"

    def dataset_dir(self, name: str, version: str) -> Path:
        return self.root / name / version

    def verify_cache(self, ref: DatasetRef) -> Path:
        return self.root / "_cache" / "verified" / ref.name / ref.version

    def staging_dir(self, name: str, version: str) -> Path:
        return self.root / name / f".{version}.staging"

    def _replaced_dirs(self, name: str, version: str) -> list[Path]:
        """Committed versions set aside during a replacement, newest first."""
        found = [p for p in (self.root / name).glob(f".{version}.replaced-*") if p.is_dir()]
        return sorted(found, key=lambda p: p.stat().st_mtime_ns, reverse=True)

    def _recovery_source(self, name: str, version: str) -> Path | None:
        """The complete copy to put back when a killed replacement left the version without one."""
        if _complete(self.dataset_dir(name, version)):
            return None
        for candidate in [self.staging_dir(name, version), *self._replaced_dirs(name, version)]:
            if _complete(candidate):
                return candidate
        return None

    def _restore(self, name: str, version: str) -> None:
        """Put back the complete copy a killed replacement left beside an incomplete version.
        Call it holding the version's lock (writers do) or when no writer holds it (gc does)."""
        final = self.dataset_dir(name, version)
        source = self._recovery_source(name, version)
        if source is not None:
            if final.exists():
                shutil.rmtree(final)  # an unfinished recompute, superseded by a complete copy
            os.rename(source, final)
            _fsync_dir(final.parent)
            print(f"[opd] restored {name}@{version} from {source.name}")

    def _replacement_leftovers(self, name: str, version: str) -> list[Path]:
        """Copies beside a complete version that nothing will read: an old dataset set aside,
        or staged shards of a recompute that no writer holds."""
        if not _complete(self.dataset_dir(name, version)):
            return []
        staging = self.staging_dir(name, version)
        return [*([staging] if staging.exists() else []), *self._replaced_dirs(name, version)]

    def ensure_writable(self) -> None:
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            probe = self.root / f".write-probe-{os.getpid()}"
            probe.write_text("")
            probe.unlink()
        except OSError as e:
            raise OpdError(
                f"data root {self.root} is not writable ({e.strerror}); "
                "pass --root or set OPD_HOME to a writable directory"
            ) from None

    # -- writing ---------------------------------------------------------------------------

    def writer(
        self,
        name: str,
        *,
        stage: str,
        stage_version: str,
        config: dict[str, Any],
        inputs: dict[str, DatasetRef | str] | None = None,
        rank: int = 0,
        world_size: int = 1,
        replace: bool = False,
    ) -> DatasetWriter:
        """A writer for the version these arguments determine; `replace=True` recomputes a
        committed version without taking it away before the new one commits."""
        return DatasetWriter(
            self,
            name,
            stage=stage,
            stage_version=stage_version,
            config=config,
            inputs=inputs or {},
            rank=rank,
            world_size=world_size,
            replace=replace,
        )

    def set_latest(self, ref: DatasetRef) -> None:
        try:
            atomic_write_text(self.root / ref.name / "LATEST", ref.version + "\n")
        except OSError as e:
            raise disk_error(
                e,
                f"{ref.name}/LATEST",
                kept=f"{ref} itself is complete; a re-run points LATEST at it",
            ) from e

    def _run_path(self, run: str) -> Path:
        return self.root / "_runs" / f"{check_run_name(run)}.json"

    def record_run(self, run: str, produced: dict[str, DatasetRef | str]) -> Path:
        """Record which version each stage of a named run produced (merged into earlier calls)."""
        path = self._run_path(run)
        data = {"run": run, "datasets": self.run_datasets(run) if path.exists() else {}}
        data["datasets"].update({k: str(v) for k, v in produced.items()})
        data["updated_at"] = now_iso()
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_text(path, json.dumps(data, indent=2, sort_keys=True))
        except OSError as e:
            raise disk_error(
                e, f"run record {path}", kept="the datasets are complete; a re-run records them"
            ) from e
        return path

    def run_datasets(self, run: str) -> dict[str, str]:
        """What a named run produced: step key or dataset name -> exact `NAME@VERSION`."""
        path = self._run_path(run)
        if not path.exists():
            raise DatasetNotFound(f"no run named {run!r} under {self.root}; see {path.parent}")
        try:
            produced = read_json_object(path)["datasets"]
            refs = {str(k): DatasetRef.parse_exact(v) for k, v in produced.items()}
        except (KeyError, TypeError, AttributeError, OpdError) as e:
            why = e.reason if isinstance(e, UnreadableJson) else e
            raise CorruptDataset(
                f"run record {path} is corrupted ({why}); delete it and re-run the chain "
                "with --run-name to record it again"
            ) from None
        return {k: str(ref) for k, ref in refs.items()}

    # -- reading ---------------------------------------------------------------------------

    def resolve(self, text: str) -> DatasetRef:
        """`NAME@VERSION`, `NAME@latest` (or bare `NAME`), or `NAME@run:RUN` -> exact ref."""
        name, sep, what = text.strip().partition("@")
        if not _NAME_RE.fullmatch(name):
            raise OpdError(f"bad dataset ref {text!r}; {_REF_FORMS}")
        if what.startswith("run:"):
            run = what[4:]
            produced = self.run_datasets(run)
            if name not in produced:
                raise DatasetNotFound(
                    f"run {run!r} produced no {name} dataset; it has: {', '.join(produced)}"
                )
            ref = DatasetRef.parse_exact(produced[name])
            if ref.name != name:
                raise CorruptDataset(
                    f"run record {self._run_path(run)} maps {name} to {ref}, another dataset; "
                    "delete the record and re-run the chain with --run-name to record it again"
                )
            return ref
        if not (self.root / name).is_dir():
            here = ", ".join(self.names()) or "none"
            raise DatasetNotFound(
                f"no dataset named {name!r} under {self.root} (datasets here: {here}): run the "
                "stage that makes it first, or check the name and --root/OPD_HOME"
            )
        if not sep or what == "latest":
            return self._latest(name)
        if re.fullmatch(rf"[0-9a-f]{{1,{_MIN_PREFIX - 1}}}", what):
            raise OpdError(
                f"version prefix {what!r} in {text!r} is too short: give at least {_MIN_PREFIX} "
                f"of the version's {VERSION_LEN} hex digits (see `opd ls {name}`), or {name}@latest"
            )
        if re.fullmatch(rf"[0-9a-f]{{{_MIN_PREFIX},{VERSION_LEN}}}", what):
            matches = [v for v in self.versions(name) if v.startswith(what)]
            if len(matches) == 1:
                return DatasetRef(name, matches[0])
            if len(matches) > 1:
                raise OpdError(f"{text!r} is ambiguous: {', '.join(matches)}")
            raise DatasetNotFound(
                f"no {name} dataset version starting with {what!r}; see `opd ls {name}`"
            )
        raise OpdError(f"bad dataset ref {text!r}; {_REF_FORMS}")

    def _latest(self, name: str) -> DatasetRef:
        latest = self.root / name / "LATEST"
        if not latest.exists():
            raise DatasetNotFound(
                f"no complete {name} dataset under {self.root} yet: run the stage that makes "
                "it first (`opd ls` shows what exists) or check --root/OPD_HOME"
            )
        version = latest.read_bytes().decode("utf-8", "replace").strip()
        if not _VERSION_RE.fullmatch(version):
            raise CorruptDataset(
                f"{latest} holds {version[:40]!r}, not a dataset version: write one of "
                f"`opd ls {name}` into it, or delete it and re-run the {name} stage"
            )
        return DatasetRef(name, version)

    def open(self, ref: str | DatasetRef) -> Dataset:
        if isinstance(ref, str):
            ref = self.resolve(ref)
        return Dataset(self, ref)

    def exists(self, ref: DatasetRef) -> bool:
        return (self.dataset_dir(ref.name, ref.version) / MANIFEST).exists()

    def versions(self, name: str) -> list[str]:
        d = self.root / name
        if not d.is_dir():
            return []
        return sorted(p.name for p in d.iterdir() if p.is_dir() and _VERSION_RE.fullmatch(p.name))

    def names(self) -> list[str]:
        if not self.root.is_dir():
            return []
        return sorted(
            p.name for p in self.root.iterdir() if p.is_dir() and _NAME_RE.fullmatch(p.name)
        )

    def listing(self, name: str | None = None) -> list[dict[str, Any]]:
        """One row per version directory: complete or not, rows, bytes, creation time."""
        if name is not None:
            self.check_name(name)
        rows = []
        for n in [name] if name else self.names():
            latest_file = self.root / n / "LATEST"
            latest = latest_file.read_text().strip() if latest_file.exists() else None
            for v in self.versions(n):
                d = self.dataset_dir(n, v)
                row: dict[str, Any] = {"name": n, "version": v, "latest": v == latest}
                row["invalid"] = None
                if (outside := _outside_root(self, d)) is not None:  # not read: not ours
                    row |= {"complete": False, "invalid": outside, "rows": None, "bytes": None}
                    rows.append(row | {"created": None})
                    continue
                try:
                    m = read_json_object(d / MANIFEST)
                    problem = _identity_problem(self, DatasetRef(n, v), m)
                    row |= {
                        "complete": problem is None,
                        "invalid": problem,
                        "rows": m["rows"],
                        "bytes": m["bytes"],
                        "created": m["provenance"]["committed_at"],
                        "stage": m["stage"],
                    }
                except FileNotFoundError:
                    partial = sum(f.stat().st_size for f in d.rglob("*") if f.is_file())
                    row |= {"complete": False, "rows": None, "bytes": partial, "created": None}
                except UnreadableJson as e:
                    invalid = f"{d / MANIFEST} does not parse ({e.reason})"
                    row |= {"complete": False, "invalid": invalid, "rows": None, "bytes": None}
                    row["created"] = "corrupt"
                except KeyError:
                    row |= {"complete": False, "rows": None, "bytes": None, "created": "corrupt"}
                rows.append(row)
        return rows

    def lineage(self, ref: DatasetRef) -> dict[str, Any]:
        """The tree of inputs back to the sources: {ref, stage, inputs: {role: subtree}}."""
        ds = self.open(ref)
        source = ds.meta.get("source")  # a file a stage read instead of a dataset
        return {
            "ref": str(ref),
            "stage": ds.manifest.get("stage"),
            **({"source": source} if isinstance(source, dict) and "sha256" in source else {}),
            "inputs": {
                role: self.lineage(DatasetRef.parse_exact(r))
                if self.exists(DatasetRef.parse_exact(r))
                else {"ref": r, "missing": True}
                for role, r in ds.inputs.items()
            },
        }
