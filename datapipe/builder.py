"""`datapipe build`: decode every image once on a Dask cluster and write a verified, sharded cache.

One Dask task per shard and one writer per shard; tasks take paths and return small records, so
no image bytes ever travel through the task graph. A shard is written under a temporary name and
renamed when whole; a rerun recognises finished shards (by their inputs hash and the build's
configuration hash) and skips them, so a killed build resumes and an unchanged rerun is a no-op
that writes nothing. A shard that quarantined a file for a reason that says nothing of its bytes (a
failed read, a timeout, a crashed decoder) is built again by a rerun (see :func:`read_again`). The
manifest is written last.
"""

from __future__ import annotations

import contextlib
import contextvars
import errno
import fcntl
import gc
import hashlib
import importlib
import io
import json
import logging
import numbers
import os
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from . import __version__, remote, samples
from . import manifest as mf
from ._threads import torch_threads
from .bounded import READ_AGAIN_ADVICE, Watchdog, file_timeout, max_file_bytes, read_file, warm_up
from .codecs import DECODE_RULES, DecodeSpec, Fit, decode_fitted, plain_int
from .errors import (
    FULL_DISK,
    MAX_SECONDS,
    QUARANTINE_KINDS,
    TOO_LARGE_ADVICE,
    ArgumentError,
    BuildError,
    CacheError,
    CorruptShardError,
    DatapipeError,
    DecodeError,
    OutputBusyError,
    OutputError,
    OutputWriteError,
    RemoteStoreError,
    SourceError,
    TooManyBadFilesError,
    TooManyOpenFilesError,
    check_bool,
    check_path,
    describe_quarantine,
    env_seconds,
    one_line,
    quarantine_counts,
    soft_limits,
    thread_start_failed,
    unreadable,
)
from .files import (
    FileTooLarge,
    NotRegularFile,
    atomic_write_bytes,
    atomic_write_text,
    crc32c,
    disk_room,
    file_crc32c,
    fsync_dir,
    holds,
    read_regular,
)
from .output import (
    LOCK_FILE,
    Output,
    linked_shards,
    not_ours,
    prepare,
    remove_shards,
    shard_build_id,
    shards_of,
    still_held,
)
from .records import (
    INDEX_ROW_BYTES,
    SHARD_NAME,
    FileRecord,
    Manifest,
    ShardRecord,
    SourceRecord,
    layout_of,
    parse_manifest,
    read_json,
)
from .shards import (
    GROUP_META,
    SHARDS_DIR,
    document_problems,
    foreign_entries,
    images_path,
    index_path,
    read_shard_record,
    remove_shard,
    shard_labels_path,
    shard_layout,
    shard_name,
)
from .sources import (
    Listing,
    fs_encoding,
    locale_error,
    note_numeric_labels,
    plan_shards,
    repeats_a_row,
    scan,
    shown,
    valid_utf8,
    with_classes,
)
from .text import message_text, plural, printable, progress_bar, show
from .writer import ShardWriter

if TYPE_CHECKING:
    from types import FrameType

    from dask.distributed import Client, Future, LocalCluster
    from tqdm import tqdm

TARGET_SHARD_BYTES = 100 * 2**20
JPEG_SHRINK = 8  # a JPEG sample is taken to be ~1/8 of its raw bytes when sizing shards (measured: ~1/10 at q90)
log = logging.getLogger("datapipe.build")


