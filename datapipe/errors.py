"""One hierarchy for every error datapipe raises, each with the matching built-in base."""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Collection, Iterable, Mapping
from typing import Any

from .text import message_text, printable


def one_line(exc: BaseException, limit: int = 300) -> str:
    """An exception's message on one line of at most ``limit`` characters (its type's name when it has none),
    for an error that quotes what a library raised."""
    return (" ".join(str(exc).split()) or type(exc).__name__)[:limit]


class DatapipeError(Exception):
    """Base class of every error raised by datapipe.

    Its text is one line that any output can carry, whatever the names it quotes hold: control characters
    (newline, ESC), line separators and bidirectional controls escaped, and a name that is not UTF-8 shown by
    its bytes (``\\xff``), never as the lone surrogates that a ``print`` of it would fail on.
    """

    def __str__(self) -> str:
        return message_text(super().__str__())

    def line(self) -> str:
        """The text for the command line's own error line: control characters escaped as in ``str()``, but a name
        that is not UTF-8 kept as the lone surrogates it decoded to, which the command line's streams write back
        as its bytes (see :func:`datapipe.text.plain_where_unencodable`): the name as the user's terminal shows it."""
        return printable(super().__str__())


class SourceError(DatapipeError, FileNotFoundError):
    """The source to build from is missing, empty or unreadable."""


class OutputError(DatapipeError, OSError):
    """The output folder cannot be created or written."""


class OutputBusyError(OutputError):
    """Another build holds the output folder's lock."""


class ConfigMismatchError(DatapipeError, ValueError):
    """An output folder already holds a build made with a different configuration."""


class CacheError(DatapipeError, ValueError):
    """A cache is missing, incomplete, of an unknown format version, or damaged."""


class UnreadableFileError(CacheError):
    """A file that is there but cannot be read (no permission, an I/O error): never taken for a missing,
    damaged or foreign one."""


# The longest wait a timeout may ask for: the system's waits (threading, time.sleep) take no longer (292 years).
MAX_SECONDS = float(threading.TIMEOUT_MAX)


def env_seconds(name: str, default: float) -> float:
    """The seconds environment variable ``name`` gives, ``default`` when it is unset or empty.

    Raises:
        ArgumentError: it is set to anything but a positive number up to :data:`MAX_SECONDS` (one line naming it).
    """
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value <= MAX_SECONDS:
        raise ArgumentError(f"{name} must be a positive number of seconds, at most {MAX_SECONDS:,.0f}, got {text!r}; "
                            f"unset it for the default ({default:g} s)")
    return value


PERMISSION_ADVICE = "check its permissions and those of the folders above it, and rerun"


def refused(exc: BaseException) -> bool:
    """Whether ``exc`` is a file system's refusal to let this user look (no permission), not damage."""
    return isinstance(exc, OSError) and exc.errno in (errno.EACCES, errno.EPERM)


def refused_error(what: str, exc: BaseException) -> UnreadableFileError | None:
    """The UnreadableFileError of ``what`` (a path, or 'shard NAME (path)') when ``exc`` is a refusal to read it
    (:func:`refused`), else None: the caller's own error follows."""
    if not refused(exc):
        return None
    return UnreadableFileError(f"{what} cannot be read ({getattr(exc, 'strerror', None) or exc}); {PERMISSION_ADVICE}")


class CorruptShardError(CacheError):
    """A shard's size or checksum does not match the manifest."""


class DecodeError(DatapipeError, ValueError):
    """One input file cannot be turned into a sample; the message is the quarantine reason and
    ``kind`` its class (one of :data:`QUARANTINE_KINDS`)."""

    def __init__(self, message: str, kind: str = "corrupt") -> None:
        super().__init__(message)
        self.kind = kind


# The classes of a quarantined file (the ``error`` of each entry in report.json):
QUARANTINE_KINDS = {
    "empty": "a 0-byte file",
    "not-an-image": "content that is no image format datapipe reads",
    "corrupt": "an image that does not decode fully (truncated or damaged data, a bad header)",
    "unsupported": "a valid image of a kind no decoder here reads (a 12- or 16-bit or a hierarchical JPEG, a TIFF "
                   "pixel layout Pillow has no mode for)",
    "too-large": "a header over max_pixels (a decompression bomb), checked before decoding",
    "unreadable": "the file cannot be opened or read (missing, permissions, I/O error), or was not the file the scan "
                  "saw when read (gone, or changed, while the build ran)",
    "decoder-crash": "decoding it killed its process (found after it killed a build worker), or ran out of memory",
    "timeout": "decoding it did not finish in time (found after its shard killed a build worker)",
    "decoder-error": "any other error the decoder raised",
    "duplicate": "a path a list source names twice (the first row is kept)",
}


class BuildError(DatapipeError, RuntimeError):
    """A shard could not be built (for example, its task kept killing the Dask workers)."""


class TooManyBadFilesError(DatapipeError, RuntimeError):
    """More files were quarantined than ``max_bad_fraction`` allows."""


class StateError(DatapipeError, ValueError):
    """A saved loader state cannot be restored (unknown version, other dataset, other batch size)."""


