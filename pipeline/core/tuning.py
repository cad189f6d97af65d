"""`opd tune`: the draft length (K) and stop threshold that decode a drafter fastest on this
machine, and the K `opd export` serves with.

Tuning runs `models.draft_length.tune` on the held-out prompts `evaluate` decodes, at one
serving temperature, batch 1: a calibration decode at the drafter's trained depth gives the
acceptance of every step and the measured costs, the cost model predicts tokens/s for every K
and threshold, and the best predicted settings are measured side by side with plain decoding
and the configured K. The setting `models.draft_length.choose` picks (the predicted fastest,
unless another measured beside it is faster beyond the prompts' spread) is recorded, per
temperature, in
`<root>/_tune/<NAME-VERSION>.json`: not a dataset, since wall-clock numbers belong to the
machine that measured them, not to the drafter.

vLLM serves a fixed `num_speculative_tokens` and has no confidence stop, so the K recorded for
serving is the one `choose` picks among the settings without a threshold. The prompts are
taken from each held-out set in turn, so a tune on a few of them does not read one benchmark
only.
"""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path
from typing import Any

import polars as pl

from models.draft_length import TuneOptions, choose, tune
from pipeline.core.drafters import load_drafter_dataset, trained_depth
from pipeline.core.stage import HELDOUT_SETS
from pipeline.core.targets import TargetLoader
from storage import Dataset, OpdError
from storage.jsonfile import UnreadableJson, read_json_object
from storage.layout import atomic_write_text, stale_temporary, take_lock

log = logging.getLogger("opd")

TUNE_DIR = "_tune"


def tune_file(drafter_ds: Dataset) -> Path:
    return drafter_ds.store.root / TUNE_DIR / f"{str(drafter_ds.ref).replace('@', '-')}.json"


def heldout_prompts(prompts_ds: Dataset, split: str, max_prompts: int) -> list[list[int]]:
    """The first `max_prompts` of `split`; of held-out sets (module docstring), one of each
    set in turn."""
    rows = prompts_ds.scan().filter(pl.col("split") == split).with_row_index("row")
    if split == "heldout" and prompts_ds.meta.get(HELDOUT_SETS):
        held_set = pl.col("source").str.split(":").list.first()
        rows = rows.sort(pl.int_range(pl.len()).over(held_set), "row")
    picked = rows.head(max_prompts).select("prompt_ids").collect()["prompt_ids"].to_list()
    if not picked:
        raise OpdError(f"{prompts_ds.ref} has no {split!r} prompts to tune on")
    return picked


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
    serve, by = choose(measured, fixed or chains)
    result["serve"] = {
        "k": measured[serve]["setting"]["k"],
        "by": by,
        "speedup_vs_plain": measured[serve]["speedup_vs_plain"],
        "prompts": len(prompts),
        "drafter_depth": depth,
    }
    record_result(tune_file(drafter_ds), _key(temperature), result)
    return result


