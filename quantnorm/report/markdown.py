"""Markdown helpers every report uses: numbers with units, tables, provider names, tokens."""

from __future__ import annotations


def fmt(value, spec: str = ".4g", unit: str = "") -> str:
    """A number as text: floats by ``spec``, ints and text as they are, None as an en dash."""
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:{spec}}{unit}"
    return f"{value}{unit}"


def pct(value) -> str:
    """A fraction as a percentage with two decimals (None: an en dash)."""
    return "–" if value is None else f"{100 * value:.2f}%"


def table(header: list[str], rows: list[list]) -> list[str]:
    """A Markdown table: the header, the separator, one line per row (cells as ``str``)."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return lines


def token_suffix(entry: dict) -> str:
    """`` `<token>` `` after a position, when the probe recorded the token there."""
    token = entry.get("token")
    return f" `{token}`" if token else ""
