"""Shared state for the vLLM tests: the embedded target, its prompts, engines and one drafter.

Everything is session-scoped because starting a vLLM engine costs 30-50 s on 2 CPU cores:
the engines (one plain, one per drafter export) are cached by models.vllm_engine, and the
stages and CLI commands under test reuse them through the same `EngineSpec`s.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from models import vllm_engine
from pipeline.chains import Step
from pipeline.core.export import ensure_export
from pipeline.core.runner import RunContext, run_stage
from pipeline.core.targets import TargetLoader, resolve_dtype
from pipeline.profiles import PipelineConfig, load_config
from pipeline.stages import evaluate, features, generate, prompts, sft
from storage import Dataset, Store

UNAVAILABLE = vllm_engine.unavailable_reason()
K = 6  # drafted tokens per step, the default profile's
# The default profile (embedded target, aux layers 1/3/5, K=6), sized down for CI: a drafter
# trained on 256 greedy trajectories for 40 steps, evaluated on the first 24 held-out prompts
# (the project's decoder in batches of 8: at T=0 its tokens are the same as one by one). 40
# steps, not 80: the EAGLE-3 drafter's held-out tau is 1.50 there (1.86 at 80) in half the
# training time (51 s against 103 s on an idle 2-core machine), and a format mistake shows as
# a collapse to ~1.0 either way.
SETS = [
    "generate.max_prompts=256",
    "generate.max_new_tokens=64",
    "generate.backend=vllm",
    "sft.steps=40",
    "drafting.ttt_steps=6",  # the default's 7 less one: CI time, still >= K
    "sft.val_every=1000",
    "evaluate.max_prompts=24",
    "evaluate.max_new_tokens=64",
    "evaluate.batch_size=8",
    "evaluate.measure_baseline=false",
    "evaluate.untrained_contrast=false",
]


@dataclass
class Embedded:
    store: Store
    ctx: RunContext
    cfg: PipelineConfig
    prompts: Dataset
    plain: vllm_engine.EngineSpec

    @property
    def target(self):
        return self.ctx.target_loader.target

    def heldout(self) -> list[list[int]]:
        return evaluate.prompt_ids(self.prompts, self.cfg.evaluate)


@pytest.fixture(scope="session")
def embedded(tmp_path_factory) -> Embedded:
    store = Store(tmp_path_factory.mktemp("vllm") / "data")
    cfg = load_config("default", None, SETS)
    loader = TargetLoader(cfg.target)
    ctx = RunContext(store=store, target_loader=loader, progress=False)
    ds = run_stage(prompts.STAGE, cfg.prompts, {}, ctx).dataset
    plain = vllm_engine.EngineSpec(str(loader.directory), resolve_dtype(cfg.target))
    vllm_engine.engine(plain)
    yield Embedded(store, ctx, cfg, ds, plain)
    vllm_engine.close()


@pytest.fixture(scope="session")
def generated(embedded: Embedded) -> Dataset:
    """Trajectories from the generate stage on vLLM, run as a Prefect flow in this process."""
    from flows.pipeline import run_steps_flow

    step = Step("generate", generate.STAGE, embedded.cfg.generate, {"prompts": "prompts"})
    results = run_steps_flow([step], embedded.ctx, {"prompts": embedded.prompts}, set())
    return results["generate"].dataset


@pytest.fixture(scope="session")
def drafter(embedded: Embedded, generated: Dataset) -> Dataset:
    ctx, cfg = embedded.ctx, embedded.cfg
    feats = run_stage(features.STAGE, cfg.features, {"trajectories": generated}, ctx).dataset
    return run_stage(sft.STAGE, cfg.sft, {"features": feats}, ctx).dataset


@pytest.fixture(scope="session")
def eagle3_export(embedded: Embedded, drafter: Dataset) -> Path:
    """The drafter's native export where `opd eval --backend vllm` puts it, its engine started
    (and kept) with the K the tests use, so the CLI test reuses it."""
    path = ensure_export(drafter, embedded.ctx.target_loader, embedded.store.root, K, "eagle3")
    plain = embedded.plain
    vllm_engine.engine(
        vllm_engine.EngineSpec(plain.model, plain.dtype, str(path), K, method="eagle3")
    )
    return path
