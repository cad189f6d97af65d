"""Decoding speed and the draft length that pays off: a measured cost model, checked side by side.

Reads (never writes) a data root, `--root` or OPD_HOME: the target of `--profile` (default
`default`), the drafter `--drafter` (default `opd@latest`) and the held-out prompts `evaluate`
decodes (`prompts@latest`, its split and max_prompts: all 48 in the default profile; a smaller
`--prompts N` takes the first N and is reported as a subset). Batch 1, one thread by default.
For each temperature (0, 1), `models.draft_length.tune`:

1. calibration: chain decoding at the drafter's trained depth (its `ttt_steps`), no stop, logs
   every step's drafts with their confidences and acceptances; it also gives the seconds of one
   drafter forward and the decoder's own seconds per step;
2. costs: the target's seconds for one forward over n = 1 .. depth + 1 tokens on a cache of a
   typical context (the prompts' mean length + half of max_new_tokens), median of `--reps`, and
   of one prompt's prefill;
3. prediction: tokens/s = E[accepted + 1] / E[verify(L + 1) + F c + o] (plus prefills) for
   every K <= depth and stop threshold in `--thresholds`;
4. measurement, side by side after a warm-up of each: plain decoding, the default (K =
   drafting.k, no stop) and the best predicted setting, alternating, best of `--repeats`.

Prints one JSON object: `speedup_best_t{0,1}`, `best_k_t{0,1}`, `best_threshold_t{0,1}`,
`speedup_default_t{0,1}` (measured) and `predicted_speedup_{best,default}_t{0,1}` first; per
temperature the costs, measured vs predicted for each measured setting (and the calibration),
and the whole sweep. At T=0 `lossless` says whether a decoder's tokens equal plain greedy
decoding's. The predicted speed-up divides by plain decoding's measured tokens/s.

    .venv/bin/python -m benchmarks.bench_decode --root /work/opd-default [--drafter opd@latest]
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import torch

from models.draft_length import THRESHOLDS, TuneOptions, tune
from pipeline.core.drafters import load_drafter_dataset, trained_depth
from pipeline.core.targets import TargetLoader
from pipeline.core.tuning import heldout_prompts
from pipeline.profiles import load_config
from storage import OpdError, Store, default_root


def load(root: str, profile: str, drafter_ref: str, n_prompts: int | None):
    """(target, drafter, prompts, config, drafter dataset, prompts description)."""
    store = Store(root)
    cfg = load_config(profile)
    loader = TargetLoader(cfg.target)
    drafter_ds = store.open(drafter_ref)
    drafter = load_drafter_dataset(drafter_ds, loader.target, loader.identity).eval()
    prompts_ds = store.open("prompts@latest")
    split, evaluated = cfg.evaluate.split, cfg.evaluate.max_prompts
    held = heldout_prompts(prompts_ds, split, evaluated)
    prompts = held[: n_prompts or len(held)]
    what = f"{prompts_ds.ref} {split}: the {len(held)} evaluate decodes"
    if len(prompts) < len(held):
        what = f"{prompts_ds.ref} {split}: a SUBSET, the first {len(prompts)} of the {len(held)}"
    return loader.target, drafter, prompts, cfg, drafter_ds, what


def headline(settings: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for s in settings:
        t, m = int(s["temperature"]), s["measured"]
        out |= {
            f"speedup_best_t{t}": m["best"]["speedup_vs_plain"],
            f"best_k_t{t}": m["best"]["setting"]["k"],
            f"best_threshold_t{t}": m["best"]["setting"]["threshold"],
            f"speedup_default_t{t}": m["default"]["speedup_vs_plain"],
            f"predicted_speedup_best_t{t}": m["best"]["predicted"]["speedup_vs_plain"],
            f"predicted_speedup_default_t{t}": m["default"]["predicted"]["speedup_vs_plain"],
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", default=None, help="data root [default: OPD_HOME]")
    parser.add_argument("--profile", default="default")
    parser.add_argument("--drafter", default="opd@latest")
    parser.add_argument(
        "--prompts", type=int, default=None, help="first N of evaluate's prompts [default: all]"
    )
    parser.add_argument("--max-new", type=int, default=None, help="[profile: evaluate]")
    parser.add_argument("--thresholds", type=float, nargs="+", default=list(THRESHOLDS))
    parser.add_argument("--reps", type=int, default=20, help="timings per verify width")
    parser.add_argument("--repeats", type=int, default=1, help="best of N per decoder")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    root = args.root or str(default_root())
    target, drafter, prompts, cfg, drafter_ds, what = load(
        root, args.profile, args.drafter, args.prompts
    )
    opts = TuneOptions(
        max_new_tokens=args.max_new or cfg.evaluate.max_new_tokens,
        thresholds=tuple(args.thresholds),
        repeats=args.repeats,
        verify_reps=args.reps,
    )
    depth = trained_depth(drafter_ds) or cfg.drafting.ttt_steps
    if cfg.drafting.k > depth:
        raise OpdError(f"drafting.k ({cfg.drafting.k}) exceeds {drafter_ds.ref}'s depth {depth}")
    settings = [tune(target, drafter, prompts, t, depth, cfg.drafting.k, opts) for t in (0.0, 1.0)]
    report: dict[str, Any] = {
        **headline(settings),
        "benchmark": "decode",
        "root": root,
        "profile": args.profile,
        "drafter": str(drafter_ds.ref),
        "drafter_depth": depth,
        "default_k": cfg.drafting.k,
        "prompts": what,
        "batch": 1,
        "max_new_tokens": opts.max_new_tokens,
        "threads": args.threads,
        "repeats": args.repeats,
        "settings": settings,
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
