"""`opd tune`: the draft length (K) and stop threshold that decode a drafter fastest on this
machine, and the K `opd export` serves with.

Tuning runs `models.draft_length.tune` on the held-out prompts `evaluate` decodes, at one
serving temperature, batch 1: a calibration decode at the drafter's trained depth gives the
acceptance of every step and the measured costs, the cost model predicts tokens/s for every K
and threshold, and the best predicted settings are measured side by side with plain decoding
and the configured K. The fastest measured setting is recorded, per temperature, in
`<root>/_tune/<NAME-VERSION>.json`: not a dataset, since wall-clock numbers belong to the
machine that measured them, not to the drafter.

vLLM serves a fixed `num_speculative_tokens` and has no confidence stop, so the K recorded for
serving is the fastest measured K among the settings without a threshold.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import polars as pl

from models.draft_length import TuneOptions, tune
from pipeline.core.drafters import load_drafter_dataset, trained_depth
from pipeline.core.targets import TargetLoader
from storage import Dataset, OpdError
from storage.store import atomic_write_text

TUNE_DIR = "_tune"


def tune_file(drafter_ds: Dataset) -> Path:
    return drafter_ds.store.root / TUNE_DIR / f"{str(drafter_ds.ref).replace('@', '-')}.json"


def heldout_prompts(prompts_ds: Dataset, split: str, max_prompts: int) -> list[list[int]]:
    rows = (
        prompts_ds.scan()
        .filter(pl.col("split") == split)
        .head(max_prompts)
        .select("prompt_ids")
        .collect()["prompt_ids"]
        .to_list()
    )
    if not rows:
        raise OpdError(f"{prompts_ds.ref} has no {split!r} prompts to tune on")
    return rows


def run_tune(
    drafter_ds: Dataset,
    prompts: list[list[int]],
    loader: TargetLoader,
    temperature: float,
    default_k: int,
    opts: TuneOptions,
) -> dict[str, Any]:
    """Tune `drafter_ds` on `prompts` and record the result (module docstring)."""
    if temperature < 0:
        raise OpdError(f"--temperature must be >= 0 (0 = greedy), got {temperature}")
    depth = trained_depth(drafter_ds) or default_k
    if default_k > depth:
        default_k = depth  # the configured K would be refused: compare against the deepest
    drafter = load_drafter_dataset(drafter_ds, loader.target, loader.identity)
    result = tune(loader.target, drafter, prompts, temperature, depth, default_k, opts)
    measured = result["measured"]
    chains = [n for n in measured if n not in ("plain", "calibration")]
    fixed = [n for n in chains if measured[n]["setting"]["threshold"] == 0]
    serve = max(fixed or chains, key=lambda n: measured[n]["tokens_per_s"])
    result["serve"] = {
        "k": measured[serve]["setting"]["k"],
        "speedup_vs_plain": measured[serve]["speedup_vs_plain"],
        "prompts": len(prompts),
        "drafter_depth": depth,
    }
    path = tune_file(drafter_ds)
    recorded = json.loads(path.read_text()) if path.exists() else {}
    recorded[_key(temperature)] = result
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(recorded, indent=2, sort_keys=True))
    return result


def serving_k(drafter_ds: Dataset, temperature: float, fallback: int) -> tuple[int, str]:
    """The K to serve `drafter_ds` with and where it came from: `opd tune`'s measurement at
    `temperature` if one is recorded, else `fallback` (the K the drafter was trained for)."""
    path = tune_file(drafter_ds)
    entry = json.loads(path.read_text()).get(_key(temperature)) if path.exists() else None
    if entry is None:
        return fallback, (
            f"the drafter's trained K (drafting.k); no `opd tune` result at T={temperature} "
            f"in {path}"
        )
    serve = entry["serve"]
    return serve["k"], (
        f"measured by `opd tune` on this machine at T={temperature}: {serve['speedup_vs_plain']}x "
        f"plain decoding on {serve['prompts']} held-out prompts, batch 1 ({path})"
    )


def trained_k(drafter_ds: Dataset) -> int | None:
    """The K (drafting.k) the drafter was trained for: SFT measures its tau over it (`tau_k`),
    Draft-OPD validates over it (`val_ttt_steps`); None if the dataset records neither."""
    stage = drafter_ds.config.get("stage", {})
    k = stage.get("tau_k", stage.get("val_ttt_steps"))
    return k if isinstance(k, int) else None


def _key(temperature: float) -> str:
    return f"T={float(temperature)}"
