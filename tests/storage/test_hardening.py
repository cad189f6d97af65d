"""Issue #14: nothing silently wrong, no data lost, refs never leave the root."""

import errno
import json
import os
import shutil
import subprocess
import sys

import pyarrow as pa
import pytest

import storage.layout
from storage import CorruptDataset, DatasetNotFound, OpdError, Store, check_run_name


def make(store: Store, rows: list[int], *, replace: bool = False, crash_after: int | None = None):
    """A two-shard prompts dataset whose content is `rows`, at the same version each time."""
    w = store.writer("prompts", stage="prompts", stage_version="1", config={}, replace=replace)
    with w:
        if w.exists():
            return store.open(w.ref)
        for i in range(2):
            if i == crash_after:
                raise KeyboardInterrupt  # stands in for a crash mid-stage
            if not w.has_shard(f"part-{i}.parquet"):
                w.write_parquet(f"part-{i}.parquet", pa.table({"x": [r + i for r in rows]}))
        return w.commit()


def values(store: Store, ref: str = "prompts@latest") -> list[int]:
    ds = store.open(ref)
    ds.verify_all(rehash=True)
    return ds.read_table()["x"].to_pylist()


def hidden(store: Store) -> list[str]:
    return sorted(p.name for p in (store.root / "prompts").iterdir() if p.name.startswith(".v"))


def dead_pid() -> int:
    p = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True)
    return int(p.stdout)


# -- verify -----------------------------------------------------------------------------


def test_verify_hashes_every_byte_even_when_size_and_mtime_match_the_cache(tmp_path):
    store = Store(tmp_path)
    ds = make(store, [1, 2, 3])
    ds.verify_all()  # fills the verify cache
    shard = ds.path / "part-1.parquet"
    st = shard.stat()
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert shard.stat().st_size == st.st_size and shard.stat().st_mtime_ns == st.st_mtime_ns
    with pytest.raises(CorruptDataset, match=rf"{ds.ref}: shard 'part-1.parquet' fails its sha256"):
        store.open(ds.ref).verify_all(rehash=True)
    # the cache no longer vouches for the shard, so ordinary reads catch it too
    with pytest.raises(CorruptDataset, match="part-1.parquet"):
        store.open(ds.ref).verify_all()


# -- refs stay inside the root ----------------------------------------------------------


def test_run_names_and_latest_cannot_leave_the_root(tmp_path):
    root = tmp_path / "deep" / "root"
    store = Store(root)
    ds = make(store, [1])
    # a JSON file and a dataset-looking directory outside the root
    (tmp_path / "deep" / "x.json").write_text(json.dumps({"datasets": {"prompts": str(ds.ref)}}))
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (outside / "manifest.json").write_text(json.dumps(ds.manifest))

    for bad in ("../x", "../../deep/x", "a/b", "Upper", "x\n", ""):
        if bad.strip() == bad:  # resolve strips the whole ref first
            with pytest.raises(OpdError, match="invalid run name"):
                store.resolve(f"prompts@run:{bad}")
        with pytest.raises(OpdError, match="invalid run name"):
            check_run_name(bad)
        with pytest.raises(OpdError, match="invalid run name"):
            store.record_run(bad, {"prompts": ds.ref})
    assert check_run_name("exp-1_b") == "exp-1_b"

    latest = root / "prompts" / "LATEST"
    for content in ("../../../elsewhere", "../" + ds.ref.version, "\x00\xff"):
        latest.write_text(content)
        with pytest.raises(CorruptDataset, match=r"LATEST holds .*not a dataset version"):
            store.resolve("prompts")
    latest.write_text(ds.ref.version + "\n")
    assert store.resolve("prompts@latest") == ds.ref

    # a run record that maps a name to another dataset, or to a path, is refused
    store.record_run("r1", {"prompts": ds.ref})
    assert store.resolve("prompts@run:r1") == ds.ref
    (root / "_runs" / "r1.json").write_text(json.dumps({"datasets": {"prompts": "../../x"}}))
    with pytest.raises(CorruptDataset, match="run record .*r1.json is corrupted"):
        store.resolve("prompts@run:r1")
    (root / "_runs" / "r1.json").write_text(
        json.dumps({"datasets": {"features": str(ds.ref).replace("prompts", "trajectories")}})
    )
    with pytest.raises(CorruptDataset, match="maps features to trajectories@"):
        store.resolve("features@run:r1")


