"""Streaming a cache from object storage: the node-local shard cache under a remote cache.

``StreamingDataset("s3://bucket/cache", local_cache="/nvme/datapipe")`` opens a cache that lives in
an object store by downloading its small files (manifest, labels, paths) into
``local_cache/<build id>/`` and then each shard's data file (and sample index) when a reader first
needs it — or before, when the prefetch thread, following the order this process will read,
gets there first. The folder has the layout of a local cache, so :class:`~datapipe.cache.Cache`
reads it through its usual hot path; the only hook is :meth:`ShardFetcher.hold`, called when a
shard file is opened, and :meth:`ShardFetcher.ensure_index` before a sample index is read.

Why each rule holds:

- **Nothing partial is visible.** A file is downloaded to a temporary name in the build folder's
  ``.datapipe-partial/`` (``<path, "/" as "%2F">.part-<pid>-<random>``), its crc32c (and size) checked
  against the manifest — taken as the bytes arrive — and renamed into place: a killed download leaves
  only a temporary file, which the next download of that file removes (or the next opening of the
  cache, when no process is downloading that file). A mismatch is downloaded
  again (``retries`` times in all), then a CorruptShardError naming the shard and the object.
- **One download per shard per node.** Every process on the node (ranks, DataLoader workers) takes an
  ``flock`` on ``.datapipe-locks/<shard>.lock``: exclusive to download, shared while the shard is open
  for reading. A waiting process sees the download's temporary file grow; when nothing arrives for
  ``timeout`` seconds it raises instead of waiting for ever.
- **Eviction touches only what it downloaded.** The lock file records the identity (inode, size,
  mtime) of each file downloaded under it; beyond ``cache_limit`` the least recently used shard data
  files (the lock file's mtime is the access stamp) whose identity still matches are deleted — never a
  file of another name or identity, never one whose lock is held (open by a reader, or downloading).
  The limit is kept by evicting before each download, shards finished in this epoch first (see
  ``FINISHED_BELOW_NS``), then those read again furthest ahead; shards held open by readers cannot be
  evicted, so the folder may exceed the limit by what is open at once (each process keeps open the
  shards its plan reads at once, see :meth:`ShardFetcher.follow`).
- **A copy is a download; anything else in the way is the user's.** A file at a download's place that
  is not the one recorded there (a node cache copied, moved or restored: new inodes) is recorded as
  this node's when its size and crc32c are the manifest's, byte for byte the store's object; one that
  differs is never replaced: a CacheError names every such file of the build's folder at once.
- **The node's disk is not the store.** A full, read-only or forbidden ``local_cache`` is one line
  naming it (CacheError, ArgumentError), never retried nor reported as the store's failure.
- **No hang.** A store that stops answering is a RemoteStoreError after ``timeout`` seconds without
  a byte arriving (the transfer runs in its own thread; the caller stops waiting for it).
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import numbers
import os
import queue
import re
import stat
import threading
import time
import uuid
import weakref
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np

from ._threads import renew_after_fork
from .cache import LOCAL_CACHE_MARKER, Cache
from .errors import (
    FULL_DISK,
    TOO_LARGE_ADVICE,
    ArgumentError,
    CacheError,
    CorruptShardError,
    DatapipeError,
    RemoteStoreError,
    check_path,
    local_os_error,
    one_line,
)
from .files import (
    atomic_write_text,
    crc32c,
    crc32c_range,
    few_entries,
    file_crc32c,
    free_mib,
    link_on_the_way,
    make_dirs,
)
from .records import INDEX_ROW_BYTES, MANIFEST, Manifest, parse_json, parse_manifest
from .remote import connect, is_s3fs, past_the_end
from .shards import SHARDS_DIR, images_path, index_path
from .text import show

log = logging.getLogger("datapipe.fetch")

MARKER = LOCAL_CACHE_MARKER  # in the local cache folder and in each build's folder under it
LOCKS = ".datapipe-locks"  # <shard name>.lock: the flock and the record of the files downloaded under it
DOWNLOADS = ".datapipe-downloads"  # one JSON line per file downloaded (what, bytes, pid, time)
DOWNLOADS_LIMIT = 8 << 20  # the log's size beyond which its lines so far become DOWNLOADS.1
EVICT_LOCK = ".datapipe-evict.lock"
FILES_LOCK = "_files"  # the lock of the manifest's own files (labels, paths)
PART = ".part-"
PARTIAL = ".datapipe-partial"  # downloads in progress: <path with "/" as "%2F">.part-<pid>-<random>, renamed into place

# The temporary files of this process's downloads in progress. A download in a prefetch (daemon) thread when the
# interpreter exits would never reach its own clean-up: at exit, _exiting stops every transfer at its next chunk
# (and any not yet begun), each removes its file as it ends, and what is left after EXIT_WAIT_SECONDS is removed
# (a thread still writing one writes on into the unlinked file), with any file of this process in the folders
# its downloads used (one a transfer created at that very moment). A process killed outright leaves its own for
# the next open to remove.
_parts: set[Path] = set()
_part_dirs: set[Path] = set()
_parts_lock = threading.Lock()
_exiting = threading.Event()
EXIT_WAIT_SECONDS = 2.0


class _Exiting(Exception):
    """The interpreter is exiting: a download stops (its temporary file is removed)."""


@atexit.register
def _remove_parts_at_exit() -> None:
    _exiting.set()
    deadline = time.monotonic() + EXIT_WAIT_SECONDS
    while time.monotonic() < deadline:
        with _parts_lock:
            if not _parts:
                break
        time.sleep(0.01)
    with _parts_lock:
        left, folders = list(_parts), list(_part_dirs)
    mine = f"{PART}{os.getpid()}-"
    for folder in folders:
        with contextlib.suppress(OSError):
            left += [Path(entry.path) for entry in os.scandir(folder) if mine in entry.name]
    for path in left:
        with contextlib.suppress(OSError):
            os.unlink(path)
# A lock file's mtime is its shard's access stamp; a shard every reader of this process has finished in
# this epoch gets a stamp below this (1970, ordered by when it was finished): evicted before any other.
FINISHED_BELOW_NS = 10**15
_RECORD_LOCK = threading.Lock()  # the read-modify-write of a lock file's record by this process's threads
MANIFEST_LIMIT = 1 << 30
_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12,
          "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def is_url(location: object) -> bool:
    """Whether ``location`` is a URL (``s3://...``, ``gs://...``) rather than a local path."""
    from .remote import is_url as url

    return url(location)


def open_cache(path: str | Path, *, local_cache: str | os.PathLike | None = None,
               cache_limit: int | str | None = None, storage_options: dict | None = None,
               prefetch: int | str | None = None, timeout: float | None = None) -> Cache:
    """Open a finished cache for random access (see :class:`Cache`); ``datapipe.open``.

    Args:
        path: the cache's folder (or ``file://`` URL), or a cache in object storage (an fsspec URL such
            as ``s3://bucket/cache``), whose shards are downloaded into ``local_cache`` when first read.
        local_cache: for a cache in object storage: the node-local folder its shards are downloaded
            into (see :mod:`datapipe.fetch`); required for a URL.
        cache_limit: for a cache in object storage: bytes (or a size such as ``"200GB"``) ``local_cache``
            may hold, as for :class:`datapipe.StreamingDataset`; None: the default.
        storage_options: for a cache in object storage: fsspec's options for its store (credentials,
            ``endpoint_url``, ...).
        prefetch: for a cache in object storage: shards downloaded ahead of the reader (an int), or
            bytes ahead (``"2GB"``); None: the default.
        timeout: for a cache in object storage: seconds without a byte arriving before a download raises
            RemoteStoreError; None: the default.

    Raises:
        ArgumentError: a URL without ``local_cache``, or these arguments for a cache read in place.
        CacheError: no finished cache there (a build still writing it is named).
    """
    from .remote import local_path

    if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
        raise ArgumentError(f"the cache must be a folder or a URL (a str or path), got {show(path)}")
    check_path(path, "the cache")
    named = {"local_cache": local_cache, "cache_limit": cache_limit, "storage_options": storage_options,
             "prefetch": prefetch, "timeout": timeout}
    given: dict[str, Any] = {name: value for name, value in named.items() if value is not None}
    if local_cache is None:  # a file:// URL is the folder it names, read in place (with local_cache: streamed)
        path = local_path(path)
    if is_url(path):
        if local_cache is None:
            raise ArgumentError(f"{path} is in object storage: pass local_cache= (a node-local folder its shards "
                                "are downloaded into)")
        given.pop("local_cache")
        return ShardFetcher(str(path), local_cache, **given).open()
    if given:
        raise ArgumentError(f"{', '.join(given)}: for a cache in object storage (a URL such as s3://bucket/cache) "
                            f"only; {show(str(path))} is read in place, so leave "
                            f"{'it' if len(given) == 1 else 'them'} out")
    return Cache(path)


def parse_size(value: object, what: str) -> int:
    """Bytes from an int or a size such as ``"200GB"``, ``"1.5 TiB"``, ``"500MB"`` (decimal and binary units)."""
    if isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_)) and value >= 0:
        return int(value)
    if isinstance(value, str):
        m = re.fullmatch(r"\s*(\d{1,30}(?:\.\d{0,30})?|\.\d{1,30})\s*([A-Za-z]*)\s*", value)
        if m and m.group(2).lower() in _UNITS:  # (more digits are no size: float() of 400 is infinite)
            return int(Fraction(m.group(1)) * _UNITS[m.group(2).lower()])  # exact, as a decimal is written
    raise ArgumentError(f"{what} must be a number of bytes or a size such as '200GB' or '1.5TiB', got {show(value)}")


