"""Numbers in the "opd" log lines a person reads: 4 significant digits.

Stages log validation losses and τ with `%s`, which prints a float's 17 digits
(`val replay loss 0.5646208917922786`). The datasets and `--json` keep full precision; only the
log record's arguments are shortened, so a `%.3f` or `%d` in a format string still applies.
"""

from __future__ import annotations

import logging
import math
from typing import Any


class _Short(float):
    """A float that prints with 4 significant digits (whole numbers from 1000 up)."""

    def __repr__(self) -> str:
        if not math.isfinite(self) or self == 0:
            return float.__repr__(self)
        return f"{self:.0f}" if abs(self) >= 1000 else f"{self:.4g}"

    __str__ = __repr__


def _shorten(value: Any) -> Any:
    if isinstance(value, float):
        return _Short(value)
    if isinstance(value, list):
        return [_shorten(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_shorten(v) for v in value)
    if isinstance(value, dict):
        return {k: _shorten(v) for k, v in value.items()}
    return value


class ShortFloats(logging.Filter):
    """Shortens the floats among a record's arguments (nested in lists, tuples, dicts too)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, dict):
            record.args = _shorten(record.args)
        elif record.args:
            record.args = tuple(_shorten(a) for a in record.args)
        return True


def shorten_floats(logger: logging.Logger) -> None:
    """Install `ShortFloats` on `logger` (once)."""
    if not any(isinstance(f, ShortFloats) for f in logger.filters):
        logger.addFilter(ShortFloats())
