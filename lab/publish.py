"""`opd publish`: copy a run's report out of a data root into the repository.

A data root lives on the machine that made it; the repository is what carries over. Publishing
copies an experiment's or evaluation's report dataset (its tables, plots, report.md and its
manifest, which records the stage, config, inputs and headline numbers), the experiment's full
result JSON where the root kept one, or a benchmark's JSON output, into lab/published/NAME/,
with provenance.json saying where it came from. docs/findings.md renders its tables from these
folders (lab/findings.py), so no number there is typed by hand.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import subprocess
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from storage import OpdError, Store

PUBLISHED = Path(__file__).resolve().parent / "published"
REPORT_NAMES = ("experiment", "eval")
MAX_FILE_BYTES = 8 << 20  # a report's tables and plots; a training dataset's shards are larger
PROVENANCE = "provenance.json"
RESULT = "result.json"
MANIFEST = "manifest.json"


def _check_name(name: str) -> None:
    ok = name and all(c.isalnum() or c in "-._" for c in name) and name[0].isalnum()
    if not ok:
        raise OpdError(
            f"--as {name!r}: a published name is letters, digits, '-', '.' and '_', starting with "
            "a letter or digit (e.g. smollm2-eagle3-opd-vs-sft)"
        )


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _code_commit() -> str | None:
    """The repository's commit, when this checkout is a git one (a record, not a check)."""
    done = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=PUBLISHED.parent, capture_output=True, text=True
    )
    return (done.stdout.strip() or None) if done.returncode == 0 else None


def _result_json(store: Store, ref: str) -> Path | None:
    """The experiment's whole result (every seed's runs), saved beside the root's datasets."""
    for path in sorted((store.root / "_experiments").glob("*.json")):
        try:
            if json.loads(path.read_text()).get("report") == ref:
                return path
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            continue  # another run's file being written, or not ours to judge
    return None


def this_machine() -> str:
    """This machine in words: its GPU, else its CPU model and torch's CPU capability."""
    import torch

    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}"
    cpuinfo = Path("/proc/cpuinfo")
    fields: dict[str, str] = {}
    for line in cpuinfo.read_text().splitlines() if cpuinfo.is_file() else []:
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())  # the first core's
    cpu = fields.get("model name") or platform.processor() or "unknown CPU"
    cpu = " ".join(w for w in cpu.replace("(R)", "").split() if w != "Processor")
    if "model" in fields:
        cpu += f" (model {fields['model']})"
    flags = set(fields.get("flags", "").split())
    bf16 = "AVX-512-BF16" if "avx512_bf16" in flags else "no AVX-512-BF16"
    amx = "AMX" if "amx_tile" in flags else "no AMX"
    capability = torch.backends.cpu.get_cpu_capability()
    return f"{cpu}, {os.cpu_count()} cores, {capability}, {bf16}, {amx}, torch {torch.__version__}"


def _files_of_dataset(store: Store, ref: str) -> tuple[dict[str, Path], dict[str, Any]]:
    from models.drafters import recorded_kind

    ds = store.open(ref)
    if ds.ref.name not in REPORT_NAMES:
        raise OpdError(
            f"{ds.ref} is a {ds.ref.name} dataset; publish a report: an experiment@VERSION or "
            "eval@VERSION dataset, or a benchmark's JSON file"
        )
    files = {shard: ds.file(shard) for shard in ds.shards()}
    files[MANIFEST] = ds.path / MANIFEST
    if (result := _result_json(store, str(ds.ref))) is not None:
        files[RESULT] = result
    origin: dict[str, Any] = {"ref": str(ds.ref), "stage": ds.manifest.get("stage")}
    if (drafter := ds.manifest.get("inputs", {}).get("drafter")) is not None:
        origin["drafter_kind"] = recorded_kind(store.open(drafter).path)
    return files, origin


def publish(
    store: Store,
    source: str,
    name: str,
    *,
    replace: bool = False,
    command: str | None = None,
    hardware: str | None = None,
    into: Path = PUBLISHED,
) -> Path:
    """Copy `source` (a report dataset's ref, or a benchmark's JSON file) into `into`/`name`;
    the folder it wrote. Nothing is changed unless every file copies: the copy is made beside
    the destination and renamed into place."""
    _check_name(name)
    dest = into / name
    if dest.exists() and not replace:
        raise OpdError(f"{dest} exists; pass --replace to publish {source} over it")
    if source.endswith(".json"):
        path = Path(source)
        if not path.is_file():
            raise OpdError(f"no benchmark JSON at {path}")
        files = {RESULT: path}
        origin: dict[str, Any] = {"file": path.name}
    else:
        files, origin = _files_of_dataset(store, source)
    sizes = {n: p.stat().st_size for n, p in files.items()}
    big = [f"{n} ({size:,} bytes)" for n, size in sizes.items() if size > MAX_FILE_BYTES]
    if big:
        raise OpdError(
            f"{source}: {', '.join(big)} over {MAX_FILE_BYTES >> 20} MiB; a published report is "
            "tables, plots and JSON, not training data"
        )
    provenance = {
        **origin,
        "published_as": name,
        "data_root": str(store.root),
        "command": command,
        # a data root lives on the machine that made it, so by default the publishing one
        "hardware": hardware or this_machine(),
        "code_commit": _code_commit(),
        "published_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "files": {n: _sha256(p) for n, p in sorted(files.items())},
    }
    into.mkdir(parents=True, exist_ok=True)
    staging = into / f".{name}.{os.getpid()}.tmp"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    try:
        for file_name, path in files.items():
            shutil.copyfile(path, staging / file_name)
        (staging / PROVENANCE).write_text(json.dumps(provenance, indent=2) + "\n")
        old = into / f".{name}.{os.getpid()}.old"
        if dest.exists():
            dest.rename(old)
        staging.rename(dest)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return dest
