"""Wording shared by the messages of the library and the command line."""

from __future__ import annotations


def plural(count: int, noun: str, plural_form: str | None = None) -> str:
    """``count`` with ``noun`` in the right number: ``1 shard``, ``2 shards``, ``1,000 samples``."""
    word = noun if count == 1 else (plural_form or noun + "s")
    return f"{count:,} {word}"
