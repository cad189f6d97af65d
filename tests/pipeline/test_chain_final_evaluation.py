"""The chains' final evaluation at the K `opd tune` measures fastest (pipeline/chains.py
`tuned_evaluation`, `final_report`), on the tiny profile: which evaluations run and what the
report names, never the timings (a tune result is recorded by hand where its K must be known)."""

from pipeline import chains
from pipeline.core.config import DraftTree
from pipeline.core.tuning import record_result, tune_file, tuned_result

MACHINE = "CPU test, target dtype float32"


def _sft_chain(tiny):
    store, ctx, cfg, prompts = tiny
    steps = chains.CHAINS["sft-chain"](cfg)[1:]  # the prompts come from the fixture
    return chains.run_chain(steps, ctx, external={"prompts": prompts})


def _record_k(drafter, k: int) -> None:
    serve = {"k": k, "speedup_vs_plain": 1.5, "prompts": 3, "drafter_depth": 3}
    record_result(tune_file(drafter), "T=0.0", {"serve": serve, "measured": {}})


def test_final_evaluation_tunes_then_reports_trained_and_tuned_k_beside_the_lookup(tiny):
    store, ctx, cfg, _ = tiny
    results = _sft_chain(tiny)
    final = results["evaluate"].dataset
    drafter = store.open(final.inputs["drafter"])
    assert final.meta["k"] == cfg.drafting.k == 3 and tuned_result(drafter, 0.0) is None

    # not tuned yet: the chain tunes the final drafter, then evaluates at the K it chose
    tuned = chains.tuned_evaluation(results, ctx, cfg)
    k = tuned_result(drafter, 0.0)["serve"]["k"]
    assert (tuned is None) == (k == 3)

    # a tuned K other than the trained one: a second evaluation at it, same drafter and prompts
    _record_k(drafter, 2)
    tuned = chains.tuned_evaluation(results, ctx, cfg).dataset
    assert tuned.meta["k"] == 2 and tuned.inputs == final.inputs
    assert "free_baseline" not in tuned.meta and "tau_untrained" not in tuned.meta
    assert store.open("eval@latest").ref == final.ref  # the chain's own evaluation
    lines = chains.final_report(final, tuned, MACHINE)
    assert lines[0] == f"final evaluation, T=0, {final.meta['prompts']} held-out prompts, " + (
        f"batch 1, {MACHINE}:"
    )
    labels = [line.split("  tau ")[0].strip() for line in lines[1:]]
    assert labels == ["EAGLE-3 K=3 (trained K)", "EAGLE-3 K=2 (opd tune's K)", "n-gram lookup K=3"]
    for line, meta in zip(
        lines[1:], (final.meta, tuned.meta, final.meta["free_baseline"]), strict=True
    ):
        assert f"tau {meta['tau']:.3f}, {meta['speedup']:.2f}x plain decoding" in line

    # tuned to the trained K: the final evaluation is the tuned one, nothing more runs
    _record_k(drafter, 3)
    assert chains.tuned_evaluation(results, ctx, cfg) is None
    lines = chains.final_report(final, None, MACHINE)
    assert "EAGLE-3 K=3 (trained and opd tune's K)  tau" in lines[1] and len(lines) == 3


def test_no_tuned_evaluation_for_draft_trees(tiny):
    store, ctx, cfg, _ = tiny
    results = _sft_chain(tiny)
    treed = cfg.model_copy(
        update={
            "drafting": cfg.drafting.model_copy(
                update={"tree": DraftTree(depth=2, top_k=2, budget=4)}
            )
        }
    )
    assert chains.tuned_evaluation(results, ctx, treed) is None
    drafter = store.open(results["evaluate"].dataset.inputs["drafter"])
    assert tuned_result(drafter, 0.0) is None  # nothing was tuned
