"""Feature caching cost vs the bare target forward over the same batches.

Runs, alternately `--repeats` times on the same trajectories: (a) the bare target forward of
every batch (what any feature cache must pay), and (b) the `features` stage end to end into a
fresh store (forward + bf16 conversion + Arrow IPC shards + checksums + manifest). Prints JSON
with both times and their ratio (goal <= 1.15).

    python -m lab.benchmarks.bench_features [--sequences 64] [--len 256] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import torch

from pipeline.core.runner import RunContext, run_stage
from pipeline.core.targets import TargetConfig, TargetLoader
from pipeline.stages import features, generate
from storage import Store


def make_trajectories(store: Store, n: int, length: int, vocab: int) -> object:
    g = torch.Generator().manual_seed(0)
    rows = []
    for i in range(n):
        ids = torch.randint(3, vocab, (length,), generator=g).tolist()
        rows.append(
            {
                "seq_id": f"s{i}",
                "prompt_id": f"p{i}",
                "input_ids": ids,
                "prompt_len": 16,
                "loss_mask": [0] * 16 + [1] * (length - 16),
                "finish_reason": "length",
                "temperature": 0.0,
                "top_p": 1.0,
                "seed": 0,
            }
        )
    w = store.writer(
        "trajectories", stage="bench", stage_version="1", config={"n": n, "len": length}
    )
    with w:
        w.write_parquet("part-00000.parquet", pa.Table.from_pylist(rows, schema=generate.SCHEMA))
        return w.commit()


def measure(sequences: int, length: int, repeats: int, target_cfg: TargetConfig) -> dict:
    """Best-of-`repeats` seconds of the bare forward and of the features stage, and their ratio."""
    loader = TargetLoader(target_cfg)
    target = loader.target
    cfg = features.Config(batch_size=8, rows_per_shard=32)
    tmp = Path(tempfile.mkdtemp(prefix="opd-bench-"))
    try:
        traj = make_trajectories(Store(tmp / "src"), sequences, length, target.vocab_size)
        seqs = traj.read_table().column("input_ids").to_pylist()
        bare, cached = [], []
        for r in range(repeats):
            t0 = time.perf_counter()
            with torch.no_grad():
                for b in range(0, len(seqs), cfg.batch_size):
                    target(torch.tensor(seqs[b : b + cfg.batch_size], device=target.device))
            _sync(target.device)
            bare.append(time.perf_counter() - t0)
            store = Store(tmp / f"run{r}")
            ctx = RunContext(store=store, target_loader=loader, progress=False)
            t0 = time.perf_counter()
            run_stage(features.STAGE, cfg, {"trajectories": traj}, ctx)
            cached.append(time.perf_counter() - t0)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return {
        "device": str(target.device),
        "sequences": sequences,
        "tokens_per_sequence": length,
        "bare_forward_s": round(min(bare), 3),
        "features_stage_s": round(min(cached), 3),
        "ratio_features_vs_bare": round(min(cached) / min(bare), 3),
        "bare_runs_s": [round(x, 3) for x in bare],
        "features_runs_s": [round(x, 3) for x in cached],
    }


def _sync(device: torch.device) -> None:
    if device.type == "cuda":  # kernels run asynchronously; time what they did
        torch.cuda.synchronize(device)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sequences", type=int, default=64)
    ap.add_argument("--len", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--target", default="embedded")
    ap.add_argument("--device", default="auto")
    args = ap.parse_args()
    target = TargetConfig(path=args.target, aux_layer_ids=[1, 3, 5], device=args.device)
    print(json.dumps(measure(args.sequences, args.len, args.repeats, target), indent=2))


if __name__ == "__main__":
    main()
