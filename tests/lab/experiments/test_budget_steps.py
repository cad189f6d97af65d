"""Counting optimizer steps to a budget when epochs hold different numbers of batches."""

import pytest

from lab.experiments.common import nth_step
from pipeline.core.budget import steps_for_budget
from storage import OpdError


def test_steps_run_epoch_after_epoch_whatever_their_lengths():
    # max_tokens packs each epoch's shuffle differently: 3 batches, then 2, then 3, ...
    epochs = {0: [1, 2, 3], 1: [10, 20], 2: [100, 200, 300]}
    plan = epochs.__getitem__
    assert [nth_step(plan, s) for s in range(8)] == [1, 2, 3, 10, 20, 100, 200, 300]
    # the budget is reached in the shorter second epoch, then in the third
    assert steps_for_budget(16, lambda s: nth_step(plan, s)) == 4
    assert steps_for_budget(37, lambda s: nth_step(plan, s)) == 6


def test_an_empty_epoch_is_refused():
    with pytest.raises(OpdError, match="no batch"):
        nth_step(lambda epoch: [], 0)
