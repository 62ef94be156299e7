"""How a sample's pixels are stored in a shard and read back: the encodings and the sample index.

A cache stores each sample either as raw pixels (``raw``: uint8 rows of RGB, ``h·w·3`` bytes) or
encoded once with libjpeg-turbo at build time (``jpeg``: 4:2:0, the build's quality). Samples of a
cache whose shapes differ (the aspect-preserving ``--fit short``) or whose sizes differ (``jpeg``)
are found through a **sample index**: per shard, one row of four little-endian int64 per sample,
``(offset, nbytes, height, width)``, the sample's bytes lying at ``offset`` of the shard's data
file. The index is small (32 bytes a sample); a reader loads and checks it once per shard, and a
sample then costs one positioned read, as a square raw sample does.

The JPEG decoders here release the GIL (simplejpeg's binding does, and ctypes for the partial
decoder), so reader threads decode in parallel. :func:`decode_crop` decodes only as many pixels as a
crop needs: when the crop is at least twice the output size, libjpeg-turbo scales the image down in
the DCT domain while decoding (1/2, 1/4, 1/8 ...), and the crop box is mapped onto the smaller image;
with the optional partial decoder (``datapipe/_jpegcrop.c``, :func:`partial_decoder`) only the crop's
region is decoded, the same pixels as a whole decode's there. Stored JPEG samples carry a restart
marker after every MCU, so the partial decoder Huffman-decodes only the MCUs around the crop too.
"""

from __future__ import annotations

import ctypes
import importlib.machinery
import io
import math
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Literal, Protocol

import numpy as np

from . import native
from .errors import CorruptShardError

Encoding = Literal["raw", "jpeg"]
ENCODINGS: tuple[Encoding, ...] = ("raw", "jpeg")
DEFAULT_QUALITY = 90
JPEG_SUBSAMPLING = "420"  # as the JPEG files of ImageNet and FFCV's JPEG mode: half the bytes of 4:4:4 here
_PIL_SUBSAMPLING = {"444": 0, "422": 1, "420": 2}
RESTART_INTERVAL = 1  # MCUs between restart markers in stored JPEG samples (in the build's configuration)
INDEX_COLUMNS = ("offset", "nbytes", "height", "width")
INDEX_ROW_BYTES = 8 * len(INDEX_COLUMNS)

REWRITE_ADVICE = "rerun the same `datapipe build` with --verify to rewrite it (a plain rerun checks sizes, not contents)"


class EncodedLike(Protocol):
    """A stored JPEG sample (``datapipe.cache.EncodedSample``): its bytes, decoded shape and error location."""

    @property
    def data(self) -> np.ndarray | bytes: ...
    @property
    def height(self) -> int: ...
    @property
    def width(self) -> int: ...
    @property
    def where(self) -> str: ...


def encode(image: np.ndarray, encoding: Encoding, quality: int = DEFAULT_QUALITY) -> bytes | memoryview:
    """The stored bytes of a uint8 [H, W, 3] sample.

    JPEG samples are baseline 4:2:0 with a restart marker after every MCU (16x16 pixels): the
    partial decoder then Huffman-decodes only the MCUs around a crop (``datapipe/_jpegcrop.c``),
    for about 5 % more bytes. Any JPEG decoder reads them."""
    image = np.ascontiguousarray(image)
    if encoding == "raw":
        return image.data.cast("B")
    decoder = partial_decoder()
    if decoder is not None and decoder.encodes_as_pillow:  # the same bytes, a third less time
        return decoder.encode(image, int(quality), RESTART_INTERVAL)
    return _encode_pillow(image, int(quality))


