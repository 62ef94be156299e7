"""The shard format: one Zarr v3 group per shard whose image array is plain bytes at known offsets.

A shard is the folder ``shards/NNNNNN.zarr``, a Zarr v3 group in one of two layouts.

**fixed** (format version 1: square raw samples), holding

* ``images``: uint8 [n, S, S, 3], sharding codec, chunk = one sample, no compression — so the one
  shard file ``images/c/0/0/0/0`` is the n samples back to back, followed by the shard index
  (n × (offset, nbytes) little-endian uint64) and the index's crc32c, exactly as the Zarr v3 sharding
  spec lays it out. zarr-python reads it; the loader reads the first n·S·S·3 bytes with positioned reads instead,
  which turns a batch into one read per run of samples rather than one zarr call per image.
* ``labels``: int64 [n], one uncompressed chunk.
* group attributes: the shard's source paths, its plan hash, quarantined files and the data file's
  crc32c.

**indexed** (format version 2: samples of their own shape, or JPEG-encoded), holding

* ``images``: uint8 [total] (total: the samples' bytes), sharding codec with inner chunks of 65536
  bytes, one shard: the data file ``images/c/0`` is the samples back to back from offset 0, zeros
  to a whole number of chunks, then the shard index (one (k·65536, 65536) pair per chunk) and its
  crc32c. zarr-python reads a sample as ``images[offset:offset + nbytes]``.
* ``index``: int64 [count, 4], one uncompressed chunk ``index/c/0/0``: the sample index
  (:class:`datapipe.samples.SampleIndex`: offset, nbytes, height, width per sample).
* ``labels`` as in the fixed layout; group attributes as there, plus the index file's crc32c.

This module is the one place for that layout: the names and paths of a shard's files, the metadata
documents as written and as read back. :mod:`datapipe.writer` writes shards with it, the cache and
the build read them with it.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import stat
import threading
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from .errors import PERMISSION_ADVICE, CacheError, UnreadableFileError, thread_start_failed
from .files import FileTooLarge, NotRegularFile, atomic_write_text, crc32c, is_mount, link_on_the_way, read_regular
from .records import CHUNK_BYTES, INDEX_ROW_BYTES, indexed_chunks, read_json

SHARDS_DIR = "shards"
IMAGES_FILE = ("images", "c", "0", "0", "0", "0")  # the fixed layout's data file
INDEXED_IMAGES_FILE = ("images", "c", "0")  # the indexed layout's data file
INDEX_FILE = ("index", "c", "0", "0")  # the indexed layout's sample index
LABELS_FILE = ("labels", "c", "0")
GROUP_META = "zarr.json"
# Every file a shard of either layout holds, relative to its folder: all a build writes there (and all it deletes).
SHARD_FILES = frozenset({
    GROUP_META, "images/zarr.json", "labels/zarr.json", "index/zarr.json",
    "/".join(IMAGES_FILE), "/".join(INDEXED_IMAGES_FILE), "/".join(INDEX_FILE), "/".join(LABELS_FILE),
})
_SHARD_FOLDERS = frozenset("/".join(name.split("/")[:k]) for name in SHARD_FILES for k in range(1, name.count("/") + 1))
# a shard whose zarr.json is gone or damaged cannot be told to be a build's: the build leaves it (it deletes only
# what it wrote), so it is moved away first
MOVE_AWAY = ("move the shard's folder away and rerun the same `datapipe build` to rewrite it (datapipe never deletes "
             "what it did not write)")
_REWRITE = MOVE_AWAY

# ----------------------------------------------------------------------------- names and paths


def shard_name(index: int) -> str:
    """The folder name of shard ``index`` under ``shards/`` (``records.SHARD_NAME`` checks it on read)."""
    return f"{index:06d}.zarr"


def images_path(shard_dir: Path, layout: str = "fixed") -> Path:
    """The shard's data file in ``layout`` (fixed or indexed): the samples back to back, then the shard index."""
    return shard_dir.joinpath(*(INDEXED_IMAGES_FILE if layout == "indexed" else IMAGES_FILE))


def index_path(shard_dir: Path) -> Path:
    """An indexed shard's sample index (int64 [count, 4] little endian)."""
    return shard_dir.joinpath(*INDEX_FILE)


def shard_labels_path(shard_dir: Path) -> Path:
    """The shard's labels chunk (int64 little endian)."""
    return shard_dir.joinpath(*LABELS_FILE)