@pytest.mark.parametrize("prefix", ["a", "ab", "abc"])
def test_short_version_prefix_says_how_many_digits(tmp_path, prefix):
    store = Store(tmp_path)
    make(store, [1])
    with pytest.raises(OpdError, match=rf"prefix '{prefix}' .* too short: give at least 4"):
        store.resolve(f"prompts@{prefix}")


# -- failed writes ----------------------------------------------------------------------


def test_full_disk_at_latest_is_one_error_and_leaves_no_temporary(tmp_path, monkeypatch):
    store = Store(tmp_path)
    ds = make(store, [1])

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(storage.layout.os, "fsync", full)
    with pytest.raises(OpdError, match=r"disk full while writing prompts/LATEST; .*free space"):
        store.set_latest(ds.ref)
    with pytest.raises(OpdError, match="disk full while writing run record"):
        store.record_run("r", {"prompts": ds.ref})
    monkeypatch.undo()
    leftovers = [p for p in tmp_path.rglob("*") if ".tmp-" in p.name]
    assert leftovers == []


# -- replacing a committed version ------------------------------------------------------


def test_replace_keeps_the_old_dataset_readable_until_the_new_one_commits(tmp_path):
    store = Store(tmp_path)
    old = make(store, [1, 2])
    version = old.ref.version
    with pytest.raises(KeyboardInterrupt):
        make(store, [7, 8], replace=True, crash_after=1)
    assert values(store) == [1, 2, 2, 3]  # LATEST still names a complete, verified dataset
    assert hidden(store) == []
    assert (store.staging_dir("prompts", version) / "part-0.parquet").exists()

    new = make(store, [7, 8], replace=True)  # resumes from the staged shard
    assert new.ref == old.ref and new.path == old.path
    assert values(store) == [7, 8, 8, 9]
    assert not store.staging_dir("prompts", version).exists()
    assert [p.name for p in (tmp_path / "prompts").iterdir() if p.name.startswith(".")] == [
        f".{version}.lock"
    ]


@pytest.mark.parametrize("finisher", ["writer", "gc"])
def test_a_swap_killed_between_its_renames_is_finished(tmp_path, finisher):
    store = Store(tmp_path / "root")
    old = make(store, [1])
    new = make(Store(tmp_path / "other"), [5])  # the same version, other content
    assert new.ref == old.ref
    # where the two-rename swap leaves it when killed between `final -> aside` and
    # `staging -> final`
    shutil.copytree(new.path, store.staging_dir("prompts", old.ref.version))
    old.path.rename(old.path.with_name(f".{old.ref.version}.replaced-{dead_pid()}"))
    with pytest.raises(DatasetNotFound, match="`opd gc`"):
        store.open("prompts@latest")
    if finisher == "writer":
        make(store, [9])  # finds the version committed once the swap is finished
    else:
        removed = store.gc()
        assert old.path not in removed
    assert values(store) == [5, 6]
    assert hidden(store) == []


def test_gc_restores_what_an_older_forced_run_left_aside(tmp_path):
    """The state the runner's old rename-aside left after kill -9: LATEST names an incomplete
    directory and the complete dataset sits in `.VERSION.replaced-N`."""
    store = Store(tmp_path)
    old = make(store, [1])
    aside = old.path.with_name(f".{old.ref.version}.replaced-1700000000")
    old.path.rename(aside)
    old.path.mkdir()
    (old.path / "part-0.parquet").write_bytes(b"half of a recompute")
    with pytest.raises(DatasetNotFound):
        store.open("prompts@latest")
    assert [p.name for p in store.gc(dry_run=True)] == [old.ref.version]
    assert aside.exists()
    store.gc()
    assert values(store) == [1, 2]
    assert hidden(store) == []


# -- gc ---------------------------------------------------------------------------------


