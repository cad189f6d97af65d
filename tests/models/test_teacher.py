"""The blocked teacher (`models.teacher`) against the plain [.., V] logits it replaces."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from models import teacher as teacher_module
from models.losses import teacher_draft_probs
from models.teacher import ArgmaxCache, teacher_logits
from models.vocab import DraftVocab


@pytest.fixture
def setup():
    torch.manual_seed(0)
    vocab, width = 1000, 32
    head = torch.randn(vocab, width)
    hidden = torch.randn(3, 5, width) * 2  # [B, T, H]
    draft = DraftVocab.from_counts(torch.randint(0, 50, (vocab,)), 200)
    return head, hidden, draft


@pytest.mark.parametrize("block_elements", [1 << 26, 15 * 64, 15 * 7])  # 1, 16 and 143 blocks
def test_every_view_training_reads_equals_the_full_logits(setup, block_elements):
    head, hidden, draft = setup
    full = F.linear(hidden, head)  # [B, T, V]
    teacher = teacher_logits(
        hidden, head, draft.draft_to_target_ids, [0.7], block_elements=block_elements
    )
    assert teacher.shape == full.shape and torch.equal(teacher.argmax(-1), full.argmax(-1))
    for temperature in (0.0, 0.7, 1.0):
        for renormalize in (True, False):
            want = teacher_draft_probs(full, draft, temperature, renormalize=renormalize)
            got = teacher_draft_probs(teacher, draft, temperature, renormalize=renormalize)
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    if (
        block_elements == 1 << 26
    ):  # one block: the training teacher is the plain head's, bit for bit
        assert torch.equal(
            teacher_draft_probs(teacher, draft, 0.7), teacher_draft_probs(full, draft, 0.7)
        )


def test_the_argmax_outside_the_draft_vocab_gives_a_zero_greedy_mass(setup):
    head, hidden, draft = setup
    teacher = teacher_logits(hidden, head, draft.draft_to_target_ids)
    outside = draft.to_draft(teacher.top) < 0
    greedy = teacher_draft_probs(teacher, draft, 0.0, renormalize=False)
    assert torch.equal(greedy.sum(-1), (~outside).float())


def test_a_temperature_not_computed_is_refused(setup):
    head, hidden, draft = setup
    teacher = teacher_logits(hidden, head, draft.draft_to_target_ids)
    with pytest.raises(ValueError, match="temperatures \\[1.0\\], not 0.5"):
        teacher_draft_probs(teacher, draft, 0.5, renormalize=False)


def test_the_argmax_cache_gives_what_training_reads_and_runs_the_full_head_once_a_row(
    setup, monkeypatch
):
    head, hidden, draft = setup
    full_head_rows = []
    blocked = teacher_module.teacher_logits

    def counted(h, *args, **kwargs):
        full_head_rows.append(h.shape[0])
        return blocked(h, *args, **kwargs)

    monkeypatch.setattr(teacher_module, "teacher_logits", counted)
    cache = ArgmaxCache(head, draft.draft_to_target_ids)
    lengths = torch.tensor([5, 3, 4])
    # right-padded like a PaddedBatch: zeros past each length
    padded = hidden * (torch.arange(5) < lengths[:, None])[..., None]
    rows = torch.tensor([7, 2, 9])
    want = F.linear(padded, head)  # [B, T, V]
    for order in ([0, 1, 2], [2, 0]):  # a second epoch, other batches: nothing recomputed
        got = cache.teacher(padded[order], rows[order], lengths[order])
        for i, b in enumerate(order):
            n = int(lengths[b])
            assert torch.equal(got.argmax(-1)[i, :n], want[b, :n].argmax(-1))
        for temperature in (0.0, 0.7):
            torch.testing.assert_close(
                teacher_draft_probs(got, draft, temperature),
                teacher_draft_probs(want[order], draft, temperature),
                atol=1e-5,
                rtol=1e-5,
            )
    assert full_head_rows == [3] and len(cache) == 3
    with pytest.raises(ValueError, match="row 2 was read with 3 tokens and now with 4"):
        cache.teacher(padded[[1]], rows[[1]], torch.tensor([4]))
    with pytest.raises(ValueError, match="temperatures \\[\\], not 1.0"):
        teacher_draft_probs(got, draft, 1.0, renormalize=False)  # the full law is not kept


@pytest.mark.parametrize("vocab", ["pruned", "full"])
def test_draft_logits_are_the_draft_rows_of_the_head(setup, vocab: str):
    """A full draft vocabulary (MTP's) reads the head itself, a pruned one its draft rows."""
    head, hidden, draft = setup
    if vocab == "full":
        draft = DraftVocab.full(head.shape[0])
    got = teacher_module.draft_logits(hidden, head, draft.draft_to_target_ids)
    want = F.linear(hidden, head)[..., draft.draft_to_target_ids]
    assert got.shape == (*hidden.shape[:-1], draft.draft_vocab_size)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
