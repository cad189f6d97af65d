"""The embedded target's corpus: the running interpreter's standard-library sources, split by module.

Real code nobody on the project wrote. Tests are excluded (a target trained on the stdlib's own test
suite would mostly learn assertion boilerplate), and so are generated data files that are not code
(charmap tables from `gencodec.py`, `pydoc_data`'s documentation strings): they would spend a
fifth of the training budget on tables.

The split is by module (one `.py` file = one module, named with its dotted path) and is decided by
a hash of the module name alone, so it never depends on file order, on the machine, or on which
other files exist: the same interpreter version always gives the same split.
"""

from __future__ import annotations

import hashlib
import json
import sysconfig
from dataclasses import dataclass
from pathlib import Path

SPLITS = ("train", "validation", "heldout")
# Directory names excluded anywhere in a path; `site-packages` holds third-party code, not stdlib.
EXCLUDED_DIRS = frozenset(
    {"test", "tests", "idlelib", "site-packages", "pydoc_data", "__pycache__"}
)
# Per 1000 modules (by hash of the module name): validation, held-out; the rest is train.
VALIDATION_PER_MILLE = 50
HELDOUT_PER_MILLE = 50


@dataclass(frozen=True)
class SourceFile:
    module: str  # dotted name, e.g. "email.mime.text"
    path: Path
    split: str


def stdlib_root() -> Path:
    """The running interpreter's standard-library directory."""
    return Path(sysconfig.get_paths()["stdlib"])


def module_name(rel: Path) -> str:
    parts = list(rel.with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def split_of(module: str) -> str:
    """Assign a module to a split from the hash of its name only."""
    bucket = int.from_bytes(hashlib.sha256(module.encode()).digest()[:8], "big") % 1000
    if bucket < VALIDATION_PER_MILLE:
        return "validation"
    if bucket < VALIDATION_PER_MILLE + HELDOUT_PER_MILLE:
        return "heldout"
    return "train"


def _is_generated(path: Path) -> bool:
    with path.open("rb") as f:
        head = f.read(300)
    return b"gencodec.py" in head


def list_sources(root: Path | None = None) -> list[SourceFile]:
    """Every eligible `.py` file under `root` (default: the stdlib), sorted by module name."""
    root = stdlib_root() if root is None else Path(root)
    if not root.is_dir():
        raise FileNotFoundError(
            f"corpus root {root} is not a directory; pass the directory holding the .py sources"
        )
    files = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if EXCLUDED_DIRS.intersection(rel.parts[:-1]) or _is_generated(path):
            continue
        module = module_name(rel)
        files.append(SourceFile(module=module, path=path, split=split_of(module)))
    files.sort(key=lambda f: f.module)
    if not files:
        raise ValueError(f"no eligible .py files under {root}")
    return files


def read_source(path: Path) -> str | None:
    """The file's text, or None when it is not UTF-8 (a handful of legacy-encoded stdlib files)."""
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        return None


def load_split(files: list[SourceFile], split: str) -> list[tuple[str, str]]:
    """(module, text) for one split, in module order; unreadable files are skipped."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; use one of {SPLITS}")
    out = []
    for f in files:
        if f.split != split:
            continue
        text = read_source(f.path)
        if text is not None and text.strip():
            out.append((f.module, text))
    return out


def manifest(files: list[SourceFile]) -> dict:
    """Per split: the module list, the sha256 of that list, and the sha256 of the contents.

    Recorded in the model's metadata so a re-run can check it trains on the same corpus.
    """
    out = {}
    for split in SPLITS:
        members = [f for f in files if f.split == split]
        names = [f.module for f in members]
        content = hashlib.sha256()
        for f in members:
            content.update(f.module.encode() + b"\0" + f.path.read_bytes() + b"\0")
        out[split] = {
            "modules": names,
            "n_files": len(names),
            "n_bytes": sum(f.path.stat().st_size for f in members),
            "list_sha256": hashlib.sha256(json.dumps(names).encode()).hexdigest(),
            "content_sha256": content.hexdigest(),
        }
    return out
