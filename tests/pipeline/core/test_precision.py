"""Precision from the hardware: what `auto` resolves to, that the resolved precision (not the
word `auto`) enters every version, and that a stage's lines name the device and the dtype."""

import logging

import pytest
import torch

from pipeline.core import precision
from pipeline.core.runner import RunContext, output_version_config, run_stage
from pipeline.core.targets import TargetConfig, TargetLoader, resolve_dtype
from pipeline.profiles import load_config
from pipeline.stages import features, generate, opd, sft
from storage import Store
from tests.pipeline.conftest import write_prompts

NO_CUDA = not torch.cuda.is_available()


@pytest.fixture
def native(monkeypatch):
    """Set whether this CPU counts as running bf16 natively."""

    def set_to(value: bool) -> None:
        monkeypatch.setattr(precision, "native_bf16", lambda device_type: value)

    return set_to


def test_the_cpu_capability_is_named_and_only_amx_counts_as_native_bf16():
    capability = precision.cpu_capability()
    assert capability in ("AMX", "AVX-512-BF16", "AVX-512", "AVX2") or not capability.startswith(
        "AVX"
    )
    # on the AVX-512-BF16 Xeon without AMX, bf16 matmuls ran at 0.4-0.75x fp32 (docs/scale.md)
    assert precision.native_bf16("cpu") == (capability == "AMX")
    assert precision.native_bf16("cuda")
    assert precision.device_name(torch.device("cpu")) == f"cpu {capability}"


def test_a_bf16_setting_resolves_by_the_device_unless_it_is_explicit(native):
    cpu = torch.device("cpu")
    for value in (True, False):
        native(value)
        assert precision.resolve_bf16("auto", cpu) is value
        assert precision.resolve_bf16(True, cpu) is True
        assert precision.resolve_bf16(False, cpu) is False


@pytest.mark.skipif(not NO_CUDA, reason="resolution on a CPU")
def test_auto_target_dtype_is_bf16_exactly_where_the_cpu_runs_it_natively(native):
    for value, dtype in ((True, "bfloat16"), (False, "float32")):
        native(value)
        assert resolve_dtype(TargetConfig()) == dtype
        assert resolve_dtype(TargetConfig(dtype="float32")) == "float32"
        record = TargetLoader(TargetConfig(path="random", aux_layer_ids=[1, 2, 3])).record()
        assert record["target_config"]["dtype"] == dtype


def test_profiles_pin_fp32_only_where_equal_versions_everywhere_are_the_point():
    assert load_config("tiny").target.dtype == "float32"
    assert load_config("default").target.dtype == "float32"
    smollm2 = load_config("smollm2")
    assert smollm2.target.dtype == "auto" and smollm2.sft.bf16 == smollm2.opd.bf16 == "auto"
    # the tiny chain trains in fp32 wherever it runs, as its versions always said
    assert load_config("tiny").sft.bf16 is False and load_config("tiny").opd.bf16 is False


@pytest.mark.skipif(not NO_CUDA, reason="training resolves on the CPU here")
@pytest.mark.parametrize("stage", [sft.STAGE, opd.STAGE], ids=["sft", "opd"])
def test_a_training_stage_version_holds_its_resolved_precision(tiny, native, stage):
    _, ctx, cfg, _ = tiny
    section = getattr(cfg, stage.name)
    versions = {}
    for value in (True, False):
        native(value)
        auto = output_version_config(stage, section.model_copy(update={"bf16": "auto"}), ctx)
        explicit = output_version_config(stage, section.model_copy(update={"bf16": value}), ctx)
        assert auto == explicit and auto["stage"]["bf16"] is value  # hashed as resolved
        versions[value] = auto
    assert versions[True] != versions[False]  # fp32 and bf16 drafters never share a version


def test_a_stage_line_names_the_device_and_the_dtype(tiny, caplog):
    store, ctx, cfg, prompts = tiny
    with caplog.at_level(logging.INFO, logger="opd"):
        run_stage(generate.STAGE, cfg.generate, {"prompts": prompts}, ctx)
    (line,) = [r.getMessage() for r in caplog.records if "] wrote " in r.getMessage()]
    device = precision.device_name(ctx.target_loader.target.device)
    assert line.startswith("[generate] wrote trajectories@") and line.endswith(
        f"; {device}, target float32)"
    )


def test_a_training_stage_line_names_its_training_precision(tmp_path, caplog):
    store = Store(tmp_path)
    cfg = load_config("tiny", sets=["target.device=cpu", "sft.steps=1"])
    ctx = RunContext(store=store, target_loader=TargetLoader(cfg.target), progress=False)
    traj = run_stage(generate.STAGE, cfg.generate, {"prompts": write_prompts(store)}, ctx).dataset
    feats = run_stage(features.STAGE, cfg.features, {"trajectories": traj}, ctx).dataset
    with caplog.at_level(logging.INFO, logger="opd"):
        run_stage(sft.STAGE, cfg.sft, {"features": feats}, ctx)
    (line,) = [r.getMessage() for r in caplog.records if "[sft] wrote " in r.getMessage()]
    capability = precision.cpu_capability()
    assert line.endswith(f"; cpu {capability}, target float32, training fp32)")
