"""Stage `evaluate` on the tiny profile: τ and α add up, T=0 is lossless, mismatches are explained."""

import hashlib
import json

import polars as pl
import pytest
import torch

from models.decoding import target_generate
from pipeline.core.config import version_dict
from pipeline.core.drafters import load_drafter_dataset
from pipeline.core.runner import RunContext, run_stage
from pipeline.core.targets import TargetLoader
from pipeline.profiles import load_config
from pipeline.stages import evaluate, features, generate, sft
from storage import OpdError, Store, canonical_json
from tests.pipeline.conftest import write_prompts


@pytest.fixture
def drafted(tiny):
    store, ctx, cfg, prompts = tiny
    traj = run_stage(generate.STAGE, cfg.generate, {"prompts": prompts}, ctx).dataset
    feats = run_stage(features.STAGE, cfg.features, {"trajectories": traj}, ctx).dataset
    drafter = run_stage(sft.STAGE, cfg.sft, {"features": feats}, ctx).dataset
    return ctx, cfg, prompts, drafter


def test_evaluate_reports_consistent_tau_alpha_and_forwards(drafted):
    ctx, cfg, prompts, drafter = drafted
    ecfg = cfg.evaluate.model_copy(update={"batch_size": 2})
    ds = run_stage(evaluate.STAGE, ecfg, {"prompts": prompts, "drafter": drafter}, ctx).dataset
    stats = ds.meta
    steps = pl.read_parquet(ds.file("steps.parquet"))
    drafts = pl.read_parquet(ds.file("drafts.parquet"))
    # τ is the mean of accepted + 1 per verify step; forwards per token is its inverse exactly
    # when every verify step emits accepted + 1 tokens (no sequence cut short by EOS or length)
    assert stats["tau"] == pytest.approx(float((steps["accepted"] + 1).mean()))
    assert stats["verify_steps"] == steps.height and stats["prompts"] == ecfg.max_prompts
    assert stats["target_forwards_per_token"] == pytest.approx(
        steps.height / steps["emitted"].sum()
    )
    assert len(stats["alpha"]) <= ecfg.k and all(0 <= a <= 1 for a in stats["alpha"])
    reached = drafts.filter(pl.col("outcome") != "not_reached")
    assert reached.height > 0 and 1.0 <= stats["tau"] <= ecfg.k + 1
    # the drafts each offset's alpha is over: offset 1 is reached at every verify step that
    # drafted, a later one only where every offset before it was accepted
    counts = stats["alpha_reached"]
    assert (
        len(counts) == len(stats["alpha"])
        and counts[0] == steps.filter(pl.col("drafted") > 0).height
    )
    assert counts == reached.group_by("offset").len().sort("offset")["len"].to_list()
    for k in range(len(counts) - 1):
        assert counts[k + 1] <= round(counts[k] * stats["alpha"][k])
    # T=0: the speculative tokens are the target's greedy tokens, so no mismatch is reported
    assert stats["lossless_t0"] is True and stats["t0_mismatches"] == []
    assert stats["baseline_tokens_per_s"] > 0 and stats["speedup"] > 0
    assert "tau_untrained" in stats and stats["drafter"] == str(drafter.ref)


def test_divergence_names_the_first_differing_position_and_the_top2_gap(drafted):
    ctx, _, prompts, _ = drafted
    target = ctx.target_loader.target
    prompt = prompts.scan().collect()["prompt_ids"][0].to_list()
    greedy = target_generate(target, [prompt], 6, 0.0, 0).sequences[0]
    other = greedy[:3] + [(greedy[3] + 1) % target.vocab_size] + greedy[4:]
    out = evaluate.divergence(target, prompt, other, greedy)
    assert out["position"] == 3
    logits = target(torch.tensor([prompt + greedy[:3]])).logits[0, -1]
    top = logits.topk(2).values
    assert out["top2_logit_gap"] == pytest.approx(float(top[0] - top[1]))
    assert out["top2_logit_gap"] >= 0


def test_skip_prompts_takes_the_next_prompts_and_leaves_old_versions_alone(tiny):
    _, _, cfg, prompts = tiny
    heldout = prompts.scan().filter(pl.col("split") == "heldout").collect()["prompt_ids"].to_list()
    assert len(heldout) >= 3
    first = cfg.evaluate.model_copy(update={"max_prompts": 2})
    later = first.model_copy(update={"skip_prompts": 1})
    assert evaluate.prompt_ids(prompts, first) == heldout[:2]
    assert evaluate.prompt_ids(prompts, later) == heldout[1:3]
    # unset, it is not part of the version: evaluations made before it existed stay cached
    assert "skip_prompts" not in version_dict(first)
    assert version_dict(later)["skip_prompts"] == 1
    past = first.model_copy(update={"skip_prompts": len(heldout)})
    with pytest.raises(OpdError, match=f"after skipping {len(heldout)}.*lower evaluate.skip"):
        evaluate.prompt_ids(prompts, past)
    with pytest.raises(ValueError, match="give 0 or more, not -1"):
        evaluate.Config(skip_prompts=-1)


