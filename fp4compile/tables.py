"""Fixed-width text tables: the report's precision table, the traffic table and the statistics table."""

from __future__ import annotations

from typing import Callable, Optional, Sequence


def columns(rows: Sequence[Sequence], right: Optional[Callable[[int, object], bool]] = None,
            total: bool = False) -> list[str]:
    """The lines of ``rows`` (the header first) in columns two spaces apart, a rule of dashes under the
    header and, with ``total``, above the last row. A cell is right-aligned where ``right(column, cell)``
    says so, else left-aligned; trailing spaces are dropped."""
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]

    def line(r) -> str:
        return "  ".join(str(c).rjust(w) if right is not None and right(i, c) else str(c).ljust(w)
                         for i, (c, w) in enumerate(zip(r, widths))).rstrip()

    rule = "  ".join("-" * w for w in widths)
    lines = [line(rows[0]), rule, *(line(r) for r in rows[1:])]
    if total:
        lines.insert(len(lines) - 1, rule)
    return lines