def _encode_pillow(image: np.ndarray, quality: int) -> memoryview:
    from PIL import Image

    out = io.BytesIO()
    Image.fromarray(image).save(out, "JPEG", quality=quality, subsampling=_PIL_SUBSAMPLING[JPEG_SUBSAMPLING],
                                restart_marker_blocks=RESTART_INTERVAL)
    return out.getbuffer()


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
            return CorruptShardError(f"{where}: the sample index {what}; {REWRITE_ADVICE}")

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
    return CorruptShardError(f"{where}: the stored JPEG does not decode ({type(exc).__name__}: {exc}); {REWRITE_ADVICE}")


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
    pixels on each side, and the box is mapped onto the scaled image. With the partial decoder
    (``datapipe/_jpegcrop.c``) only the crop's region is decoded — its rows, and its columns from
    the iMCU boundary left of it — and the returned image is that region; without it the whole
    (scaled) image is. The crop's pixels are the same either way. The image lives in a per-thread
    buffer, valid until this thread decodes the next sample.

    Raises:
        CorruptShardError: the bytes do not decode, or their header gives another shape than the index.
    """
    m = _scale_eighths(box, out_size, height, width)
    decoder = partial_decoder()
    if decoder is None:
        return _decode_crop_whole(data, height, width, box, m, where)
    sh, sw = _scaled(height, m), _scaled(width, m)
    region = box if m == 8 else _map_box(box, height, width, sh, sw)
    return decoder.crop(data, height, width, m, region, where)


def _scaled(side: int, eighths: int) -> int:
    """A side decoded at ``eighths``/8 of its size (libjpeg rounds up)."""
    return -(-side * eighths // 8)


def _scale_eighths(box: tuple[int, int, int, int], out_size: int, height: int, width: int) -> int:
    """The DCT scale M (of M/8) a crop is decoded at: the smallest that leaves the crop ``out_size`` pixels
    on each side when it is at least twice ``out_size``, else 8 (no scaling) — the factor simplejpeg
    picks for the same minimum sizes."""
    _, _, h, w = box
    if min(h, w) / out_size < 2.0:
        return 8
    min_h, min_w = math.ceil(height * out_size / h), math.ceil(width * out_size / w)
    return next((m for m in range(1, 8) if _scaled(height, m) >= min_h and _scaled(width, m) >= min_w), 8)


def encoded_shapes(encoded: Sequence[EncodedLike]) -> np.ndarray:
    """The (height, width) of stored samples, int64 [n, 2] (a ``datapipe.cache.EncodedBatch``'s own array)."""
    arrays = getattr(encoded, "arrays", None)
    if arrays is not None:
        return np.asarray(arrays()[3], np.int64).reshape(-1, 2)
    return np.array([(e.height, e.width) for e in encoded], dtype=np.int64).reshape(-1, 2)


def crop_regions(boxes: np.ndarray, heights: np.ndarray, widths: np.ndarray, out_size: int) -> tuple[np.ndarray, np.ndarray]:
    """:func:`decode_crop`'s DCT scale and mapped box for every crop of a batch: (int32 [n, 4] boxes on the
    images decoded at their scales, int32 [n] scales in eighths), by the same per-crop rules."""
    boxes = np.asarray(boxes, np.int64).reshape(-1, 4)
    regions, eighths = np.empty((len(boxes), 4), np.int32), np.empty(len(boxes), np.int32)
    for i, (box, h, w) in enumerate(zip(boxes.tolist(), np.asarray(heights).tolist(), np.asarray(widths).tolist(), strict=True)):
        top, left, bh, bw = box
        eighths[i] = m = _scale_eighths((top, left, bh, bw), out_size, h, w)
        regions[i] = box if m == 8 else _map_box((top, left, bh, bw), h, w, _scaled(h, m), _scaled(w, m))
    return regions, eighths


def _map_box(box: tuple[int, int, int, int], height: int, width: int, dh: int, dw: int) -> tuple[int, int, int, int]:
    """The crop ``box`` of a ``height`` x ``width`` image, on the same image decoded at ``dh`` x ``dw``."""
    top, left, h, w = box
    sy, sx = dh / height, dw / width
    t, lf = min(int(top * sy), dh - 1), min(int(left * sx), dw - 1)
    return t, lf, max(1, min(round(h * sy), dh - t)), max(1, min(round(w * sx), dw - lf))


def _decode_crop_whole(data: bytes | np.ndarray, height: int, width: int, box: tuple[int, int, int, int], eighths: int,
                       where: str) -> tuple[np.ndarray, tuple[int, int, int, int]]:
    """:func:`decode_crop` with simplejpeg: the whole image, at ``eighths``/8 of its size."""
    import simplejpeg

    buffer = _scratch_buffer(height * width * 3)
    try:
        if eighths < 8:
            img = simplejpeg.decode_jpeg(data, colorspace="RGB", min_height=_scaled(height, eighths),
                                         min_width=_scaled(width, eighths), buffer=buffer)
        else:
            img = simplejpeg.decode_jpeg(data, colorspace="RGB", buffer=buffer)
    except (ValueError, RuntimeError) as exc:
        raise _decode_error(where, exc) from None
    dh, dw = img.shape[:2]
    if (dh, dw) == (height, width):
        return img, box
    if dh > height or dw > width or dh < 1 or dw < 1:
        raise _decode_error(where, ValueError(f"decoded {dh}x{dw}, the index says {height}x{width}"))
    return img, _map_box(box, height, width, dh, dw)


# ----------------------------------------------------------------------------- the partial decoder

_JPEGCROP_ABI = 2  # must match DATAPIPE_JPEGCROP_ABI in _jpegcrop.c
_ERRLEN = 200


class PartialDecoder:
    """``datapipe/_jpegcrop.c`` through ctypes (the GIL released while it decodes), with the libjpeg-turbo it opened."""

    def __init__(self, lib: ctypes.CDLL, libjpeg: str) -> None:
        self.libjpeg = libjpeg
        f = self._decode = lib.datapipe_jpeg_decode_crop
        f.restype = ctypes.c_int
        f.argtypes = [ctypes.c_void_p, ctypes.c_size_t, *[ctypes.c_int] * 7,
                      ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t]
        e = self._encode = lib.datapipe_jpeg_encode
        e.restype = ctypes.c_int
        e.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_int,
                      ctypes.c_void_p, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t]
        self._free = lib.datapipe_jpeg_free
        self._free.restype = None
        self._free.argtypes = [ctypes.c_void_p]
        b = self._batch = lib.datapipe_jpeg_train_batch
        b.restype = ctypes.c_int
        b.argtypes = [ctypes.c_int, *[ctypes.c_void_p] * 6, ctypes.c_int, *[ctypes.c_void_p] * 5, ctypes.c_ssize_t,
                      ctypes.c_int, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t]
        self._local = threading.local()
        #: its encoder writes Pillow's bytes (checked when opened): :func:`encode` uses it
        self.encodes_as_pillow = False

    def encode(self, image: np.ndarray, quality: int, restart: int) -> bytes:
        """``image`` (uint8 [H, W, 3], rows may be strided) as a baseline 4:2:0 JPEG with a restart marker every
        ``restart`` MCUs: the bytes Pillow's encoder writes for these options, without its per-image work."""
        if image.dtype != np.uint8 or image.ndim != 3 or image.shape[2] != 3 or image.strides[1:] != (3, 1):
            image = np.ascontiguousarray(image, dtype=np.uint8)
        out, size = ctypes.c_void_p(), ctypes.c_ulong()
        err = ctypes.create_string_buffer(_ERRLEN)
        if self._encode(image.ctypes.data, image.shape[0], image.shape[1], image.strides[0], quality, restart,
                        ctypes.byref(out), ctypes.byref(size), err, _ERRLEN) != 0:
            raise ValueError(f"cannot encode a {image.shape} sample: {err.value.decode(errors='replace')}")
        try:
            return ctypes.string_at(out, size.value)
        finally:
            self._free(out)

    def train_batch(self, encoded: Sequence[EncodedLike], boxes: Sequence[Sequence[int]], flips: Sequence[bool],
                    size: int, kernels: tuple[int, int], scale_shift: tuple[int, int], out: int, out_step: int,
                    planar: int) -> None:
        """The training crops of a batch in one call (the GIL released throughout): sample i's crop
        ``boxes[i]`` (top, left, h, w), decoded alone (DCT-scaled as :func:`decode_crop` does), resized
        to ``size`` x ``size`` and mirrored where ``flips[i]``, converted by the kernels at ``kernels``
        (resize, conversion: :func:`datapipe.native.kernel_addresses`) with the float32 ``scale_shift``
        addresses into ``out + i * out_step`` floats, planar [3, size, size] or [size, size, 3].

        Raises:
            CorruptShardError: a sample does not decode (named by its ``where``).
        """
        n = len(encoded)
        arrays = getattr(encoded, "arrays", None)  # a datapipe.cache.EncodedBatch: its arrays as they are
        if arrays is not None:
            buffer, starts, nbytes, _ = arrays()
            keep = [buffer]  # the bytes, alive through the call
            datas = (buffer.ctypes.data + starts).astype(np.uint64)
        else:
            keep = [e.data if isinstance(e.data, np.ndarray) and e.data.dtype == np.uint8 and e.data.flags.c_contiguous
                    else np.ascontiguousarray(np.frombuffer(bytes(e.data), np.uint8)) for e in encoded]
            nbytes = np.array([d.size for d in keep], dtype=np.int64)
            datas = np.array([d.__array_interface__["data"][0] for d in keep], dtype=np.uint64)
        shapes = encoded_shapes(encoded).astype(np.int32)
        if n and not nbytes.all():
            raise _decode_error(encoded[int(np.argmin(nbytes))].where, ValueError("the sample has no bytes"))
        sizes = nbytes.astype(np.uint64)
        regions, eighths = crop_regions(np.asarray(boxes, np.int64).reshape(n, 4), shapes[:, 0], shapes[:, 1], size)
        flip = np.asarray(flips, dtype=bool).astype(np.uint8).reshape(n)
        failed, err = ctypes.c_int32(-1), ctypes.create_string_buffer(_ERRLEN)
        rc = self._batch(n, datas.ctypes.data, sizes.ctypes.data, shapes.ctypes.data, regions.ctypes.data,
                         eighths.ctypes.data, flip.ctypes.data, size, kernels[0], kernels[1], scale_shift[0],
                         scale_shift[1], out, out_step, planar, ctypes.byref(failed), err, _ERRLEN)
        del keep
        message = err.value.decode(errors="replace")
        if rc == -1:
            raise _decode_error(encoded[failed.value].where, ValueError(message))
        if rc == -3:
            raise MemoryError(f"{encoded[failed.value].where}: {message}")
        if rc != 0:
            raise ValueError(f"{encoded[failed.value].where}: cannot decode the crop {tuple(boxes[failed.value])}: {message}")

    def crop(self, data: bytes | np.ndarray, height: int, width: int, eighths: int, box: tuple[int, int, int, int],
             where: str) -> tuple[np.ndarray, tuple[int, int, int, int]]:
        """The region of ``box`` (top, left, h, w; on the image scaled to ``eighths``/8) with the box mapped onto it.

        Raises:
            CorruptShardError: the bytes do not decode, or their header gives another shape than ``height`` x ``width``.
            ValueError: the box lies outside the scaled image.
        """
        local = self._local
        if not hasattr(local, "geom"):
            local.geom, local.err = (ctypes.c_int32 * 6)(), ctypes.create_string_buffer(_ERRLEN)
        src = data if isinstance(data, np.ndarray) else np.frombuffer(data, dtype=np.uint8)
        if src.dtype != np.uint8 or src.ndim != 1 or not src.flags.c_contiguous:
            src = np.ascontiguousarray(src, dtype=np.uint8).reshape(-1)
        if src.size == 0:
            raise _decode_error(where, ValueError("the sample has no bytes"))
        out = _scratch_buffer(height * width * 3)
        top, left, h, w = box
        rc = self._decode(src.ctypes.data, src.size, height, width, eighths, top, left, h, w, out.ctypes.data, out.nbytes,
                          local.geom, local.err, _ERRLEN)
        if rc == -1:
            raise _decode_error(where, ValueError(local.err.value.decode(errors="replace")))
        if rc != 0:
            raise ValueError(f"{where}: cannot decode the crop {box} at {eighths}/8: {local.err.value.decode(errors='replace')}")
        y0, x0, rows, cols = local.geom[:4]
        return out[: rows * cols * 3].reshape(rows, cols, 3), (top - y0, left - x0, h, w)


