"""The draft-length cost model's arithmetic (models/draft_length.py), on hand-made steps."""

import random

import pytest

from models.draft_length import (
    LoggedStep,
    Prediction,
    StepCosts,
    choose,
    faster_beyond_noise,
    predict,
    ranked,
    replay_step,
    steps_from_log,
    sweep,
    tau_change_by_offset,
    tau_from_alpha,
)

COSTS = StepCosts(verify_s={1: 1.0, 2: 1.5, 3: 2.0, 4: 2.5, 5: 3.0}, drafter_s=0.2, overhead_s=0.1)


def test_tau_from_alpha():
    assert tau_from_alpha([0.5, 0.5, 1.0], 2) == pytest.approx(1.75)
    assert tau_from_alpha([0.5, 0.5, 1.0], 3) == pytest.approx(2.0)
    assert tau_from_alpha([0.9], 0) == 1.0


def test_tau_change_splits_over_offsets_weighted_by_reaching_them():
    before = [0.25, 0.3, 0.4, 0.5]
    # one offset changed: the whole change is there, scaled by the chance of reaching it
    only_third = tau_change_by_offset(before, [0.25, 0.3, 0.6, 0.5])
    assert only_third[:2] == [0.0, 0.0] and only_third[3] == 0.0
    assert only_third[2] == pytest.approx(0.25 * 0.3 * 0.2 * (1 + 0.5))
    # the same +0.2 at the first offset moves tau far more: every later draft hangs on it
    only_first = tau_change_by_offset(before, [0.45, 0.3, 0.4, 0.5])
    assert only_first[0] == pytest.approx(0.2 * (1 + 0.3 + 0.3 * 0.4 + 0.3 * 0.4 * 0.5))
    assert only_first[0] > 10 * only_third[2]
    rng = random.Random(0)
    for _ in range(20):
        a = [rng.random() for _ in range(6)]
        b = [rng.random() for _ in range(6)]
        shares = tau_change_by_offset(a, b)
        assert sum(shares) == pytest.approx(tau_from_alpha(b, 6) - tau_from_alpha(a, 6))
    assert tau_change_by_offset(before, before) == [0.0] * 4
    with pytest.raises(ValueError, match="same K"):
        tau_change_by_offset(before, before[:3])


def test_replay_step_under_k_and_threshold():
    step = LoggedStep(accepted=2, confidence=(0.9, 0.5, 0.9))  # joint 0.9, 0.45, 0.405
    assert replay_step(step, 3, 0.0) == (3, 3, 2)
    assert replay_step(step, 1, 0.0) == (1, 1, 1)  # a shorter chain accepts at most K
    assert replay_step(step, 3, 0.4) == (3, 3, 2)
    # stops after two: the forward that drafted the third (below) is paid, its draft dropped
    assert replay_step(step, 3, 0.42) == (2, 3, 2)
    assert replay_step(step, 3, 0.95) == (0, 1, 0)
    # near max_new_tokens a step's budget cut the chain: K cannot draft past it
    assert replay_step(LoggedStep(1, (0.9,)), 3, 0.0) == (1, 1, 1)
    assert replay_step(LoggedStep(0, ()), 3, 0.5) == (0, 0, 0)


def test_a_block_drafter_pays_one_forward_and_stops_per_slot():
    step = LoggedStep(accepted=2, confidence=(0.9, 0.5, 0.9))
    assert replay_step(step, 3, 0.0, blocks=True) == (3, 1, 2)
    assert replay_step(step, 1, 0.0, blocks=True) == (1, 1, 1)
    # a block is cut at its first slot below the threshold, not by the running product
    assert replay_step(step, 3, 0.42, blocks=True) == (3, 1, 2)
    assert replay_step(step, 3, 0.6, blocks=True) == (1, 1, 1)
    assert replay_step(step, 3, 0.95, blocks=True) == (0, 1, 0)
    assert replay_step(LoggedStep(0, ()), 3, 0.0, blocks=True) == (0, 0, 0)
    costs = StepCosts(COSTS.verify_s, COSTS.drafter_s, COSTS.overhead_s, blocks=True)
    p = predict([step], costs, 3)
    # verify(4) + ONE drafter forward + overhead, whatever K
    assert p.drafter_forwards_per_step == 1.0
    assert p.tokens_per_s == pytest.approx(3 / (2.5 + 0.2 + 0.1))


