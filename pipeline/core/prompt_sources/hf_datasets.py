"""`hf:NAME[:CONFIG][@SPLIT]`: one split of a dataset read through `datasets`, offline."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import datasets


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
