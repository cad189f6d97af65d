"""Prompt lookup as a drafter kind: vLLM's n-gram rule (checked against vLLM's own function when
it is installed), lossless through the one loop (T=0 token for token against transformers'
greedy generate; T=1 in law, with a broken-verifier control), and its weightless checkpoint
and export."""

# ruff: noqa: F811 (the fixtures imported from test_decoding are parameters here)

from __future__ import annotations

import json
import random
import shlex

import pytest

import models.verify as verify
from models.decoding import SpecConfig, speculative_generate
from models.drafter import ChainShape, ExportTarget, TreeShape
from models.drafters import load_drafter, save_drafter
from models.export import read_export, round_trip_diff, write_export
from models.ngram import NgramSettings
from models.ngram.drafter import NgramDrafter
from models.ngram.lookup import lookup
from models.target import Target
from models.vocab import DraftVocab
from tests.models.test_decoding import (  # noqa: F401 (fixtures)
    MAX_NEW,
    _resample_from_p,
    chi_square,
    exact_joint,
    hf_greedy,
    law_case,
)

# ---------------------------------------------------------------------------- the rule


def test_lookup_takes_the_longest_suffix_ngram_first():
    text = [7, 1, 2, 9, 3, 1, 2, 8, 5, 3, 1, 2]
    # [3, 1, 2] occurs at 4 (a 3-gram) and [1, 2] earlier at 1: the longer one wins
    assert lookup(text, 2, 4, 3) == [8, 5, 3]
    assert lookup(text, 2, 2, 3) == [9, 3, 1]  # 2-grams only: the first occurrence, at 1


def test_lookup_takes_the_first_occurrence_and_stops_at_the_text_end():
    assert lookup([4, 5, 6, 4, 5, 7, 4, 5], 2, 3, 2) == [6, 4]
    assert lookup([1, 2, 3, 1, 2], 2, 3, 5) == [3, 1, 2]  # fewer than k: the text ends
    assert lookup([6, 6, 6, 6], 2, 3, 4) == [6]  # overlapping occurrences count


def test_lookup_proposes_nothing_below_min_or_for_the_suffix_itself():
    assert lookup([1, 2, 3, 4, 2], 2, 4, 3) == []  # [4, 2] never occurred; 1-grams too short
    assert lookup([1, 2, 3, 4, 2], 1, 4, 3) == [3, 4, 2]
    assert lookup([1, 2], 1, 4, 3) == []  # the only [2] is the last token itself
    assert lookup([1, 2, 1, 2], 2, 4, 0) == []


def test_lookup_is_vllms_rule():
    ngram = pytest.importorskip("vllm.v1.spec_decode.ngram_proposer", reason="vLLM not installed")
    import numpy as np

    rng = random.Random(0)
    for _ in range(300):
        alphabet, n = rng.randint(2, 6), rng.randint(1, 40)
        text = [rng.randrange(alphabet) for _ in range(n)]
        lo = rng.randint(1, 4)
        hi, k = rng.randint(lo, 5), rng.randint(1, 6)
        theirs = ngram._find_longest_matched_ngram_and_propose_tokens(
            np.array(text, dtype=np.int32), lo, hi, 10_000, k
        )
        assert lookup(text, lo, hi, k) == theirs.tolist(), (text, lo, hi, k)


# ---------------------------------------------------------------------------- decoding


def ngram(target: Target, **settings) -> NgramDrafter:
    return NgramDrafter.new(target, DraftVocab.full(target.vocab_size), settings).eval()