def quick_options(max_new_tokens: int) -> TuneOptions:
    """The tuning `opd see` and the chains' final evaluation run: fixed K only (vLLM serves no
    stop threshold), the best predicted K timed beside the trained one, on half the tokens (at
    least 16): the minutes go to the evaluation that follows."""
    return TuneOptions(max(16, max_new_tokens // 2), thresholds=(0.0,), verify_reps=5, candidates=1)


def record_result(path: Path, key: str, result: dict[str, Any]) -> None:
    """Merge one temperature's result into the tune file `path`. Under the file's lock, so
    two `opd tune` of one drafter keep both results; temporaries a killed tune left beside it
    are removed here. An unreadable file is replaced, with a warning: nothing in it can be
    served."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = take_lock(path.with_name(f".{path.name}.lock"))
    try:
        for tmp in path.parent.glob(f".{path.name}.tmp-*"):
            if stale_temporary(tmp):
                tmp.unlink(missing_ok=True)
        try:
            recorded = read_json_object(path) if path.exists() else {}
        except UnreadableJson as e:
            log.warning("%s; replacing it with this result", e)
            recorded = {}
        recorded[key] = result
        atomic_write_text(path, json.dumps(recorded, indent=2, sort_keys=True))
    finally:
        os.close(fd)  # releases the lock


def serving_k(drafter_ds: Dataset, temperature: float, fallback: int) -> tuple[int, str]:
    """The K to serve `drafter_ds` with and where it came from: `opd tune`'s measurement at
    `temperature` if one is recorded, else `fallback` (the K the drafter was trained for).
    A record that does not hold a K this drafter can serve (edited, corrupted, another
    drafter's) is an error saying to tune again, never a K served silently."""
    path = tune_file(drafter_ds)
    entry = _recorded_entry(drafter_ds, path, temperature)
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


def tuned_result(drafter_ds: Dataset, temperature: float) -> dict[str, Any] | None:
    """What `opd tune` recorded for `drafter_ds` at `temperature` here (None: not tuned)."""
    return _recorded_entry(drafter_ds, tune_file(drafter_ds), temperature)


def k_report(drafter_ds: Dataset, k: int, temperature: float = 0.0) -> str:
    """One line naming the K a drafter was decoded at beside its trained K and the K `opd
    tune` chose on this machine (or the command that measures it)."""
    trained = trained_k(drafter_ds)
    said = f"K={k}" + (f" (trained K={trained})" if trained is not None else "")
    entry = tuned_result(drafter_ds, temperature)
    if entry is None:
        return (
            f"{said}; fastest K on this machine not measured: opd tune --drafter "
            f"{drafter_ds.ref} --temperature {temperature}"
        )
    serve = entry["serve"]
    at_trained = entry.get("measured", {}).get("default", {}).get("speedup_vs_plain")
    there = f", trained K {at_trained}x in the same timing" if at_trained is not None else ""
    by = f", {serve['by']} fastest" if "by" in serve else ""
    return (
        f"{said}; `opd tune` chose K={serve['k']} here ({serve['speedup_vs_plain']}x plain "
        f"decoding on {serve['prompts']} prompts{by}{there})"
    )


def trained_k(drafter_ds: Dataset) -> int | None:
    """The K (drafting.k) the drafter was trained for: SFT measures its tau over it (`tau_k`),
    Draft-OPD validates over it (`val_ttt_steps`); None if the dataset records neither."""
    stage = drafter_ds.config.get("stage", {})
    k = stage.get("tau_k", stage.get("val_ttt_steps"))
    return k if isinstance(k, int) else None


def _recorded_entry(drafter_ds: Dataset, path: Path, temperature: float) -> dict | None:
    """The checked tune result at `temperature` in `path` (None: not tuned there)."""
    fix = (
        f"re-run `opd tune --drafter {drafter_ds.ref} --temperature {temperature}` or delete "
        "the file"
    )
    try:
        entry = read_json_object(path).get(_key(temperature)) if path.exists() else None
    except UnreadableJson as e:
        raise OpdError(f"{e}; {fix}") from None
    problem = None if entry is None else _serve_problem(entry, trained_depth(drafter_ds))
    if problem is not None:
        raise OpdError(
            f"{path} holds an invalid `opd tune` result at T={temperature} ({problem}); {fix}"
        )
    return entry


def _serve_problem(entry: Any, depth: int | None) -> str | None:
    """What is wrong with one recorded result's `serve` part (None: it can be served)."""
    serve = entry.get("serve") if isinstance(entry, dict) else None
    if not isinstance(serve, dict):
        return "no `serve` object"
    k, speedup, prompts = serve.get("k"), serve.get("speedup_vs_plain"), serve.get("prompts")
    if not _is_int(k) or k < 1 or (depth is not None and k > depth):
        deepest = "" if depth is None else f" and <= {depth}, the depth the drafter was trained to"
        return f"serve.k is {k!r}, not an integer >= 1{deepest}"
    if not _is_number(speedup) or speedup <= 0:
        return f"serve.speedup_vs_plain is {speedup!r}, not a positive number"
    if not _is_int(prompts) or prompts < 1:
        return f"serve.prompts is {prompts!r}, not an integer >= 1"
    return None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)  # JSON `true` reads as 1


def _is_number(value: Any) -> bool:
    return (_is_int(value) or isinstance(value, float)) and math.isfinite(value)


def _key(temperature: float) -> str:
    return f"T={float(temperature)}"
