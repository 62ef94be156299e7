"""Sniffing, decoding and normalising one image file into a canonical uint8 RGB sample.

Canonical means: whatever the decoder, the sample for a given file and configuration is uint8 RGB
H×W×3 with EXIF orientation applied (broken EXIF tolerated), CMYK/YCCK converted, grayscale and
palette images expanded, alpha composited onto a fixed background and 16-bit data scaled (not
clipped). JPEGs go through libjpeg-turbo (``simplejpeg``, which ships the library in its wheel) with
DCT-domain downscaling by powers of two when the source is at least twice the target; every other
format (and CMYK/YCCK JPEGs, which libjpeg-turbo cannot convert to RGB) goes through Pillow.

What is kept and what is quarantined follows Pillow (with ``LOAD_TRUNCATED_IMAGES`` off): a file is
kept when it decodes fully. For JPEGs, every libjpeg-turbo message is damage except the few that
leave the pixels intact (:data:`_JPEG_HARMLESS`: junk bytes between header segments, a bad ICC chunk,
...): truncated data (``Premature end of JPEG file``, even when only the end marker is missing) is
refused, as Pillow refuses it; so is scan data that ends early, does not decode or is longer than
its blocks need, which Pillow would keep with grey or garbage blocks in place of the picture. PNGs
and deflate TIFFs must also pass their own checksums, which Pillow does not check
(:func:`_checksum_error`). Orientation is what ``ImageOps.exif_transpose`` applies, and
``max_pixels`` alone says what is too large (not Pillow's ``MAX_IMAGE_PIXELS``, see
:func:`_pillow_limit`).
"""

from __future__ import annotations

import io
import math
import numbers
import os
import re
import struct
import threading
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from .errors import ArgumentError, DecodeError, one_line
from .records import MAX_SIZE, long_side_cap

if TYPE_CHECKING:
    from types import ModuleType

    from PIL import Image

Fit = Literal["crop", "pad", "stretch", "short"]
FITS = ("crop", "pad", "stretch", "short")
BACKGROUND = (255, 255, 255)  # alpha is composited onto white, and pad fills with it
DEFAULT_MAX_PIXELS = 100_000_000

_MAGIC = (
    (b"\xff\xd8\xff", "jpeg"),
    (b"\x89PNG\r\n\x1a\n", "png"),
    (b"GIF87a", "gif"),
    (b"GIF89a", "gif"),
    (b"BM", "bmp"),
    (b"II*\x00", "tiff"),
    (b"MM\x00*", "tiff"),
    (b"II+\x00", "tiff"),  # BigTIFF
    (b"MM\x00+", "tiff"),
    (b"II\x00*", "tiff"),  # byte order and magic disagree: Pillow reads these too
    (b"MM*\x00", "tiff"),
)
# A Netpbm header's start: P1..P6, then whitespace and comments, then the width's first digit (or a comment running
# past the 16 bytes sniffed): "P1 is a text" is no picture
_NETPBM = re.compile(rb"P[1-6](\s|#[^\n]*(\n|$))+([0-9]|$|#)")
# Pillow's plugin for each sniffed format: a file is only ever opened as what its content says.
_PILLOW_FORMATS = {"jpeg": "JPEG", "png": "PNG", "gif": "GIF", "bmp": "BMP", "dib": "DIB", "tiff": "TIFF", "webp": "WEBP",
                   "ppm": "PPM"}
_DIB_HEADERS = (12, 40, 52, 56, 64, 108, 124)  # BITMAPCOREHEADER, BITMAPINFOHEADER ... BITMAPV5HEADER
_DIB_DEPTHS = (1, 2, 4, 8, 16, 24, 32)


def sniff(head: bytes) -> str | None:
    """Return the image format named by the first bytes of a file (16 are enough), or None if it is not an image."""
    for magic, name in _MAGIC:
        if head.startswith(magic):
            return name
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return "webp"
    if _NETPBM.match(head):
        return "ppm"  # Netpbm: PBM, PGM, PPM, plain or raw (GTSRB's pictures)
    if _is_dib(head):
        return "dib"
    return None


# Formats of pictures datapipe does not decode, by their first bytes: ISO-BMFF image brands (HEIF/HEIC, AVIF),
# JPEG 2000 (its file format and a bare codestream), JPEG XL (a bare codestream and its container)
_HEIF_BRANDS = {b"heic": "HEIC", b"heix": "HEIC", b"heim": "HEIC", b"heis": "HEIC", b"hevc": "HEIC", b"hevx": "HEIC",
                b"mif1": "HEIF", b"msf1": "HEIF", b"avif": "AVIF", b"avis": "AVIF"}
_UNDECODED_MAGIC = ((b"\x00\x00\x00\x0cjP  \r\n\x87\n", "JPEG 2000"), (b"\xff\x4f\xff\x51", "JPEG 2000"),
                    (b"\xff\x0a", "JPEG XL"), (b"\x00\x00\x00\x0cJXL \r\n\x87\n", "JPEG XL"))


def undecoded_format(head: bytes) -> str | None:
    """The name of the picture format ``head`` (a file's first 16 bytes) starts, when it is one datapipe does not
    decode (HEIC, HEIF, AVIF, JPEG 2000, JPEG XL); None otherwise (another format, or no picture)."""
    if head[4:8] == b"ftyp":
        return _HEIF_BRANDS.get(head[8:12])
    return next((name for magic, name in _UNDECODED_MAGIC if head.startswith(magic)), None)


def _is_dib(head: bytes) -> bool:
    """A bare device-independent bitmap (a .dib, a BMP without its 14-byte file header).

    Pillow accepts any file whose first 4 bytes are one of the header sizes; a plane count of 1 and a
    valid bit depth are checked too, so that little else passes for one.
    """
    if len(head) < 16:
        return False
    size = struct.unpack("<I", head[:4])[0]
    if size not in _DIB_HEADERS:
        return False
    planes, depth = struct.unpack("<HH", head[8:12] if size == 12 else head[12:16])
    return planes == 1 and depth in _DIB_DEPTHS



def plain_int(value: object) -> object:
    """``value`` as a Python int when it is a whole number of another type (numpy's int64, ...), else as it is
    (a bool, a float or a string stays, for the caller's check to refuse)."""
    if isinstance(value, numbers.Integral) and not isinstance(value, bool) and type(value) is not int:
        return int(value)
    return value


@dataclass(frozen=True)
class DecodeSpec:
    """What every sample is turned into: the decoding part of the build configuration (and of its
    hash). :class:`datapipe.BuildSpec` extends it with how the samples are stored."""

    size: int = 256
    fit: Fit = "crop"
    max_pixels: int = DEFAULT_MAX_PIXELS
    max_aspect: float = 2.0  # fit="short" only: the longer side is cut to at most max_aspect * size

    def __post_init__(self) -> None:
        for name in ("size", "max_pixels"):  # a numpy integer is the number it holds
            object.__setattr__(self, name, plain_int(getattr(self, name)))
        if isinstance(self.max_aspect, numbers.Real) and not isinstance(self.max_aspect, (bool, int, float)):
            object.__setattr__(self, "max_aspect", float(self.max_aspect))  # numpy's float32 and int64
        # Named as the command line spells them: these are the options of `datapipe build`.
        if isinstance(self.size, bool) or not isinstance(self.size, int) or not 8 <= self.size <= MAX_SIZE:
            raise ArgumentError(f"--size must be an integer from 8 to {MAX_SIZE}, got {self.size!r}")
        if self.fit not in FITS:
            raise ArgumentError(f"--fit must be one of {', '.join(FITS)}, got {self.fit!r}")
        if isinstance(self.max_pixels, bool) or not isinstance(self.max_pixels, int) or self.max_pixels < 1:
            raise ArgumentError(f"--max-pixels must be a positive integer, got {self.max_pixels!r}")
        ok = isinstance(self.max_aspect, (int, float)) and not isinstance(self.max_aspect, bool)
        if not ok or not 1.0 <= self.max_aspect <= 8.0:  # NaN fails the range too
            raise ArgumentError(f"--max-aspect must be a number from 1 to 8, got {self.max_aspect!r}")
        if self.fit == "short" and long_side_cap(self.size, self.max_aspect) > MAX_SIZE:
            # refused before any work: a cache of such samples would be refused by every reader
            raise ArgumentError(
                f"--fit short with --size {self.size} and --max-aspect {self.max_aspect:g} gives samples a longer side of "
                f"up to {long_side_cap(self.size, self.max_aspect):,} pixels, over the {MAX_SIZE:,} a cache holds: "
                f"lower --max-aspect to at most {math.floor(MAX_SIZE / self.size * 1000) / 1000:g}, or --size")

    @property
    def max_side(self) -> int:
        """The longest side a sample can have: ``size``, or for ``short`` floor(max_aspect * size)."""
        return long_side_cap(self.size, self.max_aspect) if self.fit == "short" else self.size


# ----------------------------------------------------------------------------- decoders on offer


def decoder_info() -> dict[str, str]:
    """Which decoders are active in this process, with versions (for `datapipe info --env`)."""
    info: dict[str, str] = {}
    try:
        import simplejpeg

        info["jpeg"] = f"simplejpeg {simplejpeg.__version__} (libjpeg-turbo bundled in the wheel)"
    except Exception as exc:  # noqa: BLE001 - any import failure means "not active"
        info["jpeg"] = f"Pillow (simplejpeg unavailable: {type(exc).__name__}: {exc})"
    try:
        import PIL
        from PIL import features

        turbo = features.check_feature("libjpeg_turbo")
        simd = "post" in PIL.__version__  # Pillow-SIMD versions carry a .postN suffix
        flavour = "Pillow-SIMD" if simd else "Pillow"
        jpeg = f", libjpeg-turbo {features.version('libjpeg_turbo')}" if turbo else ""
        info["other"] = f"{flavour} {PIL.__version__}{jpeg}"
    except Exception as exc:  # noqa: BLE001
        info["other"] = f"unavailable: {exc}"
    try:
        import turbojpeg  # noqa: F401  (optional; reported, not required)

        info["pyturbojpeg"] = "installed (optional; simplejpeg is used)"
    except Exception:  # noqa: BLE001
        info["pyturbojpeg"] = "not installed (optional)"
    return info