def foreign_entries(shard_dir: Path) -> list[Path]:
    """What a shard folder holds that no build writes (a file someone put there), sorted; a folder that
    holds none of a shard's files is named itself, not what is in it."""
    found: list[Path] = []

    def walk(folder: Path, rel: str) -> None:
        try:
            with os.scandir(folder) as it:
                entries = sorted(it, key=lambda e: e.name)
        except OSError:
            return
        for entry in entries:
            name = f"{rel}{entry.name}"
            if entry.is_dir(follow_symlinks=False) and name in _SHARD_FOLDERS and not is_mount(entry.path):
                walk(Path(entry.path), f"{name}/")  # (a file system mounted there is another's: named, never entered)
            elif name not in SHARD_FILES or not entry.is_file(follow_symlinks=False):
                found.append(Path(entry.path))

    walk(shard_dir, "")
    return found


def remove_shard(shard_dir: Path) -> list[Path]:
    """Delete a shard's files (its group's ``zarr.json`` first, so it is never whole-looking while half
    deleted), then its folders once empty; what no build writes stays (returned: see :func:`foreign_entries`),
    and with it the folder."""
    for name in sorted(SHARD_FILES, key=lambda n: n != GROUP_META):
        path = shard_dir / name
        if path.is_file() and not path.is_symlink() and link_on_the_way(shard_dir, name) is None:
            path.unlink()
    for name in sorted(_SHARD_FOLDERS, key=lambda n: -n.count("/")):
        with contextlib.suppress(OSError):
            (shard_dir / name).rmdir()
    left = foreign_entries(shard_dir)
    if not left:
        with contextlib.suppress(OSError):
            shard_dir.rmdir()
    return left


# ----------------------------------------------------------------------------- writing the documents


def shard_index(count: int, size: int) -> bytes:
    """The tail of a data file of ``count`` samples: the Zarr v3 shard index (one (offset, nbytes)
    pair of little-endian uint64 per sample) and its crc32c; empty for an empty shard."""
    if not count:
        return b""
    chunk = size * size * 3
    index = np.empty((count, 2), "<u8")
    index[:, 0] = np.arange(count, dtype=np.uint64) * chunk
    index[:, 1] = chunk
    raw = index.tobytes()
    return raw + crc32c(raw).to_bytes(4, "little")


def indexed_tail(total: int) -> bytes:
    """The tail of an indexed shard's data file after its ``total`` sample bytes and the zero padding
    to whole chunks: the Zarr v3 shard index (one (k·65536, 65536) pair of little-endian uint64 per
    inner chunk) and its crc32c; empty for an empty shard."""
    chunks = indexed_chunks(total)
    if not chunks:
        return b""
    index = np.empty((chunks, 2), "<u8")
    index[:, 0] = np.arange(chunks, dtype=np.uint64) * CHUNK_BYTES
    index[:, 1] = CHUNK_BYTES
    raw = index.tobytes()
    return raw + crc32c(raw).to_bytes(4, "little")


_METADATA: dict[tuple[str, int, int], dict[str, bytes]] = {}
_METADATA_LOCK = threading.Lock()
_METADATA_KEEP = 64  # documents of this many shapes are kept per process (JPEG shards all differ in size)


def _zarr_metadata(layout: str, count: int, size: int) -> dict[str, bytes]:
    """The metadata documents zarr-python writes for a shard of ``count`` samples (key -> bytes);
    ``size`` is the sample side (fixed) or the total bytes of the samples (indexed).

    zarr-python itself writes them, into memory, once per (layout, count, size) in a process; a
    build's fixed shards almost all share one count, so the ~10 ms zarr spends per group is paid
    once, not per shard, and the files stay exactly what zarr writes.
    """
    key = (layout, count, size)
    with _METADATA_LOCK:
        docs = _METADATA.get(key)
        if docs is None:
            docs = _zarr_documents(layout, count, size)
            if len(_METADATA) >= _METADATA_KEEP:
                _METADATA.pop(next(iter(_METADATA)))
            _METADATA[key] = docs
    return docs


def _forget_zarr_loop() -> None:
    """zarr keeps the event loop of an I/O thread that failed to start: every later call would wait on it for
    ever (and its exit handler fails joining the thread). Forget both, so that the next call starts anew."""
    from zarr.core import sync

    with contextlib.suppress(AttributeError, IndexError, TypeError):
        thread = sync.iothread[0]
        if thread is not None and thread.ident is None:  # never started
            sync.iothread[0] = None
            sync.loop[0] = None


