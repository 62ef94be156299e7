"""MkDocs hook: the CLI reference is generated from datapipe's own argument parser.

A page that contains the line ``<!-- cli-reference -->`` gets, in its place, the ``--help`` of
``datapipe`` and of each of its subcommands, so the reference can never drift from the parser.
"""

from __future__ import annotations

import argparse

MARKER = "<!-- cli-reference -->"


def _reference() -> str:
    from datapipe.cli import _parser

    parser = _parser()
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    blocks = ["## datapipe", "", "```text", parser.format_help().rstrip(), "```", ""]
    subactions = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    for action in subactions:
        for name, sub in action.choices.items():
            blocks += [f"## datapipe {name}", "", "```text", sub.format_help().rstrip(), "```", ""]
    return "\n".join(blocks)


def on_page_markdown(markdown: str, **_: object) -> str:
    if MARKER in markdown:
        markdown = markdown.replace(MARKER, _reference())
    return markdown