def _simplejpeg():
    try:
        import simplejpeg

        return simplejpeg
    except ImportError:  # pragma: no cover - the wheel is a hard dependency
        return None


# ----------------------------------------------------------------------------- EXIF orientation


_XMP_ID = b"http://ns.adobe.com/xap/1.0/\x00"
# Markers Pillow's JPEG parser steps over without reading a length: JPG, RSTn, SOI, EOI, JPGn
_NO_LENGTH = frozenset({0xC8, *range(0xD0, 0xDA), *range(0xF0, 0xFE)})
# Bytes per value of each IFD field type (TIFF 6 and BigTIFF): any other type is left to Pillow
_IFD_TYPE_SIZES = {1: 1, 2: 1, 3: 2, 4: 4, 5: 8, 6: 1, 7: 1, 8: 2, 9: 4, 10: 8, 11: 4, 12: 8, 13: 4, 16: 8, 17: 8, 18: 8}
# exif_transpose looks the value up in a dict keyed 2..8: 6, 6.0 and a rational 6/1 all turn the image
_TRANSPOSING = {k: k for k in range(2, 9)}
_ABSENT, _ASK_PILLOW = "absent", "ask Pillow"
_CUT = "cut short"  # the first IFD does not end in this segment: what follows in the next EXIF segment may continue it


def jpeg_orientation(data: bytes) -> int:
    """The EXIF orientation (1–8) that Pillow's ``ImageOps.exif_transpose`` applies to this JPEG; 1 when
    there is none or the metadata is broken (where exif_transpose would raise).

    Pillow's rules: the Orientation tag of the first IFD of the EXIF data (every APP1 ``Exif``
    segment, joined), whatever its field type (a LONG, a float or a rational 6/1 rotate as a SHORT 6
    does); when the EXIF has none, ``tiff:Orientation`` in the last XMP segment. The usual case, an
    EXIF segment whose first IFD holds a single SHORT (or no orientation, and no XMP one), is read
    here (under 10 µs); every other form is read by Pillow itself (about 0.1 ms), so that the result
    is Pillow's by construction.
    """
    found: int | str = _ABSENT
    first: int | str = _ABSENT
    exif_segments, xmp, segments = 0, None, []
    for marker_payload in _jpeg_app1(data):
        if marker_payload.startswith(_XMP_ID):
            xmp = marker_payload[len(_XMP_ID) :]
            continue
        exif_segments += 1
        segments.append(marker_payload)
        if exif_segments == 1:
            first = _exif_orientation(marker_payload)
            found = _ABSENT if first == _CUT else first  # alone, a first IFD cut short is read as far as it goes
        else:
            # Later EXIF segments only lengthen the data Pillow reads the first IFD from: they change nothing when
            # it ends in the first segment (and Pillow joins thousands of them in quadratic time, minutes in all).
            found = _ABSENT if first == _ABSENT else _ASK_PILLOW
        if isinstance(found, int):
            return _TRANSPOSING.get(found, 1)
    if found == _ABSENT and (xmp is None or b"tiff:Orientation" not in xmp):
        return 1
    if exif_segments > 1:  # Pillow joins them in quadratic time (60,000 small segments: 20 s)
        return _joined_exif_orientation(segments, xmp)
    return _pillow_jpeg_orientation(data)


def _joined_exif_orientation(segments: list[bytes], xmp: bytes | None) -> int:
    """:func:`_pillow_jpeg_orientation` of a JPEG whose APP1 ``Exif`` segments are ``segments`` and whose last XMP
    segment holds ``xmp``, by Pillow's rules, in linear time: its EXIF data the segments joined as its parser joins
    them (the first whole, the others without their ``Exif`` header), read by Pillow's ``Exif``; the XMP's
    ``tiff:Orientation`` when that has none."""
    import warnings

    from PIL import Image

    joined = segments[0] + b"".join(segment[6:] for segment in segments[1:])
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "Corrupt EXIF data": EXIF is optional
            exif = Image.Exif()
            exif.load(joined)
            value = exif.get(0x0112)
    except Exception:  # noqa: BLE001 - broken metadata is tolerated (exif_transpose would raise), the image is not
        return 1
    if value is None and xmp is not None and (match := re.search(rb'tiff:Orientation(="|>)([0-9])', xmp)):
        value = int(match[2])
    try:
        return _TRANSPOSING.get(value, 1)  # type: ignore[arg-type]
    except TypeError:  # a value of no hashable kind: exif_transpose's lookup raises
        return 1


def _jpeg_app1(data: bytes) -> Iterator[bytes]:
    """The APP1 ``Exif`` and XMP segments of a JPEG's header (their payloads), found as Pillow's parser
    walks the header (:func:`_jpeg_segments`)."""
    for marker, start, end in _jpeg_segments(data):
        if marker == 0xE1 and data.startswith((b"Exif\x00\x00", _XMP_ID), start, end):
            yield data[start:end]


def _jpeg_segments(data: bytes, pos: int = 2) -> Iterator[tuple[int, int, int]]:
    """(marker, start, end) of each segment of a JPEG's header from ``pos``, its payload ``data[start:end]``,
    found as Pillow's parser walks the header: junk bytes, fill bytes and stuffed zeros are skipped,
    markers without a length yield an empty payload; the walk ends after the start of scan, and where
    Pillow would refuse the header (a marker it does not know, a segment cut short). What lies inside a
    segment (an EXIF thumbnail, which is a JPEG of its own) is never read as markers."""
    n = len(data)
    while pos + 1 < n:
        if data[pos] != 0xFF:  # junk: Pillow reads on, byte by byte
            nxt = data.find(b"\xff", pos + 1)
            if nxt < 0:
                return
            pos = nxt
            continue
        marker = data[pos + 1]
        if marker == 0xFF:  # fill byte
            pos += 1
            continue
        if marker == 0x00:  # a stuffed zero
            pos += 2
            continue
        if marker < 0xC0:
            return
        pos += 2
        if marker in _NO_LENGTH:
            yield marker, pos, pos
            continue
        if pos + 2 > n:
            return
        size = max(0, struct.unpack(">H", data[pos : pos + 2])[0] - 2)
        if pos + 2 + size > n:
            return
        yield marker, pos + 2, pos + 2 + size
        if marker == 0xDA:
            return
        pos += 2 + size


@dataclass(frozen=True)
class JpegFrame:
    """A JPEG's frame header (its SOFn segment): the coding process and sample precision."""

    marker: int  # 0xC0 baseline, 0xC1 extended, 0xC2 progressive, 0xC3 lossless, 0xC9-0xCB arithmetic, ...
    precision: int  # bits per sample: 8 in nearly every JPEG; 12 or 16 (lossless) in medical and camera-raw files
    height: int = -1  # 0: given later, by a DNL marker after the first scan; -1: the segment is cut short
    width: int = -1

    @property
    def lossless(self) -> bool:
        """A lossless frame (SOF3, SOF7, SOF11, SOF15): no DCT, so no DCT-domain downscaling either."""
        return self.marker & 0x03 == 0x03

    @property
    def hierarchical(self) -> bool:
        """A hierarchical frame (SOF5-7, SOF13-15), which libjpeg-turbo and Pillow do not decode."""
        return self.marker in (0xC5, 0xC6, 0xC7, 0xCD, 0xCE, 0xCF)


def jpeg_frame(data: bytes) -> JpegFrame | None:
    """The frame header of the JPEG in ``data`` (the main image's, never an EXIF thumbnail's); None when the
    header holds none before its first scan, or it is cut short."""
    for marker, start, end in _jpeg_segments(data):
        if marker in _JPEG_SOF and end > start:
            if end - start >= 5:
                height, width = struct.unpack(">HH", data[start + 1 : start + 5])
                return JpegFrame(marker, data[start], height, width)
            return JpegFrame(marker, data[start])
    return None


MAX_SCANS = 500  # a progressive JPEG has about 10 scans; each is a pass over the whole image (libjpeg-turbo's advice)
_PROGRESSIVE_SOF = (0xC2, 0xCA)


def _scans(data: bytes) -> int:
    """The number of scans of a JPEG: its start-of-scan markers (:func:`_jpeg_walk`)."""
    return sum(1 for marker, _, _ in _jpeg_walk(data) if marker == 0xDA)


def _jpeg_end(data: bytes) -> tuple[int, int]:
    """(where the last scan's coded data starts, where the end-of-image marker is) in a JPEG (:func:`_jpeg_walk`);
    (-1, -1) when it has no end marker."""
    scan = -1
    for marker, _, end in _jpeg_walk(data):
        if marker == 0xDA:
            scan = end
        elif marker == 0xD9:
            return scan, end - 2
    return -1, -1


def _jpeg_walk(data: bytes) -> Iterator[tuple[int, int, int]]:
    """(marker, start, end) of every segment of a JPEG in order (:func:`_jpeg_segments`), through its scans: each
    scan's coded data is skipped as a decoder skips it, to the next marker that is neither a stuffed zero nor a
    restart marker. Ends at the end-of-image marker, or where the file ends or stops being a JPEG."""
    pos, n = 2, len(data)
    while True:
        marker = None
        for marker, start, end in _jpeg_segments(data, pos):
            yield marker, start, end
            if marker == 0xD9:
                return
            pos = end
        if marker != 0xDA:
            return
        while True:
            ff = data.find(b"\xff", pos)
            if ff < 0 or ff + 1 >= n:
                return
            follower = data[ff + 1]
            if follower == 0x00 or 0xD0 <= follower <= 0xD7:
                pos = ff + 2
            elif follower == 0xFF:
                pos = ff + 1
            else:
                pos = ff
                break


