"""User files (JSONL / Parquet: `text`, chat `messages`, ShareGPT `conversations`, EAGLE's
`turns`) and records of any source turned into prompt rows."""

from __future__ import annotations

import codecs
import hashlib
import json
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING

import pyarrow as pa
import pyarrow.parquet as pq

from models.tiny_target.tokenizer import CHAT_TEMPLATE
from pipeline.core.prompt_sources.common import (
    ROLES,
    SPLITS,
    Row,
    _finish,
    _prompt_id,
    _require_fast,
    _split_ids,
)
from pipeline.core.prompt_sources.hf_datasets import HfSource, _read_hf_rows

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from pipeline.core.prompt_sources.config import PromptsConfig


def _read_user_rows(path: Path, skipped: Counter) -> list[tuple[str, dict]]:
    """(location, record) per row; undecodable rows are counted, a malformed file is an error."""
    if not path.is_file():
        raise FileNotFoundError(f"prompt source {path} does not exist")
    if path.suffix == ".jsonl":
        out = []
        # A byte-order mark (Windows editors write one) is not part of the first row.
        data = path.read_bytes().removeprefix(codecs.BOM_UTF8)
        for n, raw in enumerate(data.splitlines(), start=1):
            if not raw.strip():
                skipped["empty"] += 1
                continue
            try:
                record = json.loads(raw.decode("utf-8"))
            except UnicodeDecodeError:
                skipped["not_utf8"] += 1
                continue
            except (json.JSONDecodeError, RecursionError):  # the decoder recurses per level
                skipped["bad_json"] += 1
                continue
            if not isinstance(record, dict):
                skipped["bad_json"] += 1
                continue
            try:  # a "\ud800" escape parses to a lone surrogate, which no tokenizer can encode
                json.dumps(record, ensure_ascii=False).encode("utf-8")
            except UnicodeEncodeError:
                skipped["not_utf8"] += 1
                continue
            out.append((f"{path.name}:{n}", record))
        return out
    if path.suffix == ".parquet":
        try:
            table = pq.read_table(path)
        except (pa.ArrowInvalid, OSError) as e:
            raise ValueError(f"{path} is not a readable Parquet file: {e}") from e
        if not {"text", "messages", "conversations"} & set(table.column_names):
            raise ValueError(
                f"{path} has columns {table.column_names}; a prompt source needs a `text` "
                "column (raw completion) or a `messages` or `conversations` column (chat)"
            )
        return [(f"{path.name}:{n}", record) for n, record in enumerate(table.to_pylist())]
    raise ValueError(f"prompt source {path} must end in .jsonl or .parquet")


_SHAREGPT_ROLES = {"human": "user", "gpt": "assistant", "system": "system"}


def _sharegpt_messages(conversations) -> list[dict] | None:
    """ShareGPT turns as role/content messages; None if a turn is not {"from", "value"} with a
    known speaker."""
    if not isinstance(conversations, list):
        return None
    out = []
    for turn in conversations:
        # a list or dict speaker cannot be looked up (unhashable): a bad row, not a traceback
        speaker = turn.get("from") if isinstance(turn, dict) else None
        if not isinstance(speaker, str) or speaker not in _SHAREGPT_ROLES:
            return None
        out.append({"role": _SHAREGPT_ROLES[speaker], "content": turn.get("value")})
    return out


def _valid_messages(messages) -> bool:
    return (
        isinstance(messages, list)
        and len(messages) > 0
        and all(
            isinstance(m, dict)
            and isinstance(m.get("role"), str)  # a list or dict role is unhashable
            and m["role"] in ROLES
            and isinstance(m.get("content"), str)
            and m["content"].strip()
            for m in messages
        )
        # The text before an assistant turn is rendered alone; before a first turn it is an
        # empty conversation, which chat templates refuse.
        and messages[0]["role"] != "assistant"
    )


def _chat_row(
    messages: list[dict], tokenizer: PreTrainedTokenizerBase, cfg: PromptsConfig
) -> tuple[list[int], list[int], list[int], str] | str:
    """(prompt_ids, reference_ids, loss_mask, prompt_text), or the reason the row is skipped."""
    template = tokenizer.chat_template or CHAT_TEMPLATE

    def render(msgs: list[dict], generation_prompt: bool) -> str:
        return tokenizer.apply_chat_template(
            msgs, chat_template=template, tokenize=False, add_generation_prompt=generation_prompt
        )

    final_is_answer = messages[-1]["role"] == "assistant"
    full = render(messages, generation_prompt=not final_is_answer)
    prompt_text = render(messages[:-1], True) if final_is_answer else full
    # Assistant spans from prefix renders; a template whose renders are not prefixes of one
    # another (e.g. one that rewrites earlier turns) cannot give a faithful mask.
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        start, end = render(messages[:i], True), render(messages[: i + 1], False)
        if not (full.startswith(end) and end.startswith(start)):
            return "template_not_prefix"
        spans.append((len(start), len(end.rstrip())))
    if not full.startswith(prompt_text):
        return "template_not_prefix"
    if final_is_answer:  # the reference is the answer; template text after it is not
        full = full[: spans[-1][1]]
    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True, verbose=False)
    prompt_ids, reference_ids = _split_ids(
        enc["input_ids"], enc["offset_mapping"], len(prompt_text), cfg.max_reference_tokens
    )
    offsets = enc["offset_mapping"][: len(prompt_ids) + len(reference_ids)]
    if len(prompt_ids) > cfg.max_prompt_tokens:
        return "too_long"
    mask = [int(any(s <= a and b <= e for s, e in spans) and b > a) for a, b in offsets]
    return prompt_ids, reference_ids, mask, tokenizer.decode(prompt_ids)


