"""Shards on disk: one Zarr v3 group per shard whose image array is plain bytes at known offsets.

A shard is the folder ``shards/NNNNNN.zarr``, a Zarr v3 group holding

* ``images``: uint8 [n, S, S, 3], sharding codec, chunk = one sample, no compression — so the one
  shard file ``images/c/0/0/0/0`` is the n samples back to back, followed by the shard index
  (n × (offset, nbytes) little-endian uint64) and the index's crc32c, exactly as the Zarr v3 sharding
  spec lays it out. zarr-python reads it; the loader reads the first n·S·S·3 bytes with positioned reads instead,
  which turns a batch into one read per run of samples rather than one zarr call per image.
* ``labels``: int64 [n], one uncompressed chunk.
* group attributes: the shard's source paths, its plan hash, quarantined files and the data file's
  crc32c.

A shard is written into a temporary folder beside its final name and renamed into place when
complete, so a shard folder with the final name is always whole. The writer streams one sample at a
time to the file: a worker never holds more than one decoded image.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import threading
import uuid
from pathlib import Path
from typing import BinaryIO

import numpy as np

from .errors import CacheError
from .records import expected_file_size, read_json

SHARDS_DIR = "shards"
TMP_PREFIX = ".tmp-"
IMAGES_FILE = ("images", "c", "0", "0", "0", "0")
LABELS_FILE = ("labels", "c", "0")
GROUP_META = "zarr.json"
SYNC_EVERY_BYTES = 16 << 20  # a shard's data is flushed to disk in the background in steps of this


def shard_name(index: int) -> str:
    return f"{index:06d}.zarr"


def images_path(shard_dir: Path) -> Path:
    return shard_dir.joinpath(*IMAGES_FILE)


def _crc32c(data, value: int = 0) -> int:
    import google_crc32c

    return google_crc32c.extend(value, data)


class ShardWriter:
    """Write one shard into a temporary folder, then rename it into place.

    Use as ``with ShardWriter(final_dir, size=S) as w: w.add(img, label, path); info = w.commit(...)``.
    Leaving the block without ``commit`` (an exception) removes the temporary folder.
    """

    def __init__(self, final_dir: Path, *, size: int) -> None:
        self.final_dir = Path(final_dir)
        self.size = size
        self.tmp_dir = self.final_dir.parent / f"{TMP_PREFIX}{self.final_dir.stem}-{uuid.uuid4().hex[:8]}"
        self.labels: list[int] = []
        self.paths: list[str] = []
        self._crc = 0
        self._file: BinaryIO | None = None  # open between __enter__ and commit
        self._unsynced = 0  # bytes written since the last background flush was started
        self._flusher: threading.Thread | None = None
        self._flush_error: OSError | None = None

    def __enter__(self) -> ShardWriter:
        data = images_path(self.tmp_dir)
        data.parent.mkdir(parents=True)
        self._file = open(data, "wb")  # closed in commit/__exit__
        return self

    def add(self, image: np.ndarray, label: int, path: str) -> None:
        if image.shape != (self.size, self.size, 3) or image.dtype != np.uint8:
            raise ValueError(f"sample {path!r} has shape {image.shape} {image.dtype}, expected "
                             f"({self.size}, {self.size}, 3) uint8")
        buf = np.ascontiguousarray(image)
        self._writing().write(buf.data)
        self._crc = _crc32c(buf, self._crc)
        self.labels.append(int(label))
        self.paths.append(path)
        self._unsynced += buf.nbytes
        if self._unsynced >= SYNC_EVERY_BYTES:
            self._sync_in_background()

    def _sync_in_background(self) -> None:
        """Start flushing what is written so far to disk while decoding goes on, so that the
        final ``fsync`` of the shard only waits for its last few megabytes."""
        if self._flusher is not None and self._flusher.is_alive():
            return  # one flush at a time; a later sample starts the next
        file = self._writing()
        file.flush()
        self._unsynced = 0
        self._flusher = threading.Thread(target=self._sync, args=(file.fileno(),), daemon=True,
                                         name="datapipe-shard-sync")
        self._flusher.start()

    def _writing(self) -> BinaryIO:
        """The open images file (a ShardWriter is written inside its ``with`` block only)."""
        assert self._file is not None, "ShardWriter used outside its with block"
        return self._file

    def _sync(self, fd: int) -> None:
        try:
            os.fdatasync(fd)
        except OSError as exc:  # raised by commit, in the writing thread
            self._flush_error = exc

    def _join_flusher(self, *, raise_error: bool = True) -> None:
        if self._flusher is not None:
            self._flusher.join()  # before the file is fsynced or closed: never sync a closed fd
            self._flusher = None
        if raise_error and self._flush_error is not None:
            raise self._flush_error

    def commit(self, attributes: dict) -> dict:
        """Finish the files, rename the folder into place and return the shard's record."""
        n, chunk = len(self.labels), self.size * self.size * 3
        file = self._writing()
        if n:
            index = np.empty((n, 2), "<u8")
            index[:, 0] = np.arange(n, dtype=np.uint64) * chunk
            index[:, 1] = chunk
            raw = index.tobytes()
            tail = raw + _crc32c(raw).to_bytes(4, "little")
            file.write(tail)
            self._crc = _crc32c(tail, self._crc)
        file.flush()
        self._join_flusher()
        os.fsync(file.fileno())
        file.close()
        if not n:
            images_path(self.tmp_dir).unlink()
        _write_zarr_metadata(self.tmp_dir, n, self.size, np.asarray(self.labels, np.int64))
        record = {
            "count": n,
            "nbytes": expected_file_size(n, self.size),
            "crc32c": f"{self._crc:08x}",
            **attributes,
        }
        meta = _group_metadata(n, self.size)
        meta["attributes"] = {"datapipe": {**record, "paths": self.paths}}
        _atomic_write(self.tmp_dir / GROUP_META, json.dumps(meta, indent=1, ensure_ascii=False))
        fsync_dir(self.tmp_dir)
        try:
            os.rename(self.tmp_dir, self.final_dir)
        except OSError:
            # Another attempt at the same shard (a re-run task) finished first; both are identical.
            if not (self.final_dir / GROUP_META).exists():
                raise
            shutil.rmtree(self.tmp_dir, ignore_errors=True)
        fsync_dir(self.final_dir.parent)
        return record

    def __exit__(self, exc_type, exc, tb) -> None:
        self._join_flusher(raise_error=False)  # the block is failing already
        if self._file is not None and not self._file.closed:
            self._file.close()
        if self.tmp_dir.exists():
            shutil.rmtree(self.tmp_dir, ignore_errors=True)