def repetitive_prompts(n: int, vocab: int, seed: int) -> list[list[int]]:
    """Prompts that repeat a random phrase, so the lookup finds matches in them."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        phrase = [rng.randrange(vocab) for _ in range(rng.randint(3, 6))]
        out.append([rng.randrange(vocab) for _ in range(rng.randint(0, 4))] + phrase * 2)
    return out


@pytest.mark.parametrize("batch", [1, 5])
def test_greedy_lookup_equals_hf_generate(tiny_llama: Target, batch: int):
    prompts = repetitive_prompts(10, tiny_llama.vocab_size, seed=0)
    reference = hf_greedy(tiny_llama, prompts, MAX_NEW)
    cfg = SpecConfig(ChainShape(4), temperature=0.0, max_new_tokens=MAX_NEW, eos_token_ids=())
    drafter = ngram(tiny_llama)
    got, steps, forwards = [], {"drafted": [], "accepted": []}, 0
    for i in range(0, len(prompts), batch):
        res = speculative_generate(tiny_llama, drafter, prompts[i : i + batch], cfg)
        got += res.sequences
        forwards += res.stats["drafter_forwards"]
        for key in steps:
            steps[key] += res.steps[key]
    assert got == reference and forwards == 0
    # both sides of the rule were under test: steps with no match, drafts accepted and rejected
    assert 0 in steps["drafted"] and sum(steps["accepted"]) > 10
    assert sum(steps["drafted"]) > sum(steps["accepted"])


# Every id of the law target occurs in the prompt, so a 1-gram lookup drafts after any first
# token: the second and third tokens are always decided by verifying point-mass drafts.
LOOKUP_LAW_PROMPT = [3, 0, 7, 1, 6, 2, 5, 4, 1, 5, 2]


def sample_lookup(target: Target, n: int, seed: int = 0):
    drafter = ngram(target, prompt_lookup_min=1, prompt_lookup_max=3)
    cfg = SpecConfig(ChainShape(2), temperature=1.0, max_new_tokens=4, seed=seed, eos_token_ids=())
    return speculative_generate(target, drafter, [LOOKUP_LAW_PROMPT] * n, cfg)


def test_lookup_at_t1_samples_the_target_law(law_case):
    target, _ = law_case
    result = sample_lookup(target, 20_000)
    joint = exact_joint(target, LOOKUP_LAW_PROMPT, 1.0)
    stat, critical, tv = chi_square(result.sequences, joint)
    assert stat < critical, (stat, critical, tv)
    outcomes = result.records["outcome"]
    assert outcomes.count("accepted") > 2000 and outcomes.count("rejected") > 2000


def test_the_lookup_law_test_catches_a_correction_sampled_from_p(law_case, monkeypatch):
    target, _ = law_case
    monkeypatch.setattr(verify, "correction", _resample_from_p)
    result = sample_lookup(target, 8_000)
    stat, critical, _ = chi_square(result.sequences, exact_joint(target, LOOKUP_LAW_PROMPT, 1.0))
    assert stat > critical


def test_a_lookup_drafts_no_trees(tiny_llama: Target):
    cfg = SpecConfig(TreeShape(2, 2, 4), max_new_tokens=4, eos_token_ids=())
    with pytest.raises(ValueError, match="unset drafting.tree"):
        speculative_generate(tiny_llama, ngram(tiny_llama), [[1, 2, 3]], cfg)


# ---------------------------------------------------------------------------- checkpoint, export


def test_a_lookup_saves_no_weights_and_loads_back(tiny_llama: Target, tmp_path):
    drafter = ngram(tiny_llama, prompt_lookup_min=1, prompt_lookup_max=3)
    save_drafter(drafter, tmp_path)
    back = load_drafter(tmp_path, tiny_llama.embed_weight)
    assert back.tensors() == {} and back.config == drafter.config
    assert NgramDrafter.settings_of(back.config.to_dict()) == {
        "prompt_lookup_min": 1,
        "prompt_lookup_max": 3,
    }


def test_the_export_is_vllms_ngram_config_and_reads_back(tiny_llama: Target, tmp_path):
    drafter = ngram(tiny_llama, prompt_lookup_max=5)
    serves = ExportTarget(tiny_llama.config, {"weights_sha256": "x"}, tiny_llama.embed_weight)
    out = write_export(drafter, "ngram", tmp_path / "export", serves, k=3)
    assert sorted(p.name for p in out.iterdir()) == ["config.json"]  # no weights
    spec = json.loads((out / "config.json").read_text())["speculative_config"]
    assert spec == {
        "method": "ngram",
        "num_speculative_tokens": 3,
        "prompt_lookup_min": 2,
        "prompt_lookup_max": 5,
    }
    assert drafter.speculative_config(out, 3) == spec
    serve = json.loads((out / "config.json").read_text())["serve"]
    assert serve.startswith("vllm serve ") and json.loads(shlex.split(serve)[-1]) == spec
    assert round_trip_diff(drafter, out, tiny_llama.embed_weight) == 0.0
    assert read_export(out, None).config == drafter.config


def test_an_edited_export_is_refused(tiny_llama: Target, tmp_path):
    serves = ExportTarget(tiny_llama.config, None, tiny_llama.embed_weight)
    out = write_export(ngram(tiny_llama), "ngram", tmp_path / "export", serves, k=3)
    config = json.loads((out / "config.json").read_text())
    config["speculative_config"]["prompt_lookup_max"] = 7
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="does not serve the recorded lookup"):
        read_export(out, None)


def test_a_range_whose_min_exceeds_its_max_is_refused():
    with pytest.raises(ValueError, match="prompt_lookup_min .3. exceeds"):
        NgramSettings(prompt_lookup_min=3, prompt_lookup_max=2)
    with pytest.raises(ValueError, match="exceeds"):
        NgramSettings(prompt_lookup_min=5)  # the default max is 4
