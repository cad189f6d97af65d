"""The store's layout and its primitives: refs, names, checksums, atomic writes, locks, and
what a complete dataset or a stale temporary looks like on disk."""

from __future__ import annotations

import ctypes
import errno
import fcntl
import functools
import hashlib
import json
import os
import re
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from storage.errors import OpdError
from storage.fingerprint import VERSION_LEN

if TYPE_CHECKING:
    from storage.store import Store


MANIFEST = "manifest.json"
MANIFEST_FORMAT = 1
# The manifest's own checksum, over the rest of it: an edited or flipped value that still
# parses (a config number, a shard's row count) must not be read as the truth.
_MANIFEST_SUM = "manifest_sha256"
_NAME_RE = re.compile(r"[a-z][a-z0-9_-]*")
_VERSION_RE = re.compile(rf"[0-9a-f]{{{VERSION_LEN}}}")
_SHARD_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/-]*")
_MIN_PREFIX = 4
_REF_FORMS = (
    f"expected NAME@VERSION (the {VERSION_LEN} lowercase hex digits of `opd ls NAME`, or a "
    f"unique prefix of at least {_MIN_PREFIX}), NAME@latest or NAME@run:RUN"
)
# A temporary's name ends in the writing process's id: `.X.tmp-PID` or `.X.tmp-rRANK-PID`.
_TMP_PID_RE = re.compile(r"(?:\.tmp-(?:r\d+-)?|^\.write-probe-)(\d+)$")
# What a replacement leaves beside a version: `.<version>.staging`, `.<version>.replaced-N`.
_BESIDE_RE = re.compile(rf"\.([0-9a-f]{{{VERSION_LEN}}})\.(?:staging|replaced-\d+)")
_CHUNK = 8 << 20


def default_root() -> Path:
    return Path(os.environ.get("OPD_HOME", "opd-data"))


def check_root_placement(root: Path) -> None:
    """Refuse a data root inside a dataset version (`<root>/prompts/<v>/...`): its runs and
    datasets would be written into a committed, immutable version."""
    for d in (root.resolve(), *root.resolve().parents):
        if _VERSION_RE.fullmatch(d.name) and _complete(d):
            raise OpdError(
                f"--root/OPD_HOME {root} is inside the dataset version {d} (committed, never "
                "written again): point it at a directory outside any data root's datasets"
            )


@dataclass(frozen=True)
class DatasetRef:
    """An exact dataset: NAME@VERSION."""

    name: str
    version: str

    def __str__(self) -> str:
        return f"{self.name}@{self.version}"

    @staticmethod
    def parse_exact(text: str) -> DatasetRef:
        name, sep, version = text.partition("@")
        if not sep or not _NAME_RE.fullmatch(name) or not _VERSION_RE.fullmatch(version):
            raise OpdError(f"{text!r} is not an exact dataset ref; expected NAME@<12 hex digits>")
        return DatasetRef(name, version)


def check_run_name(run: str) -> str:
    """A run name is a file name under `_runs/`: never a path, so it cannot leave the root."""
    if not _NAME_RE.fullmatch(run):
        raise OpdError(
            f"invalid run name {run!r}: use lowercase letters, digits, - and _, "
            "starting with a letter (e.g. --run-name exp-1)"
        )
    return run


def sha256_file(path: Path) -> str:
    """A file's sha256, read in chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_text(path: Path, text: str) -> None:
    """Write a small file so readers see either the old or the new content, never a torn one."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def disk_error(
    e: OSError, what: str, kept: str = "completed shards are kept and a re-run resumes from them"
) -> OpdError:
    """The one-line error for a failed write; `kept` says what survives and how to go on."""
    if e.errno == errno.ENOSPC:
        return OpdError(
            f"disk full while writing {what}; {kept}: free space or point --root/OPD_HOME at "
            "a larger disk"
        )
    return OpdError(f"could not write {what}: {e}")


def _manifest_sum(manifest: dict[str, Any]) -> str:
    rest = {k: v for k, v in manifest.items() if k != _MANIFEST_SUM}
    return hashlib.sha256(json.dumps(rest, sort_keys=True).encode()).hexdigest()


def _complete(path: Path) -> bool:
    return (path / MANIFEST).is_file()


def stale_temporary(path: Path) -> bool:
    """A temporary whose writing process is gone (a live one may still rename it)."""
    m = _TMP_PID_RE.search(path.name)
    if m is None:
        return False
    try:
        os.kill(int(m.group(1)), 0)
    except ProcessLookupError:
        return True
    except (PermissionError, OverflowError):
        return False
    return False


def _names(fd: int, path: Path) -> bool:
    """Whether `path` still names the file open as `fd` (gc may have unlinked it)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino)


def take_lock(path: Path, waiting: str | None = None, *, shared: bool = False) -> int:
    """An exclusive (or `shared`) flock on the lock file `path`, waiting for its holder
    (saying `waiting` on stderr first). `opd gc` unlinks a lock file only while it holds it,
    so a lock that turns out to be on an unlinked file (gc removed it between our open and
    our flock) is dropped and taken again on the file the path names now: two writers never
    hold locks on two different files of one path."""
    mode = fcntl.LOCK_SH if shared else fcntl.LOCK_EX
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            try:
                fcntl.flock(fd, mode | fcntl.LOCK_NB)
            except BlockingIOError:
                if waiting is not None:  # stderr: stdout may be a command's --json answer
                    print(f"[opd] {waiting}; waiting for it", file=sys.stderr, flush=True)
                    waiting = None
                fcntl.flock(fd, mode)
            if _names(fd, path):
                return fd
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)


def _remove(path: Path) -> None:
    """Remove a file or directory gc found; a link is unlinked, never followed."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _exchange(a: Path, b: Path) -> bool:
    """Swap two directories in one atomic step (Linux renameat2); False where unsupported."""
    fn = getattr(_libc(), "renameat2", None)
    if fn is None:
        return False
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(a))


def _outside_root(store: Store, path: Path) -> str | None:
    """Why `path` (a version directory) is not the root's own: a link that leaves the root
    would let a directory elsewhere pass for a dataset of this one."""
    real, root = path.resolve(), store.root.resolve()
    if root not in real.parents:
        return f"{path} resolves to {real}, outside the data root {root}"
    return None


def _identity_problem(store: Store, ref: DatasetRef, manifest: dict[str, Any]) -> str | None:
    """Why the directory of `ref` does not hold `ref` (None when it does): a version directory
    copied or renamed keeps the manifest of the version it was made as."""
    path = store.dataset_dir(ref.name, ref.version)
    if (outside := _outside_root(store, path)) is not None:
        return outside
    theirs = f"{manifest.get('name')}@{manifest.get('version')}"
    if theirs != str(ref):
        return f"{path} holds the manifest of {theirs} (copied or renamed)"
    return None
