"""The `rollouts` dataset's shard layout: written by `rollout`, read by `score` and `opd`."""

from __future__ import annotations


def shard_files(i: int) -> tuple[str, str, str, str]:
    return (
        f"sequences-{i:05d}.parquet",
        f"features-{i:05d}.arrow",
        f"rejections-{i:05d}.parquet",
        f"steps-{i:05d}.parquet",
    )


TEACHER_FORMAT = "teacher-ipc"
"""The teachers' manifest format: Arrow IPC, but not rows of features (`shards("ipc")`)."""


def teacher_file(i: int) -> str:
    """Shard i's verify-forward teachers, written only with `rollout.keep_teacher`."""
    return f"teacher-{i:05d}.arrow"
