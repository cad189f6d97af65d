import fcntl
import importlib.metadata
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pyarrow as pa
import pytest
import torch

import storage.layout
from pipeline.core.config import StrictConfig, runtime_field, version_dict
from storage import (
    CorruptDataset,
    DatasetNotFound,
    OpdError,
    Store,
    dataset_version,
    read_tensor_column,
    tensor_array,
    tensor_field,
)

PROC = Path(__file__).with_name("writer_proc.py")
REPO = Path(__file__).resolve().parents[2]


def run_proc(root: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    env = os.environ | {
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    }
    p = subprocess.run(
        [sys.executable, str(PROC), str(root), *args], env=env, capture_output=True, text=True
    )
    if check:
        assert p.returncode == 0, p.stderr
    return p


def checksums(store: Store) -> dict[str, str]:
    ds = store.open("features@latest")
    return {s["path"]: s["sha256"] for s in ds.manifest["shards"]}


def make_dataset(store: Store, n: int = 2):
    w = store.writer("prompts", stage="prompts", stage_version="1", config={"n": n})
    with w:
        for i in range(n):
            w.write_parquet(f"part-{i}.parquet", pa.table({"i": list(range(i * 3, i * 3 + 3))}))
        return w.commit()


# -- versions ---------------------------------------------------------------------------


class Cfg(StrictConfig):
    lr: float = 1e-3
    layers: list[int] = [2, 4]
    progress: bool = runtime_field(True, "progress bar only")


def test_version_ignores_key_order_and_runtime_fields():
    a = dataset_version(
        "sft", "1", {"a": 1, "b": {"x": 1, "y": 2}}, {"features": "features@" + "0" * 12}
    )
    b = dataset_version(
        "sft", "1", {"b": {"y": 2, "x": 1}, "a": 1}, {"features": "features@" + "0" * 12}
    )
    assert a == b and len(a) == 12
    assert version_dict(Cfg(progress=False)) == version_dict(Cfg(progress=True))
    assert "progress" not in version_dict(Cfg())


def test_version_changes_with_what_matters():
    base = dataset_version("sft", "1", version_dict(Cfg()), {})
    assert dataset_version("sft", "1", version_dict(Cfg(lr=2e-3)), {}) != base
    assert dataset_version("sft", "2", version_dict(Cfg()), {}) != base
    assert dataset_version("sft", "1", version_dict(Cfg()), {"f": "features@" + "1" * 12}) != base
    with pytest.raises(ValueError, match="non-finite"):
        dataset_version("sft", "1", {"lr": float("nan")}, {})


def test_strict_config_rejects_unknown_keys():
    with pytest.raises(Exception, match="extra"):
        Cfg(lrr=1.0)


# -- write, read, resolve ----------------------------------------------------------------


def test_commit_resolve_and_lineage(tmp_path):
    store = Store(tmp_path)
    ds = make_dataset(store)
    assert ds.num_rows == 6
    assert store.resolve("prompts") == ds.ref
    assert store.resolve("prompts@latest") == ds.ref
    assert store.resolve(f"prompts@{ds.ref.version}") == ds.ref
    assert store.resolve(f"prompts@{ds.ref.version[:6]}") == ds.ref
    w = store.writer(
        "trajectories", stage="generate", stage_version="1", config={}, inputs={"prompts": ds.ref}
    )
    with w:
        w.write_parquet("a.parquet", pa.table({"x": [1]}))
        traj = w.commit()
    store.record_run("demo", {"prompts": ds.ref, "trajectories": traj.ref})
    assert store.resolve("trajectories@run:demo") == traj.ref
    lin = store.lineage(traj.ref)
    assert lin["inputs"]["prompts"]["ref"] == str(ds.ref)
    m = traj.manifest
    assert m["inputs"] == {"prompts": str(ds.ref)}
    assert set(m["provenance"]) >= {"git", "packages", "command", "started_at", "committed_at"}
    assert m["provenance"]["packages"]["torch"] == importlib.metadata.version("torch")
    assert m["shards"][0]["sha256"] and m["shards"][0]["rows"] == 1


def test_tabular_readers(tmp_path):
    import datasets
    import polars as pl

    ds = make_dataset(Store(tmp_path))
    lf = ds.scan()
    assert isinstance(lf, pl.LazyFrame)
    assert lf.select(pl.col("i").sum()).collect().item() == sum(range(6))
    hf = datasets.load_dataset(
        "parquet", data_files=ds.parquet_files(), split="train", cache_dir=str(tmp_path / "hf")
    )
    assert sorted(hf["i"]) == list(range(6))


@pytest.mark.parametrize(
    "ref, msg",
    [
        ("nonsense", "no dataset named .nonsense."),
        ("prompts@@x", "bad dataset ref"),
        ("prompts@zzzz-1", "bad dataset ref"),
        ("prompts@abcdef123456", "no prompts dataset version"),
        ("prompts@run:nope", "no run named"),
        ("sft@latest", "no dataset named 'sft'"),
    ],
)
def test_bad_refs(tmp_path, ref, msg):
    store = Store(tmp_path)
    make_dataset(store)
    with pytest.raises(OpdError, match=msg):
        store.open(ref)


def test_unwritable_root_and_incomplete_dataset(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    store = Store(blocker / "root")
    w = store.writer("prompts", stage="p", stage_version="1", config={})
    with pytest.raises(OpdError, match="not writable"), w:
        pass
    assert not (blocker / "root").exists()

    store = Store(tmp_path / "ok")
    w = store.writer("prompts", stage="p", stage_version="1", config={})
    with w:
        w.write_parquet("a.parquet", pa.table({"x": [1]}))
    with pytest.raises(DatasetNotFound, match="incomplete"):
        store.open(w.ref)
    assert store.listing()[0]["complete"] is False
    assert store.gc(dry_run=True) == [w.dir] and w.dir.exists()
    store.gc()
    assert not w.dir.exists()


def test_inputs_must_be_exact(tmp_path):
    with pytest.raises(OpdError, match="exact dataset ref"):
        Store(tmp_path).writer(
            "sft", stage="s", stage_version="1", config={}, inputs={"f": "features@latest"}
        )


# -- corruption --------------------------------------------------------------------------


def test_corruption_is_detected_with_a_clear_error(tmp_path):
    store = Store(tmp_path)
    ds = make_dataset(store)
    shard = ds.path / "part-1.parquet"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    fresh = store.open(ds.ref)
    with pytest.raises(CorruptDataset, match=rf"{ds.ref}.*part-1.parquet.*sha256"):
        fresh.parquet_files()

    shard.unlink()
    with pytest.raises(CorruptDataset, match=rf"{ds.ref}.*part-1.parquet.*missing"):
        store.open(ds.ref).parquet_files()

    (ds.path / "manifest.json").write_text("{not json")
    with pytest.raises(CorruptDataset, match="manifest.json does not parse"):
        store.open(ds.ref)


def test_verification_is_cached_but_rechecks_changed_files(tmp_path):
    store = Store(tmp_path)
    ds = make_dataset(store)
    ds.verify_all()
    assert list(store.verify_cache(ds.ref).glob("*.ok"))
    shard = ds.path / "part-0.parquet"
    data = bytearray(shard.read_bytes())
    data[10] ^= 1
    shard.write_bytes(bytes(data))  # same size, new mtime: must be re-hashed
    with pytest.raises(CorruptDataset):
        store.open(ds.ref).verify_all()


# -- crashes and concurrency -------------------------------------------------------------


def test_uninterrupted_reference(tmp_path):
    run_proc(tmp_path, "4")
    assert len(checksums(Store(tmp_path))) == 8


@pytest.mark.parametrize("mode", ["kill-after-shard", "kill-mid-shard"])
def test_sigkill_then_resume_is_byte_identical(tmp_path, mode):
    ref_root, root = tmp_path / "ref", tmp_path / "crash"
    run_proc(ref_root, "4")
    p = run_proc(root, "4", mode, "1", check=False)
    assert p.returncode == -signal.SIGKILL
    store = Store(root)
    with pytest.raises(DatasetNotFound):
        store.open("features@latest")
    assert [r["complete"] for r in store.listing()] == [False]
    run_proc(root, "4")
    assert checksums(store) == checksums(Store(ref_root))
    leftovers = [p.name for p in store.open("features@latest").path.iterdir()]
    assert not [n for n in leftovers if n.startswith(".")], leftovers


def test_sigkill_at_a_random_moment_then_resume(tmp_path):
    ref_root, root = tmp_path / "ref", tmp_path / "crash"
    run_proc(ref_root, "6")
    env = os.environ | {
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    }
    p = subprocess.Popen([sys.executable, str(PROC), str(root), "6", "slow", "0.3"], env=env)
    deadline = time.time() + 60
    while time.time() < deadline and not list(root.glob("features/*/shard-00001.arrow")):
        time.sleep(0.02)
    p.send_signal(signal.SIGKILL)
    p.wait()
    run_proc(root, "6")
    assert checksums(Store(root)) == checksums(Store(ref_root))


def test_concurrent_writers_end_with_one_complete_dataset(tmp_path):
    env = os.environ | {
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    }
    procs = [
        subprocess.Popen(
            [sys.executable, str(PROC), str(tmp_path), "4", "slow", "0.05"],
            env=env,
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert sorted(o.strip().splitlines()[-1] for o in outs) == ["committed", "exists"]
    store = Store(tmp_path)
    ds = store.open("features@latest")
    ds.verify_all()
    assert ds.num_rows == 32
    assert len(store.versions("features")) == 1


# -- tensors -----------------------------------------------------------------------------


def test_bf16_round_trip_is_bit_exact_for_every_pattern(tmp_path):
    patterns = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16)
    t = patterns.view(torch.bfloat16).reshape(-1, 64)  # includes NaNs, infs, subnormals, -0
    field = tensor_field("h", torch.bfloat16, 64)
    table = pa.table([tensor_array([t[:100], t[100:]], field)], schema=pa.schema([field]))
    store = Store(tmp_path)
    w = store.writer("features", stage="t", stage_version="1", config={})
    with w:
        w.write_ipc("s.arrow", table)
        ds = w.commit()
    assert ds.manifest["shards"][0]["bytes"] < t.numel() * 2 + 4096  # 2 bytes a value
    back = ds.read_ipc("s.arrow")
    values, offsets = read_tensor_column(back.column("h"), back.schema.field("h"))
    assert values.dtype == torch.bfloat16
    assert torch.equal(values.view(torch.int16), t.view(torch.int16))
    assert offsets.tolist() == [0, 100, 1024]


def _mapping_of(ptr: int) -> str | None:
    for line in Path("/proc/self/maps").read_text().splitlines():
        parts = line.split()
        lo, hi = (int(x, 16) for x in parts[0].split("-"))
        if lo <= ptr < hi:
            return parts[5] if len(parts) > 5 else ""
    return None


def test_read_path_is_zero_copy_from_the_mapped_file(tmp_path):
    field = tensor_field("aux", torch.bfloat16, 32)
    tensors = [torch.randn(n, 32).bfloat16() for n in (7, 1, 12)]
    table = pa.table([tensor_array(tensors, field)], schema=pa.schema([field]))
    store = Store(tmp_path)
    w = store.writer("features", stage="t", stage_version="1", config={})
    with w:
        w.write_ipc("s.arrow", table)
        ds = w.commit()
    back = ds.read_ipc("s.arrow")
    values, offsets = read_tensor_column(back.column("aux"), back.schema.field("aux"))
    assert _mapping_of(values.data_ptr()) == str(ds.file("s.arrow").resolve())
    for i, t in enumerate(tensors):
        assert torch.equal(values[offsets[i] : offsets[i + 1]], t)


def test_sliced_tensor_column_reads_the_right_rows():
    field = tensor_field("h", torch.float32, 3)
    tensors = [torch.full((n, 3), float(n)) for n in (1, 2, 3, 4)]
    arr = tensor_array(tensors, field).slice(1, 2)
    values, offsets = read_tensor_column(arr, field)
    assert offsets.tolist() == [0, 2, 5]
    assert torch.equal(values, torch.cat(tensors[1:3]))


def test_tensor_column_rejects_wrong_shapes():
    field = tensor_field("h", torch.bfloat16, 8)
    with pytest.raises(OpdError, match=r"row 1: expected a \[T, 8\] bfloat16"):
        tensor_array(
            [torch.zeros(2, 8, dtype=torch.bfloat16), torch.zeros(2, 9, dtype=torch.bfloat16)],
            field,
        )


def test_manifest_lists_schema_with_tensor_dtype(tmp_path):
    run_proc(tmp_path, "1")
    m = json.loads(next(Path(tmp_path).glob("features/*/manifest.json")).read_text())
    assert m["schema"]["ipc"]["hidden"]["opd.dtype"] == "bfloat16"
    assert m["schema"]["parquet"]["x"]["type"] == "double"


def test_sharded_writers_commit_only_when_every_rank_is_done(tmp_path):
    store = Store(tmp_path)
    kw = dict(stage="generate", stage_version="1", config={"n": 4})
    writers = [store.writer("trajectories", rank=r, world_size=2, **kw) for r in range(2)]
    assert writers[0].version == writers[1].version
    with writers[0] as w0, writers[1] as w1:  # both ranks hold their own lock at once
        w0.write_parquet("part-r0.parquet", pa.table({"x": [0, 1]}))
        w1.write_parquet("part-r1.parquet", pa.table({"x": [2]}))
        w0.rank_done()
        with pytest.raises(OpdError, match=r"ranks \[1\] have not finished"):
            w0.commit()
        w1.rank_done()
        ds = w1.commit()
    assert ds.num_rows == 3 and [s["path"] for s in ds.manifest["shards"]] == [
        "part-r0.parquet",
        "part-r1.parquet",
    ]
    assert not [p for p in ds.path.iterdir() if p.name.startswith(".")]


def test_a_waiting_rank_stops_when_another_failed_and_a_rerun_clears_the_mark(tmp_path):
    store = Store(tmp_path)
    kw = dict(stage="rollout", stage_version="1", config={"n": 4})
    writers = [store.writer("rollouts", rank=r, world_size=2, **kw) for r in range(2)]
    with writers[1] as w1:
        w1.rank_failed()
    with writers[0] as w0, pytest.raises(OpdError, match="rank 1 of 2 failed"):
        w0.wait_for_ranks(timeout_s=60)
    with writers[1] as w1:  # the re-run of rank 1 takes its mark back, then finishes
        w1.rank_done()
    with writers[0] as w0:
        w0.wait_for_ranks(timeout_s=60)
        w0.rank_done()
        ds = w0.commit()
    assert not [p for p in ds.path.iterdir() if p.name.startswith(".")]


def test_a_writer_waiting_for_another_process_says_so_on_stderr_only(tmp_path, capfd):
    store = Store(tmp_path)
    w = store.writer("trajectories", stage="s", stage_version="1", config={"a": 1})
    lock = store.dataset_dir("trajectories", w.version).parent / f".{w.version}.lock"
    lock.parent.mkdir(parents=True)
    fd = os.open(lock, os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)  # another process is writing this version

    def write():
        with w:
            w.write_parquet("a.parquet", pa.table({"x": [1]}))
            w.commit()

    thread = threading.Thread(target=write)
    thread.start()
    deadline = time.monotonic() + 30
    err = ""
    while "being written by another process" not in err and time.monotonic() < deadline:
        time.sleep(0.05)
        err += capfd.readouterr().err
    fcntl.flock(fd, fcntl.LOCK_UN)
    os.close(fd)
    thread.join(30)
    out, rest = capfd.readouterr()
    assert "being written by another process" in err + rest
    assert out == ""  # a --json answer on stdout stays parseable
    assert store.open(f"trajectories@{w.version}").read_table().num_rows == 1


def _files(root: Path) -> list[Path]:
    return sorted(p.relative_to(root) for p in root.rglob("*"))


def test_a_writer_refused_before_its_first_shard_leaves_the_files_as_it_found_them(tmp_path):
    store = Store(tmp_path)
    make_dataset(store)
    before = _files(tmp_path)
    w = store.writer("prompts", stage="prompts", stage_version="1", config={"n": 5})
    with w:
        assert (tmp_path / "prompts" / f".{w.version}.lock").exists()
        w.discard_if_empty()  # what a refusal inside the stage does
    assert _files(tmp_path) == before  # was: its new lock file stayed

    # A lock file that was there already (a killed writer's) is not this writer's to remove.
    lock = tmp_path / "prompts" / f".{w.version}.lock"
    lock.write_text("")
    with w:
        w.discard_if_empty()
    assert _files(tmp_path) == sorted([*before, lock.relative_to(tmp_path)])


def test_a_writer_waiting_on_a_refused_writers_lock_locks_the_file_its_path_names(
    tmp_path, monkeypatch
):
    store = Store(tmp_path)
    config = {"a": 1}
    refused = store.writer("prompts", stage="prompts", stage_version="1", config=config)
    waiting = store.writer("prompts", stage="prompts", stage_version="1", config=config)
    lock = tmp_path / "prompts" / f".{refused.version}.lock"
    real_flock, blocked, held = fcntl.flock, threading.Event(), []

    def flock(fd: int, op: int) -> None:
        if threading.current_thread() is not threading.main_thread() and not op & fcntl.LOCK_NB:
            blocked.set()  # the waiting writer opened the refused one's lock file and waits
        real_flock(fd, op)

    def write() -> None:
        with waiting:
            held.append(os.fstat(waiting._lock_fd).st_ino == lock.stat().st_ino)
            waiting.write_parquet("a.parquet", pa.table({"x": [1]}))
            waiting.commit()

    with refused:
        monkeypatch.setattr(storage.layout.fcntl, "flock", flock)
        thread = threading.Thread(target=write)
        thread.start()
        assert blocked.wait(30)
        refused.discard_if_empty()  # unlinks the lock file it created, still holding it
        assert not lock.exists()
    thread.join(30)
    assert held == [True]  # not a lock on the unlinked file, which a third writer would miss
    assert store.open(f"prompts@{refused.version}").read_table().num_rows == 1
