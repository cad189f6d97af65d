"""How large a draft vocabulary a target needs: coverage of held-out target tokens against the
draft head's share of the target's per-token cost, per size, from one trajectories dataset.

The draft vocabulary is the most frequent ids of the training tokens (`DraftVocab.from_counts`,
as the features stage builds it). Here the counts come from a seeded 90% of the trajectories'
sequences and coverage is measured on the other 10%: the share of their generated (loss-masked)
tokens the head can propose at all, an upper bound on any drafter's acceptance at T=0. The
head's cost is Vd x H multiply-adds a token, against the target's per-token multiply-adds (its
layers' matrices and its LM head, from its config.json).

    .venv/bin/python -m lab.benchmarks.bench_draft_vocab --root ROOT [--trajectories REF] \\
        [--sizes 2048 4096 8192 16384 32000]
"""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path

import numpy as np

from pipeline.core.targets import TARGET_RECORD, model_directory
from storage import Store


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", type=Path, required=True)
    ap.add_argument("--trajectories", default="trajectories@latest")
    ap.add_argument("--sizes", type=int, nargs="+", default=[2048, 4096, 8192, 16384, 32000])
    args = ap.parse_args()

    ds = Store(args.root).open(args.trajectories)
    table = ds.scan().select("seq_id", "input_ids", "loss_mask").collect().to_dicts()
    target = json.loads(
        (model_directory(ds.meta[TARGET_RECORD]["path"]) / "config.json").read_text()
    )
    vocab, hidden = target["vocab_size"], target["hidden_size"]
    kv = hidden * target["num_key_value_heads"] // target["num_attention_heads"]
    per_layer = 2 * hidden * hidden + 2 * hidden * kv + 3 * hidden * target["intermediate_size"]
    target_macs = target["num_hidden_layers"] * per_layer + vocab * hidden
    fit = np.zeros(vocab, dtype=np.int64)
    held: list[np.ndarray] = []
    for row in table:
        ids = np.asarray(row["input_ids"], dtype=np.int64)[np.asarray(row["loss_mask"]) == 1]
        if int(hashlib.sha256(row["seq_id"].encode()).hexdigest()[:8], 16) % 10 == 0:
            held.append(ids)
        else:
            fit += np.bincount(ids, minlength=vocab)
    tokens = np.concatenate(held)
    order = np.argsort(-fit, kind="stable")
    rows = []
    for size in args.sizes:
        chosen = np.zeros(vocab, dtype=bool)
        chosen[order[:size]] = True
        rows.append(
            {
                "draft_vocab": size,
                "heldout_coverage": round(float(chosen[tokens].mean()), 4),
                "head_macs_vs_target": round(size * hidden / target_macs, 4),
            }
        )
    print(
        json.dumps(
            {
                "trajectories": str(ds.ref),
                "fit_tokens": int(fit.sum()),
                "heldout_tokens": int(tokens.size),
                "distinct_fit_ids": int((fit > 0).sum()),
                "sizes": rows,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