_METADATA: dict[tuple[int, int], dict[str, bytes]] = {}
_METADATA_LOCK = threading.Lock()


def _zarr_metadata(count: int, size: int) -> dict[str, bytes]:
    """The metadata documents zarr-python writes for a shard of ``count`` samples (key -> bytes).

    zarr-python itself writes them, into memory, once per (count, size) in a process; a build's
    shards almost all share one count, so the ~10 ms zarr spends per group is paid once, not per
    shard, and the files stay exactly what zarr writes.
    """
    key = (count, size)
    with _METADATA_LOCK:
        docs = _METADATA.get(key)
        if docs is None:
            import zarr
            from zarr.storage import MemoryStore

            written: dict = {}
            store = MemoryStore(written)
            group = zarr.create_group(store=store, zarr_format=3, overwrite=False)
            group.create_array(
                "images", shape=(count, size, size, 3), dtype="uint8",
                chunks=(1, size, size, 3), shards=(max(count, 1), size, size, 3),
                compressors=None, fill_value=0, write_data=False,
            )
            group.create_array("labels", shape=(count,), dtype="int64", chunks=(max(count, 1),),
                               compressors=None, fill_value=-1)
            docs = {k: bytes(v.to_bytes()) for k, v in written.items() if k.endswith(GROUP_META)}
            _METADATA[key] = docs
    return docs


def _write_zarr_metadata(folder: Path, count: int, size: int, labels: np.ndarray) -> None:
    """Write the Zarr v3 array metadata and the labels chunk of a shard (the group's own
    ``zarr.json`` is written by the caller, with the shard's attributes)."""
    for key, doc in _zarr_metadata(count, size).items():
        if key != GROUP_META:
            target = folder / key
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(doc)
    if count:  # the labels chunk: codec "bytes" (little endian), no compressor
        chunk = folder.joinpath(*LABELS_FILE)
        chunk.parent.mkdir(parents=True, exist_ok=True)
        chunk.write_bytes(np.asarray(labels, "<i8").tobytes())


def _group_metadata(count: int, size: int) -> dict:
    return json.loads(_zarr_metadata(count, size)[GROUP_META])


def shard_labels_path(shard_dir: Path) -> Path:
    return shard_dir.joinpath(*LABELS_FILE)


def read_shard_metadata(shard_dir: Path) -> dict:
    """The datapipe attributes of a shard's ``zarr.json`` (count, nbytes, crc32c, paths, ...), checked
    to be an object whose count, nbytes and crc32c have the right types.

    Raises:
        CacheError: the file is missing, not a regular file, not JSON, or lacks the record.
    """
    path = shard_dir / GROUP_META
    hint = "rerun the same `datapipe build` to rewrite the shard"
    meta = read_json(path, hint=hint)
    record = meta.get("attributes") if isinstance(meta, dict) else None
    record = record.get("datapipe") if isinstance(record, dict) else None
    if not isinstance(record, dict):
        raise CacheError(f"{path} holds no datapipe shard record (attributes.datapipe); {hint}")
    for key, kind in (("count", int), ("nbytes", int), ("crc32c", str)):
        value = record.get(key)
        if isinstance(value, bool) or not isinstance(value, kind):
            raise CacheError(f"{path}: field 'attributes.datapipe.{key}' is missing or not {kind.__name__}; {hint}")
    return record


def read_shard_record(shard_dir: Path) -> dict | None:
    """The record a finished shard carries in its group attributes, or None if it is not whole."""
    try:
        record = read_shard_metadata(shard_dir)
    except CacheError:
        return None
    try:
        st = os.stat(images_path(shard_dir))
        actual = st.st_size if stat.S_ISREG(st.st_mode) else -1
    except OSError:
        actual = 0
    return record if actual == record["nbytes"] else None


def file_crc32c(path: Path, chunk: int = 1 << 24) -> str:
    """The crc32c of a regular file (opened non-blocking: a FIFO in its place is refused, not waited on)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    with open(fd, "rb", closefd=True) as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise CacheError(f"{path} is not a regular file; rerun the same `datapipe build` to rewrite it")
        crc = 0
        while block := f.read(chunk):
            crc = _crc32c(block, crc)
    return f"{crc:08x}"


def remove_stale_temps(shards_dir: Path) -> int:
    """Remove temporary shard folders left by a killed build (only names this writer creates)."""
    removed = 0
    if shards_dir.is_dir():
        for entry in shards_dir.iterdir():
            if entry.name.startswith(TMP_PREFIX) and entry.is_dir():
                shutil.rmtree(entry, ignore_errors=True)
                removed += 1
    return removed


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f"{TMP_PREFIX}{path.name}.{uuid.uuid4().hex[:8]}")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


atomic_write_text = _atomic_write
