"""Replay scoring: one tree-masked forward vs one full-prefix forward per anchor.

A 512-token context with 8 anchors x K=6 branch tokens, on the embedded target when it is trained
(models/tiny_target/model), else a random target of its shape (6 layers, d=256, ~6k vocab).
`speedup`: per-anchor plain forwards (logits on every row) / the tree forward. `speedup_vs_lean`:
the same per-anchor forwards with the LM head on the scored rows only, as `score_tree` does, so
the ratio is the shared context alone. All compute the same log-probs (max abs diff reported);
timings are interleaved, median of --repeats. Prints one JSON object.

    .venv/bin/python -m lab.benchmarks.bench_tree_scoring [--repeats 7] [--threads N]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from models.target import Target, load_target

EMBEDDED = Path(__file__).resolve().parents[2] / "models" / "tiny_target" / "model"


def embedded_or_random_target(seed: int = 0) -> tuple[Target, str]:
    """The embedded target if trained, else a random Llama of its shape."""
    if (EMBEDDED / "model.safetensors").is_file():
        return load_target(EMBEDDED, aux_layer_ids=(1, 3, 5)), "embedded"
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=6144,
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
    )
    config._attn_implementation = "sdpa"
    return Target.from_model(
        LlamaForCausalLM(config).eval(), aux_layer_ids=(1, 3, 5)
    ), "random(6x256, vocab 6144)"


def per_anchor(target: Target, context: torch.Tensor, branches) -> list[torch.Tensor]:
    """Baseline 1: each anchor's prefix plus its branch as its own plain forward (all logits)."""
    out = []
    for anchor, tokens in branches:
        logits = target.forward(torch.cat([context[:anchor], tokens])[None]).logits[0, anchor - 1 :]
        out.append(torch.log_softmax(logits, dim=-1))
    return out


def per_anchor_lean(target: Target, context: torch.Tensor, branches) -> list[torch.Tensor]:
    """Baseline 2: the same forwards, but the LM head only on the rows a branch reads, as the
    tree forward does: what remains of the speed-up is the shared context alone."""
    out = []
    for anchor, tokens in branches:
        _, last = target.forward_features(torch.cat([context[:anchor], tokens])[None])
        out.append(torch.log_softmax(target.logits_from_hidden(last[0, anchor - 1 :]), dim=-1))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--anchors", type=int, default=8)
    parser.add_argument("--k", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    target, source = embedded_or_random_target()
    gen = torch.Generator().manual_seed(0)
    context = torch.randint(0, target.vocab_size, (args.context,), generator=gen)
    # evenly spread anchors, the last one at the context's end
    step = args.context // args.anchors
    branches = [
        (step * (i + 1), torch.randint(0, target.vocab_size, (args.k,), generator=gen))
        for i in range(args.anchors)
    ]

    tree = target.score_tree(context, branches)
    max_diff = 0.0
    for baseline in (per_anchor, per_anchor_lean):
        base = baseline(target, context, branches)
        for a, b in zip(tree.log_probs, base, strict=True):
            max_diff = max(max_diff, float((a - b).abs().max()))

    seconds: dict[str, list[float]] = {"tree": [], "plain": [], "lean": []}
    runs = {
        "tree": lambda: target.score_tree(context, branches),
        "plain": lambda: per_anchor(target, context, branches),
        "lean": lambda: per_anchor_lean(target, context, branches),
    }
    for _ in range(args.repeats):  # interleaved, so drift in machine load hits all alike
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            seconds[name].append(time.perf_counter() - start)
    tree_med, base_med, lean_med = (
        statistics.median(seconds[n]) for n in ("tree", "plain", "lean")
    )
    report = {
        "benchmark": "tree_scoring",
        "target": source,
        "layers": target.num_layers,
        "hidden": target.hidden_size,
        "vocab": target.vocab_size,
        "context": args.context,
        "anchors": [a for a, _ in branches],
        "k": args.k,
        "threads": args.threads,
        "tree_tokens": args.context + args.anchors * args.k,
        "per_anchor_tokens": sum(a + args.k for a, _ in branches),
        "tree_forward_s": round(tree_med, 5),
        "per_anchor_forwards_s": round(base_med, 5),
        "speedup": round(base_med / tree_med, 3),
        "per_anchor_lean_s": round(lean_med, 5),
        "speedup_vs_lean": round(lean_med / tree_med, 3),
        "max_abs_diff_logprobs": max_diff,
        "repeats": args.repeats,
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
