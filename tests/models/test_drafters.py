"""Drafter kinds: every checkpoint records its kind, and loading checks it."""

from __future__ import annotations

import json

import pytest
import torch

from models.drafter import Drafter, ServableDrafter, TrainableDrafter
from models.drafters import (
    CONFIG_FILE,
    KINDS,
    drafter_class,
    load_drafter,
    recorded_kind,
    save_drafter,
)
from models.vocab import DraftVocab


def _drafter(target) -> Drafter:
    counts = torch.arange(target.vocab_size, dtype=torch.float)
    torch.manual_seed(0)
    return drafter_class("eagle3").new(target, DraftVocab.from_counts(counts, 64), {})


def test_every_kind_describes_itself_and_implements_its_roles():
    for kind, spec in KINDS.items():
        cls = spec.drafter
        assert spec.name == kind and cls.spec is spec and issubclass(cls, Drafter)
        assert spec.settings().kind == kind  # its settings model is tagged with its name
        assert not getattr(cls, "__abstractmethods__", None), cls.__abstractmethods__
        # the built-in kinds train but the training-free baseline; a kind serves exactly
        # when it names export formats
        assert issubclass(cls, TrainableDrafter) != spec.baseline, kind
        servable = issubclass(cls, ServableDrafter)
        assert servable == bool(spec.export_formats) == bool(spec.serve_method), kind


def test_a_checkpoint_records_its_kind_and_loading_checks_it(tiny_llama, tmp_path):
    drafter = _drafter(tiny_llama)
    save_drafter(drafter, tmp_path)
    config = json.loads((tmp_path / CONFIG_FILE).read_text())
    assert config["kind"] == "eagle3" == recorded_kind(tmp_path)
    loaded = load_drafter(tmp_path, tiny_llama.embed_weight, kind="eagle3")
    assert type(loaded) is type(drafter) and loaded.config == drafter.config
    with pytest.raises(ValueError, match="holds a eagle3 drafter, not a dflash one"):
        load_drafter(tmp_path, tiny_llama.embed_weight, kind="dflash")

    # written before kinds existed: no "kind", and it is EAGLE-3
    del config["kind"]
    (tmp_path / CONFIG_FILE).write_text(json.dumps(config))
    assert recorded_kind(tmp_path) == "eagle3"
    assert load_drafter(tmp_path, tiny_llama.embed_weight).kind == "eagle3"

    (tmp_path / CONFIG_FILE).write_text(json.dumps(config | {"kind": "nosuchkind"}))
    with pytest.raises(ValueError, match="unknown drafter kind 'nosuchkind'; kinds: eagle3"):
        load_drafter(tmp_path, tiny_llama.embed_weight)


def test_rebuilt_and_untrained_keep_the_kind_and_config(tiny_llama):
    drafter = _drafter(tiny_llama)
    with torch.no_grad():
        drafter.fc.weight.add_(1.0)
    again = drafter.rebuilt(drafter.tensors(), "test")
    assert all(torch.equal(again.tensors()[k], v) for k, v in drafter.tensors().items())
    fresh = drafter.untrained()
    assert fresh.config == drafter.config and fresh.kind == drafter.kind
    assert not torch.equal(fresh.tensors()["fc.weight"], drafter.tensors()["fc.weight"])
