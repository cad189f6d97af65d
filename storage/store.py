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

import contextlib
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
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.ipc as ipc
import pyarrow.parquet as pq

from storage.errors import CorruptDataset, DatasetNotFound, OpdError
from storage.fingerprint import VERSION_LEN, dataset_version
from storage.jsonfile import UnreadableJson, read_json_object
from storage.provenance import now_iso, provenance

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


class Dataset:
    """A committed dataset opened for reading. Only shards listed in the manifest are read."""

    def __init__(self, store: Store, ref: DatasetRef):
        self.store = store
        self.ref = ref
        self.path = store.dataset_dir(ref.name, ref.version)
        manifest_path = self.path / MANIFEST
        if self.path.exists() and (outside := _outside_root(store, self.path)) is not None:
            raise CorruptDataset(
                f"{ref} is not a dataset of this root: {outside}; remove the link and re-run "
                "its stage here"
            )
        if not manifest_path.exists():
            if self.path.exists():
                raise DatasetNotFound(
                    f"{ref} is incomplete (no manifest.json): re-run its stage to resume it, "
                    "or `opd gc` to remove it"
                )
            if store._recovery_source(ref.name, ref.version) is not None:
                raise DatasetNotFound(
                    f"{ref} was set aside by a replacement that was killed: `opd gc` (or a "
                    "re-run of its stage) puts it back"
                )
            raise DatasetNotFound(f"dataset {ref} does not exist under {store.root}; see `opd ls`")
        try:
            self.manifest: dict[str, Any] = read_json_object(manifest_path)
        except UnreadableJson as e:
            raise CorruptDataset(
                f"{ref}: manifest.json does not parse ({e.reason}); the dataset is corrupted: "
                f"delete {self.path} and re-run its stage"
            ) from None
        # Manifests written before they carried a checksum are read as they are.
        expected = self.manifest.get(_MANIFEST_SUM)
        if expected is not None and expected != _manifest_sum(self.manifest):
            raise CorruptDataset(
                f"{ref}: manifest.json fails its sha256 check (edited or corrupted): "
                f"delete {self.path} and re-run its stage"
            )
        if (problem := _identity_problem(store, ref, self.manifest)) is not None:
            raise CorruptDataset(
                f"{ref} is not what its directory holds: {problem}; remove {self.path} (or "
                "give it back its own name) and re-run its stage"
            )
        self._shards = {s["path"]: s for s in self.manifest.get("shards", [])}
        self._verified: set[str] = set()

    def __repr__(self) -> str:
        return f"Dataset({self.ref})"

    @property
    def config(self) -> dict[str, Any]:
        return self.manifest["config"]

    @property
    def inputs(self) -> dict[str, str]:
        return self.manifest["inputs"]

    @property
    def meta(self) -> dict[str, Any]:
        return self.manifest.get("meta", {})

    @property
    def num_rows(self) -> int:
        return int(self.manifest.get("rows", 0))

    def shards(self, fmt: str | None = None) -> list[str]:
        """Shard paths in manifest order, optionally only those of one format."""
        return [p for p, s in self._shards.items() if fmt is None or s["format"] == fmt]

    def file(self, shard: str) -> Path:
        """The verified path of one listed shard or file."""
        if shard not in self._shards:
            raise OpdError(
                f"{self.ref} has no shard {shard!r}; listed: {', '.join(self._shards) or 'none'}"
            )
        path = self.path / shard
        if shard not in self._verified:
            self._verify(shard, path)
            self._verified.add(shard)
        return path

    def verify_all(self, *, rehash: bool = False) -> None:
        """Check every listed shard; `rehash` hashes every byte even where the verify cache
        says a file of this size and mtime was checked (a flipped byte keeps both)."""
        for shard in self._shards:
            if rehash:
                self._verify(shard, self.path / shard, rehash=True)
                self._verified.add(shard)
            else:
                self.file(shard)

    def _verify(self, shard: str, path: Path, rehash: bool = False) -> None:
        entry = self._shards[shard]
        try:
            st = path.stat()
        except FileNotFoundError:
            raise CorruptDataset(
                f"{self.ref}: shard {shard!r} is missing from {self.path}; "
                "delete the dataset directory and re-run its stage"
            ) from None
        if st.st_size != entry["bytes"]:
            raise CorruptDataset(
                f"{self.ref}: shard {shard!r} has {st.st_size} bytes, the manifest says "
                f"{entry['bytes']}; the shard is corrupted: delete {self.path} and re-run its stage"
            )
        # Hash once per (size, mtime): later opens only stat the file.
        stamp = self.store.verify_cache(self.ref) / (shard.replace("/", "%") + ".ok")
        key = f"{entry['sha256']} {st.st_size} {st.st_mtime_ns}"
        if not rehash and stamp.exists() and stamp.read_text() == key:
            return
        if sha256_file(path) != entry["sha256"]:
            with contextlib.suppress(OSError):  # a stale stamp would vouch for it next time
                stamp.unlink(missing_ok=True)
            raise CorruptDataset(
                f"{self.ref}: shard {shard!r} fails its sha256 check; the shard is corrupted: "
                f"delete {self.path} and re-run its stage"
            )
        with contextlib.suppress(OSError):  # a read-only root still reads, just re-hashes
            stamp.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_text(stamp, key)

    # -- typed readers ---------------------------------------------------------------------

    def read_ipc(self, shard: str) -> pa.Table:
        """A memory-mapped Arrow IPC shard: column buffers point into the page cache."""
        source = pa.memory_map(str(self.file(shard)), "r")
        return ipc.open_file(source).read_all()

    def ipc_batches(self, shard: str) -> Iterator[pa.RecordBatch]:
        source = pa.memory_map(str(self.file(shard)), "r")
        reader = ipc.open_file(source)
        for i in range(reader.num_record_batches):
            yield reader.get_batch(i)

    def parquet_files(self) -> list[str]:
        """Absolute paths of the (verified) Parquet shards, for polars/datasets/pyarrow."""
        return [str(self.file(s)) for s in self.shards("parquet")]

    def scan(self):
        """A polars LazyFrame over all Parquet shards."""
        import polars as pl

        files = self.parquet_files()
        if not files:
            raise OpdError(f"{self.ref} has no Parquet shards to scan")
        return pl.scan_parquet(files)

    def read_table(self) -> pa.Table:
        files = self.parquet_files()
        if not files:
            raise OpdError(f"{self.ref} has no Parquet shards")
        return pa.concat_tables(pq.read_table(f) for f in files)


