"""Dataset versions: a short content hash of everything that determines a stage's output.

version = sha256(canonical JSON of {stage, stage_version, config, inputs})[:12], where inputs
maps each input role to the exact `NAME@VERSION` it read. Key order never matters; fields
that do not change the output (progress bars, worker counts) are left out by the caller.
"""

from __future__ import annotations

import hashlib
import json
import math
from typing import Any

VERSION_LEN = 12


def canonical_json(obj: Any) -> str:
    """JSON with sorted keys and no whitespace; NaN/inf are refused (they do not round-trip)."""

    def check(o: Any) -> Any:
        if isinstance(o, float) and not math.isfinite(o):
            raise ValueError(f"non-finite float {o!r} cannot be part of a dataset version")
        if isinstance(o, dict):
            for k, v in o.items():
                if not isinstance(k, str):
                    raise TypeError(f"config keys must be strings, got {k!r}")
                check(v)
        elif isinstance(o, list | tuple):
            for v in o:
                check(v)
        return o

    check(obj)
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True)


def dataset_version(
    stage: str, stage_version: str, config: dict[str, Any], inputs: dict[str, str]
) -> str:
    """The version string of the dataset a stage produces from this config and these inputs."""
    payload = canonical_json(
        {"stage": stage, "stage_version": stage_version, "config": config, "inputs": inputs}
    )
    return hashlib.sha256(payload.encode()).hexdigest()[:VERSION_LEN]
