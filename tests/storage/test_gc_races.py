"""Issue #40: `opd gc` beside a live writer, a link where gc expects a directory, and JSON files
on disk that do not decode (nested too deeply, not JSON, not an object)."""

import fcntl
import json
import os

import pyarrow as pa
import pytest
from click.testing import CliRunner

import storage.layout
from cli.main import cli
from storage import CorruptDataset, Store
from tests.storage.test_hardening import dead_pid, make, values

DEEP = "[" * 100_000 + "]" * 100_000


def writer(store: Store):
    return store.writer("prompts", stage="prompts", stage_version="1", config={})


def gc_between_open_and_flock(monkeypatch, store: Store, removed: list) -> None:
    """Run `store.gc()` once, just after the next writer opens its lock file and before it
    flocks it: the moment a gc could unlink the file the writer is about to lock."""
    real, pending = fcntl.flock, [True]

    def flock(fd: int, op: int) -> None:
        if pending and op & fcntl.LOCK_EX:
            pending.clear()  # gc's own flocks below go straight through
            removed.extend(store.gc())
        real(fd, op)

    monkeypatch.setattr(storage.layout.fcntl, "flock", flock)


def test_gc_never_takes_the_lock_or_the_directory_of_a_writer_starting_beside_it(
    tmp_path, monkeypatch
):
    store, removed = Store(tmp_path), []
    w = writer(store)
    gc_between_open_and_flock(monkeypatch, store, removed)
    with w:
        monkeypatch.undo()
        lock = tmp_path / "prompts" / f".{w.version}.lock"
        # gc may remove the file it held, but the writer then locks the one the path names
        assert os.fstat(w._lock_fd).st_ino == lock.stat().st_ino
        w.write_parquet("part-0.parquet", pa.table({"x": [1]}))
        assert store.gc() == []  # later gcs find the lock held and the directory in progress
        w.write_parquet("part-1.parquet", pa.table({"x": [2]}))
        assert store.gc() == []
        w.commit()
    assert values(store) == [1, 2]


def test_gc_never_removes_the_directory_of_a_rank_whose_lock_file_did_not_exist_yet(
    tmp_path, monkeypatch
):
    store = Store(tmp_path)

    def rank(r: int):
        return store.writer(
            "prompts", stage="prompts", stage_version="1", config={}, rank=r, world_size=2
        )

    with rank(1) as one:
        one.write_parquet("part-1.parquet", pa.table({"x": [2]}))
        one.rank_done()
    # Rank 0 starts between gc's listing of the version's lock files and its flocks: its own
    # lock file did not exist when gc listed them.
    zero, real, pending = rank(0), fcntl.flock, [True]

    def flock(fd: int, op: int) -> None:
        if pending:
            pending.clear()
            zero.__enter__()
            zero.write_parquet("part-0.parquet", pa.table({"x": [1]}))
        real(fd, op)

    monkeypatch.setattr(storage.layout.fcntl, "flock", flock)
    removed = store.gc()
    monkeypatch.undo()
    try:
        assert removed == [] and zero.ranks_done() == [1]
        zero.rank_done()
        zero.wait_for_ranks(timeout_s=5)
        zero.commit()
    finally:
        zero.__exit__(None, None, None)
    assert sorted(values(store)) == [1, 2]


def test_gc_removes_an_abandoned_lock_and_directory_holding_them_first(tmp_path):
    store = Store(tmp_path)
    with pytest.raises(KeyboardInterrupt):
        make(store, [1], crash_after=1)
    d = tmp_path / "prompts"
    (version,) = store.versions("prompts")
    assert (d / f".{version}.lock").exists()
    removed = store.gc()
    assert [p.name for p in removed] == [version]  # its lock file goes with it
    assert [p.name for p in d.iterdir()] == []
    assert make(store, [1]).num_rows == 2  # a writer after gc starts afresh


def test_gc_unlinks_a_link_where_it_expects_a_directory_and_never_follows_it(tmp_path):
    store = Store(tmp_path / "root")
    ds = make(store, [1])
    v = ds.ref.version
    inside = store.root / "kept"  # a directory of the root that is not gc's
    inside.mkdir()
    (inside / "f").write_text("x")
    links = [
        store.root / "prompts" / "0123456789ab",  # an incomplete version, as gc sees it
        store.root / "prompts" / f".{v}.replaced-{dead_pid()}",
        store.root / "_work" / "prompts" / v,
        store.root / "_cache" / "verified" / "prompts" / "ba9876543210",
    ]
    for link in links:
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(inside, target_is_directory=True)
    removed = store.gc()
    assert sorted(map(str, removed)) == sorted(map(str, links))
    assert not any(p.is_symlink() for p in links)
    assert (inside / "f").read_text() == "x" and values(store) == [1, 2]


def opd(root, *args):
    return CliRunner().invoke(cli, ["--root", str(root), *args])


def one_line_error(result, *messages):
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    for message in messages:
        assert message in lines[0], result.output


@pytest.mark.parametrize("content", [DEEP, "{not json", "[1, 2]"])
def test_an_unreadable_manifest_is_listed_invalid_and_opening_it_is_one_line(tmp_path, content):
    store = Store(tmp_path)
    ds = make(store, [1])
    (ds.path / "manifest.json").write_text(content)
    (row,) = store.listing()
    assert not row["complete"] and "manifest.json" in row["invalid"]
    r = opd(tmp_path, "ls")
    assert r.exit_code == 0 and "INVALID" in r.output, r.output
    one_line_error(opd(tmp_path, "show", str(ds.ref)), "manifest.json", "delete")
    with pytest.raises(CorruptDataset, match="manifest.json"):
        store.open(ds.ref)


@pytest.mark.parametrize("content", [DEEP, "{not json", '{"datasets": ' + DEEP + "}"])
def test_an_unreadable_run_record_is_one_line(tmp_path, content):
    store = Store(tmp_path)
    ds = make(store, [1])
    path = store.record_run("exp", {"prompts": ds.ref})
    assert json.loads(path.read_text())["datasets"] == {"prompts": str(ds.ref)}
    path.write_text(content)
    one_line_error(opd(tmp_path, "show", "prompts@run:exp"), str(path), "delete it")


def test_gc_goes_on_when_a_lock_file_it_listed_is_unlinked_before_it_opens_it(
    tmp_path, monkeypatch
):
    # A writer refused before its first shard unlinks the lock file it created (as gc does),
    # so the file gc listed for a training work directory can be gone by the time gc opens it.
    store = Store(tmp_path)
    v = make(store, [1]).ref.version
    work = tmp_path / "_work" / "prompts" / v
    work.mkdir(parents=True)
    lock = tmp_path / "prompts" / f".{v}.lock"
    real_open = os.open

    def open_(path, flags, *args, **kwargs):
        if str(path) == str(lock) and flags == os.O_RDWR:  # gc's check for a live writer
            lock.unlink(missing_ok=True)  # the writer's refusal, just before it
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(storage.layout.os, "open", open_)
    removed = store.gc()  # was: FileNotFoundError
    monkeypatch.undo()
    assert removed == [work] and values(store) == [1, 2]
