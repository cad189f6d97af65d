"""Reading a JSON object from a file on disk (a manifest, a run or tune record, an export's
checksums): whatever the file holds, an error that names it, never a traceback."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from storage.errors import CorruptDataset


class UnreadableJson(CorruptDataset):
    """A JSON file that does not hold a readable object; `reason` says why, without the path,
    for callers that name the file their own way."""

    def __init__(self, path: Path, reason: str):
        super().__init__(f"cannot read {path}: {reason}")
        self.path, self.reason = path, reason


def read_json_object(path: Path) -> dict[str, Any]:
    """The JSON object in `path`, or UnreadableJson. A missing file is the caller's
    (FileNotFoundError), since what that means differs by file."""
    try:
        value = json.loads(Path(path).read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UnreadableJson(path, f"it is not valid JSON ({e})") from None
    except RecursionError:  # Python's JSON decoder recurses once per level of nesting
        raise UnreadableJson(path, "its JSON is nested too deeply to read") from None
    if not isinstance(value, dict):
        raise UnreadableJson(path, f"it holds a JSON {type(value).__name__}, not an object")
    return value
