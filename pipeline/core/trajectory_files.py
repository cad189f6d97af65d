"""Trajectories in and out of a data root as one file: what `generate.source` reads and
`opd data export` writes.

Two formats:
- **Parquet** (`.parquet`): the `trajectories` dataset's own columns (`TRAJECTORY_SCHEMA`), in
  order, with file-level metadata under the schema key `opd_trajectories` (`FileInfo`, JSON):
  `format`, `format_version`, `tokenizer_sha256` and `chat_template_sha256` (the target's
  tokenizer fingerprint), `target` (how to load it, as manifests record it), `target_identity`,
  `generation` (the generate config and engine that made the rows), `source` (the dataset
  exported and its lineage), `rows` and `content_sha256` (a digest of every row's token
  columns, checked on read: a file changed since its export is refused). Token ids are the
  target's own; nothing is re-tokenized.
- **Chat JSONL** (`.jsonl`): one conversation a line, `{"messages": [{"role", "content"}, ...]}`
  with at least one assistant turn; rendered with the target's chat template and tokenized.
  Every assistant turn up to its end-of-turn token is in the loss mask; the prompt is
  everything before the first one.

A Parquet file made with another tokenizer or chat template is refused in one line before any
row is read (`check_source`).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from storage import Dataset, OpdError, canonical_json, sha256_file

FORMAT = "opd-trajectories"
FORMAT_VERSION = 1
META_KEY = b"opd_trajectories"

SEQUENCE_FIELDS = [
    ("seq_id", pa.string()),
    ("prompt_id", pa.string()),
    ("input_ids", pa.list_(pa.int32())),
    ("prompt_len", pa.int32()),
    ("loss_mask", pa.list_(pa.int8())),
    ("finish_reason", pa.string()),
]
"""A generated sequence's columns: the trajectories' and the rollouts' sequences alike."""
TRAJECTORY_SCHEMA = pa.schema(
    [
        *SEQUENCE_FIELDS,
        ("temperature", pa.float32()),
        ("top_p", pa.float32()),
        ("seed", pa.int64()),
    ]
)
"""The `trajectories` dataset's columns (generate writes them; the file carries them as is)."""

SUFFIXES = (".parquet", ".jsonl")


def tokenizer_fingerprint(tokenizer: Any) -> dict[str, str]:
    """sha256 of the token <-> id map (with the special tokens' ids) and of the chat template:
    what token ids and rendered conversations mean. Hashes the vocabulary, not the tokenizer
    file, so another `tokenizers` release that writes its JSON differently reads the same."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    special = {
        name: getattr(tokenizer, f"{name}_token_id", None) for name in ("bos", "eos", "pad", "unk")
    }
    template = tokenizer.chat_template or ""
    if not isinstance(template, str):  # several named templates
        template = canonical_json(template)
    return {
        "tokenizer_sha256": hashlib.sha256(
            canonical_json({"vocab": vocab, "special": special}).encode()
        ).hexdigest(),
        "chat_template_sha256": hashlib.sha256(template.encode()).hexdigest(),
    }


def target_fingerprint(loader: Any) -> dict[str, Any]:
    """The target as files made for it record it: its identity (`TargetLoader.identity`:
    weights, shape, dtype) and its tokenizer's fingerprint."""
    return {**loader.identity, **tokenizer_fingerprint(loader.tokenizer)}


SAME_TARGET_KEYS = (
    "weights_sha256",
    "hidden_size",
    "vocab_size",
    "num_layers",
    "tokenizer_sha256",
    "chat_template_sha256",
)
"""What must agree for a drafter made for one target to serve another (not the dtype: a
drafter trained beside a bf16 target serves the same weights in fp32)."""


def target_mismatch(recorded: dict[str, Any], current: dict[str, Any]) -> str | None:
    """How a recorded target fingerprint differs from `current` (None: the same target, as
    far as `recorded` tells: keys it lacks are not compared)."""
    diff = [
        f"{k} {recorded[k]!r} vs {current.get(k)!r}"
        for k in SAME_TARGET_KEYS
        if recorded.get(k) is not None and recorded[k] != current.get(k)
    ]
    return "; ".join(diff) or None


@dataclass(frozen=True)
class FileInfo:
    """A trajectories file's file-level metadata (Parquet) or what stands for it (JSONL)."""

    kind: str  # parquet | jsonl
    meta: dict[str, Any]


