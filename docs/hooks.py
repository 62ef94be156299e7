"""MkDocs hook: the CLI reference is generated from datapipe's own argument parser.

A page that contains the line ``<!-- cli-reference -->`` gets, in its place, the ``--help`` of
``datapipe`` and of each of its subcommands, so the reference can never drift from the parser.
"""

from __future__ import annotations

import argparse
import re

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


# The docstrings cross-reference in Sphinx's roles (:class:`Cache`, :meth:`~Cache.verify`), which the Google-style
# handler renders as text before the name's code: the role goes, and a leading ~ shows the last part, as in Sphinx.
_ROLE = re.compile(r":(?:class|meth|func|mod|attr|data|exc|obj|const):(?=<code>)")
_TILDE = re.compile(r"<code>~(?:[\w.]+\.)?([\w]+)</code>")


def on_page_content(html: str, **_: object) -> str:
    return _TILDE.sub(r"<code>\1</code>", _ROLE.sub("", html))