def _exif_orientation(segment: bytes) -> int | str:
    """The orientation in one APP1 ``Exif`` segment, read as Pillow reads it: its value when the first
    IFD's first Orientation entry is one SHORT; :data:`_ABSENT` when that IFD has none; else
    :data:`_ASK_PILLOW` (another field type, another TIFF header, or an entry before it whose data
    lies outside the segment, which makes Pillow stop reading the IFD)."""
    tiff = segment[6:]
    order = {b"II*\x00": "<", b"MM\x00*": ">"}.get(tiff[:4])
    if order is None or len(tiff) < 8:
        return _CUT if not tiff else _ASK_PILLOW  # an empty segment: the next one's data is all Pillow reads
    ifd = struct.unpack(order + "I", tiff[4:8])[0]
    if ifd + 2 > len(tiff):
        return _CUT  # Pillow reads no entry of this segment alone
    count = struct.unpack(order + "H", tiff[ifd : ifd + 2])[0]
    elsewhere = 0  # bytes of values stored outside their entries, as Pillow counts them against the size
    for i in range(count):
        start = ifd + 2 + 12 * i
        if start + 12 > len(tiff):
            return _CUT  # the IFD is cut short before any orientation: Pillow keeps what it read
        tag, typ, number, value = struct.unpack(order + "HHI4s", tiff[start : start + 12])
        if tag == 0x0112:
            return struct.unpack(order + "H", value[:2])[0] if typ == 3 and number == 1 else _ASK_PILLOW
        unit = _IFD_TYPE_SIZES.get(typ)
        if unit is None:
            return _ASK_PILLOW
        if number * unit > 4:
            offset = struct.unpack(order + "I", value)[0]
            elsewhere += number * unit
            if elsewhere > len(tiff) or offset + number * unit > len(tiff):
                return _ASK_PILLOW
    return _ABSENT


def _pillow_jpeg_orientation(data: bytes) -> int:
    """The orientation Pillow reads from a JPEG's metadata (what exif_transpose applies); 1 where Pillow
    cannot open the file or raises on its EXIF."""
    import warnings

    from PIL import Image

    try:
        with warnings.catch_warnings(), _pillow_limit(None):  # metadata only: no pixel is decoded
            warnings.simplefilter("ignore", UserWarning)  # "Corrupt EXIF data": EXIF is optional
            with Image.open(io.BytesIO(data), formats=["JPEG"]) as img:
                return _TRANSPOSING.get(img.getexif().get(0x0112, 1), 1)
    except Exception:  # noqa: BLE001 - broken metadata is tolerated, the image is not
        return 1


def apply_orientation(img: np.ndarray, orientation: int) -> np.ndarray:
    """Undo EXIF orientation on an H×W×C array (views, no copy)."""
    if orientation == 2:
        return img[:, ::-1]
    if orientation == 3:
        return img[::-1, ::-1]
    if orientation == 4:
        return img[::-1]
    if orientation == 5:
        return img.transpose(1, 0, 2)
    if orientation == 6:
        return np.rot90(img, -1)
    if orientation == 7:
        return img[::-1, ::-1].transpose(1, 0, 2)
    if orientation == 8:
        return np.rot90(img, 1)
    return img


# ----------------------------------------------------------------------------- geometry


def _resize(img: np.ndarray, height: int, width: int, out: np.ndarray | None = None) -> np.ndarray:
    """Antialiased bilinear resize of a uint8 H×W×3 array: datapipe's compiled kernel
    (:func:`datapipe.native.resize`) where it is built, else torch's AVX2 uint8 kernel, which gives
    the same pixels (docs/build.md, *CPU kernel*, has the timings).

    Input and output stay channels-last (H×W×3 in memory): with an ``out=`` tensor in that layout
    torch skips two transposing copies. A cropped view is read in place;
    any other view (mirrored or transposed by EXIF orientation) is first copied, see :func:`_packed`.
    """
    if out is None:
        out = np.empty((height, width, 3), np.uint8)
    if img.shape[0] == height and img.shape[1] == width:
        out[...] = img
        return out
    from datapipe import native

    img = _packed(img)
    if native.resize(img, out):  # the compiled kernel: the same pixels as torch's, faster
        return out
    if not img.flags.writeable:  # torch.from_numpy needs writable memory
        img = img.copy()
    import torch  # the build's shard loop runs this with one intra-op thread (builder.build_shard)

    src = torch.from_numpy(img).permute(2, 0, 1)[None]
    dst = torch.from_numpy(out).permute(2, 0, 1)[None]
    try:
        torch.ops.aten._upsample_bilinear2d_aa.out(src, [height, width], False, None, None, out=dst)
    except (AttributeError, RuntimeError):  # pragma: no cover - older torch without the out= overload
        import torch.nn.functional as F

        res = F.interpolate(src, size=(height, width), mode="bilinear", antialias=True, align_corners=False)
        dst.copy_(res)
    return out


def _packed(img: np.ndarray) -> np.ndarray:
    """``img`` itself where both resize kernels read it as is — rows at a positive stride, pixels
    3 bytes apart, channels adjacent (a crop of a decoded image) — else a contiguous copy.

    The compiled kernel takes nothing else; torch's takes more, but copying for both keeps one rule.
    EXIF orientations 2–8 give such views: mirrored (negative strides) or transposed (pixels a row apart).
    """
    rows, pixels, channels = img.strides
    if pixels == 3 and channels == 1 and rows >= 3 * img.shape[1] and img.dtype == np.uint8:
        return img
    # a fresh array, not np.ascontiguousarray: numpy calls a view with a dimension of 1 contiguous
    # whatever that dimension's stride (a 1-row crop of a mirrored image keeps a negative one)
    return np.array(img, dtype=np.uint8, order="C", copy=True)


@dataclass(frozen=True)
class FitShape:
    """Where an image of a given size ends up: the sample's height and width, and whether its longer
    side was cut by ``max_aspect`` (fit="short" only)."""

    height: int
    width: int
    capped: bool = False


def fit_shape(height: int, width: int, spec: DecodeSpec) -> FitShape:
    """The shape of the sample an oriented ``height`` x ``width`` image becomes under ``spec``.

    ``short``: the shorter side becomes ``size`` exactly, the longer one keeps the aspect (rounded,
    at least ``size``) up to :func:`long_side_cap`; beyond that it is cut (``capped``). Every other
    fit gives a square of ``size``.
    """
    size = spec.size
    if spec.fit != "short":
        return FitShape(size, size)
    short, long = min(height, width), max(height, width)
    natural = max(size, round(long * size / short))
    cap = long_side_cap(size, spec.max_aspect)
    out_long = min(natural, cap)
    return FitShape(*((size, out_long) if height <= width else (out_long, size)), capped=natural > cap)


def _target(shape: tuple[int, int, int], out: np.ndarray | None) -> np.ndarray:
    """``out`` when it has ``shape``; a view of its first bytes when it is a flat uint8 buffer large
    enough (a reusable scratch for samples of varying shapes); else a new array."""
    if out is not None and out.dtype == np.uint8:
        if out.shape == shape:
            return out
        n = shape[0] * shape[1] * shape[2]
        if out.ndim == 1 and out.size >= n and out.flags.c_contiguous:
            return out[:n].reshape(shape)
    return np.empty(shape, np.uint8)


def fit_image(img: np.ndarray, spec: DecodeSpec, out: np.ndarray | None = None, *,
              source: tuple[int, int] | None = None) -> np.ndarray:
    """Resize an oriented H×W×3 uint8 array into the sample ``spec`` describes (see :func:`fit_shape`):
    crop/pad/stretch to ``size`` × ``size``, or ``short`` with the shorter side at ``size``.

    ``source``: the (height, width) of the image ``img`` was decoded from when it is smaller (a JPEG
    downscaled in the DCT): the sample's shape, and the picture's inside a padded one, are those of the
    image itself, whatever the decoder's scale. ``out`` is written when it has the sample's shape, or is
    a flat uint8 buffer of at least the sample's bytes (a view of its start is returned); otherwise a new
    array is returned.
    """
    h, w = img.shape[:2]
    size = spec.size
    full_h, full_w = source or (h, w)
    shape = fit_shape(full_h, full_w, spec)
    out = _target((shape.height, shape.width, 3), out)
    if spec.fit == "crop":
        side = min(h, w)
        y0, x0 = (h - side) // 2, (w - side) // 2
        return _resize(img[y0 : y0 + side, x0 : x0 + side], size, size, out)
    if spec.fit == "stretch":
        return _resize(img, size, size, out)
    if spec.fit == "short":
        return _resize(_short_crop(img, shape), shape.height, shape.width, out)
    scale = size / max(full_h, full_w)
    nh, nw = max(1, round(full_h * scale)), max(1, round(full_w * scale))
    out[...] = BACKGROUND
    y0, x0 = (size - nh) // 2, (size - nw) // 2
    out[y0 : y0 + nh, x0 : x0 + nw] = _resize(img, nh, nw)
    return out


def _short_crop(img: np.ndarray, shape: FitShape) -> np.ndarray:
    """The centred part of ``img`` along its longer side that a capped ``short`` sample shows: the
    longer side's source pixels in proportion to the cap (the whole image when it is not capped)."""
    if not shape.capped:
        return img
    h, w = img.shape[:2]
    short = min(h, w)
    if h <= w:
        keep = min(w, max(1, round(shape.width * short / shape.height)))
        x0 = (w - keep) // 2
        return img[:, x0 : x0 + keep]
    keep = min(h, max(1, round(shape.height * short / shape.width)))
    y0 = (h - keep) // 2
    return img[y0 : y0 + keep]


def dct_factor(height: int, width: int, spec: DecodeSpec) -> int:
    """The largest power-of-two DCT downscale (1, 2, 4 or 8) that keeps enough pixels for spec:
    at least ``size`` on the side that becomes ``size`` (the longer one for pad, the shorter for
    crop and short; both for stretch, so the shorter)."""
    limit = max(height, width) if spec.fit == "pad" else min(height, width)
    factor = 1
    while factor < 8 and limit // (factor * 2) >= spec.size:
        factor *= 2
    return factor


