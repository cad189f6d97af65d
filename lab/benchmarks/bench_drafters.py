"""Decoding speed by proposal shape: plain decoding vs K-chains vs EAGLE-2 trees (vs DFlash
blocks with `--dflash`), on held-out prompts of a data root. (The draft-length sweep, K and
stop threshold from measured costs, is `bench_decode`.)

Reads (never writes) a data root, `--root` or OPD_HOME: the target of `--profile` (default
`default`), the drafter `--drafter` (default `opd@latest`) and the held-out split of
`prompts@latest`. For each temperature (0, 1) and batch size (1, `--batch`) it runs, side by
side on the same prompts, plain KV-cached decoding (`target_generate`), chain drafting with
K = drafting.k and draft trees of depth K, all through `speculative_generate`
(K drafter forwards and one target forward per step, as the chain):

- `tree`: at equal token budget, budget = K nodes verified per step, as the chain verifies K
  drafts: the K most confident nodes of the dynamic tree instead of the top-1 chain;
- `tree_wide`: budget `--tree-budget` (default 10): a wider tree for a verify forward that
  costs more on this CPU (the target's cost grows with the tokens it verifies);
- `tree_stop`: `tree_wide` that stops expanding once no frontier path's joint drafter
  probability reaches `--tree-min-confidence` (default 0.1), to spend fewer drafter forwards.

Both expand `--tree-top-k` (default 4) nodes per depth. EAGLE-2's own setting (top-k 10,
budget 60, `drafting.tree`'s defaults) is sized for GPUs, where verifying 60 tokens costs about
what verifying 1 does; on this CPU it is far slower than a chain. Per setting:

- tau (mean accepted + 1 per verify step) and target forwards per token (verify steps per
  emitted token, per sequence; the prefill and its token excluded; plain decoding: 1);
- tokens/s and the wall-clock speed-up over plain decoding in the same setting;
- profile shares of the wall time: inside the drafter's forwards, inside the target's, and the
  rest (the decoder's own tensor work and host syncs);
- at T=0, whether the decoder's tokens equal plain greedy decoding's (`lossless`).

`--dflash REF` adds a DFlash drafter (`dflash`: K drafts from one drafter forward per step)
to every setting, so it is measured beside the EAGLE-3 chain in the same run.

Decoders alternate within a setting, after one untimed warm-up of each. The headline keys
(batch 1) come first: speedup_{chain,tree,tree_wide,tree_stop,dflash}_t{0,1}, tau_..._t{0,1} and the drafter's
profile share; the full table is under `settings`. Prints one JSON object.

    .venv/bin/python -m lab.benchmarks.bench_drafters --root $OPD_HOME [--drafter opd@latest] [--dflash REF]
"""

from __future__ import annotations

import json
import time
from typing import Any

import polars as pl

from lab.benchmarks.decode_args import drafter_parser, parse_decoding
from models.decoding import SpecConfig, speculative_generate, target_generate
from models.drafter import ChainShape, TreeShape
from pipeline.core.config import DraftTree
from pipeline.core.drafters import load_drafter_dataset
from pipeline.core.targets import TargetLoader
from pipeline.profiles import load_config
from storage import Store


def load(root: str, profile: str, drafter_ref: str, n_prompts: int):
    """(target, drafter, held-out prompt ids, config, exact drafter ref) from the data root."""
    store = Store(root)
    cfg = load_config(profile)
    loader = TargetLoader(cfg.target)
    drafter_ds = store.open(drafter_ref)
    drafter = load_drafter_dataset(drafter_ds, loader.target, loader.identity).eval()
    prompts_ds = store.open("prompts@latest")
    prompts = (
        prompts_ds.scan()
        .filter(pl.col("split") == "heldout")
        .head(n_prompts)
        .select("prompt_ids")
        .collect()["prompt_ids"]
        .to_list()
    )
    return loader.target, drafter, prompts, cfg, str(drafter_ds.ref), str(prompts_ds.ref)


def decode_all(
    kind: str, target, drafter, prompts, batch: int, temperature: float, k: int, tree, max_new
) -> dict[str, Any]:
    """One decoder over all prompts in batches of `batch`: wall time, tokens and step counts.
    `tree`: the DraftTree of a tree kind (None for plain and chain)."""
    seqs: list[list[int]] = []
    steps = emitted = 0
    accepted: list[int] = []
    inside = {"target": 0.0, "drafter": 0.0}
    start = time.perf_counter()
    for i in range(0, len(prompts), batch):
        chunk = prompts[i : i + batch]
        if kind == "plain":
            res = target_generate(target, chunk, max_new, temperature, seed=i)
            seqs += res.sequences
            continue
        if tree is None:  # chains, and a block drafter's blocks: a chain to the loop
            shape = ChainShape(k)
        else:
            shape = TreeShape(k, tree.top_k, tree.budget, tree.min_confidence)
        cfg = SpecConfig(shape, temperature=temperature, max_new_tokens=max_new, seed=i)
        res = speculative_generate(target, drafter, chunk, cfg)
        seqs += res.sequences
        steps += len(res.steps["accepted"])
        emitted += sum(res.steps["emitted"])
        accepted += res.steps["accepted"]
        inside["target"] += res.stats["target_forward_seconds"]
        inside["drafter"] += res.stats["drafter_forward_seconds"]
    wall = time.perf_counter() - start
    tokens = sum(len(s) for s in seqs)
    out: dict[str, Any] = {"wall_s": wall, "tokens": tokens, "sequences": seqs}
    if kind != "plain":
        out |= {
            "tau": sum(a + 1 for a in accepted) / len(accepted),
            "target_forwards_per_token": steps / emitted,
            "drafter_share": inside["drafter"] / wall,
            "target_share": inside["target"] / wall,
            "decoder_overhead_share": 1 - (inside["drafter"] + inside["target"]) / wall,
        }
    return out