class DatasetWriter:
    """Writes one dataset version; use as a context manager (it holds the version's lock).

    Call `write_*` per shard (skipping those `has_shard` reports complete, to resume), then
    `commit()`. Leaving the block without commit keeps the completed shards for a re-run.

    With `replace=True` a committed version is recomputed: shards go to a staging directory
    (`dir` points there inside the block) and `commit()` swaps it with the committed one, so
    the old dataset is readable until the new one is complete.
    """

    def __init__(
        self,
        store: Store,
        name: str,
        *,
        stage: str,
        stage_version: str,
        config: dict[str, Any],
        inputs: dict[str, DatasetRef | str],
        rank: int = 0,
        world_size: int = 1,
        replace: bool = False,
    ):
        store.check_name(name)
        if not 0 <= rank < world_size:
            raise OpdError(f"rank {rank} is not in [0, world_size={world_size})")
        self.rank, self.world_size = rank, world_size
        self.store = store
        self.name = name
        self.stage = stage
        self.stage_version = stage_version
        self.config = config
        self.inputs = {role: str(ref) for role, ref in inputs.items()}
        for ref in self.inputs.values():
            DatasetRef.parse_exact(ref)  # inputs must be exact versions, never "latest"
        self.version = dataset_version(stage, stage_version, config, self.inputs)
        self.ref = DatasetRef(name, self.version)
        self.final_dir = store.dataset_dir(name, self.version)
        self.dir = self.final_dir
        self.replace = replace
        self._lock_fd: int | None = None
        self._shared_fd: int | None = None  # a rank's share of the version's plain lock
        self._made_lock: Path | None = None  # the lock file this writer created, if it did
        self._started = now_iso()

    def exists(self) -> bool:
        """Whether the directory this writer writes (the staging one when replacing) is committed."""
        return (self.dir / MANIFEST).exists()

    def __enter__(self) -> DatasetWriter:
        self.store.ensure_writable()
        self.dir.parent.mkdir(parents=True, exist_ok=True)
        # One lock per rank: ranks of a sharded stage write disjoint shards side by side.
        plain = self.dir.parent / f".{self.version}.lock"
        waiting = f"{self.ref} is being written by another process"
        if self.world_size > 1:
            # Each rank also shares the plain lock, which gc takes exclusively (creating it if
            # need be) before it removes anything: gc lists the rank lock files before it locks
            # them, so a rank whose own lock file did not exist yet would go unseen.
            self._shared_fd = take_lock(plain, waiting, shared=True)
            lock = plain.with_name(f".{self.version}.r{self.rank}.lock")
        else:
            lock = plain
        # Another writer creating it meanwhile is harmless: this one unlinks it only holding it.
        made = not lock.exists()
        try:
            self._lock_fd = take_lock(lock, waiting)
        except BaseException:
            self._release()
            raise
        self._made_lock = lock if made else None
        if self.rank == 0:
            self.store._restore(self.name, self.version)
            staging = self.store.staging_dir(self.name, self.version)
            for leftover in self.store._replacement_leftovers(self.name, self.version):
                # staged shards of an earlier forced run are resumed, not removed
                if leftover != staging or _complete(staging):
                    shutil.rmtree(leftover)
        if self.replace and _complete(self.final_dir):
            self.dir = self.store.staging_dir(self.name, self.version)
        self.dir.mkdir(exist_ok=True)
        if self.world_size > 1:
            self._failed_mark(self.rank).unlink(missing_ok=True)  # this attempt may succeed
        # Temporaries of a crashed writer are garbage; complete shards are kept. With several
        # ranks only this rank's temporaries are ours to remove.
        for tmp in self.dir.glob("**/.*.tmp-*"):
            if self.world_size == 1 or self._owned(tmp.name):
                tmp.unlink(missing_ok=True)
        return self

    def discard_if_empty(self) -> None:
        """Remove this writer's directory if nothing was written into it (a run refused before
        its first shard), so it does not show as an incomplete dataset until `opd gc`, and the
        lock file if this writer created it: a refusal leaves the root's files as it found them."""
        self._require_lock()
        with contextlib.suppress(OSError):  # not empty (or already gone): keep it for a re-run
            self.dir.rmdir()
        if self._made_lock is not None and not self.dir.exists():
            # Unlinked while held, as gc does: a writer waiting on this file finds it gone once
            # it holds it, and locks the file the path names then (`take_lock`).
            self._made_lock.unlink(missing_ok=True)
            self._made_lock = None

    def _owned(self, name: str) -> bool:
        return f".tmp-r{self.rank}-" in name

    def rank_done(self) -> None:
        """Mark this rank's shards complete (sharded stages call it instead of commit)."""
        self._require_lock()
        atomic_write_text(self.dir / f".rank-{self.rank}-of-{self.world_size}.done", now_iso())

    def rank_failed(self) -> None:
        """Mark this rank failed, so a rank waiting for it stops with an error instead of
        waiting out its timeout (a re-run of the rank clears the mark)."""
        self._require_lock()
        atomic_write_text(self._failed_mark(self.rank), now_iso())

    def _failed_mark(self, rank: int) -> Path:
        return self.dir / f".rank-{rank}-of-{self.world_size}.failed"

    def ranks_done(self) -> list[int]:
        return sorted(
            int(p.name.split("-")[1]) for p in self.dir.glob(f".rank-*-of-{self.world_size}.done")
        )

    def wait_for_ranks(self, timeout_s: float = 3600) -> None:
        """Rank 0 waits until every other rank is done, so what it summarises or commits last
        covers all of them."""
        others = list(range(1, self.world_size))
        deadline = time.monotonic() + timeout_s
        while [r for r in self.ranks_done() if r in others] != others:
            failed = [r for r in others if self._failed_mark(r).exists()]
            if failed:
                raise OpdError(
                    f"rank {failed[0]} of {self.world_size} failed (its own error says why); "
                    "a re-run resumes from every rank's completed shards"
                )
            if time.monotonic() > deadline:
                raise OpdError(f"ranks {others} did not finish within {timeout_s:.0f}s of rank 0")
            time.sleep(0.1)

    @contextlib.contextmanager
    def commit_lock(self) -> Iterator[None]:
        """Held by the rank deciding whether to commit: two ranks finishing together must not
        both find every rank done and both commit (the second would list no shards)."""
        fd = take_lock(self.dir.parent / f".{self.version}.commit.lock")
        try:
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

    def __exit__(self, *exc: object) -> None:
        self.dir = self.final_dir
        self._release()

    def _release(self) -> None:
        for fd in (self._lock_fd, self._shared_fd):
            if fd is not None:
                fcntl.flock(fd, fcntl.LOCK_UN)
                os.close(fd)
        self._lock_fd = self._shared_fd = None

    def _require_lock(self) -> None:
        if self._lock_fd is None:
            raise RuntimeError("DatasetWriter used outside its `with` block")

    def _meta_path(self, shard: str) -> Path:
        p = self.dir / shard
        return p.with_name(f".{p.name}.meta.json")

    def has_shard(self, shard: str) -> bool:
        """True if a previous (possibly killed) run completed this shard."""
        return (self.dir / shard).exists() and self._meta_path(shard).exists()

    def _put(self, shard: str, fmt: str, rows: int | None, write) -> None:
        """Write via a temp file, fsync, record rows/bytes/sha256, then rename into place."""
        self._require_lock()
        if not _SHARD_RE.fullmatch(shard) or ".." in shard.split("/") or shard == MANIFEST:
            raise OpdError(f"invalid shard name {shard!r}")
        final = self.dir / shard
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = final.with_name(f".{final.name}.tmp-r{self.rank}-{os.getpid()}")
        meta_final = self._meta_path(shard)
        meta_tmp = meta_final.with_name(f"{meta_final.name}.tmp-r{self.rank}-{os.getpid()}")
        try:
            write(tmp)
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
            meta = {
                "path": shard,
                "format": fmt,
                "rows": rows,
                "bytes": tmp.stat().st_size,
                "sha256": sha256_file(tmp),
            }
            meta_tmp.write_text(json.dumps(meta))
            # Meta first, then the shard: a visible shard always has its meta.
            os.replace(meta_tmp, meta_final)
            os.replace(tmp, final)
            _fsync_dir(final.parent)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            meta_tmp.unlink(missing_ok=True)
            raise disk_error(e, f"{self.ref} shard {shard!r}") from e

    def write_parquet(self, shard: str, table: pa.Table) -> None:
        # No compression dictionary surprises: zstd is deterministic for identical input.
        self._put(
            shard,
            "parquet",
            table.num_rows,
            lambda p: pq.write_table(table, p, compression="zstd", write_statistics=True),
        )

    def write_ipc(
        self, shard: str, table: pa.Table | list[pa.RecordBatch], fmt: str = "ipc"
    ) -> None:
        """Uncompressed Arrow IPC file, so readers can memory-map it zero-copy. Another `fmt`
        marks a side table that readers of the dataset's `ipc` rows must not take for one."""
        batches = table.to_batches() if isinstance(table, pa.Table) else table
        schema = table.schema if isinstance(table, pa.Table) else batches[0].schema

        def write(p: Path) -> None:
            with pa.OSFile(str(p), "wb") as sink, ipc.new_file(sink, schema) as w:
                for b in batches:
                    w.write_batch(b)

        self._put(shard, fmt, sum(b.num_rows for b in batches), write)

    def write_bytes(self, shard: str, data: bytes, fmt: str = "file") -> None:
        self._put(shard, fmt, None, lambda p: p.write_bytes(data))

    def write_file(self, shard: str, src: Path, fmt: str = "file") -> None:
        """Copy a file produced elsewhere (weights, plots) into the dataset."""
        self._put(shard, fmt, None, lambda p: shutil.copyfile(src, p))

    def discard(self, folder: str) -> None:
        """Remove `folder` and the shards in it: scratch (e.g. each rank's share) that a stage
        merged into its own files before committing."""
        self._require_lock()
        if not _SHARD_RE.fullmatch(folder) or ".." in folder.split("/"):
            raise OpdError(f"invalid folder name {folder!r}")
        shutil.rmtree(self.dir / folder, ignore_errors=True)

    def completed_shards(self) -> list[dict[str, Any]]:
        metas = []
        for m in sorted(self.dir.glob("**/.*.meta.json")):
            meta = json.loads(m.read_text())
            if (self.dir / meta["path"]).exists():
                metas.append(meta)
        return metas

    def commit(self, *, meta: dict[str, Any] | None = None, schema: dict | None = None) -> Dataset:
        """Write manifest.json (atomically, last). `meta` holds stage-specific facts."""
        self._require_lock()
        if self.world_size > 1:
            missing = sorted(set(range(self.world_size)) - set(self.ranks_done()))
            if missing:
                raise OpdError(f"{self.ref}: ranks {missing} have not finished; cannot commit yet")
        shards = sorted(self.completed_shards(), key=lambda s: s["path"])
        if schema is None:
            schema = self._schemas(shards)
        manifest = {
            "format": MANIFEST_FORMAT,
            "name": self.name,
            "version": self.version,
            "stage": self.stage,
            "stage_version": self.stage_version,
            "config": self.config,
            "inputs": self.inputs,
            "rows": sum(s["rows"] or 0 for s in shards if s["format"] in ("parquet", "ipc")),
            "bytes": sum(s["bytes"] for s in shards),
            "shards": shards,
            "schema": schema,
            "meta": meta or {},
            "provenance": provenance(self._started),
        }
        manifest[_MANIFEST_SUM] = _manifest_sum(manifest)
        try:
            atomic_write_text(self.dir / MANIFEST, json.dumps(manifest, indent=2, sort_keys=True))
        except OSError as e:
            raise disk_error(e, f"{self.ref} manifest") from e
        for m in [*self.dir.glob("**/.*.meta.json"), *self.dir.glob(".rank-*")]:
            m.unlink()
        if self.dir != self.final_dir:
            self._swap_in()
        self.store.set_latest(self.ref)
        return Dataset(self.store, self.ref)

    def _swap_in(self) -> None:
        """Make the committed staging directory the version's directory, then drop the old one."""
        staging, final = self.dir, self.final_dir
        if _exchange(staging, final):
            old = staging
        else:  # two renames; `Store.recover` finishes them if a kill lands in between
            old = final.with_name(f".{self.version}.replaced-{os.getpid()}")
            os.rename(final, old)
            os.rename(staging, final)
        _fsync_dir(final.parent)
        self.dir = final
        shutil.rmtree(old)
        shutil.rmtree(self.store.verify_cache(self.ref), ignore_errors=True)

    def _schemas(self, shards: list[dict[str, Any]]) -> dict[str, Any]:
        """The Arrow schema of the first shard of each tabular format, as field -> type."""
        out: dict[str, Any] = {}
        for s in shards:
            fmt = s["format"]
            if fmt in out or fmt not in ("parquet", "ipc"):
                continue
            path = self.dir / s["path"]
            sch = pq.read_schema(path) if fmt == "parquet" else ipc.open_file(path).schema
            out[fmt] = {
                f.name: {
                    "type": str(f.type),
                    **{k.decode(): v.decode() for k, v in (f.metadata or {}).items()},
                }
                for f in sch
            }
        return out