def test_prompts_made_from_heldout_sets_report_tau_per_set(drafted):
    import pyarrow as pa

    from pipeline.core.stage import HELDOUT_SETS

    ctx, cfg, prompts, drafter = drafted
    rows = prompts.read_table().to_pylist()
    held = [r for r in rows if r["split"] == "heldout"]
    # two sets, the second listed first in the file: evaluate takes max_prompts of each
    sources = ["b:1", "a:1", "b:2", "a:2"]
    table = [r | {"source": s} for r, s in zip(held, sources, strict=True)]
    w = ctx.store.writer("prompts", stage="test-prompts", stage_version="1", config={"sets": 2})
    with w:
        w.write_parquet("part-00000.parquet", pa.Table.from_pylist(table))
        sets = w.commit(meta={HELDOUT_SETS: ["a", "b"]})
    ecfg = cfg.evaluate.model_copy(update={"max_prompts": 2, "untrained_contrast": False})
    stats = run_stage(evaluate.STAGE, ecfg, {"prompts": sets, "drafter": drafter}, ctx).dataset
    by_set = stats.meta["by_set"]
    assert sorted(by_set) == ["a", "b"] and stats.meta["prompts"] == 4
    assert all(one["prompts"] == 2 for one in by_set.values())
    steps = pl.read_parquet(stats.file("steps.parquet"))
    # sequences 0, 1 are set a's (b's come after): each set's τ is over its own verify steps
    a = steps.filter(pl.col("sequence") < 2)
    assert by_set["a"]["tau"] == pytest.approx(float((a["accepted"] + 1).mean()))
    # one τ over everything is the step-weighted mean of the sets'
    n = {s: steps.filter((pl.col("sequence") < 2) == (s == "a")).height for s in by_set}
    mean = sum(by_set[s]["tau"] * n[s] for s in n) / sum(n.values())
    assert stats.meta["tau"] == pytest.approx(mean)


def test_every_decoding_pass_shows_its_own_progress(drafted, capsys):
    ctx, cfg, prompts, drafter = drafted
    ecfg = cfg.evaluate.model_copy(update={"untrained_contrast": True})
    ctx.progress = True
    try:
        ds = run_stage(evaluate.STAGE, ecfg, {"prompts": prompts, "drafter": drafter}, ctx)
    finally:
        ctx.progress = False
    stats = ds.dataset.meta
    assert "tau_untrained" in stats
    # the free baseline's speed-up is over plain decoding timed in its own pass, beside it
    free = stats["free_baseline"]
    assert free["speedup"] == pytest.approx(free["tokens_per_s"] / free["plain_tokens_per_s"])
    assert free["plain_tokens_per_s"] != stats["baseline_tokens_per_s"]
    assert free["lossless_t0"] is True
    err = capsys.readouterr().err
    for desc in ("evaluate", "untrained contrast", "free baseline"):
        assert f"{desc}: 100%" in err, err[-2000:]


def _eval(ctx, cfg, prompts, drafter, contrast: bool):
    ecfg = cfg.evaluate.model_copy(update={"untrained_contrast": contrast})
    return run_stage(evaluate.STAGE, ecfg, {"prompts": prompts, "drafter": drafter}, ctx).dataset


def _flip_tau(entry: dict) -> dict:
    entry["stats"]["tau"] += 8  # a flipped leading digit; the sha256 still the old numbers'
    return entry


def _impossible_tau(entry: dict) -> dict:
    entry["stats"]["tau"] = 9.857  # τ <= K + 1 = 4, with a matching sha256
    entry["sha256"] = hashlib.sha256(canonical_json(entry["stats"]).encode()).hexdigest()
    return entry


