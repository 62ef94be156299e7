"""Random access to a finished cache: ``datapipe.open(path)`` and the batch reader under the loader.

Opening parses the manifest into a checked :class:`~datapipe.records.Manifest` and stats every
shard file (O(number of shards), no sample is touched), recording each file's identity. Shard files
are opened lazily through a bounded set of descriptors. A shard whose identity (device, inode,
size, mtime) differs from what was recorded at open was rebuilt or altered since; reading it is
refused, so a reader keeps reading the build it opened or stops with a clear error, and never
pairs one build's images with another's labels.

Samples are copied out of memory maps of the shard files where the compiled kernel's SIGBUS guard
is in place (:func:`datapipe.native.guard_available`): a batch is one guarded gather per shard, and
``sample_views(..., mapped=True)`` hands out views of the maps for a consumer that reads only the
pixels of its crops, through the guarded kernels. A file that shrinks under a reader faults inside
the guard and becomes an error naming the shard, never a SIGBUS. Without the kernel
(``DATAPIPE_NATIVE=0``, no compiler) samples are read with positioned reads (``os.preadv``) into
the caller's buffer, where a shrunk file is a short read and the same error — correct, but slower:
pread copies out of the page cache at a third of the speed of a copy from a mapped file here.

Two layouts (docs/format.md): ``fixed`` (format version 1: square raw samples, sample i at
i·S·S·3 of the shard's data file) and ``indexed`` (version 2: samples of their own shape, raw or
JPEG, found through each shard's sample index, :class:`datapipe.samples.SampleIndex`). A shard's
index is read once, when the shard is first used, and checked (its crc32c against the manifest,
then every row); a sample is then one guarded copy (or positioned read) of its own bytes. JPEG
samples are copied out of the map first and decoded from the copy, never from the map, so a file
truncated under the decoder is a short copy naming the shard rather than a SIGBUS inside libjpeg.
"""

from __future__ import annotations

import bisect
import functools
import heapq
import io
import itertools
import operator
import os
import stat
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NamedTuple, TypeVar, overload

import numpy as np

from . import manifest as mf
from . import native
from ._threads import renew_after_fork
from .environment import memory_limit
from .errors import (
    PERMISSION_ADVICE,
    ArgumentError,
    CacheError,
    CorruptShardError,
    MappedReadError,
    UnreadableFileError,
    check_bool,
    check_path,
    refused,
    refused_error,
)
from .files import FileTooLarge, NotRegularFile, describe_mode, file_crc32c, open_for_reading, read_regular
from .output import lock_holder, shard_build_id
from .records import Manifest, indexed_file_size, parse_json
from .samples import INDEX_ROW_BYTES, SampleIndex, decode_jpeg
from .shards import (
    MOVE_AWAY,
    SHARDS_DIR,
    document_problems,
    foreign_entries,
    images_path,
    index_path,
    read_shard_metadata,
    shard_labels_path,
)
from .text import progress_bar, show

Identity = tuple[int, int, int, int]  # st_dev, st_ino, st_size, st_mtime_ns
T = TypeVar("T")
# the marker of a node-local cache (``StreamingDataset(url, local_cache=...)``): in the local cache folder and in
# each build's folder under it, whose shards are downloaded as they are read (datapipe.fetch)
LOCAL_CACHE_MARKER = ".datapipe-local-cache"


def node_cache_of(root: Path) -> str | None:
    """The URL of the remote cache whose node-local copy ``root`` is; None for a cache built here."""
    try:
        doc = parse_json(read_regular(root / LOCAL_CACHE_MARKER, 1 << 16), root / LOCAL_CACHE_MARKER)
    except (OSError, CacheError, NotRegularFile, FileTooLarge):
        return None
    url = doc.get("url") if isinstance(doc, dict) else None
    return url if isinstance(url, str) else None