_open_lock = threading.Lock()
os.register_at_fork(after_in_child=lambda: globals().update(_open_lock=threading.Lock()))  # held by no thread there


@lru_cache(maxsize=1)
def _partial() -> tuple[PartialDecoder | None, str]:
    """(the partial decoder or None, a line saying which libjpeg it uses, or why there is none)."""
    with _open_lock:  # the library is opened once, whichever reader thread asks first
        return _open_partial()


def _open_partial() -> tuple[PartialDecoder | None, str]:
    if (off := native.switched_off()) is not None:
        return None, f"off ({off}): whole-image decodes with simplejpeg"
    here = Path(__file__).resolve().parent
    path = next((p for s in importlib.machinery.EXTENSION_SUFFIXES if (p := here / f"_jpegcrop{s}").exists()), None)
    if path is None:
        return None, "not built (no C compiler at install time): whole-image decodes with simplejpeg"
    try:
        lib = ctypes.CDLL(str(path))
        abi = lib.datapipe_jpegcrop_abi()
    except (OSError, AttributeError) as exc:
        return None, f"unusable ({path.name}: {exc}): whole-image decodes with simplejpeg"
    if abi != _JPEGCROP_ABI:
        return None, f"stale build ({path.name} has ABI {abi}, this datapipe needs {_JPEGCROP_ABI}; reinstall): whole-image decodes"
    lib.datapipe_jpeg_open.restype = ctypes.c_int
    lib.datapipe_jpeg_open.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t]
    err = ctypes.create_string_buffer(_ERRLEN)
    reasons = []
    for candidate in _libjpeg_candidates():
        if lib.datapipe_jpeg_open(os.fsencode(candidate), err, _ERRLEN) != 0:
            reasons.append(err.value.decode(errors="replace"))
            continue
        decoder = PartialDecoder(lib, candidate)
        mismatch = _self_check(decoder)
        if mismatch is None:
            encoder = "; samples encoded by it too" if decoder.encodes_as_pillow else ""
            return decoder, f"{path.name} with {candidate} (crops decoded alone{encoder})"
        return None, f"unusable ({candidate}: {mismatch}): whole-image decodes with simplejpeg"
    return None, f"no libjpeg-turbo found ({'; '.join(reasons[-2:])}): whole-image decodes with simplejpeg"


