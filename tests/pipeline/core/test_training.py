"""The training building blocks: loader, holdout, schedule, checkpoints, acceptance metrics, DDP."""

import json
import math
import os
import random
import socket
import sys
from pathlib import Path

import pyarrow as pa
import pytest
import torch

from pipeline.core import training
from storage import OpdError, Store, tensor_array, tensor_field

REPO = Path(__file__).resolve().parents[3]
LENGTHS = [3, 12, 5, 7, 9, 4, 11, 6, 8, 10, 3, 5, 12, 7, 4, 9, 6]  # 17 rows
COLUMNS = ("input_ids", "loss_mask", "aux_hidden", "last_hidden")


def _rows(first: int, lengths: list[int]) -> pa.RecordBatch:
    """Row r's values encode (r, t) so a batch shows exactly which row and position it holds."""
    aux_f, last_f = (
        tensor_field("aux_hidden", torch.bfloat16, 6),
        tensor_field("last_hidden", torch.bfloat16, 2),
    )
    rows = range(first, first + len(lengths))
    schema = pa.schema(
        [
            pa.field("seq_id", pa.string()),
            pa.field("input_ids", pa.list_(pa.int32())),
            pa.field("loss_mask", pa.list_(pa.int8())),
            aux_f,
            last_f,
        ]
    )
    return pa.record_batch(
        [
            pa.array([f"seq-{r}" for r in rows]),
            pa.array(
                [[r * 100 + t for t in range(n)] for r, n in zip(rows, lengths, strict=True)],
                pa.list_(pa.int32()),
            ),
            pa.array([[int(t >= 2) for t in range(n)] for n in lengths], pa.list_(pa.int8())),
            # half-integers below 128 are exact in bf16
            tensor_array(
                [
                    (torch.arange(n)[:, None] + 0.5 * r + torch.zeros(n, 6)).bfloat16()
                    for r, n in zip(rows, lengths, strict=True)
                ],
                aux_f,
            ),
            tensor_array(
                [
                    torch.full((n, 2), -float(r)).bfloat16()
                    for r, n in zip(rows, lengths, strict=True)
                ],
                last_f,
            ),
        ],
        schema=schema,
    )


@pytest.fixture(scope="module")
def index(tmp_path_factory):
    """17 rows in two shards; the second shard holds two record batches."""
    store = Store(tmp_path_factory.mktemp("data"))
    with store.writer("features", stage="test", stage_version="1", config={}) as w:
        w.write_ipc("part-00000.arrow", [_rows(0, LENGTHS[:7])])
        w.write_ipc("part-00001.arrow", [_rows(7, LENGTHS[7:12]), _rows(12, LENGTHS[12:])])
        ds = w.commit()
    return training.FeatureIndex(ds, COLUMNS)


# -- loader --------------------------------------------------------------------------------


def test_index_reads_all_shards_and_batches(index):
    assert len(index) == 17
    assert index.lengths.tolist() == LENGTHS
    assert index.keys == [f"seq-{r}" for r in range(17)]


