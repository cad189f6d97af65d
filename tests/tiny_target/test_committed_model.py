"""The committed embedded target: loads offline with plain transformers and is a real LM of Python."""

import json
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from models.tiny_target import corpus

MODEL_DIR = Path(__file__).resolve().parents[2] / "models" / "tiny_target" / "model"

pytestmark = pytest.mark.skipif(
    not (MODEL_DIR / "model.safetensors").exists(), reason="the embedded target is not trained yet"
)


def test_loads_offline_and_continues_python():
    tok = AutoTokenizer.from_pretrained(MODEL_DIR, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(
        MODEL_DIR, dtype=torch.float32, local_files_only=True
    ).eval()
    cfg = model.config
    assert cfg.architectures == ["LlamaForCausalLM"]
    assert cfg.num_hidden_layers >= 6 and cfg.hidden_size >= 256
    assert cfg.max_position_embeddings >= 2048
    assert len(tok) == cfg.vocab_size
    prompt = "import os\n\n\ndef exists(path):\n    "
    ids = tok(prompt, return_tensors="pt")
    out = model.generate(**ids, max_new_tokens=8, do_sample=False)
    text = tok.decode(out[0, ids["input_ids"].shape[1] :])
    assert text.strip(), "greedy continuation is empty"
    probs = model(**ids).logits[0, -1].softmax(-1)
    assert probs.max() > 0.1, "the next-token distribution should be peaked on code"


def test_bf16_default_load_matches_fp32():
    tok = AutoTokenizer.from_pretrained(MODEL_DIR, local_files_only=True)
    ids = tok("class Stack:\n    def push(self, item):\n", return_tensors="pt")["input_ids"]
    bf16 = AutoModelForCausalLM.from_pretrained(MODEL_DIR, local_files_only=True)
    fp32 = AutoModelForCausalLM.from_pretrained(
        MODEL_DIR, dtype=torch.float32, local_files_only=True
    )
    with torch.no_grad():
        a, b = bf16(input_ids=ids).logits.float(), fp32(input_ids=ids).logits
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() > 0.9


def test_size_and_quality_report():
    total = sum(f.stat().st_size for f in MODEL_DIR.iterdir() if f.is_file())
    assert total <= 25 * 2**20, f"model dir is {total / 2**20:.1f} MiB"
    report = json.loads((MODEL_DIR / "quality.json").read_text())
    # Far below the unigram baseline on modules it never saw: a language model of Python.
    assert report["splits"]["heldout"]["ratio"] < 0.6
    assert report["splits"]["validation"]["ratio"] < 0.6


@pytest.mark.xfail(
    strict=True,
    reason="issue aim not met: the committed 24-min CPU run (1400 compiled steps, 5.7M tokens) "
    "reached a held-out ratio of 0.554; the 30-min budget on 2 cores bounds the tokens seen",
)
def test_heldout_loss_is_below_half_the_unigram_baseline():
    report = json.loads((MODEL_DIR / "quality.json").read_text())
    assert report["splits"]["heldout"]["ratio"] < 0.5


def test_recorded_split_matches_this_interpreter():
    meta = json.loads((MODEL_DIR / "opd_target.json").read_text())
    if meta["python_version"] != sys.version.split()[0]:
        pytest.skip(f"model trained on Python {meta['python_version']}")
    now = corpus.manifest(corpus.list_sources())
    for split, recorded in meta["corpus"]["splits"].items():
        assert now[split]["list_sha256"] == recorded["list_sha256"]
        assert now[split]["content_sha256"] == recorded["content_sha256"]
