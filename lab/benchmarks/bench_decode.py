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

`--compare REF` tunes a second drafter (say the EAGLE-3 chain beside a DFlash drafter) in the same
run, on the same prompts and budget, each temperature's two tunings back to back.

Prints one JSON object: `speedup_best_t{0,1}`, `best_k_t{0,1}`, `best_threshold_t{0,1}`,
`speedup_default_t{0,1}` (measured) and `predicted_speedup_{best,default}_t{0,1}` first, then per
drafter by its label (`dflash` for a DFlash drafter, `chain` for EAGLE-3):
`speedup_{label}_t{0,1}` (the setting `opd tune` chooses), `tau_{label}_t{0,1}` and
`drafter_share_{label}_t{0,1}` (the share of decoding time in drafter forwards) there; per
temperature the costs, measured vs predicted for each measured setting (and the calibration),
and the whole sweep. At T=0 `lossless` says whether a decoder's tokens equal plain greedy
decoding's. The predicted speed-up divides by plain decoding's measured tokens/s.

    .venv/bin/python -m lab.benchmarks.bench_decode --root $OPD_HOME [--drafter opd@latest] \
        [--compare sft@VERSION]
"""

from __future__ import annotations

import json
from typing import Any

from lab.benchmarks.decode_args import drafter_parser, parse_decoding
from models.draft_length import THRESHOLDS, TuneOptions, tune
from models.drafters import kind_spec
from pipeline.core.drafters import drafter_kind, load_drafter_dataset, trained_depth
from pipeline.core.targets import TargetLoader
from pipeline.core.tuning import heldout_prompts
from pipeline.profiles import load_config
from storage import OpdError, Store


def kind_label(kind: str) -> str:
    """How the headline names a drafter kind's keys: a block drafter by its kind, every
    other kind drafts a chain."""
    return kind if kind_spec(kind).drafts_blocks else "chain"


def load(root: str, profile: str, n_prompts: int | None):
    """(store, target loader, prompts, config, prompts description)."""
    store = Store(root)
    cfg = load_config(profile)
    loader = TargetLoader(cfg.target)
    prompts_ds = store.open("prompts@latest")
    split, evaluated = cfg.evaluate.split, cfg.evaluate.max_prompts
    held = heldout_prompts(prompts_ds, split, evaluated)
    prompts = held[: n_prompts or len(held)]
    what = f"{prompts_ds.ref} {split}: the {len(held)} evaluate decodes"
    if len(prompts) < len(held):
        what = f"{prompts_ds.ref} {split}: a SUBSET, the first {len(prompts)} of the {len(held)}"
    return store, loader, prompts, cfg, what


def headline(settings: list[dict[str, Any]], label: str, *, main: bool) -> dict[str, Any]:
    """The headline keys of one drafter's tunings (`main`: also the unlabelled keys)."""
    out: dict[str, Any] = {}
    for s in settings:
        t, m = int(s["temperature"]), s["measured"]
        best = m[s["chosen"]["name"]]
        out |= {
            f"speedup_{label}_t{t}": best["speedup_vs_plain"],
            f"tau_{label}_t{t}": best["tau"],
            f"drafter_share_{label}_t{t}": best["drafter_share"],
        }
        if not main:
            continue
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
    parser = drafter_parser(__doc__)
    parser.add_argument(
        "--compare", default=None, help="a drafter of the other kind, tuned in the same run"
    )
    parser.add_argument(
        "--prompts", type=int, default=None, help="first N of evaluate's prompts [default: all]"
    )
    parser.add_argument("--max-new", type=int, default=None, help="[profile: evaluate]")
    parser.add_argument("--thresholds", type=float, nargs="+", default=list(THRESHOLDS))
    parser.add_argument("--reps", type=int, default=20, help="timings per verify width")
    args, root = parse_decoding(parser)
    store, loader, prompts, cfg, what = load(root, args.profile, args.prompts)
    opts = TuneOptions(
        max_new_tokens=args.max_new or cfg.evaluate.max_new_tokens,
        thresholds=tuple(args.thresholds),
        repeats=args.repeats,
        verify_reps=args.reps,
    )
    refs = [args.drafter, *([args.compare] if args.compare else [])]
    drafters = []
    for ref in refs:
        ds = store.open(ref)
        depth = trained_depth(ds) or cfg.drafting.ttt_steps
        if cfg.drafting.k > depth:
            raise OpdError(f"drafting.k ({cfg.drafting.k}) exceeds {ds.ref}'s depth {depth}")
        drafter = load_drafter_dataset(ds, loader.target, loader.identity).eval()
        drafters.append((ds, drafter, depth, kind_label(drafter_kind(ds))))
    if len({label for *_, label in drafters}) < len(drafters):
        raise OpdError("--compare a drafter of the other kind (its keys would collide)")
    tuned: list[list[dict[str, Any]]] = [[] for _ in drafters]
    for t in (0.0, 1.0):
        for i, (_, drafter, depth, _) in enumerate(drafters):
            tuned[i].append(tune(loader.target, drafter, prompts, t, depth, cfg.drafting.k, opts))
    report: dict[str, Any] = {}
    for i, (_, _, _, label) in enumerate(drafters):
        report |= headline(tuned[i], label, main=i == 0)
    report |= {
        "benchmark": "decode",
        "root": root,
        "profile": args.profile,
        "default_k": cfg.drafting.k,
        "prompts": what,
        "batch": 1,
        "max_new_tokens": opts.max_new_tokens,
        "threads": args.threads,
        "repeats": args.repeats,
        "drafters": [
            {"drafter": str(ds.ref), "label": label, "depth": depth, "settings": tuned[i]}
            for i, (ds, _, depth, label) in enumerate(drafters)
        ],
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
