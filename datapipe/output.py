"""A build's output folder: one writer at a time, and nothing touched that datapipe cannot prove it wrote.

An output is datapipe's when its ``build.json`` carries the datapipe marker (format, version) and a
build id (32 hex digits, a fresh uuid4 per configuration). Every shard carries that id in its
``zarr.json`` attributes, the manifest and the report carry it too, so a rebuild (``--force``)
removes exactly the files of the earlier build: a shard without the id, or with another one, is not
datapipe's to delete. A folder that is not empty and holds no marker is refused, with or without
``--force``.

A build holds an exclusive ``flock`` on ``OUTPUT/.datapipe.lock`` (host and pid written in it) for
its whole run and removes the file when it ends; a second build into the same output fails at once
naming the holder. The kernel releases the lock when its process dies, so a build killed with
SIGKILL is resumed by a rerun (the file it leaves is locked anew).

A rerun that finds nothing to do writes nothing: ``build.json`` is rewritten only when its content would
change. In a folder the user cannot write (a shared dataset), the lock cannot be taken: :func:`prepare`
then hands the builder a read-only output, which it may only check, never write (see ``Output.read_only``).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import socket
import stat
import time
import uuid
from collections.abc import Collection, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import records
from .errors import (
    PERMISSION_ADVICE,
    BuildError,
    CacheError,
    ConfigMismatchError,
    DatapipeError,
    OutputBusyError,
    OutputError,
    OutputWriteError,
    UnreadableFileError,
)
from .files import OUTPUT_TEMPS, TMP_PREFIX, atomic_write_text, fsync_dir, holds, is_mount, remove_stale_temps
from .shards import GROUP_META, SHARDS_DIR, foreign_entries, remove_shard, shard_attributes
from .text import plural, show

LOCK_FILE = ".datapipe.lock"


def new_build_id() -> str:
    return uuid.uuid4().hex


# A lock found held is tried again for this long before the build gives up: a look at the lock by
# lock_holder (a shared lock taken and dropped at once) must not make a build fail as busy.
LOCK_PATIENCE_SECONDS = 0.2
NOT_WRITABLE = frozenset({errno.EACCES, errno.EPERM, errno.EROFS})


class OutputNotWritable(OutputError):
    """The output folder may not be written (no permission, a read-only file system)."""


def busy(out: Path, holder: str) -> OutputBusyError:
    return OutputBusyError(f"output {out} is being written by another datapipe build ({holder}); wait for it "
                           "to finish or stop it, or build into another folder")


class BuildLock:
    """An exclusive, non-blocking ``flock`` on the output's lock file, released on exit or process death."""

    def __init__(self, out: Path) -> None:
        self.path = out / LOCK_FILE
        self.fd: int | None = None
        self.created = False
        self.token = uuid.uuid4().hex  # this hold of the lock, written in the file: see still_held

    def acquire(self) -> None:
        """Take the lock. Raises OutputBusyError naming the holder, OutputNotWritable where the lock file
        cannot be created or opened for writing (no permission, a read-only file system), else OutputError."""
        self.created = not os.path.lexists(self.path)
        while True:
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.EISDIR):  # a link (never followed) or a folder at its name
                    what = "a symbolic link" if exc.errno == errno.ELOOP else "a folder"
                    raise OutputError(f"{self.path} is {what}, where a build keeps its lock file (a plain file it "
                                      "makes and removes); datapipe does not delete what it did not write: move it "
                                      "away and rerun") from None
                kind = OutputNotWritable if exc.errno in NOT_WRITABLE else OutputError
                raise kind(f"cannot write to output folder {self.path.parent}: {exc.strerror or exc}") from None
            if not _lock_within(fd, LOCK_PATIENCE_SECONDS):
                holder = _holder(fd)
                os.close(fd)
                raise busy(self.path.parent, holder) from None
            if _same_file(fd, self.path):
                break
            os.close(fd)  # the holder removed the file as we locked it: lock the current one
        self.fd = fd
        info = json.dumps({"host": socket.gethostname(), "pid": os.getpid(),
                           "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "token": self.token})
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, info.encode() + b"\n", 0)
        except OSError as exc:  # a full disk or quota, a file size limit: the lock file goes, as it came
            self.release()
            raise OutputWriteError(f"cannot write the lock file {self.path}: {exc.strerror or exc}; nothing was "
                                   "built: free space on its disk (or raise the file size limit, ulimit -f) and "
                                   "rerun") from None

    def release(self) -> None:
        """Remove the lock file, then unlock. A build that locked the removed file meanwhile sees that
        it is no longer the file at that name and locks the new one (see ``acquire``)."""
        if self.fd is None:
            return
        with contextlib.suppress(OSError):
            self.path.unlink(missing_ok=True)
        os.close(self.fd)  # closing the last descriptor releases the flock
        self.fd = None


def _lock_within(fd: int, seconds: float) -> bool:
    """Take the exclusive flock on ``fd``, trying again for ``seconds``; whether it was taken."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except OSError:
            if time.monotonic() >= deadline:
                return False
        time.sleep(0.01)


@contextlib.contextmanager
def _lock_probe(out: Path) -> Iterator[tuple[str, int]]:
    """The lock of ``out`` looked at without taking it: the lock file opened read-only (never created) and a
    shared lock tried on it at once, dropped when the block ends (a build starting at that moment waits it out,
    LOCK_PATIENCE_SECONDS). Yields the state and the descriptor (-1 without one): "missing", "unopenable" (it
    cannot be opened here, or is no regular file), "free", "held", or "unlockable" (its file system has no locks)."""
    try:
        fd = os.open(out / LOCK_FILE, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOFOLLOW)
    except FileNotFoundError:
        yield "missing", -1
        return
    except OSError:
        yield "unopenable", -1
        return
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            state = "unopenable"
        else:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                state = "free"
            except BlockingIOError:
                state = "held"
            except OSError:
                state = "unlockable"
        yield state, fd
    finally:
        os.close(fd)  # drops the shared lock


def lock_holder(out: Path, *, certain: bool = False) -> str | None:
    """Who holds the build lock of ``out`` (``pid N on host H, since T``), or None when no build does (reads only,
    see :func:`_lock_probe`). On a file system without locks the lock file's holder is taken as holding it, unless
    ``certain`` (a lock file left by a killed build is then no holder)."""
    with _lock_probe(out) as (state, fd):
        return _holder(fd) if state == "held" or (state == "unlockable" and not certain) else None


def still_held(out: Path, token: str) -> bool:
    """Whether the build whose :class:`BuildLock` has ``token`` holds the lock of ``out`` now (reads only, see
    :func:`_lock_probe`). True when that cannot be told (the file cannot be opened here, or its file system
    has no locks); False when no build holds it, or another build does."""
    with _lock_probe(out) as (state, fd):
        if state in ("missing", "free"):
            return False
        if state != "held":
            return True
        return _lock_info(fd).get("token") in (None, token)


def _same_file(fd: int, path: Path) -> bool:
    try:
        a, b = os.fstat(fd), os.stat(path, follow_symlinks=False)
    except OSError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def _lock_info(fd: int) -> dict:
    """What the holder wrote in the lock file (host, pid, started, token); empty when it cannot be read."""
    try:
        info = json.loads(os.pread(fd, 4096, 0).decode("utf-8", "replace") or "{}")
    except (OSError, ValueError):
        return {}
    return info if isinstance(info, dict) else {}


def _holder(fd: int) -> str:
    info = _lock_info(fd)
    try:
        return f"pid {int(info['pid'])} on host {info['host']}, since {info.get('started', '?')}"
    except (ValueError, KeyError, TypeError):
        return "holder unknown"


@dataclass
class Output:
    """The prepared output of one build: its build id, the lock, and what this run created."""

    path: Path
    build_id: str
    lock: BuildLock
    created: list[Path] = field(default_factory=list)  # in creation order
    # Not None: a folder this process may not write (OutputNotWritable) or another build holds (OutputBusyError),
    # holding this very build (same configuration and source): the builder may only check that it is up to
    # date, and raises cannot_write() otherwise.
    read_only: OutputError | None = None

    def why_read_only(self) -> str:
        """Why a read-only output was not written, for the build's last line."""
        return "another build holds the folder" if isinstance(self.read_only, OutputBusyError) else \
            "the folder cannot be written"

    def cannot_write(self) -> OutputError:
        """The error of a build that has something to write into a read-only output: that another build is
        writing it (whose changes may be what this one found), else that the folder cannot be written."""
        holder = lock_holder(self.path)
        if holder is not None:
            return busy(self.path, holder)
        return self.read_only or OutputNotWritable(f"cannot write to output folder {self.path}")

    def discard_if_untouched(self) -> None:
        """After a failure before any shard was finished: remove exactly what this run created."""
        shards = self.path / SHARDS_DIR
        try:
            if shards.is_dir() and any(e.name.endswith(".zarr") for e in shards.iterdir()):
                return
        except OSError:  # what it holds cannot be seen: everything is kept
            return
        if self.path / records.BUILD_LOCK not in self.created:
            return  # an earlier build's output: keep its marker, so a rerun resumes it
        remove_stale_temps(shards)
        remove_dir = self.path in self.created
        for path in reversed(self.created):
            try:
                if path == self.path:
                    continue
                if path.is_dir() and not path.is_symlink():
                    path.rmdir()
                else:
                    path.unlink(missing_ok=True)
            except OSError:
                remove_dir = False
        self.lock.release()
        if remove_dir:
            with contextlib.suppress(OSError):
                self.path.rmdir()


def _unreadable(path: Path, exc: OSError) -> OutputError:
    return OutputError(f"output folder {path} cannot be read ({exc.strerror or exc}); {PERMISSION_ADVICE}")


def _entries(out: Path) -> list[str]:
    return [e.name for e in os.scandir(out) if e.name != LOCK_FILE]


def prepare(out: Path, config: dict, chash: str, source: dict[str, str], force: bool,
            shards: Collection[str] = ()) -> Output:
    """Create or reopen ``out`` for a build of ``config`` from ``source``, holding its lock; ``shards`` names the
    shard folders the build writes (one it cannot replace stops ``force`` before anything is removed).

    A folder whose lock file cannot be written (no permission, a read-only file system), or whose lock
    another build holds, that holds this very build gives an Output without the lock, marked
    ``read_only``: the builder only checks that it is up to date.

    Raises:
        OutputError: the folder cannot be created or written (OutputNotWritable where it holds no build
            of this configuration and source), is not empty and not datapipe's, or holds a build whose
            files cannot be told from a user's.
        OutputBusyError: another build holds the output (also while it has not yet written its marker);
            raised by the builder when the output is not up to date.
        ConfigMismatchError: it holds a build of another configuration or source (``force`` rebuilds).
        CacheError: its build.json carries the datapipe marker but is damaged.
    """
    try:
        existed = out.exists()
        if existed and not out.is_dir():
            raise OutputError(f"output {out} is a file, not a folder; choose a folder")
        if existed and _entries(out) and not records.is_datapipe_output(out):
            holder = lock_holder(out)  # a build that has made the folder but not yet written its marker
            if holder is not None:
                raise busy(out, holder)
            raise OutputError(f"output {out} is not empty and is not a datapipe cache; choose an empty "
                              "or new folder (datapipe never deletes files it did not create)")
    except DatapipeError:
        raise
    except OSError as exc:  # it cannot be looked at: whether it is empty, or datapipe's, cannot be told
        raise _unreadable(out, exc) from None
    dangling = next((p for p in (out, *out.parents) if os.path.islink(p) and not p.exists()), None) \
        if not existed else None
    if dangling is not None:  # mkdir would say "File exists" of a name that shows no file
        which = "output" if dangling == out else f"output {out}: the folder on its way"
        raise OutputError(f"{which} {dangling} is a symbolic link to {os.readlink(dangling)}, which does not exist: "
                          "create the folder it names (a build writes into it), or remove the link, and rerun")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OutputError(f"cannot create output folder {out}: {exc.strerror or exc}") from None
    output = Output(out, "", BuildLock(out))
    if not existed:
        output.created.append(out)
    try:
        output.lock.acquire()
    except (OutputNotWritable, OutputBusyError) as exc:
        # A folder this process cannot write, or one another build holds (the ranks of a job each calling
        # build() on the same cache): it may still hold this very build, up to date, checked without the lock.
        return _read_only(out, config, chash, source, force, exc)
    except OutputWriteError as exc:  # a full disk: a cache already up to date still needs nothing written
        if existed:
            return _read_only(out, config, chash, source, force, exc)
        with contextlib.suppress(OSError):
            out.rmdir()  # the folder this build made, and nothing else: it goes
        raise
    if output.lock.created:
        output.created.append(output.lock.path)
    try:
        output.build_id = _claim(out, config, chash, source, force, shards)
        build_json = out / records.BUILD_LOCK
        if not build_json.exists():
            output.created.append(build_json)
        folder = out / SHARDS_DIR
        if not folder.exists():
            folder.mkdir()
            output.created.append(folder)
        text = _build_json(config, chash, output.build_id, source)
        if not holds(build_json, text.encode()):  # an unchanged one is left as it is: a rerun with nothing to do writes nothing
            atomic_write_text(build_json, text)
            fsync_dir(out)
    except OutputError:  # says what is wrong already
        output.discard_if_untouched()
        output.lock.release()
        raise
    except OSError as exc:
        output.discard_if_untouched()
        output.lock.release()
        if exc.errno in (errno.EACCES, errno.EPERM) and exc.filename and os.fspath(exc.filename) != str(out):
            raise OutputError(f"{exc.filename} in output folder {out} cannot be read or written ({exc.strerror}); "
                              f"{PERMISSION_ADVICE}") from None
        raise OutputError(f"cannot write to output folder {out}: {exc.strerror or exc}") from None
    except BaseException:
        output.discard_if_untouched()
        output.lock.release()
        raise
    try:
        remove_stale_temps(out, OUTPUT_TEMPS)  # a write of the manifest, report... that a killed run left unfinished
        removed = remove_stale_temps(out / SHARDS_DIR)
    except OSError as exc:
        output.lock.release()
        raise _unreadable(out / SHARDS_DIR if exc.filename and SHARDS_DIR in str(exc.filename) else out, exc) from None
    if removed:
        logging.getLogger("datapipe.build").info(
            f"datapipe build: removed {plural(removed, 'unfinished shard')} left by an interrupted build")
    return output


def _build_json(config: dict, chash: str, build_id: str, source: dict[str, str]) -> str:
    return json.dumps(records.BuildRecord(config=config, config_hash=chash, build_id=build_id, source=source).to_json(),
                      indent=1)


def _read_only(out: Path, config: dict, chash: str, source: dict[str, str], force: bool,
               error: OutputError) -> Output:
    """The output of a build into a folder it may not write, or that another build holds (``error`` says
    which): only when the folder holds this very build, whose build.json needs no change, and then as an
    Output the builder may only check (``read_only``). Anything else needs writing: ``error`` (or
    ConfigMismatchError, as for a writable folder)."""
    previous = records.read_build_record(out) if _entries(out) else None
    if previous is None or not previous.build_id:
        raise error
    try:
        same = resumes(previous, config, chash, source, force=force, where=str(out), place="folder")
    except ConfigMismatchError:
        if isinstance(error, OutputBusyError):  # another build at work: the first thing to know, whatever it builds
            raise error from None
        raise
    if not same:
        raise error  # a rebuild (--force) writes
    if not holds(out / records.BUILD_LOCK, _build_json(config, chash, previous.build_id, source).encode()):
        raise error
    return Output(out, previous.build_id, BuildLock(out), read_only=error)


def _claim(out: Path, config: dict, chash: str, source: dict[str, str], force: bool, shards: Collection[str]) -> str:
    """The build id to build under, checked under the lock: the earlier build's when it is the same
    build (a resume), a new one for a fresh or forced output."""
    if not _entries(out):
        return new_build_id()
    if not records.is_datapipe_output(out):  # emptied or replaced between the first check and the lock
        raise OutputError(f"output {out} is not empty and is not a datapipe cache; choose an empty or new folder")
    previous = records.read_build_record(out)
    if previous is None:
        raise OutputError(f"{out} holds a datapipe manifest but no build.json of datapipe's, so its files cannot "
                          "be told from yours; build into a new folder (datapipe never deletes files it did not create)")
    if not previous.build_id:
        raise OutputError(f"{out} was written by an earlier datapipe whose build.json has no build id, so its files "
                          "cannot be told from yours; build into a new folder, or remove this one yourself")
    _check_owned(out, records.MANIFEST, previous.build_id)
    _check_owned(out, records.REPORT, previous.build_id)
    if resumes(previous, config, chash, source, force=force, where=str(out), place="folder"):
        return previous.build_id
    remove_build(out, previous.build_id, writes=shards)
    return new_build_id()


def resumes(previous: records.BuildRecord, config: dict, chash: str, source: dict[str, str], *, force: bool,
            where: str, place: str) -> bool:
    """Whether a build finds its own earlier build at ``where`` (same configuration and source: resume
    it). False when it is another build that ``force`` lets this one replace.

    Raises:
        ConfigMismatchError: another build, and no ``force`` (the message names what differs).
    """
    same_source = not previous.source or previous.source == source
    if previous.config_hash == chash and same_source:
        return True
    if not force:
        what = []
        if previous.config_hash != chash:
            what.append(f"another configuration ({_diff(previous.config, config)})")
        if not same_source:
            what.append(f"another source (it was built from {_describe(previous.source)}, this build reads "
                        f"{_describe(source)})")
        raise ConfigMismatchError(f"{where} holds a build with {' and '.join(what)}; choose another output {place}, "
                                  "or pass --force to rebuild it")
    return False


def _describe(source: dict) -> str:
    return f"{source.get('path', '?')} ({source.get('kind', '?')})"


def _diff(old: dict, new: dict) -> str:
    parts = [_change(k, old.get(k), new.get(k)) for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)]
    unrecorded = sorted(set(new) - set(old))
    earlier = (f"; the earlier build's datapipe did not record {', '.join(unrecorded)}: an earlier datapipe wrote it"
               if unrecorded else "")
    return (", ".join(parts) or "unknown configuration") + earlier