def default_shard_size(size: int, encoding: samples.Encoding = "raw") -> int:
    """Samples per shard so that a shard holds about 100 MB (at least 1, at most 4096): a raw
    sample counts as size² · 3 bytes, a JPEG one as 1/8 of that."""
    per_sample = size * size * 3 // (JPEG_SHRINK if encoding == "jpeg" else 1)
    return int(min(4096, max(1, TARGET_SHARD_BYTES // max(per_sample, 1))))


def fields_default(cls: type, name: str) -> Any:
    """The default of dataclass ``cls``'s field ``name``."""
    return next(f.default for f in fields(cls) if f.name == name)


@dataclass(frozen=True)
class BuildSpec(DecodeSpec):
    """What a cache holds: every field enters the build configuration and its hash, so a cache built
    from another spec is another cache (a rebuild into it needs ``force``).

    The decoding fields (``size``, ``fit``, ``max_pixels``, ``max_aspect``) are
    :class:`~datapipe.codecs.DecodeSpec`'s; a BuildSpec adds how the samples are stored: the shard
    size, the ``encoding`` (``raw`` pixels or ``jpeg``) and the JPEG ``quality``. An invalid value
    raises ArgumentError naming the option of ``datapipe build``.
    """

    shard_size: int | None = None  # samples per shard; None: about 100 MB per shard (default_shard_size)
    encoding: samples.Encoding = "raw"
    quality: int = samples.DEFAULT_QUALITY  # JPEG quality 1..100 (encoding="jpeg" only; 4:2:0 chroma)
    # The class names labels index, in order: another cache's (train's, for a validation cache), so that the two
    # agree on every label; the source's classes must be among them. None: the source's own, sorted.
    classes: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("shard_size", "quality"):  # a numpy integer is the number it holds
            object.__setattr__(self, name, plain_int(getattr(self, name)))
        if self.classes is not None:
            names = self.classes
            if isinstance(names, str) or not isinstance(names, (list, tuple)) or not names \
                    or not all(isinstance(c, str) and c for c in names):
                raise ArgumentError(f"classes must be a non-empty list of class names, got {show(names)}")
            for c in names:  # the manifest holds them as UTF-8 text
                if not valid_utf8(c) or "\x00" in c:
                    raise ArgumentError(f"classes: the class name {c!r} holds "
                                        f"{'a NUL character' if valid_utf8(c) else 'what is not valid UTF-8 text'} "
                                        "(a folder name the file system gave undecoded?); give names of plain text")
            if len(set(names)) != len(names):
                twice = next(c for c in names if names.count(c) > 1)
                raise ArgumentError(f"classes names {twice!r} more than once; each class name must be given once")
            object.__setattr__(self, "classes", tuple(names))
        if self.shard_size is not None and (isinstance(self.shard_size, bool) or not isinstance(self.shard_size, int)
                                            or self.shard_size < 1):
            raise ArgumentError(f"--shard-size must be a positive integer, got {self.shard_size!r}")
        if self.encoding not in samples.ENCODINGS:
            raise ArgumentError(f"--encoding must be one of {', '.join(samples.ENCODINGS)}, got {self.encoding!r}")
        if isinstance(self.quality, bool) or not isinstance(self.quality, int) or not 1 <= self.quality <= 100:
            raise ArgumentError(f"--quality must be an integer from 1 to 100, got {self.quality!r}")
        # An option of another mode is refused rather than dropped (it would not enter the configuration either).
        if self.encoding == "raw" and self.quality != samples.DEFAULT_QUALITY:
            raise ArgumentError(f"--quality {self.quality} applies to --encoding jpeg only; the samples are stored raw "
                                "(add --encoding jpeg, or leave --quality out)")
        if self.fit != "short" and self.max_aspect != fields_default(DecodeSpec, "max_aspect"):
            raise ArgumentError(f"--max-aspect {self.max_aspect:g} applies to --fit short only; with --fit {self.fit} every "
                                "sample is square (add --fit short, or leave --max-aspect out)")

    @property
    def samples_per_shard(self) -> int:
        return self.shard_size or default_shard_size(self.size, self.encoding)

    @property
    def layout(self) -> str:
        """The shards' layout: ``fixed`` for square raw samples, else ``indexed`` (format version 2)."""
        return "indexed" if self.fit == "short" or self.encoding != "raw" else "fixed"

    @property
    def decode(self) -> DecodeSpec:
        """The part a worker needs to turn a file into a sample."""
        return DecodeSpec(**{f.name: getattr(self, f.name) for f in fields(DecodeSpec)})

    def config(self, source_kind: str) -> dict[str, Any]:
        """The build configuration written to the manifest and hashed: every field that decides the
        bytes (the shard size resolved, so that the default and its value are one configuration) and
        the kind of source. ``max_aspect`` enters only with fit short, ``encoding``, ``quality``
        and the JPEG restart interval only with jpeg: a configuration of the earlier options is the very dict (and hash) it was."""
        config: dict[str, Any] = {"size": self.size, "fit": self.fit, "max_pixels": self.max_pixels}
        if self.fit == "short":
            config["max_aspect"] = float(self.max_aspect)
        config["shard_size"] = self.samples_per_shard
        if self.encoding != "raw":
            config.update(encoding=self.encoding, quality=self.quality, restart_interval=samples.RESTART_INTERVAL)
        if self.classes is not None:
            config["classes"] = list(self.classes)
        config["source_kind"] = source_kind
        assert layout_of(config) == self.layout
        return config


@dataclass(frozen=True)
class Cluster:
    """Where a build runs. Not part of the configuration: every cluster writes the same bytes."""

    workers: int | None = None  # worker processes of the LocalCluster started for the build; None: one per core
    scheduler: str | None = None  # an existing Dask scheduler's address, or "sync": serially in this process

    def __post_init__(self) -> None:
        object.__setattr__(self, "workers", plain_int(self.workers))
        if self.workers is not None and (isinstance(self.workers, bool) or not isinstance(self.workers, int)
                                         or self.workers < 1):
            raise ArgumentError(f"--workers must be a positive integer, got {self.workers!r}")
        if self.scheduler is not None and (not isinstance(self.scheduler, str) or not self.scheduler):
            raise ArgumentError(f"--scheduler must be a Dask scheduler's address (tcp://host:8786) or 'sync', "
                                f"got {self.scheduler!r}")
        if self.workers is not None and self.scheduler is not None:  # it would be ignored in silence
            where = "builds serially in this process" if self.scheduler == "sync" else "builds on that cluster's workers"
            raise ArgumentError(f"--workers {self.workers} sets the LocalCluster a build starts, but --scheduler "
                                f"{self.scheduler} {where}: leave one of them out")

    @property
    def serial(self) -> bool:
        return self.scheduler == "sync"


@dataclass
class BuildReport:
    """What a build did: returned by :func:`build` and written to ``report.json``."""

    output: str
    status: str
    num_samples: int = 0
    scanned: int = 0
    quarantined: list[dict] = field(default_factory=list)
    ignored: int = 0
    shards_total: int = 0
    shards_built: int = 0
    shards_skipped: int = 0
    workers: int = 0
    dashboard: str | None = None
    seconds: dict[str, float] = field(default_factory=dict)
    images_per_second: float = 0.0
    page_faults_per_image: float = 0.0  # minor page faults in the build workers per image decoded
    bytes_on_disk: int = 0
    bytes_per_sample: float = 0.0
    peak_worker_rss_mb: float = 0.0
    config: dict = field(default_factory=dict)
    build_id: str = ""
    aspect_capped: int = 0  # fit short: samples whose longer side was cut to max_aspect * size
    outside_classes: list[str] = field(default_factory=list)  # image files at the top of a folder source: not used
    empty_classes: list[str] = field(default_factory=list)  # classes of the source without a single sample
    index_written: bool = False  # labels.npy, paths.json or the manifest written (new, or changed: classes, labels)

    def quarantine_counts(self) -> dict[str, int]:
        """Quarantined files by class (``error``: see datapipe.errors.QUARANTINE_KINDS), most first."""
        return quarantine_counts(self.quarantined)

    def _unused(self) -> str:
        """What the summary says of images and classes that are not in the cache although not quarantined."""
        text = ""
        if self.outside_classes:
            text += (f", {plural(len(self.outside_classes), 'image file')} at the source's top level not used "
                     "(no class folder; listed in report.json)")
        if self.empty_classes:
            names = ", ".join(map(printable, self.empty_classes[:3])) + (" ..." if len(self.empty_classes) > 3 else "")
            text += f", {plural(len(self.empty_classes), 'class', 'classes')} without any sample ({names})"
        return text

    def summary(self) -> str:
        rate = (f"{self.images_per_second:,.0f} img/s" if self.shards_built else
                "no shard to build, index updated" if self.index_written else "nothing to do")
        capped = f", {plural(self.aspect_capped, 'image')} cut to --max-aspect" if self.aspect_capped > 0 else ""
        return (f"{self.status}: {plural(self.num_samples, 'sample')} in {plural(self.shards_total, 'shard')} "
                f"({self.shards_built} built, {self.shards_skipped} already done), "
                f"{describe_quarantine(self.quarantined)}{capped}{self._unused()}, {rate}, "
                f"{self.bytes_per_sample / 1024:,.0f} KiB/sample -> {message_text(str(self.output))}")


# ----------------------------------------------------------------------------- the task


# Quarantine classes that are no verdict on a file's bytes: a read that failed (no permission, an I/O
# error, a store that refused it), a decode that ran out of time or whose process died (memory pressure).
# Each can clear while the file keeps its size and mtime (chmod changes neither), which is all the inputs
# hash sees; so a rerun reads such files again (see read_again).
READ_AGAIN = frozenset({"unreadable", "timeout", "decoder-crash"})
# ... but for a path that did not exist when the scan looked: it records size and mtime -1 for a path it cannot
# stat (a dangling symlink, a CSV row naming no file), so one that appears changes the inputs hash and is read
# again anyway. A file the scan saw that was gone when its shard read it (moved away during the build) may come
# back as it was, the same size and mtime (as may one that was written to when read, bounded.CHANGED): its reason
# says so (_GONE), and it is read again as any of READ_AGAIN is.
_MISSING = tuple(f"unreadable: {name}:" for name in ("FileNotFoundError", "NotADirectoryError"))
_GONE = "unreadable: gone since the scan"


def _gone_since_scan(quarantined: list[dict], plan: dict) -> list[dict]:
    """``quarantined`` with the reason of each file that was missing when read, though the scan saw it, saying
    so (:data:`_GONE`): such a file is read again by a rerun (:func:`read_again`), as the scan's record of it
    does not change when it comes back unchanged."""
    absent = set(plan.get("absent") or ())
    return [{**q, "reason": f"{_GONE} (moved or deleted while the build ran; {READ_AGAIN_ADVICE}): "
                            f"{q['reason'][len('unreadable: '):]}"}
            if q.get("error") == "unreadable" and str(q.get("reason", "")).startswith(_MISSING)
            and q.get("path") not in absent else q
            for q in quarantined]


def read_again(entry: dict) -> bool:
    """Whether a quarantined file (an entry of a shard's record) is read again by a rerun: its class says
    nothing of its bytes (READ_AGAIN). A verdict on bytes that were read whole (corrupt, not an image, ...)
    stands until the file changes."""
    kind = entry.get("error")
    if kind not in READ_AGAIN:
        return False
    return not (kind == "unreadable" and str(entry.get("reason", "")).startswith(_MISSING))


def _reads_again(record: dict) -> bool:
    quarantined = record.get("quarantined")
    return isinstance(quarantined, list) and any(isinstance(q, dict) and read_again(q) for q in quarantined)


def _same_build(record: dict, plan: dict, config_hash: str, build_id: str) -> bool:
    """Whether a shard's record is of this plan's shard and inputs, this configuration and this build. A record
    that names another shard (its zarr.json edited, or taken from another shard of the same inputs) is none:
    taken, it would be filed as that other shard's."""
    shard = record.get("shard")
    return (type(shard) is int and shard == plan["shard"] and record.get("inputs_hash") == plan["inputs_hash"]
            and record.get("config_hash") == config_hash and record.get("build_id") == build_id
            and _accounts_for(record, plan))


# subprocess waits on a child with poll(), in milliseconds that must fit in a C int (24.8 days): a longer timeout (the
# variables take up to errors.MAX_SECONDS) is that, which no decode reaches
_LONGEST_CHILD_WAIT = (2**31 - 1) / 1000


def _accounts_for(record: dict, plan: dict) -> bool:
    """Whether a shard's record accounts for each of its plan's files once, as a sample or as quarantined (of a
    known kind): a quarantine list edited (a file the plan lacks) would be copied into the report, counted, and
    judged against the budget of bad files."""
    quarantined, paths = record.get("quarantined"), set(plan["paths"])
    if not isinstance(quarantined, list) or not all(isinstance(q, dict) and q.get("path") in paths
                                                    and q.get("error") in QUARANTINE_KINDS for q in quarantined):
        return False
    count = record.get("count")
    return len({q["path"] for q in quarantined}) == len(quarantined) and type(count) is int and \
        count == len(plan["paths"]) - len(quarantined)


def finished_shard(plan: dict, *, output: str, config_hash: str, build_id: str, retry: bool = True) -> dict | None:
    """The record of this plan's shard when it is already on disk, whole, from the same inputs,
    configuration and build (its zarr.json and one stat: no data is read), and, with ``retry``,
    quarantined no file that a rerun reads again (:func:`read_again`): such a shard is built again."""
    existing = read_shard_record(Path(output) / SHARDS_DIR / shard_name(plan["shard"]))
    if existing is not None and _same_build(existing, plan, config_hash, build_id) \
            and not (retry and _reads_again(existing)):
        return existing
    return None


# How a file that never finishes ends the process: a worker dies (the shard is then rebuilt with every
# file isolated, see _run); a serial build ends with one line naming the file.
WORKER_TIMEOUT = ("datapipe build worker: reading and decoding {path} did not finish within {timeout:g} s "
                  "(DATAPIPE_FILE_TIMEOUT); ending this worker so that its shard is rebuilt with every file isolated")
SERIAL_TIMEOUT = ("datapipe build: error: reading and decoding {path} did not finish within {timeout:g} s "
                  "(DATAPIPE_FILE_TIMEOUT); remove or fix the file (or raise the limit) and rerun to resume: "
                  "finished shards are kept")


def build_shard(plan: dict, *, root: str, output: str, spec: dict, config_hash: str, build_id: str = "",
                verify: bool = False, isolate: bool = False, serial: bool = False, encoding: samples.Encoding = "raw",
                quality: int = samples.DEFAULT_QUALITY, source_options: dict | None = None,
                output_options: dict | None = None, store_timeout: float | None = None, lock_token: str | None = None,
                client_version: str | None = None) -> dict:
    """Build one shard (runs on a Dask worker). Returns its record; never raises for one bad file.

    ``spec`` is the :class:`DecodeSpec`'s fields; ``encoding`` and ``quality`` say how samples are
    stored. A finished shard of the same inputs, configuration and build is kept (unless it quarantined a
    file to read again, see :func:`read_again`; with ``verify``,
    only if its data file's checksum, and an indexed shard's index's, still match). With ``isolate`` (after this shard's task killed a
    worker) every file is first decoded in a separate process; one that crashes it or never
    finishes is quarantined. A file that takes longer than DATAPIPE_FILE_TIMEOUT ends the process
    (see :mod:`datapipe.bounded`); ``serial`` says the process is the build's own.

    ``source_options`` (not None: ``root`` is a URL) and ``output_options`` (``output`` is a URL) are the
    storage options of a source or output in object storage: the files are then read as objects, and the
    shard is written into a local temporary folder and uploaded while it is written (its data object
    streamed by a thread of this task, see :class:`datapipe.remote.ShardUpload`), its zarr.json last;
    ``store_timeout``: the deadline of each request to the store, per 8 MiB a write sends (the client's
    DATAPIPE_STORE_TIMEOUT). ``client_version``: the build's datapipe version, which this worker's must be (a
    worker that joined after the build checked the others').
    """
    if client_version is not None and client_version != _identity():
        raise BuildError(_other_version(_worker_address(), _identity(), client_version))
    names = ([] if output_options is not None else [os.fspath(output)]) + \
        ([] if source_options is not None else [os.fspath(root), *plan["paths"]])
    if (problem := _names_problem(names)) is not None:
        raise BuildError(f"{_this_process()} {problem}")
    if output_options is None:
        return _build_shard(plan, root=root, output=output, spec=spec, config_hash=config_hash, build_id=build_id,
                            verify=verify, isolate=isolate, serial=serial, encoding=encoding, quality=quality,
                            source_options=source_options, store_timeout=store_timeout, lock_token=lock_token)
    loc = remote.open_location(output, output_options, timeout=store_timeout or remote.STORE_TIMEOUT)
    name = shard_name(plan["shard"])
    staging, held = _staging_folder()
    def claim() -> None:
        _check_remote_lock(loc, name, lock_token)
        _claim_remote_shard(loc, name, build_id, plan["shard"])

    upload = remote.ShardUpload(loc, f"{SHARDS_DIR}/{name}", before=claim)
    try:
        record = _build_shard(plan, root=root, output=str(staging), spec=spec, config_hash=config_hash,
                              build_id=build_id, isolate=isolate, serial=serial, encoding=encoding, quality=quality,
                              source_options=source_options, store_timeout=store_timeout, opened=upload.follow,
                              durable=False)
        _check_remote_lock(loc, name, lock_token)  # the zarr.json that makes it whole comes last
        with _outside_the_pool(serial):
            upload.finish(staging / SHARDS_DIR / name)
        _check_remote_lock(loc, name, lock_token, written=True)  # a pause between the check and the writes
    except BaseException:
        upload.abort()
        raise
    finally:
        _remove_staging(staging)
        os.close(held)
    return record


SHARD_TASK = "datapipe-shard-"  # the key of a shard's Dask task begins so
STAGING_PREFIX = "datapipe-shard-"  # a shard staged on its way to an object store: <tempdir>/datapipe-shard-*
STAGING_LOCK = ".held"  # its flock, held while the task that stages it lives
STAGING_GRACE_SECONDS = 60.0  # a staging folder younger than this is never reclaimed (its lock may not be taken yet)


def _staging_folder() -> tuple[Path, int]:
    """A new folder in the temporary directory for a shard on its way to an object store, and the descriptor of
    the flock that marks it in use until it is closed (the kernel releases it when the process dies).

    First the staging folders of tasks that died (a SIGKILLed or OOM-killed worker cannot remove its own: up to
    a shard's size each, on a worker's disk) are removed: those whose lock is free and that are older than
    STAGING_GRACE_SECONDS; a folder in use, or one being created, is left alone."""
    base = Path(tempfile.gettempdir())
    _reclaim_staging(base)
    folder = Path(tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=base))
    fd = os.open(folder / STAGING_LOCK, os.O_CREAT | os.O_RDWR | os.O_CLOEXEC, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    return folder, fd


def _reclaim_staging(base: Path) -> int:
    """Remove the staging folders under ``base`` that no living task holds (see _staging_folder); returns how many."""
    removed = 0
    now = time.time()
    try:
        entries = [e for e in os.scandir(base) if e.name.startswith(STAGING_PREFIX)]
    except OSError:
        return 0
    for entry in entries:
        try:
            if not entry.is_dir(follow_symlinks=False) or now - entry.stat(follow_symlinks=False).st_mtime < STAGING_GRACE_SECONDS:
                continue
            fd = os.open(os.path.join(entry.path, STAGING_LOCK), os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError:  # gone, not ours to read, or without its lock: empty (see _remove_staging) unless not ours
            with contextlib.suppress(OSError):
                os.rmdir(entry.path)  # only if empty: a task killed as it made it, or as it removed it
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # held: a living task's
            os.close(fd)
            continue
        try:
            removed += _remove_staging(Path(entry.path))
        finally:
            os.close(fd)
    if removed:
        log.info("datapipe build: removed %s left in %s by killed tasks", plural(removed, "staged shard folder"), base)
    return removed


def _remove_staging(folder: Path) -> bool:
    """Remove a staging folder, its lock last: a task killed while removing it (or a removal that fails) leaves
    the lock with what remains, so that the next task removes the rest; a folder without its lock is empty.
    Returns whether the folder is gone."""

    def rest() -> list[os.DirEntry]:
        try:
            with os.scandir(folder) as entries:
                return [e for e in entries if e.name != STAGING_LOCK]
        except OSError:
            return []

    for entry in rest():
        if entry.is_dir(follow_symlinks=False):
            shutil.rmtree(entry.path, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                os.unlink(entry.path)
    if rest():
        return False  # something could not be removed: the lock stays, for the next task to try again
    for remove, path in ((os.unlink, folder / STAGING_LOCK), (os.rmdir, folder)):
        with contextlib.suppress(OSError):
            remove(path)
    return not os.path.lexists(folder)


# One shard per worker process may wait for the store outside the worker's thread pool (see _outside_the_pool):
# at most one more shard's temporary files and upload buffers than the worker has threads.
_WAITING_FOR_THE_STORE = threading.BoundedSemaphore(1)


@contextlib.contextmanager
def _outside_the_pool(serial: bool) -> Iterator[None]:
    """Wait for a shard's last part, the completion of its upload and its zarr.json outside the Dask worker's
    thread pool, so that the worker decodes its next shard meanwhile instead of waiting for the store (a
    multipart upload of tens of MB takes the store a good part of a second to complete). The task still
    returns only once the shard is whole in the store. Nothing changes for a serial build, or when another
    shard of this process is already waiting."""
    if serial or not _WAITING_FOR_THE_STORE.acquire(blocking=False):
        yield
        return
    try:
        from distributed import secede

        with contextlib.suppress(ValueError):  # not a task of a Dask worker's thread pool
            secede()
        yield
    finally:
        _WAITING_FOR_THE_STORE.release()


def _check_remote_lock(loc: remote.Location, name: str, token: str | None, *, written: bool = False) -> None:
    """A task of a build into object storage writes only while that build holds the prefix's lock (read from the
    store): a build paused past the lock's TTL (SIGSTOP, a frozen VM) whose lock another build took over meanwhile
    would otherwise overwrite that build's shards when it runs on.

    Raises:
        BuildError: the lock object is not the build's (``token``), or gone.
    """
    if not token:
        return
    held = remote.read_lock(loc)
    if not (isinstance(held, dict) and held.get("token") == token):
        holder = f" (pid {held.get('pid')} on host {held.get('host')} holds it)" if isinstance(held, dict) else ""
        if written:  # paused between its check and its writes: it may have written over the other build's shard
            raise BuildError(f"shard {name} was written by a build that no longer holds the lock of {loc.url}{holder} "
                             "(it was paused past the lock's TTL, and another build took it over): if that build "
                             f"finished, its shard {name} may be this one's now; `datapipe verify {loc.url}` names it "
                             f"and `datapipe build SOURCE {loc.url} --verify` rewrites it")
        raise BuildError(f"shard {name} was not written: the build that asked for it no longer holds the lock of "
                         f"{loc.url}{holder}: another build took it over, or the build ended; rerun the build to resume")


def _claim_remote_shard(loc: remote.Location, name: str, build_id: str, shard: int) -> None:
    """Before a shard is uploaded: mark its folder as this build's (:func:`datapipe.remote.uploading_document`, in
    place of an earlier attempt's zarr.json, so the shard never looks whole while its objects are replaced);
    refuse a folder that holds objects of another build, or objects of a shard's names and no zarr.json (no
    datapipe build's)."""
    key = f"{SHARDS_DIR}/{name}/{GROUP_META}"
    try:
        doc = remote.read_doc(loc, key)
    except CacheError:
        doc = {}
    if doc is None:
        prefix = f"{SHARDS_DIR}/{name}/"
        present = sorted(k for k in remote.listing(loc, prefix) if k[len(prefix):] in remote.SHARD_OBJECTS)
        if present:  # objects an upload would overwrite (others beside them stay, untouched)
            more = f" (and {len(present) - 1} more)" if len(present) > 1 else ""
            raise BuildError(f"{loc.url_of(present[0])}{more} is in shard folder {loc.url_of(SHARDS_DIR, name)}, which "
                             "this build writes, and no datapipe build wrote it; datapipe does not overwrite what it did "
                             "not write: move it away and rerun (finished shards are kept)")
    elif remote.shard_owner(doc) != build_id:
        raise BuildError(f"{loc.url_of(key)} is in the way and was not written by this build; datapipe does not "
                         "delete what it did not write: move it away and rerun")
    remote.write_bytes(loc, key, remote.uploading_document(build_id, shard))


def _build_shard(plan: dict, *, root: str, output: str, spec: dict, config_hash: str, build_id: str, verify: bool = False,
                 isolate: bool, serial: bool, encoding: samples.Encoding, quality: int, source_options: dict | None,
                 store_timeout: float | None = None, lock_token: str | None = None,
                 opened: Callable[[Path, str], None] | None = None, durable: bool = True) -> dict:
    """build_shard into a local output folder; ``opened`` is told the data file's path (and its name inside
    the shard) as soon as the writer opens it (an upload follows it while it is written). ``durable=False``:
    the shard is staged for an object store, whose copy is the durable one, so nothing is flushed to disk."""
    import resource

    final = Path(output) / SHARDS_DIR / shard_name(plan["shard"])
    if lock_token:
        _check_still_building(Path(output), final, lock_token)
    existing = finished_shard(plan, output=output, config_hash=config_hash, build_id=build_id)
    if existing and (not verify or _checksums_match(final, existing, plan, DecodeSpec(**spec).max_side, encoding)):
        return {**existing, "skipped": True, "seconds": 0.0}
    if os.path.lexists(final):  # a shard of this build from other inputs, or a damaged one: replace it
        foreign = [] if final.is_symlink() or not final.is_dir() else foreign_entries(final)
        if foreign:
            raise not_ours(foreign, final, "writes", "finished shards are kept")
        if not final.is_symlink() and final.is_dir() and not any(f for _, _, f in os.walk(final)):
            remove_shard(final)  # empty folders only (a shard removed but for a file since moved out of it)
        elif shard_build_id(final) != build_id or final.is_symlink():
            raise BuildError(f"{final} is in the way and was not written by this build; datapipe does not delete "
                             "what it did not write: move it away and rerun")
        else:
            stale = final.with_name(f".tmp-stale-{final.name}-{os.getpid()}")
            os.rename(final, stale)
            shutil.rmtree(stale, ignore_errors=True)
    _warm_up()  # before the watchdog: waits for imports another thread of this worker may be running
    decode_spec = DecodeSpec(**spec)
    layout = "indexed" if decode_spec.fit == "short" or encoding != "raw" else "fixed"
    limit = max_file_bytes(decode_spec.max_pixels)
    quarantined: list[dict] = []
    capped = 0
    start = time.perf_counter()
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    side = decode_spec.max_side
    # reused for every image: the square sample, or (short) a flat buffer for the largest sample, of which
    # each image takes a view of its own shape
    sample = np.empty(decode_spec.size * side * 3, np.uint8) if side != decode_spec.size else np.empty(
        (side, side, 3), np.uint8)
    message = SERIAL_TIMEOUT if serial else WORKER_TIMEOUT
    watchdog = Watchdog(lambda path, timeout: message.format(path=shown(path), timeout=timeout), 2 if serial else 70)
    # One intra-op thread where torch resizes (the fallback of the compiled kernel): the workers already run
    # one task per core, and torch would otherwise start threads per image.
    with ShardWriter(final, size=side, layout=layout, encoding=encoding, quality=quality, durable=durable) as writer, \
            _no_cyclic_gc(), torch_threads(1) if _resize_by_torch() else contextlib.nullcontext(), watchdog:
        if opened is not None:
            data = images_path(writer.tmp_dir, layout)
            opened(data, data.relative_to(writer.tmp_dir).as_posix())
        for path, label, scanned in zip(plan["paths"], plan["labels"], plan["stats"], strict=True):
            file = os.path.join(root, path) if source_options is None else f"{root}/{path}"
            failure = _probe(file, spec, source_options, store_timeout) if isolate else None
            if failure is not None:
                quarantined.append({"path": path, **failure})
                continue
            watchdog.watch(path)
            loaded = _load(file, decode_spec, path, quarantined, sample, limit, source_options, store_timeout,
                           scanned=tuple(scanned) if scanned[0] >= 0 else None)
            watchdog.watch(None)
            if loaded is not None:
                writer.add(loaded[0], label, path)
                capped += loaded[1]
        attributes: dict[str, Any] = {
            "shard": plan["shard"], "inputs_hash": plan["inputs_hash"], "config_hash": config_hash,
            "build_id": build_id, "quarantined": _gone_since_scan(quarantined, plan), "decode_rules": DECODE_RULES,
        }
        if decode_spec.fit == "short":
            attributes["aspect_capped"] = capped
        if lock_token:  # the build that sent this task may have ended meanwhile (Ctrl-C, SIGTERM, a lost scheduler)
            _check_still_building(Path(output), final, lock_token)
        record = writer.commit(attributes)
    record["paths"] = writer.paths
    record["skipped"] = False
    record["seconds"] = time.perf_counter() - start
    usage = resource.getrusage(resource.RUSAGE_SELF)
    record["peak_rss_mb"] = usage.ru_maxrss / 1024
    record["page_faults"] = usage.ru_minflt - faults
    return record


@contextlib.contextmanager
def _no_cyclic_gc():
    """Pause Python's cyclic garbage collector while a shard's images are decoded.

    The loop makes no reference cycles (reference counting frees everything), but its small
    allocations keep triggering collections, and each full one walks the ~180,000 objects that
    torch, zarr and dask leave behind (a measurable share of a build's time).
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _probe(file: str, spec: dict, source_options: dict | None = None, store_timeout: float | None = None) -> dict | None:
    """Decode ``file`` in a child process; None if that works, else its quarantine entry's
    ``error`` and ``reason``. (An object of a remote source is read here and decoded there; a store that
    fails, rather than the object, raises RemoteStoreError.)"""
    import signal
    import subprocess

    if source_options is not None:
        try:
            data = remote.read_object(file, max_file_bytes(int(spec["max_pixels"])), source_options, store_timeout)
        except DecodeError as exc:
            return {"error": exc.kind, "reason": str(exc)}
        except RemoteStoreError:
            raise
        except OSError as exc:
            return unreadable(exc)
        with tempfile.NamedTemporaryFile(prefix="datapipe-probe-", suffix=os.path.splitext(file)[1]) as tmp:
            tmp.write(data)
            tmp.flush()
            return _probe(tmp.name, spec)

    timeout = env_seconds("DATAPIPE_PROBE_TIMEOUT", PROBE_TIMEOUT)
    try:
        proc = subprocess.run([sys.executable, "-m", "datapipe.probe", str(file), json.dumps(spec)],
                              capture_output=True, text=True, stdin=subprocess.DEVNULL,
                              timeout=min(timeout, _LONGEST_CHILD_WAIT))
    except subprocess.TimeoutExpired:
        return {"error": "timeout",
                "reason": f"decoding did not finish within {timeout:g} s (isolated after its shard killed a worker)"}
    if proc.returncode == 0:
        return None
    if proc.returncode == 3:  # the entry is the last line (a library may have printed before it)
        return json.loads(proc.stdout.strip().splitlines()[-1])
    if proc.returncode < 0:
        return {"error": "decoder-crash", "reason": f"the decoder crashed its process ({signal.Signals(-proc.returncode).name})"}
    return {"error": "decoder-crash",
            "reason": f"the decoder process failed (exit {proc.returncode}): {proc.stderr.strip()[-300:]}"}


def _check_still_building(out: Path, final: Path, token: str) -> None:
    """A task of a build into a local folder writes only while that build holds the folder's lock: a task a
    Dask cluster still runs after its build ended (the client stopped by Ctrl-C or SIGTERM, or it lost the
    scheduler) writes nothing more there, and leaves nothing (its temporary folder is removed).

    Raises:
        BuildError: the build whose lock has ``token`` holds the lock of ``out`` no more (none does, or another).
    """
    if not still_held(out, token):
        if os.path.lexists(out / LOCK_FILE):
            why = f"the build that asked for it has ended (no build holds the lock of {out})"
        else:
            why = (f"{out} holds no build lock as this worker sees it: the build that asked for it has ended, or this "
                   "worker sees another folder at that path (every worker must see the output folder at the same "
                   "path, a shared file system)")
        raise BuildError(f"{final} was not written: {why}; rerun the build to resume")


def _kept(plan: dict, record: dict) -> list[tuple[str, int]]:
    """The (path, label) of the plan's files that its shard holds: all but those its record quarantined."""
    quarantined = {entry.get("path") for entry in record.get("quarantined") or [] if isinstance(entry, dict)}
    return [(path, label) for path, label in zip(plan["paths"], plan["labels"], strict=True) if path not in quarantined]


def _checksums_match(shard_dir: Path, record: dict, plan: dict, side: int, encoding: str) -> bool:
    """Whether a finished shard still holds what its build wrote, checked as ``datapipe verify`` checks it
    (reads the whole shard): its data file's checksum (and an indexed shard's sample index's, whose rows must
    also be possible ones, as a reader checks them), its paths and labels chunk against the plan's (less the files
    it quarantined), and its Zarr documents (``side``: the samples' side in a fixed-layout shard, the longest side
    any sample may have in an indexed one)."""
    count = record["count"]
    kept = _kept(plan, record)
    if len(kept) != count or record.get("paths") != [path for path, _ in kept]:
        return False
    layout = shard_layout(record)
    size = side if layout == "fixed" else 0
    if count:
        try:
            if file_crc32c(images_path(shard_dir, layout)) != record["crc32c"]:
                return False
            labels = read_regular(shard_labels_path(shard_dir), 8 * count + 1)
            if labels != np.asarray([label for _, label in kept], "<i8").tobytes():
                return False
            if layout == "indexed":
                raw = read_regular(index_path(shard_dir), count * INDEX_ROW_BYTES)
                if f"{crc32c(raw):08x}" != record["index_crc32c"]:
                    return False
                size = samples.SampleIndex.parse(raw, count=count, encoding=encoding, max_side=side,
                                                 where=str(index_path(shard_dir))).data_size
        except (OSError, NotRegularFile, FileTooLarge, CorruptShardError):
            return False
    return not document_problems(shard_dir, count, size, indexed=layout == "indexed")


def _load(file: str, spec: DecodeSpec, path: str, quarantined: list[dict], out: np.ndarray,
          limit: int, source_options: dict | None = None, store_timeout: float | None = None, *,
          scanned: tuple[int, int] | None = None) -> tuple[np.ndarray, bool] | None:
    """Read and decode one file (an object, with ``source_options``) into ``out``: the sample and whether
    its longer side was cut by ``max_aspect``; on failure record why in ``quarantined`` and return None.
    ``scanned``: a file's (size, mtime_ns) as the scan saw it, which the shard's inputs hash records: a file
    that no longer is so is the scan's no more (bounded.CHANGED). (An object's is not checked: the scan records
    no time of it, and a size may be the stored, compressed one.)
    A store that fails while an object is read (no connection, no answer, throttled past its retries) is no
    fault of the object: RemoteStoreError ends the shard's task, and the rerun resumes."""
    try:
        # a regular file only, one unbuffered read, at most ``limit`` bytes (an object: at most ``limit`` too)
        data = read_file(file, limit, scanned) if source_options is None else \
            remote.read_object(file, limit, source_options, store_timeout)
        return decode_fitted(data, spec, out)
    except DecodeError as exc:
        entry = {"error": exc.kind, "reason": str(exc)}
    except (RemoteStoreError, TooManyOpenFilesError):  # no fault of the file: the task ends, the rerun resumes
        raise
    except OSError as exc:
        entry = unreadable(exc)
    except MemoryError as exc:  # memory pressure, not the file: read again by a rerun, as a killed decoder is
        entry = {"error": "decoder-crash", "reason": f"out of memory while decoding ({one_line(exc)})"}
    except Exception as exc:  # noqa: BLE001 - one bad file must never end the build
        entry = {"error": "decoder-error", "reason": f"decoder failed: {type(exc).__name__}: {exc}"}
    quarantined.append({"path": path, **entry})
    return None


# ----------------------------------------------------------------------------- the driver


def build(
    source: str | os.PathLike,
    output: str | os.PathLike,
    spec: BuildSpec | None = None,
    *,
    cluster: Cluster | None = None,
    max_bad_fraction: float = 0.01,
    force: bool = False,
    verify: bool = False,
    progress: bool = True,
    size: int | None = None,
    fit: Fit | None = None,
    max_pixels: int | None = None,
    shard_size: int | None = None,
    max_aspect: float | None = None,
    encoding: samples.Encoding | None = None,
    quality: int | None = None,
    classes: Sequence[str] | None = None,
    storage_options: dict | None = None,
) -> BuildReport:
    """Decode every image in ``source`` once and write a sharded cache to ``output``.

    Progress lines go to the ``datapipe.build`` logger.

    Args:
        source: a folder of class folders (ImageNet layout) or a CSV of ``path,label`` rows.
        output: the cache folder; created if missing. A rerun resumes, or is a no-op that writes nothing
            (in a folder that cannot be written too: a cache there that is up to date is reported as such).
        spec: what the cache holds (:class:`BuildSpec`); default ``BuildSpec()``.
        cluster: where the build runs (:class:`Cluster`); default a LocalCluster with one worker per core.
        max_bad_fraction: quarantined files above this share of the source fail the build.
        force: rebuild into an output that holds a build of another configuration.
        verify: check the checksum of every finished shard before keeping it (reads the whole
            cache); a damaged shard is rebuilt.
        progress: show a progress bar on stderr.
        size: ``spec``'s field, given as a keyword instead of a spec (not both); so are the next three.
        fit: see :class:`BuildSpec`.
        max_pixels: see :class:`BuildSpec`.
        shard_size: see :class:`BuildSpec`.
        max_aspect: see :class:`BuildSpec` (fit ``short`` only).
        encoding: see :class:`BuildSpec`: ``raw`` or ``jpeg``.
        quality: see :class:`BuildSpec` (``jpeg`` only).
        classes: see :class:`BuildSpec`: the class list labels index, e.g. ``datapipe.open(train).classes`` for a
            validation cache, so that both give every class the same label.
        storage_options: for a ``source`` or ``output`` that is an fsspec URL (``s3://bucket/prefix``): the
            options of its filesystem (credentials, ``endpoint_url`` ...), on top of fsspec's configuration
            and the environment. A remote output is written object by object, the manifest last.

    Returns:
        A :class:`BuildReport`; also written to ``output/report.json``.

    Raises:
        ArgumentError: an option is out of range, or the spec is given both ways.
        SourceError: the source is missing or holds no images.
        OutputError: the output cannot be written (and the build has something to write), or holds
            something that is not a datapipe cache.
        ConfigMismatchError: the output holds a build with another configuration (use ``force``).
        TooManyBadFilesError: more than ``max_bad_fraction`` of the files were quarantined.
        OutputWriteError: writing failed part-way (disk full, read-only folder); finished shards are kept.
    """
    spec = _spec(spec, size=size, fit=fit, max_pixels=max_pixels, shard_size=shard_size, max_aspect=max_aspect,
                 encoding=encoding, quality=quality, classes=classes)
    cluster = Cluster() if cluster is None else cluster
    if not isinstance(cluster, Cluster):
        raise ArgumentError(f"cluster must be a datapipe.Cluster, got {type(cluster).__name__}")
    _check_not_reimported()
    if not cluster.scheduler and _unguarded_script_call():
        raise ArgumentError(_GUARD_HINT)
    if not cluster.scheduler:
        local_workers(cluster.workers)  # a count the machine cannot run is refused before the scan
    if isinstance(max_bad_fraction, bool) or not isinstance(max_bad_fraction, (int, float, numbers.Real)) \
            or not 0.0 <= max_bad_fraction <= 1.0:
        raise ArgumentError(f"max_bad_fraction must be a number in [0, 1], got {max_bad_fraction!r}")
    max_bad_fraction = float(max_bad_fraction)
    for name, flag in (("force", force), ("verify", verify), ("progress", progress)):
        check_bool(flag, name)
    for name, value in (("source", source), ("output", output)):
        if not isinstance(value, (str, os.PathLike)) or not os.fspath(value):  # "" would be the working folder
            raise ArgumentError(f"{name} must be a path or a URL, got {value!r}")
        check_path(value, name)
    source, output = remote.local_path(source), remote.local_path(output)  # file:// URLs: the folders they name
    _check_utf8_path("source", source, SourceError)
    _check_utf8_path("output", output, OutputError)
    t0 = time.perf_counter()
    remote_source = remote.is_url(os.fspath(source))
    remote_output = remote.is_url(os.fspath(output))
    if storage_options and not (remote_source or remote_output):
        raise ArgumentError(f"storage_options: for an s3:// (gs://, az://) source or output only; {source} and {output} "
                            "are local, so leave them out")
    store_timeout = remote.store_timeout() if remote_source or remote_output else remote.STORE_TIMEOUT
    _check_timeouts()
    if remote_source:
        listing = remote.scan(os.fspath(source), storage_options, store_timeout,
                              exclude=os.fspath(output) if remote_output else None)
    else:  # the output is never a class, even when it lies inside the source
        listing = scan(source, exclude=None if remote_output else Path(output).expanduser())
    if spec.classes is not None:
        listing = with_classes(listing, spec.classes)
    note_numeric_labels(listing)
    config = spec.config(listing.kind)
    chash = mf.config_hash(config)
    options = {"source_options": dict(storage_options or {}) if remote_source else None, "store_timeout": store_timeout}
    if remote_output:
        loc = remote.open_location(os.fspath(output), storage_options, timeout=store_timeout)
        return _build_remote(loc, listing, config, chash, spec, cluster=cluster, max_bad_fraction=max_bad_fraction,
                             force=force, verify=verify, progress=progress, t0=t0, options=options)
    out = Path(output).expanduser().absolute()
    writes = [shard_name(p["shard"]) for p in plan_shards(listing, spec.samples_per_shard)]
    target = prepare(out, config, chash, listing.identity, force, writes)
    try:
        with _write_errors(out):
            return _build_locked(target, listing, config, chash, spec, cluster=cluster, max_bad_fraction=max_bad_fraction,
                                 force=force, verify=verify, progress=progress, t0=t0, options=options)
    except BaseException:
        target.discard_if_untouched()  # a build that failed before its first shard leaves nothing behind
        raise
    finally:
        target.lock.release()


def _check_utf8_path(name: str, path: str | os.PathLike, error: type[DatapipeError]) -> None:
    """A path the build records (in build.json, the manifest and the report: UTF-8 text) must be UTF-8 itself."""
    text = os.fspath(path)
    where = text if remote.is_url(text) else os.path.abspath(os.path.expanduser(text))
    if not remote.is_url(text) and (wrong := locale_error(where)) is not None:
        raise error(f"{name} {wrong}")
    if not valid_utf8(where):
        raise error(f"{name} {shown(where)}: the path is not valid UTF-8; rename it (or link to it from a "
                    "path that is) and rerun")


def _check_not_reimported() -> None:
    """A script that calls build() without ``if __name__ == "__main__":`` runs it again in every worker
    process that a LocalCluster starts (they import the main module); there it would meet the lock
    of the build that started them. Say so in one line instead."""
    # multiprocessing runs the parent's main script under the name __mp_main__ in each process it
    # spawns, before the process is its child in name (parent_process() is still None then): a call from
    # that script's top-level code. A function of the script that the spawned process runs afterwards (its
    # target: torch.multiprocessing.spawn's ranks, a pool's tasks) may build.
    frame: FrameType | None = sys._getframe(1)
    while frame is not None and not (frame.f_globals.get("__name__") == "__mp_main__"
                                     and frame.f_code.co_name == "<module>"):
        frame = frame.f_back
    if frame is not None:
        raise ArgumentError(_GUARD_HINT)


_GUARD_HINT = ("a script that calls datapipe.build() with a LocalCluster must call it under "
               "`if __name__ == \"__main__\":`: its worker processes import the script, and would build again")


def _check_main_importable() -> None:
    """A LocalCluster's worker processes (spawned, as distributed starts them by default) run the main script
    again from its path, as multiprocessing does: a script read from standard input (``python - < build.py``)
    names a path that is no file, and the cluster would fail to start for no reason it could tell."""
    from multiprocessing import process

    import dask

    main = sys.modules.get("__main__")
    if dask.config.get("distributed.worker.multiprocessing-method", "spawn") == "fork" or main is None \
            or getattr(getattr(main, "__spec__", None), "name", None) is not None:
        return  # forked workers import nothing; a module run with -m is imported by its name
    path = getattr(main, "__file__", None)
    if not isinstance(path, str):
        return  # an interactive session, `python -c`: nothing to import
    where = os.path.join(getattr(process, "ORIGINAL_DIR", None) or "", path)  # where multiprocessing looks for it
    if not os.path.isfile(where):
        raise ArgumentError(f"the main script {shown(path)} is no file that the LocalCluster's worker processes can "
                            "import again (a script read from standard input?): save it as a file and run that, or "
                            "build with --scheduler sync (Cluster(scheduler=\"sync\")) or on a running Dask cluster")


def _unguarded_script_call() -> bool:
    """Whether build() is called from the top-level code of the main script, outside an
    ``if __name__ == "__main__":`` block: the LocalCluster's workers would run that call again."""
    import ast

    frame: FrameType | None = sys._getframe(2)
    while frame is not None and not (frame.f_globals.get("__name__") == "__main__"
                                     and frame.f_code.co_name == "<module>"):
        frame = frame.f_back
    path = frame.f_globals.get("__file__") if frame is not None else None
    if frame is None or not isinstance(path, str) or frame.f_code.co_filename != path or not os.path.isfile(path):
        # an interactive session (python -m asyncio's names a __file__ of its own), `python -c`, a function:
        # nothing is imported again
        return False
    try:
        tree = ast.parse(Path(path).read_text(encoding="utf-8"))
    except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
        return False
    line = frame.f_lineno
    return not any(isinstance(node, ast.If) and "__main__" in ast.unparse(node.test)
                   and "__name__" in ast.unparse(node.test) and node.lineno <= line <= (node.end_lineno or node.lineno)
                   for node in ast.walk(tree))


def _spec(spec: BuildSpec | None, **given: Any) -> BuildSpec:
    """The build's spec: ``spec``, or one made of the fields given as keywords (not both)."""
    given = {name: value for name, value in given.items() if value is not None}
    if spec is None:
        return BuildSpec(**given)
    if not isinstance(spec, BuildSpec):
        raise ArgumentError(f"spec must be a datapipe.BuildSpec, got {type(spec).__name__}")
    if given:
        raise ArgumentError(f"{', '.join(given)} given both in the BuildSpec and as keywords: give the spec one way")
    return spec


@contextlib.contextmanager
def _write_errors(out: Path) -> Iterator[None]:
    """An OSError while the cache is written (the disk filling up, the folder turning read-only) is the
    machine's state, not a bug: it becomes an OutputWriteError naming the file (or, when the error does
    not say which, the output folder)."""
    try:
        yield
    except OSError as exc:
        if isinstance(exc, DatapipeError):
            raise
        where = f": {exc.filename}" if exc.filename else f" while writing {out}"
        fix = "fix it"
        if exc.errno == errno.EFBIG:
            fix = TOO_LARGE_ADVICE
        elif exc.errno in FULL_DISK:
            room = disk_room(out if out.exists() else out.parent)
            where += f" ({room})" if room else ""
            fix = "free space there"
        kept = ("finished shards are kept: {} and rerun to resume" if _finished_shards(out) else
                "no shard was finished yet: {} and rerun")
        raise OutputWriteError(f"{exc.strerror or exc}{where}; {kept.format(fix)}") from exc


def _finished_shards(out: Path) -> bool:
    """Whether ``out`` holds a shard a build finished (a folder renamed into place), for a message."""
    try:
        return any(SHARD_NAME.fullmatch(entry.name) for entry in os.scandir(out / SHARDS_DIR))
    except OSError:
        return False


def _build_locked(target: Output, listing: Listing, config: dict, chash: str, spec: BuildSpec, *, cluster: Cluster,
                  max_bad_fraction: float, force: bool, verify: bool, progress: bool, t0: float,
                  options: dict) -> BuildReport:
    """The build proper, run while holding the output's lock (or, for a read-only output, checking that
    there is nothing to do: see :func:`_check_up_to_date`)."""
    out = target.path
    plans = plan_shards(listing, spec.samples_per_shard)
    retry = _retries(force, verify, finished=(out / mf.MANIFEST).exists() and not _report_failed(out))
    if target.read_only is not None:
        _log_plan(listing, plans, spec)
        return _check_up_to_date(target, listing, plans, config, chash, verify=verify, retry=retry,
                                 max_bad_fraction=max_bad_fraction, t0=t0, side=spec.decode.max_side,
                                 encoding=spec.encoding)
    refusal = linked_shards(out)  # behind the link, only a rerun that finds nothing to do; refused before it writes
    if refusal is not None and _changes_shards(out, plans, chash, target.build_id, retry=retry, verify=verify, spec=spec):
        raise refusal
    _retire_stale_manifest(out, plans, chash, target.build_id, retry=retry)
    t_scan = time.perf_counter() - t0
    _log_plan(listing, plans, spec)
    kwargs = {"root": listing.location, "output": str(out), "spec": asdict(spec.decode), "config_hash": chash,
              "build_id": target.build_id, "verify": verify, "encoding": spec.encoding, "quality": spec.quality,
              "lock_token": target.lock.token, **options}
    # Decided from the shards' records (zarr.json and a stat each) before any cluster starts: an
    # unchanged rerun imports no Dask and starts no worker.
    done = {} if verify else _finished_local(out, plans, chash, target.build_id, verify=False, retry=retry,
                                             side=spec.decode.max_side, encoding=spec.encoding)
    return _build_todo(out, listing, plans, done, kwargs, config, chash, cluster=cluster, progress=progress,
                       max_bad_fraction=max_bad_fraction, t0=t0, t_scan=t_scan, build_id=target.build_id)


def _changes_shards(out: Path, plans: list[dict], chash: str, build_id: str, *, retry: bool, verify: bool,
                    spec: BuildSpec) -> bool:
    """Whether a build would write or remove a shard: a planned one not finished, or one of this build no longer
    planned."""
    done = _finished_local(out, plans, chash, build_id, verify=verify, retry=retry, side=spec.decode.max_side,
                           encoding=spec.encoding)
    return len(done) < len(plans) or bool(shards_of(out, build_id, keep={shard_name(p["shard"]) for p in plans}))


def _retries(force: bool, verify: bool, *, finished: bool) -> bool:
    """Whether a build reads again the files its finished shards quarantined for a reason their bytes do not
    decide (:func:`read_again`): when the earlier build did not finish (it failed over its budget of bad
    files, or was stopped), or when asked (``--force``, ``--verify``). A rerun of a finished cache stays a
    no-op that writes nothing (the training script that calls build() on every start, on every rank)."""
    return force or verify or not finished


def _finished_local(out: Path, plans: list[dict], chash: str, build_id: str, *, verify: bool,
                    retry: bool, side: int, encoding: str) -> dict[int, dict]:
    """The plans' shards already finished in ``out`` (see finished_shard; with ``verify``, also their checksums)."""
    done: dict[int, dict] = {}
    for plan in plans:
        rec = finished_shard(plan, output=str(out), config_hash=chash, build_id=build_id, retry=retry)
        if rec is not None and (not verify or _checksums_match(out / SHARDS_DIR / shard_name(plan["shard"]), rec, plan, side,
                                                               encoding)):
            done[plan["shard"]] = {**rec, "skipped": True, "seconds": 0.0}
    return done


def _note_earlier_rules(done: dict[int, dict], total: int) -> None:
    """Log how many of the finished shards a build keeps another datapipe decoded, by other rules (see
    codecs.DECODE_RULES; a shard without the number is of rules 1): they are kept as they are (nothing says any of
    their files decodes otherwise now), and the shards built now follow this datapipe's rules."""
    def rules(rec: dict) -> int | None:  # None: a number of no kind (the record edited)
        value = rec.get("decode_rules", 1)
        return value if type(value) is int else None

    others = [r for r in map(rules, done.values()) if r != DECODE_RULES]
    if others:
        named = ", ".join(sorted({"unknown" if r is None else str(r) for r in others}))
        log.warning(f"datapipe build: {len(others):,} of the {total:,} shards kept were decoded by another datapipe's "
                    f"rules (decode rules {named}; this one's: {DECODE_RULES}: rare image kinds may decode otherwise, see "
                    "docs/build.md); they are kept as they are, and the shards built now follow this one's rules: a "
                    "build into a new folder decodes every file by them")


def _check_up_to_date(target: Output, listing: Listing, plans: list[dict], config: dict, chash: str, *,
                      verify: bool, retry: bool, max_bad_fraction: float, t0: float, side: int,
                      encoding: str) -> BuildReport:
    """A build into a folder it may not write (a shared cache): its report when the cache is finished and a
    build would write nothing (every shard finished, and labels, paths, report and manifest what it would
    write), else ``target.cannot_write()``. No lock is taken; the verdict holds all the same: any build that
    changes a shard first removes the manifest, and the manifest is compared last."""
    done = _finished_local(target.path, plans, chash, target.build_id, verify=verify, retry=retry, side=side,
                           encoding=encoding)
    if len(done) < len(plans):
        raise target.cannot_write()
    _note_earlier_rules(done, len(plans))
    records = [done[p["shard"]] for p in plans]
    timing = {"scan": time.perf_counter() - t0, "shards": 0.0, "cluster": 0.0}
    return _finish(target.path, listing, plans, records, config, chash, max_bad_fraction, seconds=timing, workers=0,
                   dashboard=None, t0=t0, build_id=target.build_id, read_only=target)


def _log_plan(listing: Listing, plans: list[dict], spec: BuildSpec) -> None:
    refused = f" (and {len(listing.dropped)} refused at the scan)" if listing.dropped else ""  # counted in `scanned` too
    log.info(f"datapipe build: {plural(len(listing), 'file')}{refused} in "
             f"{plural(len(listing.classes), 'class', 'classes')} "
             f"from {message_text(str(_listed_from(listing)))} -> {plural(len(plans), 'shard')} of up to "
             f"{plural(spec.samples_per_shard, 'sample')} at {_describe(spec)}")


def _listed_from(listing: Listing) -> str | Path:
    """What a build's files are listed by, as its plan line names it: the CSV (file or object) or the folder."""
    csv_file = listing.source if listing.kind == "csv" else None
    return listing.listed_from or csv_file or listing.url or listing.root


def _build_todo(out: Path | remote.RemoteOutput, listing: Listing, plans: list[dict], done: dict[int, dict], kwargs: dict,
                config: dict, chash: str, *, cluster: Cluster, progress: bool, max_bad_fraction: float, t0: float,
                t_scan: float, build_id: str) -> BuildReport:
    """Build the shards not ``done`` and finish the cache."""
    todo = [p for p in plans if p["shard"] not in done]
    timing = {"scan": t_scan, "shards": 0.0}
    t1 = time.perf_counter()
    n_workers, dashboard = 0, None
    if todo:
        built, n_workers, dashboard = _run(todo, kwargs, cluster=cluster, progress=progress, timing=timing)
        if isinstance(out, Path):
            _check_visible(out, built, cluster)
        done.update((rec["shard"], rec) for rec in built)
    # the shards kept: those found finished here, and those the tasks found whole (all of them with --verify)
    _note_earlier_rules({k: rec for k, rec in done.items() if rec.get("skipped")}, len(plans))
    timing["cluster"] = time.perf_counter() - t1 - timing["shards"]
    records = [done[p["shard"]] for p in plans]
    return _finish(out, listing, plans, records, config, chash, max_bad_fraction, seconds=timing,
                   workers=n_workers, dashboard=dashboard, t0=t0, build_id=build_id)


def _check_visible(out: Path, built: list[dict], cluster: Cluster) -> None:
    """Every shard the workers report written is in ``out`` as this process sees it, whole (its zarr.json and the
    sizes it gives): a worker whose ``out`` is another folder (a path local to each machine, not a shared file
    system) reports shards that are not here, and a manifest of them would be a cache that is not.

    Raises:
        BuildError: naming the first missing shard (the others stay where the workers wrote them).
    """
    missing = [rec["shard"] for rec in built if read_shard_record(out / SHARDS_DIR / shard_name(rec["shard"])) is None]
    if missing:
        where = f"the workers of {cluster.scheduler}" if cluster.scheduler else "the build's workers"
        raise BuildError(
            f"{len(missing)} of the {len(built)} shards {where} wrote are not in {out} as this machine sees it (first: "
            f"{out / SHARDS_DIR / shard_name(missing[0])}): every worker must see the output folder at the same path "
            "(a shared file system); finished shards that are here are kept, and a rerun once every worker sees "
            "the folder resumes")


# ----------------------------------------------------------------------------- an output in object storage


def _build_remote(loc: remote.Location, listing: Listing, config: dict, chash: str, spec: BuildSpec, *, cluster: Cluster,
                  max_bad_fraction: float, force: bool, verify: bool, progress: bool, t0: float,
                  options: dict) -> BuildReport:
    """A build into object storage: the prefix claimed (build.json, the lock object), one listing decides the
    finished shards, workers upload theirs, the index objects and the manifest come last."""
    if loc.url.startswith("memory://"):
        raise ArgumentError(f"{loc.url}: a memory:// filesystem is not shared with the Dask workers; use a real store")
    target = remote.prepare(loc, config, chash, listing.identity, force)
    try:
        with remote.store_errors(loc, "write the cache", OutputWriteError):
            plans = plan_shards(listing, spec.samples_per_shard)
            _log_plan(listing, plans, spec)
            done = _finished_remote(target, plans, chash, verify=verify, side=spec.decode.max_side, encoding=spec.encoding,
                                    retry=_retries(force, verify, finished=mf.MANIFEST in target.objects
                                                   and not _report_failed(target)))
            if target.read_only is not None:  # checked, never written (see _check_up_to_date)
                if len(done) < len(plans):
                    raise target.cannot_write()
                return _finish(target, listing, plans, [done[p["shard"]] for p in plans], config, chash,
                               max_bad_fraction, seconds={"scan": time.perf_counter() - t0, "shards": 0.0, "cluster": 0.0},
                               workers=0, dashboard=None, t0=t0, build_id=target.build_id, read_only=target)
            if len(done) < len(plans) and mf.MANIFEST in target.objects:
                remote.delete(loc, [mf.MANIFEST])  # a half-rebuilt cache must not read as finished
            kwargs = {"root": listing.location, "output": loc.url, "spec": asdict(spec.decode), "config_hash": chash,
                      "build_id": target.build_id, "encoding": spec.encoding, "quality": spec.quality,
                      "output_options": loc.storage_options, "lock_token": target.lock.token, **options}
            report = _build_todo(target, listing, plans, done, kwargs, config, chash, cluster=cluster,
                                 progress=progress, max_bad_fraction=max_bad_fraction, t0=t0,
                                 t_scan=time.perf_counter() - t0, build_id=target.build_id)
    except BaseException:
        target.end(failed=True)
        raise
    target.end(failed=False)
    return report


def _finished_remote(target: remote.RemoteOutput, plans: list[dict], chash: str, *, verify: bool,
                     retry: bool, side: int, encoding: str) -> dict[int, dict]:
    """The plans' shards already whole in the store, from the listing and their zarr.json records (with
    ``verify``, also their data's crc32c, streamed), but for those with a quarantined file to read again."""
    names = {shard_name(p["shard"]): p for p in plans}
    records = remote.shard_records(target.loc, target.objects, names)
    done: dict[int, dict] = {}
    for name, rec in records.items():
        plan = names[name]
        objects = remote.shard_objects(target.objects, name)
        if not _same_build(rec, plan, chash, target.build_id) or (retry and _reads_again(rec)) \
                or not remote.whole(rec, objects):
            continue
        if verify and rec["count"] and _remote_damaged(target.loc, name, rec, plan, side, encoding):
            continue
        done[plan["shard"]] = {**rec, "skipped": True, "seconds": 0.0}
    return done


def _remote_damaged(loc: remote.Location, name: str, rec: dict, plan: dict, side: int, encoding: str) -> bool:
    """Whether a finished remote shard differs from what its build wrote, checked as ``datapipe verify`` checks it:
    its data's and sample index's crc32c (streamed), its paths and labels chunk against the plan's, its Zarr documents."""
    layout = shard_layout(rec)
    base = f"{SHARDS_DIR}/{name}/"
    data = base + images_path(Path(), layout).as_posix()
    if remote.stream_crc32c(loc, data)[1] != rec["crc32c"]:
        return True
    if layout == "indexed" and remote.stream_crc32c(loc, base + index_path(Path()).as_posix())[1] != rec["index_crc32c"]:
        return True
    kept = _kept(plan, rec)
    return len(kept) != rec["count"] or bool(remote.shard_content_problems(
        loc, name, rec, [label for _, label in kept], [path for path, _ in kept], side, encoding))


def _publish_remote(target: remote.RemoteOutput, plans: list[dict], documents: dict[str, bytes], *, build_id: str,
                    report_first: Callable[[], None]) -> bool:
    """Remove this build's shards no longer planned, write the report (``report_first``), then upload labels.npy
    and paths.json, then the manifest, unless they already are what it would upload (a rerun with nothing to do
    writes nothing); whether it uploaded."""
    loc = target.loc
    if not target.lock.held_now():  # its shards may be another build's by now: a manifest must not vouch for them
        raise OutputBusyError(f"output {loc.url}: another datapipe build took over this build's lock while it ran "
                              f"(its lock object was replaced or removed, and not refreshed for "
                              f"{target.lock.ttl:g} s); no manifest was written: wait for that build, then rerun")
    remote.remove_shards(loc, remote.listing(loc, SHARDS_DIR), build_id, keep={shard_name(p["shard"]) for p in plans})
    report_first()
    if _index_current(target, documents):
        return False
    with tempfile.TemporaryDirectory(prefix="datapipe-index-") as tmp:
        for name, data in documents.items():  # the manifest last
            Path(tmp, name).write_bytes(data)
            remote.put_file(loc, os.path.join(tmp, name), name)
    return True


def _index_current(out: Path | remote.RemoteOutput, documents: dict[str, bytes]) -> bool:
    """Whether labels.npy, paths.json and, last, the manifest already hold ``documents``: a build that changes any
    of them removes the manifest first, so its bytes, unchanged after the rest was found as it should be, vouch
    for all of it."""
    holds_ = out.holds if isinstance(out, remote.RemoteOutput) else lambda name, data: holds(out / name, data)
    return all(holds_(name, documents[name]) for name in (mf.LABELS, mf.PATHS, mf.MANIFEST))


def _describe(spec: BuildSpec) -> str:
    """The samples a spec makes, for the build's first line: ``64x64 (crop)``, ``short side 64, longer
    at most 128 (short), jpeg q90``."""
    if spec.fit == "short":
        text = f"short side {spec.size}, longer at most {spec.max_side} (short)"
    else:
        text = f"{spec.size}x{spec.size} ({spec.fit})"
    return text + (f", {spec.encoding} q{spec.quality}" if spec.encoding != "raw" else "")


def _retire_stale_manifest(out: Path, plans: list[dict], chash: str, build_id: str, *, retry: bool) -> None:
    """Remove an earlier build's manifest unless it already describes this build's shards, and none of
    them is to be built again for a file it quarantined (see read_again).

    A build that replaces, adds or removes any shard would otherwise leave, if it is stopped or
    fails, a manifest that no longer matches the shards (and labels) on disk. Without one the cache
    reads as unfinished until a rerun completes it; a rerun that changes nothing keeps it.
    (The output's preparation has checked that this manifest carries this build's id.)
    """
    path = out / mf.MANIFEST
    if not path.exists():
        return
    try:
        old = mf.read_manifest(out)
        same = old.config_hash == chash and [(s.name, s.inputs_hash) for s in old.shards] == [
            (shard_name(p["shard"]), p["inputs_hash"]) for p in plans]
    except CacheError:  # damaged: it cannot describe this build's shards
        same = False
    if same and retry:
        for plan in plans:  # a file read again may now be a sample: the shard, labels and manifest change
            rec = read_shard_record(out / SHARDS_DIR / shard_name(plan["shard"]))
            if rec is not None and _same_build(rec, plan, chash, build_id) and _reads_again(rec):
                same = False
                break
    if not same:
        path.unlink()
        fsync_dir(out)


# Dask makes workers hand freed memory back to the OS at once (MALLOC_TRIM_THRESHOLD_=64 KiB), and
# setting that threshold at all freezes glibc's mmap threshold at 128 KiB: every buffer above it (a
# decoded image, torch's resize scratch) is then a fresh mmap whose pages fault in on each use, which
# slows decoding (docs/build.md has the figures). A build allocates the same
# few buffers per image, so its workers keep them: both thresholds raised, set before the spawn.
# (Workers of an existing cluster: set both variables in their environment, as docker/ does.)
WORKER_ENV = {"MALLOC_TRIM_THRESHOLD_": str(256 << 20), "MALLOC_MMAP_THRESHOLD_": str(16 << 20)}


_warmed = False


def _resize_by_torch() -> bool:
    """Whether this process resizes with torch's kernel: only where the compiled one is not available.
    Otherwise a build never imports torch (a worker saves its seconds of import and ~200 MB)."""
    from . import native

    return not native.available()


def _warm_up() -> dict[str, str]:
    """Import and load everything decoding needs, once per process, so that the first file is timed
    like any other (on a busy machine these one-time costs take seconds). Returns what this process runs
    (:func:`_what_runs`).

    Raises:
        BuildError: a library decoding needs is older than datapipe's least (:data:`_NEEDS`), missing, or cannot
            be loaded: named, with the worker (:func:`_load_problem`).
    """
    problem = _load_problem()
    if problem is not None:
        raise BuildError(f"{_this_process()} {problem}")
    return _what_runs()


def _warm_up_report() -> dict[str, str | None]:
    """:func:`_warm_up` on each worker of a cluster (``Client.run``, where a worker cannot name itself): what it
    runs, and under ``problem`` what keeps it from decoding (None: nothing), for the client to say with its address."""
    return {**_what_runs(), "problem": _load_problem()}


def _load_problem() -> str | None:
    """Load what decoding needs, once per process (:func:`_warm_up`); what keeps this process from decoding as the
    build's does, as the end of a sentence naming it, or None."""
    global _warmed
    if _warmed:
        return None
    problems = _library_problems()
    if problems:
        return (f"has {'; '.join(problems)}: install the versions datapipe needs (pip install -U 'PACKAGE>=VERSION') "
                "and rerun")
    try:
        import zarr  # noqa: F401

        if _resize_by_torch():
            import torch  # noqa: F401
        warm_up()
    except DatapipeError as exc:
        return f"could not load datapipe's decoders: {exc}"
    except ImportError:  # a dependency not installed: the command line names it (and the client, of a worker)
        raise
    except Exception as exc:  # noqa: BLE001 - a library that fails to load (built for another numpy), in one line
        return (f"could not load datapipe's decoders ({type(exc).__name__}: {one_line(exc) or 'no message'}): "
                "reinstall the failing library for this environment (its numpy, its Python), and rerun")
    _warmed = True
    return None


def _what_runs() -> dict[str, str]:
    """This process's datapipe (:func:`_identity`), dask and distributed: what a build's workers must share."""
    import dask
    import distributed

    return {"datapipe": _identity(), "dask": dask.__version__, "distributed": distributed.__version__}


# The libraries whose versions decide what a worker decodes and writes, and the least version of each (as
# pyproject.toml requires them): a worker built from another image may hold an older one that pip never checked.
_NEEDS = {"numpy": "1.26", "Pillow": "11.2.1", "simplejpeg": "1.7.3", "zarr": "3.1", "google-crc32c": "1.6"}
_MODULES = {"Pillow": "PIL", "google-crc32c": "google_crc32c"}  # the module of each that is not named alike


def _library_problems() -> list[str]:
    """What this process lacks of :data:`_NEEDS`, one phrase each (``Pillow 9.5.0 (datapipe needs 11.2.1 or later)``)."""
    from importlib.metadata import PackageNotFoundError, version

    def release(text: str) -> tuple[int, ...]:  # "10.2.0rc1" -> (10, 2, 0): the numbers a minimum is compared by
        return tuple(int(part) for part in re.findall(r"\d+", text.split("+")[0])[:3])

    problems = []
    for name, least in _NEEDS.items():
        try:
            have = version(name)
        except PackageNotFoundError:  # installed under another name (pillow-simd) or by hand: the module says
            try:
                have = str(getattr(importlib.import_module(_MODULES.get(name, name)), "__version__", least))
            except ImportError:
                problems.append(f"no {name} installed (datapipe needs {least} or later)")
                continue
        if release(have) < release(least):
            problems.append(f"{name} {have} (datapipe needs {least} or later)")
    return problems


_IDENTITY: str | None = None


def _identity() -> str:
    """This datapipe as a build's workers must match it: its version, the number of its decode rules
    (codecs.DECODE_RULES) and a digest of its code (its Python and C sources), which tells two installs of one
    version apart (``0.1.0, decode rules 3, code 4f1c2a9e``)."""
    global _IDENTITY
    if _IDENTITY is None:
        digest = hashlib.sha256()
        package = Path(__file__).parent
        for path in sorted([*package.rglob("*.py"), *package.rglob("*.c")]):
            digest.update(str(path.relative_to(package)).encode())
            digest.update(path.read_bytes())
        _IDENTITY = f"{__version__}, decode rules {DECODE_RULES}, code {digest.hexdigest()[:8]}"
    return _IDENTITY


def _names_problem(names: list[str]) -> str | None:
    """Why this process cannot open the build's files by these names, or None. The build found them as UTF-8
    text; a worker whose locale reads file names otherwise (LC_ALL=C with PYTHONUTF8=0, a Latin-1 locale) would
    open other bytes than the scan found: a name that is not ASCII would be missing there, or fail to encode,
    and be quarantined as a bad file (an output folder so named, written elsewhere)."""
    if fs_encoding() == "utf-8" or (name := next((n for n in names if not n.isascii()), None)) is None:
        return None
    return (f"reads file names as {fs_encoding()} (its locale's), not UTF-8, so it would open other files than the "
            f"build found ({shown(name)}), or none: start it with PYTHONUTF8=1 (or in a UTF-8 locale: LC_ALL=C.UTF-8) "
            "and rerun")


def _this_process() -> str:
    """This process in a message: the Dask worker it is (its address), or "this process" (a build's own)."""
    address = _worker_address()
    return f"Dask worker {address}" if address != "this worker" else "this process"


def _run(plans: list[dict], kwargs: dict, *, cluster: Cluster, progress: bool,
         timing: dict[str, float]) -> tuple[list[dict], int, str | None]:
    """Build the shards of ``plans`` on ``cluster``: their records in plan order, the number of
    workers and the dashboard's address. The time spent building goes into ``timing["shards"]``."""
    if cluster.serial:
        log.info("datapipe build: building serially in this process (scheduler='sync'): no Dask dashboard")
        _warm_up()
        t_start = time.perf_counter()
        records = _build_serially(plans, kwargs, progress=progress)
        timing["shards"] = time.perf_counter() - t_start
        return records, 1, None
    with _dask_client(cluster) as client:
        n_workers, dashboard = _ready_workers(client, cluster)
        t_start = time.perf_counter()
        records, joined = _map_shards(client, plans, kwargs, progress=progress,
                                      where=cluster.scheduler or "the LocalCluster")
        timing["shards"] = time.perf_counter() - t_start
        return records, max(n_workers, joined), dashboard


def _progress_bar(total: int, progress: bool) -> tqdm:
    return progress_bar(total=total, unit="shard", desc="shards", disable=not progress)


def _build_serially(plans: list[dict], kwargs: dict, *, progress: bool) -> list[dict]:
    records = []
    with _progress_bar(len(plans), progress) as bar:  # closed before any error line is printed
        for plan in plans:
            records.append(build_shard(plan, serial=True, **kwargs))
            bar.update()
    return records


# ----------------------------------------------------------------------------- the cluster policy


@contextlib.contextmanager
def _dask_client(cluster: Cluster) -> Iterator[Client]:
    """A Dask client of the scheduler at ``cluster.scheduler``, or of a LocalCluster of our own;
    closed when the block ends, and our own workers with it (none may outlive the build)."""
    # A LocalCluster's nannies (in this process) set their workers' environment in this process's own before each
    # start: the program's is given back as it was once they are gone (a process it starts later, a training run,
    # would otherwise run torch on one thread).
    names = () if cluster.scheduler else tuple(dict.fromkeys((*_pre_spawn_environ(), "PYTHONHASHSEED")))  # and a seed
    _Environ.hold(names)
    quieted = _dask_quieted.set([])  # _quiet_dask() silences Dask's loggers from then until the end of this block
    try:
        with _dask_client_open(cluster) as client:
            yield client
    finally:
        if _dask_quieted.get():
            _Silenced.release(_DASK_LOGGERS)
        _dask_quieted.reset(quieted)
        _Environ.release(names)


@contextlib.contextmanager
def _dask_client_open(cluster: Cluster) -> Iterator[Client]:
    own = None
    pending: list[int] = []
    if cluster.scheduler:
        client = _connect(cluster.scheduler)
    else:
        own, client = _start_local(local_workers(cluster.workers), pending)
    # The client logs each failed try to reach a scheduler that went away, with its traceback, before the task's
    # future says so: the build's one line says it (see _SCHEDULER_LOST).
    with _loggers_quiet("distributed.client"):
        try:
            for signum in pending:  # delivered now, so that the cluster is closed below
                signal.raise_signal(signum)
            if own is not None:  # our own workers leave Ctrl-C to this process, which stops them
                from .dask_plugins import IgnoreSigint

                client.register_plugin(IgnoreSigint(), name="datapipe-ignore-sigint")
            yield client
        except BaseException:
            _quiet_dask()  # stopping early: the cluster's shutdown has nothing to tell the user
            raise
        finally:
            _close(client, own)


WORKER_MEMORY = 256 << 20  # what one LocalCluster worker needs, its nanny and a large image's decode included
WORKERS_PER_CORE = 4  # beyond this many processes a core, decoding only waits for the CPU


def available_memory() -> int:
    """Bytes of memory available to new processes: the kernel's estimate (MemAvailable), or else the free pages."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def local_workers(asked: int | None) -> int:
    """The LocalCluster's worker count: ``asked``, or one per core this process may use (its CPU affinity and
    a container's CPU quota counted, as Dask counts them).

    Raises:
        ArgumentError: more workers than WORKERS_PER_CORE a core, or than the available memory holds at
            WORKER_MEMORY each (a thousand workers would end in the kernel's OOM killer, after minutes).
    """
    from dask.system import CPU_COUNT

    cores = max(1, CPU_COUNT)
    if asked is None:
        return cores
    available = available_memory()
    limit = max(1, min(WORKERS_PER_CORE * cores, available // WORKER_MEMORY))
    if asked > limit:
        raise ArgumentError(
            f"--workers {asked} is more than this machine can run: {plural(cores, 'core')} and "
            f"{available / 2**30:.1f} GiB of memory available allow at most {limit} LocalCluster workers "
            f"({WORKERS_PER_CORE} a core, {WORKER_MEMORY >> 20} MiB each); leave --workers out for one per core, or "
            "build on a larger Dask cluster with --scheduler tcp://HOST:8786")
    return asked


# Descriptors a LocalCluster needs open in this process (its scheduler, nannies, their pipes and connections):
# measured, about 36 and 8 a worker; with fewer it fails to start, or, with some 20, its scheduler retries
# accept() for ever and the start never ends.
CLUSTER_FILES, WORKER_FILES = 48, 8


def _check_open_files(n_workers: int) -> None:
    """Raise this process's limit of open files to what a LocalCluster of ``n_workers`` needs (see CLUSTER_FILES),
    up to its hard limit, as Dask's own scheduler does; refuse the cluster when even that is too low."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    needed = CLUSTER_FILES + WORKER_FILES * n_workers
    if soft == resource.RLIM_INFINITY or soft >= needed:
        return
    if hard == resource.RLIM_INFINITY or hard >= needed:
        with contextlib.suppress(OSError, ValueError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (needed, hard))
            return
    raise BuildError(f"this process may open {min(soft, hard):,} files (ulimit -n), and a LocalCluster of "
                     f"{plural(n_workers, 'worker')} needs about {needed}: raise the limit (ulimit -n {needed}), "
                     "build with fewer --workers, or with --scheduler sync (no Dask processes)")


def _check_not_daemonic() -> None:
    """A daemonic process (a multiprocessing.Pool's worker) may start no processes: a LocalCluster's workers."""
    import multiprocessing

    if multiprocessing.current_process().daemon:
        raise BuildError(f"this process ({multiprocessing.current_process().name}) is daemonic, as a "
                         "multiprocessing.Pool's workers are, and may not start the LocalCluster's worker processes: "
                         "build with --scheduler sync (Cluster(scheduler=\"sync\")), on a running Dask cluster, or "
                         "from a process that is not daemonic")


def _start_local(n_workers: int, pending: list[int]) -> tuple[LocalCluster, Client]:
    """Our own LocalCluster and a client of it, started with SIGINT and SIGTERM deferred into ``pending``.

    Ctrl-C or SIGTERM while the cluster starts would leave it half made, not yet ours to close (its
    workers, and distributed's exit handler failing on it): such a signal waits until it is. A signal
    sent to the whole process group (Ctrl-C in a terminal) also stops the starting workers, so that the
    start fails ("Nanny failed to start"): the failure is then that interruption, delivered here once the
    cluster has closed what it had started, and not distributed's traceback."""
    from dask.distributed import Client

    _check_main_importable()
    _check_not_daemonic()
    _check_open_files(n_workers)
    try:
        with _signals_deferred(pending), _loggers_quiet("asyncio", "tornado"):  # a failure to start: our one line says it
            own = _local_cluster(n_workers)
            try:
                return own, Client(own)
            except BaseException:
                own.close(timeout=15)
                raise
    except Exception as exc:  # noqa: BLE001 - whatever distributed raises, said in one line
        if not pending:
            _quiet_dask()
            raise BuildError(_cluster_failed(n_workers, exc)) from None
        failure = exc
    _quiet_dask()  # the workers' shutdown has nothing to tell the user
    for signum in pending:  # outside the except block: the interruption is not chained to the failure
        signal.raise_signal(signum)
    raise failure  # a handler that did not raise: the start's own failure


class _Counted:
    """Settings of the process that builds running at once (threads) each change for a while: the first hold of
    a name saves its setting (and changes it), the last release puts the saved one back. A build never leaves a
    setting of the program's changed."""

    def __init__(self, save: Callable[[str], Any], change: Callable[[str], None],
                 restore: Callable[[str, Any], None]) -> None:
        self.save, self.change, self.restore = save, change, restore
        self.lock = threading.Lock()
        self.holds: dict[str, tuple[int, Any]] = {}  # name: (holds, its setting before the first)

    def hold(self, names: Sequence[str]) -> None:
        with self.lock:
            for name in names:
                count, saved = self.holds.get(name, (0, None))
                self.holds[name] = (count + 1, self.save(name) if count == 0 else saved)
                self.change(name)

    def release(self, names: Sequence[str]) -> None:
        with self.lock:
            for name in names:
                count, saved = self.holds.pop(name)
                if count > 1:
                    self.holds[name] = (count - 1, saved)
                else:
                    self.restore(name, saved)


def _set_environ(name: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value


# Loggers that datapipe's builds hold silent, and the environment that LocalClusters' nannies set in this process
_Silenced = _Counted(lambda name: logging.getLogger(name).level,
                     lambda name: logging.getLogger(name).setLevel(logging.CRITICAL + 1),
                     lambda name, level: logging.getLogger(name).setLevel(level))
_Environ = _Counted(os.environ.get, lambda name: None, _set_environ)


@contextlib.contextmanager
def _loggers_quiet(*names: str) -> Iterator[None]:
    """The block runs with these loggers silent, then their levels are put back."""
    _Silenced.hold(names)
    try:
        yield
    finally:
        _Silenced.release(names)


def _other_version(worker: str, version: str | None, client: str) -> str:
    """The error of a worker that runs another datapipe (``version``, see :func:`_identity`; None: one too old to
    say) than the build's process (``client``)."""
    runs = f"datapipe {version}" if version else "an older datapipe"
    return (f"Dask worker {worker} runs {runs}, this process datapipe {client}: every worker must run this "
            "process's datapipe, which decides what the cache holds (its format, how each file decodes); install "
            "it on the workers (or this one's on this machine) and rerun")


def _worker_address() -> str:
    """The address of the Dask worker running the calling task (or "this worker")."""
    try:
        from dask.distributed import get_worker

        return str(get_worker().address)
    except (ImportError, ValueError):
        return "this worker"


def _cluster_failed(n_workers: int, exc: BaseException) -> str:
    """The one line of a LocalCluster that did not start: distributed's reason, and this process's limits that
    commonly cause it (open files, memory, threads)."""
    reason = one_line(exc) or type(exc).__name__
    failed = f"the LocalCluster of {plural(n_workers, 'worker')} did not start ({type(exc).__name__}: {reason})"
    if "temporary directory" in reason:  # tempfile's "No usable temporary directory found in [...]"
        return (f"{failed}: its processes need a writable temporary folder; set TMPDIR to one, or build with "
                "--scheduler sync")
    disk = _local_disk_error(exc)
    if disk is not None:  # its scratch folder (dask-scratch-space) on a full or read-only disk: no limit to raise
        import dask

        scratch = dask.config.get("temporary-directory", None) or tempfile.gettempdir()
        if disk.errno in FULL_DISK:
            room = f", {room}" if (room := disk_room(scratch)) else ""
            where = f"{scratch}{room}; free space there, or point"
        else:
            where = f"{scratch}, which is read-only; point"
        return (f"{failed}: its processes keep their scratch space in {where} DASK_TEMPORARY_DIRECTORY (or TMPDIR) "
                "at a writable folder with room, or build with --scheduler sync")
    limits = soft_limits(("open files", "RLIMIT_NOFILE", ""), ("virtual memory", "RLIMIT_AS", " bytes"),
                         ("processes", "RLIMIT_NPROC", ""))
    shown = f" (this process's limits: {', '.join(limits)})" if limits else ""
    return (f"{failed}: the machine may be short of open files, memory or processes{shown}; raise the limit "
            "(ulimit -n, ulimit -v), build with fewer --workers, or with --scheduler sync (no Dask processes)")


def _local_disk_error(exc: BaseException) -> OSError | None:
    """The full disk, quota or read-only file system behind ``exc`` (its causes followed; distributed's
    "Cluster failed to start" keeps only the text of some: "[Errno 28] No space left on device: '...'")."""
    seen: BaseException | None = exc
    for _ in range(8):
        if seen is None:
            break
        if isinstance(seen, OSError) and seen.errno in FULL_DISK | {errno.EROFS}:
            return seen
        seen = seen.__cause__ or seen.__context__
    found = re.search(r"\[Errno (\d+)\]", one_line(exc) or "")
    if found and int(found.group(1)) in FULL_DISK | {errno.EROFS}:
        code = int(found.group(1))
        return OSError(code, os.strerror(code))
    return None


@contextlib.contextmanager
def _signals_deferred(pending: list[int]) -> Iterator[None]:
    """SIGINT and SIGTERM received in the block are noted in ``pending`` (for the caller to deliver
    once it owns what the block made) instead of interrupting it. Only the main thread handles
    signals; elsewhere the block runs as it is. The handlers are Python's: processes started in the
    block (spawned, not forked) do not inherit them.

    SIGINT is also blocked in this thread during the block, and so in the threads started in it and in
    the processes they start (a signal mask is inherited, through exec too): the cluster's workers never
    see Ctrl-C, which a terminal sends to the whole process group, and one that is still starting does
    not die of it with a traceback of its own; this process stops them. SIGTERM stays deliverable to
    them: their nanny stops them with it."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    kinds = (signal.SIGINT, signal.SIGTERM)
    previous = {sig: signal.getsignal(sig) for sig in kinds}

    def note(signum: int, frame: object) -> None:
        if signum not in pending:
            pending.append(signum)

    for sig in kinds:
        if previous[sig] not in (signal.SIG_IGN, None):
            signal.signal(sig, note)
    # multiprocessing's resource tracker, when it starts, unblocks SIGINT in the thread that starts it (the
    # cluster's loop thread, whose spawned workers would inherit that): it is started here, before the block
    from multiprocessing import resource_tracker

    resource_tracker.ensure_running()
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)  # a SIGINT held back meanwhile is noted here
        for sig in kinds:
            if previous[sig] not in (signal.SIG_IGN, None):
                signal.signal(sig, previous[sig])


PROBE_TIMEOUT = 120.0  # seconds a file decoded in a process of its own may take (DATAPIPE_PROBE_TIMEOUT)
SCHEDULER_TIMEOUT = 20.0  # seconds to reach an existing Dask scheduler, or for it to answer (DATAPIPE_SCHEDULER_TIMEOUT)
WORKER_WAIT = 300.0  # seconds a build waits for a worker that can build its shards (DATAPIPE_WORKER_TIMEOUT)


def _check_timeouts() -> None:
    """Every DATAPIPE_*_TIMEOUT a build reads is valid, checked before anything starts (a worker reading a bad one
    would fail its shard instead of the build failing with one line)."""
    file_timeout()
    env_seconds("DATAPIPE_PROBE_TIMEOUT", PROBE_TIMEOUT)
    env_seconds("DATAPIPE_SCHEDULER_TIMEOUT", SCHEDULER_TIMEOUT)
    env_seconds("DATAPIPE_WORKER_TIMEOUT", WORKER_WAIT)
    env_seconds("DATAPIPE_REMOTE_LOCK_TTL", remote.LOCK_TTL)
    env_seconds("DATAPIPE_REMOTE_LOCK_SETTLE", remote.LOCK_SETTLE)


def _connect(scheduler: str) -> Client:
    from dask.distributed import Client

    wait = env_seconds("DATAPIPE_SCHEDULER_TIMEOUT", SCHEDULER_TIMEOUT)
    # distributed bounds the connection by the timeout but not its handshake: something else that listens at the
    # address (a web server, a socket that never answers) would be waited on for ever
    thread, made = _in_thread(lambda: Client(scheduler, timeout=f"{float(wait):g}s"), "datapipe-connect")
    thread.join(min(float(wait) + 10, MAX_SECONDS))
    if made and isinstance(made[0], BaseException):
        # the Client whose constructor failed lingers, held by the error's frames and a reference cycle: collected
        # at the interpreter's exit only, it waited 40 s there to close and printed a traceback, after the build had
        # said why it ended. Its error is raised as one line below, without those frames.
        seen: BaseException | None = made[0]
        for _ in range(16):  # a chain of causes, never a loop without end
            if seen is None:
                break
            seen.__traceback__ = None
            seen = seen.__cause__ or seen.__context__
        gc.collect()
    if not made:
        raise OutputError(f"the Dask scheduler at {scheduler} did not answer within {float(wait) + 10:g} s "
                          "(DATAPIPE_SCHEDULER_TIMEOUT + 10): something that is not a Dask scheduler may listen "
                          "there; check the address")
    try:
        if isinstance(made[0], BaseException):
            raise made[0]
        return made[0]
    except ValueError as exc:  # refused before any connection is tried
        raise OutputError(f"--scheduler {scheduler} is not a Dask scheduler address ({exc}); give one such as "
                          "tcp://head:8786") from None
    except TypeError as exc:  # tls:// without Dask's TLS configuration, ucx:// without its package: distributed's own
        scheme = scheduler.split("://", 1)[0] if "://" in scheduler else "tcp"
        need = ("the cluster's TLS settings in Dask's configuration (distributed.comm.tls.*)" if scheme == "tls" else
                f"distributed's support for {scheme}:// installed here (ucx: pip install distributed-ucxx)")
        raise OutputError(f"--scheduler {scheduler}: {one_line(exc)}; a {scheme}:// scheduler needs {need}") from None
    except OSError as exc:
        raise OutputError(f"cannot reach the Dask scheduler at {scheduler} within {wait} s "
                          f"(DATAPIPE_SCHEDULER_TIMEOUT): {exc}; start it, or check the address") from None


def _pre_spawn_environ() -> dict[str, str]:
    """The environment of our LocalCluster's worker processes: Dask's pre-spawn environment and WORKER_ENV, which
    glibc reads when a process starts (setting them as ordinary worker env would come too late to have any effect)."""
    import dask
    import distributed  # noqa: F401 - its configuration's defaults, the pre-spawn environment among them

    return {**dask.config.get("distributed.nanny.pre-spawn-environ", {}), **WORKER_ENV}


def _local_cluster(n_workers: int) -> LocalCluster:
    import dask
    from dask.distributed import LocalCluster

    with dask.config.set({"distributed.nanny.pre-spawn-environ": _pre_spawn_environ()}), warnings.catch_warnings():
        # Another cluster's dashboard on 8787 (a second build, a notebook): this one takes a free port, which
        # the build's line names; distributed's four-line warning about it says nothing more.
        warnings.filterwarnings("ignore", message=r"Port \d+ is already in use", category=UserWarning)
        # silence_logs: the workers log nothing below CRITICAL on the user's terminal. A task that fails logs
        # "Compute Failed" with its traceback at ERROR; the build's own line already says what failed.
        return LocalCluster(n_workers=n_workers, threads_per_worker=1, processes=True, dashboard_address=":8787",
                            silence_logs=logging.CRITICAL)


def _ready_workers(client: Client, cluster: Cluster) -> tuple[int, str | None]:
    """Warm every worker up and say where the build runs: the number of workers and the dashboard."""
    cluster_at = cluster.scheduler or "the LocalCluster"
    patience = env_seconds("DATAPIPE_WORKER_TIMEOUT", WORKER_WAIT)
    try:
        # imports on every worker before the clock for shards starts; a worker stopped or frozen never answers
        versions = client.sync(client._run, _warm_up_report, callback_timeout=patience)
    except DatapipeError:
        raise
    except TimeoutError:
        _quiet_dask()
        raise BuildError(f"the Dask workers of {cluster_at} did not load datapipe's decoders within {patience:g} s "
                         "(DATAPIPE_WORKER_TIMEOUT): a worker may be stopped, frozen or starved of memory; fix or "
                         "restart the workers, or build with --scheduler sync") from None
    except Exception as exc:  # noqa: BLE001 - whatever a worker raised, said in one line
        _quiet_dask()
        if type(exc).__name__ in _SCHEDULER_LOST:
            raise BuildError(f"the build lost its Dask scheduler at {cluster_at} ({type(exc).__name__}: "
                             f"{one_line(exc)}) before any shard; rerun once it is up") from None
        if "_warm_up_report" in str(exc):  # a worker's datapipe has no such function: an older one
            raise BuildError(_other_version(f"(one of {cluster_at})", None, _identity())) from None
        raise BuildError(f"the Dask workers of {cluster_at} could not load datapipe's decoders ({type(exc).__name__}: "
                         f"{one_line(exc) or 'no message'}): every worker needs datapipe and its libraries installed "
                         "(the same version as here) and memory to load them (ulimit -v); fix the workers, or build "
                         "with --scheduler sync") from None
    mine = _what_runs()
    for address, found in versions.items():
        if isinstance(found, dict) and found.get("problem"):
            raise BuildError(f"Dask worker {address} of {cluster_at} {found['problem']}")
    other = {address: found for address, found in versions.items()
             if not isinstance(found, dict) or found.get("datapipe") != mine["datapipe"]}
    if other:
        address, found = next(iter(other.items()))
        more = f" (and {len(other) - 1} more)" if len(other) > 1 else ""
        theirs = found.get("datapipe") if isinstance(found, dict) else found  # (an older datapipe's: its version)
        raise BuildError(_other_version(f"{address} of {cluster_at}{more}", theirs, mine["datapipe"]))
    for library in ("distributed", "dask"):
        skewed = {address: found[library] for address, found in versions.items() if found.get(library) != mine[library]}
        if skewed:
            address, theirs = next(iter(skewed.items()))
            raise BuildError(f"Dask worker {address} of {cluster_at} runs {library} {theirs}, this process {mine[library]}: "
                             f"its tasks would not arrive whole; install {library} {mine[library]} on every worker (or "
                             "the workers' here) and rerun")
    info = client.scheduler_info()
    n_workers = len(info["workers"])
    dashboard = _dashboard(client)
    where = dashboard or "unavailable (the dashboard needs bokeh>=3.1: pip install 'bokeh>=3.1')"
    if dashboard and "dashboard" not in (info.get("services") or {}):  # `dask scheduler --no-dashboard`
        dashboard, where = None, "none (the scheduler runs without one)"
    log.info(f"datapipe build: {plural(n_workers, 'Dask worker')} at "
             f"{info.get('address', cluster.scheduler or 'a LocalCluster')}; dashboard: {where}")
    return n_workers, dashboard


# ----------------------------------------------------------------------------- the tasks


def _map_shards(client: Client, plans: list[dict], kwargs: dict, *, progress: bool,
                where: str) -> tuple[list[dict], int]:
    """One build_shard task per plan; their records in plan order, and the most workers the cluster had meanwhile
    (workers may join mid-build). A task that kills its worker is handled by :class:`_Isolation`; a cluster that
    can no longer build the shards ends the build (:class:`_Watch`)."""
    import dask
    from dask.distributed import as_completed

    kwargs = {**kwargs, "client_version": _identity()}  # a worker that joins mid-build is checked by its task
    out_tag = hashlib.sha256(kwargs["output"].encode()).hexdigest()[:8]  # two builds at once stay apart
    keys = [f"{SHARD_TASK}{out_tag}-{p['shard']:06d}-{kwargs['config_hash']}-{p['inputs_hash']}" for p in plans]
    records: dict[int, dict] = {}
    with _progress_bar(len(plans), progress) as bar:
        # The plans hold each file's path and stat (about 20 bytes a file and its name): a million files make a
        # graph past distributed's 10 MB warning, whose advice (load the data with Dask) does not apply. Data in
        # the graph would still be warned of: the threshold grows by 256 bytes a file only.
        configured = dask.utils.parse_bytes(dask.config.get("distributed.admin.large-graph-warning-threshold", "10MB"))
        threshold = max(configured, 256 * sum(len(p["paths"]) for p in plans))
        with dask.config.set({"distributed.admin.large-graph-warning-threshold": threshold}):
            futures = client.map(build_shard, plans, key=keys, pure=False, **kwargs)
        isolation = _Isolation(client, kwargs, dict(zip(keys, plans, strict=True)))
        watch = _Watch(client, where)
        pending = as_completed(futures)
        while not pending.is_empty():
            if not pending.has_ready():
                watch.check(len(records), len(plans))  # a cluster that can no longer build them ends the build
                time.sleep(0.02)
                continue
            for future in pending.next_batch(block=False):
                try:
                    rec = _fetch(future, lambda key: watch.check(len(records), len(plans), [key]))
                except Exception as exc:
                    if type(exc).__name__ in _SCHEDULER_LOST:
                        raise BuildError(f"the build lost its Dask scheduler ({type(exc).__name__}: {one_line(exc)}); "
                                         f"{_shards_kept(len(records), len(plans))}") from None
                    if isinstance(exc, TypeError) and "build_shard() got an unexpected keyword argument" in str(exc):
                        # a datapipe older than one of the task's arguments (the check among them)
                        raise BuildError(_other_version(f"(one of {where})", None, kwargs["client_version"])) from None
                    if type(exc).__name__ != "KilledWorker":
                        raise
                    pending.add(isolation.retry(future.key))
                    continue
                records[rec["shard"]] = rec
                bar.update()
    return [records[p["shard"]] for p in plans], watch.most


def _fetch(future: Future, check: Callable[[str], None]) -> Any:
    """The result of a finished task, fetched from the worker that holds it (through the scheduler): a worker
    busy in a long decode that holds its interpreter answers late, a frozen one never. The fetch runs in a thread
    of its own, never cancelled (a cancelled fetch can make the scheduler forget the result and run the task
    again), while ``check(key)`` runs every half second and raises when the holder has been silent too long."""
    thread, got = _in_thread(future.result, "datapipe-fetch-record")
    while True:
        thread.join(0.5)
        if got:
            if isinstance(got[0], BaseException):
                raise got[0]
            return got[0]
        check(str(future.key))


def _in_thread(call: Callable[[], Any], name: str) -> tuple[threading.Thread, list[Any]]:
    """``call()`` in a daemon thread of its own, never waited on at exit: the thread, and a list that receives its
    result, or the exception it raised."""
    got: list[Any] = []

    def run() -> None:
        try:
            got.append(call())
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            got.append(exc)

    thread = threading.Thread(target=run, name=name, daemon=True)
    try:
        thread.start()
    except RuntimeError as exc:
        raise (thread_start_failed(exc) or exc) from None
    return thread, got


def _executing(info: dict) -> int:
    """How many tasks a worker executes now, as its last heartbeat said (0 when it did not say)."""
    counts = (info.get("metrics") or {}).get("task_counts") or {}
    try:
        return int(counts.get("executing", 0))
    except (TypeError, ValueError):
        return 0


def _shards_kept(built: int, total: int) -> str:
    return (f"the shards finished so far are kept ({built} of {total} reported): rerun once the cluster is up to "
            "resume")


class _Watch:
    """While shards are pending, checks (every ``EVERY`` seconds) that the cluster can still build them, so that
    a build never waits on a cluster without end: a scheduler that does not answer within
    DATAPIPE_SCHEDULER_TIMEOUT (stopped, frozen, overloaded) ends the build; so does, after
    DATAPIPE_WORKER_TIMEOUT, a cluster with no worker (all lost and none restarted, or none ever joined), with
    every worker paused (over its memory limit) or silent, or a worker building a shard that has not been heard
    from (its heartbeat to the scheduler stopped: a process stopped or frozen). Ages are taken on this process's
    clock, from when a worker's last heartbeat was first seen, never from the scheduler's clock."""

    EVERY = 2.0

    def __init__(self, client: Client, where: str) -> None:
        self.client, self.where = client, where
        self.answer = env_seconds("DATAPIPE_SCHEDULER_TIMEOUT", SCHEDULER_TIMEOUT)
        self.patience = env_seconds("DATAPIPE_WORKER_TIMEOUT", WORKER_WAIT)
        self.next = time.monotonic() + self.EVERY
        self.heard: dict[str, tuple[float, float]] = {}  # worker -> (its last heartbeat's time, when we first saw it)
        self.stuck: tuple[str, float] | None = None  # (why no worker can build, since when)
        self.most = 0  # the most workers seen at once
        self.built = self.total = 0  # shards built so far, of how many (for the messages)

    def _ask(self, handler: str, **kwargs: Any) -> Any:
        """The scheduler's answer to ``handler``, or BuildError when none comes within DATAPIPE_SCHEDULER_TIMEOUT."""
        scheduler = self.client.scheduler
        assert scheduler is not None  # a client connected to its scheduler
        try:
            return self.client.sync(getattr(scheduler, handler), callback_timeout=self.answer, **kwargs)
        except TimeoutError:
            _quiet_dask()
            raise BuildError(f"the Dask scheduler at {self.where} stopped answering (nothing within {self.answer:g} s, "
                             f"DATAPIPE_SCHEDULER_TIMEOUT): it may be stopped, frozen or overloaded; "
                             f"{_shards_kept(self.built, self.total)}") from None

    def check(self, built: int, total: int, unfetched: Sequence[str] = ()) -> None:
        """Raise BuildError when the cluster can no longer build the pending shards, or a worker holding the record of
        a finished one (``unfetched``: their task keys) has been silent for DATAPIPE_WORKER_TIMEOUT."""
        if built != self.built:  # a shard was built since: whatever the cluster's state, it still builds
            self.stuck = None
        self.built, self.total = built, total
        now = time.monotonic()
        if now < self.next:
            return
        self.next = now + self.EVERY
        try:
            workers = self._ask("identity", n_workers=-1)["workers"]
            processing = self._ask("processing", workers=None)
        except DatapipeError:
            raise
        except Exception as exc:
            if type(exc).__name__ in _SCHEDULER_LOST:
                return  # the task futures say so next
            raise
        now = time.monotonic()
        self.most = max(self.most, len(workers))
        for address, info in workers.items():
            seen = float(info.get("last_seen", 0.0))
            if self.heard.get(address, (None, 0.0))[0] != seen:
                self.heard[address] = (seen, now)
        silent = {a for a in workers if now - self.heard[a][1] >= self.patience}
        if unfetched and silent:
            holders = self._ask("who_has", keys=list(unfetched))
            for key in unfetched:
                held = [a for a in holders.get(key) or () if a in silent]
                if held and len(held) == len(holders[key]):
                    _quiet_dask()
                    raise BuildError(f"the record of a finished shard did not arrive from Dask worker {held[0]} of "
                                     f"{self.where}, not heard from for {now - self.heard[held[0]][1]:.0f} s "
                                     f"(DATAPIPE_WORKER_TIMEOUT: {self.patience:g} s): it may be stopped or frozen; "
                                     f"{_shards_kept(built, total)}")
        with_shards = {a for a, keys in processing.items() if any(str(k).startswith(SHARD_TASK) for k in keys)}
        # a paused worker still runs the task it executes (its heartbeat says how many), none of those queued on it
        building = {a for a in with_shards if _executing(workers.get(a, {})) > 0}
        for address in sorted(with_shards & silent):
            _quiet_dask()
            raise BuildError(f"Dask worker {address} of {self.where} has not been heard from for "
                             f"{now - self.heard[address][1]:.0f} s (DATAPIPE_WORKER_TIMEOUT: {self.patience:g} s) "
                             f"while building a shard: it may be stopped or frozen; {_shards_kept(built, total)}")
        paused = sorted(a for a, info in workers.items() if info.get("status") == "paused" and a not in building)
        why: tuple[str, str] | None = None  # (what the cluster has, what it means or what to do)
        if not workers:
            why = "no workers", "all were lost and none restarted, or none joined"
        elif not with_shards and not unfetched and built < total:
            why = ("no worker running any of the build's shards", f"{total - built} are left, and the scheduler gives "
                   "them to none (a task whose result or error could not reach it?)")
        elif set(paused) | silent == set(workers):
            limits = {a: workers[a].get("memory_limit") for a in paused}
            named = ", ".join(f"{a} (memory limit {int(m) / 2**20:,.0f} MiB)" if m else a for a, m in limits.items())
            why = (("only paused workers", f"each over its memory limit: {named}; give them more memory "
                    "(dask worker --memory-limit)") if not silent else
                   ("no worker that answers it", "each is paused for memory or silent (stopped or frozen)"))
        if why is None:
            self.stuck = None
            return
        if self.stuck is None or self.stuck[0] != why[0]:
            self.stuck = (why[0], now)
        if now - self.stuck[1] >= self.patience:
            _quiet_dask()
            raise BuildError(f"the Dask scheduler at {self.where} has had {why[0]} for {now - self.stuck[1]:.0f} s "
                             f"(DATAPIPE_WORKER_TIMEOUT: {self.patience:g} s): {why[1]}; {_shards_kept(built, total)}")


# What a task's future raises when the client's connection to the scheduler is gone (the scheduler stopped or
# was killed): the build cannot go on, and nothing is wrong with its shards.
_SCHEDULER_LOST = frozenset({"FutureCancelledError", "CancelledError", "CommClosedError", "StreamClosedError"})


class _Isolation:
    """What happens to a shard whose task killed its worker (out of memory, a decoder crash, a file
    that never finishes): it is built again with every file first decoded in a separate process, so
    that the culprit is quarantined; if that task kills its worker too, the build fails."""

    def __init__(self, client: Client, kwargs: dict, plans: dict[str, dict]) -> None:
        self.client = client
        self.kwargs = kwargs
        self.tasks = {key: (plan, False) for key, plan in plans.items()}  # key -> (plan, isolated)

    def retry(self, key: str) -> Future:
        """The future of the isolated rebuild of the shard whose task ``key`` killed its worker;
        BuildError when that task was already the isolated one."""
        plan, isolated = self.tasks[key]
        first, last = message_text(plan["paths"][0]), message_text(plan["paths"][-1])
        files = first if first == last else f"one of its {len(plan['paths'])} files, {first} … {last}"
        if isolated:
            raise BuildError(
                f"shard {plan['shard']} killed its Dask workers repeatedly while decoding {files}, also with every file "
                "checked in a separate process first: out of memory, a decoder crash, or a file over "
                f"DATAPIPE_FILE_TIMEOUT ({file_timeout():g} s; a worker ended by it says so in its log). Finished shards "
                "are kept: remove or fix the offending file (a lower --max-pixels catches huge images, a higher "
                "DATAPIPE_FILE_TIMEOUT slow ones) and rerun to resume.") from None
        log.warning(f"datapipe build: shard {plan['shard']} killed its worker; decoding {files} one by one in "
                    "separate processes to quarantine the culprit")
        retry_key = f"{key}-isolated"
        future = self.client.submit(build_shard, plan, key=retry_key, pure=False, isolate=True, **self.kwargs)
        self.tasks[retry_key] = (plan, True)
        return future


def _close(client: Client, cluster: LocalCluster | None) -> None:
    """Close the client and our LocalCluster; after an interrupted close, end its worker processes
    that are still running (none may outlive the build)."""
    procs = []
    if cluster is not None:
        for nanny in list(getattr(cluster, "workers", {}).values()):
            proc = getattr(getattr(getattr(nanny, "process", None), "process", None), "_process", None)
            if proc is not None:  # the multiprocessing.Process of the worker
                procs.append(proc)
    try:
        client.close()
        if cluster is not None:
            cluster.close(timeout=15)
    finally:
        for proc in procs:
            with contextlib.suppress(Exception):
                if proc.is_alive():
                    proc.kill()


_DASK_LOGGERS = ("distributed", "tornado", "asyncio", "bokeh")
_dask_quieted: contextvars.ContextVar[list[bool] | None] = contextvars.ContextVar("datapipe_dask_quieted", default=None)


def _quiet_dask() -> None:
    """Silence Dask's loggers until the build's Dask client is closed (_dask_client): after Ctrl-C or an error,
    closing the cluster logs tracebacks of the tasks it cancels, which would bury the build's one line saying
    what happened. Their levels are put back then."""
    quieted = _dask_quieted.get()
    if quieted is not None and not quieted:
        quieted.append(True)
        _Silenced.hold(_DASK_LOGGERS)


def _dashboard(client: Client) -> str | None:
    try:
        import bokeh  # noqa: F401
    except ImportError:
        return None
    try:
        return client.dashboard_link
    except Exception:  # noqa: BLE001 - a scheduler without a dashboard
        return None


def _finish(out: Path | remote.RemoteOutput, listing: Listing, plans: list[dict], records: list[dict], config: dict, chash: str,
            max_bad_fraction: float, *, seconds: dict[str, float], workers: int, dashboard: str | None, t0: float,
            build_id: str, read_only: Output | remote.RemoteOutput | None = None) -> BuildReport:
    """Check the quarantine budget, then write what changed of the cache's index files, manifest (last)
    and report. With ``read_only`` (a local folder this build may not write, or an output another build
    holds), nothing is written: the report when everything already is as it would be written, else
    ``read_only.cannot_write()``."""
    quarantined = list(listing.dropped)
    for rec in records:
        quarantined.extend(rec.get("quarantined", []))
    total = len(listing) + len(listing.dropped)
    built = [r for r in records if not r.get("skipped")]
    n_samples = sum(r["count"] for r in records)
    on_disk = sum(r["nbytes"] for r in records)
    report = BuildReport(
        output=out.loc.url if isinstance(out, remote.RemoteOutput) else str(out),
        status="ok", num_samples=n_samples, scanned=total, quarantined=quarantined,
        ignored=len(listing.ignored), shards_total=len(plans), shards_built=len(built),
        shards_skipped=len(records) - len(built), workers=workers, dashboard=dashboard, config=config,
        bytes_on_disk=on_disk, bytes_per_sample=on_disk / max(n_samples, 1),
        peak_worker_rss_mb=max((r.get("peak_rss_mb", 0.0) for r in built), default=0.0), build_id=build_id,
        aspect_capped=sum(int(r.get("aspect_capped", 0)) for r in records),
        outside_classes=list(listing.outside_classes), empty_classes=_empty_classes(listing, records),
    )
    built_images = sum(r["count"] + len(r["quarantined"]) for r in built)
    report.page_faults_per_image = sum(r.get("page_faults", 0) for r in built) / max(built_images, 1)
    report.images_per_second = built_images / seconds["shards"] if built and seconds["shards"] > 0 else 0.0
    lost = [q for q in quarantined if not repeats_a_row(q)]  # a row repeated exactly loses nothing: its file is used
    files = total - (len(quarantined) - len(lost))
    bad_fraction = len(lost) / max(files, 1)
    if bad_fraction > max_bad_fraction:
        report.status = "failed"
        report.seconds = {**seconds, "total": time.perf_counter() - t0}
        if read_only is None:
            _write_report(out, report)
        first = "; ".join(f"{printable(q['path'])} ({printable(str(q.get('error', 'unknown')))}): {printable(q['reason'])}"
                          for q in lost[:3])
        raise TooManyBadFilesError(
            f"{len(lost)} of {files} files ({bad_fraction:.1%}) could not be used, over "
            f"--max-bad-fraction {max_bad_fraction:g}. First: {first}. Every file and its reason "
            f"is in {_report_location(out)}; finished shards are kept, and a rerun reads again every file "
            "that changed or could not be read, timed out or crashed its decoder, so fixing the files or "
            "raising the budget and rerunning resumes the build.")
    t_fin = time.perf_counter()
    documents = _index_documents(listing, records, config, chash, build_id=build_id)
    if read_only is not None:
        report.seconds = {**seconds, "total": time.perf_counter() - t0}
        if not (_report_current(out, report) and _index_current(out, documents)):
            raise read_only.cannot_write()
        log.info(f"datapipe build: {report.summary()} (up to date; nothing written: {read_only.why_read_only()})")
        return report
    report.index_written = not _index_current(out, documents)

    def report_first() -> None:
        """The report, before the index: the manifest is written last. A rerun with nothing to do writes nothing,
        and keeps the report of the build that did the work; so does one that only writes an index file again (a
        labels.npy deleted since): what the report says of the cache holds."""
        seconds["finalize"] = time.perf_counter() - t_fin
        report.seconds = {**seconds, "total": time.perf_counter() - t0}
        if built or not _report_current(out, report):
            _write_report(out, report)

    if isinstance(out, remote.RemoteOutput):
        _publish_remote(out, plans, documents, build_id=build_id, report_first=report_first)
    else:
        # Shards left from an earlier, larger source are this build's and no longer part of the cache; so
        # are temporary folders of attempts that died with a lost worker. Nothing else is touched.
        remove_shards(out, build_id, keep={shard_name(p["shard"]) for p in plans})
        report_first()
        _write_index(out, documents)
    log.info("datapipe build: " + report.summary())
    return report


def _empty_classes(listing: Listing, records: list[dict]) -> list[str]:
    """The classes that no sample of the cache carries (a class folder without images, or with only bad ones)."""
    label_of = dict(zip(listing.paths, listing.labels, strict=True))
    present = {label_of[p] for r in records for p in r["paths"] if p in label_of}
    return [name for i, name in enumerate(listing.classes) if i not in present]


def _index_documents(listing: Listing, records: list[dict], config: dict, chash: str, *,
                     build_id: str) -> dict[str, bytes]:
    """The bytes of labels.npy, paths.json and manifest.json for these shard records, in the order they are
    written (the manifest last)."""
    label_of = dict(zip(listing.paths, listing.labels, strict=True))  # a shard's samples are its plan's surviving files
    paths = [p for r in records for p in r["paths"]]
    labels = io.BytesIO()
    np.save(labels, np.fromiter((label_of[p] for p in paths), np.int64, count=len(paths)))
    documents = {mf.LABELS: labels.getvalue(), mf.PATHS: json.dumps(paths, ensure_ascii=False).encode("utf-8")}
    shards, first = [], 0
    for r in records:
        shards.append(ShardRecord(name=shard_name(r["shard"]), count=r["count"], first=first, nbytes=r["nbytes"],
                                  crc32c=r["crc32c"], inputs_hash=r["inputs_hash"],
                                  index_crc32c=r.get("index_crc32c", "")))
        first += r["count"]
    manifest = Manifest(
        config=config, config_hash=chash, num_samples=first, classes=tuple(listing.classes),
        source=SourceRecord(root=listing.location, kind=listing.kind),
        files={key: FileRecord(name=name, crc32c=f"{crc32c(documents[name]):08x}")
               for key, name in (("labels", mf.LABELS), ("paths", mf.PATHS))},
        shards=tuple(shards), build_id=build_id,
    )
    doc = manifest.to_json()
    parse_manifest(doc, Path(mf.MANIFEST))  # the writer never writes what the reader refuses
    documents[mf.MANIFEST] = json.dumps(doc, indent=1, ensure_ascii=False).encode("utf-8")
    return documents


def _write_index(out: Path, documents: dict[str, bytes]) -> bool:
    """Write labels.npy, paths.json, then manifest.json (``documents``: see :func:`_index_documents`), each only
    where it differs from the file there (an unchanged file keeps its inode, so a reader that has it open reads
    on); whether any was written."""
    written = False
    for name, data in documents.items():
        if holds(out / name, data):
            continue
        atomic_write_bytes(out / name, data)  # fsynced, then renamed over the old one
        written = True
    return written


# What report.json says of the run rather than of the cache: a rerun with nothing to do keeps the report of
# the build that did the work, when it says the same of the cache.
_RUN_FIELDS = frozenset({"output", "shards_built", "shards_skipped", "workers", "dashboard", "seconds",
                         "images_per_second", "page_faults_per_image", "peak_worker_rss_mb", "index_written"})


def _report_doc(out: Path | remote.RemoteOutput) -> Any:
    """The output's report.json document, or None where it has none that reads."""
    try:
        return remote.read_doc(out.loc, mf.REPORT) if isinstance(out, remote.RemoteOutput) else read_json(out / mf.REPORT)
    except CacheError:
        return None


def _report_failed(out: Path | remote.RemoteOutput) -> bool:
    """Whether the output's report.json says its last build failed (over its budget of bad files, with the
    manifest of the build before it kept): that build did not finish, and the next reads its files again."""
    doc = _report_doc(out)
    return isinstance(doc, dict) and doc.get("status") == "failed"


def _report_current(out: Path | remote.RemoteOutput, report: BuildReport) -> bool:
    """Whether the output's report.json is a finished build's report saying of the cache what ``report`` does."""
    doc = _report_doc(out)
    want = json.loads(json.dumps(asdict(report), ensure_ascii=False))  # as it would read back
    return isinstance(doc, dict) and set(doc) == set(want) and all(
        doc[key] == value for key, value in want.items() if key not in _RUN_FIELDS)


def _write_report(out: Path | remote.RemoteOutput, report: BuildReport) -> None:
    text = json.dumps(asdict(report), indent=1, ensure_ascii=False)
    if isinstance(out, remote.RemoteOutput):
        remote.write_bytes(out.loc, mf.REPORT, text.encode())
    else:
        atomic_write_text(out / mf.REPORT, text)


def _report_location(out: Path | remote.RemoteOutput) -> str:
    return out.loc.url_of(mf.REPORT) if isinstance(out, remote.RemoteOutput) else str(out / mf.REPORT)

