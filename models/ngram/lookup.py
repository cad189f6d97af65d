"""Prompt lookup: the drafts vLLM's `ngram` speculative method proposes, as a pure function.

The rule (read from vLLM 0.32's v1/spec_decode/ngram_proposer.py, which finds it with a
capped KMP over the reversed text): among the suffix n-grams of the text so far (prompt and
generated tokens, the last sampled one included) with `min_n <= n <= max_n`, take the longest
that also occurs earlier, ending before the last token; of its earlier occurrences take the
first; propose the tokens that followed it, at most k, fewer where the text ends sooner. No
match of at least `min_n` tokens proposes nothing.
"""

from __future__ import annotations

from collections.abc import Sequence


def lookup(text: Sequence[int], min_n: int, max_n: int, k: int) -> list[int]:
    """At most k tokens that followed the first earlier occurrence of the longest suffix n-gram
    of `text` (min_n <= n <= max_n); [] when none occurs or k < 1."""
    total = len(text)
    if k < 1:
        return []
    for n in range(min(max_n, total - 1), min_n - 1, -1):
        suffix = list(text[total - n :])
        # an occurrence starting at s ends at s + n - 1 <= total - 2: before the last token
        for start in range(total - n):
            if list(text[start : start + n]) == suffix:
                return list(text[start + n : start + n + k])
    return []
