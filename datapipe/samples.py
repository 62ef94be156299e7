"""How a sample's pixels are stored in a shard and read back: the encodings and the sample index.

A cache stores each sample either as raw pixels (``raw``: uint8 rows of RGB, ``h·w·3`` bytes) or
encoded once with libjpeg-turbo at build time (``jpeg``: 4:2:0, the build's quality). Samples of a
cache whose shapes differ (the aspect-preserving ``--fit short``) or whose sizes differ (``jpeg``)
are found through a **sample index**: per shard, one row of four little-endian int64 per sample,
``(offset, nbytes, height, width)``, the sample's bytes lying at ``offset`` of the shard's data
file. The index is small (32 bytes a sample); a reader loads and checks it once per shard, and a
sample then costs one positioned read, as a square raw sample does.

The JPEG decoders here release the GIL (simplejpeg's binding does), so reader threads decode in
parallel. :func:`decode_crop` decodes only as many pixels as a crop needs: when the crop is at least
twice the output size, libjpeg-turbo scales the image down in the DCT domain while decoding (1/2,
1/4, 1/8 ...), and the crop box is mapped onto the smaller image.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from typing import Literal

import numpy as np

from .errors import CorruptShardError

Encoding = Literal["raw", "jpeg"]
ENCODINGS: tuple[Encoding, ...] = ("raw", "jpeg")
DEFAULT_QUALITY = 90
JPEG_SUBSAMPLING = "420"  # as the JPEG files of ImageNet and FFCV's JPEG mode: half the bytes of 4:4:4 here
INDEX_COLUMNS = ("offset", "nbytes", "height", "width")
INDEX_ROW_BYTES = 8 * len(INDEX_COLUMNS)

_REWRITE = "rerun the same `datapipe build` to rewrite it"


def encode(image: np.ndarray, encoding: Encoding, quality: int = DEFAULT_QUALITY) -> bytes | memoryview:
    """The stored bytes of a uint8 [H, W, 3] sample."""
    image = np.ascontiguousarray(image)
    if encoding == "raw":
        return image.data.cast("B")
    import simplejpeg

    return simplejpeg.encode_jpeg(image, quality=int(quality), colorspace="RGB", colorsubsampling=JPEG_SUBSAMPLING)


@dataclass(frozen=True)
class SampleIndex:
    """The rows of one shard's sample index, as int64 arrays of the shard's ``count`` samples."""

    offsets: np.ndarray
    nbytes: np.ndarray
    heights: np.ndarray
    widths: np.ndarray

    @classmethod
    def of(cls, rows: np.ndarray) -> SampleIndex:
        rows = np.asarray(rows, dtype=np.int64).reshape(-1, len(INDEX_COLUMNS))
        return cls(*(np.ascontiguousarray(rows[:, k]) for k in range(len(INDEX_COLUMNS))))

    def __len__(self) -> int:
        return len(self.offsets)

    def to_bytes(self) -> bytes:
        rows = np.stack([self.offsets, self.nbytes, self.heights, self.widths], axis=1)
        return rows.astype("<i8").tobytes()

    @property
    def data_size(self) -> int:
        """Bytes of sample data the index covers (the samples lie back to back from offset 0)."""
        return int(self.offsets[-1] + self.nbytes[-1]) if len(self) else 0

    @classmethod
    def parse(cls, raw: bytes, *, count: int, encoding: str, max_side: int, where: str) -> SampleIndex:
        """Read and check an index of ``count`` rows; ``where`` names the file in the error.

        Raises:
            CorruptShardError: the index's size, offsets, sizes or shapes are impossible for the cache.
        """
        def fail(what: str) -> CorruptShardError:
            return CorruptShardError(f"{where}: the sample index {what}; {_REWRITE}")

        if len(raw) != count * INDEX_ROW_BYTES:
            raise fail(f"has {len(raw)} bytes, expected {count * INDEX_ROW_BYTES} for {count} samples")
        index = cls.of(np.frombuffer(raw, dtype="<i8"))
        if not count:
            return index
        h, w, n, off = index.heights, index.widths, index.nbytes, index.offsets
        bad = np.flatnonzero((h < 1) | (h > max_side) | (w < 1) | (w > max_side))
        if bad.size:
            i = int(bad[0])
            raise fail(f"gives sample {i} the shape {int(h[i])}x{int(w[i])}, outside 1..{max_side}")
        expected = h * w * 3 if encoding == "raw" else None
        bad = np.flatnonzero(n != expected) if expected is not None else np.flatnonzero(n < 1)
        if bad.size:
            i = int(bad[0])
            raise fail(f"gives sample {i} {int(n[i])} bytes" + (f", expected {int(h[i] * w[i] * 3)}" if expected is not None else ""))
        starts = np.concatenate([[0], np.cumsum(n[:-1])])
        bad = np.flatnonzero(off != starts)
        if bad.size:
            i = int(bad[0])
            raise fail(f"puts sample {i} at byte {int(off[i])}, expected {int(starts[i])} (samples lie back to back)")
        return index


# ----------------------------------------------------------------------------- JPEG decoding


def _decode_error(where: str, exc: BaseException) -> CorruptShardError:
    return CorruptShardError(f"{where}: the stored JPEG does not decode ({type(exc).__name__}: {exc}); {_REWRITE}")


def decode_jpeg(data: bytes | np.ndarray, height: int, width: int, *, where: str, out: np.ndarray | None = None) -> np.ndarray:
    """Decode a stored JPEG sample of ``height`` x ``width`` into uint8 [H, W, 3] (into ``out`` if given).

    Raises:
        CorruptShardError: the bytes do not decode, or decode to another shape than the index says.
    """
    import simplejpeg

    try:
        shape = simplejpeg.decode_jpeg_header(data)[:2]
        if tuple(shape) != (height, width):
            raise ValueError(f"its header says {shape[0]}x{shape[1]}, the index {height}x{width}")
        return simplejpeg.decode_jpeg(data, colorspace="RGB", buffer=out)
    except (ValueError, RuntimeError) as exc:
        raise _decode_error(where, exc) from None


_scratch = threading.local()


def _scratch_buffer(nbytes: int) -> np.ndarray:
    """A per-thread byte buffer of at least ``nbytes`` that the decoder writes into (no allocation per sample)."""
    buf = getattr(_scratch, "buf", None)
    if buf is None or buf.nbytes < nbytes:
        buf = np.empty(max(nbytes, 1 << 20), dtype=np.uint8)
        _scratch.buf = buf
    return buf


def decode_crop(data: bytes | np.ndarray, height: int, width: int, box: tuple[int, int, int, int], out_size: int, *,
                where: str) -> tuple[np.ndarray, tuple[int, int, int, int]]:
    """Decode a stored JPEG sample for one crop: ``(image, box)`` with the crop ``box`` (top, left,
    h, w) mapped onto the returned image.

    When the crop is at least twice ``out_size`` on both sides, the image is decoded scaled down in
    the DCT domain (libjpeg-turbo's M/8 factors), so that the crop still has at least ``out_size``
    pixels on each side; otherwise it is decoded at full size. The image lives in a per-thread
    buffer, valid until this thread decodes the next sample.
    """
    import simplejpeg

    top, left, h, w = box
    scale = min(h, w) / out_size
    try:
        if scale >= 2.0:
            min_h, min_w = math.ceil(height * out_size / h), math.ceil(width * out_size / w)
            img = simplejpeg.decode_jpeg(data, colorspace="RGB", min_height=min_h, min_width=min_w,
                                         buffer=_scratch_buffer(height * width * 3))
        else:
            img = simplejpeg.decode_jpeg(data, colorspace="RGB", buffer=_scratch_buffer(height * width * 3))
    except (ValueError, RuntimeError) as exc:
        raise _decode_error(where, exc) from None
    dh, dw = img.shape[:2]
    if (dh, dw) == (height, width):
        return img, box
    if dh > height or dw > width or dh < 1 or dw < 1:
        raise _decode_error(where, ValueError(f"decoded {dh}x{dw}, the index says {height}x{width}"))
    sy, sx = dh / height, dw / width
    t, lf = min(int(top * sy), dh - 1), min(int(left * sx), dw - 1)
    ch = max(1, min(round(h * sy), dh - t))
    cw = max(1, min(round(w * sx), dw - lf))
    return img, (t, lf, ch, cw)
