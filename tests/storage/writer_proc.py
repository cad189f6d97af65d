"""A stage-like writer run in a subprocess by the crash and concurrency tests.

usage: python writer_proc.py ROOT N_SHARDS [kill-after-shard I | kill-mid-shard I | slow S]
Writes N deterministic shards (Parquet and Arrow IPC with a bf16 tensor column), resuming
from completed ones, then commits. Kill modes SIGKILL the process itself at that point.
"""

import os
import signal
import sys
import time
from pathlib import Path

import pyarrow as pa
import torch

from storage import Store, tensor_array, tensor_field


def shard_tables(i: int) -> tuple[pa.Table, pa.Table]:
    g = torch.Generator().manual_seed(i)
    field = tensor_field("hidden", torch.bfloat16, 16)
    tensors = [torch.randn(5 + j, 16, generator=g).bfloat16() for j in range(4)]
    ipc = pa.table(
        [pa.array(range(4 * i, 4 * i + 4), pa.int64()), tensor_array(tensors, field)],
        schema=pa.schema([pa.field("seq_id", pa.int64()), field]),
    )
    tab = pa.table({"seq_id": list(range(4 * i, 4 * i + 4)), "x": [float(j) for j in range(4)]})
    return ipc, tab


def main() -> None:
    root, n = sys.argv[1], int(sys.argv[2])
    mode, arg = (sys.argv[3], sys.argv[4]) if len(sys.argv) > 4 else (None, None)
    store = Store(root)
    w = store.writer("features", stage="test", stage_version="1", config={"n": n})
    with w:
        if w.exists():
            print("exists")
            return
        for i in range(n):
            if mode == "slow":
                time.sleep(float(arg))
            ipc, tab = shard_tables(i)
            if mode == "kill-mid-shard" and i == int(arg):

                def half_then_die(p: Path) -> None:
                    p.write_bytes(b"partial bytes of a shard")
                    os.kill(os.getpid(), signal.SIGKILL)

                w._put(f"shard-{i:05d}.arrow", "ipc", 4, half_then_die)
            if not w.has_shard(f"shard-{i:05d}.arrow"):
                w.write_ipc(f"shard-{i:05d}.arrow", ipc)
            if not w.has_shard(f"table-{i:05d}.parquet"):
                w.write_parquet(f"table-{i:05d}.parquet", tab)
            if mode == "kill-after-shard" and i == int(arg):
                os.kill(os.getpid(), signal.SIGKILL)
        w.commit(meta={"shards": n})
    print("committed")


if __name__ == "__main__":
    main()