def _change(key: str, old: Any, new: Any) -> str:
    """One setting's change, on one short line: two long lists (a class list of 1,000 names made a line of 26,000
    characters) are told by their lengths and their first difference."""
    text = f"{key}: {old!r} -> {new!r}"
    if len(text) <= 160 or not (isinstance(old, list) and isinstance(new, list)):
        return text if len(text) <= 160 else f"{key}: {show(old, 70)} -> {show(new, 70)}"
    at = next((i for i, (a, b) in enumerate(zip(old, new, strict=False)) if a != b), min(len(old), len(new)))
    first = (f"{show(old[at], 40) if at < len(old) else 'nothing'} -> {show(new[at], 40) if at < len(new) else 'nothing'}")
    return f"{key}: a list of {len(old):,} -> {len(new):,} (the first difference at [{at:,}]: {first})"


def _doc_build_id(path: Path) -> str | None:
    """The build id a JSON document of the output carries; None if it has none or cannot be read."""
    try:
        doc = records.read_json(path)
    except UnreadableFileError:  # whose it is cannot be told: said, never taken for foreign
        raise
    except CacheError:
        return None
    build_id = doc.get("build_id") if isinstance(doc, dict) else None
    return build_id if isinstance(build_id, str) else None


def _check_owned(out: Path, name: str, build_id: str) -> None:
    path = out / name
    if os.path.lexists(path) and _doc_build_id(path) != build_id:
        raise OutputError(f"{path} was not written by the build recorded in {out / records.BUILD_LOCK}, and datapipe "
                          "does not overwrite files it did not write; move it away and rerun")


