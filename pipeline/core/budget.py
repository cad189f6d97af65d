"""A drafter budget in optimizer steps: the row-steps each step of an epoch costs, and the fewest
steps that reach a budget (Draft-OPD's rounds and the experiments' matched arms)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from pipeline.core import training
from pipeline.core.trainer import TrainConfig
from storage import OpdError


def step_costs(
    lengths: np.ndarray,
    rows: list[int],
    *,
    steps_per_row: int,
    epoch: int,
    cfg: TrainConfig,
    world_size: int,
) -> list[int]:
    """Row-steps of each optimizer step of one epoch, all ranks' parts together (the same plan
    for any number of ranks, as FeatureLoader splits each batch across them)."""
    plan = training.plan_batches(
        lengths,
        rows,
        batch_size=cfg.batch_size,
        max_tokens=cfg.max_tokens,
        seed=cfg.seed,
        epoch=epoch,
        shuffle=True,
        world_size=world_size,
    )
    return [int(lengths[b].sum()) * steps_per_row for b in plan]


def steps_for_budget(budget: int, step_cost: Callable[[int], int]) -> int:
    """The fewest optimizer steps whose summed row-steps reach `budget`; step_cost(s) -> int."""
    done, step = 0, 0
    while done < budget:
        cost = step_cost(step)
        if cost <= 0:
            raise OpdError("a training step processes no rows; the budget cannot be reached")
        done += cost
        step += 1
    return step
