"""A committed dataset opened for reading: its manifest, verified shards, tables and scans."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.ipc as ipc
import pyarrow.parquet as pq

from storage.errors import CorruptDataset, DatasetNotFound, OpdError
from storage.jsonfile import UnreadableJson, read_json_object
from storage.layout import (
    _MANIFEST_SUM,
    MANIFEST,
    DatasetRef,
    _identity_problem,
    _manifest_sum,
    _outside_root,
    atomic_write_text,
    sha256_file,
)

if TYPE_CHECKING:
    from storage.store import Store


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
