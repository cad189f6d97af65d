"""A drafter directory into a data root as an `sft` version (`opd data import-drafter DIR`).

Reads either the project's export (`opd export`, either format: the served files plus
`opd_drafter.json`, checked against `opd_export.json`'s sha256s) or a drafter dataset's own
directory copied out of a data root (`<root>/sft/<version>/`: checked against its manifest).
Both record the target the drafter was made for; a drafter made for another target (weights,
shape, tokenizer or chat template) is refused in one line before anything is written. The
`sft` version it writes has the drafter dataset's layout (`pipeline.core.drafters`), so
evaluate, tune, rollout, export, sft (to continue) and opd take it as any drafter; its
version hashes the directory's files and the target, and its stage config records the depth
and K the drafter was trained for (what `trained_depth` and `trained_k` read).
"""

from __future__ import annotations

import hashlib
import json
import logging
import tempfile
from pathlib import Path
from typing import Any

import pyarrow as pa
from safetensors.torch import save as save_safetensors

from models.drafter import Drafter
from models.drafters import CONFIG_FILE, KIND_KEY, WEIGHTS_FILE, load_drafter, save_drafter
from models.export import ExportError, read_export
from models.export_format import PROVENANCE_KEY
from pipeline.core.checks import VOCAB_FILE
from pipeline.core.drafters import METRICS_FILE, SUMMARY_FILE
from pipeline.core.export import CHECKSUMS_FILE, DRAFTER_RECORD, export_problem
from pipeline.core.targets import TARGET_RECORD, TargetLoader, target_spec
from pipeline.core.trainer import METRICS_SCHEMA
from pipeline.core.trajectory_files import target_fingerprint, target_mismatch
from storage import Dataset, OpdError, Store, sha256_file
from storage.store import MANIFEST

log = logging.getLogger("opd")

STAGE_NAME = "import-drafter"
STAGE_VERSION = "1"


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise OpdError(f"{path} is not readable JSON ({e}); export the drafter again") from None
    if not isinstance(data, dict):
        raise OpdError(f"{path} is not a JSON object; export the drafter again")
    return data


def describe(directory: Path) -> dict[str, Any]:
    """What `directory` records about its drafter, checked against its own sha256s: `kind`
    (export | dataset), `target` (how to load it, or None), `fingerprint`, `trained_depth`,
    `trained_k`, `provenance`, and `files` (name -> sha256 of every file read)."""
    directory = Path(directory).expanduser()
    if not directory.is_dir():
        raise OpdError(f"{directory} is not a directory: pass an `opd export` directory")
    if (directory / MANIFEST).is_file():
        return _describe_dataset(directory)
    if not (directory / CHECKSUMS_FILE).is_file():
        raise OpdError(
            f"{directory} is neither an `opd export` directory (no {CHECKSUMS_FILE}) nor a "
            f"drafter dataset (no {MANIFEST}): export the drafter with `opd export`"
        )
    # notes added beside the export (a provenance file) are read by people, not here
    if (problem := export_problem(directory, extra_ok=True)) is not None:
        raise OpdError(f"{directory} fails its checksums: {problem}; export it again")
    record_path = directory / DRAFTER_RECORD
    if record_path.is_file():
        record = _read_json(record_path)
    else:  # an export from before the record: its config.json's provenance names the target
        config = _read_json(directory / "config.json")
        prov = config.get(PROVENANCE_KEY) or {}
        record = {"target": None, "target_fingerprint": prov.get("target") or {}}
    files = json.loads((directory / CHECKSUMS_FILE).read_text())["files"]
    return {
        "kind": "export",
        "target": record.get("target"),
        "fingerprint": record.get("target_fingerprint") or {},
        "trained_depth": record.get("trained_depth"),
        "trained_k": record.get("trained_k"),
        "drafter_config": record.get("drafter_config"),
        "provenance": {k: record[k] for k in ("drafter", "lineage", "summary") if k in record},
        "files": {name: f["sha256"] for name, f in sorted(files.items())},
    }


def _describe_dataset(directory: Path) -> dict[str, Any]:
    manifest = _read_json(directory / MANIFEST)
    if manifest.get("name") not in ("sft", "opd"):
        raise OpdError(
            f"{directory} holds a {manifest.get('name')} dataset, not a drafter (sft or opd)"
        )
    files = {}
    for shard in manifest.get("shards", []):
        path = directory / shard["path"]
        if not path.is_file() or sha256_file(path) != shard["sha256"]:
            raise OpdError(
                f"{path} is missing or fails its sha256 in {directory / MANIFEST}: copy the "
                "drafter dataset again"
            )
        files[shard["path"]] = shard["sha256"]
    stage = manifest.get("config", {}).get("stage", {})
    meta = manifest.get("meta", {})
    return {
        "kind": "dataset",
        "target": meta.get(TARGET_RECORD),
        "fingerprint": manifest.get("config", {}).get("target") or meta.get("target") or {},
        "trained_depth": stage.get("ttt_steps"),
        "trained_k": stage.get("tau_k", stage.get("val_ttt_steps")),
        "drafter_config": None,
        "provenance": {
            "drafter": f"{manifest.get('name')}@{manifest.get('version')}",
            "summary": {k: meta[k] for k in ("steps", "validation", "objective") if k in meta},
        },
        "files": files,
    }


