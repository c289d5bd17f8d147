"""Numbers into table cells: one ratio helper and one table renderer (text or Markdown); the
"did you mean" of an error line."""

from __future__ import annotations

import difflib


def ratio(value, baseline):
    """value / baseline, or None where either is missing (or the baseline is 0)."""
    if value is None or not baseline:
        return None
    return value / baseline


def did_you_mean(word: str, known) -> str:
    """ " (did you mean X?)" for the known word closest to a mistyped one, or ""."""
    close = difflib.get_close_matches(word, list(known), n=1, cutoff=0.6)
    return f" (did you mean {close[0]}?)" if close else ""


def count(n: int, noun: str) -> str:
    """``1 config``, ``2 configs``: a count with its noun (plural by an added s)."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def cell(value, scale: float = 1.0, digits: int = 2) -> str:
    """``-`` for a missing value; floats divided by ``scale`` to ``digits`` decimals."""
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value / scale:.{digits}f}"
    return str(value)


def render_table(header: list[str], body: list[list[str]], markdown: bool = False) -> str:
    """Cells already formatted. Text: left-aligned columns under a dashed rule."""
    if markdown:
        lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        return "\n".join(lines + ["| " + " | ".join(cells) + " |" for cells in body]) + "\n"
    widths = [max([len(h), *(len(cells[i]) for cells in body)]) for i, h in enumerate(header)]
    lines = [header, ["-" * w for w in widths], *body]
    return "".join(
        "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip() + "\n" for cells in lines
    )
