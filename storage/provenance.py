"""What produced an artifact: code revision, package versions, command line, host, times."""

from __future__ import annotations

import importlib.metadata
import platform
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

_PACKAGES = (
    "opd-pipeline",
    "torch",
    "transformers",
    "tokenizers",
    "safetensors",
    "pyarrow",
    "polars",
    "datasets",
    "prefect",
    "vllm",
)
_REPO = Path(__file__).resolve().parent.parent


def now_iso() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(
            ["git", "-C", str(_REPO), *args], capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def git_state() -> dict[str, Any]:
    """The code's git sha and whether the work tree had uncommitted changes (None if not a repo)."""
    sha = _git("rev-parse", "HEAD")
    if sha is None:
        return {"sha": None, "dirty": None}
    status = _git("status", "--porcelain", "--untracked-files=no")
    return {"sha": sha, "dirty": bool(status)}


def package_versions() -> dict[str, str]:
    versions = {}
    for name in _PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return versions


def provenance(started_at: str | None = None) -> dict[str, Any]:
    return {
        "git": git_state(),
        "packages": package_versions(),
        "python": platform.python_version(),
        "host": platform.node(),
        "command": sys.argv,
        "started_at": started_at or now_iso(),
        "committed_at": now_iso(),
    }
