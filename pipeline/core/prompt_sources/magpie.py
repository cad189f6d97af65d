"""Magpie: user turns sampled from the target given its chat template up to a user message."""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

from models import vllm_engine
from models.tiny_target.tokenizer import CHAT_TEMPLATE
from pipeline.core.prompt_sources.chat_files import _bucket_split, _chat_row, _row
from pipeline.core.prompt_sources.common import Row
from pipeline.core.targets import resolve_backend

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from pipeline.core.prompt_sources.config import PromptsConfig


_USER_SLOT = "\u2063OPD-USER-TURN\u2063"  # text no template or user writes


def user_prefix(tokenizer: PreTrainedTokenizerBase, system: str = "") -> str:
    """The chat template's text up to where a (first) user message's content begins, after
    `system` as the system message (empty: the template's default)."""
    template = tokenizer.chat_template or CHAT_TEMPLATE
    messages = [{"role": "user", "content": _USER_SLOT}]
    if system:
        messages.insert(0, {"role": "system", "content": system})
    text = tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False)
    return text[: text.index(_USER_SLOT)]


def _usable_request(text: str) -> bool:
    # Sampled requests are sometimes a fragment or a run of symbols: keep sentences.
    words = text.split()
    letters = sum(c.isalpha() for c in text)
    return len(words) >= 4 and letters >= 0.6 * len(text.replace(" ", ""))


def magpie_engine(cfg: PromptsConfig, ctx) -> str | None:
    """`hf` or `vllm`: what `magpie.backend` resolves to (None when nothing is sampled)."""
    return None if cfg.magpie is None else resolve_backend(cfg.magpie.backend, ctx.target_loader)


def magpie_rows(
    cfg: PromptsConfig,
    tokenizer: PreTrainedTokenizerBase,
    target,
    progress: bool,
    engine: vllm_engine.EngineSpec | None = None,
) -> tuple[list[Row], Counter]:
    """Distinct user requests the target writes after its template's user prefix, as chat rows.

    Draws are seeded from `cfg.seed` and their index (vLLM: a seed per draw; HF: a generator per
    batch), never with one seed for all: identical prompts with one seed are one draw repeated."""
    from tqdm import tqdm

    from models.decoding import target_generate

    m = cfg.magpie
    prefixes = [
        tokenizer(user_prefix(tokenizer, system), add_special_tokens=False)["input_ids"]
        for system in m.systems or [""]
    ]
    skipped: Counter = Counter()
    seen: set[str] = set()
    rows: list[Row] = []
    with tqdm(total=m.rows, desc="magpie user turns", unit="row", disable=not progress) as bar:
        for batch in range((m.max_draws + m.batch_size - 1) // m.batch_size):
            n = min(m.batch_size, m.max_draws - batch * m.batch_size)
            first = cfg.seed * 1_000_003 + batch * m.batch_size
            prefix_ids = prefixes[batch % len(prefixes)]
            if engine is not None:  # one seed per draw: distinct samples of one prompt
                drawn = vllm_engine.generate(
                    engine,
                    [prefix_ids] * n,
                    max_new_tokens=m.max_new_tokens,
                    temperature=m.temperature,
                    seeds=range(first, first + n),
                    stop_ids=target.eos_token_ids,
                )
            else:  # one generator for the batch: seeding each row alike would repeat one draw
                out = target_generate(
                    target, [prefix_ids] * n, m.max_new_tokens, m.temperature, first
                )
                drawn = zip(out.sequences, out.finish_reasons, strict=True)
            for ids, reason in drawn:
                text = tokenizer.decode(ids, skip_special_tokens=True).strip()
                if reason != "eos":
                    skipped["magpie_unfinished"] += 1
                elif not _usable_request(text):
                    skipped["magpie_garbled"] += 1
                elif text in seen:
                    skipped["duplicate"] += 1
                else:
                    seen.add(text)
                    result = _chat_row([{"role": "user", "content": text}], tokenizer, cfg)
                    if isinstance(result, str):
                        skipped[result] += 1
                        continue
                    prompt_ids, reference_ids, mask, prompt_text = result
                    where = f"magpie:{len(rows)}"
                    split = _bucket_split(prompt_text, cfg)
                    rows.append(
                        _row(where, split, "magpie", prompt_ids, prompt_text, reference_ids, mask)
                    )
                    bar.update(1)
                if len(rows) >= m.rows:
                    return rows, skipped
    if not rows:
        raise ValueError(
            f"magpie: none of {m.max_draws} sampled user turns passed the filter "
            f"({dict(skipped)}); raise prompts.magpie.max_new_tokens or max_draws"
        )
    return rows, skipped