def downloads(folder: str | Path) -> list[dict]:
    """The downloads recorded in a build's local folder (``local_cache/<build id>``), oldest first (the
    log is kept to its last ``DOWNLOADS_LIMIT`` bytes or so: the earlier part is moved to ``<log>.1``,
    which replaces the one before)."""
    found = []
    for name in (DOWNLOADS + ".1", DOWNLOADS):
        try:
            text = (Path(folder) / name).read_text(encoding="utf-8")
        except FileNotFoundError:
            continue
        for line in text.splitlines():
            with contextlib.suppress(ValueError):
                found.append(json.loads(line))
    return found


class _Progress:
    """Bytes a transfer has written so far (an fsspec callback), and the crc32c of the file's bytes as they arrive.

    Transfers write a file in order (s3fs and gcsfs chunk by chunk; s3fs's concurrent parts too, each
    written in turn over a file pre-sized with zeros), so once ``value`` bytes are reported the bytes
    below ``value`` are final. Every ``CHECK_EVERY`` bytes the callback wakes the thread waiting for the
    transfer (``ready``), which reads them back (still in the page cache) and carries their crc on
    (:meth:`catch_up`): the transfer's own thread (the event loop of every transfer, on an async
    filesystem) does no more than count, and the checksum is done when the last byte arrives. A
    transfer that writes out of order gives a crc that differs from the manifest's; the caller checks
    the whole file again before it calls that a mismatch. ``cancelled`` tells a late transfer to stop
    counting. An S3 transfer takes the crc itself as it writes (:func:`_s3_get`): it only counts here.
    """

    CHECK_EVERY = 1 << 20
    BUFFER = 1 << 20

    def __init__(self, path: Path | None = None) -> None:
        self.value = 0
        self.cancelled = False
        self.ready = threading.Event()
        self._path = path
        self._fd = -1
        self._buf: np.ndarray | None = None
        self._signalled = 0
        self.crc = 0
        self.checked = 0  # the crc covers the file's bytes [0, checked)

    def set_size(self, size: Any) -> None:
        pass

    def absolute_update(self, value: int) -> None:
        if _exiting.is_set():
            raise _Exiting()
        self.value = int(value)
        self._signal()

    def relative_update(self, inc: int = 1) -> None:
        if _exiting.is_set():
            raise _Exiting()
        self.value += int(inc)
        self._signal()

    def _signal(self) -> None:
        if self.value - self._signalled >= self.CHECK_EVERY and not self.cancelled:
            self._signalled = self.value
            self.ready.set()

    def catch_up(self, *, to_end: bool = False) -> None:
        """Carry the crc over the bytes that arrived (to the end of the file once the transfer ended)."""
        if self._path is None or self.cancelled:
            return
        try:
            if self._fd < 0:
                self._fd = os.open(self._path, os.O_RDONLY | os.O_CLOEXEC)
                self._buf = np.empty(self.BUFFER, dtype=np.uint8)
            assert self._buf is not None
            self.crc, self.checked = crc32c_range(self._fd, self.checked, None if to_end else self.value,
                                                  self._buf, self.crc)
        except OSError:
            self._path = None  # the file went away: the caller reads it whole

    def finish(self) -> tuple[str, int] | None:
        """(crc32c, size) of the whole file once the transfer has ended, reading only what was not
        read as it arrived; None when it could not be followed (the caller reads the file)."""
        self.catch_up(to_end=True)
        if self._path is None or self._fd < 0 or self.checked != os.fstat(self._fd).st_size:
            return None
        return f"{self.crc:08x}", self.checked

    def unfollowed(self) -> None:
        """The transfer takes the checksum itself: nothing is read back (``finish`` gives None)."""
        self._path = None

    def close(self) -> None:
        self.cancelled = True
        self._path = None
        fd, self._fd = self._fd, -1
        if fd >= 0:
            os.close(fd)

    def branched(self, *args: Any, **kwargs: Any) -> None:
        return None

    def branch_coro(self, fn: Any) -> Any:
        return fn

    def call(self, *args: Any, **kwargs: Any) -> None:
        pass


class Hold:
    """A shard held open by a reader: a shared flock on its lock file, so it is not evicted; release it once."""

    __slots__ = ("fd",)

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def release(self) -> None:
        fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)  # closing the descriptor releases its flock


# The longest wait for a byte a timeout may ask for: longer ones overflowed the clock ("timestamp out of range")
# and were reported as the store's failure.
MAX_TIMEOUT = 86_400