def run_setting(
    target, drafter, prompts, temperature, batch, k, trees, max_new, repeats, block=None
):
    """All decoders on one (temperature, batch): best of `repeats`, speed-ups over plain.
    `block`: (its kind, a block drafter) decoded as one more chain, named by its kind."""
    uses = dict([block]) if block is not None else {}
    kinds = ("plain", "chain", *trees, *uses)
    for kind in kinds:  # warm-up: first-call allocations and kernels out of the timings
        tree, d = trees.get(kind), uses.get(kind, drafter)
        decode_all(kind, target, d, prompts[:batch], batch, temperature, k, tree, 4)
    runs: dict[str, list[dict]] = {kind: [] for kind in kinds}
    for _ in range(repeats):
        for kind in kinds:
            tree, d = trees.get(kind), uses.get(kind, drafter)
            runs[kind].append(
                decode_all(kind, target, d, prompts, batch, temperature, k, tree, max_new)
            )
    out: dict[str, Any] = {"temperature": temperature, "batch": batch}
    best = {kind: min(r, key=lambda x: x["wall_s"]) for kind, r in runs.items()}
    plain_tps = best["plain"]["tokens"] / best["plain"]["wall_s"]
    for kind in kinds:
        r = best[kind]
        row = {"tokens_per_s": round(r["tokens"] / r["wall_s"], 2), "wall_s": round(r["wall_s"], 3)}
        if kind == "plain":
            row["target_forwards_per_token"] = 1.0
        else:
            row |= {
                name: round(r[name], 4)
                for name in (
                    "tau",
                    "target_forwards_per_token",
                    "drafter_share",
                    "target_share",
                    "decoder_overhead_share",
                )
            }
            row["speedup_vs_plain"] = round(r["tokens"] / r["wall_s"] / plain_tps, 3)
            if temperature == 0:
                row["lossless"] = r["sequences"] == best["plain"]["sequences"]
        out[kind] = row
    return out


def main() -> None:
    parser = drafter_parser(__doc__)
    parser.add_argument(
        "--dflash", default=None, help="a DFlash drafter dataset decoded beside the chain"
    )
    parser.add_argument("--prompts", type=int, default=8, help="held-out prompts")
    parser.add_argument("--batch", type=int, default=8, help="the batched setting's batch size")
    parser.add_argument("--max-new", type=int, default=None, help="[profile: evaluate]")
    parser.add_argument("--tree-top-k", type=int, default=4)
    parser.add_argument("--tree-budget", type=int, default=10, help="tree_wide's budget")
    parser.add_argument("--tree-min-confidence", type=float, default=0.1, help="tree_stop's")
    args, root = parse_decoding(parser)
    target, drafter, prompts, cfg, drafter_ref, prompts_ref = load(
        root, args.profile, args.drafter, args.prompts
    )
    k = cfg.drafting.k
    trees = {
        "tree": DraftTree(depth=k, top_k=args.tree_top_k, budget=k),
        "tree_wide": DraftTree(depth=k, top_k=args.tree_top_k, budget=args.tree_budget),
        "tree_stop": DraftTree(
            depth=k,
            top_k=args.tree_top_k,
            budget=args.tree_budget,
            min_confidence=args.tree_min_confidence,
        ),
    }
    max_new = args.max_new or cfg.evaluate.max_new_tokens
    block = None  # (kind, drafter) of --dflash
    if args.dflash is not None:
        store, loader = Store(root), TargetLoader(cfg.target)
        dflash_ds = store.open(args.dflash)
        dflash = load_drafter_dataset(dflash_ds, target, loader.identity).eval()
        if not dflash.drafts_blocks:
            raise SystemExit(f"--dflash {args.dflash}: a {dflash.kind} drafter drafts no blocks")
        block = (dflash.kind, dflash)
    settings = [
        run_setting(target, drafter, prompts, t, b, k, trees, max_new, args.repeats, block)
        for t in (0.0, 1.0)
        for b in (1, args.batch)
    ]
    headline: dict[str, Any] = {}
    for s in settings:
        if s["batch"] == 1:
            t = int(s["temperature"])
            for kind in ("chain", *trees, *([block[0]] if block is not None else [])):
                headline[f"speedup_{kind}_t{t}"] = s[kind]["speedup_vs_plain"]
                headline[f"tau_{kind}_t{t}"] = s[kind]["tau"]
                headline[f"drafter_share_{kind}_t{t}"] = s[kind]["drafter_share"]
    report = {
        **headline,
        "benchmark": "drafters",
        "root": root,
        "profile": args.profile,
        "drafter": drafter_ref,
        "prompts": f"{prompts_ref} heldout, first {len(prompts)}",
        "target_layers": target.num_layers,
        "target_vocab": target.vocab_size,
        "k": k,
        "trees": {name: tree.model_dump() for name, tree in trees.items()},
        "max_new_tokens": max_new,
        "threads": args.threads,
        "repeats": args.repeats,
        "settings": settings,
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