def content_digest(table: pa.Table) -> str:
    """sha256 over the token columns' values (not their Parquet bytes): the rows the file
    must still hold when it is read."""
    h = hashlib.sha256()
    for name in ("input_ids", "loss_mask"):
        col = table.column(name).combine_chunks()
        h.update(pc.list_value_length(col).to_numpy(zero_copy_only=False).astype("<i8").tobytes())
        h.update(pc.list_flatten(col).to_numpy(zero_copy_only=False).astype("<i4").tobytes())
    h.update(table.column("prompt_len").to_numpy().astype("<i8").tobytes())
    h.update("\0".join(table.column("seq_id").to_pylist()).encode())
    return h.hexdigest()


def export_trajectories(ds: Dataset, loader: Any, out: Path, lineage: dict[str, Any]) -> dict:
    """Write trajectories dataset `ds` as one Parquet file `out` (written beside and renamed
    into place, so a failure leaves no partial file). Returns the file's metadata."""
    if ds.ref.name != "trajectories":
        raise OpdError(f"{ds.ref} is a {ds.ref.name} dataset: export a trajectories dataset")
    out = Path(out).expanduser()
    if out.suffix != ".parquet":
        raise OpdError(f"--out {out}: a trajectories file is Parquet; name it FILE.parquet")
    if out.exists():
        raise OpdError(f"--out {out} exists; choose a new file name (nothing was written)")
    ds.verify_all(rehash=True)
    table = ds.read_table().select(TRAJECTORY_SCHEMA.names).cast(TRAJECTORY_SCHEMA)
    stage = ds.config.get("stage", {})
    generation = ds.meta.get("generation") or {
        "stage": stage,
        **({"engine": ds.config["engine"]} if "engine" in ds.config else {}),
    }
    fp = target_fingerprint(loader)
    meta = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "tokenizer_sha256": fp["tokenizer_sha256"],
        "chat_template_sha256": fp["chat_template_sha256"],
        "target": ds.meta.get("target_config"),
        "target_identity": loader.identity,
        "generation": generation,
        "source": {"dataset": str(ds.ref), "lineage": lineage},
        "rows": table.num_rows,
        "content_sha256": content_digest(table),
    }
    table = table.replace_schema_metadata({META_KEY: canonical_json(meta).encode()})
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    try:
        pq.write_table(table, tmp, compression="zstd", row_group_size=4096)
        tmp.rename(out)
    finally:
        tmp.unlink(missing_ok=True)
    return meta | {"bytes": out.stat().st_size, "sha256": sha256_file(out)}


def file_info(path: Path) -> FileInfo:
    """The format of `path` and, for Parquet, its metadata (footer only: no rows read)."""
    path = Path(path)
    if not path.is_file():
        raise OpdError(f"generate.source {path} is not a file: pass a .parquet or .jsonl file")
    if path.suffix not in SUFFIXES:
        raise OpdError(
            f"generate.source {path}: expected a trajectories .parquet (opd data export) or a "
            'chat .jsonl ({"messages": [...]} a line)'
        )
    if path.suffix == ".jsonl":
        return FileInfo("jsonl", {})
    try:
        schema = pq.read_schema(path)
    except (pa.ArrowException, OSError) as e:
        raise OpdError(f"{path} is not a readable Parquet file ({e}); export it again") from None
    raw = (schema.metadata or {}).get(META_KEY)
    try:
        meta = json.loads(raw) if raw is not None else None
    except ValueError:
        meta = None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise OpdError(
            f"{path} carries no {FORMAT} metadata (tokenizer fingerprint, target): write it "
            "with `opd data export`, or pass the conversations as chat .jsonl"
        )
    if meta.get("format_version") != FORMAT_VERSION:
        raise OpdError(
            f"{path} is {FORMAT} version {meta.get('format_version')}; this opd reads version "
            f"{FORMAT_VERSION}"
        )
    return FileInfo("parquet", meta)


def check_source(path: Path, tokenizer: Any) -> FileInfo:
    """Refuse, before any work, a trajectories file made for another tokenizer or template."""
    info = file_info(path)
    if info.kind == "jsonl":
        if not tokenizer.chat_template:
            raise OpdError(
                f"{path} is chat JSONL, and the target's tokenizer has no chat template to "
                "render it with: pass token ids as an `opd data export` Parquet file"
            )
        return info
    mine = tokenizer_fingerprint(tokenizer)
    for key, what in (("tokenizer_sha256", "tokenizer"), ("chat_template_sha256", "chat template")):
        if info.meta.get(key) != mine[key]:
            made_for = (info.meta.get("target") or {}).get("path", "another target")
            raise OpdError(
                f"{path} was made with another {what} ({key} {str(info.meta.get(key))[:12]}… "
                f"vs this target's {mine[key][:12]}…, file made for {made_for}): its token ids "
                "mean other text here; use the target it was made for (target.path)"
            )
    return info


