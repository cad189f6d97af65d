"""The decoding policy the stages that decode share (rollout, evaluate): chains or draft trees
from the `drafting` settings, checked before any work."""

from __future__ import annotations

from models.decoding import SpecConfig, check_tree_fits, speculative_generate
from models.drafter import ChainShape, TreeShape
from models.verify import Typical
from pipeline.core.config import DraftTree, TypicalAcceptance
from storage import OpdError


def decoder(
    k: int,
    tree: DraftTree | None,
    temperature: float,
    max_new_tokens: int,
    seed: int,
    stop_confidence: float | None = None,
    keep_teacher: bool = False,
    typical: TypicalAcceptance | None = None,
):
    """decode(target, drafter, prompts) -> SpecResult: K-chains (confidence-stopped when
    `stop_confidence` is set), or draft trees when `tree` is set; `keep_teacher` keeps the
    verify forwards' teachers (chains only); `typical` accepts by Medusa's typical acceptance
    (lossy at T>0) instead of the lossless rule."""
    chain = ChainShape(k, stop_confidence or 0.0)
    shape = chain if tree is None else TreeShape(**tree.model_dump())
    spec = SpecConfig(
        shape,
        temperature=temperature,
        max_new_tokens=max_new_tokens,
        seed=seed,
        keep_teacher=keep_teacher,
        typical=None if typical is None else Typical(typical.epsilon, typical.delta),
    )
    return lambda target, drafter, prompts: speculative_generate(target, drafter, prompts, spec)


def check_tree_setting(target, tree: DraftTree | None, prompts, max_new_tokens: int) -> None:
    """Refuse, before any work, a tree budget the target's context cannot hold."""
    if tree is not None:
        try:
            check_tree_fits(target, max(map(len, prompts)), max_new_tokens, tree.budget)
        except ValueError as e:
            raise OpdError(f"drafting.{e}") from None