def test_collate_pads_right_with_zeros_and_keeps_values(index):
    rows = [1, 0, 13, 16]
    b = index.collate(rows)
    width = max(LENGTHS[r] for r in rows)
    assert b["input_ids"].shape == (4, width) and b["input_ids"].dtype == torch.int64
    assert b["aux_hidden"].shape == (4, width, 6) and b["aux_hidden"].dtype == torch.bfloat16
    assert b["last_hidden"].shape == (4, width, 2)
    assert b.rows.tolist() == rows and b.lengths.tolist() == [LENGTHS[r] for r in rows]
    assert b.num_tokens == sum(LENGTHS[r] for r in rows)
    for i, r in enumerate(rows):
        n = LENGTHS[r]
        assert b["input_ids"][i, :n].tolist() == [r * 100 + t for t in range(n)]
        assert b["loss_mask"][i, :n].tolist() == [int(t >= 2) for t in range(n)]
        assert torch.equal(b["aux_hidden"][i, :n, 0].float(), torch.arange(n) + 0.5 * r)
        assert (b["last_hidden"][i, :n] == -r).all()
        # padding: zero ids, a zero mask (never trained on) and zero features
        assert (b["input_ids"][i, n:] == 0).all() and (b["loss_mask"][i, n:] == 0).all()
        assert (b["aux_hidden"][i, n:] == 0).all() and (b["last_hidden"][i, n:] == 0).all()


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_every_row_once_per_epoch_across_ranks(index, world_size):
    rows = list(range(17))
    seen_by_epoch = []
    one = training.FeatureLoader(index, rows, batch_size=4, max_tokens=36, seed=3)
    for epoch in range(2):
        seen, counts, steps = [], [], []
        for rank in range(world_size):
            loader = training.FeatureLoader(
                index, rows, batch_size=4, max_tokens=36, seed=3, rank=rank, world_size=world_size
            )
            batches = list(loader.iterate(epoch))
            assert len(batches) == len(loader)
            counts.append(len(batches))
            steps.append(batches)
            for b in batches:
                assert len(b.rows) <= 4 and len(b.rows) * int(b.lengths.max()) <= 36
                assert b["input_ids"][:, 0].tolist() == [100 * r for r in b.rows.tolist()]
                seen += b.rows.tolist() if b.share > 0 else []  # share 0: a stand-in row
        assert sorted(seen) == rows  # each row exactly once
        assert counts == [len(one)] * world_size  # DDP ranks step together, as one process
        # step s of every rank together is step s of one process, the shares its tokens
        for s, whole in enumerate(one.plan(epoch)):
            parts = [batches[s] for batches in steps]
            assert sorted(r for b in parts if b.share > 0 for r in b.rows.tolist()) == sorted(whole)
            assert sum(b.share for b in parts) == pytest.approx(1.0)
        seen_by_epoch.append(seen)
    assert seen_by_epoch[0] != seen_by_epoch[1]  # reshuffled each epoch


def test_plan_is_deterministic_and_resumable(index):
    kw = dict(batch_size=3, max_tokens=40, seed=7)
    a = training.FeatureLoader(index, range(17), **kw)
    b = training.FeatureLoader(index, range(17), **kw)
    assert a.plan(5) == b.plan(5)
    full = [x.rows.tolist() for x in a.iterate(5)]
    assert [x.rows.tolist() for x in b.iterate(5, start=2)] == full[2:]
    assert training.FeatureLoader(index, range(17), **(kw | {"seed": 8})).plan(5) != a.plan(5)
    # one prefetching stream continues across epochs, each epoch in its own order
    two = [x.rows.tolist() for x in a.iterate(5, start=4, epochs=2)]
    assert two == a.plan(5)[4:] + a.plan(6)
    endless = a.iterate(5, epochs=None)
    assert [next(endless).rows.tolist() for _ in range(3 * len(a))] == a.plan(5) + a.plan(
        6
    ) + a.plan(7)
    endless.close()


def test_a_steps_batch_is_found_epoch_after_epoch_whatever_their_lengths(index):
    # 204 rows (each of the 17 twelve times) span two sort windows of 128, so max_tokens packs
    # each epoch's shuffle into its own number of batches: 138, 139, 139, ... for this seed
    loader = training.FeatureLoader(index, list(range(17)) * 12, batch_size=2, max_tokens=16)
    lens = [len(loader.plan(e)) for e in range(4)]
    assert len(set(lens)) > 1 and len(loader) == lens[0]  # where divmod by one epoch is wrong
    stream = [rows for e in range(4) for rows in loader.plan(e)]
    for step in range(len(stream)):
        epoch, i = loader.position(step)
        assert loader.plan(epoch)[i] == stream[step]
    # a run resumed at a step sees the batches the uninterrupted run saw from there
    epoch, i = loader.position(300)
    resumed = loader.iterate(epoch, i, epochs=None)
    assert [next(resumed).rows.tolist() for _ in range(5)] == stream[300:305]
    resumed.close()
    with pytest.raises(OpdError, match="no batch"):
        training.FeatureLoader(index, [], batch_size=2, max_tokens=16).position(0)


def test_unshuffled_loader_without_equal_ranks_keeps_order(index):
    rows = [2, 4, 6, 8, 10]
    plans = [
        training.FeatureLoader(
            index,
            rows,
            batch_size=2,
            max_tokens=100,
            shuffle=False,
            equal_ranks=False,
            rank=r,
            world_size=2,
        ).plan(0)
        for r in range(2)
    ]
    assert plans == [[[2, 4], [10]], [[6, 8]]]


def test_loader_stops_cleanly_when_closed_early(index):
    loader = training.FeatureLoader(index, range(17), batch_size=2, max_tokens=40, prefetch=1)
    it = loader.iterate(0)
    next(it)
    it.close()  # must join the producer thread, not hang


