"""The CUDA path against the CPU path: same features and the same SFT step within bf16
tolerance, pinned feature batches, bf16 by default. Skipped (with the reason) without a GPU."""

import pytest
import torch

from models.teacher import ArgmaxCache
from models.vocab import DraftVocab
from pipeline.core import featurize, training, validation
from pipeline.core.checks import vocab_of
from pipeline.core.runner import RunContext, run_stage
from pipeline.core.targets import TargetConfig, TargetLoader, resolve_dtype
from pipeline.profiles import load_config
from pipeline.stages import features, generate, sft
from storage import Store
from tests.pipeline.conftest import write_prompts

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _ctx(store: Store, device: str) -> RunContext:
    # fp32 on both devices: the comparison is of the device, not of the dtype
    cfg = load_config("tiny", sets=[f"target.device={device}", "target.dtype=float32"])
    return RunContext(store=store, target_loader=TargetLoader(cfg.target), progress=False)


@pytest.fixture(scope="module")
def cpu_and_cuda(tmp_path_factory):
    """(cfg, cpu ctx, cuda ctx, trajectories) on one store: the trajectories come from the CPU."""
    store = Store(tmp_path_factory.mktemp("data"))
    cfg = load_config("tiny")
    cpu, cuda = _ctx(store, "cpu"), _ctx(store, "cuda")
    traj = run_stage(generate.STAGE, cfg.generate, {"prompts": write_prompts(store)}, cpu).dataset
    return cfg, cpu, cuda, traj


def test_auto_dtype_is_bf16_and_the_target_lands_on_the_gpu():
    assert resolve_dtype(TargetConfig()) == "bfloat16"
    target = _ctx(Store("unused"), "cuda").target_loader.target
    assert target.device.type == "cuda"
    # decoding meets a new key length every step; cuDNN's attention would plan each one
    assert not torch.backends.cuda.cudnn_sdp_enabled()


def test_features_on_cuda_equal_the_cpu_within_bf16(cpu_and_cuda):
    cfg, cpu, cuda, traj = cpu_and_cuda
    seqs = [r["input_ids"] for r in traj.read_table().select(["input_ids"]).to_pylist()[:6]]
    aux_cpu, last_cpu = featurize.forward_batch(cpu.target_loader.target, seqs)
    aux_gpu, last_gpu = featurize.forward_batch(cuda.target_loader.target, seqs)
    assert aux_gpu.device.type == "cpu"  # written from host memory
    # both are stored in bf16: one bf16 rounding step apart at most, plus fp32 kernel noise
    torch.testing.assert_close(aux_gpu.float(), aux_cpu.float(), rtol=1.6e-2, atol=1e-2)
    torch.testing.assert_close(last_gpu.float(), last_cpu.float(), rtol=1.6e-2, atol=1e-2)
    # the whole stage runs on the GPU into its own store
    other = Store(cuda.store.root.parent / "gpu-store")
    ctx = RunContext(store=other, target_loader=cuda.target_loader, progress=False)
    traj_copy = run_stage(
        generate.STAGE, cfg.generate, {"prompts": write_prompts(other)}, ctx
    ).dataset
    ds = run_stage(features.STAGE, cfg.features, {"trajectories": traj_copy}, ctx).dataset
    assert ds.num_rows == traj.num_rows


def test_one_sft_step_on_cuda_equals_the_cpu(cpu_and_cuda):
    cfg, cpu, cuda, traj = cpu_and_cuda
    feats = run_stage(features.STAGE, cfg.features, {"trajectories": traj}, cpu).dataset
    v = vocab_of(feats)
    vocab = DraftVocab(v["d2t"], v["t2d"])
    index = training.FeatureIndex(feats, validation.FEATURE_COLUMNS)
    batch = index.collate(list(range(4)))
    sft_cfg = cfg.sft.model_copy(update={"bf16": False})
    losses, grads = [], []
    for ctx in (cpu, cuda):
        target = ctx.target_loader.target
        drafter = sft.new_drafter(target, vocab, seed=0)
        argmax = ArgmaxCache(target.lm_head_weight, vocab.draft_to_target_ids)
        out = sft.train_step(drafter.training_module(), drafter, batch, target, sft_cfg, argmax)
        out.loss.backward()
        losses.append(out.loss.detach().cpu())
        grads.append(
            torch.cat([p.grad.flatten().cpu() for p in drafter.parameters() if p.grad is not None])
        )
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-3, atol=1e-4)
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-2, atol=1e-4)


def test_feature_batches_are_pinned_for_the_gpu(cpu_and_cuda):
    cfg, cpu, cuda, traj = cpu_and_cuda
    feats = run_stage(features.STAGE, cfg.features, {"trajectories": traj}, cpu).dataset
    index = training.FeatureIndex(feats, validation.FEATURE_COLUMNS)
    loader = training.FeatureLoader(index, range(4), batch_size=2, max_tokens=4096, pin_memory=True)
    batch = next(iter(loader.iterate(0)))
    assert all(t.is_pinned() for t in batch.columns.values())
