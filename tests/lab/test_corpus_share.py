import json
import sys

import pyarrow as pa
import pyarrow.parquet as pq

from lab import corpus_share
from pipeline.core.batches import holdout_split, nested_subset
from pipeline.core.trajectory_files import content_digest


def test_the_subset_holds_the_held_out_rows_and_the_shares_sft_would_draw(
    tmp_path, monkeypatch, capsys
):
    n = 400
    table = pa.table(
        {
            "seq_id": [f"p{i}-0" for i in range(n)],
            "input_ids": [[1, 2, 3, i % 7] for i in range(n)],
            "prompt_len": [2] * n,
            "loss_mask": [[0, 0, 1, 1 if i % 2 else 0] for i in range(n)],
        }
    )
    meta = {"format": "opd-trajectories", "rows": n, "content_sha256": content_digest(table)}
    table = table.replace_schema_metadata({corpus_share.META: json.dumps(meta).encode()})
    src, out = tmp_path / "corpus.parquet", tmp_path / "sub.parquet"
    pq.write_table(table, src)
    argv = ["corpus_share", str(src), "--shares", "0.03,0.1", "--out", str(out)]
    monkeypatch.setattr(sys, "argv", argv)
    corpus_share.main()
    report = json.loads(capsys.readouterr().out)

    keys = table.column("seq_id").to_pylist()
    train, val = holdout_split(keys, 0.05, 0)
    want = {keys[i] for i in val} | {keys[i] for i in nested_subset(keys, train, 0.1, 0)}
    sub = pq.read_table(out)
    sub_keys = sub.column("seq_id").to_pylist()
    assert set(sub_keys) == want and len(sub_keys) == report["rows"] == len(want)
    written = json.loads(sub.schema.metadata[corpus_share.META])
    assert written["rows"] == len(want) and written["content_sha256"] == content_digest(sub)
    assert written["subset_of"]["content_sha256"] == meta["content_sha256"]
    # The printed fractions select, inside the file, what sft would have drawn from the corpus.
    sub_train, sub_val = holdout_split(sub_keys, report["sft.val_share"], 0)
    assert {sub_keys[i] for i in sub_val} == {keys[i] for i in val}
    small = nested_subset(sub_keys, sub_train, report["0.03"]["sft.train_share"], 0)
    assert {sub_keys[i] for i in small} == {keys[i] for i in nested_subset(keys, train, 0.03, 0)}
    assert report["0.03"]["rows"] == len(small) < report["0.1"]["rows"]