def shard_build_id(shard_dir: Path) -> str | None:
    """The build id in a shard's ``zarr.json`` attributes (whole or not); None if it carries none."""
    try:
        record = shard_attributes(records.read_json(shard_dir / GROUP_META))
    except UnreadableFileError:  # whose it is cannot be told: said, never taken for foreign
        raise
    except CacheError:
        return None
    value = (record or {}).get("build_id")
    return value if isinstance(value, str) else None


def linked_shards(out: Path) -> OutputError | None:
    """The refusal of a build that would write or remove shards in ``out`` whose ``shards/`` is a symbolic link
    (another cache's shards, maybe); None when it is a folder. Reading such a cache, and a rerun that finds nothing
    to do, go through the link."""
    if not os.path.islink(out / SHARDS_DIR):
        return None
    return OutputError(f"{out / SHARDS_DIR} is a symbolic link (to {os.readlink(out / SHARDS_DIR)}), and this build "
                       "would write or remove shards there; a build does so only in a folder of its own, never behind a "
                       "link (another cache's shards, maybe): make it a folder (to keep a cache on another disk, link "
                       "the whole output folder instead). Nothing was changed")


def not_ours(found: list[Path], shard: Path, does: str, kept: str) -> BuildError:
    """The refusal of a build that ``does`` (writes, replaces) the shard folder ``shard``, which holds ``found``:
    entries no build wrote (see :func:`datapipe.shards.foreign_entries`); ``kept`` says what is left as it was."""
    more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
    return BuildError(f"{found[0]}{more} is in shard folder {shard}, which this build {does}, and no datapipe build wrote "
                      f"it; datapipe does not delete what it did not write: move it out and rerun ({kept})")


