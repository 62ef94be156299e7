"""Writing one shard (the layout is :mod:`datapipe.shards`).

A shard is written into a temporary folder beside its final name and renamed into place when
complete, so a shard folder with the final name is always whole. The writer streams one sample at a
time to the file: a worker never holds more than one decoded image. The fixed layout takes square
raw samples; the indexed one takes samples of any shape, stored raw or encoded as JPEG, and writes
their sample index.
"""

from __future__ import annotations

import os
import shutil
import threading
import uuid
from pathlib import Path
from types import TracebackType
from typing import Any, BinaryIO

import numpy as np

from . import samples
from .files import TMP_PREFIX, crc32c, fsync_dir
from .records import CHUNK_BYTES, LAYOUTS, expected_file_size, indexed_chunks, indexed_file_size
from .shards import GROUP_META, images_path, indexed_tail, shard_index, write_metadata

SYNC_EVERY_BYTES = 16 << 20  # a shard's data is flushed to disk in the background in steps of this


class ShardWriter:
    """Write one shard into a temporary folder, then rename it into place.

    Use as ``with ShardWriter(final_dir, size=S) as w: w.add(img, label, path); info = w.commit(...)``.
    Leaving the block without ``commit`` (an exception) removes the temporary folder.
    ``layout="indexed"`` (with ``encoding`` raw or jpeg, and the JPEG ``quality``) takes samples of
    any shape and writes the sample index; ``size`` is then the largest side a sample may have.
    ``durable=False``: nothing is flushed to disk (no ``fsync``), for a shard staged on its way to an
    object store, whose copy is the durable one (the staged files are deleted once it is whole there).
    """

    def __init__(self, final_dir: Path, *, size: int, layout: str = "fixed", encoding: samples.Encoding = "raw",
                 quality: int = samples.DEFAULT_QUALITY, durable: bool = True) -> None:
        if layout not in LAYOUTS or encoding not in samples.ENCODINGS or (layout == "fixed" and encoding != "raw"):
            raise ValueError(f"no shard layout {layout!r} of {encoding!r} samples")
        self.final_dir = Path(final_dir)
        self.size = size
        self.layout = layout
        self.encoding = encoding
        self.quality = quality
        self.durable = durable
        self.rows: list[tuple[int, int, int, int]] = []  # indexed: (offset, nbytes, height, width) per sample
        self._offset = 0  # indexed: bytes of samples written so far
        self.tmp_dir = self.final_dir.parent / f"{TMP_PREFIX}{self.final_dir.stem}-{uuid.uuid4().hex[:8]}"
        self.labels: list[int] = []
        self.paths: list[str] = []
        self._crc = 0
        self._file: BinaryIO | None = None  # open between __enter__ and commit
        self._unsynced = 0  # bytes written since the last background flush was started
        self._flusher: threading.Thread | None = None
        self._flush_error: OSError | None = None

    def __enter__(self) -> ShardWriter:
        data = images_path(self.tmp_dir, self.layout)
        try:
            data.parent.mkdir(parents=True)
            self._file = open(data, "wb")  # closed in commit/__exit__
        except BaseException:  # no file entries left, a full disk: __exit__ is not called for a failed __enter__
            shutil.rmtree(self.tmp_dir, ignore_errors=True)
            raise
        return self

    def add(self, image: np.ndarray, label: int, path: str) -> None:
        if self.layout == "fixed":
            if image.shape != (self.size, self.size, 3) or image.dtype != np.uint8:
                raise ValueError(f"sample {path!r} has shape {image.shape} {image.dtype}, expected "
                                 f"({self.size}, {self.size}, 3) uint8")
        elif (image.ndim != 3 or image.shape[2] != 3 or image.dtype != np.uint8 or not 1 <= image.shape[0] <= self.size
              or not 1 <= image.shape[1] <= self.size):
            raise ValueError(f"sample {path!r} has shape {image.shape} {image.dtype}, expected (H, W, 3) uint8 "
                             f"with sides from 1 to {self.size}")
        buf: np.ndarray | bytes = np.ascontiguousarray(image)
        if self.encoding == "jpeg":
            buf = bytes(samples.encode(image, "jpeg", self.quality))
        nbytes = len(buf) if isinstance(buf, bytes) else buf.nbytes
        self._writing().write(buf if isinstance(buf, bytes) else buf.data)
        self._crc = crc32c(buf, self._crc)
        if self.layout == "indexed":
            self.rows.append((self._offset, nbytes, int(image.shape[0]), int(image.shape[1])))
            self._offset += nbytes
        self.labels.append(int(label))
        self.paths.append(path)
        self._unsynced += nbytes
        if self._unsynced >= SYNC_EVERY_BYTES and self.durable:
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

    def _tail(self) -> bytes:
        """What follows the samples in the data file: the zero padding to whole chunks (indexed), the
        shard index and its crc32c."""
        n = len(self.labels)
        if self.layout == "fixed":
            return shard_index(n, self.size)
        padding = bytes(indexed_chunks(self._offset) * CHUNK_BYTES - self._offset)
        return padding + indexed_tail(self._offset)

    def commit(self, attributes: dict[str, Any]) -> dict[str, Any]:
        """Finish the files, rename the folder into place and return the shard's record."""
        n = len(self.labels)
        file = self._writing()
        if n:
            tail = self._tail()
            file.write(tail)
            self._crc = crc32c(tail, self._crc)
        file.flush()
        self._join_flusher()
        if self.durable:
            os.fsync(file.fileno())
        file.close()
        if not n:
            images_path(self.tmp_dir, self.layout).unlink()
        labels = np.asarray(self.labels, np.int64)
        if self.layout == "fixed":
            record = {"count": n, "nbytes": expected_file_size(n, self.size), "crc32c": f"{self._crc:08x}", **attributes}
            write_metadata(self.tmp_dir, self.size, labels, {**record, "paths": self.paths}, durable=self.durable)
        else:
            index = samples.SampleIndex.of(np.array(self.rows, np.int64).reshape(-1, 4)).to_bytes()
            record = {"count": n, "nbytes": indexed_file_size(self._offset), "crc32c": f"{self._crc:08x}",
                      "index_crc32c": f"{crc32c(index):08x}", **attributes}
            write_metadata(self.tmp_dir, self.size, labels, {**record, "paths": self.paths}, index=index,
                           total=self._offset, durable=self.durable)
        if self.durable:
            fsync_dir(self.tmp_dir)
        try:
            os.rename(self.tmp_dir, self.final_dir)
        except OSError:
            # Another attempt at the same shard (a re-run task) finished first; both are identical.
            if not (self.final_dir / GROUP_META).exists():
                raise
            shutil.rmtree(self.tmp_dir, ignore_errors=True)
        if self.durable:
            fsync_dir(self.final_dir.parent)
        return record

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._join_flusher(raise_error=False)  # the block is failing already
        try:
            if self._file is not None and not self._file.closed:
                self._file.close()  # flushes what it buffered: on a full disk, fails again
        except OSError:
            if exc is None:
                raise
        finally:  # never a half-written shard left on the disk the user is told to free
            if self.tmp_dir.exists():
                shutil.rmtree(self.tmp_dir, ignore_errors=True)