def _zarr_documents(layout: str, count: int, size: int) -> dict[str, bytes]:
    import zarr
    from zarr.storage import MemoryStore

    written: dict[str, Any] = {}
    # the call's coroutine, never run when zarr's thread cannot start, is collected with a warning of its own as
    # the failure is let go: the error says it all
    failed = None
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="coroutine '.*' was never awaited", category=RuntimeWarning)
        try:
            group = zarr.create_group(store=MemoryStore(written), zarr_format=3, overwrite=False)
        except RuntimeError as exc:  # the first zarr call of the process starts zarr's I/O thread
            failed = thread_start_failed(exc, "zarr's I/O")
            if failed is None:
                raise
            _forget_zarr_loop()
        if failed is not None:
            gc.collect()  # the failure let go, its coroutine goes now, and its warning with it
    if failed is not None:
        raise failed
    if layout == "indexed":
        padded = max(indexed_chunks(size), 1) * CHUNK_BYTES
        group.create_array("images", shape=(size,), dtype="uint8", chunks=(CHUNK_BYTES,), shards=(padded,),
                           compressors=None, fill_value=0, write_data=False)
        group.create_array("index", shape=(count, 4), dtype="int64", chunks=(max(count, 1), 4),
                           compressors=None, fill_value=0, write_data=False)
    else:
        group.create_array(
            "images", shape=(count, size, size, 3), dtype="uint8",
            chunks=(1, size, size, 3), shards=(max(count, 1), size, size, 3),
            compressors=None, fill_value=0, write_data=False,
        )
    group.create_array("labels", shape=(count,), dtype="int64", chunks=(max(count, 1),),
                       compressors=None, fill_value=-1)
    return {k: bytes(v.to_bytes()) for k, v in written.items() if k.endswith(GROUP_META)}


def write_metadata(folder: Path, size: int, labels: np.ndarray, record: dict[str, Any], *,
                   index: bytes | None = None, total: int = 0, durable: bool = True) -> None:
    """Write a shard's Zarr v3 documents and labels chunk into ``folder``: the arrays' metadata, the
    labels, and last the group's ``zarr.json`` carrying ``record`` as ``attributes.datapipe``.

    With ``index`` (the sample index's bytes, :meth:`datapipe.samples.SampleIndex.to_bytes`) the
    shard is of the indexed layout holding ``total`` bytes of samples, and the index is written too.
    ``durable=False``: the group's ``zarr.json`` is not flushed to disk (a shard staged for an object store).
    """
    count = len(labels)
    docs = _zarr_metadata("fixed", count, size) if index is None else _zarr_metadata("indexed", count, total)
    for key, doc in docs.items():
        if key != GROUP_META:
            target = folder / key
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(doc)
    if count:  # the labels chunk: codec "bytes" (little endian), no compressor
        chunk = shard_labels_path(folder)
        chunk.parent.mkdir(parents=True, exist_ok=True)
        chunk.write_bytes(np.asarray(labels, "<i8").tobytes())
    if index is not None and count:  # one chunk, codec "bytes" (little endian), no compressor
        if len(index) != count * INDEX_ROW_BYTES:
            raise ValueError(f"a sample index of {len(index)} bytes for {count} samples")
        target = index_path(folder)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(index)
    meta = json.loads(docs[GROUP_META])
    meta["attributes"] = {"datapipe": record}
    text = json.dumps(meta, indent=1, ensure_ascii=False)
    if durable:
        atomic_write_text(folder / GROUP_META, text)
    else:
        (folder / GROUP_META).write_text(text)


def document_problems(shard_dir: Path, count: int, size: int, *, indexed: bool) -> list[str]:
    """What differs between a shard's Zarr documents and those its build writes (:func:`write_metadata`):
    its arrays' ``zarr.json`` byte for byte, its group's apart from the datapipe record. One line per
    file, naming it; ``size`` as for :func:`_zarr_metadata`. zarr-python reads the shard through these."""
    def read(key: str) -> bytes | str | None:
        try:
            return read_regular(shard_dir / key, MAX_DOCUMENT_BYTES)
        except FileNotFoundError:
            return None
        except FileTooLarge:
            return b""  # not the document (none is this long)
        except NotRegularFile as exc:
            return f"is not a regular file ({exc})"
        except OSError as exc:
            return f"cannot be read ({exc.strerror or exc})"

    return documents_differ(read, count, size, indexed=indexed, name=lambda key: str(shard_dir / key))


MAX_DOCUMENT_BYTES = 256 << 20  # a group's zarr.json carries the shard's paths