def remove_build(out: Path, build_id: str, writes: Collection[str] = ()) -> None:
    """Remove what the build ``build_id`` wrote here, and nothing else; nothing when a shard cannot be read
    (OSError: no permission), which would otherwise leave the cache without its manifest, its shards as they were,
    or when one of the shard folders named in ``writes`` (those the next build writes) is in its way.

    Raises:
        OutputError: ``shards/`` is a link (see :func:`linked_shards`), a shard holds what no build wrote, or one of
            ``writes`` is no shard of ``build_id`` (a link, another build's, one of no record).
    """
    if (refusal := linked_shards(out)) is not None:
        raise refusal
    doomed = shards_of(out, build_id, keep=())
    foreign = [(shard, entry) for shard in doomed for entry in foreign_entries(shard)]
    if foreign:  # refused before anything goes: the cache stays whole, as it was
        raise not_ours([entry for _, entry in foreign], foreign[0][0], "replaces", "nothing was removed")
    if in_the_way := _other_shards(out, doomed, writes):  # the next build would refuse them, the cache gone by then
        more = f" (and {len(in_the_way) - 1} more)" if len(in_the_way) > 1 else ""
        raise OutputError(f"{in_the_way[0]}{more} in {out / SHARDS_DIR} is no shard of the build this one replaces (a "
                          "symbolic link, a mount point, another cache's shard, or a folder whose zarr.json is gone: a removal cut "
                          "short), and a build writes its shards only where none of those is; datapipe does not "
                          "delete what it did not write: move it away and rerun. Nothing was removed")
    manifest_ours = _doc_build_id(out / records.MANIFEST) == build_id
    for name in (records.MANIFEST, records.REPORT):
        if _doc_build_id(out / name) == build_id:
            (out / name).unlink()
    if manifest_ours or not os.path.lexists(out / records.MANIFEST):
        for name in (records.LABELS, records.PATHS):  # the index files beside our manifest
            path = out / name
            if path.is_file() and not path.is_symlink():
                path.unlink()
    _remove_shards(out, doomed)