class ShardFetcher:
    """The node-local shard cache of one remote cache (see the module's docstring).

    Args:
        url: the remote cache, an fsspec URL (``s3://bucket/cache``).
        local_cache: the node-local folder shared by every process on the node.
        storage_options: passed to fsspec (credentials, ``endpoint_url``...).
        cache_limit: bytes (or ``"200GB"``) the local cache may hold; None: no limit.
        prefetch: shards to download ahead of the reader (an int), or bytes ahead (``"2GB"``); 0: none.
        timeout: seconds without a byte arriving before a download (or the wait for another
            process's download) raises RemoteStoreError.
        retries: downloads of one file in all before a checksum mismatch is a CorruptShardError.
    """

    def __init__(self, url: str, local_cache: str | os.PathLike, *, storage_options: dict | None = None,
                 cache_limit: int | str | None = None, prefetch: int | str = 2, timeout: float = 60.0,
                 retries: int = 3) -> None:
        if not is_url(url):
            raise ArgumentError(f"a remote cache is a URL such as s3://bucket/cache, got {show(url)}")
        if not isinstance(local_cache, (str, os.PathLike)) or is_url(local_cache) or not os.fspath(local_cache):
            # "" would be the working folder, whatever it is
            raise ArgumentError(f"local_cache must be a local folder (shared by the node's processes), got {show(local_cache)}")
        if storage_options is not None and not isinstance(storage_options, dict):
            raise ArgumentError(f"storage_options must be a dict, got {type(storage_options).__name__}")
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float, numbers.Real)) or not 0 < timeout <= MAX_TIMEOUT:
            raise ArgumentError(f"timeout must be a positive number of seconds, at most {MAX_TIMEOUT:,} (a day), "
                                f"got {show(timeout)}")
        if isinstance(retries, bool) or not isinstance(retries, (int, numbers.Integral)) or retries < 1:
            raise ArgumentError(f"retries must be an integer >= 1, got {show(retries)}")
        self.url = url.rstrip("/")
        self.storage_options = dict(storage_options or {})
        self.local_root = Path(check_path(local_cache, "local_cache")).expanduser().absolute()
        self.limit: int | None = None if cache_limit is None else parse_size(cache_limit, "cache_limit")
        if isinstance(prefetch, str):
            self._prefetch_bytes: int | None = parse_size(prefetch, "prefetch")
            self._prefetch_shards = 0
        elif isinstance(prefetch, (int, np.integer)) and not isinstance(prefetch, bool) and prefetch >= 0:
            self._prefetch_bytes, self._prefetch_shards = None, int(prefetch)
        else:
            raise ArgumentError(f"prefetch must be a number of shards (an int >= 0) or bytes ahead ('2GB'), got {show(prefetch)}")
        self.timeout = float(timeout)
        self.retries = int(retries)
        self.folder = self.local_root  # the build's folder, set by open()
        self.manifest: Manifest | None = None
        self.opened = ""  # the sha256 of the manifest opened (set by open())
        self._init_runtime()

    # ----------------------------------------------------------------- process-local state
    def _init_runtime(self) -> None:
        renew_after_fork(self, "_after_fork")
        self._fs: Any = None
        self._fs_pid = -1
        self._root = ""
        self._lock = threading.Lock()
        self._rel_cache: dict[int, tuple[str, str]] = {}
        self._shard_numbers: dict[str, int] | None = None
        self._follower: _Follower | None = None
        self._open_files: Any = None  # weakref to the Cache's open shard files (their limit follows the plan)
        self._open_cap = 1 << 20
        self.downloaded_bytes = 0  # by this process
        self._warned = False

    def _after_fork(self) -> None:
        """In a child made by fork, which has none of the parent's threads: a new lock (a prefetch thread of the
        parent may have held it) and no prefetch plan (its downloads in flight never end here)."""
        self._lock = threading.Lock()
        self._follower = None

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        for key in ("_fs", "_fs_pid", "_root", "_lock", "_rel_cache", "_shard_numbers", "_follower", "_open_files", "_open_cap",
                    "downloaded_bytes", "_warned"):
            state.pop(key, None)
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._init_runtime()

    def __repr__(self) -> str:
        return f"ShardFetcher({self.url!r}, local_cache={str(self.local_root)!r}, cache_limit={self.limit})"

    def filesystem(self) -> tuple[Any, str]:
        """(fsspec filesystem, root path inside it), made once per process (never shared across a fork)."""
        if self._fs is None or self._fs_pid != os.getpid():
            fs, root = _open_filesystem(self.url, self.storage_options, self.timeout)
            connect(fs, self.timeout, self.url)  # under a deadline of its own, not the first download's
            self._fs, self._root, self._fs_pid = fs, root, os.getpid()
        return self._fs, self._root

    # ----------------------------------------------------------------- opening
    def open(self) -> Cache:
        """Download the manifest and its files (labels, paths) into ``local_cache/<build id>/`` and open
        the local folder as a :class:`Cache` that downloads shards through this fetcher."""
        raw = self._read_small(MANIFEST)
        where = f"{self.url}/{MANIFEST}"  # a URL, never a Path (s3:// -> s3:/)
        manifest = parse_manifest(parse_json(raw, where), where)
        build = manifest.build_id or "m-" + hashlib.sha256(raw).hexdigest()[:32]
        self.manifest = manifest
        self.opened = hashlib.sha256(raw).hexdigest()  # the manifest opened: a rebuild in the store replaces it
        try:
            self.local_root.mkdir(parents=True, exist_ok=True)
            _write_marker(self.local_root, {"format": "datapipe-local-cache"})
            self.folder = self.local_root / build
            if os.path.islink(self.folder):  # its files would be neither counted against cache_limit nor its own
                raise CacheError(f"{self.folder} is a symbolic link (to {os.readlink(self.folder)}): a node cache keeps "
                                 "its shards, and its limit, in a folder of its own; remove the link and give "
                                 "local_cache= the folder on the other disk instead")
            (self.folder / LOCKS).mkdir(parents=True, exist_ok=True)
            _write_marker(self.folder, {"format": "datapipe-local-cache", "url": self.url, "build_id": manifest.build_id})
        except OSError as exc:
            if exc.errno in FULL_DISK:
                raise CacheError(f"local_cache {self.local_root}: {exc.strerror or exc} while its folders were made"
                                 f"{self._full_disk_advice()}") from None
            raise ArgumentError(f"local_cache {self.local_root} cannot be used ({exc.strerror or exc}); pass a "
                                "writable local folder") from None
        # A read-only or full local_cache fails here (the lock files are opened for writing): one line, not the store's.
        with self._local_writes("the manifest's files"), self._locked(FILES_LOCK, fcntl.LOCK_EX, FILES_LOCK) as fd:
            wanted = {MANIFEST: (f"{crc32c(raw):08x}", len(raw), False),
                      **{rec.name: (rec.crc32c, None, False) for rec in manifest.files.values()}}
            for rel in self._take_or_refuse(fd, wanted, recheck=True):  # small files: checked at every opening
                if rel == MANIFEST:
                    atomic_write_text(self.folder / MANIFEST, raw.decode("utf-8"))
                    self._record(fd, MANIFEST, os.stat(self.folder / MANIFEST), evict=False, crc=wanted[MANIFEST][0])
                else:
                    self._fetch_file(fd, rel, wanted[rel][0], None, f"{rel} of {self.url}", evict=False)
        self._reclaim_temps()
        return Cache(self.folder, remote=self)

    def _reclaim_temps(self) -> None:
        """Remove the temporary files that killed downloads left in ``PARTIAL`` and that no process is
        downloading now (their file's lock is free): the next download of a file removes them too, but a
        shard never read again would keep them for ever. Anything else in the folder is kept."""
        assert self.manifest is not None
        files = {rec.name for rec in self.manifest.files.values()}
        with contextlib.suppress(OSError):
            for entry in list(os.scandir(self.folder / PARTIAL)):
                head, part, _ = entry.name.partition(PART)
                rel = head.replace("%2F", "/").replace("%25", "%")  # _temp_name's inverse
                shard = self._shard_holding(rel)
                lock = (self.manifest.shards[shard].name if shard is not None
                        else FILES_LOCK if rel in files else None)
                if not part or lock is None:
                    continue
                fd = self._lock_fd(lock)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    with contextlib.suppress(OSError):
                        os.unlink(entry.path)
                except BlockingIOError:
                    pass  # downloading now, in another process
                finally:
                    _close_step_lock(fd)

    def _read_small(self, name: str) -> bytes:
        """A small object of the remote cache (the manifest), read whole with the same timeout."""
        fs, root = self.filesystem()
        rpath = f"{root}/{name}"

        def read() -> bytes:
            try:
                return fs.cat_file(rpath, start=0, end=MANIFEST_LIMIT)
            except FileNotFoundError:
                raise
            except OSError as exc:
                if past_the_end(exc):  # an empty object
                    return b""
                raise

        future = _transfers().submit(read)
        try:
            return future.result(timeout=self.timeout)
        except FutureTimeout:
            raise RemoteStoreError(f"{self.url}/{name}: the store did not answer within {self.timeout:g} s; check "
                                   "the endpoint and that the store is up, or raise timeout=") from None
        except FileNotFoundError:
            from .remote import Location, no_manifest

            raise no_manifest(Location(self.url, fs, root, self.storage_options, self.timeout)) from None
        except DatapipeError:
            raise
        except Exception as exc:  # noqa: BLE001 - fsspec backends raise their own kinds
            raise RemoteStoreError(f"{self.url}/{name} cannot be read: {one_line(exc)}; check the URL, the "
                                   "credentials (storage_options) and that the store is up") from None

    # ----------------------------------------------------------------- paths and records
    def _rels(self, shard: int) -> tuple[str, str]:
        """(sample index, data file) of a shard, relative to the cache (made once: pathlib is slow)."""
        rels = self._rel_cache.get(shard)
        if rels is None:
            assert self.manifest is not None
            folder = Path(SHARDS_DIR) / self.manifest.shards[shard].name
            rels = self._rel_cache[shard] = (index_path(folder).as_posix(),
                                             images_path(folder, self.manifest.layout).as_posix())
        return rels

    def _rel_data(self, shard: int) -> str:
        return self._rels(shard)[1]

    def _shard_holding(self, rel: str) -> int | None:
        """The shard whose folder holds ``rel`` (``shards/<name>/...``); None for a file outside them."""
        assert self.manifest is not None
        if self._shard_numbers is None:
            self._shard_numbers = {rec.name: s for s, rec in enumerate(self.manifest.shards)}
        parts = rel.split("/", 2)
        return self._shard_numbers.get(parts[1]) if len(parts) == 3 and parts[0] == SHARDS_DIR else None

    def shard_of(self, rel: str) -> int | None:
        """The shard whose data file is ``rel``; None for any other file."""
        shard = self._shard_holding(rel)
        return shard if shard is not None and rel == self._rel_data(shard) else None

    def _rel_index(self, shard: int) -> str:
        return self._rels(shard)[0]

    def _indexed(self) -> bool:
        assert self.manifest is not None
        return self.manifest.layout == "indexed"

    def _present(self, shard: int, fd: int) -> bool:
        """The shard's files are in place, each the very file downloaded under its lock (``fd``, held) as the
        object the manifest names now (see :func:`_current`)."""
        record = _read_record(fd)
        return all(self._ours(fd, rel, record) and _current(record[rel], self._want(shard, rel)[0])
                   for rel in self._shard_rels(shard))

    def _ours(self, fd: int, rel: str, record: dict[str, dict] | None = None) -> bool:
        """``rel`` is in place and is the file this node downloaded (the record in the lock file, held;
        ``record``: that record, read already)."""
        entry = (_read_record(fd) if record is None else record).get(rel)
        return entry is not None and _same_file(self.folder, rel, entry)

    def _in_place(self, shard: int, rel: str) -> bool:
        """``rel`` is the file this node downloaded, by its record read without the lock (a record being
        rewritten reads as empty: the caller then takes the lock and looks again)."""
        assert self.manifest is not None
        entry = _peek_record(self._lock_path(self.manifest.shards[shard].name)).get(rel)
        return entry is not None and _same_file(self.folder, rel, entry) and _current(entry, self._want(shard, rel)[0])

    def _want(self, shard: int, rel: str) -> tuple[str, int, bool]:
        """(crc32c, size, evictable) the manifest gives the shard's data file or sample index ``rel``."""
        assert self.manifest is not None
        rec = self.manifest.shards[shard]
        if rel == self._rel_data(shard):
            return rec.crc32c, rec.nbytes, True
        return rec.index_crc32c, rec.count * INDEX_ROW_BYTES, False

    def _take_or_refuse(self, fd: int, wanted: dict[str, tuple[str, int | None, bool]], *,
                        recheck: bool = False) -> list[str]:
        """The files of ``wanted`` (path -> the manifest's crc32c, size or None, evictable) to download, under
        their lock ``fd`` (held exclusively).

        A file in place that is not the one recorded as downloaded here (a copied, moved or restored node
        cache has new inodes) is taken as this node's download when its size and crc32c are the manifest's:
        it is byte for byte the store's object. One that differs is no file datapipe may replace (datapipe
        deletes only what it downloaded): CacheError naming it and every other file of the folder that a
        stat shows to differ. ``recheck``: files recorded here are checked too (the manifest's own small
        files), and downloaded again when they differ."""
        record = _read_record(fd)
        todo: list[str] = []
        refused: dict[str, str] = {}
        for rel, (crc, size, evict) in wanted.items():
            ours = self._ours(fd, rel, record)
            current = ours and _current(record[rel], crc)
            if current and not recheck:
                continue
            if not ours and not os.path.lexists(self.folder / rel):
                todo.append(rel)
                continue
            why, st = _differs(self.folder / rel, crc, size)
            if why is None and st is not None:
                if not current:
                    self._record(fd, rel, st, evict=evict, crc=crc)
            elif ours:
                todo.append(rel)  # this node's own download, since altered: replaced
            else:
                refused[rel] = why or "cannot be read"
        if refused:
            raise self._refusal(refused)
        return todo

    def _refusal(self, refused: dict[str, str]) -> CacheError:
        """The error for files in the way of downloads (``refused``: path -> how it differs, checked now), naming
        also the folder's other files that a stat shows to differ from the manifest (a size of its own, or
        not a regular file) and are not those recorded as downloaded here."""
        assert self.manifest is not None
        found = dict(refused)
        for shard, rec in enumerate(self.manifest.shards):
            if not rec.count:
                continue
            record = _peek_record(self._lock_path(rec.name))
            for rel in self._shard_rels(shard):
                if rel in found or (rel in record and _same_file(self.folder, rel, record[rel])):
                    continue
                try:
                    st = os.lstat(self.folder / rel)
                except OSError:
                    continue
                size = self._want(shard, rel)[1]
                if not stat.S_ISREG(st.st_mode):
                    found[rel] = "not a regular file"
                elif st.st_size != size:
                    found[rel] = f"{st.st_size:,} bytes, the manifest's {size:,}"
        names = [f"{rel} ({why})" for rel, why in sorted(found.items())]
        shown = "; ".join(names[:6]) + (f"; and {len(names) - 6} more" if len(names) > 6 else "")
        return CacheError(f"node cache {self.folder} holds {len(found)} file{'s' if len(found) > 1 else ''} that "
                          f"{'are' if len(found) > 1 else 'is'} not what datapipe downloaded there and differ"
                          f"{'' if len(found) > 1 else 's'} from the store's objects (damaged, or put there): {shown}; "
                          f"datapipe deletes no file it did not write: remove the folder {self.folder} (it holds "
                          f"only copies of {self.url}, downloaded again as they are needed) and run again")

    @contextlib.contextmanager
    def _local_writes(self, what: str, *, doing: str | None = None) -> Iterator[None]:
        """A failure of this machine's disk while ``what`` is made local (see :func:`datapipe.errors.local_os_error`)
        as one line naming ``local_cache``, never as the store's: a full disk is a CacheError saying how much is
        free and that ``cache_limit`` keeps the folder under a size; a read-only or forbidden folder is the
        ArgumentError that an unwritable ``local_cache`` gets when it is opened. ``doing``: what was under way, where
        it was no download ("making room for ...")."""
        try:
            yield
        except OSError as exc:
            if exc.errno in (errno.ENOENT, errno.ENOTDIR, errno.EEXIST) and self._inside(exc.filename):
                # the node cache's own folders removed (rm -rf local_cache) or replaced by a file while it ran
                happened = "is in the way (a file where a folder of it belongs)" if exc.errno == errno.EEXIST else \
                    "is gone"
                raise CacheError(f"local_cache {self.local_root}: {exc.filename} {happened} while "
                                 f"{doing or what + ' was made local'}: its folders were removed or replaced while "
                                 "readers used it; leave them to datapipe (cache_limit bounds its size) and run "
                                 "again") from None
            if not local_os_error(exc):
                raise
            reason = exc.strerror or one_line(exc)
            if exc.errno == errno.EFBIG:
                raise CacheError(f"local_cache {self.local_root}: {reason} while "
                                 f"{doing or what + ' was downloaded into it'}: "
                                 f"{TOO_LARGE_ADVICE} or put local_cache on another file system, and run again") from None
            if exc.errno not in FULL_DISK:
                raise ArgumentError(f"local_cache {self.local_root} cannot be used ({reason}); pass a writable "
                                    "local folder") from None
            raise CacheError(f"local_cache {self.local_root}: {reason} while {doing or what + ' was downloaded into it'}"
                             f"{self._full_disk_advice()}") from None

    def _full_disk_advice(self) -> str:
        """Why this node cache's disk filled, and what to do, for the end of a message: its file entries (inodes)
        used up, no ``cache_limit``, a limit above what the disk holds, or one within it (the shards open for
        reading, which are never evicted, or other files outgrew the disk)."""
        try:
            st = os.statvfs(self.local_root)
        except OSError:
            st = None
        if st is not None and few_entries(st) and st.f_bavail * st.f_frsize >= 2**20:
            return (f"; {st.f_favail:,} file entries (inodes) are left on its disk, whatever its free bytes (`df -i` "
                    "shows them): free some there, or put local_cache on another file system, and run again")
        free = f", {mib} free on its disk now" if (mib := free_mib(self.local_root)) else ""
        if self.limit is None:
            return (f"{free}; no cache_limit is set: set one below the space the node may use there (least recently "
                    "used shards are evicted to stay under it), or free space there, and run again")
        held = _scan(self.local_root)[0]
        if st is None or self.limit > held + st.f_bavail * st.f_frsize:
            return f"{free}; its cache_limit of {self.limit:,} bytes is more than its disk holds: lower it, or free " \
                   "space there, and run again"
        return (f"{free}, {held:,} bytes held by its downloaded shards, though its cache_limit of {self.limit:,} bytes is "
                "within what the disk holds: the shards open for reading at once (never evicted while they are read) "
                "or other files there outgrew the disk; free space there, or read fewer shards at once (fewer "
                "DataLoader workers or ranks on the node, a smaller window), and run again")

    def _inside(self, path: object) -> bool:
        """Whether ``path`` (an OSError's file name) lies in this node cache's folder."""
        if not isinstance(path, (str, os.PathLike)):
            return False
        return os.path.abspath(path).startswith(os.path.join(os.path.abspath(self.local_root), ""))

    def _lock_path(self, name: str) -> Path:
        return self.folder / LOCKS / f"{name}.lock"

    @staticmethod
    def _record(fd: int, rel: str, st: os.stat_result, *, evict: bool, crc: str) -> None:
        """Record in the lock file (held exclusively) the identity of the file downloaded to ``rel`` and the
        manifest's crc32c of the object it is a copy of — before it is renamed into place (a rename keeps
        inode, size and mtime), so a file in place is always recorded."""
        with _RECORD_LOCK:  # a shard's files are downloaded by two threads of this process at once
            files = _read_record(fd)
            files[rel] = {"path": rel, "ino": st.st_ino, "size": st.st_size, "mtime_ns": st.st_mtime_ns, "evict": evict,
                          "crc32c": crc}
            _write_record(fd, files)

    def _log_download(self, what: str, rel: str, nbytes: int) -> None:
        line = json.dumps({"what": what, "file": rel, "bytes": nbytes, "pid": os.getpid(), "time": time.time()}) + "\n"
        path = self.folder / DOWNLOADS
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            os.write(fd, line.encode())
            if os.fstat(fd).st_size > DOWNLOADS_LIMIT:  # every epoch downloads again what was evicted: bounded
                with contextlib.suppress(OSError):
                    os.replace(path, path.with_name(DOWNLOADS + ".1"))
        finally:
            os.close(fd)
        with self._lock:
            self.downloaded_bytes += nbytes

    def _stamp_finished(self, shards: Sequence[int]) -> None:
        """Give these shards' locks a finished stamp (eviction takes them first; a reader opening one
        again stamps it as used)."""
        assert self.manifest is not None
        base = time.time_ns() // 10**6  # below FINISHED_BELOW_NS, ordered by when they were finished
        for shard in shards:
            with contextlib.suppress(OSError):
                os.utime(self._lock_path(self.manifest.shards[shard].name), ns=(time.time_ns(), base))

    # ----------------------------------------------------------------- locks
    @contextlib.contextmanager
    def _locked(self, name: str, op: int, what: str, temps: Sequence[str] = ()) -> Iterator[int]:
        fd = self._lock_fd(name)
        try:
            self._flock_wait(fd, op, what, temps, lock=name)
            yield fd
        finally:
            _close_step_lock(fd)

    def _lock_fd(self, name: str) -> int:
        """The lock file of ``name``, opened for a step (close it with _close_step_lock, or hand it to a Hold)."""
        return _open_step_lock(str(self._lock_path(name)))

    def _flock_wait(self, fd: int, op: int, what: str, temps: Sequence[str] = (), *, lock: str) -> None:
        """Take the flock of ``fd`` (the lock file of ``lock``); while another process downloads under it, wait
        as long as its temporary files grow."""
        try:
            fcntl.flock(fd, op | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            pass
        seen, since, pause = self._temp_bytes(temps), time.monotonic(), 0.002
        while True:
            time.sleep(pause)
            pause = min(pause * 2, 0.05)
            try:
                fcntl.flock(fd, op | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                pass
            now_bytes = self._temp_bytes(temps)
            if now_bytes != seen:
                seen, since = now_bytes, time.monotonic()
            elif time.monotonic() - since > self.timeout:
                raise RemoteStoreError(f"{what}: another process on this node has been downloading it for "
                                       f"{self.timeout:g} s without a byte arriving (lock {self._lock_path(lock)}); "
                                       "check that the store is up, or raise timeout=")

    @contextlib.contextmanager
    def _exclusive_unless_present(self, shard: int) -> Iterator[int]:
        """The shard's lock held exclusively to download it, or -1 once it is present. Never waits for the
        exclusive lock while readers hold it shared: a shard another process downloaded meanwhile may be
        held open by readers for a long time (ranks waiting for each other at a step)."""
        assert self.manifest is not None
        rec = self.manifest.shards[shard]
        rels = self._shard_rels(shard)
        what = f"shard {rec.name}"
        since, pause, other_state = time.monotonic(), 0.001, None
        while True:
            fd = self._lock_fd(rec.name)
            try:  # the common case first: no other process holds the lock
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                _close_step_lock(fd)
            else:
                try:
                    yield -1 if self._present(shard, fd) else fd
                    return
                finally:
                    _close_step_lock(fd)
            with self._locked(rec.name, fcntl.LOCK_SH, what, rels) as fd:  # waits while another process downloads
                if self._present(shard, fd):
                    yield -1
                    return
                if other_state is None:  # a copy of another state of the shard, which readers hold: whose is stale?
                    record = _read_record(fd)
                    other_state = all(self._ours(fd, rel, record) for rel in rels)
                    rebuilt = self._rebuilt() if other_state else ""
                    if rebuilt:  # this reader's: the cache was rebuilt in place since it was opened
                        raise CorruptShardError(f"{what}: {rebuilt}")
            if time.monotonic() - since > self.timeout:
                if other_state:  # the readers' copy is stale: they opened the cache before it was rebuilt in place
                    raise RemoteStoreError(
                        f"{what}: this node's copy is of the cache before it was rebuilt in place, and another process "
                        f"still reads it (it holds {self._lock_path(rec.name)}), so it cannot be replaced; restart the "
                        "jobs that opened the cache before the rebuild (or close() their datasets), or give this one "
                        "another local_cache")
                if not all(os.path.exists(self.folder / rel) for rel in rels):  # removed under its readers
                    raise CacheError(f"{what}: this node's copy of it was removed from {self.folder} while another "
                                     f"process reads it (it holds {self._lock_path(rec.name)}), and it cannot be "
                                     "downloaded again until that process lets go: the node cache's files are "
                                     "datapipe's; stop the readers and run again")
                raise RemoteStoreError(f"{what}: its lock {self._lock_path(rec.name)} was never free to download it "
                                       f"in {self.timeout:g} s (other processes on this node read the shard all that "
                                       "time); raise timeout=")
            time.sleep(pause)
            pause = min(pause * 2, 0.02)

    def _temp_name(self, rel: str) -> str:
        """The prefix of the temporary files of downloads of ``rel`` in ``PARTIAL`` (one flat folder: a
        download starts before the folders of the shard's layout are made, see :meth:`_fetch_file`)."""
        return rel.replace("%", "%25").replace("/", "%2F") + PART

    def _temps(self, rels: Sequence[str]) -> Iterator[os.DirEntry]:
        """The temporary files of downloads of these files (in progress, or left by a killed one), and
        those that earlier versions wrote beside the file's place."""
        with contextlib.suppress(OSError):
            names = tuple(self._temp_name(rel) for rel in rels)
            for entry in os.scandir(self.folder / PARTIAL):
                if entry.name.startswith(names):
                    yield entry
        for rel in rels:
            final = self.folder / rel
            with contextlib.suppress(OSError):
                for entry in os.scandir(final.parent):
                    if entry.name.startswith(final.name + PART):
                        yield entry

    def _temp_bytes(self, rels: Sequence[str]) -> int:
        total = 0
        for entry in self._temps(rels):
            with contextlib.suppress(OSError):
                total += entry.stat().st_size
        return total

    def _clean_temps(self, rels: Sequence[str], *, spare: int | None = None) -> None:
        """Remove the temporary files a killed download of these files left (the exclusive lock is held);
        those of process ``spare`` are its downloads in progress."""
        mine = f"{PART}{spare}-"
        for entry in self._temps(rels):
            if spare is None or mine not in entry.name:
                with contextlib.suppress(OSError):
                    os.unlink(entry.path)

    # ----------------------------------------------------------------- the Cache's hook
    @property
    def max_open(self) -> int:
        """Shard files one process keeps open before its plan is known: the shards ``cache_limit`` holds
        (:meth:`follow` lowers it to the most shards the plan reads at once)."""
        slots = self.slots()
        return 1 << 20 if slots is None else slots

    def attach(self, files: Any) -> None:
        """The Cache's open shard files (``cache._ShardFiles``): :meth:`follow` sizes their limit from the plan."""
        self._open_files = weakref.ref(files)
        self._open_cap = int(files.limit)

    def open_shards(self) -> set[int]:
        """The shards this process's Cache holds open (they cannot be evicted)."""
        files = self._open_files() if self._open_files is not None else None
        return set() if files is None else set(list(files._open))

    def slots(self) -> int | None:
        """Shard data files ``cache_limit`` holds on this node beside the cache's small files (manifest,
        labels, paths, sample indexes, which are never evicted); None without a limit.

        Not split over the node's ranks: with the ``"shards"`` order they read the same window of shards."""
        if self.limit is None or self.manifest is None:
            return None
        sizes = [s.nbytes for s in self.manifest.shards if s.count]
        small = sum(s.count * 32 for s in self.manifest.shards) if self._indexed() else 0
        for name in (MANIFEST, *(rec.name for rec in self.manifest.files.values())):
            with contextlib.suppress(OSError):
                small += os.stat(self.folder / name).st_size
        return max(1, (self.limit - small) // max(1, max(sizes) if sizes else 1))

    def hold(self, shard: int) -> Hold | None:
        """Make shard ``shard``'s files local (downloading them, or waiting for another process's download)
        and hold it against eviction until :meth:`Hold.release`. None for a shard without samples."""
        assert self.manifest is not None
        rec = self.manifest.shards[shard]
        if rec.count == 0:
            return None
        follower = self._follower
        if follower is not None:
            follower.reached(shard)
            follower.wait_for(shard)  # a download this process's prefetch started: no lock polling
        rels = self._shard_rels(shard)
        for _ in range(8):  # a shard evicted between its download and the shared lock is downloaded again
            with self._local_writes(f"shard {rec.name}"):
                fd = self._lock_fd(rec.name)
            try:
                self._flock_wait(fd, fcntl.LOCK_SH, f"shard {rec.name}", rels, lock=rec.name)
                if self._present(shard, fd):
                    with contextlib.suppress(OSError):
                        os.utime(fd)  # the access stamp eviction orders by
                    _STEP_LOCKS.discard(fd)  # the reader's now, for as long as it reads the shard
                    hold, fd = Hold(fd), -1
                    return hold
            finally:
                if fd >= 0:
                    _close_step_lock(fd)
            self.download(shard)
        self._refuse_links(rels)
        raise RemoteStoreError(f"shard {rec.name}: evicted from {self.folder} again and again before it could be read; "
                               "raise cache_limit (other processes on this node fill it)")

    def _refuse_links(self, rels: list[str]) -> None:
        """CacheError when a folder on the way to one of ``rels`` is a symbolic link or a mount point (see
        :func:`datapipe.files.link_on_the_way`): the node cache never writes or removes behind one."""
        linked = next((link for rel in rels if (link := link_on_the_way(self.folder, rel)) is not None), None)
        if linked is not None:
            raise CacheError(f"{linked} is a symbolic link or a mount point inside the node cache {self.folder}, where "
                             "datapipe writes and removes only files of its own: remove it (what it leads to is left as "
                             "it is)")

    def ensure_index(self, shard: int) -> None:
        """Make an indexed shard's sample index local (the data file is left to :meth:`hold`)."""
        assert self.manifest is not None
        rel = self._rel_index(shard)
        if self._in_place(shard, rel):
            return
        rec = self.manifest.shards[shard]
        with self._local_writes(f"shard {rec.name}"), \
                self._locked(rec.name, fcntl.LOCK_EX, f"shard {rec.name}", [rel]) as fd:
            if not self._take_or_refuse(fd, {rel: self._want(shard, rel)}):
                return
            self._clean_temps([rel])
            self._make_room(rec.count * 32)
            self._fetch_file(fd, rel, rec.index_crc32c, None, f"shard {rec.name}", evict=False)

    def ensure_indexes(self) -> None:
        """Every sample index local, downloaded in parallel (for the table of every sample's shape)."""
        assert self.manifest is not None
        missing = [s for s, rec in enumerate(self.manifest.shards)
                   if rec.count and not (self.folder / self._rel_index(s)).is_file()]
        if missing:
            with ThreadPoolExecutor(max_workers=8, thread_name_prefix="datapipe-index") as pool:
                list(pool.map(self.ensure_index, missing))

    def _shard_rels(self, shard: int) -> list[str]:
        return list(self._rels(shard)) if self._indexed() else [self._rel_data(shard)]

    def download(self, shard: int) -> bool:
        """Download shard ``shard`` unless it is local (one process on the node does; the others wait).
        Returns whether this call downloaded it."""
        assert self.manifest is not None
        rec = self.manifest.shards[shard]
        rels = self._shard_rels(shard)
        with self._local_writes(f"shard {rec.name}"), self._exclusive_unless_present(shard) as fd:
            if fd < 0:
                return False
            # before any transfer starts: nothing is renamed over a file that is not ours
            missing = self._take_or_refuse(fd, {rel: self._want(shard, rel) for rel in rels})
            if not missing:
                os.utime(fd)
                return False  # in place already: copies of the store's objects, now recorded as this node's

            def prepare() -> None:  # while the transfers run
                self._clean_temps(rels, spare=os.getpid())
                self._make_room(rec.nbytes)

            def fetch(rel: str, meanwhile: Any = None) -> None:
                data = rel == self._rel_data(shard)
                self._fetch_file(fd, rel, rec.crc32c if data else rec.index_crc32c, rec.nbytes if data else None,
                                 f"shard {rec.name}", evict=data, meanwhile=meanwhile)

            # the sample index and the data file at once (a store's first byte takes tens of milliseconds);
            # the lock ``fd`` stays open until both have ended
            others = [_transfers().submit(fetch, rel) for rel in missing[:-1]]
            try:
                if missing:
                    fetch(missing[-1], prepare)
            finally:
                errors = [f.exception() for f in others]
            for error in errors:
                if error is not None:
                    raise error
            os.utime(fd)
            return True

    # ----------------------------------------------------------------- one file
    def _fetch_file(self, fd: int, rel: str, want_crc: str, want_size: int | None, what: str, *, evict: bool,
                    meanwhile: Any = None) -> None:
        """Download ``rel`` to a temporary name, check it against the manifest, record it under the lock
        ``fd`` (held exclusively) and rename it into place; ``meanwhile()`` is called once, while the
        first transfer runs.

        Raises:
            CorruptShardError: the object's checksum (or size) differs from the manifest's ``retries`` times.
            RemoteStoreError: the store did not answer (nothing arrived for ``timeout`` seconds).
        """
        final = self.folder / rel
        self._refuse_links([rel, PARTIAL + "/-"])
        url = f"{self.url}/{rel}"
        mismatch = ""
        started = time.monotonic()
        attempt = 0
        while attempt < self.retries:
            attempt += 1
            make_dirs(self.folder / PARTIAL)
            tmp = self.folder / PARTIAL / f"{self._temp_name(rel)}{os.getpid()}-{uuid.uuid4().hex[:8]}"
            with _parts_lock:
                if _exiting.is_set():
                    raise _Exiting()
                _parts.add(tmp)
                _part_dirs.add(tmp.parent)
            progress = _Progress(tmp)
            then, meanwhile = meanwhile, None

            def prepare(then: Any = then) -> None:  # the shard's folders (six for images/c/0/0/0/0), then the caller's
                make_dirs(final.parent)
                if then is not None:
                    then()

            try:
                got = self._transfer(rel, tmp, what, progress, meanwhile=prepare) or progress.finish()
                if got is None or got[0] != want_crc:  # the crc taken as the bytes arrived: trusted when it matches
                    got = (file_crc32c(tmp), os.stat(tmp).st_size)
                crc, size = got
                if crc == want_crc and (want_size is None or size == want_size):
                    self._record(fd, rel, os.stat(tmp), evict=evict, crc=want_crc)
                    os.replace(tmp, final)
                    self._log_download(what, rel, size)
                    return
                mismatch = (f"checksum {crc} of {size:,} bytes differs from the manifest's {want_crc}"
                            + (f" of {want_size:,} bytes" if want_size is not None else ""))
                if attempt == 1 and (rebuilt := self._rebuilt()):  # another build's object: no retry would match
                    raise CorruptShardError(f"{what}: {url}: {mismatch}; {rebuilt}")
                log.warning("%s: %s (%s), download %d of %d", what, mismatch, url, attempt, self.retries)
            except _Missing:
                raise CorruptShardError(f"{what}: {url} is missing from the store; "
                                        f"{self._rebuilt() or 'rerun the same `datapipe build` to rewrite it'}") from None
            except _Transient as exc:
                if time.monotonic() - started > self.timeout:
                    raise RemoteStoreError(f"{what}: {url} cannot be downloaded: {exc}; check that the store is up, "
                                           "or raise timeout=") from None
                attempt -= 1  # only checksum mismatches use up the retries; failures end with the timeout
                time.sleep(min(0.1 * 2 ** min(attempt, 4), 1.0))
            finally:
                progress.close()
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp)
                with _parts_lock:
                    _parts.discard(tmp)
        then = self._rebuilt() or ("the object was altered after the build: rerun the same `datapipe build` with --verify "
                                   "to rewrite it (a plain rerun checks sizes, not contents)")
        raise CorruptShardError(f"{what}: {url}: {mismatch}, {self.retries} downloads in a row; {then}")

    def _rebuilt(self) -> str:
        """What to say when the store's manifest is no longer the one this reader opened (the cache was rebuilt
        in place, or is being rebuilt): its objects are another build's. Empty when it is the same (or when
        the store cannot say)."""
        fs, root = self.filesystem()
        try:
            raw = _transfers().submit(fs.cat_file, f"{root}/{MANIFEST}").result(timeout=self.timeout)
        except FileNotFoundError:
            now = "it has no manifest now: it is being rebuilt"
        except Exception:  # noqa: BLE001 - the store cannot say: the caller's own words stand
            return ""
        else:
            if hashlib.sha256(raw).hexdigest() == self.opened:
                return ""
            now = "its manifest is another build's now"
        return (f"the cache changed since it was opened ({self.url} was rebuilt: {now}); reopen the cache (restart "
                "the job) once the build has finished, to read the new build")

    def _transfer(self, rel: str, tmp: Path, what: str, progress: _Progress,
                  meanwhile: Any = None) -> tuple[str, int] | None:
        """Copy object ``rel`` to ``tmp``, counting into ``progress``; give up when nothing arrives for
        ``timeout`` s. An async filesystem's transfer runs on its own event loop (no thread between), a
        blocking one's in a transfer thread; this thread calls ``meanwhile()`` once the transfer has
        started, then takes the checksum of what arrives (:meth:`_Progress.catch_up`). Returns the
        (crc32c, size) of what was written when the transfer took it itself (S3), else None."""
        fs, root = self.filesystem()
        rpath = f"{root}/{rel}"
        if is_s3fs(fs):  # the checksum is taken on the event loop, from each chunk as it is written
            progress.unfollowed()
            future: Future = asyncio.run_coroutine_threadsafe(_s3_get(fs, rpath, str(tmp), progress), fs.loop)
        elif getattr(fs, "async_impl", False) and getattr(fs, "loop", None) is not None:
            future = asyncio.run_coroutine_threadsafe(fs._get_file(rpath, str(tmp), callback=progress), fs.loop)
        else:
            future = _transfers().submit(fs.get_file, rpath, str(tmp), callback=progress)
        future.add_done_callback(lambda _: progress.ready.set())
        if meanwhile is not None:
            try:
                meanwhile()
            except BaseException:
                progress.cancelled = True
                future.cancel()
                raise
        seen, since = 0, time.monotonic()
        while not future.done():
            if _exiting.is_set():
                progress.cancelled = True
                future.cancel()
                raise _Exiting()
            progress.ready.wait(min(0.25, self.timeout))
            progress.ready.clear()
            progress.catch_up()
            if progress.value != seen:
                seen, since = progress.value, time.monotonic()
            elif time.monotonic() - since > self.timeout and not future.done():
                progress.cancelled = True
                future.cancel()
                raise RemoteStoreError(f"{what}: {self.url}/{rel}: no data arrived for {self.timeout:g} s (the "
                                       "store stopped answering); check that it is up, or raise timeout=")
        try:
            got = future.result()
        except DatapipeError:
            raise
        except Exception as exc:
            if isinstance(exc, _Exiting) or local_os_error(exc):
                raise  # this machine's disk (full, read-only): no retry mends it, and it is not the store's
            if isinstance(exc, FileNotFoundError) and exc.filename != str(tmp):
                raise _Missing() from None
            raise _Transient(one_line(exc)) from None
        return got if isinstance(got, tuple) else None

    # ----------------------------------------------------------------- eviction
    def _make_room(self, need: int) -> None:
        """Evict least recently used shard data files this node downloaded until ``need`` more bytes fit."""
        if self.limit is None:
            return
        with contextlib.ExitStack() as stack:
            fd = _open_step_lock(str(self.local_root / EVICT_LOCK))
            stack.callback(_close_step_lock, fd)
            fcntl.flock(fd, fcntl.LOCK_EX)
            usage, candidates = _scan(self.local_root)
            if usage + need <= self.limit:
                return
            for _, lock_path, folder, rel in sorted(candidates, key=self._eviction_key):
                freed = _evict(lock_path, folder, rel)
                if freed is not None:
                    usage -= freed
                if usage + need <= self.limit:
                    return
            if not self._warned:
                self._warned = True
                coming = f", and {need:,} more are being downloaded" if need else ""
                log.warning("%s holds %s bytes in files open for reading%s; the cache_limit of %s is exceeded until "
                            "they are closed", self.local_root, f"{usage:,}", coming, f"{self.limit:,}")

    def _eviction_key(self, candidate: tuple[int, str, Path, str]) -> tuple[int, float, int]:
        """Which shard goes first: those finished in this epoch (oldest first), then those this process
        does not read again soon (furthest next read first, never-again first: Belady's rule on the plan),
        each in least recently used order."""
        stamp, _, folder, rel = candidate
        if stamp < FINISHED_BELOW_NS:
            return 0, 0.0, stamp
        follower = self._follower
        if follower is None or folder != self.folder:
            return 1, -float("inf"), stamp
        return 1, -follower.next_read(rel), stamp

    # ----------------------------------------------------------------- prefetch
    def follow(self, shards: Sequence[int] | np.ndarray, first: Sequence[int] | np.ndarray | None = None,
               last: Sequence[int] | np.ndarray | None = None, *, reader_first: int | None = None) -> None:
        """Prefetch ``shards`` (the order this process will first read them; ``first`` and ``last``: the
        positions of the batches that first and last read each, default one shard per batch) in background
        threads; replaces the previous order. ``reader_first``: the shard the reader opens first, which it
        downloads itself (it could only wait for a prefetch thread's download of it).

        What the batch being read needs is downloaded first (in parallel); then up to ``prefetch`` shards
        ahead, never more than ``cache_limit`` holds together with the shards still to be read.
        """
        previous, self._follower = self._follower, None
        if previous is not None:
            previous.stop()
        shard_list = [int(s) for s in shards]
        first_at = np.arange(len(shard_list), dtype=np.int64) if first is None else np.asarray(first, np.int64)
        last_at = first_at.copy() if last is None else np.asarray(last, np.int64)
        self._size_open_files(first_at, last_at)
        if self._depth() is not None and len(shard_list):
            assert self.manifest is not None
            self._follower = _Follower(self, shard_list, first_at, last_at, self._depth() or 0, self.slots(),
                                       reader_first)
        # Room is made before each download, so a folder that went over the limit while readers held its
        # shards open (they cannot be evicted) would stay over it for as long as nothing is downloaded —
        # for good once every shard is local. Each plan brings it back under (what is not open).
        with self._local_writes("", doing="making room for the shards to read"):  # its lock file is on the disk
            self._make_room(0)

    def advance(self, position: int) -> None:
        """The reader starts the batch at ``position`` of the plan given to :meth:`follow`."""
        follower = self._follower
        if follower is not None:
            follower.advance(position)

    def read(self, position: int) -> None:
        """The reader has read the batch at ``position`` of the plan: prefetching ahead may start. Until
        the first batch of the plan is read, nothing beyond it is downloaded, so that neither the store's
        bandwidth nor this process's CPU is shared with shards read later."""
        follower = self._follower
        if follower is not None and not follower.head_done:  # set once an iteration: no lock on every batch
            follower.read(position)

    def _size_open_files(self, first: np.ndarray, last: np.ndarray) -> None:
        """Keep open the shards the plan reads at once (a window of the ``"shards"`` order, two where a batch
        straddles windows) and no more: a shard closed is evictable, and one kept open past its last read
        holds room another shard needs."""
        files = self._open_files() if self._open_files is not None else None
        slots = self.slots()
        if files is None or slots is None:
            return
        at_once = 1
        if len(first):
            events = np.concatenate([np.stack([first, np.ones_like(first)], 1), np.stack([last + 1, -np.ones_like(last)], 1)])
            events = events[np.lexsort((events[:, 1], events[:, 0]))]  # closes before opens at the same batch
            at_once = int(np.cumsum(events[:, 1]).max())
        files.limit = max(1, min(self._open_cap, slots, at_once))

    def _depth(self) -> int | None:
        """Shards to prefetch ahead of the batch being read; None: no prefetch at all (``prefetch=0``)."""
        assert self.manifest is not None
        depth = self._prefetch_shards
        if self._prefetch_bytes is not None:
            sizes = [s.nbytes for s in self.manifest.shards if s.count]
            depth = self._prefetch_bytes // max(1, int(np.mean(sizes)) if sizes else 1)
        return depth or None

    def close(self) -> None:
        """Stop prefetching (transfers in flight finish in the background)."""
        follower, self._follower = self._follower, None
        if follower is not None:
            follower.stop()


class _Follower:
    """The prefetch threads of one plan (shards in first-read order, the batch positions that first and
    last read each).

    Scheduling: first every shard the batch being read needs (``THREADS`` at once; at the start of an
    epoch nothing else until the reader has read the first batch, so that it shares neither the store's
    bandwidth nor the CPU with shards read later); then shards ahead, at most ``depth`` beyond the batch
    being read, and only while the shards from here to it fit ``slots``. A reader needing a shard in flight here waits for
    that download (:meth:`wait_for`); a shard not started yet it downloads itself. A shard whose last
    read is behind the reader gets a finished stamp (see ``FINISHED_BELOW_NS``) so eviction takes it first.
    """

    THREADS = 8

    def __init__(self, fetcher: ShardFetcher, shards: list[int], first: np.ndarray, last: np.ndarray, depth: int,
                 slots: int | None, reader_first: int | None = None) -> None:
        self.fetcher, self.shards, self.first, self.last = fetcher, shards, first, last
        self.depth, self.slots = depth, slots
        self.index = {s: k for k, s in reversed(list(enumerate(shards)))}
        self.by_last = np.argsort(last, kind="stable")
        self.finished_upto = 0  # entries of by_last already stamped finished
        self.position = 0  # the batch being read
        self.next_k = 0  # the first entry not started
        self.started: dict[int, Future] = {}
        self.head_done = False  # the reader has read the first batch: prefetching ahead may start
        self.done = False
        self.cond = threading.Condition()
        # threads start one at a time as work appears (starting eight costs a steady epoch's reader ~10 ms on
        # a busy machine); none at all when every shard is local and held open
        held = fetcher.open_shards()
        self.threads = min(self.THREADS, len(set(shards) - held))
        self.running = 0
        self.idle = 0
        if reader_first in self.index and reader_first not in held:
            # The reader downloads the first shard it reads itself: it could only wait for a prefetch thread's
            # download of it, and a thread's start and hand-over would delay that transfer (on two cores, by
            # the milliseconds the reader and the thread take turns at the interpreter).
            self._claim(int(reader_first))
        with self.cond:
            self._wake()

    # ----------------------------------------------------------------- the reader's side
    def reached(self, shard: int) -> None:
        """A reader opens ``shard``: it reads at least the batch that first reads it."""
        k = self.index.get(shard)
        if k is not None:
            self.advance(int(self.first[k]))

    def advance(self, position: int) -> None:
        finished: list[int] = []
        with self.cond:
            if position <= self.position:
                return
            self.position = position
            self.head_done = True
            while self.finished_upto < len(self.by_last) and self.last[self.by_last[self.finished_upto]] < position - 1:
                finished.append(self.shards[self.by_last[self.finished_upto]])  # one batch of slack: workers interleave
                self.finished_upto += 1
            self._wake()
        if finished:
            self.fetcher._stamp_finished(finished)

    def read(self, position: int) -> None:
        with self.cond:
            if not self.head_done and position >= self.position:
                self.head_done = True
                self._wake()

    def wait_for(self, shard: int) -> None:
        """Wait for this process's prefetch of ``shard`` when one is in flight; claim it when not started, so
        the caller's download is the only one.

        Raises:
            RemoteStoreError: the prefetch found the store silent for ``timeout`` seconds: the caller's own
                download would wait as long again (the error came after twice the timeout). Its other errors
                are the caller's own download's to report.
        """
        with self.cond:
            future = self.started.get(shard)
            if future is None:
                if shard in self.index:
                    self._claim(shard)  # the reader downloads it now
                return
        try:
            future.result(timeout=4 * self.fetcher.timeout)  # the download's own timeouts end it before
        except RemoteStoreError:
            raise
        except Exception:  # noqa: BLE001 - the caller downloads it itself and reports its own failure
            pass

    def next_read(self, rel: str) -> float:
        """The batch position this process next reads the shard of data file ``rel``; inf when never again."""
        shard = self.fetcher.shard_of(rel)
        k = self.index.get(shard) if shard is not None else None
        if k is None or self.last[k] < self.position:
            return float("inf")
        return float(max(int(self.first[k]), self.position))

    def stop(self) -> None:
        # Never blocks, so garbage collection may call it (Cache.__del__) while this thread holds the
        # condition: a thread that is not woken here sees ``done`` within its 0.5 s wait.
        self.done = True
        if self.cond.acquire(blocking=False):
            try:
                self.cond.notify_all()
            finally:
                self.cond.release()

    # ----------------------------------------------------------------- the prefetch threads
    def _pick(self) -> tuple[int, Future] | None:
        """The next shard to download (held: self.cond), or None when none may start now (or stopped)."""
        if self.done:
            return None
        k = self._skip()
        if k >= len(self.shards):
            return None
        now = max(self.position, 0)
        if self.first[k] > now:  # ahead of the batch being read
            if not self.head_done:
                return None
            ahead = int(np.count_nonzero(self.first[:k + 1] > now))
            if ahead > self.depth:
                return None
            if self.slots is not None:
                live = {self.shards[j] for j in np.flatnonzero(self.last[:k + 1] >= now)}
                if len(live | self.fetcher.open_shards()) > self.slots:
                    return None  # would evict a shard still to be read, or need room held open
        future: Future = Future()
        self.started[self.shards[k]] = future
        self.next_k += 1
        return self.shards[k], future

    def _claim(self, shard: int) -> None:
        """The reader downloads ``shard`` itself: no prefetch thread starts it."""
        mine: Future = Future()
        mine.set_result(None)
        self.started[shard] = mine

    def _skip(self) -> int:
        """The first entry neither started nor held open here (local, not evictable) (held: self.cond)."""
        held = self.fetcher.open_shards()
        while self.next_k < len(self.shards) and (self.shards[self.next_k] in self.started or self.shards[self.next_k] in held):
            self.next_k += 1
        return self.next_k

    def _more_now(self) -> bool:
        """Whether another shard may start now (held: self.cond). Before the reader has read the first batch
        only that batch's shards may: a thread started for later ones would only wait, and its start would
        take the interpreter from the first batch's transfer."""
        k = self._skip()
        return k < len(self.shards) and (self.head_done or int(self.first[k]) <= max(self.position, 0))

    def _wake(self) -> None:
        """Work may be ready (held: self.cond): start the first prefetch thread, or wake those waiting."""
        if self.running == 0 and self.threads and not self.done and self._more_now():
            self._spawn()
        else:
            self.cond.notify_all()

    def _spawn(self) -> None:
        self.running += 1
        threading.Thread(target=self._work, name=f"datapipe-prefetch_{self.running}", daemon=True).start()

    def _work(self) -> None:
        while True:
            with self.cond:
                job = self._pick()
                while job is None and not self.done and self.next_k < len(self.shards):
                    self.idle += 1
                    self.cond.wait(0.5)
                    self.idle -= 1
                    job = self._pick()
                if job is None:
                    self.running -= 1
                    return  # stopped, or every shard of the plan started (or local and held open)
                if not self.idle and self.running < self.threads and self._more_now():
                    self._spawn()  # more work is ready: one more thread
            shard, future = job
            try:
                future.set_result(self.fetcher.download(shard))
            except Exception as exc:  # noqa: BLE001 - the reader's own download reports it
                log.debug("prefetch of shard %d failed: %s", shard, exc)
                future.set_exception(exc)
            with self.cond:
                self.cond.notify_all()


class _DaemonPool:
    """Daemon threads for blocking transfers, started as work arrives (at most ``limit``) and ending
    after ``idle`` seconds without any: a transfer stuck on a store that stopped answering never holds
    up the interpreter's exit (a ThreadPoolExecutor's threads are joined at exit), and the threads of
    a process's datasets are shared, not left behind by each of them."""

    def __init__(self, name: str, limit: int = 64, idle: float = 10.0) -> None:
        self._name, self._limit, self._idle_s = name, limit, idle
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._threads = 0
        self._idle = 0  # threads waiting for work
        self._pending = 0  # work queued and not taken yet
        self._started = 0

    def submit(self, fn: Any, *args: Any, **kwargs: Any) -> Future:
        future: Future = Future()
        with self._lock:  # queued under the lock: a thread that ends for want of work sees it first
            self._queue.put((future, fn, args, kwargs))
            self._pending += 1
            spawn = self._pending > self._idle and self._threads < self._limit
            if spawn:
                self._threads += 1
                self._started += 1
        if spawn:
            threading.Thread(target=self._work, name=f"{self._name}_{self._started}", daemon=True).start()
        return future

    @property
    def threads(self) -> int:
        return self._threads

    def _work(self) -> None:
        while True:
            with self._lock:
                self._idle += 1
            try:
                future, fn, args, kwargs = self._queue.get(timeout=self._idle_s)
            except queue.Empty:
                with self._lock:
                    self._idle -= 1
                    if self._queue.empty():
                        self._threads -= 1
                        return
                continue
            with self._lock:
                self._idle -= 1
                self._pending -= 1
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args, **kwargs))
            except BaseException as exc:  # noqa: BLE001 - handed to the waiter
                future.set_exception(exc)
            del future, fn, args, kwargs


