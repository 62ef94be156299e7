"""Files, whatever they hold: bounded reads of regular files, checksums, atomic writes.

A path handed to datapipe — a source image, a CSV listing, a cache's JSON document — may name a
FIFO (reading it would block forever), a device, a directory, or a file far larger than it should
be. :func:`read_regular` opens it non-blocking, checks it with ``fstat`` before a byte is read, and
reads at most ``limit`` bytes; each caller turns a refusal into its own one-line error.

What datapipe writes goes through a temporary name (``TMP_PREFIX``) and a rename, fsynced, so a
file or folder with its final name is always whole and a killed run leaves only names that
:func:`remove_stale_temps` recognises.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import stat
import time
import uuid
from pathlib import Path

import numpy as np

from .errors import CacheError, too_many_open_files

TMP_PREFIX = ".tmp-"  # every temporary file or folder datapipe writes starts with this

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


class FileChanged(Exception):
    """The file is not the one the caller expected: its (size, mtime_ns) ``seen`` differ from ``expected``, or
    it was written to while read."""

    def __init__(self, expected: tuple[int, int], seen: tuple[int, int]) -> None:
        super().__init__(f"expected size and mtime {expected}, found {seen}")
        self.expected, self.seen = expected, seen


def open_for_reading(path: str | os.PathLike) -> int:
    """A descriptor of ``path`` opened read-only and non-blocking (a FIFO in a file's place is never waited on);
    OSError as os.open gives it, but TooManyOpenFilesError when the descriptor limit is reached."""
    try:
        return os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        error = too_many_open_files(exc, path)
        if error is not None:
            raise error from None
        raise


def read_regular(path: str | os.PathLike, limit: int, expected: tuple[int, int] | None = None) -> bytes:
    """The bytes of the regular file ``path``, at most ``limit`` of them; with ``expected``, of the file whose
    (size, mtime_ns) those are, as they still are once it is read.

    One ``read`` for the whole file in the common case (unbuffered: the fastest way for the build's
    source images); a file that grew since ``fstat`` is read on, within the limit.

    Raises:
        NotRegularFile: a FIFO, socket, device or directory (never read, so never blocked on).
        FileTooLarge: more than ``limit`` bytes.
        FileChanged: with ``expected``, a file of another size or mtime, or one written to while read.
        OSError: it cannot be opened or read.
    """
    fd = open_for_reading(path)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise NotRegularFile(describe_mode(st.st_mode))
        if expected is not None and (st.st_size, st.st_mtime_ns) != expected:
            raise FileChanged(expected, (st.st_size, st.st_mtime_ns))
        if st.st_size > limit:
            raise FileTooLarge(st.st_size, limit)
        data = os.read(fd, st.st_size + 1)
        while 0 < len(data) < st.st_size:  # a short read (Linux reads at most 2 GiB at once): read on to its end
            more = os.read(fd, st.st_size + 1 - len(data))
            if not more:
                break
            data += more
        if len(data) > st.st_size:  # it grew since fstat: read on, within the limit
            parts, total = [data], len(data)
            while chunk := os.read(fd, min(1 << 24, limit + 1 - total)):
                parts.append(chunk)
                total += len(chunk)
                if total > limit:
                    raise FileTooLarge(total, limit, grew=True)
            data = b"".join(parts)
        if expected is not None:
            after = os.fstat(fd)
            if (after.st_size, after.st_mtime_ns) != expected:
                raise FileChanged(expected, (after.st_size, after.st_mtime_ns))
            if len(data) != expected[0]:  # cut and written back to its size and mtime while read
                raise FileChanged(expected, (len(data), after.st_mtime_ns))
        return data
    finally:
        os.close(fd)


def crc32c(data: bytes | np.ndarray, value: int = 0) -> int:
    """The crc32c of ``data`` continued from ``value`` (the crc of what came before it); a contiguous
    array is read in place, not copied (google_crc32c refuses a memoryview)."""
    import google_crc32c

    return google_crc32c.extend(value, data)


def file_crc32c(path: Path, chunk: int = 1 << 20) -> str:
    """The crc32c of a regular file (opened non-blocking: a FIFO in its place is refused, not waited on),
    read through one reused buffer (a new block per read made every page of it fault in: a third of
    the time of a 5 MB shard's check)."""
    fd = open_for_reading(path)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise CacheError(f"{path} is not a regular file; rerun the same `datapipe build` to rewrite it")
        crc, _ = crc32c_range(fd, 0, None, np.empty(max(1, min(chunk, st.st_size)), dtype=np.uint8))
    finally:
        os.close(fd)
    return f"{crc:08x}"


def crc32c_range(fd: int, start: int, stop: int | None, buf: np.ndarray, value: int = 0) -> tuple[int, int]:
    """The crc32c of the bytes ``[start, stop)`` of the open file ``fd`` (to its end when ``stop`` is None)
    continued from ``value``, read into ``buf`` (reused, uint8): (crc, the offset reached — short of
    ``stop`` where the file ends before it)."""
    at = start
    while stop is None or at < stop:
        want = len(buf) if stop is None else min(len(buf), stop - at)
        n = os.preadv(fd, [buf[:want].data], at)
        if not n:
            break
        value = crc32c(buf[:n], value)
        at += n
    return value, at


def listed_files(folder: Path, listed: object) -> set[Path]:
    """The files inside ``folder`` that a marker's list (``listed``: relative paths, as datapipe wrote them)
    names; an entry that is no relative path inside the folder (absolute, with ``..``, not a string) names
    none, and a list that is not one names nothing."""
    if not isinstance(listed, list):
        return set()
    return {folder / name for name in listed if isinstance(name, str) and _inside(Path(name))}


def _inside(path: Path) -> bool:
    return bool(path.parts) and not path.is_absolute() and ".." not in path.parts


def remove_empty_folders(folder: Path) -> None:
    """Remove the folders under ``folder`` left empty (deepest first), once datapipe's files in them are
    deleted; a folder that still holds anything stays, and no file is touched."""
    if not folder.is_dir():
        return
    for sub in sorted((p for p in folder.rglob("*") if p.is_dir() and not p.is_symlink()), key=lambda p: -len(p.parts)):
        with contextlib.suppress(OSError):  # not empty
            sub.rmdir()


def free_mib(folder: str | os.PathLike) -> str | None:
    """The space left to write on the disk of ``folder``, as "12.3 MiB" (for a message about a full disk);
    None where the disk cannot be asked."""
    try:
        st = os.statvfs(folder)
    except OSError:
        return None
    return f"{st.f_bavail * st.f_frsize / 2**20:,.1f} MiB"


def few_entries(st: os.statvfs_result) -> bool:
    """Whether a disk is (nearly) out of file entries (inodes) rather than bytes: few left (a write that failed for
    want of one removed what it had begun before this is asked, which gave a few back), and a smaller share of them
    than of its bytes (XFS makes inodes as they are needed and counts those its free bytes could hold: a disk out
    of bytes is out of inodes there too)."""
    if not st.f_files or st.f_favail > max(1024, st.f_files // 100):
        return False
    return not st.f_blocks or st.f_favail / st.f_files < st.f_bavail / st.f_blocks


def disk_room(folder: str | os.PathLike) -> str | None:
    """What is left on the disk of ``folder``, for a message about a full one: "12.3 MiB free on its disk", with
    the file entries (inodes) left where they are few; None where the disk cannot be asked."""
    try:
        st = os.statvfs(folder)
    except OSError:
        return None
    if few_entries(st):
        return f"{free_mib(folder)} and {st.f_favail:,} file entries (inodes) free on its disk (`df -i` shows them)"
    return f"{free_mib(folder)} free on its disk"


def make_dirs(folder: str | os.PathLike) -> None:
    """``mkdir -p``, top down from the deepest folder that exists: one ``mkdir`` per missing level
    (``Path.mkdir(parents=True)`` first fails at every missing level on the way up, and a directory
    costs a third of a millisecond to make here: a shard downloaded into ``images/c/0/0/0`` makes six)."""
    missing = []
    path = os.fspath(folder)
    while not os.path.isdir(path):
        missing.append(path)
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    for path in reversed(missing):
        try:
            os.mkdir(path)
        except FileExistsError:
            if not os.path.isdir(path):
                raise


def link_on_the_way(folder: Path, rel: str) -> Path | None:
    """The first folder on the way from ``folder`` to its file ``rel`` that is a symbolic link or a mount point (of
    another device, or a folder bound from the same one: see :func:`mount_points`): what is behind it lies elsewhere,
    in a folder datapipe did not make, never written or deleted through. None if none is (or the way ends before)."""
    parts = Path(rel).parts
    if len(parts) < 2:
        return None
    mounts, base = mount_points(), _resolved(folder)  # the folders below it are no links: each is checked first
    try:
        device = os.stat(folder).st_dev
    except OSError:
        return None
    for i in range(1, len(parts)):
        path = folder.joinpath(*parts[:i])
        try:
            st = os.lstat(path)  # one call a folder: a link, or another device than its parent's
        except OSError:
            return None
        if stat.S_ISLNK(st.st_mode) or st.st_dev != device or os.path.join(base, *parts[:i]) in mounts:
            return path
    return None


_RESOLVED: dict[str, tuple[float, str]] = {}  # folder -> (when resolved, its real path): see _resolved


def _resolved(folder: Path) -> str:
    """``os.path.realpath(folder)``, resolved again at most every :data:`MOUNTS_FRESH` seconds."""
    now, key = time.monotonic(), str(folder)
    known = _RESOLVED.get(key)
    if known is not None and now - known[0] < MOUNTS_FRESH:
        return known[1]
    if len(_RESOLVED) > 64:
        _RESOLVED.clear()
    real = os.path.realpath(folder)
    _RESOLVED[key] = (now, real)
    return real


_MOUNTS: tuple[float, frozenset[str]] | None = None  # (when read, the mount points): see mount_points
MOUNTS_FRESH = 1.0  # seconds a reading of the mount table serves: a scan of thousands of files reads it once


def mount_points() -> frozenset[str]:
    """The mount points of this process's file systems (Linux's /proc/self/mountinfo; empty where it cannot be read):
    a folder bound there from the same file system has its device, which ``os.path.ismount`` alone misses. Read
    again at most every :data:`MOUNTS_FRESH` seconds (a node with thousands of mounts takes milliseconds)."""
    global _MOUNTS
    now = time.monotonic()
    known = _MOUNTS
    if known is not None and now - known[0] < MOUNTS_FRESH:
        return known[1]
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as f:
            lines = f.read().splitlines()
    except OSError:
        lines = []
    found = set()
    for line in lines:
        fields = line.split(" ")
        if len(fields) > 4:  # the mount point, its spaces and the like written in octal (\040)
            found.add(re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), fields[4]))
    _MOUNTS = (now, frozenset(found))
    return _MOUNTS[1]


def is_mount(path: str | os.PathLike) -> bool:
    """Whether the folder ``path`` (no link itself) is a mount point: of another device, or one of
    :func:`mount_points` (a folder bound from the same file system)."""
    path = Path(path)
    return os.path.ismount(path) or os.path.join(_resolved(path.parent), path.name) in mount_points()


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` to a temporary name beside ``path``, fsync it and rename it over ``path``:
    a reader sees the old file or the new one, never half of one."""
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """:func:`atomic_write_text` of bytes: no half-written temporary is left beside ``path`` either (a full disk,
    a size limit)."""
    tmp = path.with_name(f"{TMP_PREFIX}{path.name}.{uuid.uuid4().hex[:8]}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def fsync_dir(path: Path) -> None:
    """Make the renames and new entries of a folder durable (silently skipped where a folder
    cannot be opened for it)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# The exact names of what datapipe writes through a temporary name (see TMP_PREFIX): in shards/, a shard's
# folder being written (ShardWriter: .tmp-000012-1a2b3c4d) or one being replaced (.tmp-stale-000012.zarr-PID);
# in the output folder, atomic_write_bytes's files (.tmp-manifest.json.1a2b3c4d, .tmp-labels.npy.1a2b3c4d) and
# the labels as earlier versions wrote them (.tmp-labels.npy).
SHARD_TEMPS = re.compile(r"\.tmp-(\d{6,9}-[0-9a-f]{8}|stale-\d{6,9}\.zarr-\d+)")
OUTPUT_TEMPS = re.compile(r"\.tmp-(((manifest|report|build|paths)\.json|labels\.npy)\.[0-9a-f]{8}|labels\.npy)")


def remove_stale_temps(folder: Path, names: re.Pattern[str] = SHARD_TEMPS) -> int:
    """Remove what a killed run left in ``folder`` under a temporary name: only entries whose whole name
    matches ``names`` (a user's ``.tmp-notes`` stays), folders and files alike; return how many."""
    removed = 0
    if folder.is_dir():
        for entry in folder.iterdir():
            if not names.fullmatch(entry.name):
                continue
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                with contextlib.suppress(OSError):
                    entry.unlink()
            removed += not os.path.lexists(entry)
    return removed


def holds(path: str | os.PathLike, data: bytes) -> bool:
    """Whether ``path`` is a regular file of exactly these bytes (a larger one is not read)."""
    try:
        return read_regular(path, len(data)) == data
    except (OSError, NotRegularFile, FileTooLarge):
        return False
