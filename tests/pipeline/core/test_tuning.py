"""`opd tune`'s recording and the K `opd export` serves with (pipeline/core/tuning.py), on the tiny
profile: correctness of what is recorded and read back, never its timings."""

import json

import polars as pl

from models.draft_length import TuneOptions, choose
from pipeline.core.runner import run_stage
from pipeline.core.tuning import (
    heldout_prompts,
    k_report,
    run_tune,
    serving_k,
    trained_k,
    tune_file,
)
from pipeline.stages import features, generate, sft


def test_tune_records_a_fixed_k_and_export_serves_it(tiny):
    store, ctx, cfg, prompts_ds = tiny
    traj = run_stage(generate.STAGE, cfg.generate, {"prompts": prompts_ds}, ctx).dataset
    feats = run_stage(features.STAGE, cfg.features, {"trajectories": traj}, ctx).dataset
    drafter = run_stage(sft.STAGE, cfg.sft, {"features": feats}, ctx).dataset
    assert trained_k(drafter) == cfg.drafting.k == 3

    # nothing tuned yet: the drafter's trained K, and why
    k, source = serving_k(drafter, 0.0, trained_k(drafter))
    assert k == 3 and "no `opd tune` result at T=0.0" in source
    assert k_report(drafter, 3) == (
        f"K=3 (trained K=3); fastest K on this machine not measured: opd tune --drafter "
        f"{drafter.ref} --temperature 0.0"
    )

    prompts = heldout_prompts(prompts_ds, "heldout", 2)
    opts = TuneOptions(6, thresholds=(0.0, 0.5), verify_reps=1, candidates=2)
    result = run_tune(drafter, prompts, ctx.target_loader, 0.0, cfg.drafting.k, opts)
    measured = result["measured"]
    assert {"plain", "default", "best", "candidate_2", "calibration"} <= set(measured)
    assert measured["default"]["setting"] == {"k": 3, "threshold": 0.0}
    for name in ("default", "best", "candidate_2"):
        assert measured[name]["lossless"] is True  # T=0: every setting decodes plain greedy
    assert len(result["sweep"]) == 3 * 2  # K = 1..3 (the trained depth) x two thresholds
    serve = result["serve"]
    timed = [n for n in measured if n not in ("plain", "calibration")]
    no_stop = [n for n in timed if not measured[n]["setting"]["threshold"]]
    # the best predicted fixed K is always timed: vLLM serves no threshold
    fixed = [p for p in result["sweep"] if not p["threshold"]]
    top = max(p["tokens_per_s"] for p in fixed)  # rounded: ties are any of the tied K
    assert {p["k"] for p in fixed if p["tokens_per_s"] == top} & {
        measured[n]["setting"]["k"] for n in no_stop
    }
    served, by = choose(measured, no_stop)
    assert serve["k"] == measured[served]["setting"]["k"] and serve["by"] == by
    assert serve["prompts"] == 2
    for name in no_stop:  # one timing per prompt
        assert len(measured[name]["per_prompt_tokens_per_s"]) == 2

    recorded = json.loads(tune_file(drafter).read_text())
    assert set(recorded) == {"T=0.0"}
    k, source = serving_k(drafter, 0.0, 3)
    assert k == serve["k"] and "measured by `opd tune` on this machine at T=0.0" in source
    k, source = serving_k(drafter, 1.0, 3)  # another serving temperature was not tuned
    assert k == 3 and "trained K" in source
    line = k_report(drafter, 3)
    assert line.startswith(f"K=3 (trained K=3); `opd tune` chose K={serve['k']} here")
    assert f"{by} fastest" in line
    assert f"trained K {measured['default']['speedup_vs_plain']}x in the same timing" in line


def test_heldout_prompts_are_evaluates(tiny):
    _, _, _, prompts_ds = tiny
    rows = prompts_ds.scan().filter(pl.col("split") == "heldout").collect()["prompt_ids"]
    assert heldout_prompts(prompts_ds, "heldout", 3) == rows.to_list()[:3]


def test_heldout_prompts_take_each_heldout_set_in_turn(tiny):
    import pyarrow as pa

    from pipeline.core.stage import HELDOUT_SETS

    store, ctx, _, _ = tiny
    sources = ["a:1", "a:2", "a:3", "b:1", "b:2"]
    rows = [
        {"split": "heldout", "source": s, "prompt_ids": [i + 1]} for i, s in enumerate(sources)
    ] + [{"split": "train", "source": "t:1", "prompt_ids": [9]}]
    w = ctx.store.writer("prompts", stage="test-prompts", stage_version="1", config={"sets": 2})
    with w:
        w.write_parquet("part-00000.parquet", pa.Table.from_pylist(rows))
        sets = w.commit(meta={HELDOUT_SETS: ["a", "b"]})
    # a tune on 4 prompts reads both sets, not set a's first 3 and one of b's
    assert heldout_prompts(sets, "heldout", 4) == [[1], [4], [2], [5]]
    assert heldout_prompts(sets, "heldout", 9) == [[1], [4], [2], [5], [3]]
    assert heldout_prompts(sets, "train", 9) == [[9]]
