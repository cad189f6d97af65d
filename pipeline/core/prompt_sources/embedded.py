"""The embedded target's corpus as prompts: `def_body`, `class_body` and `file_continuation`
rows from the stdlib's modules, train and held-out modules apart."""

from __future__ import annotations

import ast
import random
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING

from models.tiny_target import corpus
from pipeline.core.prompt_sources.common import (
    _BATCH,
    SPLITS,
    Row,
    _prompt_id,
    _require_fast,
    _split_ids,
)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from pipeline.core.prompt_sources.config import PromptsConfig


def _import_block(tree: ast.Module, lines: list[str], max_lines: int) -> str:
    """The module's first few single-line top-level imports: the context a body most needs."""
    picked = [
        lines[node.lineno - 1]
        for node in tree.body
        if isinstance(node, ast.Import | ast.ImportFrom) and node.lineno == node.end_lineno
    ][:max_lines]
    return "".join(picked) + "\n" if picked else ""


def _definitions(tree: ast.Module):
    """(definition, enclosing class or None) for top-level defs/classes and their methods."""
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            yield node, None
        if isinstance(node, ast.ClassDef):
            for child in node.body:
                if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                    yield child, node


def _first_line(node: ast.AST) -> int:
    decorators = getattr(node, "decorator_list", [])
    return min([node.lineno] + [d.lineno for d in decorators])


def _source_candidates(text: str, cfg: PromptsConfig) -> list[tuple[str, str, str]]:
    """(kind, prompt text, reference text) candidates of one source file."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return []
    lines = text.splitlines(keepends=True)
    imports = _import_block(tree, lines, cfg.max_import_lines)
    out = []
    for node, owner in _definitions(tree):
        if not ast.get_docstring(node) or len(node.body) < 2:
            continue
        doc_end = node.body[0].end_lineno
        context = imports
        if owner is not None:
            # The owning class's header (without its body) tells the body what `self` is.
            context += "".join(lines[_first_line(owner) - 1 : owner.lineno])
        prompt = context + "".join(lines[_first_line(node) - 1 : doc_end])
        reference = "".join(lines[doc_end : node.end_lineno])
        if sum(1 for ln in reference.splitlines() if ln.strip()) >= cfg.min_body_lines:
            kind = "class_body" if isinstance(node, ast.ClassDef) else "def_body"
            out.append((kind, prompt, reference))
    for n in cfg.continuation_lines:
        reference = "".join(lines[n:])
        if sum(1 for ln in reference.splitlines() if ln.strip()) >= cfg.min_body_lines:
            out.append(("file_continuation", "".join(lines[:n]), reference))
    return out


def source_rows(
    modules: list[tuple[str, str, str]], tokenizer: PreTrainedTokenizerBase, cfg: PromptsConfig
) -> tuple[list[Row], dict[str, int]]:
    """Rows from (module, split, text) source files; the split of a row is its module's split.

    Candidates are shuffled (seeded) and tokenized in batches only until a split's cap is reached:
    the stdlib yields several times more candidates than a run keeps.
    """
    _require_fast(tokenizer)
    candidates: dict[str, list[tuple[str, str, str, str]]] = {s: [] for s in SPLITS}
    for module, split, text in modules:
        if split not in SPLITS:
            raise ValueError(f"module {module} has split {split!r}; use one of {SPLITS}")
        for kind, prompt, reference in _source_candidates(text, cfg):
            # Tokenize only what can be kept: a longer reference is cut to max tokens anyway.
            reference = reference[: 16 * cfg.max_reference_tokens]
            candidates[split].append((module, kind, prompt, reference))
    skipped: Counter = Counter()
    rows: list[Row] = []
    seen: set[str] = set()  # held-out first, so a train prompt never repeats a held-out one
    for split, cap in (("heldout", cfg.max_heldout_rows), ("train", cfg.max_train_rows)):
        pool = candidates[split]
        random.Random(f"{cfg.seed}:{split}").shuffle(pool)
        kept = 0
        for i in range(0, len(pool), _BATCH):
            if kept == cap:
                break
            batch = pool[i : i + _BATCH]
            encoded = tokenizer(
                [p + r for _, _, p, r in batch], return_offsets_mapping=True, verbose=False
            )
            for (module, kind, prompt, _), ids, offsets in zip(
                batch, encoded["input_ids"], encoded["offset_mapping"], strict=True
            ):
                if kept == cap:
                    break
                prompt_ids, reference_ids = _split_ids(
                    ids, offsets, len(prompt), cfg.max_reference_tokens
                )
                if len(prompt_ids) > cfg.max_prompt_tokens:
                    skipped["too_long"] += 1
                    continue
                if not reference_ids:
                    skipped["empty"] += 1
                    continue
                prompt_text = tokenizer.decode(prompt_ids, skip_special_tokens=True)
                if prompt_text in seen:
                    skipped["duplicate"] += 1
                    continue
                seen.add(prompt_text)
                kept += 1
                rows.append(
                    {
                        "prompt_id": _prompt_id(prompt_text, reference_ids),
                        "split": split,
                        "source": f"stdlib:{module}",
                        "kind": kind,
                        "prompt_ids": prompt_ids,
                        "prompt_text": prompt_text,
                        "reference_ids": reference_ids,
                        "loss_mask": [0] * len(prompt_ids) + [1] * len(reference_ids),
                    }
                )
    return rows, dict(skipped)


def embedded_modules(root: Path | None = None) -> list[tuple[str, str, str]]:
    """(module, split, text) of the embedded corpus's train and held-out modules."""
    files = corpus.list_sources(root)
    return [
        (module, split, text)
        for split in SPLITS
        for module, text in corpus.load_split(files, split)
    ]
