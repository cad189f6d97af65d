import polars as pl
import pytest
import torch
from safetensors.torch import load_file

from pipeline.core.runner import run_stage
from pipeline.core.targets import TargetConfig, TargetLoader
from pipeline.stages import features, generate
from storage import OpdError, read_tensor_column


def test_generate_greedy_matches_target_and_masks(tiny):
    store, ctx, cfg, prompts = tiny
    res = run_stage(generate.STAGE, cfg.generate, {"prompts": prompts}, ctx)
    traj = res.dataset
    df = traj.scan().collect()
    assert len(df) == 12 and traj.num_rows == 12
    assert len(traj.shards("parquet")) == 3  # 5 rows a shard
    model = ctx.target_loader.target.model
    for row in df.head(3).iter_rows(named=True):
        p = row["input_ids"][: row["prompt_len"]]
        ref = model.generate(torch.tensor([p]), max_new_tokens=16, do_sample=False, pad_token_id=0)
        assert row["input_ids"] == ref[0].tolist()[: len(row["input_ids"])]
        assert row["loss_mask"] == [0] * row["prompt_len"] + [1] * (
            len(row["input_ids"]) - row["prompt_len"]
        )
    # a second run is a no-op that returns the same version
    again = run_stage(generate.STAGE, cfg.generate, {"prompts": prompts}, ctx)
    assert again.reused and again.ref == res.ref


def test_generate_ranks_write_disjoint_shards_and_equal_single_worker(tiny, tmp_path):
    store, ctx, cfg, prompts = tiny
    single = run_stage(generate.STAGE, cfg.generate, {"prompts": prompts}, ctx).dataset
    sums = {s["path"]: s["sha256"] for s in single.manifest["shards"]}
    # same version from two ranks, written into a second store
    from pipeline.core.runner import RunContext
    from storage import Store

    other = Store(tmp_path / "other")
    from tests.pipeline.conftest import write_prompts

    p2 = write_prompts(other)
    assert p2.ref == prompts.ref
    ctx2 = RunContext(store=other, target_loader=ctx.target_loader, progress=False)
    r0 = run_stage(generate.STAGE, cfg.generate, {"prompts": p2}, ctx2, rank=0, world_size=2)
    assert r0.dataset is None  # rank 1 has not finished
    r1 = run_stage(generate.STAGE, cfg.generate, {"prompts": p2}, ctx2, rank=1, world_size=2)
    assert {s["path"]: s["sha256"] for s in r1.dataset.manifest["shards"]} == sums


def test_features_cache_matches_a_fresh_forward(tiny):
    store, ctx, cfg, prompts = tiny
    traj = run_stage(generate.STAGE, cfg.generate, {"prompts": prompts}, ctx).dataset
    feats = run_stage(features.STAGE, cfg.features, {"trajectories": traj}, ctx).dataset
    assert feats.meta["aux_layer_ids"] == [1, 2, 3]
    vocab = load_file(feats.file(features.VOCAB_FILE))
    assert int(vocab["t2d"].sum()) == 512 and vocab["d2t"].shape == (512,)
    target = ctx.target_loader.target
    seen = 0
    for shard in feats.shards("ipc"):
        table = feats.read_ipc(shard)
        aux, off = read_tensor_column(table.column("aux_hidden"), table.schema.field("aux_hidden"))
        last, off2 = read_tensor_column(
            table.column("last_hidden"), table.schema.field("last_hidden")
        )
        assert (off == off2).all()
        for i, ids in enumerate(table.column("input_ids").to_pylist()):
            out = target(torch.tensor([ids]))
            torch.testing.assert_close(
                aux[off[i] : off[i + 1]].float(),
                out.aux_hidden[0].float().cpu(),
                atol=0.05,
                rtol=0.02,
            )
            assert torch.equal(last[off[i] : off[i + 1]], out.last_hidden[0].bfloat16().cpu())
            seen += 1
    assert seen == 12
    # the vocab map is built from loss-masked counts only
    counts = vocab["counts"]
    df = (
        traj.scan()
        .select(pl.col("input_ids"), pl.col("loss_mask"))
        .explode("input_ids", "loss_mask")
        .filter(pl.col("loss_mask") == 1)
        .collect()
    )
    assert int(counts.sum()) == len(df)