class Store:
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

    def _locked(self, name: str, version: str) -> bool:
        """Whether any writer (any rank) currently holds this version."""
        for lock in (self.root / name).glob(f".{version}*.lock"):
            try:
                fd = os.open(lock, os.O_RDWR)
            except FileNotFoundError:
                continue  # unlinked since the glob by its refused writer, or by another gc
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return True
            else:
                fcntl.flock(fd, fcntl.LOCK_UN)
            finally:
                os.close(fd)
        return False

    def _locked_anywhere(self, version: str) -> bool:
        return any(self._locked(n, version) for n in self.names())

    def _committed_anywhere(self, version: str) -> bool:
        return any(_complete(self.dataset_dir(n, version)) for n in self.names())

    def gc(self, dry_run: bool = False) -> list[Path]:
        """Remove what no writer holds and no complete dataset needs: incomplete versions,
        leftovers of replacements (after restoring a complete copy a kill left aside), the
        training work directories of committed versions, and temporaries of dead processes."""
        doomed: list[Path] = []
        for name in self.names():
            d = self.root / name
            beside = {m.group(1) for p in d.iterdir() if (m := _BESIDE_RE.fullmatch(p.name))}
            locked = {p.name[1:].split(".")[0] for p in d.glob(".*.lock")}
            for v in sorted({*self.versions(name), *beside, *locked}):
                if _outside_root(self, self.dataset_dir(name, v)):
                    continue  # not the root's to clean
                # Removed while holding the version's locks: a writer starting now waits for
                # gc, then finds its lock file gone and takes a new one (`take_lock`).
                with self._hold(name, v, create=not dry_run) as locks:
                    if locks is not None:  # else held by a writer
                        doomed += self._gc_version(name, v, locks, dry_run)
            doomed += [p for p in d.glob(".*.tmp-*") if stale_temporary(p)]
        work = self.root / "_work"
        for v_dir in work.glob("*/*") if work.is_dir() else []:
            v = v_dir.name
            if not v_dir.is_dir() or not _VERSION_RE.fullmatch(v) or self._locked_anywhere(v):
                continue
            if self._committed_anywhere(v):
                doomed.append(v_dir)  # checkpoints of a finished stage: never read again
            else:
                doomed += [p for p in v_dir.glob(".*.tmp-*") if stale_temporary(p)]
        cache = self.root / "_cache" / "verified"
        for c_dir in cache.glob("*/*") if cache.is_dir() else []:
            if not _complete(self.dataset_dir(c_dir.parent.name, c_dir.name)):
                doomed.append(c_dir)
        for folder in (self.root, self.root / "_runs", self.root / "_tune", *cache.glob("*/*")):
            if folder.is_dir():
                doomed += [p for p in folder.glob(".*") if p.is_file() and stale_temporary(p)]
        # Once each, and not again inside a directory that goes anyway.
        doomed = list(dict.fromkeys(doomed))
        doomed = [p for p in doomed if not any(q in p.parents for q in doomed)]
        if not dry_run:
            for p in doomed:
                _remove(p)
        return doomed

    def _gc_version(
        self, name: str, v: str, locks: list[tuple[Path, bool]], dry_run: bool
    ) -> list[Path]:
        """What gc removes of one version whose locks it holds (removed now unless
        `dry_run`): an incomplete directory, a complete one's leftovers, and its lock files
        once nothing of the version is left."""
        keep = self._recovery_source(name, v)
        if not dry_run:
            self._restore(name, v)
            keep = None
        final = self.dataset_dir(name, v)
        found: list[Path] = []
        if (final.is_dir() or final.is_symlink()) and not _complete(final):
            found.append(final)
        elif _complete(final):
            found += [
                *final.glob("**/.*.tmp-*"),
                *final.glob("**/.*.meta.json"),
                *final.glob(".rank-*"),
            ]
        if keep is None:
            found += self._replacement_leftovers(name, v)
        else:  # dry run: what the restore would leave beside the version
            beside_v = [self.staging_dir(name, v), *self._replaced_dirs(name, v)]
            found += [p for p in beside_v if p.exists() and p != keep]
        # Lock files go once nothing of the version is left; reported only where they were
        # all that was left (gc's own, or those of a directory it removes, go silently).
        gone = [lock for lock, existed in locks if not existed]
        rest = [final, self.staging_dir(name, v), *self._replaced_dirs(name, v)]
        if not any(p.exists() or p.is_symlink() for p in rest if p not in found):
            theirs = [lock for lock, existed in locks if existed]
            (gone if final in found else found).extend(theirs)
        if not dry_run:
            for p in [*found, *gone]:
                _remove(p)
        return found

    @contextlib.contextmanager
    def _hold(
        self, name: str, version: str, *, create: bool
    ) -> Iterator[list[tuple[Path, bool]] | None]:
        """Every lock file of `version` taken without waiting: (path, whether it existed
        before) per lock, or None when a writer holds one. With `create` the plain writer's
        lock is taken even where its file did not exist, so no writer starts meanwhile."""
        d = self.root / name
        plain = d / f".{version}.lock"
        paths = sorted({*d.glob(f".{version}*.lock"), *([plain] if create else [])})
        held: list[tuple[Path, int, bool]] = []
        try:
            for path in paths:
                existed = path.exists()
                flags = os.O_RDWR | (os.O_CREAT if create and path == plain else 0)
                try:
                    fd = os.open(path, flags, 0o644)
                except FileNotFoundError:
                    continue  # removed since the glob (another gc)
                held.append((path, fd, existed))
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    break
                if not _names(fd, path):
                    break  # another gc removed it meanwhile: the version is its to clean
            else:
                yield [(path, existed) for path, _, existed in held]
                return
            yield None
        finally:
            for _, fd, _ in held:
                os.close(fd)  # releases the flock
