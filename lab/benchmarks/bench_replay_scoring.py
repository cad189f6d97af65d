"""Replay scoring: one tree-masked target forward vs one full-prefix forward per anchor.

For one sequence of `--seq-len` tokens and E anchors, each with a branch of K replayed tokens,
the `score` stage asks the target for the distributions predicting every branch token. Two ways,
timed alternately in the same process (`--repeats` rounds, medians reported):
  (a) tree: `Target.score_tree`: the sequence once plus E*K branch tokens under a tree mask;
  (b) per-anchor: E plain forwards over prefix y<e + branch, (e + K) tokens each.
Both must give the same log-probs (the max abs difference is printed). Uses the embedded target
(models/tiny_target/model) when it has weights, else a random Llama of the same shape (6 layers,
hidden 256, vocab 6144). Prints JSON with seconds, tokens run and the speed-up of (a) over (b).

    python -m lab.benchmarks.bench_replay_scoring [--anchors 8,32,64] [--k 6] [--seq-len 512]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from lab.benchmarks.bench_tree_scoring import embedded_or_random_target
from models.target import Target


@torch.no_grad()
def per_anchor(
    target: Target, ids: list[int], branches: list[tuple[int, list[int]]]
) -> list[torch.Tensor]:
    """Log-probs [K+1, V] of each branch from its own full-prefix forward."""
    out = []
    for e, tokens in branches:
        logits = target(torch.tensor([ids[:e] + tokens])).logits[0, e - 1 :]  # [K+1, V]
        out.append(torch.log_softmax(logits, -1))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--anchors", default="8,32,64", help="comma-separated anchor counts E")
    ap.add_argument("--k", type=int, default=6)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    target, which = embedded_or_random_target()
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, target.vocab_size, (args.seq_len,), generator=gen).tolist()
    results = []
    for n_anchors in (int(a) for a in args.anchors.split(",")):
        # Anchors spread over the second half onward, as rejections in a generated response are.
        starts = torch.linspace(args.seq_len // 8, args.seq_len - 1, n_anchors).long().tolist()
        branches = [
            (e, torch.randint(0, target.vocab_size, (args.k,), generator=gen).tolist())
            for e in starts
        ]
        per_anchor(target, ids, branches[:1])  # warm-up
        target.score_tree(ids, branches[:1])
        tree_s, plain_s = [], []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            tree = target.score_tree(ids, branches)
            tree_s.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            plain = per_anchor(target, ids, branches)
            plain_s.append(time.perf_counter() - t0)
        diff = max(float((a - b).abs().max()) for a, b in zip(tree.log_probs, plain, strict=True))
        tree_med, plain_med = statistics.median(tree_s), statistics.median(plain_s)
        results.append(
            {
                "anchors": n_anchors,
                "tree_seconds": round(tree_med, 4),
                "per_anchor_seconds": round(plain_med, 4),
                "speedup": round(plain_med / tree_med, 2),
                "tree_tokens": args.seq_len + n_anchors * args.k,
                "per_anchor_tokens": sum(e + args.k for e in starts),
                "max_abs_logprob_diff": diff,
            }
        )
    print(
        json.dumps(
            {
                "benchmark": "replay_scoring",
                "target": which,
                "seq_len": args.seq_len,
                "k": args.k,
                "threads": torch.get_num_threads(),
                "repeats": args.repeats,
                "results": results,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
