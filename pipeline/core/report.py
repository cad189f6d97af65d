"""Drawing and writing reports (analyze, the experiments): figures rendered to PNG bytes and
markdown tables."""

from __future__ import annotations

import io
import re
from collections.abc import Sequence
from typing import Any

import polars as pl

DPI = 110


def png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def figure(width: float, height: float):
    # A bare Figure renders through Agg without touching pyplot's global backend or state.
    from matplotlib.figure import Figure

    # Lay out at the dpi the PNG is saved at: constrained layout computed at another dpi can
    # leave long tick labels cut at the edge.
    return Figure(figsize=(width, height), layout="constrained", dpi=DPI)


def md_cell(value: Any) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:.3f}"
    return str(value).replace("|", "\\|")


def md_code(text: str | None) -> str:
    """Text as a markdown code span that survives backticks and table pipes."""
    if text is None:
        return "–"
    fence = "`" * (max((len(r) for r in re.findall("`+", text)), default=0) + 1)
    return f"{fence}{text.replace('|', chr(92) + '|')}{fence}"


def md_table(df: pl.DataFrame, code: Sequence[str] = ()) -> str:
    lines = ["| " + " | ".join(df.columns) + " |", "|" + "---|" * df.width]
    for row in df.iter_rows(named=True):
        cells = [md_code(v) if c in code else md_cell(v) for c, v in row.items()]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