class RankMismatchError(DatapipeError, ValueError):
    """The ranks of a distributed run disagree on a dataset (its cache, seed, batch layout or position),
    or a dataset's rank and world size are not torch.distributed's; the message names both values."""


class IterationSupersededError(DatapipeError, RuntimeError):
    """An iterator of a DeviceLoader was asked for a batch after a newer iteration began (or after
    set_epoch/load_state_dict changed the position it reads): only the newest iteration runs."""


class RepeatedEpochWarning(UserWarning):
    """A shuffled epoch that the loop received whole began again without ``set_epoch``: the same order
    as before (every epoch of a loop that never calls ``set_epoch`` is epoch 0)."""


class ResumeWarning(UserWarning):
    """A saved loader state that is not resumed: torchdata's StatefulDataLoader handed a worker the state of an
    unfinished epoch earlier than the one the dataset is set to, whose epoch is then read whole."""


class ClassListWarning(UserWarning):
    """Two datasets opened in one process number their classes otherwise: the class list of one is within the
    other's, at other labels (a validation set built without ``--classes-from`` that lacks a class, or a
    training set rebuilt with another class list since). If one is the other's validation set, its labels are
    wrong for a model trained on the other."""


class ArgumentError(DatapipeError, ValueError):
    """A loader or bench argument has the wrong type or is out of range (the message names it)."""


def quarantine_counts(entries: Iterable[Mapping[str, Any]]) -> dict[str, int]:
    """Quarantine entries (``{"path", "error", "reason"}``) counted by class, most first."""
    counts: dict[str, int] = {}
    for q in entries:
        kind = q.get("error", "unknown")
        counts[kind] = counts.get(kind, 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))


def describe_quarantine(entries: Collection[Mapping[str, Any]]) -> str:
    """'6 quarantined (2 corrupt, 1 empty, ...)', or '0 quarantined'."""
    kinds = ", ".join(f"{n} {printable(str(kind))}" for kind, n in quarantine_counts(entries).items())
    return f"{len(entries)} quarantined" + (f" ({kinds})" if kinds else "")


def unreadable(exc: OSError) -> dict[str, str]:
    """The quarantine class and reason of a file that cannot be opened or read."""
    return {"error": "unreadable", "reason": f"unreadable: {type(exc).__name__}: {exc.strerror or exc}"}


class MappedReadError(CorruptShardError):
    """A memory-mapped file shrank under a guarded read: the page at ``address`` is gone. The cache
    turns it into a CorruptShardError naming the shard."""

    def __init__(self, message: str, address: int = 0) -> None:
        super().__init__(message)
        self.address = address


class OutputWriteError(OutputError):
    """Writing the output failed part-way (the disk filled up, the folder turned read-only); what was
    finished is kept and a rerun resumes. The command exits with 1, not 2: the machine, not the call."""

    exit_code = 1


class MissingExtraError(DatapipeError, ImportError):
    """A command needs a library of an optional extra that is not installed (the message says which extra)."""


class RemoteStoreError(DatapipeError, OSError):
    """An object store did not answer: unreachable, stopped, or no data arrived for the timeout (the message
    names the object and says what to check)."""


class TooManyOpenFilesError(DatapipeError, RuntimeError):
    """The process (or the system) reached its limit of open files: nothing is wrong with the file named."""


def too_many_open_files(exc: OSError, path: str | os.PathLike) -> TooManyOpenFilesError | None:
    """The error for an ``exc`` of opening ``path`` that says the descriptor limit was reached (EMFILE, ENFILE),
    or None: reported as that, never as a damaged or missing file (whose advice would be to rebuild)."""
    if exc.errno == errno.ENFILE:
        return TooManyOpenFilesError(f"{path} cannot be opened: the system's limit of open files is reached "
                                     "(fs.file-max); nothing is wrong with the file. Close programs that hold many "
                                     "files, or raise the limit, and retry")
    if exc.errno != errno.EMFILE:
        return None
    try:
        import resource

        limit = f" ({resource.getrlimit(resource.RLIMIT_NOFILE)[0]:,}, `ulimit -n`)"
    except (ImportError, OSError, ValueError):
        limit = ""
    return TooManyOpenFilesError(f"{path} cannot be opened: this process has reached its limit of open files{limit}; "
                                 "nothing is wrong with the file. Raise the limit (`ulimit -n 65536` before starting, "
                                 "or resource.setrlimit) or let go of what holds files open (datasets no longer used)")


def soft_limits(*limits: tuple[str, str, str]) -> list[str]:
    """This process's soft limits that are set, of those named as (what, the ``resource`` module's RLIMIT_ name,
    unit), each as "what value unit"."""
    try:
        import resource
    except ImportError:
        return []
    shown = []
    for what, name, unit in limits:
        try:
            soft = resource.getrlimit(getattr(resource, name))[0]
        except (AttributeError, OSError, ValueError):
            continue
        if soft != resource.RLIM_INFINITY:
            shown.append(f"{what} {soft:,}{unit}")
    return shown