@pytest.mark.parametrize(
    "damage",
    [
        _flip_tau,
        _impossible_tau,
        lambda entry: {},
        lambda entry: entry | {"stats": entry["stats"] | {"tau": "1.5"}},
        lambda entry: entry | {"stats": entry["stats"] | {"tau": None}},
    ],
    ids=["flipped-digit", "out-of-range", "empty", "string-tau", "null-tau"],
)
def test_a_damaged_baseline_cache_entry_is_measured_again_with_one_warning(drafted, caplog, damage):
    ctx, cfg, prompts, drafter = drafted
    first = _eval(ctx, cfg, prompts, drafter, contrast=False).meta["free_baseline"]
    [entry] = (ctx.store.root / evaluate.BASELINE_DIR).glob("*.json")
    entry.write_text(json.dumps(damage(json.loads(entry.read_text()))))
    caplog.clear()
    again = _eval(ctx, cfg, prompts, drafter, contrast=True).meta["free_baseline"]
    # measured again (no "cached"), so the same counts as the first measurement
    assert "cached" not in again and again["tau"] == first["tau"] <= cfg.evaluate.k + 1
    warned = [r.getMessage() for r in caplog.records if "free baseline cache" in r.getMessage()]
    assert len(warned) == 1 and str(entry) in warned[0], warned
    # and cached again, intact: a third evaluation reads it
    assert evaluate.read_cached_baseline(entry, cfg.evaluate.k) == {
        k: v for k, v in again.items() if k != "cached"
    }


@pytest.mark.parametrize("where", ["entry-is-a-directory", "cache-dir-is-a-file"])
def test_a_baseline_cache_in_the_way_costs_a_warning_not_the_evaluation(drafted, caplog, where):
    ctx, cfg, prompts, drafter = drafted
    cache = ctx.store.root / evaluate.BASELINE_DIR
    if where == "cache-dir-is-a-file":
        cache.write_text("not a directory")
    else:
        _eval(ctx, cfg, prompts, drafter, contrast=False)
        [entry] = cache.glob("*.json")
        entry.unlink()
        entry.mkdir()
    caplog.clear()
    free = _eval(ctx, cfg, prompts, drafter, contrast=True).meta["free_baseline"]
    assert "cached" not in free and 1 <= free["tau"] <= cfg.evaluate.k + 1
    warned = [r.getMessage() for r in caplog.records if "free baseline cache" in r.getMessage()]
    assert warned and all(str(cache) in w for w in warned), warned


def test_a_bf16_evaluation_counts_the_outputs_identical_to_plain_greedy(tmp_path):
    # the whole chain in bf16 (a drafter records the target's dtype): near-ties may flip, and
    # in 32 tokens some did here (2 of 4 prompts, top-2 gaps 0.03); the test recounts either way
    sets = ["target.dtype=bfloat16", "evaluate.batch_size=3", "evaluate.max_new_tokens=32"]
    cfg = load_config("tiny", sets=sets)
    store = Store(tmp_path / "data")
    ctx = RunContext(store=store, target_loader=TargetLoader(cfg.target), progress=False)
    prompts = write_prompts(store)
    traj = run_stage(generate.STAGE, cfg.generate, {"prompts": prompts}, ctx).dataset
    feats = run_stage(features.STAGE, cfg.features, {"trajectories": traj}, ctx).dataset
    drafter = run_stage(sft.STAGE, cfg.sft, {"features": feats}, ctx).dataset
    ds = run_stage(evaluate.STAGE, cfg.evaluate, {"prompts": prompts, "drafter": drafter}, ctx)
    stats = ds.dataset.meta
    assert ds.dataset.meta["target_config"]["dtype"] == "bfloat16"
    # recount: decode the same prompts again with the same code (deterministic), and compare
    # each speculative output with plain greedy decoding of the same batch
    target = ctx.target_loader.target
    model = load_drafter_dataset(drafter, target, ctx.target_loader.identity)
    held = evaluate.prompt_ids(prompts, cfg.evaluate)
    again = evaluate.evaluate(target, model, held, cfg.evaluate)
    assert stats["prompts"] == len(held) == len(again.sequences)
    size = cfg.evaluate.batch_size
    plain = [
        s
        for b in range(0, len(held), size)
        for s in target_generate(
            target, held[b : b + size], cfg.evaluate.max_new_tokens, 0.0, 0
        ).sequences
    ]
    same = [a == b for a, b in zip(again.sequences, plain, strict=True)]
    assert stats["t0_identical"] == sum(same)
    assert {m["prompt"] for m in stats["t0_mismatches"]} == {i for i, s in enumerate(same) if not s}
    assert stats["lossless_t0"] is all(same)
    positions = [m["position"] for m in stats["t0_mismatches"]]
    assert stats["t0_first_divergence"] == (min(positions) if positions else None)
    for m in stats["t0_mismatches"]:
        spec, base = again.sequences[m["prompt"]], plain[m["prompt"]]
        at = m["position"]
        assert spec[:at] == base[:at] and spec[at : at + 1] != base[at : at + 1]
    assert evaluate.identity_line(stats).startswith(
        f"T=0: {sum(same)} of {len(held)} outputs identical to plain greedy"
    )
