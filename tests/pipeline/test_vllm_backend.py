"""The vLLM backend's plumbing without vLLM's engine: what `auto` resolves to, the version, and
the one-line errors when vLLM cannot serve (tests/vllm runs the engine itself)."""

from __future__ import annotations

import sys

import pytest
from click.testing import CliRunner

from cli.main import cli
from models import vllm_engine
from pipeline.core.runner import planned_ref, run_stage
from pipeline.core.targets import EMBEDDED_TARGET, TargetConfig, TargetLoader
from pipeline.stages import evaluate, features, generate, sft
from storage import OpdError


def test_auto_uses_hf_for_an_in_process_target_and_the_engine_enters_the_version(tiny):
    store, ctx, cfg, prompts = tiny
    auto = cfg.generate
    assert generate.resolved_engine(auto, ctx) == "hf"
    hf = auto.model_copy(update={"backend": "hf"})
    vllm = auto.model_copy(update={"backend": "vllm"})
    inputs = {"prompts": prompts}
    assert planned_ref(generate.STAGE, auto, inputs, ctx) == planned_ref(
        generate.STAGE, hf, inputs, ctx
    )
    assert planned_ref(generate.STAGE, vllm, inputs, ctx) != planned_ref(
        generate.STAGE, hf, inputs, ctx
    )


def test_vllm_backend_refuses_an_in_process_target(tiny):
    store, ctx, cfg, prompts = tiny
    vllm = cfg.generate.model_copy(update={"backend": "vllm"})
    with pytest.raises(OpdError, match="needs a target directory"):
        run_stage(generate.STAGE, vllm, {"prompts": prompts}, ctx)
    assert not any(r["complete"] for r in store.listing("trajectories"))


def test_without_vllm_installed_the_error_names_make_vllm(tiny, monkeypatch):
    store, _, cfg, prompts = tiny
    monkeypatch.setitem(sys.modules, "vllm", None)  # what `import vllm` meets when it is absent
    # and no engine: this worker may hold the vLLM tests' engine for the same embedded target
    monkeypatch.setattr(vllm_engine, "_ENGINES", {})
    ctx = type(tiny[1])(
        store=store,
        target_loader=TargetLoader(TargetConfig(aux_layer_ids=[1, 3, 5])),
        progress=False,
    )
    assert generate.resolved_engine(cfg.generate, ctx) == "hf"
    vllm = cfg.generate.model_copy(update={"backend": "vllm"})
    with pytest.raises(OpdError) as err:
        run_stage(generate.STAGE, vllm, {"prompts": prompts}, ctx)
    msg = str(err.value)
    assert "make vllm" in msg and "\n" not in msg
    assert not any(r["complete"] for r in store.listing("trajectories"))


@pytest.mark.vllm
def test_a_target_vllm_cannot_run_resolves_to_hf_and_an_explicit_vllm_says_why(tiny, tmp_path):
    from models import vllm_engine

    if (reason := vllm_engine.unavailable_reason()) is not None:
        pytest.skip(reason)
    if vllm_engine.device() != "cpu":
        pytest.skip("the head-size limit is the CPU build's")
    store, ctx, cfg, prompts = tiny
    # the tiny random target has head_dim 16, which vLLM's CPU attention does not run
    model_dir = tmp_path / "tiny-model"
    ctx.target_loader.target.model.save_pretrained(model_dir)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (model_dir / name).write_bytes((EMBEDDED_TARGET / name).read_bytes())
    local = type(ctx)(
        store=store,
        target_loader=TargetLoader(TargetConfig(path=str(model_dir), aux_layer_ids=[1, 2, 3])),
        progress=False,
    )
    assert generate.resolved_engine(cfg.generate, local) == "hf"
    vllm = cfg.generate.model_copy(update={"backend": "vllm"})
    with pytest.raises(OpdError, match=r"head sizes \[.*\]; .* has 16 \(use the hf backend"):
        run_stage(generate.STAGE, vllm, {"prompts": prompts}, local)
    assert not any(r["complete"] for r in store.listing("trajectories"))


SHAPE = ["target.path=shape:llama-3.1-8b", "target.shape.num_layers=4"]
SHAPE += ["target.shape.hidden_size=512", "features.draft_vocab_size=32000"]


def _one_line_error(root, *args: str) -> str:
    r = CliRunner().invoke(cli, ["--root", str(root), *args])
    assert r.exit_code == 2, r.output
    lines = r.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), r.output
    return lines[0]


def test_a_vllm_backend_for_a_target_without_a_directory_is_refused_before_any_work(tmp_path):
    root = tmp_path / "root"
    for chain, sets, target in (
        ("full", ["generate.backend=vllm"], "target.path=random"),  # was: after prompts
        ("full", ["evaluate.backend=vllm"], "target.path=random"),  # was: after the chain
        ("sft-chain", [*SHAPE, "evaluate.backend=vllm"], "target.path=shape:llama-3.1-8b"),
        ("generate", [*SHAPE, "generate.backend=vllm"], "target.path=shape:llama-3.1-8b"),
    ):
        args = ["run", chain, "--profile", "tiny", *(a for s in sets for a in ("--set", s))]
        stage = sets[-1].split(".")[0]
        error = _one_line_error(root, *args)
        assert f"{stage}.backend=vllm needs a target directory vLLM can load, and {target} is" in (
            error
        ), error
        assert f"set {stage}.backend=hf" in error
        assert not root.exists(), args  # nothing written, not even the prompts


def test_eval_on_vllm_of_a_drafter_of_an_in_process_target_is_refused_before_it_decodes(
    tiny, monkeypatch
):
    store, ctx, cfg, prompts = tiny
    traj = run_stage(generate.STAGE, cfg.generate, {"prompts": prompts}, ctx).dataset
    feats = run_stage(features.STAGE, cfg.features, {"trajectories": traj}, ctx).dataset
    drafter = run_stage(sft.STAGE, cfg.sft.model_copy(update={"steps": 1}), {"features": feats},
                        ctx).dataset  # fmt: skip

    def decoded(*args, **kwargs):
        raise AssertionError("decoded before the refusal")

    monkeypatch.setattr(evaluate, "evaluate", decoded)
    for args in (
        ["eval", "--drafter", str(drafter.ref), "--backend", "vllm"],
        ["run", "evaluate", "--set", "evaluate.backend=vllm"],
    ):
        error = _one_line_error(store.root, *args)
        assert "evaluate.backend=vllm needs a target directory" in error, args
        assert "target.path=random is built in this process" in error, args
    assert store.listing("eval") == []
