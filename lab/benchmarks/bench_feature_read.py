"""Feature-shard read throughput vs a plain copy of the same bytes, from the page cache.

Writes one ~1 GB feature shard (bf16 aux hidden states, ragged rows) through the store, then
alternates, `--repeats` times: (a) the real read path: memory-mapped IPC -> zero-copy torch
view -> batches of rows copied into contiguous training tensors; (b) a plain copy of the
shard file's bytes into a preallocated buffer. Prints JSON with GB/s of each and their ratio.

    python -m lab.benchmarks.bench_feature_read [--gb 1.0] [--repeats 3] [--dir /tmp/x]
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch

from storage import Store, read_tensor_column, tensor_array, tensor_field


def write_shard(root: Path, gb: float, dim: int) -> tuple[Store, str]:
    store = Store(root)
    field = tensor_field("aux_hidden", torch.bfloat16, dim)
    bytes_per_tok = dim * 2
    n_tok = int(gb * (1 << 30)) // bytes_per_tok
    g = torch.Generator().manual_seed(0)
    lengths = []
    while sum(lengths) < n_tok:
        lengths.append(int(torch.randint(128, 1024, (1,), generator=g)))
    lengths[-1] -= sum(lengths) - n_tok
    base = torch.randn(1024, dim, generator=g).bfloat16()
    tensors = [base[:n].clone() for n in lengths]
    table = pa.table(
        [pa.array(range(len(tensors)), pa.int64()), tensor_array(tensors, field)],
        schema=pa.schema([pa.field("seq_id", pa.int64()), field]),
    )
    del tensors
    w = store.writer("features", stage="bench", stage_version="1", config={"gb": gb, "dim": dim})
    with w:
        w.write_ipc("shard-00000.arrow", table)
        w.commit()
    return store, "features@latest"


def read_path(store: Store, ref: str, batch_rows: int) -> int:
    ds = store.open(ref)
    table = ds.read_ipc("shard-00000.arrow")
    field = table.schema.field("aux_hidden")
    values, offsets = read_tensor_column(table.column("aux_hidden"), field)
    n = 0
    for i in range(0, len(offsets) - 1, batch_rows):
        j = min(i + batch_rows, len(offsets) - 1)
        batch = values[offsets[i] : offsets[j]].clone()  # what a loader hands the trainer
        n += batch.numel() * 2
    return n


def plain_copy(path: Path, buf: np.ndarray) -> int:
    with open(path, "rb", buffering=0) as f:
        n = f.readinto(memoryview(buf))
    return n


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gb", type=float, default=1.0)
    ap.add_argument("--dim", type=int, default=768, help="3 x hidden of the embedded target")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batch-rows", type=int, default=16)
    ap.add_argument("--dir", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    tmp = Path(args.dir or tempfile.mkdtemp(prefix="opd-bench-"))
    try:
        store, ref = write_shard(tmp, args.gb, args.dim)
        path = store.open(ref).path / "shard-00000.arrow"
        size = path.stat().st_size
        t0 = time.perf_counter()
        store.open(ref).verify_all()  # first open: sha256 of the shard
        verify_s = time.perf_counter() - t0
        buf = np.empty(size, dtype=np.uint8)
        plain_copy(path, buf)  # warm the page cache
        read_path(store, ref, args.batch_rows)
        ours, copy = [], []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            n = read_path(store, ref, args.batch_rows)
            ours.append(n / (time.perf_counter() - t0) / 1e9)
            t0 = time.perf_counter()
            m = plain_copy(path, buf)
            copy.append(m / (time.perf_counter() - t0) / 1e9)
        best_ours, best_copy = max(ours), max(copy)
        print(
            json.dumps(
                {
                    "shard_bytes": size,
                    "tensor_bytes_read": n,
                    "read_path_GBps": round(best_ours, 3),
                    "plain_copy_GBps": round(best_copy, 3),
                    "ratio_read_vs_copy": round(best_ours / best_copy, 3),
                    "read_path_runs_GBps": [round(x, 3) for x in ours],
                    "plain_copy_runs_GBps": [round(x, 3) for x in copy],
                    "first_open_verify_s": round(verify_s, 2),
                    "first_open_verify_GBps": round(size / verify_s / 1e9, 3),
                },
                indent=2,
            )
        )
    finally:
        if args.dir is None:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