def test_predict_adds_steps_and_prefills():
    steps = [LoggedStep(2, (0.9, 0.5, 0.9)), LoggedStep(0, (0.3, 0.9, 0.9))]
    p = predict(steps, COSTS, 2)
    # each step: verify(3) + 2 drafter forwards + overhead = 2.5 s; emitted 3 and 1
    assert (p.tau, p.drafts_per_step, p.drafter_forwards_per_step) == (2.0, 2.0, 2.0)
    assert p.tokens_per_s == pytest.approx(4 / 5.0)
    costs = StepCosts(COSTS.verify_s, COSTS.drafter_s, COSTS.overhead_s, prefill_s=1.0)
    with_prefill = predict(steps, costs, 2, prompts=1)
    assert with_prefill.tau == 2.0 and with_prefill.tokens_per_s == pytest.approx(5 / 6.0)
    # threshold 0.35: the second step stops before its first draft (verify(1) + 1 forward)
    stopped = predict(steps, COSTS, 2, threshold=0.35)
    assert stopped.drafts_per_step == 1.0 and stopped.drafter_forwards_per_step == 1.5
    assert stopped.tokens_per_s == pytest.approx(4 / (2.5 + 1.0 + 0.2 + 0.1))


def test_unstopped_tau_is_the_alpha_product():
    """With no threshold, mean(min(accepted, K) + 1) over the steps is 1 + sum prod alpha."""
    rng = random.Random(0)
    steps = [LoggedStep(rng.choice([0, 0, 1, 2, 3, 4]), (0.5,) * 4) for _ in range(200)]
    acc = [s.accepted for s in steps]
    alpha = [sum(a >= d for a in acc) / max(1, sum(a >= d - 1 for a in acc)) for d in range(1, 5)]
    for k in range(1, 5):
        assert predict(steps, COSTS, k).tau == pytest.approx(tau_from_alpha(alpha, k))


def test_steps_from_log_orders_drafts_by_offset():
    records = {
        "sequence": [0, 0, 0, 1],
        "step": [0, 0, 1, 0],
        "offset": [2, 1, 1, 1],
        "confidence": [0.4, 0.8, 0.7, 0.6],
    }
    steps = {"sequence": [0, 0, 1, 1], "step": [0, 1, 0, 1], "accepted": [1, 0, 1, 0]}
    assert steps_from_log(records, steps) == [
        LoggedStep(1, (0.8, 0.4)),
        LoggedStep(0, (0.7,)),
        LoggedStep(1, (0.6,)),
        LoggedStep(0, ()),  # a step with no drafts (its budget was 0)
    ]


def test_sweep_and_ranking():
    steps = [LoggedStep(2, (0.9, 0.5, 0.9)), LoggedStep(0, (0.3, 0.9, 0.9))]
    preds = sweep(steps, COSTS, range(1, 4), (0.0, 0.35))
    assert [(p.k, p.threshold) for p in preds][:3] == [(1, 0.0), (1, 0.35), (2, 0.0)]
    top = ranked(preds)[0]
    assert top.tokens_per_s == max(p.tokens_per_s for p in preds)
    tie = [Prediction(3, 0.1, 1, 1, 1, 5.0), Prediction(2, 0.2, 1, 1, 1, 5.0)]
    assert ranked(tie)[0].k == 2


def test_faster_beyond_noise_needs_a_consistent_gain_over_the_prompts():
    assert faster_beyond_noise([12.0, 13.0, 12.5], [10.0, 10.4, 10.1])  # every prompt faster
    assert not faster_beyond_noise([10.0, 10.4, 10.1], [12.0, 13.0, 12.5])
    assert not faster_beyond_noise([20.0, 9.0, 10.0], [10.0, 10.0, 10.0])  # one lucky prompt
    assert not faster_beyond_noise([20.0], [10.0])  # one prompt never separates them
    assert faster_beyond_noise([11.0] * 4, [10.0] * 4)  # no spread: any gain counts


def _row(k, predicted_tps, tps, per_prompt):
    return {
        "setting": {"k": k, "threshold": 0.0},
        "predicted": {"tokens_per_s": predicted_tps},
        "tokens_per_s": tps,
        "per_prompt_tokens_per_s": per_prompt,
    }


def test_choose_keeps_the_prediction_unless_a_measurement_beats_it_beyond_noise():
    measured = {
        "best": _row(1, 20.0, 17.0, [17.0, 16.0, 18.0]),
        # measured faster in total, thanks to one prompt's lucky draws: not beyond noise
        "default": _row(6, 10.0, 19.0, [30.0, 12.0, 15.0]),
    }
    assert choose(measured, ["best", "default"]) == ("best", "predicted")
    measured["default"] = _row(6, 10.0, 22.0, [22.0, 21.0, 23.5])  # faster on every prompt
    assert choose(measured, ["best", "default"]) == ("default", "measured")
    # the reference is the predicted fastest of the names given, ties to the smaller K
    measured["default"] = _row(6, 20.0, 22.0, [17.0, 16.0, 18.0])
    assert choose(measured, ["default", "best"]) == ("best", "predicted")
    assert choose(measured, ["default"]) == ("default", "predicted")
