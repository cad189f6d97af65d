"""Writing one dataset version: shards under its lock, the ranks' marks, the commit that writes
the manifest last (or swaps a recomputed version in)."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.ipc as ipc
import pyarrow.parquet as pq

from storage.dataset import Dataset
from storage.errors import OpdError
from storage.fingerprint import dataset_version
from storage.layout import (
    _MANIFEST_SUM,
    _SHARD_RE,
    MANIFEST,
    MANIFEST_FORMAT,
    DatasetRef,
    _complete,
    _exchange,
    _fsync_dir,
    _manifest_sum,
    atomic_write_text,
    disk_error,
    sha256_file,
    take_lock,
)
from storage.provenance import now_iso, provenance

if TYPE_CHECKING:
    from storage.store import Store


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