# ----------------------------------------------------------------------------- colour


_WIDE = ("I;16", "I;16L", "I;16B", "I;16N", "I")  # integer samples read as 0..65535
_ALPHA = ("RGBA", "LA", "PA")  # straight alpha: Pillow converts these to RGBA exactly
_PREMULTIPLIED = {"RGBa": 3, "La": 1}  # colour already multiplied by alpha: composited as is


def _white_is_zero_wide(img: Image.Image) -> bool:
    """Whether ``img`` (opened, not loaded) is a gray TIFF of 16-bit, 32-bit or float samples whose
    PhotometricInterpretation says 0 is white (WhiteIsZero), which Pillow reads as stored: it inverts only
    the 1- to 8-bit ones (raw mode ``L;I`` and the like)."""
    tags, tiles = getattr(img, "tag_v2", None), getattr(img, "tile", None)
    try:
        if img.mode not in (*_WIDE, "F") or tags is None or tags.get(262) != 0:
            return False
        rawmode = tiles[0][3][0] if tiles and tiles[0][3] else None
    except (AttributeError, IndexError, TypeError):
        return False
    return isinstance(rawmode, str) and not rawmode.endswith(";I")


# Raw modes of wide TIFF samples in a fixed byte order that Pillow (up to 13 at least) gives its libtiff decoder,
# which returns every sample in the machine's byte order: Pillow makes only the ";16B"/";16L" modes native, so
# these come out with their bytes swapped (the big-endian ones on little-endian machines, and the other way
# round). Each is read in the native mode here.
_LIBTIFF_NATIVE = {"F;32BF": "F;32NF", "I;16BS": "I;16NS", "I;32BS": "I;32NS",
                   "F;32F": "F;32NF", "I;16S": "I;16NS", "I;32S": "I;32NS"}


def _mend_tiff_tiles(img: Image.Image) -> None:
    """Have Pillow read ``img`` (a TIFF, opened, not loaded) right where its tiles name the wrong raw mode: a file
    of wide samples on its libtiff path (:data:`_LIBTIFF_NATIVE`), and an uncompressed one of separate planes
    (PlanarConfiguration 2), whose tiles Pillow gives the first letter of the raw mode only: ``R``, ``G`` and
    ``B`` read each 16-bit sample as two 8-bit pixels, and a single plane loses its bit depth or byte order
    (``I`` for ``I;16``) or its inversion (``L`` for ``L;I``).

    Raises:
        DecodeError: ("unsupported") several planes of wide samples in a layout with no raw mode for its planes
            here (CMYK, extra samples, 32 bits).
    """
    tags, tiles = getattr(img, "tag_v2", None), list(getattr(img, "tile", None) or ())
    if tags is None or not tiles:
        return
    bits = tags.get(258) or (1,)
    bits = bits if isinstance(bits, tuple) else (bits,)
    if tags.get(284) == 2 and img.mode in ("LA", "La", "PA") and any(tile[0] == "libtiff" for tile in tiles):
        raise DecodeError("unsupported TIFF: a gray or palette image with alpha in separate planes (PlanarConfiguration "
                          "2), compressed, whose alpha Pillow reads as 0; convert the file (e.g. `tiffcp -p contig IN "
                          "OUT`, or to a PNG)", "unsupported")
    planar = tags.get(284) == 2 and any(tile[0] == "raw" for tile in tiles)  # (codec, box, offset, args)
    whole = _single_plane_rawmode(img) if planar and tags.get(277, 1) == 1 else None
    separate = planar and whole is None and max(bits) > 8
    if separate:
        band = f";16{'B' if tags.prefix == b'MM' else 'L'}"
        if img.mode not in ("RGB", "RGBA") or set(bits) != {16} or \
                any(not (tile[3] and tile[3][0] in tuple("RGBA"[:len(img.mode)])) for tile in tiles):
            raise DecodeError(f"unsupported TIFF: {'/'.join(map(str, bits))}-bit samples in separate planes "
                              "(PlanarConfiguration 2), which Pillow reads as 8-bit; convert the file (e.g. "
                              "`tiffcp -p contig IN OUT`, or to a PNG)", "unsupported")
    mended = []
    for tile in tiles:
        codec, args = tile[0], tile[3]
        rawmode = args[0] if args else None
        if codec == "libtiff" and rawmode in _LIBTIFF_NATIVE:
            rawmode = _LIBTIFF_NATIVE[rawmode]
        elif whole is not None and codec == "raw":
            rawmode = whole
        elif separate and codec == "raw" and isinstance(rawmode, str):
            rawmode += band
        else:
            mended.append(tile)
            continue
        mended.append(_with_rawmode(tile, rawmode))
    setattr(img, "tile", mended)  # noqa: B010 - an ImageFile's, which Image does not declare


def _tiff_samples(img: Image.Image) -> int | None:
    """The largest value the integer samples of ``img`` (a TIFF, opened) hold, where it is not their Pillow mode's:
    unsigned 32-bit samples (SampleFormat 1), which Pillow reads into its signed mode ``I`` (2**31 and above come
    out negative), and 12-bit ones, which it reads into ``I;16`` as 0..4095 (ImageMagick's reading: 4095 is white).
    None for every other image. (Signed 8-bit gray is read as Pillow reads it, as unsigned bytes: Pillow's own
    sample files of that SampleFormat are pictures of unsigned values.)"""
    tags = getattr(img, "tag_v2", None)
    if tags is None:
        return None
    bits, sample_format = set(tuple(tags.get(258, (1,)))), set(tuple(tags.get(339, (1,))))
    if len(bits) != 1 or sample_format != {1}:
        return None
    depth = bits.pop()
    if img.mode == "I" and depth == 32:
        return 2**32 - 1
    if img.mode in _WIDE and img.mode != "I" and depth < 16:
        return 2**depth - 1
    return None


def _single_plane_rawmode(img: Image.Image) -> str | None:
    """The raw mode Pillow's table gives a TIFF of one sample per pixel (its key as Pillow makes it), whose
    PlanarConfiguration 2 is the same layout as 1; None when the table has none for it."""
    from PIL import TiffImagePlugin

    tags = img.tag_v2  # type: ignore[attr-defined]
    sample_format = tuple(tags.get(339, (1,)))
    if len(sample_format) > 1 and len(set(sample_format)) == 1:
        sample_format = sample_format[:1]
    key = (tags.prefix, tags.get(262), sample_format, tags.get(266, 1), tuple(tags.get(258, (1,)))[:1],
           tuple(tags.get(338, ())))
    found = TiffImagePlugin.OPEN_INFO.get(key)
    return found[1] if found is not None and found[0] == img.mode else None


def _with_rawmode(tile: Any, rawmode: str) -> Any:
    """A copy of Pillow's ``tile`` (codec, box, offset, args: a raw mode, or a tuple that starts with one) that
    unpacks with ``rawmode``: a named tuple since Pillow 11, a plain one before."""
    args = rawmode if isinstance(tile[3], str) else (rawmode, *tile[3][1:])
    return tile._replace(args=args) if hasattr(tile, "_replace") else (*tile[:3], args)