def read_rows(path: Path, info: FileInfo, tokenizer: Any, vocab_size: int) -> pa.Table:
    """The rows of a checked trajectories file as a `TRAJECTORY_SCHEMA` table."""
    if info.kind == "jsonl":
        return _chat_rows(Path(path), tokenizer, vocab_size)
    try:
        table = pq.read_table(path)
    except (pa.ArrowException, OSError) as e:
        raise OpdError(f"{path} is corrupted ({e}); export it again") from None
    missing = [n for n in TRAJECTORY_SCHEMA.names if n not in table.column_names]
    if missing:
        raise OpdError(f"{path} lacks the trajectories columns {missing}; export it again")
    try:
        table = table.select(TRAJECTORY_SCHEMA.names).cast(TRAJECTORY_SCHEMA)
    except (pa.ArrowException, ValueError) as e:
        raise OpdError(f"{path}: its columns do not have the trajectories types ({e})") from None
    if table.num_rows != info.meta.get("rows") or content_digest(table) != info.meta.get(
        "content_sha256"
    ):
        raise OpdError(
            f"{path} does not hold the rows it was exported with (row count or content sha256 "
            "differs): the file is corrupted or was edited; export it again"
        )
    _check_rows(path, table, vocab_size)
    return table.replace_schema_metadata(None)


def _check_rows(path: Path, table: pa.Table, vocab_size: int) -> None:
    ids = pc.list_flatten(table.column("input_ids"))
    if len(ids) and (pc.max(ids).as_py() >= vocab_size or pc.min(ids).as_py() < 0):
        raise OpdError(
            f"{path} holds token ids outside the target's vocabulary (0..{vocab_size - 1})"
        )
    lengths = pc.list_value_length(table.column("input_ids"))
    if not pc.all(pc.equal(lengths, pc.list_value_length(table.column("loss_mask")))).as_py():
        raise OpdError(f"{path}: a row's loss_mask and input_ids differ in length")
    if not pc.all(pc.less_equal(table.column("prompt_len"), lengths)).as_py():
        raise OpdError(f"{path}: a row's prompt_len exceeds its length")


def _chat_rows(path: Path, tokenizer: Any, vocab_size: int) -> pa.Table:
    """Chat JSONL rendered with the target's template (module docstring)."""
    eos = tokenizer.eos_token_id
    rows = []
    with path.open(encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path.name} line {n}"
            try:
                messages = json.loads(line)["messages"]
                roles = [m["role"] for m in messages]
                _ = [str(m["content"]) for m in messages]
            except (ValueError, KeyError, TypeError):
                raise OpdError(
                    f'{where}: expected {{"messages": [{{"role": ..., "content": ...}}]}}'
                ) from None
            if "assistant" not in roles or roles[0] == "assistant":
                raise OpdError(f"{where}: needs a user turn followed by an assistant turn")
            rows.append(_conversation_row(messages, tokenizer, eos, f"{path.stem}:{n}", where))
    if not rows:
        raise OpdError(f"{path} holds no conversations")
    table = pa.Table.from_pylist(rows, schema=TRAJECTORY_SCHEMA)
    _check_rows(path, table, vocab_size)
    return table


def _ids(tokenizer: Any, messages: list[dict], generation_prompt: bool) -> list[int]:
    out = tokenizer.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=generation_prompt, return_dict=False
    )
    return list(out["input_ids"] if isinstance(out, dict) else out)


def _conversation_row(
    messages: list[dict], tokenizer: Any, eos: int | None, prompt_id: str, where: str
) -> dict:
    full = _ids(tokenizer, messages, False)
    mask = np.zeros(len(full), dtype=np.int8)
    prompt_len, finish = None, "length"
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = _ids(tokenizer, messages[:i], True)
        upto = _ids(tokenizer, messages[: i + 1], False)
        if full[: len(before)] != before or full[: len(upto)] != upto:
            raise OpdError(
                f"{where}: the chat template does not render this conversation's turns as "
                "prefixes of each other, so its assistant tokens cannot be located"
            )
        turn = upto[len(before) :]
        # the turn ends at the end-of-turn token the target emits; the template's separator
        # after it is not the target's output
        ended = eos is not None and eos in turn
        end = turn.index(eos) + 1 if ended else len(turn)
        finish = "eos" if ended else "length"
        mask[len(before) : len(before) + end] = 1
        prompt_len = len(before) if prompt_len is None else prompt_len
    return {
        "seq_id": f"{prompt_id}-0",
        "prompt_id": prompt_id,
        "input_ids": full,
        "prompt_len": prompt_len,
        "loss_mask": mask.tolist(),
        "finish_reason": finish,
        "temperature": None,
        "top_p": None,
        "seed": None,
    }
