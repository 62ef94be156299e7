"""Wording shared by the messages of the library and the command line."""

from __future__ import annotations

import codecs
import contextlib
import io
import sys
from collections.abc import Callable
from typing import Any


def plural(count: int, noun: str, plural_form: str | None = None) -> str:
    """``count`` with ``noun`` in the right number: ``1 shard``, ``2 shards``, ``1,000 samples``."""
    word = noun if count == 1 else (plural_form or noun + "s")
    return f"{count:,} {word}"


def one_line(text: str, limit: int = 120) -> str:
    """``text`` on one line (whitespace runs folded to a space), cut to ``limit`` characters with "…"."""
    line = " ".join(text.split())
    return line if len(line) <= limit else line[: limit - 1] + "…"


# Characters a name may hold that would break a message's line or act on the terminal: the C0 and C1 controls
# (newline, tab, ESC ...), DEL, the Unicode line and paragraph separators, and the bidirectional controls that
# reorder what follows them on screen.
_UNPRINTABLE = {c: f"\\x{c:02x}" for c in (*range(0x20), *range(0x7F, 0xA0))}
_UNPRINTABLE.update({c: f"\\u{c:04x}" for c in (0x2028, 0x2029, 0x200E, 0x200F, 0x061C, *range(0x202A, 0x202F),
                                                   *range(0x2066, 0x206A))})
_UNPRINTABLE.update({ord("\n"): "\\n", ord("\t"): "\\t", ord("\r"): "\\r"})


def printable(text: str) -> str:
    """``text`` (a file, folder or class name) as it may appear in a one-line message: control characters,
    line separators and bidirectional controls escaped (``\\n``, ``\\x1b``, ``\\u202e``); the rest as it is."""
    return text.translate(_UNPRINTABLE)


def message_text(text: str) -> str:
    """``text`` as a one-line message any output can carry: what :func:`printable` escapes, and the lone
    surrogates a name that is not UTF-8 decodes to (``os.fsdecode``), which no encoder writes, as the bytes
    they stand for (``\\xff``) or their code points (``\\udc12``)."""
    if any("\ud800" <= c <= "\udfff" for c in text):
        text = "".join(f"\\x{ord(c) - 0xDC00:02x}" if "\udc80" <= c <= "\udcff"
                       else f"\\u{ord(c):04x}" if "\ud800" <= c <= "\udfff" else c for c in text)
    return printable(text)


def show(value: object, limit: int = 60) -> str:
    """A short, one-line repr of a value from the user or a file (a hostile one may hold anything)."""
    try:
        text = repr(value)
    except Exception:  # noqa: BLE001 - a repr that raises still gets a name
        text = f"<{type(value).__name__}>"
    return one_line(text, limit)


class ProgressStream:
    """Standard error for a progress bar: once its reader has gone (``datapipe build SRC OUT 2>&1 | head -1``)
    or it was closed, the bar is silent from then on, and so it is in a process without one (``sys.stderr`` is
    None: started with descriptor 2 closed, ``2>&-``); a bar never ends the work it shows."""

    def __init__(self) -> None:
        self.gone = False

    @property
    def encoding(self) -> str | None:
        """Standard error's (tqdm draws Unicode bars only on a UTF-8 stream)."""
        return getattr(sys.stderr, "encoding", None)

    def fileno(self) -> int:
        """Standard error's descriptor (tqdm asks the terminal it is on for its width)."""
        if sys.stderr is None:
            raise io.UnsupportedOperation("no standard error")
        return sys.stderr.fileno()

    def write(self, text: str) -> int:
        if not self.gone:
            try:
                sys.stderr.write(text)
            except (OSError, ValueError, AttributeError):  # EPIPE, a closed stream, or none (None)
                self.gone = True
        return len(text)

    def flush(self) -> None:
        if not self.gone:
            try:
                sys.stderr.flush()
            except (OSError, ValueError, AttributeError):
                self.gone = True


_BAR: Any = None  # tqdm without its monitor thread (see progress_bar)


def progress_bar(*args: Any, **kwargs: Any) -> Any:
    """A tqdm bar on standard error (:class:`ProgressStream`), without tqdm's monitor thread: a bar needs none,
    and one that cannot start (no memory for a thread) only adds a warning to the error that follows."""
    global _BAR
    if _BAR is None:
        from tqdm import tqdm

        _BAR = type("ProgressBar", (tqdm,), {"monitor_interval": 0})
    return _BAR(*args, file=ProgressStream(), dynamic_ncols=True, **kwargs)


# The typographic characters of messages, tables and --help, in ASCII where the output's encoding lacks them.
_PLAIN = {"…": "...", "—": "-", "–": "-", "×": "x", "→": "->", "←": "<-", "≤": "<=", "≥": ">=", "≈": "~", "µ": "u",
          "²": "^2", "³": "^3", "‘": "'", "’": "'", "“": '"', "”": '"', "·": ".", "°": " deg", "±": "+/-", "√": "sqrt"}


def _plain(error: UnicodeError) -> tuple[str | bytes, int]:
    """The ``datapipe-plain`` encoding error handler: our typographic characters as ASCII, a byte the C locale's
    decoding escaped (a lone surrogate, U+DC80..U+DCFF) as that byte, as ``surrogateescape`` writes it, anything
    else (a class name in another script) as a backslash escape; never an error."""
    if not isinstance(error, UnicodeEncodeError):
        raise error
    text = error.object[error.start : error.end]
    if any(0xDC80 <= ord(c) <= 0xDCFF for c in text):
        return b"".join(bytes([ord(c) - 0xDC00]) if 0xDC80 <= ord(c) <= 0xDCFF else
                        (_PLAIN.get(c) or c.encode("ascii", "backslashreplace").decode()).encode("ascii")
                        for c in text), error.end
    return "".join(_PLAIN.get(c) or c.encode("ascii", "backslashreplace").decode() for c in text), error.end


def plain_where_unencodable(*streams: Any) -> Callable[[], None]:
    """Let ``streams`` (standard output and error) write any text: a character their encoding lacks (a terminal
    or pipe in a Latin-1, ASCII or C locale, ``PYTHONIOENCODING``) is written as ASCII or escaped, where printing
    it raised UnicodeEncodeError, after a bench had measured for minutes. A UTF-8 stream is unchanged but for a
    lone surrogate, written as ``surrogateescape`` would. Returns what puts the streams' error handlers back."""
    codecs.register_error("datapipe-plain", _plain)
    changed = []
    for stream in streams:
        errors = getattr(stream, "errors", None)
        if errors in ("strict", "backslashreplace", "surrogateescape"):
            with contextlib.suppress(Exception):  # a stream without reconfigure (replaced by a program) stays as it is
                stream.reconfigure(errors="datapipe-plain")
                changed.append((stream, errors))

    def restore() -> None:
        for stream, errors in changed:
            with contextlib.suppress(Exception):
                stream.reconfigure(errors=errors)

    return restore