def test_features_refuse_trajectories_of_another_target(tiny):
    store, ctx, cfg, prompts = tiny
    traj = run_stage(generate.STAGE, cfg.generate, {"prompts": prompts}, ctx).dataset
    other = TargetLoader(TargetConfig(path="random", random={"seed": 1}, aux_layer_ids=[1, 2, 3]))
    from pipeline.core.runner import RunContext

    ctx2 = RunContext(store=store, target_loader=other, progress=False)
    with pytest.raises(OpdError, match="different target"):
        run_stage(features.STAGE, cfg.features, {"trajectories": traj}, ctx2)
    assert not store.versions("features") or not any(
        r["complete"] for r in store.listing("features")
    )


def test_generate_refuses_empty_split(tiny):
    store, ctx, cfg, prompts = tiny
    bad = cfg.generate.model_copy(update={"split": "heldout", "max_prompts": None})
    assert run_stage(generate.STAGE, bad, {"prompts": prompts}, ctx).dataset.num_rows == 4
    from storage import Store
    from tests.pipeline.conftest import write_prompts

    empty_store = Store(store.root.parent / "empty")
    p = write_prompts(empty_store, n_train=0, n_heldout=2)
    from pipeline.core.runner import RunContext

    ctx2 = RunContext(store=empty_store, target_loader=ctx.target_loader, progress=False)
    with pytest.raises(OpdError, match="no 'train' prompts"):
        run_stage(generate.STAGE, cfg.generate, {"prompts": p}, ctx2)


def test_features_store_only_what_the_drafter_kind_reads(tiny):
    """A kind that reads the target's last hidden state alone (its spec's `reads`) gets feature
    rows without the aux layers, the last hidden state byte for byte the default's; the
    default's version is unchanged, and a kind that reads the aux layers refuses those rows in
    one line before it trains."""
    from models.drafters import KINDS
    from pipeline.core.config import version_dict
    from pipeline.profiles import load_config
    from pipeline.stages import sft

    store, ctx, cfg, prompts = tiny
    from models.kind import Reads

    last_only = next(s.name for s in KINDS.values() if s.reads == Reads(last_hidden=True))
    tied = load_config("tiny", None, [f"drafter.kind={last_only}"]).features
    assert tied.hidden_states == ["last_hidden"]
    assert "hidden_states" not in version_dict(cfg.features)  # the default kind's: unchanged
    named = features.Config.model_validate(
        cfg.features.model_dump() | {"hidden_states": ["last_hidden", "aux_hidden"]}
    )
    assert version_dict(named) == version_dict(cfg.features)

    traj = run_stage(generate.STAGE, cfg.generate, {"prompts": prompts}, ctx).dataset
    both = run_stage(features.STAGE, cfg.features, {"trajectories": traj}, ctx).dataset
    last = run_stage(features.STAGE, tied, {"trajectories": traj}, ctx).dataset
    assert last.ref != both.ref and last.meta["hidden_states"] == ["last_hidden"]
    assert "hidden_states" not in both.meta
    hidden = ctx.target_loader.target.hidden_size
    for shard in both.shards("ipc"):
        full, slim = both.read_ipc(shard), last.read_ipc(shard)
        assert slim.schema.names == ["seq_id", "input_ids", "loss_mask", "last_hidden"]
        assert slim.column("last_hidden").equals(full.column("last_hidden"))
        tokens = sum(len(ids) for ids in slim.column("input_ids").to_pylist())
        for table, name, per_token in ((slim, "last_hidden", 2), (full, "aux_hidden", 6)):
            values, _ = read_tensor_column(table.column(name), table.schema.field(name))
            assert values.numel() * values.element_size() == per_token * hidden * tokens
    with pytest.raises(
        OpdError, match=r"stores \['last_hidden'\].* also reads \['aux_hidden'\]"
    ) as err:
        run_stage(sft.STAGE, cfg.sft, {"features": last}, ctx)
    assert "\n" not in str(err.value)
