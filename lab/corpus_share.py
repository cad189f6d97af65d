"""Write the rows SFT's data-curve runs on a small share of a corpus read, as a corpus file.

A curve point trained from scratch on a share of a committed corpus needs features for only the
share's rows and the held-out ones; featurizing the whole corpus on a CPU costs hours. This
writes the held-out split (sft's `val_share`, seed 0) and the largest nested training share as
one trajectories file, with the row digest `opd data import` checks, and prints the
`sft.val_share` and `sft.train_share` that select the same rows inside it:

    python -m lab.corpus_share assets/smollm2/corpus/FILE.parquet --shares 0.01,0.03 --out SUB.parquet
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pyarrow.parquet as pq

from pipeline.core.batches import holdout_split, nested_subset
from pipeline.core.trajectory_files import content_digest

META = b"opd_trajectories"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("corpus", type=Path)
    ap.add_argument("--shares", required=True, help="nested training shares, e.g. 0.01,0.03")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--val-share", type=float, default=0.05, help="sft.val_share of the curve")
    args = ap.parse_args()

    table = pq.read_table(args.corpus)
    keys = table.column("seq_id").to_pylist()
    train, val = holdout_split(keys, args.val_share, 0)
    shares = sorted(float(s) for s in args.shares.split(","))
    picked = {s: nested_subset(keys, train, s, 0) for s in shares}
    sub = table.take(sorted(set(val) | set(picked[shares[-1]])))

    # Inside the file, the smallest hashes are the same held-out rows, and each share the same
    # nested rows: say which fractions select them, and check that they do.
    sub_keys = sub.column("seq_id").to_pylist()
    val_share = len(val) / len(sub_keys)
    sub_train, sub_val = holdout_split(sub_keys, val_share, 0)
    assert {sub_keys[i] for i in sub_val} == {keys[i] for i in val}
    mask = table.column("loss_mask")
    report: dict = {"rows": len(sub_keys), "held_out": len(val), "sft.val_share": val_share}
    for s, rows in picked.items():
        train_share = len(rows) / len(sub_train)
        got = nested_subset(sub_keys, sub_train, train_share, 0)
        assert {sub_keys[i] for i in got} == {keys[i] for i in rows}
        generated = sum(sum(mask[i].as_py()) for i in rows)
        report[str(s)] = {"sft.train_share": train_share, "rows": len(rows), "generated": generated}

    meta = json.loads(table.schema.metadata[META])
    meta["subset_of"] = {
        "file": str(args.corpus),
        "content_sha256": meta["content_sha256"],
        "rows": f"sft's held-out split (val_share {args.val_share}, seed 0) and the nested "
        f"training shares {shares}",
    }
    meta |= {"rows": sub.num_rows, "content_sha256": content_digest(sub)}
    pq.write_table(sub.replace_schema_metadata({META: json.dumps(meta).encode()}), args.out)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
