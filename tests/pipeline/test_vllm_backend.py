"""The vLLM backend's plumbing without vLLM's engine: what `auto` resolves to, the version, and
the one-line errors when vLLM cannot serve (tests/vllm runs the engine itself)."""

from __future__ import annotations

import sys

import pytest

from pipeline import generate
from pipeline.runner import planned_ref, run_stage
from pipeline.targets import TargetConfig, TargetLoader
from storage import OpdError


def test_auto_uses_hf_for_an_in_process_target_and_the_engine_enters_the_version(tiny):
    store, ctx, cfg, prompts = tiny
    auto = cfg.generate
    assert generate.resolved_engine(auto, ctx) == "hf"
    hf = auto.model_copy(update={"backend": "hf"})
    vllm = auto.model_copy(update={"backend": "vllm"})
    inputs = {"prompts": prompts}
    assert planned_ref(generate, auto, inputs, ctx) == planned_ref(generate, hf, inputs, ctx)
    assert planned_ref(generate, vllm, inputs, ctx) != planned_ref(generate, hf, inputs, ctx)


def test_vllm_backend_refuses_an_in_process_target(tiny):
    store, ctx, cfg, prompts = tiny
    vllm = cfg.generate.model_copy(update={"backend": "vllm"})
    with pytest.raises(OpdError, match="needs a target directory"):
        run_stage(generate, vllm, {"prompts": prompts}, ctx)
    assert not any(r["complete"] for r in store.listing("trajectories"))


def test_without_vllm_installed_the_error_names_make_vllm(tiny, monkeypatch):
    store, _, cfg, prompts = tiny
    monkeypatch.setitem(sys.modules, "vllm", None)  # what `import vllm` meets when it is absent
    ctx = type(tiny[1])(store=store, target_loader=TargetLoader(TargetConfig()), progress=False)
    assert generate.resolved_engine(cfg.generate, ctx) == "hf"
    vllm = cfg.generate.model_copy(update={"backend": "vllm"})
    with pytest.raises(OpdError) as err:
        run_stage(generate, vllm, {"prompts": prompts}, ctx)
    msg = str(err.value)
    assert "make vllm" in msg and "\n" not in msg
    assert not any(r["complete"] for r in store.listing("trajectories"))