def recorded_target(about: dict[str, Any]) -> dict[str, Any] | None:
    """The target spec the drafter records, without its dtype: the dtype a drafter was trained
    beside is no property of the target, and the machine importing it picks its own."""
    spec = about.get("target")
    if not isinstance(spec, dict):
        return None
    return {k: v for k, v in spec.items() if k != "dtype"}


def _load(directory: Path, about: dict[str, Any], loader: TargetLoader) -> Drafter:
    target = loader.target
    try:
        if about["kind"] == "export":
            drafter = read_export(directory, target.embed_weight)
        else:
            drafter = load_drafter(directory, target.embed_weight)
        drafter.check_target(target)
    except (ExportError, ValueError, FileNotFoundError) as e:
        raise OpdError(f"cannot import {directory}: {e}") from None
    wanted = about.get("drafter_config")
    if wanted is not None:
        have = {KIND_KEY: drafter.kind, **drafter.config.to_dict()}
        if json.loads(json.dumps(have)) != wanted:
            raise OpdError(
                f"{directory}: the served files rebuild another drafter config than "
                f"{DRAFTER_RECORD} records; export the drafter again"
            )
    return drafter.eval()


def import_drafter(store: Store, directory: Path, loader: TargetLoader) -> tuple[Dataset, bool]:
    """(the `sft` dataset holding the drafter in `directory`, whether it existed already)."""
    directory = Path(directory).expanduser()
    about = describe(directory)
    mine = target_fingerprint(loader)
    if not about["fingerprint"]:
        raise OpdError(
            f"{directory} records no target it was made for; export it with `opd export`"
        )
    if (diff := target_mismatch(about["fingerprint"], mine)) is not None:
        raise OpdError(
            f"{directory} was made for another target ({diff}); import it beside the target "
            "it was trained for (--set target.path=...)"
        )
    digest = hashlib.sha256(json.dumps(about["files"], sort_keys=True).encode()).hexdigest()
    stage_cfg: dict[str, Any] = {"source": directory.resolve().name, "source_sha256": digest}
    # what trained_depth / trained_k read from an sft dataset's config
    if isinstance(about["trained_depth"], int):
        stage_cfg["ttt_steps"] = about["trained_depth"]
    if isinstance(about["trained_k"], int):
        stage_cfg["tau_k"] = about["trained_k"]
    writer = store.writer(
        "sft",
        stage=STAGE_NAME,
        stage_version=STAGE_VERSION,
        config={"stage": stage_cfg, "target": loader.identity},
    )
    if writer.exists():
        store.set_latest(writer.ref)
        return store.open(writer.ref), True
    drafter = _load(directory, about, loader)
    summary = {
        "drafter_kind": drafter.kind,
        "imported": {
            "path": str(directory.resolve()),
            "format": about["kind"],
            "sha256": digest,
            **about["provenance"],
        },
        # what `opd show` prints in the lineage: the directory and the hash of its files
        "source": {
            "file": directory.resolve().name,
            "path": str(directory.resolve()),
            "sha256": digest,
        },
        "draft_vocab_size": drafter.vocab.draft_vocab_size,
        "target": loader.identity,
        "steps": (about["provenance"].get("summary") or {}).get("steps"),
    }
    with writer:
        if writer.exists():
            return store.open(writer.ref), True
        with tempfile.TemporaryDirectory() as tmp:
            save_drafter(drafter, tmp)
            for name in (WEIGHTS_FILE, CONFIG_FILE):
                writer.write_file(name, Path(tmp) / name)
        vocab = {"d2t": drafter.vocab.d2t.cpu(), "t2d": drafter.vocab.t2d.cpu()}
        writer.write_bytes(VOCAB_FILE, save_safetensors(vocab))
        writer.write_parquet(METRICS_FILE, pa.Table.from_pylist([], schema=METRICS_SCHEMA))
        writer.write_bytes(SUMMARY_FILE, json.dumps(summary, indent=2, sort_keys=True).encode())
        ds = writer.commit(meta=summary | {TARGET_RECORD: target_spec(loader.cfg)})
    log.info("imported %s from %s", ds.ref, directory)
    return ds, False