def test_loader_refuses_sequences_longer_than_a_batch(index):
    with pytest.raises(OpdError, match="raise max_tokens"):
        training.FeatureLoader(index, range(17), batch_size=4, max_tokens=11)
    with pytest.raises(OpdError, match="cannot feed 4 ranks"):
        training.FeatureLoader(index, [0, 1, 2], batch_size=4, max_tokens=64, world_size=4)


def test_loader_reraises_errors_from_its_thread(index, monkeypatch):
    loader = training.FeatureLoader(index, range(17), batch_size=4, max_tokens=64)

    def broken(rows):
        raise RuntimeError("disk went away")

    monkeypatch.setattr(index, "collate", broken)
    with pytest.raises(RuntimeError, match="disk went away"):
        list(loader.iterate(0))


def test_holdout_split_is_keyed_by_name():
    keys = [f"k{i}" for i in range(40)]
    train, val = training.holdout_split(keys, 0.1, seed=0)
    assert len(val) == 4 and sorted(train + val) == list(range(40))
    shuffled = keys[::-1]
    train2, val2 = training.holdout_split(shuffled, 0.1, seed=0)
    assert {shuffled[i] for i in val2} == {keys[i] for i in val}  # layout-independent
    assert training.holdout_split(keys, 0.1, seed=1)[1] != val
    assert training.holdout_split(keys[:3], 0.01, seed=0)[1] != []  # at least one held out
    assert training.holdout_split(keys, 0.0, seed=0) == (list(range(40)), [])
    with pytest.raises(OpdError, match="none to train on"):
        training.holdout_split(keys[:1], 0.5, seed=0)


def test_nested_subset_is_keyed_nested_and_leaves_the_validation_rows_alone():
    keys = [f"k{i}" for i in range(40)]
    train, val = training.holdout_split(keys, 0.1, seed=0)
    quarter, half = (training.nested_subset(keys, train, s, seed=0) for s in (0.25, 0.5))
    assert (len(quarter), len(half)) == (9, 18)  # of 36
    assert set(quarter) < set(half) < set(train) and not set(half) & set(val)
    assert training.nested_subset(keys, train, 1.0, seed=0) == train
    assert training.nested_subset(keys, train, 0.01, seed=0) != []  # at least one row
    shuffled = keys[::-1]
    train2, _ = training.holdout_split(shuffled, 0.1, seed=0)
    half2 = training.nested_subset(shuffled, train2, 0.5, seed=0)
    assert {shuffled[i] for i in half2} == {keys[i] for i in half}  # layout-independent
    assert training.nested_subset(keys, train, 0.5, seed=1) != half
    with pytest.raises(OpdError, match=r"training share must be in \(0, 1\]"):
        training.nested_subset(keys, train, 0.0, seed=0)


# -- schedule, optimizer -------------------------------------------------------------------


def test_warmup_cosine_shape():
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=1.0)
    s = training.WarmupCosine(opt, total_steps=20, warmup_steps=4, min_lr_ratio=0.1)
    lrs = []
    for _ in range(20):
        lrs.append(opt.param_groups[0]["lr"])
        s.step()
    assert lrs[:4] == pytest.approx([0.25, 0.5, 0.75, 1.0])  # linear warm-up, never 0
    assert all(a >= b for a, b in zip(lrs[4:], lrs[5:], strict=False))  # cosine: non-increasing
    assert lrs[4] == pytest.approx(1.0) and lrs[-1] == pytest.approx(0.1)  # peak -> min at the end
    mid = 4 + (20 - 1 - 4) / 2
    assert s.factor(int(mid)) == pytest.approx(
        0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (int(mid) - 4) / 15))
    )
    with pytest.raises(OpdError):
        training.WarmupCosine(opt, total_steps=5, warmup_steps=5, min_lr_ratio=0.1)


def test_adamw_decays_matrices_only():
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.LayerNorm(3))
    model[1].weight.requires_grad_(False)
    opt = training.adamw(model, lr=1e-3, weight_decay=0.1)
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.1 and [p.shape for p in decay["params"]] == [(3, 3)]
    assert (
        no_decay["weight_decay"] == 0.0 and len(no_decay["params"]) == 2
    )  # biases; frozen weight left out


# -- checkpoints ---------------------------------------------------------------------------


def _setup(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 1))
    opt = training.adamw(model, lr=1e-2, weight_decay=0.01)
    sched = training.WarmupCosine(opt, total_steps=10, warmup_steps=2, min_lr_ratio=0.0)
    return model, opt, sched