def shards_of(out: Path, build_id: str, keep: Collection[str]) -> list[Path]:
    """The shard folders of ``out`` carrying ``build_id`` whose names are not in ``keep``."""
    shards = out / SHARDS_DIR
    if not shards.is_dir():
        return []
    return [entry for entry in shards.iterdir()
            if entry.name.endswith(".zarr") and entry.name not in keep and not entry.name.startswith(TMP_PREFIX)
            and not entry.is_symlink() and entry.is_dir() and not is_mount(entry) and shard_build_id(entry) == build_id]


def _other_shards(out: Path, ours: list[Path], names: Collection[str]) -> list[Path]:
    """The entries of ``out``'s ``shards/`` of these ``names`` that are not among ``ours`` (a link, a file, a folder
    of another build or of no readable record), sorted; a folder holding no file is none (a build removes it)."""
    keep = set(ours)
    found = [out / SHARDS_DIR / name for name in sorted(names)]
    return [entry for entry in found if entry not in keep and os.path.lexists(entry)
            and (entry.is_symlink() or not entry.is_dir() or is_mount(entry)
                 or any(files for _, _, files in os.walk(entry)))]


def remove_shards(out: Path, build_id: str, keep: Collection[str]) -> None:
    """Remove the shard folders carrying ``build_id`` whose names are not in ``keep``, and the
    writer's temporary folders; other entries of ``shards/`` stay."""
    _remove_shards(out, shards_of(out, build_id, keep))


def _remove_shards(out: Path, doomed: list[Path]) -> None:
    """Remove these shard folders (see shards_of) and the writer's temporary folders; nothing behind a linked
    ``shards/`` (see :func:`linked_shards`)."""
    if not (out / SHARDS_DIR).is_dir() or os.path.islink(out / SHARDS_DIR):
        return
    remove_stale_temps(out / SHARDS_DIR)
    for entry in doomed:
        left = remove_shard(entry)
        if left:
            logging.getLogger("datapipe.build").warning(
                "kept %s (no datapipe build wrote it) and so its folder %s; the shard's own files were removed",
                left[0] if len(left) == 1 else f"{len(left)} entries such as {left[0]}", entry)
