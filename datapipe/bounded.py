"""Bounded work per source file: only regular files are read, up to a size limit, within a time limit.

A FIFO, socket or device under an image's name would block ``open``/``read`` forever, and a file
swapped for one after the scan would too; so every file is opened non-blocking and checked with
``fstat`` before a byte is read. Its size is checked against a limit before reading. A read or decode
that never returns is caught by a watchdog thread, which ends the process: in a Dask worker that
makes the shard's task fail with ``KilledWorker``, and the build then decodes that shard's files one
by one in separate processes, quarantining the culprit as ``timeout``; in a serial build it ends the
build with one line naming the file.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable

from .errors import DecodeError, env_seconds
from .files import FileChanged, FileTooLarge, NotRegularFile, read_regular

DEFAULT_FILE_TIMEOUT = 300.0  # seconds one file may take to read and decode (DATAPIPE_FILE_TIMEOUT)
MAX_BYTES_PER_PIXEL = 8  # no image format datapipe reads stores more per pixel (16-bit RGBA, uncompressed)
FILE_SLACK_BYTES = 16 << 20  # metadata, thumbnails, further frames


def max_file_bytes(max_pixels: int) -> int:
    """The largest source file read: 8 bytes per allowed pixel plus 16 MiB (1.6 GB at the default
    100 M pixels); a larger file is quarantined as ``too-large`` before it is read."""
    return int(max_pixels) * MAX_BYTES_PER_PIXEL + FILE_SLACK_BYTES


def file_timeout() -> float:
    """Seconds one file may take to read and decode: ``DATAPIPE_FILE_TIMEOUT`` (default 300)."""
    return env_seconds("DATAPIPE_FILE_TIMEOUT", DEFAULT_FILE_TIMEOUT)


# A file whose size or mtime is not what the build's scan saw: the scan's record of it (which decides whether a
# rerun rebuilds its shard) would not be of the bytes the cache holds.
CHANGED = "changed since the scan"
# What reads a file again that was gone or changed when its shard read it: a rerun whose scan sees it otherwise
# (the inputs hash changes), and one that finds it back as it was only when it reads such files again.
READ_AGAIN_ADVICE = ("a rerun reads it again once it changes, or with --verify once it is back as the scan saw it "
                     "(or if the build did not finish)")


def read_file(path: str, limit: int, scanned: tuple[int, int] | None = None) -> bytes:
    """The bytes of the regular file ``path``, at most ``limit`` of them; with ``scanned``, of the file the scan
    saw, of that (size, mtime_ns), and not written to while read.

    Raises:
        DecodeError: not a regular file (``unreadable``), larger than ``limit`` (``too-large``), or changed since
            the scan (``unreadable``, its reason starting with :data:`CHANGED`).
        OSError: it cannot be opened or read.
    """
    try:
        return read_regular(path, limit, scanned)
    except NotRegularFile as exc:
        raise DecodeError(f"not a regular file: {exc.what}", kind="unreadable") from None
    except FileChanged as exc:
        (size, mtime), (read_size, read_mtime) = exc.expected, exc.seen
        differs = (f"{size:,} bytes then, {read_size:,} when read" if size != read_size else
                   f"modified {_when(mtime)} then, {_when(read_mtime)} when read")
        raise DecodeError(f"{CHANGED} ({differs}: written while the build ran, or another file at this path where it "
                          f"was read; {READ_AGAIN_ADVICE})", kind="unreadable") from None
    except FileTooLarge as exc:
        if exc.grew:
            raise DecodeError(f"file grew past the {limit:,}-byte limit while being read", kind="too-large") from None
        raise DecodeError(f"file of {exc.size:,} bytes, over the {limit:,}-byte limit for its max_pixels "
                          "(raise --max-pixels to build it)", kind="too-large") from None


def _when(mtime_ns: int) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(mtime_ns // 10**9)) + f".{mtime_ns % 10**9:09d}"


def warm_up() -> None:
    """Decode a tiny JPEG and PNG once, so that the one-time costs of a process's first decode (imports,
    loading the decoders and the resize kernel: up to seconds on a busy machine) are not charged to
    the first file under the watchdog."""
    import io

    import numpy as np
    import simplejpeg
    from PIL import Image

    from .codecs import DecodeSpec, decode_sample

    pixels = np.full((16, 24, 3), 128, np.uint8)
    png = io.BytesIO()
    Image.fromarray(pixels).save(png, "PNG")
    for data in (simplejpeg.encode_jpeg(pixels), png.getvalue()):
        decode_sample(data, DecodeSpec(size=8))


class Watchdog:
    """Ends the process when one file takes longer than ``timeout`` seconds.

    ``watch(path)`` marks the start of a file, ``watch(None)`` its end. On expiry the line
    ``message(path, timeout)`` is written to file descriptor ``fd`` (straight to the descriptor: a
    stuck thread may hold the lock of ``sys.stderr``) and the process exits with ``code``: nothing
    else can stop a read or a decode stuck inside C code.
    """

    def __init__(self, message: Callable[[str, float], str], code: int, *, fd: int = 2,
                 timeout: float | None = None) -> None:
        self.timeout = timeout if timeout is not None else file_timeout()
        self.message = message
        self.code = code
        self.fd = fd
        self._current: tuple[str, float] | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="datapipe-file-watchdog", daemon=True)

    def __enter__(self) -> Watchdog:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def watch(self, path: str | None) -> None:
        self._current = (path, time.monotonic()) if path is not None else None

    def _run(self) -> None:
        step = min(1.0, self.timeout / 4)
        while not self._stop.wait(step):
            current = self._current
            if current is not None and time.monotonic() - current[1] > self.timeout:
                try:
                    os.write(self.fd, (self.message(current[0], self.timeout) + "\n").encode("utf-8", "backslashreplace"))
                finally:
                    os._exit(self.code)