def _train(model, opt, sched, steps: int) -> None:
    for _ in range(steps):
        x = torch.randn(5, 4)  # consumes the global RNG: restored RNG must give the same draws
        loss = (model(x) - x.sum(-1, keepdim=True)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        sched.step()


def test_checkpoint_resume_is_bit_exact(tmp_path):
    model, opt, sched = _setup()
    _train(model, opt, sched, 3)
    ck = training.Checkpointer(tmp_path / "ck", keep=2)
    ck.save(3, model=model.state_dict(), optimizer=opt, scheduler=sched, state={"pos": [0, 3]})
    draws = (torch.rand(3), random.random())
    _train(model, opt, sched, 4)
    expected = {k: v.clone() for k, v in model.state_dict().items()}

    model2, opt2, sched2 = _setup(seed=99)  # different init, fresh optimizer state
    torch.manual_seed(12345)  # and a different RNG position
    saved = ck.load(ck.latest(), optimizer=opt2, scheduler=sched2)
    model2.load_state_dict(saved.model)
    assert saved.step == 3 and saved.state == {"pos": [0, 3]}
    assert sched2.steps_done == 3 and sched2.lr == pytest.approx(1e-2 * sched2.factor(3))
    assert torch.equal(torch.rand(3), draws[0]) and random.random() == draws[1]  # RNG restored
    _train(model2, opt2, sched2, 4)
    for k, v in model2.state_dict().items():
        assert torch.equal(v, expected[k]), k
    assert sched2.state_dict() == sched.state_dict()


def test_checkpoint_files_keep_and_atomicity(tmp_path):
    model, opt, sched = _setup()
    _train(model, opt, sched, 1)
    ck = training.Checkpointer(tmp_path / "ck", keep=2)
    for step in (1, 2, 3):
        ck.save(step, model=model.state_dict(), optimizer=opt, scheduler=sched, state={})
    assert ck.latest() == 3
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["step-00000002", "step-00000003"]
    # safetensors + JSON only: the state parses as JSON, nothing is pickled
    files = sorted(p.name for p in ck.path(3).iterdir())
    assert files == ["checksums.json", "state.json", "tensors.safetensors"]
    doc = json.loads((ck.path(3) / "state.json").read_text())
    assert doc["step"] == 3 and doc["scheduler"]["steps_done"] == 1
    # a half-written checkpoint (killed before the rename) is invisible
    (tmp_path / "ck" / ".step-00000004.tmp-1").mkdir()
    assert ck.latest() == 3
    (ck.path(3) / "state.json").write_text("{")
    with pytest.raises(OpdError, match="step-00000003 is corrupted: state.json fails its sha256"):
        ck.load(3, optimizer=opt, scheduler=sched)
    (ck.path(3) / "checksums.json").unlink()
    with pytest.raises(OpdError, match="step-00000003 is unreadable"):
        ck.load(3, optimizer=opt, scheduler=sched)


def flip_tensor_byte(path: Path, tensor: str) -> None:
    """Flip one byte inside `tensor`'s data in a safetensors file (the file stays parseable)."""
    data = bytearray(path.read_bytes())
    header_len = int.from_bytes(data[:8], "little")
    start, end = json.loads(data[8 : 8 + header_len])[tensor]["data_offsets"]
    data[8 + header_len + (start + end) // 2] ^= 0x10
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("part", ["tensors", "state"])
def test_a_corrupted_checkpoint_is_set_aside_and_the_one_before_used(tmp_path, caplog, part):
    model, opt, sched = _setup()
    ck = training.Checkpointer(tmp_path / "ck", keep=2)
    for step in (1, 2):
        _train(model, opt, sched, 1)
        ck.save(step, model=model.state_dict(), optimizer=opt, scheduler=sched, state={"s": step})
    if part == "tensors":
        flip_tensor_byte(ck.path(2) / "tensors.safetensors", "model/0.weight")
    else:  # still valid JSON, another value
        state = ck.path(2) / "state.json"
        state.write_text(state.read_text().replace('"s": 2', '"s": 3'))
    with caplog.at_level("WARNING", logger="opd"):
        assert ck.latest() == 1
    assert (
        "step-00000002 is corrupted" in caplog.text and "using the checkpoint before" in caplog.text
    )
    assert [p.name for p in (tmp_path / "ck").iterdir() if p.name.startswith(".")] == [
        f".step-00000002.corrupt-{os.getpid()}"
    ]
    saved = ck.load(1, optimizer=opt, scheduler=sched)
    assert saved.state == {"s": 1}
    # the good checkpoint is not rotated out by the next saves
    ck.save(2, model=model.state_dict(), optimizer=opt, scheduler=sched, state={"s": 2})
    assert ck.latest() == 2 and ck._steps() == [1, 2]
    flip_tensor_byte(ck.path(1) / "tensors.safetensors", "model/0.weight")
    flip_tensor_byte(ck.path(2) / "tensors.safetensors", "model/0.weight")
    assert ck.latest() is None  # nothing good left: a fresh start


def test_a_full_disk_during_a_checkpoint_is_one_error_and_keeps_the_earlier_ones(
    tmp_path, monkeypatch
):
    model, opt, sched = _setup()
    ck = training.Checkpointer(tmp_path / "ck", keep=2)
    ck.save(1, model=model.state_dict(), optimizer=opt, scheduler=sched, state={})

    def full(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(
        OpdError,
        match=r"disk full while writing checkpoint .*step-00000002; earlier checkpoints are kept "
        r"and a re-run resumes from the newest: free space",
    ):
        ck.save(2, model=model.state_dict(), optimizer=opt, scheduler=sched, state={})
    monkeypatch.undo()
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["step-00000001"]
    assert ck.latest() == 1


# -- distributed ---------------------------------------------------------------------------


def test_world_size_without_torch_distributed_is_refused():
    assert training.resolve_ranks(0, 1) == (0, 1)
    with pytest.raises(OpdError, match="torchrun"):
        training.resolve_ranks(1, 2)
    model = torch.nn.Linear(2, 2)
    assert training.wrap_ddp(model) is model


_DDP_WORKER = r"""
import os, sys, json, torch, torch.distributed as dist
sys.path.insert(0, sys.argv[1])
from pipeline.core import training
from storage import OpdError
rank, ws = int(sys.argv[2]), 2
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + sys.argv[3], rank=rank, world_size=ws)
assert training.resolve_ranks(rank, ws) == (rank, ws)
try:  # a stage told it runs alone while the process group says otherwise must refuse
    training.resolve_ranks(0, 1)
    raise SystemExit("rank 0 of 1 was accepted inside a 2-rank process group")
except OpdError:
    pass
torch.manual_seed(rank)  # DDP must broadcast rank 0's initial weights
model = torch.nn.Linear(3, 1)
ddp = training.wrap_ddp(model)
assert ddp is not model
opt = torch.optim.SGD(model.parameters(), lr=0.1)
x = torch.arange(12.0).view(4, 3)[rank::2]
ddp(x).pow(2).mean().backward()
opt.step()
total = training.all_reduce_sum(torch.tensor([float(rank + 1)]))
with open(sys.argv[4], "w") as f:
    json.dump({"w": model.weight.tolist(), "b": model.bias.tolist(), "sum": total.item()}, f)
# A gloo worker could abort after its work was done ("terminate called without an active
# exception", exit -6): 3 of 15 runs with neither line below, 1 of 28 with the barrier only,
# 0 of 20 with both. The barrier lets both ranks finish the last collective before either tears
# the group down; os._exit skips the interpreter's finalization, where the abort seems to come
# from (not diagnosed further). What the test checks is written and closed before.
dist.barrier()
dist.destroy_process_group()
os._exit(0)
"""


def test_ddp_helpers_average_gradients_over_two_gloo_ranks(tmp_path):
    import subprocess

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    script = tmp_path / "worker.py"
    script.write_text(_DDP_WORKER)
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(REPO), str(r), port, str(tmp_path / f"r{r}.json")],
            env=env,
        )
        for r in range(2)
    ]
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    out = [json.loads((tmp_path / f"r{r}.json").read_text()) for r in range(2)]
    assert out[0] == out[1] and out[0]["sum"] == 3.0
    # reference: rank 0's init, the mean of the two ranks' gradients (= the full-batch gradient)
    torch.manual_seed(0)
    ref = torch.nn.Linear(3, 1)
    x = torch.arange(12.0).view(4, 3)
    loss = (ref(x[0::2]).pow(2).mean() + ref(x[1::2]).pow(2).mean()) / 2
    loss.backward()
    with torch.no_grad():
        for p in ref.parameters():
            p -= 0.1 * p.grad
    assert torch.allclose(torch.tensor(out[0]["w"]), ref.weight, atol=1e-6)
    assert torch.allclose(torch.tensor(out[0]["b"]), ref.bias, atol=1e-6)
