"""`opd eval` and `opd analyze` flag the numbers of a lossy (typical-acceptance) evaluation in
every output that shows them, a cache hit included; `opd eval`'s refusals name its own options."""

from click.testing import CliRunner

from cli.main import cli
from pipeline.chains import summary_markdown
from pipeline.core.runner import RunContext, StageResult, run_stage
from pipeline.core.targets import TargetLoader
from pipeline.profiles import load_config
from pipeline.stages import features, generate, sft
from storage import Dataset, Store
from tests.pipeline.conftest import write_prompts

LOSSY = "LOSSY: typical acceptance (drafting.acceptance=typical), not the target's law"


def _opd(root, *args: str) -> str:
    r = CliRunner().invoke(cli, ["--root", str(root), *args])
    assert r.exit_code == 0, r.output
    return r.stdout


def _drafter(store: Store) -> Dataset:
    """A drafter trained one step on the tiny profile's random target."""
    cfg = load_config("tiny")
    ctx = RunContext(store=store, target_loader=TargetLoader(cfg.target), progress=False)
    prompts = write_prompts(store)
    traj = run_stage(generate.STAGE, cfg.generate, {"prompts": prompts}, ctx).dataset
    feats = run_stage(features.STAGE, cfg.features, {"trajectories": traj}, ctx).dataset
    one_step = cfg.sft.model_copy(update={"steps": 1})
    return run_stage(sft.STAGE, one_step, {"features": feats}, ctx).dataset


def test_a_typical_acceptance_evaluation_is_flagged_lossy_wherever_its_numbers_show(tmp_path):
    store = Store(tmp_path)
    drafter = _drafter(store)
    args = ["eval", "--drafter", str(drafter.ref), "--set", "evaluate.max_prompts=2"]
    args += ["--set", "evaluate.untrained_contrast=false"]
    lossless = _opd(store.root, *args, "--temperature", "1")
    assert "LOSSY" not in lossless
    typical = [*args, "--temperature", "1", "--set", "drafting.acceptance=typical"]
    for run in ("measured", "cache hit"):  # a cache hit prints no stage log line either
        out = _opd(store.root, *typical).splitlines()
        assert out[1] == f"  {LOSSY}", (run, out)
    ev = Store(store.root).open("eval@latest")
    assert "LOSSY (typical acceptance)" in summary_markdown({"evaluate": StageResult(ev, True, 0)})

    report = _opd(store.root, "analyze", "--input", str(ev.ref)).splitlines()
    assert report[1] == f"  LOSSY: {ev.ref} verified by {LOSSY.removeprefix('LOSSY: ')}"
    text = Store(store.root).open("report@latest").path.joinpath("report.md").read_text()
    assert f"**LOSSY**: {ev.ref} verified by typical acceptance" in text
    assert Store(store.root).open("report@latest").meta["lossy"] == [str(ev.ref)]


def test_the_vllm_refusal_names_the_fix_on_the_command_that_ran(tmp_path):
    # The tiny profile's random target has no directory vLLM could load.
    store = Store(tmp_path)
    drafter = str(_drafter(store).ref)
    for args, fix in (
        (["eval", "--drafter", drafter, "--backend", "vllm"], "use --backend hf"),
        (["eval", "--drafter", drafter, "--set", "evaluate.backend=vllm"], "use --backend hf"),
        (["run", "evaluate", "--set", "evaluate.backend=vllm"], "set evaluate.backend=hf"),
    ):
        r = CliRunner().invoke(cli, ["--root", str(store.root), *args])
        assert r.exit_code == 2, r.output
        [line] = r.output.strip().splitlines()
        assert f"is built in this process (it has none): {fix} (vLLM runs" in line, (args, line)
    assert store.listing("eval") == []