def user_rows(
    source: Path | HfSource, tokenizer: PreTrainedTokenizerBase, cfg: PromptsConfig
) -> tuple[list[Row], dict[str, int]]:
    """Rows from a user JSONL/Parquet file or a `datasets` split of `text`, `messages`,
    `conversations` or `turns` records."""
    _require_fast(tokenizer)
    skipped: Counter = Counter()
    if isinstance(source, HfSource):
        records, path = _read_hf_rows(source), source.text
    else:
        records, path = _read_user_rows(Path(source), skipped), source
    return _finish(_record_rows(records, path, tokenizer, cfg, skipped), skipped, cfg)


def _bucket_split(prompt_text: str, cfg: PromptsConfig) -> str:
    """A row's split from its text alone, for rows that name none: stable as a file grows."""
    bucket = int(hashlib.sha256(prompt_text.encode()).hexdigest()[:8], 16) % 1000
    return "heldout" if bucket < cfg.heldout_per_mille else "train"


def _row(
    where: str,
    split: str,
    kind: str,
    prompt_ids: list[int],
    prompt_text: str,
    reference_ids: list[int],
    mask: list[int],
) -> Row:
    return {
        "prompt_id": _prompt_id(prompt_text, reference_ids),
        "split": split,
        "source": where,
        "kind": kind,
        "prompt_ids": prompt_ids,
        "prompt_text": prompt_text,
        "reference_ids": reference_ids,
        "loss_mask": mask,
    }


def _record_rows(
    records: list[tuple[str, dict]],
    path: object,
    tokenizer: PreTrainedTokenizerBase,
    cfg: PromptsConfig,
    skipped: Counter,
) -> list[Row]:
    """One row per usable record (location, record); the others counted in `skipped`."""
    if records and not any(
        r.keys() & {"text", "messages", "conversations", "turns"} for _, r in records
    ):
        raise ValueError(
            f"no row of {path} has a `text`, `messages`, `conversations` or `turns` field; write one JSON "
            'object per line with "text": "..." (raw completion) or "messages": [{"role": ..., '
            '"content": ...}]'
        )
    rows = []
    for where, record in records:
        text, messages = record.get("text"), record.get("messages")
        if text is None and messages is None and record.get("turns") is not None:
            turns = record["turns"]
            if not isinstance(turns, list) or not turns:
                skipped["bad_messages"] += 1
                continue
            messages = [{"role": "user", "content": turns[0]}]
        if text is None and messages is None and record.get("conversations") is not None:
            messages = _sharegpt_messages(record["conversations"])
            if messages is None:
                skipped["bad_messages"] += 1
                continue
        if text is None and messages is None:
            skipped["missing_field"] += 1
            continue
        if isinstance(text, bytes):  # a binary Parquet column
            try:
                text = text.decode("utf-8")
            except UnicodeDecodeError:
                skipped["not_utf8"] += 1
                continue
        if text is not None and not isinstance(text, str):
            skipped["bad_text"] += 1
            continue
        if (text is not None and not text.strip()) or messages == []:
            skipped["empty"] += 1
            continue
        if text is None and not _valid_messages(messages):
            skipped["bad_messages"] += 1
            continue
        # The size of what is tokenized; a message's other fields (a Parquet datetime, say) are
        # not, and need not be JSON
        size = len(text) if text is not None else sum(len(m["content"]) for m in messages)
        if size > cfg.max_chars:
            skipped["too_long"] += 1
            continue
        if text is not None:
            prompt_ids = tokenizer(text, verbose=False)["input_ids"]
            if len(prompt_ids) > cfg.max_prompt_tokens:
                skipped["too_long"] += 1
                continue
            kind, reference_ids, mask, prompt_text = "user_text", [], [0] * len(prompt_ids), text
        else:
            result = _chat_row(messages, tokenizer, cfg)
            if isinstance(result, str):
                skipped[result] += 1
                continue
            kind, (prompt_ids, reference_ids, mask, prompt_text) = "user_chat", result
        split = record.get("split")
        if split is None:
            split = _bucket_split(prompt_text, cfg)
        elif split not in SPLITS:
            skipped["bad_split"] += 1
            continue
        rows.append(_row(where, split, kind, prompt_ids, prompt_text, reference_ids, mask))
    if not rows:
        reasons = ", ".join(f"{k}: {v}" for k, v in sorted(skipped.items())) or "no rows"
        raise ValueError(f"{path} has no usable prompt rows ({reasons})")
    return rows
