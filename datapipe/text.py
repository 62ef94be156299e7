"""Wording shared by the messages of the library and the command line."""

from __future__ import annotations


def plural(count: int, noun: str, plural_form: str | None = None) -> str:
    """``count`` with ``noun`` in the right number: ``1 shard``, ``2 shards``, ``1,000 samples``."""
    word = noun if count == 1 else (plural_form or noun + "s")
    return f"{count:,} {word}"


def one_line(text: str, limit: int = 120) -> str:
    """``text`` on one line (whitespace runs folded to a space), cut to ``limit`` characters with "…"."""
    line = " ".join(text.split())
    return line if len(line) <= limit else line[: limit - 1] + "…"


def show(value: object, limit: int = 60) -> str:
    """A short, one-line repr of a value from the user or a file (a hostile one may hold anything)."""
    try:
        text = repr(value)
    except Exception:  # noqa: BLE001 - a repr that raises still gets a name
        text = f"<{type(value).__name__}>"
    return one_line(text, limit)