def documents_differ(read: Callable[[str], bytes | str | None], count: int, size: int, *, indexed: bool,
                     name: Callable[[str], str]) -> list[str]:
    """:func:`document_problems` for a shard whose files ``read`` gives (key -> its bytes, None when it is
    missing, or the text of why it cannot be read); ``name`` names a key in a problem.

    The documents are compared as Zarr reads them, not byte for byte: zarr-python releases write the same
    metadata with optional fields absent or null (3.1.0 writes ``"consolidated_metadata": null``, later ones
    leave it out), and a shard written by one is as whole under another (:func:`_zarr_meaning`)."""
    problems = []
    for key, want in _zarr_metadata("indexed" if indexed else "fixed", count, size).items():
        got = read(key)
        if isinstance(got, str):
            problems.append(f"{name(key)} {got}")
            continue
        if got is None:
            problems.append(f"{name(key)} is missing")
            continue
        try:
            doc = json.loads(got)
        except ValueError:
            doc = None
        expected = json.loads(want)
        if key == GROUP_META and isinstance(doc, dict):  # the group's attributes carry the datapipe record
            doc = {k: v for k, v in doc.items() if k != "attributes"}
            expected.pop("attributes", None)
        if not isinstance(doc, dict) or _zarr_meaning(doc) != _zarr_meaning(expected):
            problems.append(f"{name(key)} is not the Zarr document the build writes for this shard")
    return problems


_ZARR_DEFAULTS: dict[str, Any] = {"attributes": {}, "storage_transformers": [], "dimension_names": None,
                                  "consolidated_metadata": None}


def _zarr_meaning(doc: dict[str, Any]) -> dict[str, Any]:
    """A Zarr v3 metadata document without the top-level fields that hold their default (absent, null,
    no attributes, no storage transformers): what any zarr-python reads the same whether written or not."""
    return {k: v for k, v in doc.items() if not (k in _ZARR_DEFAULTS and v == _ZARR_DEFAULTS[k])}


# ----------------------------------------------------------------------------- reading them back


def shard_attributes(doc: Any) -> dict[str, Any] | None:
    """The ``attributes.datapipe`` object of a shard group's zarr.json document; None when it has none."""
    record = doc.get("attributes") if isinstance(doc, dict) else None
    record = record.get("datapipe") if isinstance(record, dict) else None
    return record if isinstance(record, dict) else None


def read_shard_metadata(shard_dir: Path) -> dict[str, Any]:
    """The datapipe attributes of a shard's ``zarr.json`` (count, nbytes, crc32c, paths, ...), checked
    to be an object whose count, nbytes and crc32c have the right types.

    Raises:
        CacheError: the file is missing, not a regular file, not JSON, or lacks the record.
    """
    path = shard_dir / GROUP_META
    record = shard_attributes(read_json(path, hint=_REWRITE))
    if record is None:
        raise CacheError(f"{path} holds no datapipe shard record (attributes.datapipe); {_REWRITE}")
    for key, kind in (("count", int), ("nbytes", int), ("crc32c", str)):
        value = record.get(key)
        if isinstance(value, bool) or not isinstance(value, kind):
            raise CacheError(f"{path}: field 'attributes.datapipe.{key}' is missing or not {kind.__name__}; {_REWRITE}")
    if "shard" in record and type(record["shard"]) is not int:  # true would pass for shard 1
        raise CacheError(f"{path}: field 'attributes.datapipe.shard' is not int; {_REWRITE}")
    if "index_crc32c" in record and not isinstance(record["index_crc32c"], str):
        raise CacheError(f"{path}: field 'attributes.datapipe.index_crc32c' is not str; {_REWRITE}")
    return record


def shard_layout(record: dict[str, Any]) -> str:
    """The layout of the shard whose record this is: indexed shards carry their index's crc32c."""
    return "indexed" if "index_crc32c" in record else "fixed"


def _file_size(path: Path) -> int:
    """Bytes of the regular file at ``path``; 0 when there is none, -1 when it is not a regular file."""
    try:
        st = os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        return 0
    except OSError as exc:  # there, but not to be looked at: never taken for a shard to rebuild
        raise UnreadableFileError(f"{path} cannot be read ({exc.strerror or exc}); {PERMISSION_ADVICE}") from None
    return st.st_size if stat.S_ISREG(st.st_mode) else -1


def read_shard_record(shard_dir: Path) -> dict[str, Any] | None:
    """The record a finished shard carries in its group attributes, or None if it is not whole
    (its data file, and an indexed shard's sample index, not of the sizes the record gives)."""
    try:
        record = read_shard_metadata(shard_dir)
    except UnreadableFileError:  # whether it is whole cannot be told: said, never rebuilt over
        raise
    except CacheError:
        return None
    layout = shard_layout(record)
    if _file_size(images_path(shard_dir, layout)) != record["nbytes"]:
        return None
    if layout == "indexed" and _file_size(index_path(shard_dir)) != record["count"] * INDEX_ROW_BYTES:
        return None
    return record
