"""Fault injection shared by the suite and its kill subprocess.

`instrument` wraps every durable write the pipeline makes (a dataset shard, a training
checkpoint, a dataset commit) and asks a hook, as each one starts, whether to die in it:
"mid" kills the process inside the write (the temporary is written, not yet renamed),
"after" once the write is complete. `disk_full` makes fsync fail with ENOSPC for the files
whose path contains a marker, as a full disk does.
"""

from __future__ import annotations

import errno
import os
import signal
from collections.abc import Callable

import pytest

from pipeline.core import training
from storage.writer import DatasetWriter

Hook = Callable[[str], str | None]


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _die_on_replace(mp: pytest.MonkeyPatch, is_target: Callable[[str, str], bool]) -> None:
    replace = os.replace

    def fatal_replace(src, dst):
        if is_target(os.path.basename(src), os.path.basename(dst)):
            die()
        return replace(src, dst)

    mp.setattr(os, "replace", fatal_replace)


def instrument(mp: pytest.MonkeyPatch, hook: Hook) -> None:
    put, save, commit = DatasetWriter._put, training.Checkpointer.save, DatasetWriter.commit

    def _put(self, shard, fmt, rows, write):
        phase = hook(f"shard {shard}")

        def write_then_maybe_die(path):
            write(path)
            if phase == "mid":
                die()

        put(self, shard, fmt, rows, write_then_maybe_die)
        if phase == "after":
            die()

    def _save(self, step, **kwargs):
        phase = hook(f"checkpoint {step}")
        if phase == "mid":
            _die_on_replace(mp, lambda src, dst: src.startswith(".step-"))
        out = save(self, step, **kwargs)
        if phase == "after":
            die()
        return out

    def _commit(self, **kwargs):
        phase = hook("commit")
        if phase == "mid":
            _die_on_replace(mp, lambda src, dst: dst == "manifest.json")
        out = commit(self, **kwargs)
        if phase == "after":
            die()
        return out

    mp.setattr(DatasetWriter, "_put", _put)
    mp.setattr(training.Checkpointer, "save", _save)
    mp.setattr(DatasetWriter, "commit", _commit)


def disk_full(mp: pytest.MonkeyPatch, marker: str) -> None:
    """fsync of any file or directory whose path contains `marker` fails with ENOSPC."""
    fsync = os.fsync

    def full_fsync(fd):
        if marker in os.readlink(f"/proc/self/fd/{fd}"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return fsync(fd)

    mp.setattr(os, "fsync", full_fsync)
