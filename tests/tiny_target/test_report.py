import json

import numpy as np
import pytest
from click.testing import CliRunner

from models.tiny_target.report import (
    build_report,
    document_windows,
    main,
    unigram_log_probs,
    unigram_loss,
)


def test_windows_predict_every_token_of_every_document_once():
    bos = 0
    ids = np.array([0, 5, 6, 7, 8, 9, 1, 0, 4, 1, 0, 3, 3, 3, 1], dtype=np.uint16)
    windows = document_windows(ids, bos, window=3)
    assert [w.tolist() for w in windows] == [
        [0, 5, 6, 7],
        [7, 8, 9, 1],
        [0, 4, 1],
        [0, 3, 3, 3],
        [3, 1],
    ]
    assert sum(len(w) - 1 for w in windows) == len(ids) - 3  # every id but the 3 BOS


def test_unigram_is_add_one_smoothed():
    lp = unigram_log_probs(np.array([2, 2, 2, 1], dtype=np.uint16), vocab_size=4)
    assert np.exp(lp).sum() == pytest.approx(1.0)
    assert np.exp(lp).tolist() == pytest.approx([1 / 8, 2 / 8, 4 / 8, 1 / 8])
    nats, n = unigram_loss(lp, [np.array([0, 2, 3])])
    assert n == 2 and nats == pytest.approx(-np.log(4 / 8) - np.log(1 / 8))


def test_report_on_a_trained_target(tiny_target):
    out, _, _ = tiny_target
    result = CliRunner().invoke(main, [str(out)])
    assert result.exit_code == 0, result.output
    report = json.loads((out / "quality.json").read_text())
    for split in ("validation", "heldout"):
        s = report["splits"][split]
        assert s["tokens"] > 0
        assert s["ratio"] == pytest.approx(s["model_loss"] / s["unigram_loss"], abs=2e-3)
    assert report["samples"] and all(s["prompt"].startswith("def ") for s in report["samples"])
    assert "Held-out loss" in (out / "README.md").read_text()


def test_report_refuses_a_different_corpus(tiny_corpus, tiny_target, tmp_path):
    out, _, _ = tiny_target
    meta = json.loads((out / "opd_target.json").read_text())
    meta["corpus"]["splits"]["heldout"]["content_sha256"] = "0" * 64
    bad = tmp_path / "model"
    bad.mkdir()
    for f in out.iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    (bad / "opd_target.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="differs from the one the model was trained on"):
        build_report(bad)
