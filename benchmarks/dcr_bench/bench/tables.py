"""Plain-text tables for benchmark rows (lists of dicts)."""
from __future__ import annotations

from typing import Callable, Sequence

# (header, function of a row giving the cell text)
Column = tuple[str, Callable[[dict], str]]


def format_table(rows: Sequence[dict], columns: Sequence[Column]) -> str:
    """Right-aligned columns under a header and a rule."""
    cells = [[header for header, _ in columns]]
    cells += [[cell(row) for _, cell in columns] for row in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(columns))]
    lines = ["  ".join(text.rjust(w) for text, w in zip(line, widths)) for line in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
