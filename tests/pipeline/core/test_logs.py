"""The "opd" logger prints floats with 4 significant digits; format specs still apply."""

from __future__ import annotations

import logging

import pipeline  # noqa: F401  (installs the filter on "opd")
from pipeline.core.logs import ShortFloats


def _line(fmt: str, *args) -> str:
    record = logging.LogRecord("opd", logging.INFO, __file__, 1, fmt, args, None)
    ShortFloats().filter(record)
    return record.getMessage()


def test_floats_print_short_and_format_specs_still_apply():
    assert _line("%s %s", 0.5646208917922786, 3.435400665917613) == "0.5646 3.435"
    assert _line("%s", [0.123456, (2.0, 1e-7)]) == "[0.1235, (2, 1e-07)]"
    assert _line("%s %s %s", 12345.678, float("nan"), 0.0) == "12346 nan 0.0"
    assert _line("%.6f %d %r", 0.5646208917922786, 3.9, 1 / 3) == "0.564621 3 0.3333"
    assert _line("%s and %d", "text", 7) == "text and 7"
    assert any(isinstance(f, ShortFloats) for f in logging.getLogger("opd").filters)
