"""The `opd-pipeline` flow fanned out on a real local Dask cluster of 2 worker processes."""

import socket

import pytest

from flows.pipeline import opd_pipeline
from storage import OpdError, Store

pytestmark = pytest.mark.slow  # minutes: scheduled early by tests/conftest.py


def test_two_dask_workers_give_the_serial_flows_datasets(tmp_path):
    serial = opd_pipeline(profile="tiny", chain="sft-chain", root=str(tmp_path / "serial"))
    fanned = opd_pipeline(profile="tiny", chain="sft-chain", root=str(tmp_path / "dask"), workers=2)
    assert fanned == serial  # the same versions, step by step
    a, b = Store(tmp_path / "serial"), Store(tmp_path / "dask")
    for step, files in (("generate", 3), ("features", 3), ("evaluate", 2)):
        # written shard by shard by the two ranks (evaluate: each rank's prompts, merged)
        sums = [
            {s["path"]: s["sha256"] for s in st.open(serial[step]).manifest["shards"]}
            for st in (a, b)
        ]
        assert sums[0] == sums[1] and len(sums[0]) >= files
    assert b.open(serial["evaluate"]).meta["tau"] == a.open(serial["evaluate"]).meta["tau"]
    b.open(serial["sft"]).verify_all()  # trained by a torchrun launch of 2 processes


def test_a_dask_address_that_does_not_answer_is_one_error_and_writes_nothing(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    root = tmp_path / "data"
    with pytest.raises(OpdError, match=f"no Dask scheduler answers at tcp://127.0.0.1:{port}"):
        opd_pipeline(profile="tiny", root=str(root), dask_address=f"tcp://127.0.0.1:{port}")
    assert not root.exists()
    with pytest.raises(OpdError, match="workers must be >= 1"):
        opd_pipeline(profile="tiny", root=str(root), workers=0)
    assert not root.exists()