_POOL: tuple[int, _DaemonPool] | None = None
_POOL_LOCK = threading.Lock()


# Descriptors of lock files a thread of this process holds for the span of one step (a download, a check): a child
# made by fork inherits them, and with them the flock, which no thread there would ever release.
_STEP_LOCKS: set[int] = set()


def _open_step_lock(path: str) -> int:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    _STEP_LOCKS.add(fd)
    return fd


def _close_step_lock(fd: int) -> None:
    _STEP_LOCKS.discard(fd)  # before the close: the number may be reused at once
    os.close(fd)


def _renew_module_locks() -> None:
    """In a child made by fork: new module locks (a thread of the parent may have held one at the fork), and the
    lock files the parent's threads held for a step closed (their flock would outlive the parent's step)."""
    global _parts_lock, _RECORD_LOCK, _POOL_LOCK
    _parts_lock, _RECORD_LOCK, _POOL_LOCK = threading.Lock(), threading.Lock(), threading.Lock()
    for fd in list(_STEP_LOCKS):
        with contextlib.suppress(OSError):
            os.close(fd)
    _STEP_LOCKS.clear()


os.register_at_fork(after_in_child=_renew_module_locks)


async def _s3_get(fs: Any, rpath: str, lpath: str, progress: _Progress) -> tuple[str, int]:
    """An S3 object into the file ``lpath`` (s3fs's own request, with its extra arguments), its crc32c taken
    from each chunk as it is written, on the event loop: nothing is read back, and no thread is woken
    for it while the bytes arrive (:class:`_Progress` only counts). Returns (crc32c, size). A failure
    mid-body is the caller's to retry (it downloads the object again)."""
    bucket, key, version = fs.split_path(rpath)
    response = await fs._call_s3("get_object", Bucket=bucket, Key=key, **fs.req_kw,
                                 **({"VersionId": version} if version else {}))
    body = response["Body"]
    crc = size = 0
    try:
        if _exiting.is_set():
            raise _Exiting()
        with open(lpath, "wb") as f:
            while chunk := await body.read(S3_CHUNK):
                f.write(chunk)
                crc = crc32c(chunk, crc)
                size += len(chunk)
                progress.relative_update(len(chunk))
    finally:
        body.close()
    return f"{crc:08x}", size


