"""`opd see`'s table: in bf16, outputs that part from plain decoding come with the reason."""

from pipeline.core.quicklook import BF16_NOTE, Tally, table


def _tallies(identical: int) -> dict[str, Tally]:
    plain = Tally(seconds=1.0, tokens=10, prompts=2)
    drafter = Tally(seconds=0.5, tokens=10, identical=identical, prompts=2)
    drafter.accepted = {"gsm8k": [1, 0]}
    return {"plain": plain, "drafter": drafter}


def test_a_bf16_table_explains_outputs_that_part_from_plain_decoding():
    labels = {"plain": "plain decoding", "drafter": "EAGLE-3 K=1"}
    parted = table(_tallies(1), labels, ["gsm8k"], "bfloat16")
    assert parted[-1] == BF16_NOTE and "1/2" in parted[-2]
    assert BF16_NOTE not in table(_tallies(2), labels, ["gsm8k"], "bfloat16")
    assert BF16_NOTE not in table(_tallies(1), labels, ["gsm8k"], "float32")
