"""A tiny stand-in corpus (a few modules in every split) and a tiny target trained on it."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from models.tiny_target import corpus
from models.tiny_target.train import TrainConfig, train

MODULE_TEXT = textwrap.dedent(
    '''\
    import os
    import sys


    def {name}_path(base, *parts):
        """Join {name} parts onto base."""
        result = os.path.join(base, *parts)
        if not result:
            raise ValueError("empty path")
        return result


    class {cls}:
        """Hold a {name} value."""

        def __init__(self, value):
            self.value = value

        def double(self):
            """Twice the value."""
            return self.value * 2
    '''
)


def module_names(split: str, n: int) -> list[str]:
    """The first `n` names mod0, mod1, ... that the corpus hashes into `split`."""
    names, i = [], 0
    while len(names) < n:
        if corpus.split_of(f"mod{i}") == split:
            names.append(f"mod{i}")
        i += 1
    return names


def write_corpus(root: Path, per_split: dict[str, int]) -> dict[str, list[str]]:
    names = {s: module_names(s, n) for s, n in per_split.items()}
    for split_names in names.values():
        for name in split_names:
            text = MODULE_TEXT.format(name=name, cls=name.capitalize())
            (root / f"{name}.py").write_text(text)
    return names


def tiny_config(root: Path, **overrides) -> TrainConfig:
    fields = dict(
        corpus_root=str(root),
        vocab_size=300,
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_heads=2,
        num_kv_heads=2,
        max_position_embeddings=64,
        seq_len=32,
        batch_size=2,
        steps=3,
        warmup_steps=1,
        lr=1e-2,
        bf16=False,
        compile=False,
        threads=1,
        eval_every=100,
        eval_windows=2,
        checkpoint_every=100,
    )
    return TrainConfig(**(fields | overrides))


@pytest.fixture(scope="session")
def tiny_corpus(tmp_path_factory) -> tuple[Path, dict[str, list[str]]]:
    root = tmp_path_factory.mktemp("corpus")
    return root, write_corpus(root, {"train": 6, "validation": 2, "heldout": 2})


@pytest.fixture(scope="session")
def tiny_target(tiny_corpus, tmp_path_factory) -> tuple[Path, TrainConfig, dict]:
    """A 3-step target trained on the tiny corpus: (model dir, config, training record)."""
    root, _ = tiny_corpus
    out = tmp_path_factory.mktemp("model")
    cfg = tiny_config(root)
    record = train(cfg, out, tmp_path_factory.mktemp("work"))
    return out, cfg, record
