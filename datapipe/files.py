"""Reading a file that may be anything: only a regular file is read, never more than a limit.

A path handed to datapipe — a source image, a CSV listing, a cache's JSON document — may name a
FIFO (reading it would block forever), a device, a directory, or a file far larger than it should
be. :func:`read_regular` opens it non-blocking, checks it with ``fstat`` before a byte is read, and
reads at most ``limit`` bytes; each caller turns a refusal into its own one-line error.
"""

from __future__ import annotations

import os
import stat

_KINDS = ((stat.S_ISFIFO, "a named pipe (FIFO)"), (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISDIR, "a directory"))


def describe_mode(mode: int) -> str:
    """What a file that is not a regular file is, in words ("a named pipe (FIFO)", ...)."""
    for test, what in _KINDS:
        if test(mode):
            return what
    return "not a regular file"


class NotRegularFile(Exception):
    """The path is not a regular file (``what`` says what it is)."""

    def __init__(self, what: str) -> None:
        super().__init__(what)
        self.what = what


class FileTooLarge(Exception):
    """The file holds more than the caller's limit (``size`` bytes, or more when it grew while read)."""

    def __init__(self, size: int, limit: int, *, grew: bool = False) -> None:
        super().__init__(f"{size:,} bytes, over the {limit:,}-byte limit")
        self.size, self.limit, self.grew = size, limit, grew


def read_regular(path: str | os.PathLike, limit: int) -> bytes:
    """The bytes of the regular file ``path``, at most ``limit`` of them.

    One ``read`` for the whole file in the common case (unbuffered: the fastest way for the build's
    source images); a file that grew since ``fstat`` is read on, within the limit.

    Raises:
        NotRegularFile: a FIFO, socket, device or directory (never read, so never blocked on).
        FileTooLarge: more than ``limit`` bytes.
        OSError: it cannot be opened or read.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise NotRegularFile(describe_mode(st.st_mode))
        if st.st_size > limit:
            raise FileTooLarge(st.st_size, limit)
        data = os.read(fd, st.st_size + 1)
        if len(data) > st.st_size:  # it grew since fstat: read on, within the limit
            parts, total = [data], len(data)
            while chunk := os.read(fd, min(1 << 24, limit + 1 - total)):
                parts.append(chunk)
                total += len(chunk)
                if total > limit:
                    raise FileTooLarge(total, limit, grew=True)
            data = b"".join(parts)
        return data
    finally:
        os.close(fd)
