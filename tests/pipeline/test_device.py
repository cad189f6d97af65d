"""Where the target runs: `target.device` / `target.dtype` resolution, what enters versions,
and the one-line errors for a device that is not there or a GPU that runs out of memory."""

import pytest
import torch
from click.testing import CliRunner

from cli.main import cli
from pipeline.core.config import StrictConfig
from pipeline.core.precision import native_bf16
from pipeline.core.runner import RunContext, planned_ref, run_stage
from pipeline.core.stage import Stage
from pipeline.core.targets import (
    TargetConfig,
    TargetLoader,
    resolve_device,
    resolve_dtype,
    target_spec,
)
from pipeline.profiles import load_config
from pipeline.stages import generate
from storage import OpdError, Store
from tests.pipeline.conftest import write_prompts

NO_CUDA = not torch.cuda.is_available()


def test_auto_is_the_cpu_and_its_native_dtype_without_a_gpu_and_bf16_with_a_device_map():
    if not NO_CUDA:
        pytest.skip("resolution without a GPU")
    cfg = TargetConfig()
    native = "bfloat16" if native_bf16("cpu") else "float32"  # bf16 on AMX (docs/scale.md)
    assert resolve_device(cfg) == torch.device("cpu") and resolve_dtype(cfg) == native
    assert resolve_dtype(TargetConfig(dtype="bfloat16")) == "bfloat16"
    assert resolve_dtype(TargetConfig(device_map="auto")) == "bfloat16"


def test_device_is_no_part_of_the_version_and_auto_dtype_keeps_fp32_versions(tiny):
    store, ctx, cfg, prompts = tiny
    inputs = {"prompts": prompts}
    fp32 = cfg.target.model_copy(update={"dtype": "float32"})
    ctx = RunContext(store=store, target_loader=TargetLoader(fp32), progress=False)
    ref = planned_ref(generate.STAGE, cfg.generate, inputs, ctx)
    same = [fp32.model_copy(update={"device": "cpu"})]
    if NO_CUDA and not native_bf16("cpu"):  # `auto` is fp32 only on a CPU without native bf16
        same += [cfg.target, cfg.target.model_copy(update={"device": "cpu"})]
    for target in same:
        other = RunContext(store=store, target_loader=TargetLoader(target), progress=False)
        assert planned_ref(generate.STAGE, cfg.generate, inputs, other) == ref
    bf16 = cfg.target.model_copy(update={"dtype": "bfloat16"})
    other = RunContext(store=store, target_loader=TargetLoader(bf16), progress=False)
    assert planned_ref(generate.STAGE, cfg.generate, inputs, other) != ref
    spec = target_spec(cfg.target.model_copy(update={"device": "cpu"}))
    assert "device" not in spec and "device_map" not in spec and spec["dtype"] == "float32"


@pytest.mark.parametrize("bad", ["gpu", "cuda:x", "CUDA", "cpu:0"])
def test_a_malformed_device_is_a_config_error(bad):
    with pytest.raises(OpdError, match="target.device"):
        load_config("tiny", sets=[f"target.device={bad}"])


@pytest.mark.skipif(not NO_CUDA, reason="needs a machine without CUDA")
def test_cuda_without_a_gpu_is_one_line_and_writes_nothing(tmp_path):
    store = Store(tmp_path)
    write_prompts(store)
    args = ["--root", str(tmp_path), "run", "generate", "--profile", "tiny", "--no-progress"]
    r = CliRunner().invoke(cli, [*args, "--set", "target.device=cuda"])
    assert r.exit_code == 2, r.output
    assert r.output.startswith("error: target.device=cuda but torch sees no CUDA GPU")
    assert "--set target.device=cpu" in r.output and len(r.output.strip().splitlines()) == 1
    assert store.names() == ["prompts"]


def test_device_map_needs_a_model_directory():
    loader = TargetLoader(load_config("tiny", sets=["target.device_map=auto"]).target)
    with pytest.raises(OpdError, match="device_map needs a model directory"):
        _ = loader.target


class _Cfg(StrictConfig):
    batch_size: int = 8


def test_running_out_of_gpu_memory_names_the_batch_knob_and_keeps_shards(tmp_path):
    store = Store(tmp_path)
    ctx = RunContext(store=store, target_loader=None, progress=False)
    calls = []

    def run(cfg, inputs, output, rank, world_size, c):
        calls.append(len(output.completed_shards()))
        if not output.has_shard("part-00000.parquet"):
            output.write_parquet("part-00000.parquet", inputs["prompts"].read_table())
        if len(calls) == 1:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return {}

    stage = Stage(
        name="oom",
        output="ooms",
        version="1",
        config=_Cfg,
        run=run,
        doc="test",
        inputs={"prompts": ("prompts",)},
        uses_target=False,
        sharded=True,
    )
    inputs = {"prompts": write_prompts(store)}
    with pytest.raises(OpdError) as err:
        run_stage(stage, _Cfg(), inputs, ctx)
    msg = str(err.value)
    assert "ran out of GPU memory on rank 0" in msg and "--set oom.batch_size=4" in msg
    ds = run_stage(stage, _Cfg(), inputs, ctx).dataset
    assert calls == [0, 1] and ds.num_rows == 16
