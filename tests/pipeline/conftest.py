"""Shared fixtures for stage tests: a store with a tiny prompts dataset and a random target."""

import hashlib

import pyarrow as pa
import pytest

from pipeline.core.runner import RunContext
from pipeline.core.targets import TargetLoader
from pipeline.profiles import load_config
from storage import Store

PROMPTS_SCHEMA = pa.schema(
    [
        ("prompt_id", pa.string()),
        ("split", pa.string()),
        ("prompt_ids", pa.list_(pa.int32())),
    ]
)


def write_prompts(store: Store, n_train: int = 12, n_heldout: int = 4, vocab: int = 500):
    rows = []
    for split, n in (("train", n_train), ("heldout", n_heldout)):
        for i in range(n):
            ids = [
                (7 * i + 3 * j + (split == "heldout")) % (vocab - 10) + 5 for j in range(4 + i % 5)
            ]
            pid = hashlib.sha256(str((split, ids)).encode()).hexdigest()[:16]
            rows.append({"prompt_id": pid, "split": split, "prompt_ids": ids})
    w = store.writer("prompts", stage="test-prompts", stage_version="1", config={"n": len(rows)})
    with w:
        w.write_parquet("part-00000.parquet", pa.Table.from_pylist(rows, schema=PROMPTS_SCHEMA))
        return w.commit()


@pytest.fixture
def tiny(tmp_path):
    """(store, ctx, cfg, prompts dataset) on the `tiny` profile."""
    store = Store(tmp_path / "data")
    cfg = load_config("tiny")
    ctx = RunContext(store=store, target_loader=TargetLoader(cfg.target), progress=False)
    return store, ctx, cfg, write_prompts(store)