S3_CHUNK = 1 << 20  # the most of an S3 response's body taken at once (what has arrived, up to this)


def _transfers() -> _DaemonPool:
    """This process's pool of transfer threads (a forked child makes its own)."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None or _POOL[0] != os.getpid():
            _POOL = (os.getpid(), _DaemonPool("datapipe-fetch"))
        return _POOL[1]


class _Transient(Exception):
    """A transfer failed in a way a retry may mend (a connection error, an HTTP 5xx)."""


class _Missing(Exception):
    """The store has no such object."""


def _evict(lock_path: str, folder: Path, rel: str) -> int | None:
    """Delete ``folder/rel`` if its lock is free (no reader, no download) and the file is still the one
    downloaded under it; returns its size, or None when it was kept."""
    try:
        fd = os.open(lock_path, os.O_RDWR | os.O_CLOEXEC)
    except OSError:
        return None
    _STEP_LOCKS.add(fd)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return None
        files = _read_record(fd)
        entry = files.get(rel)
        if entry is None or not entry.get("evict") or not _same_file(folder, rel, entry):
            return None
        os.unlink(folder / rel)
        del files[rel]
        _write_record(fd, files)
        return int(entry["size"])
    finally:
        _close_step_lock(fd)


_SCANNED: dict[str, tuple[tuple[int, ...], list[dict], set[str]]] = {}
STABLE_NS = 100_000_000  # a lock file unchanged this long is read again only when its times or size move


def _scan(root: Path) -> tuple[int, list[tuple[int, str, Path, str]]]:
    """Bytes of the files every build folder under ``root`` downloaded (still the files downloaded), and
    the evictable ones: (access stamp, lock file, folder, relative path).

    Called before every download beyond ``cache_limit``, so it must not read every lock file each time
    (5,000 shards took 0.8 s a call): a lock file's record is read again only when the file changed
    (inode, size, mtime, ctime; one changed in the last ``STABLE_NS`` is always read again, since file
    times move by clock ticks), and a file found in place under a record is not looked at again until
    its record changes (a download records before it renames, an eviction deletes before it records,
    and both then touch the lock; a file not in place is looked at every time)."""
    global _SCANNED
    usage = 0
    candidates: list[tuple[int, str, Path, str]] = []
    scanned: dict[str, tuple[tuple[int, ...], list[dict], set[str]]] = {}
    with contextlib.suppress(OSError):
        for entry in os.scandir(root):
            if not entry.is_dir(follow_symlinks=False) or not os.path.isfile(os.path.join(entry.path, MARKER)):
                continue
            folder = Path(entry.path)
            with contextlib.suppress(OSError):
                for lock in os.scandir(os.path.join(entry.path, LOCKS)):
                    if not lock.name.endswith(".lock"):
                        continue
                    try:
                        st = lock.stat(follow_symlinks=False)
                        key = (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
                        seen = _SCANNED.get(lock.path)
                        if seen is None or seen[0] != key:
                            with open(lock.path, "rb", buffering=0) as f:
                                files = list(_parse_record(f.read(min(st.st_size, 1 << 20) + 1)).values())
                            # a file's times move in steps of a clock tick: a lock changed within the last
                            # STABLE_NS may change again without its times moving, so it is not trusted later
                            fresh = time.time_ns() - st.st_ctime_ns < STABLE_NS
                            seen = ((-1,) if fresh else key, files, set())
                    except OSError:
                        continue
                    scanned[lock.path] = seen
                    for file in seen[1]:
                        rel = file["path"]
                        if rel not in seen[2]:
                            if not _same_file(folder, rel, file):
                                continue
                            seen[2].add(rel)
                        usage += int(file["size"])
                        if file.get("evict"):
                            candidates.append((st.st_mtime_ns, lock.path, folder, rel))
    _SCANNED = scanned  # the locks of folders gone are forgotten
    return usage, candidates


def _read_record(fd: int) -> dict[str, dict]:
    # as many bytes as the file holds (asking for 1 MiB made a 1 MiB buffer each time: 50 us a read)
    return _parse_record(os.pread(fd, min(os.fstat(fd).st_size, 1 << 20) + 1, 0))


def _peek_record(path: Path) -> dict[str, dict]:
    """The record of the lock file ``path``, read without its lock: {} where there is none, or while it is
    being rewritten (a caller that must be sure takes the lock and reads it with :func:`_read_record`)."""
    try:
        with open(path, "rb", buffering=0) as f:
            return _parse_record(f.read(1 << 20))
    except OSError:
        return {}


def _parse_record(data: bytes) -> dict[str, dict]:
    """A lock file's record: relative path -> {path, ino, size, mtime_ns, evict}; {} when empty or unreadable
    (a record half written when read without the lock)."""
    try:
        doc = json.loads(data.decode("utf-8")) if data else {}
    except ValueError:
        return {}
    files = doc.get("files") if isinstance(doc, dict) else None
    if not isinstance(files, list):
        return {}
    return {f["path"]: f for f in files if isinstance(f, dict) and isinstance(f.get("path"), str)}


def _write_record(fd: int, files: dict[str, dict]) -> None:
    data = json.dumps({"files": list(files.values())}).encode()
    os.ftruncate(fd, 0)
    os.pwrite(fd, data, 0)


def _current(entry: dict, crc: str) -> bool:
    """The recorded download is a copy of the object the manifest names now: its crc32c is the manifest's. A
    rebuild that changes a shard keeps its build id (and so the node's folder) when its configuration and
    source are the same: the file in place is then the earlier object's, to be downloaded again. A record
    without a crc32c (an earlier datapipe's) is checked against the file once."""
    return entry.get("crc32c") == crc


def _same_file(folder: Path, rel: str, entry: dict) -> bool:
    """``folder / rel`` is still the file a record names (inode, size, mtime), reached through folders of the node's
    cache itself (a folder linked in from elsewhere keeps the inode of a file moved behind it): never delete one
    datapipe did not write."""
    if ".." in Path(str(entry.get("path", ""))).parts:
        return False
    if ".." in Path(rel).parts or link_on_the_way(folder, rel) is not None:
        return False
    path = folder / rel
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return (st.st_ino, st.st_size, st.st_mtime_ns) == (entry.get("ino"), entry.get("size"), entry.get("mtime_ns"))


def _differs(path: Path, crc: str, size: int | None) -> tuple[str | None, os.stat_result | None]:
    """How the file at ``path`` differs from the manifest's crc32c and size (None: it does not), and its stat.
    Only a regular file is read (opened without following a link, and non-blocking: a FIFO is not waited on)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        return ("a symbolic link" if os.path.islink(path) else f"cannot be read: {exc.strerror or exc}"), None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return "not a regular file", st
        if size is not None and st.st_size != size:
            return f"{st.st_size:,} bytes, the manifest's {size:,}", st
        got, _ = crc32c_range(fd, 0, None, np.empty(max(1, min(1 << 20, st.st_size)), dtype=np.uint8))
        return (None if f"{got:08x}" == crc else f"checksum {got:08x}, the manifest's {crc}"), st
    except OSError as exc:
        return f"cannot be read: {exc.strerror or exc}", None
    finally:
        os.close(fd)


def _write_marker(folder: Path, doc: dict) -> None:
    marker = folder / MARKER
    if not marker.is_file():
        atomic_write_text(marker, json.dumps(doc))


def _read_or_none(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except OSError:
        return None


def _local_world_size() -> int:
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        return 1


def _open_filesystem(url: str, storage_options: dict, timeout: float) -> tuple[Any, str]:
    """An fsspec filesystem and the root path of ``url`` in it; on S3 the connection and read timeouts
    default to ``timeout`` (a stopped store is an error, not a hang). The datasets of a process with the
    same store, options and timeout share one filesystem and its client (fsspec's instance cache, which
    holds one async filesystem per process and options): a client costs 0.2-0.4 s of CPU to make, and the
    objects of each one dropped (botocore's service model) made a later garbage collection of the process
    take about a second, a stall in some reader's batch."""
    options = dict(storage_options)
    if url.split("://", 1)[0] in ("s3", "s3a"):
        config = dict(options.get("config_kwargs") or {})
        config.setdefault("connect_timeout", timeout)
        config.setdefault("read_timeout", timeout)
        config.setdefault("retries", {"max_attempts": 3})
        # every file is checked against the manifest's crc32c: botocore's own CRC32 of each response
        # body (on by default since 1.36) would only add CPU on the event loop that all transfers share
        config.setdefault("response_checksum_validation", "when_required")
        options["config_kwargs"] = config
    from .remote import open_location

    loc = open_location(url, options)
    return loc.fs, loc.root