def test_gc_removes_work_dirs_of_committed_versions_and_stale_temporaries(tmp_path):
    store = Store(tmp_path)
    ds = make(store, [1])
    v = ds.ref.version
    done_work = tmp_path / "_work" / "prompts" / v
    (done_work / "step-00000002").mkdir(parents=True)
    (done_work / "step-00000002" / "tensors.safetensors").write_bytes(b"x")
    running = tmp_path / "_work" / "sft" / "0123456789ab"  # a stage that has not committed
    (running / "step-00000004").mkdir(parents=True)
    dead, alive = dead_pid(), os.getpid()
    stale = [
        tmp_path / "prompts" / f".LATEST.tmp-{dead}",
        tmp_path / "_runs" / f".r.json.tmp-{dead}",
        tmp_path / "_baseline" / f".key.json.tmp-{dead}",  # an evaluation's free-baseline cache
        store.verify_cache(ds.ref) / f".part-0.parquet.ok.tmp-{dead}",
        tmp_path / f".write-probe-{dead}",
        running / f".step-00000006.tmp-{dead}",
        ds.path.with_name(f".{v}.replaced-{dead}"),
    ]
    live = [
        tmp_path / "prompts" / f".LATEST.tmp-{alive}",
        tmp_path / "_baseline" / f".key.json.tmp-{alive}",
        running / f".step-00000008.tmp-{alive}",
    ]
    for p in stale + live:
        p.parent.mkdir(parents=True, exist_ok=True)
        if "step" in p.name or "replaced" in p.name:
            p.mkdir()
        else:
            p.write_text("x")
    shutil.copytree(ds.path, stale[-1], dirs_exist_ok=True)  # a complete copy beside it

    removed = store.gc()
    assert sorted(map(str, removed)) == sorted(map(str, [done_work, *stale]))
    assert all(p.exists() for p in live) and (running / "step-00000004").is_dir()
    assert values(store) == [1, 2]
    assert store.gc() == []


def test_an_edited_manifest_that_still_parses_is_refused(tmp_path):
    store = Store(tmp_path)
    ds = make(store, [1])
    path = ds.path / "manifest.json"
    text = path.read_text()
    assert '"rows": 2' in text
    path.write_text(text.replace('"rows": 2', '"rows": 3'))
    with pytest.raises(CorruptDataset, match=rf"{ds.ref}: manifest.json fails its sha256 check"):
        store.open(ds.ref)
    path.write_text(text)
    assert store.open(ds.ref).num_rows == 2


# -- a version directory proves which version it is -----------------------------------------


def test_a_copied_or_linked_version_directory_is_refused_and_listed_invalid(tmp_path):
    from click.testing import CliRunner

    from cli.main import cli

    store = Store(tmp_path / "root")
    ds = make(store, [1, 2, 3])
    copy = store.root / "prompts" / "bbbbbbbbbbbb"
    shutil.copytree(ds.path, copy)
    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(ds.path, elsewhere)
    link = store.root / "prompts" / "cccccccccccc"
    link.symlink_to(elsewhere, target_is_directory=True)
    with pytest.raises(CorruptDataset, match=rf"holds the manifest of {ds.ref} \(copied"):
        store.open("prompts@bbbbbbbbbbbb")
    with pytest.raises(CorruptDataset, match="outside the data root"):
        store.open("prompts@cccc")
    rows = {r["version"]: r for r in store.listing("prompts")}
    assert rows[ds.ref.version]["complete"] and rows[ds.ref.version]["invalid"] is None
    for v in ("bbbbbbbbbbbb", "cccccccccccc"):
        assert not rows[v]["complete"] and rows[v]["invalid"]
    out = CliRunner().invoke(cli, ["--root", str(store.root), "ls", "prompts"])
    assert out.exit_code == 0, out.output
    assert sum("INVALID" in line for line in out.output.splitlines()) == 4  # 2 rows, 2 reasons
    r = CliRunner().invoke(cli, ["--root", str(store.root), "show", "prompts@bbbb", "--verify"])
    assert r.exit_code == 2 and "copied or renamed" in r.output, r.output
    assert values(store) == [1, 2, 3, 2, 3, 4]  # the real version reads as before
    (elsewhere / ".part-9.parquet.tmp-1").write_text("")  # what gc would take from a dataset
    store.gc()
    assert copy.is_dir() and sorted(p.name for p in elsewhere.iterdir()) == sorted(
        [*(p.name for p in ds.path.iterdir()), ".part-9.parquet.tmp-1"]
    )  # refused, never deleted, and nothing outside the root cleaned
