"""The stage record: input kinds checked before work, no empty commits, one K for every stage."""

import pyarrow.compute as pc
import pytest
from click.testing import CliRunner

from cli.main import cli
from pipeline.core.config import StrictConfig
from pipeline.core.runner import RunContext, run_stage
from pipeline.core.stage import Stage
from pipeline.profiles import PipelineConfig, load_config
from pipeline.stages import STAGES
from storage import OpdError, Store
from tests.pipeline.conftest import write_prompts


class CopyConfig(StrictConfig):
    keep_split: str = "train"


def _copy_stage(calls: list, **over) -> Stage:
    """A stage defined only by its record and run function, as a new stage would be."""

    def run(cfg, inputs, output, rank, world_size, ctx):
        calls.append(cfg)
        table = inputs["prompts"].read_table()
        rows = table.filter(pc.equal(table["split"], cfg.keep_split))
        output.write_parquet("part-00000.parquet", rows)
        return {"rows": rows.num_rows}

    record = dict(
        name="copy",
        output="copies",
        version="1",
        config=CopyConfig,
        run=run,
        doc="copy one split of the prompts",
        inputs={"prompts": ("prompts",)},
        uses_target=False,
        sharded=True,
    )
    return Stage(**(record | over))


@pytest.fixture
def store_ctx(tmp_path):
    store = Store(tmp_path / "data")
    return store, RunContext(store=store, target_loader=None, progress=False)


def test_a_stage_is_its_record_and_commits_its_rows(store_ctx):
    store, ctx = store_ctx
    calls = []
    ds = run_stage(_copy_stage(calls), CopyConfig(), {"prompts": write_prompts(store)}, ctx).dataset
    assert ds.ref.name == "copies" and ds.num_rows == 12 and len(calls) == 1
    assert store.resolve("copies@latest") == ds.ref


def test_an_input_of_the_wrong_kind_fails_before_any_work(store_ctx):
    store, ctx = store_ctx
    prompts = write_prompts(store)
    copies = run_stage(_copy_stage([]), CopyConfig(), {"prompts": prompts}, ctx).dataset
    calls = []
    stage = _copy_stage(calls, name="copy2", output="copies2")
    with pytest.raises(OpdError, match=r"reads 'prompts' from a prompts dataset, but copies@"):
        run_stage(stage, CopyConfig(), {"prompts": copies}, ctx)
    with pytest.raises(OpdError, match=r"has no input role 'extra'"):
        run_stage(stage, CopyConfig(), {"prompts": prompts, "extra": prompts}, ctx)
    with pytest.raises(OpdError, match=r"needs inputs \['prompts'\]"):
        run_stage(stage, CopyConfig(), {}, ctx)
    assert calls == [] and "copies2" not in store.names()


def test_zero_rows_from_rows_is_refused_and_nothing_commits(store_ctx):
    store, ctx = store_ctx
    prompts = write_prompts(store)
    with pytest.raises(OpdError, match="would commit 0 rows from prompts@"):
        run_stage(_copy_stage([]), CopyConfig(keep_split="test"), {"prompts": prompts}, ctx)
    with pytest.raises(OpdError, match="no dataset named 'copies'|no complete copies"):
        store.resolve("copies@latest")
    # a stage that declares empty output legitimate commits it
    stage = _copy_stage([], may_be_empty=True)
    ds = run_stage(stage, CopyConfig(keep_split="test"), {"prompts": prompts}, ctx).dataset
    assert ds.num_rows == 0


def test_score_refuses_replays_as_rollouts_from_the_cli(tmp_path):
    store = Store(tmp_path)
    write_prompts(store)
    r = CliRunner().invoke(
        cli,
        ["--root", str(tmp_path), "run", "score", "--profile", "tiny", "--no-progress"]
        + ["--input", "rollouts=prompts@latest", "--input", "drafter=prompts@latest"],
    )
    assert r.exit_code == 2, r.output
    assert r.output.startswith("error: stage score reads") and "--input" in r.output
    assert store.names() == ["prompts"]


def test_every_stage_has_a_config_section_and_help_line():
    assert [s.name for s in STAGES][:3] == ["prompts", "generate", "features"]
    for s in STAGES:
        assert isinstance(getattr(PipelineConfig(), s.name), s.config)
    r = CliRunner().invoke(cli, ["run", "--help"])
    for s in STAGES:
        assert s.name in r.output and s.doc.split()[0] in r.output


def test_one_k_reaches_every_stage():
    cfg = load_config("tiny", sets=["drafting.k=2"])
    assert (cfg.rollout.k, cfg.score.k, cfg.evaluate.k) == (2, 2, 2)
    assert (cfg.sft.tau_k, cfg.opd.val_ttt_steps) == (2, 2)
    assert cfg.sft.ttt_steps == cfg.drafting.ttt_steps == 3
    default = load_config()
    assert (default.drafting.k, default.drafting.ttt_steps) == (6, 7)
    assert default.rollout.k == default.evaluate.k == default.sft.tau_k == 6


@pytest.mark.parametrize(
    "sets, message",
    [
        (["rollout.k=4"], "rollout.k is set once for every stage as drafting.k"),
        (["sft.ttt_steps=4"], "use --set drafting.ttt_steps=4"),
        (["drafting.k=5"], r"drafting.ttt_steps \(3\) must be >= drafting.k \(5\)"),
        (["drafting.k=0"], "drafting.k"),
    ],
)
def test_k_fields_are_set_only_through_drafting(sets, message):
    with pytest.raises(OpdError, match=message):
        load_config("tiny", sets=sets)


def test_resuming_counts_only_shards_of_rows(store_ctx, caplog):
    """A stage killed after writing only its vocab-map file has no rows to resume from; one
    killed after a shard of rows resumes from that shard, and says so."""
    store, ctx = store_ctx
    prompts = write_prompts(store)

    def run(cfg, inputs, output, rank, world_size, ctx, *, rows_first: bool):
        if rows_first:
            output.write_parquet("part-00000.parquet", inputs["prompts"].read_table())
        output.write_bytes("vocab.bin", b"map")
        raise KeyboardInterrupt  # killed after those files

    for rows_first, said in ((False, False), (True, True)):
        killed = _copy_stage(
            [],
            name=f"copy{int(rows_first)}",
            output=f"copies{int(rows_first)}",
            run=lambda *a, rows_first=rows_first: run(*a, rows_first=rows_first),
        )
        with pytest.raises(KeyboardInterrupt):
            run_stage(killed, CopyConfig(), {"prompts": prompts}, ctx)
        caplog.clear()
        with caplog.at_level("INFO"), pytest.raises(KeyboardInterrupt):
            run_stage(killed, CopyConfig(), {"prompts": prompts}, ctx)
        assert ("resuming" in caplog.text) is said
        if said:
            assert "from 1 completed shard" in caplog.text
