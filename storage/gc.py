"""Garbage collection of a data root: incomplete versions, leftovers of replacements, training
work directories and temporaries of dead processes, never what a writer holds."""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

from storage.layout import (
    _BESIDE_RE,
    _VERSION_RE,
    _complete,
    _names,
    _outside_root,
    _remove,
    stale_temporary,
)


class StoreGc:
    """`Store.gc`: what no writer holds and no complete dataset needs goes, and what locks say."""

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
        tops = (self.root, self.root / "_runs", self.root / "_tune", self.root / "_baseline")
        for folder in (*tops, *cache.glob("*/*")):
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