def _to_rgb(img: Image.Image, *, white_is_zero: bool = False, top: int | None = None) -> np.ndarray:
    """Turn a loaded Pillow image of any mode into uint8 RGB H×W×3.

    Every mode takes one of these paths: 8-bit RGB and gray are expanded as they are; 1-bit becomes
    0/255; integer modes are scaled from 0..65535 (16-bit data, never clipped at 255; from 0..``top`` when
    a TIFF's samples span another range, see :func:`_tiff_samples`; inverted first with ``white_is_zero``, see
    :func:`_white_is_zero_wide`); float is clipped to 0..255 unless all of it
    lies in 0..1, then scaled (and inverted after, with ``white_is_zero``); anything with alpha or a
    ``transparency`` entry (palette, gray, RGB and 16-bit PNGs with tRNS, GIFs) is composited onto
    :data:`BACKGROUND`; every other mode (P, CMYK, YCbCr, LAB, HSV) takes Pillow's conversion to RGB.
    """
    mode = img.mode
    transparency = img.info.get("transparency")
    if mode in _WIDE:
        arr = np.asarray(img)
        most = top or 65535
        if most > 2**31 - 1 and arr.dtype == np.int32:  # Pillow reads unsigned 32-bit samples as signed
            arr = arr.view(np.uint32)
        gray = np.empty(arr.shape, np.uint8)
        for top, bottom in _bands(*arr.shape[:2]):  # int64 temporaries a band at a time
            band = np.clip(arr[top:bottom].astype(np.int64), 0, most)
            if white_is_zero:
                band = most - band
            gray[top:bottom] = (band * 255 + most // 2) // most
        alpha = None
        if isinstance(transparency, int) and not isinstance(transparency, bool):
            alpha = np.where(arr == transparency, 0, 255).astype(np.uint8)  # a 16-bit tRNS names one value
        return _over_background(np.repeat(gray[..., None], 3, axis=2), alpha)
    if mode == "F":
        arr = np.asarray(img)
        bands = list(_bands(*arr.shape[:2]))

        def finite(top: int, bottom: int) -> np.ndarray:  # float64 temporaries a band at a time
            return np.nan_to_num(arr[top:bottom].astype(np.float64), nan=0.0, posinf=255.0, neginf=0.0)

        unit = arr.size > 0 and all(0.0 <= b.min() and b.max() <= 1.0 for b in (finite(t, e) for t, e in bands))
        gray = np.empty(arr.shape, np.uint8)
        for top, bottom in bands:
            values = finite(top, bottom)
            gray[top:bottom] = np.clip(values * 255.0 if unit else values, 0, 255).round()
        if white_is_zero:
            np.subtract(255, gray, out=gray)
        return np.repeat(gray[..., None], 3, axis=2)
    if mode in _PREMULTIPLIED:
        arr = np.asarray(img)
        colour = arr[..., :3] if mode == "RGBa" else np.repeat(arr[..., :1], 3, axis=2)
        alpha = arr[..., _PREMULTIPLIED[mode]][..., None]
        # premultiplied over white: colour + 255 * (1 - alpha), no rounding to undo
        return np.minimum(colour.astype(np.uint16) + (255 - alpha), 255).astype(np.uint8)
    if mode in _ALPHA or transparency is not None:
        rgba = np.asarray(img.convert("RGBA"))
        return _over_background(rgba[..., :3], rgba[..., 3])
    if mode == "RGB":
        return np.asarray(img)
    if mode == "L":
        return np.repeat(np.asarray(img)[..., None], 3, axis=2)
    if mode == "1":
        return np.repeat(np.asarray(img).astype(np.uint8)[..., None] * np.uint8(255), 3, axis=2)
    return np.asarray(img.convert("RGB"))


def _over_background(rgb: np.ndarray, alpha: np.ndarray | None) -> np.ndarray:
    """Composite straight-alpha uint8 ``rgb`` (H×W×3) with ``alpha`` (H×W) onto :data:`BACKGROUND`, a band of rows
    at a time (the uint16 temporaries of a whole 100 M-pixel image were GBs)."""
    if alpha is None:
        return rgb
    out = np.empty(rgb.shape, np.uint8)
    bg = np.array(BACKGROUND, np.uint16)
    for top, bottom in _bands(rgb.shape[0], rgb.shape[1]):
        a = alpha[top:bottom].astype(np.uint16)[..., None]
        out[top:bottom] = (rgb[top:bottom].astype(np.uint16) * a + bg * (255 - a) + 127) // 255
    return out


def _bands(height: int, width: int, pixels: int = 1 << 20) -> Iterator[tuple[int, int]]:
    """(top, bottom) of consecutive bands of rows of about ``pixels`` pixels covering ``height`` rows."""
    rows = max(1, pixels // max(width, 1))
    for top in range(0, height, rows):
        yield top, min(top + rows, height)


# ----------------------------------------------------------------------------- decode


# The decode's rules, numbered: raised whenever what a file decodes to changes (a rule fixed or added), so that a
# cache tells the shards an earlier datapipe decoded. 1: the shards that carry no number; 2: 16-bit TIFF planes,
# big-endian wide TIFF samples, float and 16-bit WhiteIsZero, unsigned 32-bit gray, a 16-bit RGB PNG's tRNS key;
# 3: 12-bit TIFF gray scaled from its own range, PNGs of metadata past Pillow's limits, Netpbm pictures.
DECODE_RULES = 3

_scratch = threading.local()


def _buffer(nbytes: int) -> np.ndarray:
    """A per-thread scratch buffer for decoded pixels, grown as needed and reused.

    Reusing it keeps a build worker from mapping fresh pages for every image (Dask workers
    return freed memory to the OS eagerly, so each new 400 KB array would fault in again).
    """
    buf = getattr(_scratch, "buf", None)
    if buf is None or buf.nbytes < nbytes:
        buf = np.empty(max(nbytes, 1 << 20), np.uint8)
        _scratch.buf = buf
    return buf


# What libjpeg-turbo's messages mean (jerror.h). Its warnings (JWRN_*) that leave every pixel as the
# encoder meant it are about the header only: an unknown JFIF revision, an unknown Adobe colour
# transform code (libjpeg-turbo assumes the usual one), a bad ICC profile chunk (not applied), SOS
# fields that a sequential JPEG ignores. Junk bytes between header segments ("extraneous bytes before
# marker", before the first scan) are harmless too, and removed before the strict decode
# (:func:`_clean_jpeg_header`). Every other message means lost or wrong pixels: the scan data ends
# early (the rest is grey), holds a code that does not decode, a marker where none belongs, a
# progression that does not add up, or more bytes than the picture needs (the decoder lost step with
# the data and finished early). One exception: zero bytes right before the end-of-image marker are
# padding some writers add after a scan that decoded in full. Bytes after the end-of-image marker are
# never read (no warning).
_JPEG_HARMLESS = ("unknown jfif revision", "unknown adobe color transform", "bad icc marker",
                  "invalid sos parameters for sequential jpeg")
_JPEG_SEGMENT_MARKERS = frozenset(range(0xC0, 0xFF)) - frozenset(range(0xD0, 0xDA))  # not RSTn, SOI, EOI
_JPEG_SOF = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}  # not DHT, JPG, DAC
_SEQUENTIAL_SOF = (0xC0, 0xC1, 0xC9)  # baseline, extended and arithmetic sequential frames
_EXTRANEOUS = re.compile(r"(\d+) extraneous bytes before marker 0x([0-9a-f]{2})")


def _jpeg_verdict(message: str, data: bytes) -> str:
    """``"truncated"``, ``"damaged"`` or ``"harmless"``: what a libjpeg-turbo message about ``data``
    means for its pixels (see :data:`_JPEG_HARMLESS`)."""
    lowered = message.lower()
    if "premature end of jpeg file" in lowered:
        return "truncated"
    if any(sign in lowered for sign in _JPEG_HARMLESS):
        return "harmless"
    extraneous = _EXTRANEOUS.search(lowered)
    if extraneous and extraneous.group(2) == "d9" and _zero_padded(data, int(extraneous.group(1))):
        return "harmless"
    return "damaged"


def _zero_padded(data: bytes, count: int) -> bool:
    """Whether the ``count`` bytes before the end-of-image marker are zeros (writer's padding) at the end of
    the last scan's coded data: the main image's marker and scan, found by walking its segments
    (:func:`_jpeg_end`), never those of an EXIF thumbnail, which is a JPEG inside the header."""
    scan, eoi = _jpeg_end(data)
    return scan >= 0 and 0 < count <= eoi - scan and not any(data[eoi - count : eoi])


def _jpeg_error(verdict: str, message: str, what: str) -> DecodeError:
    if verdict == "truncated":
        return DecodeError(f"truncated {what}: {message}")
    return DecodeError(f"corrupt {what} (damaged scan data): {message}")


def _clean_jpeg_header(data: bytes, *, neutral: bool = False) -> bytes:
    """``data`` with what libjpeg-turbo warns about before the first scan removed: junk bytes between
    segments (it skips them too, with a warning) and ICC profile chunks (APP2 ``ICC_PROFILE``; neither
    datapipe nor Pillow's conversion applies them, and a malformed one is a warning).

    With the header clean, a strict decode still reports anything wrong in the scan data. Unchanged
    ``data`` comes back when the header cannot be walked (the decode then says why).

    ``neutral`` also removes the causes of the other harmless header warnings (:data:`_JPEG_HARMLESS`),
    giving a file libjpeg-turbo decodes to the same pixels without them: an unknown JFIF revision
    becomes 1, an unknown Adobe colour transform the one libjpeg-turbo assumes (YCbCr for three
    components, YCCK for four), and a sequential scan's SOS fields, which it ignores, what it expects.
    """
    out = bytearray(data[:2])
    pos, n = 2, len(data)
    sequential, components, adobe = False, 0, -1
    while pos + 4 <= n:
        if data[pos] != 0xFF or data[pos + 1] == 0x00 or data[pos + 1] not in _JPEG_SEGMENT_MARKERS | {0xFF}:
            nxt = data.find(b"\xff", pos + 1)  # junk, as libjpeg's next_marker() skips it
            if nxt < 0:
                return data
            pos = nxt
            continue
        marker = data[pos + 1]
        if marker == 0xFF:  # fill byte
            pos += 1
            continue
        length = struct.unpack(">H", data[pos + 2 : pos + 4])[0]
        if length < 2:
            return data
        if marker == 0xDA:  # start of scan: the rest is entropy-coded data, kept as it is
            scan = bytearray(data[pos:])
            fields = 5 + 2 * scan[4] if len(scan) > 4 else len(scan)
            if neutral and sequential and fields + 3 <= min(len(scan), 2 + length):
                scan[fields : fields + 3] = b"\x00\x3f\x00"  # Ss, Se, Ah/Al of a sequential scan
            if neutral and adobe >= 0 and components in (3, 4):
                known = (0, 1) if components == 3 else (0, 2)
                if out[adobe] not in known:
                    out[adobe] = known[1]  # what libjpeg-turbo assumes, after its warning
            out += scan
            return bytes(out)
        segment = bytearray(data[pos : pos + 2 + length])
        if marker in _JPEG_SOF and len(segment) > 9:
            sequential, components = marker in _SEQUENTIAL_SOF, segment[9]
        if neutral and marker == 0xE0 and segment[4:9] == b"JFIF\x00" and len(segment) > 9:
            segment[9] = 1
        if neutral and marker == 0xEE and segment[4:9] == b"Adobe" and len(segment) > 15:
            adobe = len(out) + 15
        if not (marker == 0xE2 and segment[4:16] == b"ICC_PROFILE\x00"):
            out += segment
        pos += 2 + length
    return data


def _jpeg_header(sj: ModuleType, data: bytes) -> tuple[bytes, tuple]:
    """(the bytes to decode, their header): ``data`` itself, or with a header that libjpeg-turbo warns
    about cleaned (:func:`_clean_jpeg_header`). Raises DecodeError when neither has a readable header."""
    if len(data) < 4 or data.find(b"\xff", 3) < 0:
        raise DecodeError(f"truncated JPEG: the file ends after {len(data)} bytes, before its header")
    try:
        return data, sj.decode_jpeg_header(data)
    except ValueError as exc:
        if _jpeg_verdict(str(exc), data) == "truncated":
            raise _jpeg_error("truncated", str(exc), "JPEG") from None
        first = str(exc)
    except KeyError:  # simplejpeg's name for libjpeg-turbo's colour space: none for a header it could not read
        first = "the header names no colour space libjpeg-turbo knows (damaged frame header)"
    cleaned = _clean_jpeg_header(data)
    for strict in (True, False):
        try:
            return cleaned, sj.decode_jpeg_header(cleaned, strict=strict)
        except (ValueError, KeyError):
            continue
    raise DecodeError(f"corrupt JPEG header: {first}") from None


def _jpeg_pixels(sj: ModuleType, data: bytes, what: str = "JPEG", **kwargs: object) -> np.ndarray:
    """libjpeg-turbo's full decode of ``data``, strict first (the common case: no warning at all).

    Any message but a harmless one (:data:`_JPEG_HARMLESS`) is a DecodeError. After a harmless one,
    which a strict decode stops at, the file is decoded strictly again without its cause
    (:func:`_clean_jpeg_header` with ``neutral``: the same pixels), so that damage further on is still
    seen; only a harmless warning that remains (zero padding before the end) is let pass.
    """
    try:
        return sj.decode_jpeg(data, strict=True, **kwargs)
    except ValueError as exc:
        verdict = _jpeg_verdict(str(exc), data)
        if verdict != "harmless":
            raise _jpeg_error(verdict, str(exc), what) from None
        first = exc
    check = _clean_jpeg_header(data, neutral=True)
    if check != data:
        try:
            return sj.decode_jpeg(check, strict=True, **kwargs)  # the same pixels, as the docstring says
        except ValueError as exc:
            verdict = _jpeg_verdict(str(exc), check)
            if verdict != "harmless":
                raise _jpeg_error(verdict, str(exc), what) from None
    try:
        return sj.decode_jpeg(data, strict=False, **kwargs)
    except ValueError:
        raise DecodeError(f"corrupt {what}: {first}") from None


def _decode_simplejpeg(sj: ModuleType, data: bytes, spec: DecodeSpec, frame: JpegFrame | None,
                       reuse: bool = False) -> tuple[np.ndarray, tuple[int, int]] | None:
    """Decode with libjpeg-turbo: the oriented pixels (DCT-downscaled as :func:`dct_factor` allows) and the
    oriented image's full size; None when the JPEG needs Pillow (CMYK/YCCK, or a file only Pillow reads).

    With ``reuse`` the pixels land in this thread's scratch buffer (valid until its next decode).
    """
    source = data  # whose metadata Pillow would read
    try:
        data, (height, width, colorspace, _) = _jpeg_header(sj, data)
    except DecodeError:
        if _pillow_reads(data, spec):  # a JPEG this libjpeg-turbo refuses and Pillow reads
            return None
        raise
    _check_pixels(width, height, spec)
    if colorspace in ("CMYK", "YCCK"):
        # Pillow converts the colours (Adobe's inverted CMYK included) but tolerates damaged scan
        # data, so the file is first fully decoded here, under the same rules as any JPEG.
        _jpeg_pixels(sj, data, f"JPEG ({colorspace})", colorspace="CMYK")
        return None
    if frame is not None and frame.lossless:
        # No DCT, so no DCT-domain scaling: libjpeg-turbo would decode the full size into a buffer sized for
        # the scaled one. Nor does it turn lossless gray into RGB: it is decoded as gray and expanded.
        gray = colorspace == "Gray"
        img = _jpeg_pixels(sj, data, colorspace="GRAY" if gray else "RGB")
        if gray:
            img = np.repeat(img, 3, axis=2)
    else:
        factor = dct_factor(height, width, spec)
        min_h, min_w = -(-height // factor), -(-width // factor)
        buffer = None
        if reuse:
            out_h, out_w = (height, width) if factor == 1 else sj.decode_jpeg_header(
                data, min_height=min_h, min_width=min_w, strict=False)[:2]
            buffer = _buffer(out_h * out_w * 3)
        img = _jpeg_pixels(sj, data, colorspace="RGB", min_height=min_h, min_width=min_w, buffer=buffer)
    orientation = jpeg_orientation(source)
    return apply_orientation(img, orientation), _oriented_size(height, width, orientation)


def _check_frame(data: bytes, max_pixels: int) -> JpegFrame | None:
    """The JPEG's frame (:func:`jpeg_frame`); DecodeError for a frame whose size is over ``max_pixels``
    (``too-large``, before anything is decoded) or none, and (``unsupported``) for a valid JPEG of a kind that
    neither libjpeg-turbo's 8-bit decoder nor Pillow decodes, so that its reason does not call it damaged."""
    frame = jpeg_frame(data)
    if frame is None:
        return None
    if frame.width >= 0:
        if frame.width * max(frame.height, 1) > max_pixels:
            raise _too_large(frame.width, frame.height, max_pixels)
        if frame.width == 0:
            raise DecodeError(f"image header says {frame.width}x{frame.height} pixels")
        if frame.height == 0:
            raise DecodeError("unsupported JPEG: its height is given after the first scan (a DNL marker), which "
                              "libjpeg-turbo and Pillow do not read; convert the file", "unsupported")
        if max(frame.width, frame.height) > JPEG_MAX_SIDE:
            raise DecodeError(f"unsupported JPEG: {frame.width}x{frame.height} pixels, over the {JPEG_MAX_SIDE:,} a "
                              "side libjpeg-turbo decodes; convert the file (a TIFF or PNG holds it)", "unsupported")
    # Every scan of a progressive JPEG is a pass over the whole image: thousands of them in a few hundred KB take
    # minutes. Coded data never holds FFDA (a coded FF is followed by 00 or a restart marker), so its count
    # bounds the scans at C speed, and only above the limit are they walked.
    if frame.marker in _PROGRESSIVE_SOF and data.count(b"\xff\xda") > MAX_SCANS \
            and (scans := _scans(data)) > MAX_SCANS:
        raise DecodeError(f"decompression bomb: a progressive JPEG of {scans:,} scans, over {MAX_SCANS} (an ordinary "
                          "one has about 10; each is a pass over the whole image)", "too-large")
    if frame.hierarchical:
        raise DecodeError(f"unsupported JPEG: a hierarchical frame (SOF{frame.marker - 0xC0}), which libjpeg-turbo "
                          "and Pillow do not decode; convert the file to a baseline JPEG or a PNG", "unsupported")
    if frame.precision != 8:
        raise DecodeError(f"unsupported JPEG: {frame.precision}-bit samples (libjpeg-turbo's and Pillow's decoders "
                          "read 8-bit JPEGs); convert the file to an 8-bit JPEG or a 16-bit PNG", "unsupported")
    return frame


JPEG_MAX_SIDE = 65500  # libjpeg-turbo's JPEG_MAX_DIMENSION: a larger side is refused by every decoder here


def _oriented_size(height: int, width: int, orientation: int) -> tuple[int, int]:
    """The (height, width) of a ``height`` x ``width`` image once its EXIF ``orientation`` is undone."""
    return (width, height) if orientation in (5, 6, 7, 8) else (height, width)


def _pillow_reads(data: bytes, spec: DecodeSpec) -> bool:
    """Whether Pillow fully decodes these bytes (for the rare JPEG that libjpeg-turbo here refuses)."""
    from PIL import Image

    try:
        with _pillow_limit(spec.max_pixels), Image.open(io.BytesIO(data), formats=["JPEG"]) as img:
            _check_pixels(img.width, img.height, spec)
            img.load()
        return True
    except Exception:  # noqa: BLE001 - any failure means "no": the caller reports libjpeg-turbo's reason
        return False


def _check_pixels(width: int, height: int, spec: DecodeSpec) -> None:
    if width * height > spec.max_pixels:
        raise _too_large(width, height, spec.max_pixels)
    if width < 1 or height < 1:
        raise DecodeError(f"image header says {width}x{height} pixels")


def _too_large(width: int, height: int, max_pixels: int) -> DecodeError:
    return DecodeError(
        f"decompression bomb: header says {width}x{height} = {width * height:,} pixels, "
        f"over max_pixels={max_pixels:,} (raise max_pixels if the image is genuine)", "too-large"
    )


# Pillow checks an image's size against its module-wide Image.MAX_IMAGE_PIXELS when it opens a file
# (and TIFF, GIF and WebP again while reading one), and refuses above twice that (178,956,970 pixels
# by default): an image under a raised max_pixels would be lost, and a user who lowers the limit for
# their own code would change datapipe's verdicts. Setting the module variable would change it for
# every thread of the process, user code included. Instead Pillow's check function is wrapped, once,
# by one that applies the limit of the datapipe decode running in the calling thread (see
# _pillow_limit) and in any other thread calls Pillow's own, which reads MAX_IMAGE_PIXELS as before.
_limit = threading.local()
_limit_lock = threading.Lock()
os.register_at_fork(after_in_child=lambda: globals().update(_limit_lock=threading.Lock()))  # held by no thread there
_limit_installed = False


@contextmanager
def _pillow_limit(max_pixels: int | None) -> Iterator[None]:
    """Within this block, in this thread only, Pillow's decompression-bomb check applies ``max_pixels``
    (None: no limit, for reading metadata) in place of ``Image.MAX_IMAGE_PIXELS``."""
    _install_pillow_limit()
    outer = getattr(_limit, "stack", None)
    _limit.stack = (max_pixels, outer)
    try:
        yield
    finally:
        _limit.stack = outer


def _install_pillow_limit() -> None:
    global _limit_installed
    if _limit_installed:
        return
    from PIL import Image

    with _limit_lock:
        pillows = getattr(Image, "_decompression_bomb_check", None)
        if not _limit_installed and pillows is not None:

            def bomb_check(size: tuple[int, int], *args: object, **kwargs: object) -> None:
                scope = getattr(_limit, "stack", None)
                if scope is None:  # not inside a datapipe decode: Pillow's own rule
                    return pillows(size, *args, **kwargs)
                width, height = size
                if scope[0] is not None and max(1, width) * max(1, height) > scope[0]:
                    raise _too_large(width, height, scope[0])
                return None

            Image._decompression_bomb_check = bomb_check
        _limit_installed = True


def _decode_pillow(data: bytes, fmt: str, spec: DecodeSpec, source: bytes | None = None,
                   frame: JpegFrame | None = None) -> tuple[np.ndarray, tuple[int, int]]:
    """Decode with Pillow (the pixels, and the oriented image's full size: a JPEG's are DCT-downscaled as
    :func:`dct_factor` allows): the first frame, fully (truncated data is refused: LOAD_TRUNCATED_IMAGES
    stays off; so is data that fails its own checksum, see :func:`_checksum_error`), then orientation
    as ``ImageOps.exif_transpose`` would apply it (a JPEG's read from ``source``, the file's bytes
    before :func:`_clean_jpeg_header`, when given). ``spec.max_pixels`` alone decides what is too
    large (:func:`_pillow_limit`), from the header, before any pixel is decoded."""
    import warnings

    from PIL import Image, UnidentifiedImageError

    try:
        with warnings.catch_warnings(), _pillow_limit(spec.max_pixels):
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            warnings.simplefilter("ignore", UserWarning)  # "Corrupt EXIF data": EXIF is optional
            if fmt == "png":
                data = _png_text_within_limits(data)
            img = Image.open(io.BytesIO(data), formats=[_PILLOW_FORMATS[fmt]])
            # Pillow's load reads its input in blocks of this size and joins them (b = b + s) while its decoder
            # waits for a whole row: quadratic in a long row (an 80 s decode of a 94-byte WebP, whose frame Pillow
            # decodes into memory first). Every input here is in memory (BytesIO): one block holds it all.
            img.decodermaxblock = 1 << 40
            _check_pixels(img.width, img.height, spec)
            full = (img.height, img.width)
            damage = _checksum_error(img, data, fmt, spec.max_pixels)
            if damage:
                raise DecodeError(damage)
            if fmt == "jpeg":
                factor = 1 if frame is not None and frame.lossless else dct_factor(img.height, img.width, spec)
                if factor > 1:  # Pillow picks the largest scale whose result is at least this size
                    img.draft(img.mode, (max(1, img.width // factor), max(1, img.height // factor)))
            if fmt == "tiff":
                _mend_tiff_tiles(img)
            key = _wide_colour_key(img, data) if fmt == "png" else None
            white_is_zero = fmt == "tiff" and _white_is_zero_wide(img)
            top = _tiff_samples(img) if fmt == "tiff" else None
            img.load()  # a full decode of the first frame: truncated and corrupt data fail here
            # read after load(): a TIFF decoded by libtiff comes out already oriented, its tag removed
            orientation = jpeg_orientation(source or data) if fmt == "jpeg" else _pillow_orientation(img)
            if fmt == "png":
                _scale_low_depth_gray_trns(img, data)
            if key is not None:
                rgb = _over_background(np.asarray(img.convert("RGB")), _key_alpha(img, data, key))
            else:
                rgb = _to_rgb(img, white_is_zero=white_is_zero, top=top)
    except DecodeError:
        raise
    except Image.DecompressionBombError as exc:  # only where Pillow has no check for _pillow_limit to wrap
        raise DecodeError(f"decompression bomb: {exc}", "too-large") from None
    except UnidentifiedImageError:  # Pillow's message names only its in-memory buffer
        if fmt == "tiff" and data.startswith(_BIG_ENDIAN_BIGTIFF):  # Pillow reads none (13 at least)
            raise DecodeError("unsupported TIFF: a big-endian BigTIFF, which Pillow does not read; convert the file "
                              "to a little-endian TIFF (or a PNG)", "unsupported") from None
        if fmt == "tiff" and _tiff_layout_unknown(data):
            raise DecodeError("unsupported TIFF: a valid header, but a pixel layout (its PhotometricInterpretation, "
                              "BitsPerSample, SampleFormat and ExtraSamples together) that Pillow does not read; "
                              "convert the file to 8- or 16-bit RGB or gray (or a PNG)", "unsupported") from None
        raise DecodeError(f"not a readable {fmt.upper()} image: it starts like one, but its header does not "
                          "parse (damaged or cut short)") from None
    except MemoryError as exc:  # the machine's state, not the file's: a rerun reads it again (decoder-crash)
        raise DecodeError(f"out of memory while decoding ({one_line(exc)}); nothing says the file is damaged",
                          "decoder-crash") from None
    except ValueError as exc:
        if "unknown raw mode" in str(exc):  # Pillow's table of layouts has none for these samples
            raise DecodeError(f"unsupported {fmt.upper()}: a pixel layout Pillow has no raw mode for ({exc}); convert the "
                              "file to 8- or 16-bit RGB or gray (or a PNG)", "unsupported") from None
        raise DecodeError(f"corrupt or truncated {fmt.upper()}: {type(exc).__name__}: {exc}") from None
    except (OSError, SyntaxError, struct.error, EOFError, IndexError, KeyError, TypeError,
            ZeroDivisionError, OverflowError) as exc:
        raise DecodeError(f"corrupt or truncated {fmt.upper()}: {type(exc).__name__}: {exc}") from None
    oriented = apply_orientation(rgb, orientation)
    if fmt != "jpeg":  # decoded at full size (no draft)
        return oriented, (oriented.shape[0], oriented.shape[1])
    return oriented, _oriented_size(*full, orientation)


# ----------------------------------------------------------------------------- checksums


def _checksum_error(img: Image.Image, data: bytes, fmt: str, max_pixels: int) -> str | None:
    """The quarantine reason when the file's own integrity checks fail, which Pillow's decode does
    not look at: a PNG's chunk CRC-32s (:func:`_png_crc_error`) and the Adler-32 of a TIFF's deflate
    strips or tiles (:func:`_tiff_deflate_error`); None when they pass or the format has none."""
    if fmt == "png":
        return _png_crc_error(data)
    if fmt == "tiff":
        return _tiff_deflate_error(img, data, max_pixels)
    return None


def _png_crc_error(data: bytes) -> str | None:
    """The first chunk up to IEND whose CRC-32 fails, as a quarantine reason; None when all pass.

    Pillow checks the CRCs of the chunks before the image data only. A damaged byte inside IDAT
    decodes to wrong pixels (zlib's Adler-32 at the end of the stream would tell, but Pillow stops
    inflating once it has every row and never reads it), and one in a chunk after the image data
    (eXIf, iTXt) can change the orientation read from it. A chunk cut short by the end of the file is
    left to Pillow (missing image data fails its decode). Cost: one CRC-32 pass over the file (about
    0.4 ms per MB): 0.11 ms for a 265 KB 400x350 RGB PNG of a noisy photo-like picture, +5 % of its
    2 ms decode; less for a PNG that compresses better.
    """
    view = memoryview(data)
    pos, end = 8, len(data)
    while pos + 12 <= end:
        length = struct.unpack_from(">I", data, pos)[0]
        stop = pos + 8 + length
        if stop + 4 > end:
            return None
        kind = data[pos + 4 : pos + 8]
        if zlib.crc32(view[pos + 4 : stop]) != struct.unpack_from(">I", data, stop)[0]:
            name = kind.decode("ascii", "backslashreplace")
            return f"corrupt PNG: chunk {name} at byte {pos} fails its CRC (damaged data)"
        if kind == b"IEND":
            return None
        pos = stop + 4
    return None


_DEFLATE = (8, 32946)  # TIFF compression codes of zlib streams (Adobe deflate, the older deflate code)


def _tiff_deflate_error(img: Image.Image, data: bytes, max_pixels: int) -> str | None:
    """The first deflate strip (or tile) of the TIFF's first page whose zlib stream fails to inflate
    or fails its Adler-32 check, as a quarantine reason; None when all pass, or not deflate. Before that, in any
    TIFF: more strip (tile) offsets than the image has strips (tiles), or a tile of more than ``max_pixels``, is a
    damaged or crafted header (Pillow makes an object per offset, and each is a stream to inflate here).

    libtiff stops inflating a strip once it has the strip's pixels, so a damaged byte gives wrong
    pixels without a word; the Adler-32 at the stream's end would tell. The check inflates each
    stream once more, with Python's zlib: 1.4–1.6 ms for a 400x350 RGB TIFF whose decode takes
    1.9 ms (+75–90 %, on a format rare in datasets). A stream that does not end, or holds more than
    its block needs, is left to libtiff. LZW, PackBits and uncompressed data carry no checksum:
    damage that still decodes is kept.
    """
    tags = getattr(img, "tag_v2", None)
    if tags is None:
        return None
    tiled = 322 in tags and 323 in tags
    offsets, counts = tags.get(324 if tiled else 273), tags.get(325 if tiled else 279)
    if offsets is None or counts is None:
        return None
    offsets = offsets if isinstance(offsets, tuple) else (offsets,)
    counts = counts if isinstance(counts, tuple) else (counts,)
    bits = tags.get(258, 1)
    bits = sum(bits) if isinstance(bits, tuple) else bits * tags.get(277, 1)
    block = "tile" if tiled else "strip"
    try:
        cols, rows = (int(tags[322]), int(tags[323])) if tiled else (img.width, max(1, min(int(tags.get(278, img.height)),
                                                                                             img.height)))
        planes = int(tags.get(277, 1)) if tags.get(284) == 2 else 1  # planar: one block per sample per place
    except (TypeError, ValueError):
        return f"corrupt TIFF: its {block} size tags are not numbers"
    if cols < 1 or rows < 1:
        return f"corrupt TIFF: {block}s of {cols}x{rows} pixels"
    # Each block is inflated here, and its count and size bound the work: a few hundred bytes that name one
    # stream a thousand times, or a tile of 65536x65536 pixels on a 16x16 image, were hundreds of GB to inflate.
    if cols * rows > max_pixels:
        return f"corrupt TIFF: a {block} of {cols}x{rows} pixels, over max_pixels for any image"
    places = (-(-img.width // cols) if tiled else 1) * -(-img.height // rows)
    if len(offsets) > places * planes:
        return (f"corrupt TIFF: {len(offsets):,} {block} offsets for an image of {places * planes:,} {block}s "
                f"({img.width}x{img.height})")
    if tags.get(259) not in _DEFLATE:
        return None
    cap = 2 * rows * (cols * bits // 8 + 1) + (1 << 16)  # what a block holds, with room: the rest is libtiff's
    view = memoryview(data)
    for index, (offset, count) in enumerate(zip(offsets, counts, strict=False)):
        stream, inflated, stop = zlib.decompressobj(), 0, min(offset + count, len(data))
        try:
            for at in range(offset, stop, 1 << 16):  # in pieces, and at most the cap out of each: memory stays bounded
                piece: memoryview | bytes = view[at : min(at + (1 << 16), stop)]
                while piece and inflated <= cap and not stream.eof:
                    inflated += len(stream.decompress(piece, cap + 1 - inflated))
                    piece = stream.unconsumed_tail
                if stream.eof or inflated > cap:
                    break
        except zlib.error as exc:
            return f"corrupt TIFF: the deflate data of {block} {index} is damaged (zlib: {str(exc).split(': ')[-1]})"
    return None


def _scale_low_depth_gray_trns(img: Image.Image, data: bytes) -> None:
    """Pillow scales 2- and 4-bit gray PNG samples to 8 bits but keeps the tRNS gray value at the
    file's depth, so the wrong level (or none) would turn transparent; scale the value the same way."""
    depth, color_type = data[24], data[25]  # IHDR, which a PNG must start with
    value = img.info.get("transparency")
    if img.mode == "L" and color_type == 0 and depth in (2, 4) and isinstance(value, int):
        img.info["transparency"] = value * (255 // (2**depth - 1))


_BIG_ENDIAN_BIGTIFF = b"MM\x00+"


def _tiff_layout_unknown(data: bytes) -> bool:
    """Whether Pillow's TIFF reader refuses ``data`` for its pixel layout alone ("unknown pixel mode": its
    tags parse, their combination is one Pillow has no mode for), not for a damaged header."""
    import warnings

    from PIL import TiffImagePlugin

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "Corrupt EXIF data" and the like: only the exception matters here
            TiffImagePlugin.TiffImageFile(io.BytesIO(data))
    except SyntaxError as exc:  # no mode for the layout; the planes' raw modes taken letter by letter run out
        return str(exc) in ("unknown pixel mode", "string index out of range")

    except Exception:  # noqa: BLE001 - any other failure: the header is damaged
        return False
    return False


def _png_text_within_limits(data: bytes) -> bytes:
    """``data`` (a PNG) without the metadata chunks Pillow refuses for their size alone, failing the whole image: an
    ICC profile or a compressed text that inflates past ``PngImagePlugin.MAX_TEXT_CHUNK`` (1 MiB; an ImageMagick
    "Raw profile type icc" of 700 KB does), and the text chunks past ``MAX_TEXT_MEMORY`` (64 MiB) in all, counted as
    Pillow counts them. The decode applies no ICC profile and reads no text but an orientation (an XMP or EXIF text
    dropped so loses its orientation, which Pillow does not read either: it refuses the file); the pixels are
    intact. ``data`` itself when it has none (the common case: nothing is copied)."""
    from PIL import PngImagePlugin

    chunk_limit, text_limit = PngImagePlugin.MAX_TEXT_CHUNK, PngImagePlugin.MAX_TEXT_MEMORY
    kept, dropped, text, at = [data[:8]], False, 0, 8
    while at + 8 <= len(data):
        (length,), kind = struct.unpack(">I", data[at : at + 4]), data[at + 4 : at + 8]
        end = at + 12 + length
        if end > len(data):
            break  # cut short: Pillow says so
        inflated, counted = _png_metadata_size(kind, data[at + 8 : end - 4], chunk_limit)
        if inflated > chunk_limit or text + counted > text_limit:
            dropped = True
        else:
            text += counted
            kept.append(data[at:end])
        at = end
        if kind == b"IEND":
            break
    return b"".join(kept) + data[at:] if dropped else data


def _png_metadata_size(kind: bytes, body: bytes, limit: int) -> tuple[int, int]:
    """(bytes a PNG chunk's compressed metadata inflates to, past ``limit`` as ``limit + 1``; bytes of text it adds
    to Pillow's count of text chunks) as Pillow's PngImagePlugin reads them: 0 for what it does not inflate or
    count (another compression method, which it refuses or skips; a chunk of no metadata)."""
    def inflate(stream: bytes) -> tuple[int, bytes]:
        inflater = zlib.decompressobj()
        try:
            data = inflater.decompress(stream, limit)
        except zlib.error:
            return 0, b""  # Pillow reads such a text as empty (an ICC profile as none)
        return (limit + 1, b"") if inflater.unconsumed_tail else (len(data), data)

    def characters(text: bytes) -> int:  # Pillow counts an iTXt's text in characters, and none it cannot decode
        try:
            return len(text.decode("utf-8"))
        except UnicodeDecodeError:
            return 0

    if kind not in (b"iCCP", b"zTXt", b"iTXt", b"tEXt"):
        return 0, 0
    keyword, _, rest = body.partition(b"\0")
    if kind == b"tEXt":
        return 0, len(rest) if keyword else 0
    if kind in (b"iCCP", b"zTXt"):
        if rest[:1] not in (b"\0", b""):
            return 0, 0  # another method: Pillow refuses the file, and so it stays
        size = inflate(rest[1:])[0]
        return size, (size if kind == b"zTXt" and keyword else 0)
    if len(rest) < 2:
        return 0, 0
    flag, method, fields = rest[0], rest[1], rest[2:].split(b"\0", 2)
    if len(fields) < 3:
        return 0, 0
    if flag == 0:
        return 0, characters(fields[2])
    if method != 0:
        return 0, 0  # Pillow keeps such a chunk's text unread
    size, text = inflate(fields[2])
    return size, characters(text)


def _wide_colour_key(img: Image.Image, data: bytes) -> tuple[int, int, int] | None:
    """The tRNS colour key of a 16-bit RGB PNG (``img`` opened, not loaded), None for any other PNG. Pillow keeps
    only the high byte of each such sample and the key at 16 bits, matching no pixel: see :func:`_key_alpha`."""
    key = img.info.get("transparency")
    if data[24] == 16 and data[25] == 2 and isinstance(key, tuple) and len(key) == 3:  # IHDR depth, colour type
        return key
    return None


def _key_alpha(img: Image.Image, data: bytes, key: tuple[int, int, int]) -> np.ndarray:
    """The alpha (0 where a pixel's 16-bit samples equal ``key``, else 255) of a 16-bit RGB PNG ``img`` that Pillow
    loaded as the high bytes: the low bytes are decoded once more, with the raw mode that keeps them."""
    from PIL import Image

    low = Image.open(io.BytesIO(data), formats=["PNG"])
    low.decodermaxblock = 1 << 40
    low.tile = [_with_rawmode(tile, "RGB;16L") for tile in low.tile]
    low.load()
    values = np.asarray(img).astype(np.uint16) << 8 | np.asarray(low)
    return np.where((values == np.array(key, np.uint16)).all(axis=2), 0, 255).astype(np.uint8)


def _pillow_orientation(img: Image.Image) -> int:
    """The orientation exif_transpose applies to ``img`` (see :data:`_TRANSPOSING`); 1 for broken EXIF."""
    try:
        return _TRANSPOSING.get(img.getexif().get(0x0112, 1), 1)
    except Exception:  # noqa: BLE001 - broken EXIF is tolerated, the image is not
        return 1


def decode_rgb(data: bytes, spec: DecodeSpec | None = None, *, _reuse: bool = False) -> np.ndarray:
    """Fully decode one file's bytes to an oriented uint8 RGB array (before resizing).

    DCT downscaling by a power of two is applied when ``spec`` says the output is at most half the
    source size. Raises DecodeError with the quarantine reason for anything that is not a readable
    image.
    """
    return _decode(data, spec, reuse=_reuse)[0]


def _decode(data: bytes, spec: DecodeSpec | None = None, *, reuse: bool = False) -> tuple[np.ndarray, tuple[int, int]]:
    """:func:`decode_rgb`, and the oriented image's full size (its pixels may be DCT-downscaled)."""
    spec = spec or DecodeSpec(size=8192)  # no spec: full resolution, no DCT downscaling
    if not data:
        raise DecodeError("empty file (0 bytes)", "empty")
    fmt = sniff(data[:16])
    if fmt is None and (named := undecoded_format(data[:16])) is not None:
        article = "an" if named.startswith("A") else "a"
        raise DecodeError(f"unsupported: {article} {named} picture, a format datapipe does not decode; convert it to JPEG or "
                          "PNG (for instance with ImageMagick: magick FILE out.jpg)", "unsupported")
    if fmt is None:
        raise DecodeError(f"not an image: unrecognised content (starts with {data[:8]!r})", "not-an-image")
    if fmt == "jpeg":
        frame = _check_frame(data, spec.max_pixels)
        sj = _simplejpeg()
        if sj is not None:
            decoded = _decode_simplejpeg(sj, data, spec, frame, reuse=reuse)
            if decoded is not None:
                return decoded
            return _decode_pillow(_clean_jpeg_header(data), fmt, spec, source=data, frame=frame)
        return _decode_pillow(data, fmt, spec, frame=frame)
    return _decode_pillow(data, fmt, spec)


def decode_sample(data: bytes, spec: DecodeSpec, out: np.ndarray | None = None) -> np.ndarray:
    """Decode one file's bytes into the canonical sample: uint8 [size, size, 3], or for ``short`` the
    shape :func:`fit_shape` gives (into ``out``, as :func:`fit_image` takes it)."""
    return decode_fitted(data, spec, out)[0]


def decode_fitted(data: bytes, spec: DecodeSpec, out: np.ndarray | None = None) -> tuple[np.ndarray, bool]:
    """:func:`decode_sample`, and whether the image's longer side was cut by ``max_aspect``."""
    img, full = _decode(data, spec, reuse=True)
    if img.ndim != 3 or img.shape[2] != 3:
        raise DecodeError(f"decoder returned shape {img.shape}, expected H×W×3")
    return fit_image(img, spec, out, source=full), fit_shape(*full, spec).capped