def _identity(st: os.stat_result) -> Identity:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def _fd_limit() -> int:
    """Shard files held open at once by all caches of the process together: a quarter of the soft descriptor
    limit, between 16 and 1024."""
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (ImportError, OSError, ValueError):
        return 256
    if soft == resource.RLIM_INFINITY:
        return 1024
    return max(16, min(1024, soft // 4))


class _Shard:
    """An open shard data file: its descriptor, its memory map (None on the positioned-read path,
    or where mapping failed) and the map as a torch [count, H, W, 3] tensor, made on first use."""

    __slots__ = ("fd", "users", "mapping", "tensor", "hold", "used", "closing")

    def __init__(self, fd: int, mapping: native.Mapping | None, hold: Any = None) -> None:
        self.fd, self.users, self.mapping = fd, 1, mapping
        self.closing = False  # closed when its last user releases it (see _ShardFiles.close)
        self.used = 0  # when it was last acquired (a tick of _ShardFiles' process-wide clock)
        self.tensor: Any = None  # torch.Tensor, once made (torch is imported only when views are asked for)
        self.hold = hold  # a remote cache's hold on the local shard file (fetch.Hold): released when closed

    def close(self) -> None:
        os.close(self.fd)
        if self.hold is not None:
            self.hold.release()


class _ShardFiles:
    """Shard data files, opened (and mapped) on first use, least recently used closed beyond ``limit`` and
    beyond the process's budget (:func:`_fd_limit`), which every cache open in the process shares: train,
    validation and test sets read in one process hold no more descriptors together than one does.

    A descriptor in use by a reader thread is never closed under it (a closed number could be
    reused by another open and read the wrong file): eviction skips shards with users. An evicted
    map is unmapped once the last view of it is gone (the views hold it).
    """

    # One for every instance, since eviction may close another cache's files; reentrant, since a cache collected
    # while it is held (a garbage collection run by an allocation under it) closes its own files (Cache.__del__).
    _lock = threading.RLock()
    _live: weakref.WeakSet[_ShardFiles] = weakref.WeakSet()
    _clock = itertools.count(1)
    budget: int | None = None  # the process's budget; None: _fd_limit(), read on first use

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._open: OrderedDict[int, _Shard] = OrderedDict()
        with _ShardFiles._lock:
            _ShardFiles._live.add(self)

    def acquire(self, shard: int, opener: Callable[[], _Shard],
                opened: Callable[[int, _Shard], None] | None = None) -> _Shard:
        """The open shard (its user count raised; pair with :meth:`release`); ``opener()`` makes one, and
        ``opened(shard, entry)`` is told of the one kept (two threads may open a shard at once: the other's is
        closed), under the lock, before any other thread can take it (it must take no lock of the caller's that
        is ever held around this call)."""
        with self._lock:
            entry = self._open.get(shard)
            if entry is not None:
                self._open.move_to_end(shard)
                entry.users += 1
                entry.used = next(self._clock)
                entry.closing = False  # read again after a close: it stays open
                return entry
        fresh = opener()  # outside the lock: opening may block on slow storage
        with self._lock:
            entry = self._open.get(shard)
            if entry is not None:  # another thread opened it meanwhile
                fresh.close()
                self._open.move_to_end(shard)
                entry.users += 1
                entry.used = next(self._clock)
                return entry
            fresh.used = next(self._clock)
            if opened is not None:  # before another thread can take the entry (and fault in its map)
                opened(shard, fresh)
            self._open[shard] = fresh
            self._evict()
            return fresh

    def release(self, shard: int) -> None:
        with self._lock:
            entry = self._open.get(shard)
            if entry is not None:
                entry.users -= 1
                if entry.closing and not entry.users:
                    self._open.pop(shard).close()
                self._evict()

    def _evict(self) -> None:
        """Close this cache's least recently used idle files beyond its limit, then the process's beyond its
        budget, whichever cache holds them (called under the lock)."""
        # Each cache's files are in the order they were last used (acquire moves a file to the end), so the least
        # recently used idle ones are found from the front: a shard opened costs no walk over every open file.
        if len(self._open) > self.limit:
            for shard, _ in list(itertools.islice(self._idle(), len(self._open) - self.limit)):
                self._open.pop(shard).close()
        if _ShardFiles.budget is None:
            _ShardFiles.budget = _fd_limit()
        live = list(self._live) if len(self._live) > 1 else [self]  # most processes read one cache
        over = sum(len(files._open) for files in live) - _ShardFiles.budget
        if over > 0:
            oldest = heapq.merge(*(files._idle_stamped() for files in live))
            for _, _, shard, files in list(itertools.islice(oldest, over)):
                files._open.pop(shard).close()

    def _idle(self) -> Iterator[tuple[int, _Shard]]:
        """This cache's open files that no reader uses now, least recently used first."""
        return ((s, e) for s, e in self._open.items() if not e.users)

    def _idle_stamped(self) -> Iterator[tuple[int, int, int, _ShardFiles]]:
        """:meth:`_idle` as (last use, id, shard, self), to merge with other caches' in order of last use."""
        return ((e.used, id(self), s, self) for s, e in self._idle())

    def close(self) -> None:
        """Close every file; one a reader thread is using now is closed when it releases it."""
        with self._lock:
            for shard, entry in list(self._open.items()):
                if entry.users:
                    entry.closing = True
                else:
                    self._open.pop(shard).close()

    def __len__(self) -> int:
        return len(self._open)


def _after_fork_in_child() -> None:
    _ShardFiles._lock = threading.RLock()  # a reader thread of the parent may have held it at the fork


os.register_at_fork(after_in_child=_after_fork_in_child)


class EncodedSample(NamedTuple):
    """A stored JPEG sample copied out of its shard: its bytes, its decoded shape, and ``where``, the
    shard file and sample a decode error names (pass it to :func:`datapipe.samples.decode_crop`)."""

    data: np.ndarray  # uint8 [nbytes], a copy (never a view of a shard's map)
    height: int
    width: int
    where: str


class EncodedBatch(Sequence[EncodedSample]):
    """The stored JPEG samples of a batch, copied out of their shards into one buffer: a sequence of
    :class:`EncodedSample` made on access, and the arrays a compiled decoder takes at once
    (:attr:`buffer`, each sample's :attr:`starts` in it, :attr:`nbytes`, :attr:`shapes` (h, w)),
    so a batch costs no Python object per sample on the loader's path."""

    def __init__(self, buffer: np.ndarray, starts: np.ndarray, nbytes: np.ndarray, shapes: np.ndarray,
                 where: Callable[[int], str]) -> None:
        self.buffer, self.starts, self.nbytes, self.shapes = buffer, starts, nbytes, shapes
        self._where = where  # sample k of this batch -> the shard file and sample its errors name

    def __len__(self) -> int:
        return int(self.starts.shape[0])

    @overload
    def __getitem__(self, k: int) -> EncodedSample: ...
    @overload
    def __getitem__(self, k: slice) -> EncodedBatch: ...
    def __getitem__(self, k: int | slice) -> EncodedSample | EncodedBatch:
        if isinstance(k, slice):
            picked = np.arange(len(self))[k]
            return EncodedBatch(self.buffer, self.starts[picked], self.nbytes[picked], self.shapes[picked],
                                lambda j: self._where(int(picked[j])))
        k = range(len(self))[k]  # negative indices; IndexError past the end
        a, n = int(self.starts[k]), int(self.nbytes[k])
        return EncodedSample(self.buffer[a : a + n], int(self.shapes[k, 0]), int(self.shapes[k, 1]), self._where(k))

    def where(self, k: int) -> str:
        """What an error about sample ``k`` of this batch names: its shard file and sample."""
        return self._where(k)

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(buffer, starts, nbytes, shapes): uint8, then int64 [n], [n], [n, 2]."""
        return self.buffer, self.starts, self.nbytes, self.shapes


def _check_indexable(root: Path, num_samples: int) -> None:
    """CacheError when the labels and one epoch's order of ``num_samples`` (8 bytes each) would not fit in the
    memory this process can have: numpy's MemoryError names neither the cache nor the count, and a count the
    allocator does grant fills the memory first."""
    need = 16 * num_samples
    if need < 1 << 28:  # 16 M samples: any machine that reads a cache has that much (no system files read)
        return
    have, what = memory_limit()
    if have and need > have:
        raise CacheError(f"{root}: the manifest declares {num_samples:,} samples, whose labels and order alone take "
                         f"{need / 2**30:,.1f} GiB, more than the {have / 2**30:,.1f} GiB of {what}; read a cache that "
                         "large on a machine with more memory, or, if it is not that large, its manifest is damaged: "
                         "move it away and rerun the same `datapipe build` to rewrite it")


def _holds_exactly(dtype: np.dtype) -> int:
    """The largest count every whole number up to which a number type ``dtype`` holds exactly (an integer type's
    largest value; a float's 2**(mantissa bits + 1): float16 writes 2049 as 2048)."""
    return int(np.iinfo(dtype).max) if dtype.kind in "iu" else 2 ** (np.finfo(dtype).nmant + 1)


class Cache:
    """A finished cache, opened read-only.

    ``len(cache)`` samples; ``cache[i]`` is ``(image, label)`` with image a uint8 H×W×3 RGB array;
    (at the sample's own shape; decoded for a JPEG cache); :attr:`encoding` is ``"raw"`` or
    ``"jpeg"``, :attr:`fixed_shape` the shape every sample has (None when shapes vary) and
    :attr:`shapes` every sample's (height, width);
    ``cache.path(i)`` the source file of sample i relative to the source root; ``cache.classes``
    the class names; ``cache.manifest`` the checked manifest; ``cache.build_id`` the build that
    wrote it ("" for caches written before builds had ids); ``cache.mapped`` whether samples are
    copied out of memory maps under the SIGBUS guard (else positioned reads). The object pickles
    small (path, manifest and the identities recorded at open; descriptors and maps are reopened
    and checked).

    Raises:
        ArgumentError: a URL (a cache in object storage is opened with ``datapipe.open(url,
            local_cache=...)``), or ``check_sizes`` not a bool.
        CacheError: no finished cache at ``path`` (a build still writing it is named).
    """

    def __init__(self, path: str | Path, *, check_sizes: bool = True, remote: Any = None) -> None:
        from .remote import is_url, local_path

        path = local_path(check_path(path, "the cache"))  # a file:// URL is the folder it names
        if is_url(path) and remote is None:
            raise ArgumentError(f"Cache opens a local folder, got the URL {show(path)}: open a cache in object "
                                f"storage with datapipe.open({show(path)}, local_cache=...) or read it with "
                                f"datapipe.StreamingDataset({show(path)}, local_cache=...)")
        self.root = Path(path).expanduser().absolute()
        # a remote cache's node-local copy (datapipe.fetch.ShardFetcher): shard files are made local
        # when first opened, so their sizes are checked then (the rest of the hot path is the same)
        self.remote = remote
        try:
            self.manifest: Manifest = mf.read_manifest(self.root)
        except CacheError:
            _check_not_being_built(self.root)
            raise
        m = self.manifest
        self.build_id: str = m.build_id
        self.size = m.size
        self.layout: str = m.layout  # "fixed" (format 1) or "indexed" (format 2)
        self.encoding: str = m.encoding  # "raw" or "jpeg"
        self.fixed_shape: tuple[int, int, int] | None = m.fixed_shape
        self.max_side = m.max_side
        self.sample_bytes = self.size * self.size * 3  # of a raw square sample (the fixed layout's stride)
        self.classes: list[str] = list(m.classes)
        self.shard_names = [s.name for s in m.shards]
        self.counts = np.array([s.count for s in m.shards], np.int64)
        self.starts = np.array([s.first for s in m.shards], np.int64)
        self.num_samples = m.num_samples
        _check_indexable(self.root, self.num_samples)
        self._identities: dict[int, Identity] = {}  # shard -> identity of its data file at open
        self._records_checked: set[int] = set()  # shards whose zarr.json was found to be this cache's (_check_record)
        self._file_identities = {key: self._stat_identity(self.root / rec.name) for key, rec in m.files.items()}
        # opened as a folder, a node-local cache holds the shards read so far (and no zarr.json)
        self.node_cache_of: str | None = node_cache_of(self.root) if remote is None else None
        self.verified_shards = 0  # by the last verify(): every shard, or a node-local cache's downloaded ones
        check = check_bool(check_sizes, "check_sizes") and remote is None
        self._init_readers()
        if check:
            self.check_sizes()

    def _init_readers(self) -> None:
        self._files = _ShardFiles(_fd_limit() if self.remote is None else min(_fd_limit(), self.remote.max_open))
        if self.remote is not None:
            self.remote.attach(self._files)  # the remote's plan sizes what stays open
        self._renew_locks()
        renew_after_fork(self, "_renew_locks")
        self._labels: np.ndarray | None = None
        self._paths: list[str] | None = None
        # memory maps only under the SIGBUS guard; positioned reads otherwise
        self.mapped: bool = native.guard_available()
        # the address ranges of the shards' maps, to name the shard of a faulting address (shard_error): their
        # starts in order, and start -> (end, shard, the map); a shard reopened while views of its earlier map
        # live has two. Ranges of maps since unmapped go when a new map takes their addresses, or at a sweep.
        self._map_starts: list[int] = []
        self._map_ranges: dict[int, tuple[int, int, weakref.ref]] = {}
        self._map_sweep = 64  # ranges kept before those of maps unmapped are swept
        self._data_paths: dict[int, Path] = {}  # shard -> its data file (_shard_path)
        self._indexes: dict[int, SampleIndex] = {}  # shard -> its checked sample index (indexed layout)
        self._shapes: np.ndarray | None = None
        self._nbytes: np.ndarray | None = None
        self._range: tuple[tuple[int, int], tuple[int, int]] = ((0, 0), (0, 0))
        self._shard_files: dict[int, str] = {}  # shard -> its data file, as decode errors name it

    def _renew_locks(self) -> None:
        """New locks (at open, and in a child made by fork, where a reader thread of the parent may hold one)."""
        self._lock = threading.Lock()
        self._index_lock = threading.Lock()
        self._map_lock = threading.Lock()  # _map_ranges only: taken under _ShardFiles' lock, never the other way

    # -- pickling: only the small description travels to DataLoader workers
    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        for key in ("_files", "_lock", "_labels", "_paths", "mapped", "_map_ranges", "_map_starts", "_map_sweep", "_data_paths", "_indexes",
                    "_index_lock", "_map_lock", "_shapes", "_nbytes", "_range", "_shard_files"):
            state.pop(key, None)
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._init_readers()

    def close(self) -> None:
        """Close the shard files this cache has open in this process; for a cache in object storage, also
        release its hold on the node's copies (eviction, and another job's download of a rebuilt shard, may
        then take them) and stop its prefetching. The cache stays usable: a later read opens what it needs
        again. A file a reader thread is reading now is closed when that read ends. Garbage collection does
        the same, and ``with datapipe.open(path) as cache:`` closes the cache at the end of the block."""
        files = self.__dict__.get("_files")
        if files is not None:
            files.close()
        if self.__dict__.get("remote") is not None:
            self.remote.close()

    def __enter__(self) -> Cache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        self.close()

    def __len__(self) -> int:
        return self.num_samples

    def __repr__(self) -> str:
        shape = self.fixed_shape if self.fixed_shape is not None else f"varying (shorter side {self.size})"
        return (f"Cache({str(self.root)!r}, samples={self.num_samples:,}, shards={len(self.counts)}, "
                f"shape={shape}, encoding={self.encoding!r}, classes={len(self.classes)})")

    @property
    def indexed(self) -> bool:
        """Whether samples are found through per-shard sample indexes (format version 2)."""
        return self.layout == "indexed"

    @property
    def shapes(self) -> np.ndarray:
        """(height, width) of every sample, int64 [num_samples, 2]; for the indexed layout read from
        every shard's sample index on first use (each index is read and checked once)."""
        if self._shapes is None:
            with self._lock:
                if self._shapes is None:
                    self._load_table()
        assert self._shapes is not None
        return self._shapes

    @property
    def shape_range(self) -> tuple[tuple[int, int], tuple[int, int]]:
        """((least height, least width), (greatest height, greatest width)) over every sample, found once
        (from the sample indexes for the indexed layout); the fixed shape twice for the fixed layout,
        ((0, 0), (0, 0)) for an empty cache of varying shapes."""
        if self.fixed_shape is not None:
            h, w = self.fixed_shape[:2]
            return (h, w), (h, w)
        _ = self.shapes  # loads the table, and the range with it
        return self._range

    @property
    def sample_nbytes(self) -> np.ndarray:
        """The stored bytes of every sample, int64 [num_samples] (raw: h·w·3; jpeg: the compressed size)."""
        if self._nbytes is None:
            with self._lock:
                if self._nbytes is None:
                    self._load_table()
        assert self._nbytes is not None
        return self._nbytes

    def _load_table(self) -> None:
        n = self.num_samples
        if not self.indexed:  # one shape and size for all: views of one row, read-only
            shapes = np.broadcast_to(np.array([self.size, self.size], np.int64), (n, 2))
            nbytes = np.broadcast_to(np.array(self.sample_bytes, np.int64), (n,))
        else:
            shapes, nbytes = np.empty((n, 2), np.int64), np.empty(n, np.int64)
            if self.remote is not None:
                self.remote.ensure_indexes()  # downloaded in parallel, not one after another
            for s, rec in enumerate(self.manifest.shards):
                if rec.count:
                    index = self._index(s)
                    shapes[rec.first : rec.first + rec.count, 0] = index.heights
                    shapes[rec.first : rec.first + rec.count, 1] = index.widths
                    nbytes[rec.first : rec.first + rec.count] = index.nbytes
        if n:
            lo, hi = shapes.min(axis=0).tolist(), shapes.max(axis=0).tolist()
            self._range = ((lo[0], lo[1]), (hi[0], hi[1]))
        self._nbytes, self._shapes = nbytes, shapes  # shapes last: the unlocked check of shapes sees the rest

    # ----------------------------------------------------------------- index files
    @property
    def labels(self) -> np.ndarray:
        """All labels, int64 [num_samples], read and checked (size, checksum, range) on first use."""
        if self._labels is None:
            with self._lock:
                if self._labels is None:
                    self._labels = self._load_labels()
        return self._labels

    def path(self, index: int) -> str:
        """The source file of sample ``index``, relative to the source root."""
        i = self._check_index(index)
        if self._paths is None:
            with self._lock:
                if self._paths is None:
                    self._paths = self._load_paths()
        return self._paths[i]

    @staticmethod
    def _stat_identity(path: Path) -> Identity | None:
        try:
            return _identity(os.stat(path))
        except OSError:
            return None

    def _read_index_file(self, key: str, limit: int) -> tuple[Path, bytes]:
        """The bytes of index file ``key`` (labels, paths), checked to be the file seen at open and
        to match the manifest's checksum."""
        rec = self.manifest.files[key]
        path = self.root / rec.name
        try:
            fd = open_for_reading(path)
        except FileNotFoundError:
            if self._file_identities.get(key) is not None:  # there at open: removed since (a rebuild in place)
                raise CorruptShardError(_changed(path, f"{key} file", "is gone")) from None
            raise CorruptShardError(f"{path} is missing; rerun the same `datapipe build` to rewrite it") from None
        except OSError as exc:
            raise refused_error(str(path), exc) or CorruptShardError(
                f"{path} cannot be opened ({exc.strerror or exc}); rerun the same `datapipe build` to rewrite it") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise CorruptShardError(f"{path} is not a regular file; rerun the same `datapipe build` to rewrite it")
            if _identity(st) != self._file_identities.get(key):
                raise CorruptShardError(_changed(path, f"{key} file"))
            if st.st_size > limit:
                raise CorruptShardError(f"{path} is {st.st_size:,} bytes, more than the {limit:,} its "
                                        f"{self.num_samples:,} samples need; rerun the same `datapipe build` to rewrite it")
            data = bytearray(st.st_size)
            got = _pread_full(fd, memoryview(data), 0)
        finally:
            os.close(fd)
        if got != len(data):
            raise CorruptShardError(_changed(path, f"{key} file"))
        crc = _crc32c_hex(data)
        if crc != rec.crc32c:
            raise CorruptShardError(f"{path}: checksum {crc} differs from the manifest's {rec.crc32c} (altered after "
                                    "the build); rerun the same `datapipe build` to rewrite it")
        return path, bytes(data)

    def _load_labels(self) -> np.ndarray:
        n = self.num_samples
        path, data = self._read_index_file("labels", 8 * n + 65536)
        labels = _parse_labels(data, n, path)
        if n and (int(labels.min()) < 0 or int(labels.max()) >= len(self.classes)):
            bad = int(labels.min()) if int(labels.min()) < 0 else int(labels.max())
            raise CorruptShardError(f"{path} holds label {bad}, outside the {len(self.classes)} classes of the "
                                    "manifest; rerun the same `datapipe build` to rewrite it")
        return labels

    def _load_paths(self) -> list[str]:
        path, data = self._read_index_file("paths", 4096 * self.num_samples + 65536)
        paths = parse_json(data, path)
        if not isinstance(paths, list) or len(paths) != self.num_samples or not all(isinstance(p, str) for p in paths):
            raise CorruptShardError(f"{path} is not a list of {self.num_samples:,} paths (one string per sample); "
                                    "rerun the same `datapipe build` to rewrite it")
        for i, name in enumerate(paths):  # no build writes one: a reader that joins it to a source would leave it
            if not name or "\x00" in name or name.startswith("/") or ".." in name.split("/"):
                raise CorruptShardError(f"{path}: sample {i}'s path {show(name)} is no path inside a source (empty, "
                                        "absolute, or going up with '..'); rerun the same `datapipe build` to rewrite it")
        return paths

    # ----------------------------------------------------------------- samples
    def __getitem__(self, index: int) -> tuple[np.ndarray, int]:
        i = self._check_index(index)
        label = np.empty(1, np.int64)
        if self.indexed:
            return self.read_samples(np.array([i]), label)[0], int(label[0])
        out = np.empty((1, *self.sample_shape), np.uint8)
        self.read_batch(np.array([i]), out, label)
        return out[0], int(label[0])

    @property
    def shape(self) -> tuple[int, int, int]:
        """The shape every sample has (:attr:`sample_shape`); ArgumentError when shapes vary."""
        return self.sample_shape

    @property
    def sample_shape(self) -> tuple[int, int, int]:
        """The shape every sample has; ArgumentError naming the cache when shapes vary."""
        if self.fixed_shape is None:
            raise ArgumentError(f"the samples of {self.root} vary in shape (built with --fit short): read them one by "
                                "one with read_samples / sample_views, or rebuild with a square --fit for fixed shapes")
        return self.fixed_shape

    def _check_index(self, index: int) -> int:
        """A sample's number from ``index``: an int (or numpy integer), negative from the end; anything else
        (a float, a string, a bool, a slice) is refused, never rounded or converted."""
        try:
            if isinstance(index, (bool, np.bool_)):
                raise TypeError
            i = operator.index(index)  # an int, a numpy integer, a 0-d integer tensor
        except TypeError:
            raise TypeError(f"a sample index must be an integer (cache[i], cache.path(i)), got {show(index)} "
                            f"({type(index).__name__})") from None
        if i < 0:
            i += self.num_samples
        if not 0 <= i < self.num_samples:
            raise IndexError(f"sample index {index} out of range for a cache of {self.num_samples} samples")
        return i

    def read_batch(self, indices: np.ndarray, out: np.ndarray, labels_out: np.ndarray,
                   index_out: np.ndarray | None = None) -> int:
        """Read samples ``indices`` into ``out`` [>=n, H, W, 3], sorted by index; returns n.

        One guarded gather per shard out of its memory map (where the guard is in place), or one
        positioned read per run of consecutive indices, straight into ``out``; each shard file
        touched is checked (one fstat) to be the file seen at open. ``labels_out`` (and
        ``index_out``) receive the labels (and global indices) in the same order.

        A JPEG cache of square samples is read the same way, each sample decoded into its slot of
        ``out``; a cache whose samples vary in shape has no such batch (ArgumentError): use
        :meth:`read_samples` or :meth:`sample_views`.

        Raises:
            IndexError: an index is outside [0, len(cache)) (nothing is read).
            ArgumentError: the samples vary in shape.
            CorruptShardError: a shard file was truncated, replaced or altered since the cache was opened,
                or a stored JPEG does not decode (the message names the shard file and sample).
        """
        shape = self.sample_shape
        n = int(indices.size if isinstance(indices, np.ndarray) else np.asarray(indices).size)
        if n and (not isinstance(out, np.ndarray) or out.shape[0:1] < (n,) or out.shape[1:] != shape
                  or out.dtype != np.uint8 or not out.flags.writeable):
            got = (f"{out.shape} {out.dtype}{'' if out.flags.writeable else ', read-only'}" if isinstance(out, np.ndarray)
                   else type(out).__name__)
            raise ValueError(f"out must be a writable numpy uint8 array [>={n}, {', '.join(map(str, shape))}], got {got}")
        idx, shard_of = self._locate(indices, labels_out, index_out)  # checked before anything is written
        n = idx.shape[0]
        if n == 0:
            return 0
        target = out if out.flags.c_contiguous else np.empty((n, *shape), np.uint8)
        if self.indexed:
            self._read_indexed_into(idx, shard_of, target)
        elif self.mapped:
            self._gather(idx, shard_of, target)
        else:
            self._read_runs(idx, shard_of, target)
        if target is not out:
            out[:n] = target
        return n

    def read_samples(self, indices: np.ndarray, labels_out: np.ndarray, index_out: np.ndarray | None = None) -> list[np.ndarray]:
        """Samples ``indices`` as uint8 [h, w, 3] arrays each at its own shape, sorted by index.

        Raw samples are copied out (one guarded copy or positioned read per run of consecutive
        samples) into one buffer the arrays are views of; JPEG samples are copied out, then decoded.
        Labels (and indices) land in ``labels_out`` (``index_out``) in the same order.

        Raises:
            IndexError: an index is outside [0, len(cache)).
            CorruptShardError: a shard file changed since the cache was opened, or a stored sample is
                damaged (the message names the shard file and sample).
        """
        idx, shard_of = self._locate(indices, labels_out, index_out)
        if not idx.shape[0]:
            return []
        if not self.indexed:
            out = np.empty((idx.shape[0], *self.sample_shape), np.uint8)
            (self._gather if self.mapped else self._read_runs)(idx, shard_of, out)
            return list(out)
        buf, starts, nbytes, shapes = self._copy_out(idx, shard_of)
        if self.encoding == "raw":
            return [buf[a : a + k].reshape(h, w, 3) for a, k, (h, w) in zip(starts.tolist(), nbytes.tolist(), shapes.tolist(), strict=True)]
        return [decode_jpeg(buf[a : a + k], h, w, where=self._where(int(s), int(i)))
                for a, k, (h, w), s, i in zip(starts.tolist(), nbytes.tolist(), shapes.tolist(), shard_of, idx, strict=True)]

    def read_encoded(self, indices: np.ndarray, labels_out: np.ndarray, index_out: np.ndarray | None = None) -> EncodedBatch:
        """The stored JPEG bytes of samples ``indices``, sorted by index, each copied out of its shard
        (guarded copy or positioned read) with its shape and the ``where`` its decode errors name:
        decode them with :func:`datapipe.samples.decode_crop` / ``decode_jpeg`` (the GIL released) in
        the reader threads. Labels (and indices) land in ``labels_out`` (``index_out``).

        Raises:
            ArgumentError: the cache stores raw pixels (read them with :meth:`read_samples` / :meth:`sample_views`).
            IndexError, CorruptShardError: as :meth:`read_samples`.
        """
        if self.encoding != "jpeg":
            raise ArgumentError(f"{self.root} stores raw pixels, not JPEG: read them with read_samples or sample_views")
        idx, shard_of = self._locate(indices, labels_out, index_out)
        if not idx.shape[0]:
            empty = np.zeros(0, np.int64)
            return EncodedBatch(np.zeros(1, np.uint8), empty, empty, np.zeros((0, 2), np.int64), str)
        buf, starts, nbytes, shapes = self._copy_out(idx, shard_of)
        return EncodedBatch(buf, starts, nbytes, shapes, lambda k: self._where(int(shard_of[k]), int(idx[k])))

    def _where(self, shard: int, index: int) -> str:
        """What an error about sample ``index`` names: its shard's data file and the sample (made for
        every sample read, so the file's name is made once per shard)."""
        name = self._shard_files.get(shard)
        if name is None:
            name = self._shard_files[shard] = str(self._shard_path(shard))
        return f"{name}, sample {index}"

    def _spans(self, idx: np.ndarray, shard_of: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Offsets into their shard files, sizes and (h, w) of sorted samples of the indexed layout."""
        n = idx.shape[0]
        offsets, nbytes, shapes = np.empty(n, np.int64), np.empty(n, np.int64), np.empty((n, 2), np.int64)
        cuts = np.flatnonzero(np.diff(shard_of)) + 1
        for a, b in zip([0, *cuts.tolist()], [*cuts.tolist(), n], strict=True):
            s = int(shard_of[a])
            index, local = self._index(s), idx[a:b] - self.starts[s]
            offsets[a:b], nbytes[a:b] = index.offsets[local], index.nbytes[local]
            shapes[a:b, 0], shapes[a:b, 1] = index.heights[local], index.widths[local]
        return offsets, nbytes, shapes

    def _copy_out(self, idx: np.ndarray, shard_of: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The stored bytes of sorted samples of the indexed layout, copied into one new buffer:
        ``(buffer, start of each sample in it, sizes, shapes)``."""
        offsets, nbytes, shapes = self._spans(idx, shard_of)
        starts = np.concatenate(([0], np.cumsum(nbytes)))
        buf = np.empty(max(int(starts[-1]), 1), np.uint8)
        self._copy_spans(idx, shard_of, offsets, nbytes, buf, starts[:-1])
        return buf, starts[:-1], nbytes, shapes

    def _copy_spans(self, idx: np.ndarray, shard_of: np.ndarray, offsets: np.ndarray, nbytes: np.ndarray,
                    buf: np.ndarray, dst: np.ndarray) -> None:
        """Copy each sample's bytes (``offsets``, ``nbytes`` in its shard file) to ``buf[dst:]``: one
        guarded copy of all a shard's samples out of its map, or one positioned read per run of
        consecutive samples of one shard, whose bytes lie back to back in the file as in ``buf``."""
        n = idx.shape[0]
        cuts = (np.flatnonzero(np.diff(shard_of)) + 1).tolist()
        runs = (np.flatnonzero((np.diff(idx) != 1) | (np.diff(shard_of) != 0)) + 1).tolist()
        flat, address = buf.data.cast("B"), buf.ctypes.data
        for a, b in zip([0, *cuts], [*cuts, n], strict=True):  # the samples of one shard
            s = int(shard_of[a])
            entry = self._acquire(s)
            try:
                if entry.mapping is not None:
                    try:
                        native.gather_spans(address, entry.mapping, offsets[a:b], nbytes[a:b], dst[a:b])
                    except MappedReadError:
                        raise CorruptShardError(self._shard_changed(s, "ends early")) from None
                else:
                    inner = runs[bisect.bisect_right(runs, a) : bisect.bisect_left(runs, b)]  # runs split at these
                    for r0, r1 in zip([a, *inner], [*inner, b], strict=True):
                        off, d = int(offsets[r0]), int(dst[r0])
                        size = int(offsets[r1 - 1] + nbytes[r1 - 1]) - off
                        if _pread_full(entry.fd, flat[d : d + size], off) != size:
                            raise CorruptShardError(self._shard_changed(s, "ends early"))
            except BaseException:
                self._files.release(s)
                raise
            self._release_checked(s, entry)

    def _release_checked(self, shard: int, entry: _Shard | None) -> None:
        """Release a shard after copies or reads out of it; they count only if the file is still the one seen at
        open (a file truncated during a copy may have read as zeros in its last page instead of faulting, and one
        written over in place between the check before a read and the read gave the new bytes)."""
        try:
            if entry is not None:
                self._check_fd(shard, entry.fd)
        finally:
            self._files.release(shard)

    def _read_indexed_into(self, idx: np.ndarray, shard_of: np.ndarray, out: np.ndarray) -> None:
        """Samples of the indexed layout, all of ``out``'s shape, into ``out`` (C-contiguous): raw
        samples straight into their slots, JPEG samples copied out and decoded into their slots."""
        n = idx.shape[0]
        per = int(np.prod(out.shape[1:]))
        if self.encoding == "raw":
            offsets, nbytes, _ = self._spans(idx, shard_of)
            self._copy_spans(idx, shard_of, offsets, nbytes, out.reshape(-1), np.arange(n, dtype=np.int64) * per)
            return
        buf, starts, nbytes, shapes = self._copy_out(idx, shard_of)
        for k, (a, size, (h, w)) in enumerate(zip(starts.tolist(), nbytes.tolist(), shapes.tolist(), strict=True)):
            decode_jpeg(buf[a : a + size], h, w, where=self._where(int(shard_of[k]), int(idx[k])), out=out[k])

    def _locate(self, indices: np.ndarray | Sequence[int], labels_out: np.ndarray,
                index_out: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
        """Sorted, range-checked indices [n] and the shard of each; their labels (and the indices) written out.
        Integers only, as for ``cache[i]``: floats, bools (a mask is no list of indices) and strings are refused,
        never rounded or converted."""
        if isinstance(indices, np.ndarray) and indices.dtype == np.int64:  # the loader's batches
            idx = np.sort(indices.reshape(-1))
        else:
            given = np.asarray(indices)
            if given.size and given.dtype.kind not in "iu":
                raise TypeError(f"sample indices must be integers (read_batch, read_samples), got {given.dtype} "
                                f"values such as {show(given.reshape(-1)[:3].tolist())}")
            if given.size and given.dtype.kind == "u" and int(given.max()) >= self.num_samples:
                raise IndexError(f"sample index {int(given.max())} out of range for a cache of {self.num_samples} "
                                 f"samples ({self.root})")
            idx = np.sort(given.astype(np.int64).reshape(-1))  # [n]
        n = idx.shape[0]
        if n and (idx[0] < 0 or idx[-1] >= self.num_samples):
            bad = int(idx[0]) if idx[0] < 0 else int(idx[-1])
            raise IndexError(f"sample index {bad} out of range for a cache of {self.num_samples} samples ({self.root})")
        for name, buf in (("labels_out", labels_out), ("index_out", index_out)):
            if buf is None and name == "index_out":
                continue
            largest = max(len(self.classes), self.num_samples) if name == "index_out" else len(self.classes)
            if (not isinstance(buf, np.ndarray) or buf.ndim != 1 or buf.shape[0] < n or not buf.flags.writeable
                    or buf.dtype.kind not in "iuf" or _holds_exactly(buf.dtype) < largest):
                got = f"{buf.shape} {buf.dtype}" if isinstance(buf, np.ndarray) else type(buf).__name__
                raise ValueError(f"{name} must be a writable 1-D numpy array of at least {n} (one per index) of a type "
                                 f"that holds {largest:,} (int64), got {got}")
        labels_out[:n] = self.labels[idx]
        if index_out is not None:
            index_out[:n] = idx
        return idx, np.searchsorted(self.starts, idx, side="right") - 1

    def _read_runs(self, idx: np.ndarray, shard_of: np.ndarray, out: np.ndarray) -> None:
        """One positioned read per run of consecutive samples of one shard, into ``out``."""
        n = idx.shape[0]
        breaks = np.flatnonzero((np.diff(idx) != 1) | (np.diff(shard_of) != 0)) + 1
        begins = np.concatenate(([0], breaks)).tolist()
        ends = np.concatenate((breaks, [n])).tolist()
        local = (idx - self.starts[shard_of]).tolist()
        shards = shard_of.tolist()
        flat = out.reshape(-1).data.cast("B")  # n >= 1 samples: never empty
        per = self.sample_bytes
        held, entry, fd = -1, None, -1
        try:
            for a, b in zip(begins, ends, strict=True):
                s = shards[a]
                if s != held:
                    if held >= 0:
                        done, held = held, -1
                        self._release_checked(done, entry)  # the reads count only from the file checked before them
                    entry = self._acquire(s)
                    held, fd = s, entry.fd
                want = (b - a) * per
                if _pread_full(fd, flat[a * per : b * per], local[a] * per) != want:
                    raise CorruptShardError(self._shard_changed(s, "ends early"))
            if held >= 0:
                done, held = held, -1
                self._release_checked(done, entry)
        finally:
            if held >= 0:
                self._files.release(held)

    def _gather(self, idx: np.ndarray, shard_of: np.ndarray, out: np.ndarray) -> None:
        """One guarded gather per shard out of its memory map, into ``out`` (C-contiguous)."""
        n, per = idx.shape[0], self.sample_bytes
        cuts = np.flatnonzero(np.diff(shard_of)) + 1
        offsets = (idx - self.starts[shard_of]) * per  # bytes into each sample's shard file
        base = out.ctypes.data
        for a, b in zip([0, *cuts.tolist()], [*cuts.tolist(), n], strict=True):
            s = int(shard_of[a])
            entry = self._acquire(s)
            try:
                if entry.mapping is None:  # the map could not be made: positioned reads for this shard
                    self._read_runs(idx[a:b], shard_of[a:b], out[a:b])
                    continue
                native.gather(base + a * per, entry.mapping, offsets[a:b], per)
                # A file truncated during the copy may have read as zeros in its last page instead
                # of faulting: the copy counts only if the file is still the one seen at open.
                self._check_fd(s, entry.fd)
            except MappedReadError:
                raise CorruptShardError(self._shard_changed(s, "ends early")) from None
            finally:
                self._files.release(s)

    def _acquire(self, shard: int) -> _Shard:
        """The open shard (release it with ``self._files.release``), checked (one fstat) to be the file seen at open."""
        entry = self._files.acquire(shard, lambda: self._open_shard(shard), self._note_map)
        try:
            self._check_fd(shard, entry.fd)
        except BaseException:
            self._files.release(shard)
            raise
        return entry

    def sample_views(self, indices: np.ndarray, labels_out: np.ndarray,
                     index_out: np.ndarray | None = None, out: Any = None, *, mapped: bool = False) -> list:
        """Samples ``indices`` as uint8 [H, W, 3] torch tensors, sorted by index.

        With ``mapped=True`` where the cache reads through memory maps (:attr:`mapped`), the
        tensors are views of the shard files' maps and nothing is copied: a consumer that reads only
        part of each sample (a random crop) reads only those pixels. Such views may be read ONLY
        through the guarded kernels of :mod:`datapipe.native` (the CPU presets' resize and
        conversion; ``TrainAugment.reads_in_place`` says when a preset does): anything else reading
        a page of a file truncated meanwhile dies of SIGBUS. A guarded read that faults raises
        MappedReadError; :meth:`shard_error` turns it into the error naming the shard.

        Otherwise the samples are read into ``out`` (a uint8 [>=n, H, W, 3] torch tensor or numpy
        array the caller reuses: the loader passes its batch buffer) or into a new buffer, with the
        checks of :meth:`read_batch`. The list is what the CPU augmentation presets take. Labels
        (and indices) land in ``labels_out`` in the same order.

        Samples of varying shape (``--fit short``) are each at their own shape: views of the maps
        (raw, ``mapped=True``), or read as :meth:`read_samples` does (``out`` is not used). JPEG
        samples are always decoded copies (into ``out`` when every sample has its shape).
        """
        import torch

        if mapped and self.mapped and self.encoding == "raw":
            return self._mapped_views(indices, labels_out, index_out)
        if self.fixed_shape is None:
            return [torch.from_numpy(a) for a in self.read_samples(indices, labels_out, index_out)]
        n = int(np.asarray(indices).size)
        if out is None:
            out = torch.empty((n, *self.fixed_shape), dtype=torch.uint8)
        elif isinstance(out, np.ndarray):
            out = torch.from_numpy(out)
        n = self.read_batch(indices, out.numpy(), labels_out, index_out)
        return list(out[:n].unbind(0))

    def _mapped_views(self, indices: np.ndarray, labels_out: np.ndarray, index_out: np.ndarray | None) -> list:
        import torch

        idx, shard_of = self._locate(indices, labels_out, index_out)
        views: list = []
        n = idx.shape[0]
        if n == 0:
            return views
        native.guard_arm()  # the handler is (again) the first to see a SIGBUS while these views are read
        cuts = np.flatnonzero(np.diff(shard_of)) + 1
        local = (idx - self.starts[shard_of]).tolist()
        for a, b in zip([0, *cuts.tolist()], [*cuts.tolist(), n], strict=True):
            s = int(shard_of[a])
            entry = self._acquire(s)
            try:
                if entry.mapping is None:  # the map could not be made: read these samples
                    views.extend(torch.from_numpy(v) for v in self._read_copies(idx[a:b], shard_of[a:b]))
                    continue
                if self.indexed:
                    views.extend(self._indexed_views(s, entry, local[a:b]))
                    continue
                if entry.tensor is None:
                    count = int(self.counts[s])
                    shape = self.sample_shape
                    entry.tensor = torch.from_numpy(entry.mapping.array()[: count * self.sample_bytes].reshape(count, *shape))
                t = entry.tensor  # each view holds the map (not the descriptor) alive
                views.extend(t[i] for i in local[a:b])
            finally:
                self._files.release(s)
        return views

    def _read_copies(self, idx: np.ndarray, shard_of: np.ndarray) -> list[np.ndarray]:
        """Copies of raw samples (sorted), each at its own shape."""
        if not self.indexed:
            out = np.empty((idx.shape[0], *self.sample_shape), np.uint8)
            self._read_runs(idx, shard_of, out)
            return list(out)
        buf, starts, nbytes, shapes = self._copy_out(idx, shard_of)
        return [buf[a : a + k].reshape(h, w, 3) for a, k, (h, w) in zip(starts.tolist(), nbytes.tolist(), shapes.tolist(), strict=True)]

    def _indexed_views(self, shard: int, entry: _Shard, local: list[int]) -> list:
        """Views [h, w, 3] of the map of an indexed raw shard, one per sample (local indices)."""
        import torch

        if entry.tensor is None:
            entry.tensor = torch.from_numpy(entry.mapping.array())  # type: ignore[union-attr]  # flat uint8: the samples back to back
        index, t = self._index(shard), entry.tensor
        offsets, heights, widths = index.offsets[local].tolist(), index.heights[local].tolist(), index.widths[local].tolist()
        return [t[o : o + h * w * 3].view(h, w, 3) for o, h, w in zip(offsets, heights, widths, strict=True)]

    @contextmanager
    def mapped_reads(self, indices: np.ndarray) -> Iterator[None]:
        """Around the reads of mapped views of samples ``indices`` (``sample_views(mapped=True)``):
        a guarded read that faulted becomes the error naming the shard (:meth:`shard_error`), and
        when the reads are done each shard file they touched is checked (one fstat) to be the file
        seen at open — a file truncated meanwhile may read as zeros in its last page instead of
        faulting."""
        try:
            yield
        except MappedReadError as exc:
            raise self.shard_error(exc) from None
        idx = np.asarray(indices, np.int64).reshape(-1)
        for s in np.unique(np.searchsorted(self.starts, idx, side="right") - 1).tolist():
            self._acquire(s)  # raises CorruptShardError naming a shard that changed
            self._files.release(s)

    def shard_error(self, exc: MappedReadError) -> CorruptShardError:
        """The error naming the shard whose map a guarded read faulted in (``exc.address``)."""
        with self._map_lock:
            i = bisect.bisect_right(self._map_starts, exc.address) - 1
            end, shard, _ = self._map_ranges[self._map_starts[i]] if i >= 0 else (0, -1, None)
        if exc.address < end:
            return CorruptShardError(self._shard_changed(shard, "ends early"))
        return exc

    # ----------------------------------------------------------------- shard files
    def _shard_path(self, shard: int) -> Path:
        path = self._data_paths.get(shard)  # made once: a shuffled epoch over many shards opens them again and again
        if path is None:
            path = self._data_paths[shard] = images_path(self.root / SHARDS_DIR / self.shard_names[shard], self.layout)
        return path

    def _index_path(self, shard: int) -> Path:
        return index_path(self.root / SHARDS_DIR / self.shard_names[shard])

    def _index(self, shard: int) -> SampleIndex:
        """The checked sample index of an indexed shard, read on first use."""
        index = self._indexes.get(shard)
        if index is None:
            with self._index_lock:
                index = self._indexes.get(shard)
                if index is None:
                    index = self._indexes[shard] = self._load_index(shard)
        return index

    @property
    def _rewrite_hint(self) -> str:
        """What to do about a damaged shard file: rebuild it, or, in a node's copy of a cache in a store, drop
        the copy (the store's objects are not in question: each was checked when it was downloaded)."""
        if self.remote is not None:
            return (f"remove the folder {self.root} (this node's copy of {self.remote.url}: it holds only copies of "
                    "the store's objects) and run again")
        return "rerun the same `datapipe build` with --verify to rewrite the shard (a plain rerun checks sizes, not contents)"

    def _in_the_way(self, s: int) -> str | None:
        """What must be moved before a build rewrites shard ``s`` of this folder (a build never deletes what it did
        not write, nor a shard whose zarr.json names no build of this cache: zarr-python recreated the group,
        another cache's shard was copied in), as advice; None when a rerun rewrites it as it is."""
        shard_dir = self.root / SHARDS_DIR / self.manifest.shards[s].name
        if self.node_cache_of is not None:  # a node's copy of a cache in a store: no build writes here
            return f"delete {self._shard_path(s)}: the next reader of {self.node_cache_of} downloads it again"
        foreign = foreign_entries(shard_dir) if shard_dir.is_dir() and not shard_dir.is_symlink() else []
        if foreign:
            more = f" (and {len(foreign) - 1} more)" if len(foreign) > 1 else ""
            return (f"{foreign[0]}{more} in the shard's folder is no file a build writes: move it out (datapipe never "
                    "deletes what it did not write), then rerun the same `datapipe build` with --verify to rewrite "
                    "the shard")
        build_id = shard_build_id(shard_dir)  # as the build tells its own shard (None: no readable record)
        if shard_dir.is_symlink() or (os.path.lexists(shard_dir) and build_id != (self.build_id or build_id)):
            return MOVE_AWAY
        return None

    def _rebuilt(self) -> bool:
        """Whether the cache on disk is no longer the build this reader opened: its manifest is gone, cannot
        be read, or is another (a rebuild writes a new one, ``--force`` under a new build id). Asked only
        once a shard's file is found wrong, to tell a rebuild (reopen the cache) from damage (rebuild it):
        advice to rebuild a cache that was just rebuilt, maybe into another layout, would undo that build."""
        if self.remote is not None:
            return False  # a node's copy of a store's cache: its files are checked as they are downloaded
        try:
            return mf.read_manifest(self.root) != self.manifest
        except CacheError:
            return True

    def _load_index(self, shard: int) -> SampleIndex:
        """Read shard ``shard``'s sample index and check it (see :meth:`_read_index`); an index that is
        wrong because the cache was rebuilt since it was opened is said to be that.

        Raises:
            CorruptShardError: naming the index file, with what is wrong.
        """
        self._ensure_record(shard)  # a shard of another cache is said to be that, before its index is found wrong
        try:
            return self._read_index(shard)
        except CorruptShardError:
            if self._rebuilt():
                raise CorruptShardError(_changed(self._index_path(shard), f"shard {self.shard_names[shard]}'s sample index",
                                                 "is not the one the cache was opened with")) from None
            raise

    def _read_index(self, shard: int) -> SampleIndex:
        """Read shard ``shard``'s sample index (a bounded read of a regular file), check its crc32c
        against the manifest's, every row, and that the samples fill the data file the manifest sizes.

        Raises:
            CorruptShardError: naming the index file, with what is wrong.
        """
        rec = self.manifest.shards[shard]
        path = self._index_path(shard)
        where = f"shard {rec.name} ({path})"
        if self.remote is not None:
            self.remote.ensure_index(shard)
        limit = rec.count * INDEX_ROW_BYTES
        try:
            raw = read_regular(path, limit)
        except FileNotFoundError:
            raise CorruptShardError(f"{where}: the sample index is missing; {self._rewrite_hint}") from None
        except NotRegularFile:
            raise CorruptShardError(f"{where}: the sample index is not a regular file; {self._rewrite_hint}") from None
        except FileTooLarge as exc:
            raise CorruptShardError(f"{where}: the sample index is {exc.size:,} bytes, more than the {limit:,} of "
                                    f"{rec.count} samples; {self._rewrite_hint}") from None
        except OSError as exc:
            raise refused_error(f"{where}: the sample index", exc) or CorruptShardError(
                f"{where}: the sample index cannot be read ({exc.strerror or exc}); check the storage, then reopen "
                "the cache") from None
        want = rec.index_crc32c
        crc = _crc32c_hex(raw)
        if crc != want:
            raise CorruptShardError(f"{where}: sample index checksum {crc} differs from the manifest's {want or 'none'} "
                                    f"(altered after the build); {self._rewrite_hint}")
        index = SampleIndex.parse(raw, count=rec.count, encoding=self.encoding, max_side=self.max_side, where=where)
        self._check_shapes(index, where)
        if indexed_file_size(index.data_size) != rec.nbytes:
            raise CorruptShardError(f"{where}: the sample index covers {index.data_size:,} bytes of samples, which "
                                    f"do not fill the {rec.nbytes:,}-byte data file of the manifest; {self._rewrite_hint}")
        return index

    def _check_shapes(self, index: SampleIndex, where: str) -> None:
        """Every sample has the cache's shape (square fits) or its shorter side is the size (--fit short)."""
        if self.fixed_shape is not None:
            bad = np.flatnonzero((index.heights != self.size) | (index.widths != self.size))
            want = f"{self.size}x{self.size}"
        else:
            bad = np.flatnonzero(np.minimum(index.heights, index.widths) != self.size)
            want = f"a shorter side of {self.size}"
        if bad.size:
            i = int(bad[0])
            raise CorruptShardError(f"{where}: the sample index gives sample {i} the shape "
                                    f"{int(index.heights[i])}x{int(index.widths[i])}, the cache's samples have {want}; "
                                    f"{self._rewrite_hint}")

    def _shard_changed(self, shard: int, what: str) -> str:
        if self.remote is not None:  # a node's copy: the store's cache is not in question, and no build mends it
            return (f"shard {self.shard_names[shard]} ({self._shard_path(shard)}) {what}: this node's copy changed "
                    f"since it was read; {self._rewrite_hint}")
        return _changed(self._shard_path(shard), f"shard {self.shard_names[shard]}", what)

    def _open_shard(self, shard: int) -> _Shard:
        if self.remote is None:
            return self._open_local(shard)
        hold = self.remote.hold(shard)  # downloaded (checked, renamed into place) and held against eviction
        try:
            with self._lock:  # a shard downloaded again is a new file: the one checked on download is the one seen
                self._identities.pop(shard, None)
            entry = self._open_local(shard)
        except BaseException:
            if hold is not None:
                hold.release()
            raise
        entry.hold = hold
        return entry

    def _open_local(self, shard: int) -> _Shard:
        path = self._shard_path(shard)
        try:
            fd = open_for_reading(path)
        except (FileNotFoundError, NotADirectoryError):  # gone, or a file where its folder was (another layout)
            raise CorruptShardError(self._shard_changed(shard, "is gone")) from None
        except OSError as exc:
            raise refused_error(f"shard {self.shard_names[shard]} ({path})", exc) or CorruptShardError(
                f"shard {self.shard_names[shard]} ({path}) cannot be opened ({exc.strerror or exc}); check the "
                "storage, then reopen the cache") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                if self._rebuilt():  # a folder where the data file was: a rebuild into another layout
                    raise CorruptShardError(self._shard_changed(shard, "is not a file any more"))
                raise CorruptShardError(f"shard {self.shard_names[shard]} ({path}) is not a regular file but "
                                        f"{describe_mode(st.st_mode)}; move it away and rerun the same `datapipe "
                                        "build` to rewrite the shard (datapipe never deletes what it did not write)")
            with self._lock:
                seen = self._identities.setdefault(shard, _identity(st))
            if seen != _identity(st):
                raise CorruptShardError(self._shard_changed(shard, "was replaced or altered"))
            self._ensure_record(shard)
            return _Shard(fd, self._map(shard, fd))
        except BaseException:
            os.close(fd)
            raise

    def _ensure_record(self, shard: int) -> None:
        """:meth:`_check_record`, once per shard and process, for a cache in a folder (a node-local copy has no
        zarr.json: its files are checked as they are downloaded)."""
        if shard in self._records_checked or self.remote is not None or self.node_cache_of is not None:
            return
        self._check_record(shard)
        self._records_checked.add(shard)

    def _raise_if_changed(self, shard: int) -> None:
        """CorruptShardError saying the cache changed since it was opened, when it did (a rebuild finished, or one
        is writing it now): a shard found wrong then is no damage to repair."""
        if self._rebuilt():
            raise CorruptShardError(self._shard_changed(shard, "was rewritten by a rebuild"))
        holder = lock_holder(self.root)
        if holder is not None:
            raise CorruptShardError(self._shard_changed(shard, f"is being rewritten by a datapipe build ({holder})"))

    def _check_record(self, shard: int) -> None:
        """The first time this cache opens a shard: its zarr.json is the record of this cache's shard (its build,
        position, sample count and checksum), so that a shard folder copied in from another cache of the same
        shape, or an older copy of this one's, is refused rather than read with this cache's labels. One small
        read per shard and process; a node-local copy (no zarr.json) is checked by its download instead."""
        rec = self.manifest.shards[shard]
        shard_dir = self.root / SHARDS_DIR / rec.name
        try:
            meta = read_shard_metadata(shard_dir)
        except UnreadableFileError:
            raise
        except CacheError as exc:
            self._raise_if_changed(shard)  # a rebuild moves the shard's folder away before it writes it again
            raise CorruptShardError(f"shard {rec.name}: {exc}") from None
        differ = [(key, meta.get(key), want) for key, want in
                  (("build_id", self.build_id or None), ("shard", shard), ("count", rec.count), ("crc32c", rec.crc32c))
                  if want is not None and meta.get(key) != want]
        if not differ:
            return
        self._raise_if_changed(shard)
        key, got, want = differ[0]
        # a shard of this build the build rewrites (--verify: its size is right); another build's it leaves alone
        fix = MOVE_AWAY if key == "build_id" else self._rewrite_hint
        raise CorruptShardError(
            f"shard {rec.name} ({shard_dir}) is not the one this cache's manifest lists: its zarr.json says {key} "
            f"{show(got)}, the manifest {show(want)} (a shard of another cache, or an older copy, put in its place?); "
            f"{fix}")

    def _map(self, shard: int, fd: int) -> native.Mapping | None:
        """A memory map of the shard's samples (None on the positioned-read path, or when mapping
        fails: then this shard is read with positioned reads). It spans the samples the manifest
        counts, whatever the file's size: a page past the file's end faults inside the guard."""
        if not self.mapped:
            return None
        size = self._index(shard).data_size if self.indexed else int(self.counts[shard]) * self.sample_bytes
        if size < 1 or os.fstat(fd).st_size < size:  # a short file: short reads name it
            return None
        try:
            return native.Mapping(fd, size)
        except OSError:
            return None

    def _note_map(self, shard: int, entry: _Shard) -> None:
        """Record the address range of the map of ``entry``, the open shard kept (see :meth:`shard_error`): that of a
        shard another thread opened at the same time is closed, and names no shard."""
        if entry.mapping is None:
            return
        address, end = entry.mapping.address, entry.mapping.address + entry.mapping.length
        with self._map_lock:
            starts, ranges = self._map_starts, self._map_ranges
            i = bisect.bisect_left(starts, end)  # the ranges kept never overlap: sorted by start, they are by end too
            while i > 0 and ranges[starts[i - 1]][0] > address:  # maps unmapped from this address range
                i -= 1
                del ranges[starts.pop(i)]
            starts.insert(i, address)
            ranges[address] = (end, shard, weakref.ref(entry.mapping))
            if len(starts) > self._map_sweep:  # maps unmapped whose addresses no new map took: forgotten
                starts[:] = [a for a in starts if ranges[a][2]() is not None]
                for a in [a for a, kept in ranges.items() if kept[2]() is None]:
                    del ranges[a]
                self._map_sweep = max(64, 2 * len(starts))

    def _check_fd(self, shard: int, fd: int) -> None:
        """The open file is still the one seen at open: same size and modification time."""
        if _identity(os.fstat(fd)) != self._identities[shard]:
            raise CorruptShardError(self._shard_changed(shard, "was truncated or altered"))

    def check_sizes(self) -> None:
        """Raise CorruptShardError naming the first shard whose file size differs from the manifest,
        and record every shard file's identity (what later reads check against)."""
        for s in range(len(self.manifest.shards)):
            problem = self._size_problem(s)
            if problem is not None:
                raise problem

    def _size_problem(self, s: int) -> CacheError | None:
        """Shard ``s``'s data file against the manifest's size: the error naming it and what to do, or None (its
        identity then recorded). A shard whose every file was quarantined has no data file."""
        rec = self.manifest.shards[s]
        if rec.count == 0:
            return None
        path = self._shard_path(s)
        try:
            st = os.stat(path)
            actual = st.st_size if stat.S_ISREG(st.st_mode) else -2
        except (FileNotFoundError, NotADirectoryError):
            actual = -1
        except OSError as exc:  # there, but not to be looked at (no permission, an I/O error): not damage
            return UnreadableFileError(f"shard {rec.name} ({path}) cannot be read ({exc.strerror or exc}); check "
                                       "the permissions of the cache's files and folders")
        if actual == -1 and self.node_cache_of is not None:
            return CacheError(
                f"shard {rec.name} ({path}) has not been downloaded: {self.root} is a node-local cache of "
                f"{self.node_cache_of}, which downloads shards as they are read; open "
                f"StreamingDataset({self.node_cache_of!r}, local_cache={str(self.root.parent)!r}) instead")
        if actual == -2:  # never removed by a build (it did not write it): moved away by the user first
            return CorruptShardError(
                f"shard {rec.name} ({path}) is not a regular file but {describe_mode(st.st_mode)}; move it away "
                "and rerun the same `datapipe build` to rewrite the shard (datapipe never deletes what it did not "
                "write)")
        if actual != rec.nbytes:
            what = "missing" if actual == -1 else f"{actual:,} bytes, expected {rec.nbytes:,}"
            return CorruptShardError(f"shard {rec.name} ({path}) is {what}: truncated or altered after the build; "
                                     f"{self._in_the_way(s) or 'rerun the same `datapipe build` to rewrite it'}")
        self._identities[s] = _identity(st)
        return None

    # ----------------------------------------------------------------- verify
    def verify(self, *, progress: bool = False) -> list[str]:
        """Check every file of the cache against the manifest; return the problems, one line each.

        The index files (labels, paths: checksum, shape, range), and for each shard its data
        file's checksum, the record in its ``zarr.json`` (count, size, checksum) and its own labels
        chunk against labels.npy.
        """
        shown = check_bool(progress, "progress")  # before any work
        problems: list[str] = []
        labels = self._verify_step(problems, self._load_labels)
        paths = self._verify_step(problems, self._load_paths)
        if labels is not None and paths is not None and self.manifest.source.kind == "folder":
            problems.extend(self._misnamed(labels, paths))
        for key, rec in self.manifest.files.items():
            if key not in ("labels", "paths"):
                path = self.root / rec.name
                if self._verify_step(problems, functools.partial(file_crc32c, path)) not in (None, rec.crc32c):
                    problems.append(f"{key} file {path}: checksum differs from the manifest")
        self.verified_shards = 0
        if self.node_cache_of is None:  # every shard file's size, before any is read
            sizes = [self._size_problem(s) for s in range(len(self.manifest.shards))]
            unreadable = [e for e in sizes if isinstance(e, UnreadableFileError)]
            if unreadable:  # no damage: a folder that cannot be looked into hides every shard alike
                raise unreadable[0]
        bar = progress_bar(self.manifest.shards, desc="verify", unit="shard", disable=not shown)
        for s, _ in enumerate(bar):
            if self.node_cache_of is not None:
                problems.extend(self._verify_downloaded(s))
            else:
                problems.extend(self._verify_shard(s, labels, paths, sizes[s]))
                self.verified_shards += 1
        if self.node_cache_of is None:
            self._check_not_rebuilt_meanwhile(found=bool(problems))
        return problems

    def _misnamed(self, labels: np.ndarray, paths: list[str]) -> list[str]:
        """A folder source's samples whose class folder (their path's first part) is not their class's name: the
        manifest's class list edited (two names swapped) would name every sample of those classes wrongly."""
        folders = np.array([p.split("/", 1)[0] for p in paths], dtype=object)
        named = np.array(self.classes, dtype=object)[labels] if len(labels) else folders
        wrong = np.flatnonzero(folders != named)
        if not wrong.size:
            return []
        i = int(wrong[0])
        return [f"manifest {self.root / mf.MANIFEST}: {len(wrong):,} samples' class folder is not their class's name "
                f"(sample {i}, {show(paths[i])}, is labelled {show(str(named[i]))}): the class list is not the one the "
                "build wrote; move the manifest away and rerun the same `datapipe build` to rewrite it"]

    def _check_not_rebuilt_meanwhile(self, *, found: bool) -> None:
        """Raise when the folder's manifest is no longer the one read at open (an incremental rebuild keeps the build
        id and configuration, and writes another), or, when :meth:`verify` ``found`` problems, a build holds the
        folder's lock: what it found missing or different is that build's work, not damage, and an empty list would
        speak for a cache that is no longer there.

        Raises:
            CacheError: naming the build (its lock holder) or saying the cache was rebuilt.
        """
        holder = lock_holder(self.root, certain=True) if found else None  # never a stale lock file hiding damage
        try:
            now: Manifest | None = mf.read_manifest(self.root)
        except CacheError:
            now = None
        if holder is None and now == self.manifest:
            return
        why = (f"a datapipe build is writing it now ({holder})" if holder is not None
               else "it was rebuilt while it was being verified")
        found_what = ("what verify found missing or changed is that build's work, not damage" if found
                      else "verify checked the cache as it was before")
        raise CacheError(f"{self.root}: {why}, so {found_what}; run `datapipe verify` again once the build has finished")

    def _verify_downloaded(self, s: int) -> list[str]:
        """A node-local cache's shard: the files downloaded so far (data file, sample index) against the
        manifest; its zarr.json and labels chunk are never downloaded (labels.npy holds the labels)."""
        rec = self.manifest.shards[s]
        if not rec.count:
            return []
        fix = "delete it: the next reader downloads it again"
        problems, found = [], False
        if self.indexed and os.path.lexists(self._index_path(s)):
            found = True
            try:
                self._load_index(s)
            except CacheError as exc:
                problems.append(str(exc) if isinstance(exc, UnreadableFileError) else f"{exc}; {fix}")
        if os.path.lexists(self._shard_path(s)):
            found = True
            problems.extend(self._verify_data(s, read_fix=f"; {fix}", crc_fix=fix))
        self.verified_shards += found
        return problems

    def _verify_data(self, s: int, *, read_fix: str, crc_fix: str) -> list[str]:
        """The shard's data file against the manifest's crc32c: no problem, or one naming the file and
        ending with what to do (``read_fix`` after a read error, ``crc_fix`` after a mismatch)."""
        rec = self.manifest.shards[s]
        path = self._shard_path(s)
        try:
            crc = file_crc32c(path)
        except (CacheError, OSError) as exc:
            fix = f"; {PERMISSION_ADVICE}" if refused(exc) else read_fix
            return [f"shard {rec.name}: {path} cannot be read ({getattr(exc, 'strerror', None) or exc}){fix}"]
        if crc != rec.crc32c:
            return [f"shard {rec.name}: checksum {crc} != manifest {rec.crc32c} ({path}); {crc_fix}"]
        return []

    @staticmethod
    def _verify_step(problems: list[str], fn: Callable[[], T]) -> T | None:
        try:
            return fn()
        except (CacheError, OSError) as exc:
            problems.append(str(exc) if isinstance(exc, CacheError) else f"{exc.filename}: {exc.strerror or exc}")
            return None

    def _verify_shard(self, s: int, labels: np.ndarray | None, paths: list[str] | None,
                      wrong_size: CacheError | None) -> list[str]:
        rec = self.manifest.shards[s]
        shard_dir = self.root / SHARDS_DIR / rec.name
        name = f"shard {rec.name}"
        try:
            meta = read_shard_metadata(shard_dir)
        except CacheError as exc:
            return [f"{name}: {exc}"]
        if self.build_id and meta.get("build_id") != self.build_id:  # a build leaves another build's shard alone
            return [f"{name}: {shard_dir / 'zarr.json'} says build_id {show(meta.get('build_id'))}, the manifest "
                    f"{show(self.build_id)} (a shard of another cache or build in its place); {MOVE_AWAY}"]
        keys = [("shard", s), ("count", rec.count), ("nbytes", rec.nbytes), ("crc32c", rec.crc32c)]
        if self.indexed:
            keys.append(("index_crc32c", rec.index_crc32c))
        problems = [f"{name}: {shard_dir / 'zarr.json'} says {key} {meta.get(key)!r}, the manifest {want!r}; "
                    "`datapipe build SOURCE OUTPUT --verify` rewrites it" for key, want in keys if meta.get(key) != want]
        if paths is not None and meta.get("paths") != paths[rec.first : rec.first + rec.count]:
            problems.append(f"{name}: the paths in {shard_dir / 'zarr.json'} differ from paths.json; "
                            "`datapipe build SOURCE OUTPUT --verify` rewrites it")
        size: int | None = 0 if self.indexed else self.max_side  # as the writer gave it; None: unknown
        if rec.count:
            problems.extend(self._verify_shard_labels(s, labels))
            if self.indexed:
                try:
                    size = self._load_index(s).data_size  # its checksum, every row, and the data size it implies
                except CacheError as exc:
                    problems.append(str(exc))
                    size = None
            # its checksum, of a file of another size, would say no more than its size
            problems.extend([str(wrong_size)] if wrong_size is not None else
                            self._verify_data(s, read_fix="",
                                              crc_fix="`datapipe build SOURCE OUTPUT --verify` rewrites it"))
        if size is not None:
            problems.extend(f"{name}: {problem}; `datapipe build SOURCE OUTPUT --verify` rewrites it"
                            for problem in document_problems(shard_dir, rec.count, size, indexed=self.indexed))
        if problems:  # the rewrite advised refuses a folder holding what no build wrote (kept with a whole shard)
            problems[:0] = [f"{name}: {entry} is no file a build writes (zarr-python, or someone, added it); move it "
                            "out of the shard's folder (datapipe never deletes what it did not write), then `datapipe "
                            "build SOURCE OUTPUT --verify` rewrites the shard" for entry in foreign_entries(shard_dir)]
        return problems

    def _verify_shard_labels(self, s: int, labels: np.ndarray | None) -> list[str]:
        rec = self.manifest.shards[s]
        path = shard_labels_path(self.root / SHARDS_DIR / rec.name)
        fix = "`datapipe build SOURCE OUTPUT --verify` rewrites it"
        try:
            data = _read_regular(path, 8 * rec.count + 1)
        except OSError as exc:
            why = PERMISSION_ADVICE if refused(exc) else fix
            return [f"shard {rec.name}: labels chunk {path} cannot be read ({exc.strerror or exc}); {why}"]
        if len(data) != 8 * rec.count:
            return [f"shard {rec.name}: labels chunk {path} holds {len(data)} bytes, expected {8 * rec.count}; {fix}"]
        if labels is not None and not np.array_equal(np.frombuffer(data, "<i8"), labels[rec.first : rec.first + rec.count]):
            return [f"shard {rec.name}: labels chunk {path} differs from {mf.LABELS}; {fix}"]
        return []


def _check_not_being_built(root: Path) -> None:
    """A folder without a manifest whose build lock is held: say that a build is writing it now, rather
    than that one did not finish (whose advice, to run it again, would only meet that build's lock)."""
    if os.path.lexists(root / mf.MANIFEST) or not root.is_dir():
        return
    holder = lock_holder(root)
    if holder is not None:
        raise CacheError(f"{root} is not a finished datapipe cache (no {mf.MANIFEST}): a datapipe build is writing "
                         f"it now ({holder}); open it once that build has finished") from None


def _changed(path: Path, what: str, how: str = "differs from the file seen at open") -> str:
    return (f"{what} ({path}) {how}: the cache changed since it was opened (rebuilt or altered); reopen it "
            "(a new datapipe.open / dataset), or rerun the same `datapipe build` if it is damaged")


def _pread_full(fd: int, buf: memoryview, offset: int) -> int:
    """Fill ``buf`` from ``offset``; returns the bytes read (fewer only at the end of the file)."""
    got, want = 0, len(buf)
    while got < want:
        k = os.preadv(fd, [buf[got:]], offset + got)
        if k == 0:
            break
        got += k
    return got


def _read_regular(path: Path, limit: int) -> bytes:
    """Up to ``limit`` bytes of a regular file (a FIFO or device in its place is an OSError, never waited on)."""
    fd = open_for_reading(path)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(0, "not a regular file", str(path))
        buf = bytearray(limit)
        return bytes(buf[: _pread_full(fd, memoryview(buf), 0)])
    finally:
        os.close(fd)


def _crc32c_hex(data: bytes | bytearray | np.ndarray) -> str:
    import google_crc32c

    return f"{google_crc32c.value(bytes(data)):08x}"


def _parse_labels(data: bytes, n: int, path: Path) -> np.ndarray:
    """The int64 [n] array of a .npy file's bytes; CorruptShardError for anything else."""
    f = io.BytesIO(data)
    try:
        version = np.lib.format.read_magic(f)
        read_header = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
        shape, fortran, dtype = read_header(f)
    except Exception as exc:  # noqa: BLE001 - numpy raises several kinds for a damaged header
        raise CorruptShardError(f"{path} is not a .npy array ({type(exc).__name__}); rerun the same `datapipe build` "
                                "to rewrite it") from None
    if dtype != np.dtype("<i8") or fortran or shape != (n,) or len(data) - f.tell() != 8 * n:
        raise CorruptShardError(f"{path} holds {shape} {dtype} in {len(data) - f.tell()} bytes, the manifest says "
                                f"{n} int64 labels; rerun the same `datapipe build` to rewrite it")
    return np.frombuffer(data, "<i8", count=n, offset=f.tell())