class OutOfThreadsError(DatapipeError, RuntimeError):
    """A thread could not be started: the process is short of memory (``ulimit -v``) or of threads. The command
    exits with 1: the machine, not the call."""

    exit_code = 1


def allocation_failed(exc: BaseException) -> bool:
    """Whether ``exc`` is an allocation that failed: MemoryError, or torch's RuntimeError for one (on the CPU,
    "DefaultCPUAllocator: can't allocate memory"; on CUDA, torch.cuda.OutOfMemoryError, "CUDA out of memory")."""
    if isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError":  # torch.cuda.OutOfMemoryError
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and ("can't allocate memory" in text or "CUDA out of memory" in text)


def thread_start_failed(exc: BaseException, what: str = "") -> OutOfThreadsError | None:
    """The error for ``exc``, raised by starting a thread (for ``what``), when it says no thread could be started
    (Python's RuntimeError "can't start new thread"), or None."""
    if not isinstance(exc, RuntimeError) or "can't start new thread" not in str(exc):
        return None
    limits = soft_limits(("virtual memory", "RLIMIT_AS", " bytes"), ("processes and threads", "RLIMIT_NPROC", ""))
    shown = f" (its limits: {', '.join(limits)})" if limits else ""
    return OutOfThreadsError(f"no thread could be started{f' for {what}' if what else ''} ({exc}): this process is "
                             f"short of memory or threads{shown}; raise the limit (ulimit -v, ulimit -u) or free "
                             "memory, and rerun")


FULL_DISK = frozenset({errno.ENOSPC, errno.EDQUOT})  # no space, or a quota reached
# no object store's client raises these (s3fs gives OSErrors no errno); EFBIG: a file past the process's size
# limit (`ulimit -f`) or the largest its file system holds
LOCAL_ONLY = FULL_DISK | {errno.EROFS, errno.EFBIG}
TOO_LARGE_ADVICE = ("a file there would pass this process's file size limit (`ulimit -f`) or the largest file its "
                    "file system holds: raise the limit (`ulimit -f unlimited`)")


def local_os_error(exc: BaseException) -> bool:
    """Whether ``exc`` is this machine's failure to write a local file — a full disk or quota, a read-only
    file system, a file size limit, or no permission on a local path — and not an object store's: no store client raises
    these with their errno (s3fs's PermissionError for a store's AccessDenied carries none, and no local
    path), so such an error must never be reported as the store's."""
    if not isinstance(exc, OSError) or isinstance(exc, DatapipeError):
        return False
    if exc.errno in LOCAL_ONLY:
        return True
    return (exc.errno in (errno.EACCES, errno.EPERM) and isinstance(exc.filename, str | os.PathLike)
            and os.path.isabs(exc.filename))


def check_bool(value: object, what: str, *, error: type[DatapipeError] = ArgumentError) -> bool:
    """``value`` (a Python or numpy bool) as a bool, else ``error`` naming ``what``: a string such as "false" is a
    true value, and a flag that can delete or skip work takes True or False only."""
    kind = type(value)
    if not (isinstance(value, bool) or (kind.__module__ == "numpy" and kind.__name__ in ("bool", "bool_"))):
        from .text import show

        raise error(f"{what} must be True or False, got {show(value)} ({kind.__name__})")
    return bool(value)


def check_path(value: object, what: str, *, error: type[DatapipeError] = ArgumentError) -> str:
    """``value`` (a str or os.PathLike naming a path) as text, else ``error`` naming ``what``: an empty one (an unset
    variable) would be the working folder, and a NUL ends a path for the system, which refuses it with a ValueError."""
    from .text import show

    text = os.fspath(value) if isinstance(value, (str, os.PathLike)) else None
    if not isinstance(text, str):
        raise error(f"{what} must be a path (a str or os.PathLike), got {show(value)} ({type(value).__name__})")
    if not text:
        raise error(f"{what} is empty (an unset variable?); give a path: \"\" would be the working folder")
    if "\x00" in text:
        raise error(f"{what} {show(text)} holds a NUL character, which no path can; give the path without it")
    local = text[len("file://"):] if text.startswith("file://") else None if "://" in text else text
    if local is not None:  # a URL's keys are the store's, of other limits
        try:
            sizes = [len(os.fsencode(part)) for part in local.split(os.sep)]
            whole = len(os.fsencode(local))
        except UnicodeEncodeError:  # a lone surrogate that is no undecodable byte: no file name holds it
            raise error(f"{what} {show(text)} holds a character no file name can (a lone surrogate); give the path as "
                        "the file system spells it") from None
        if max(sizes) > NAME_MAX or whole > PATH_MAX:
            what_is = f"a name of {max(sizes):,} bytes" if max(sizes) > NAME_MAX else f"{whole:,} bytes"
            raise error(f"{what} {show(text[:60] + '…')} holds {what_is}, longer than a file system takes "
                        f"({NAME_MAX} bytes a name, {PATH_MAX:,} a path); give a shorter path")
    return text


NAME_MAX, PATH_MAX = 255, 4095  # Linux's (and most file systems'): longer raises ENAMETOOLONG wherever it is used