def _libjpeg_candidates() -> list[str]:
    """The libjpeg-turbo (v6.2 ABI) libraries to try, best first: Pillow's bundled one, then the system's."""
    found: list[str] = []
    try:
        import PIL

        pil = Path(PIL.__file__).resolve().parent
        for folder in (pil.parent / "pillow.libs", pil.parent / "Pillow.libs", pil / ".dylibs"):
            found += sorted(str(p) for p in folder.glob("libjpeg*62*"))
    except ImportError:
        pass
    return [*found, "libjpeg.so.62", "libjpeg.62.dylib"]


def _self_check(decoder: PartialDecoder) -> str | None:
    """None when the opened library's crops equal simplejpeg's whole decodes on a small 4:2:0 image (with and
    without restart markers), else what differs.

    The library was found at run time; its pixels must be those the rest of datapipe (and its tests) expect."""
    import simplejpeg

    yy, xx = np.mgrid[:37, :53]
    image = np.stack([xx * 5 % 256, (yy * 7 + xx) % 256, (xx * yy) % 256], axis=-1).astype(np.uint8)
    plain = simplejpeg.encode_jpeg(image, quality=90, colorspace="RGB", colorsubsampling="420")
    tiled = bytes(_encode_pillow(image, 90))  # restart markers: the crop's tiles are spliced out and decoded alone
    try:
        decoder.encodes_as_pillow = all(decoder.encode(image[:h, :w], q, RESTART_INTERVAL) == bytes(_encode_pillow(image[:h, :w], q))
                                        for h, w, q in ((37, 53, 90), (16, 17, 75), (1, 1, 100)))
    except ValueError:
        decoder.encodes_as_pillow = False
    for data, eighths, box in ((plain, 8, (3, 9, 21, 30)), (plain, 4, (5, 3, 11, 17)), (tiled, 8, (18, 17, 12, 14))):
        sh, sw = _scaled(37, eighths), _scaled(53, eighths)
        whole = simplejpeg.decode_jpeg(data, colorspace="RGB", min_height=sh, min_width=sw)
        try:
            img, (t, lf, h, w) = decoder.crop(data, 37, 53, eighths, box, "self-check")
        except (CorruptShardError, ValueError) as exc:
            return f"a test crop fails ({exc})"
        top, left, bh, bw = box
        if not np.array_equal(img[t : t + h, lf : lf + w], whole[top : top + bh, left : left + bw]):
            return f"its crop at {eighths}/8 differs from simplejpeg's decode"
    return None


def partial_decoder() -> PartialDecoder | None:
    """The partial decoder of crops, or None where it is not built, finds no libjpeg-turbo, or ``DATAPIPE_NATIVE=0``."""
    return _partial()[0]


def describe_decoder() -> str:
    """One line: how :func:`decode_crop` decodes (the partial decoder and its libjpeg, or why whole images)."""
    return _partial()[1]
