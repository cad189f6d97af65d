"""Confidence-stopped chains (`ChainShape.stop_confidence`): the stop rule, its truncation of a
block's proposal in the loop, fewer drafter forwards, and losslessness (T=0 token for token,
T>0 in law)."""

from __future__ import annotations

import pytest
import torch

from models.decoding import SpecConfig, speculative_generate
from models.drafter import ChainShape, Proposal, confident_length
from models.target import Target
from tests.models.test_decoding import (
    LAW_PROMPT,
    MAX_NEW,
    chi_square,
    exact_joint,
    greedy_case,  # noqa: F401 (a module fixture)
    hf_greedy,
    law_case,  # noqa: F401 (a module fixture)
    random_prompts,
)


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_confident_length_joint_and_per_position():
    conf = torch.tensor([[0.9, 0.6, 0.8, 0.2], [0.4, 0.9, 0.9, 0.9], [1.0, 1.0, 1.0, 1.0]])
    # joint: 0.9, 0.54, 0.432 -> two; the second row's first node is already below
    assert confident_length(conf, 0.5).tolist() == [2, 0, 4]
    # per position (a block's marginals): up to the first position below
    assert confident_length(conf, 0.5, joint=False).tolist() == [3, 0, 4]
    assert confident_length(conf, 0.0).tolist() == [4, 4, 4]
    assert confident_length(conf[:, :0], 0.5).tolist() == [0, 0, 0]


class _BlockDrafter:
    """A block drafter stand-in: one forward proposes K random tokens whose per-position
    confidences follow `pattern`, read position by position (`joint_confidence=False`)."""

    def __init__(self, pattern: list[float], vocab: int) -> None:
        self.pattern, self.vocab, self.forwards = pattern, vocab, 0

    def check_target(self, target: Target) -> None:
        pass

    def proposer(self, shape, temperature, generator, timer):
        return self

    def keep_rows(self, rows) -> None:
        pass

    def propose(self, rows, budget) -> Proposal:
        self.forwards += 1
        batch, k = len(budget), len(self.pattern)
        gen = torch.Generator().manual_seed(self.forwards)
        return Proposal(
            tokens=torch.randint(0, self.vocab, (batch, k), generator=gen),
            q=torch.ones(batch, k),
            confidence=torch.tensor(self.pattern).expand(batch, -1),
            forwards=1,
            joint_confidence=False,
        )


def test_the_loop_truncates_a_block_at_its_first_unsure_position(tiny_llama: Target, monkeypatch):
    prompts = random_prompts(3, tiny_llama.vocab_size, seed=4)
    widths = []
    real = tiny_llama.forward

    def recording(ids, *args, **kwargs):
        widths.append(ids.shape[1])
        return real(ids, *args, **kwargs)

    monkeypatch.setattr(tiny_llama, "forward", recording)
    drafter = _BlockDrafter([0.9, 0.6, 0.8, 0.2, 0.9], tiny_llama.vocab_size)
    cfg = SpecConfig(ChainShape(5, stop_confidence=0.5), max_new_tokens=MAX_NEW, eos_token_ids=())
    result = speculative_generate(tiny_llama, drafter, prompts, cfg)
    monkeypatch.setattr(tiny_llama, "forward", real)
    assert result.sequences == hf_greedy(tiny_llama, prompts, MAX_NEW)
    # per position: 0.9, 0.6, 0.8 pass, 0.2 stops the block (its 0.9 after it never counts)
    assert set(result.records["offset"]) == {1, 2, 3}
    assert max(widths[1:]) == 1 + 3  # verify forwards: the root and three drafts, not five
    assert max(result.steps["drafted"]) == 3


def test_t0_output_is_plain_greedy_with_fewer_drafter_forwards(tiny_llama: Target, greedy_case):  # noqa: F811
    prompts, reference, fitted = greedy_case
    stats = {}
    for threshold in (0.0, 0.5):
        cfg = SpecConfig(
            ChainShape(4, stop_confidence=threshold), max_new_tokens=MAX_NEW, eos_token_ids=()
        )
        got, forwards, steps, accepted = [], 0, 0, 0
        for prompt in prompts:  # one row at a time: a batch drafts while any row goes on
            result = speculative_generate(tiny_llama, fitted, [prompt], cfg)
            got += result.sequences
            forwards += result.stats["drafter_forwards"]
            steps += result.stats["verify_steps"]
            accepted += sum(result.steps["accepted"])
        assert got == reference
        stats[threshold] = (forwards / steps, accepted)
    # stopping spent fewer drafter forwards per verify step, and drafts were still accepted
    assert stats[0.5][0] < stats[0.0][0] and stats[0.5][1] > 100


def test_t0_batched_rows_stop_on_their_own(tiny_llama: Target, greedy_case):  # noqa: F811
    prompts, reference, fitted = greedy_case
    cfg = SpecConfig(ChainShape(4, stop_confidence=0.5), max_new_tokens=MAX_NEW, eos_token_ids=())
    result = speculative_generate(tiny_llama, fitted, prompts, cfg)
    assert result.sequences == reference
    drafted = result.steps["drafted"]
    assert len(set(drafted)) > 2  # rows of one batch proposed different lengths


# thresholds that leave a mix of proposals of 0, 1 and 2 drafts (the drafter's confidence is
# about 0.23-0.38 per node at T=1, 0.26-0.49 at T=0.7)
@pytest.mark.parametrize(("temperature", "threshold"), [(1.0, 0.1), (1.0, 0.3), (0.7, 0.12)])
def test_sampling_law_equals_target_with_stopping(law_case, temperature, threshold):  # noqa: F811
    target, drafter = law_case
    cfg = SpecConfig(
        ChainShape(2, stop_confidence=threshold),
        temperature=temperature,
        max_new_tokens=4,
        seed=2,
        eos_token_ids=(),
    )
    result = speculative_generate(target, drafter, [LAW_PROMPT] * 20_000, cfg)
    stat, critical, tv = chi_square(result.sequences, exact_joint(target, LAW_PROMPT, temperature))
    assert stat < critical, (stat, critical, tv)
    drafted = result.steps["drafted"]
    assert len(set(drafted)) >= 2  # the rule really cut some proposals and kept others
    outcomes = result.records["outcome"]
    assert outcomes.count("accepted") > 1000 and outcomes.count("rejected") > 1000


def test_bad_threshold_is_refused_before_any_work(tiny_llama: Target, greedy_case):  # noqa: F811
    _, _, fitted = greedy_case
    for bad in (1.0, -0.1):
        with pytest.raises(ValueError, match=r"stop_confidence must lie in \[0, 1\)"):
            speculative_generate(
                tiny_llama, fitted, [[1, 2]], SpecConfig(ChainShape(3, stop_confidence=bad))
            )
