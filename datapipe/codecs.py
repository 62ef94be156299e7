"""Sniffing, decoding and normalising one image file into a canonical uint8 RGB sample.

Canonical means: whatever the decoder, the sample for a given file and configuration is uint8 RGB
H×W×3 with EXIF orientation applied (broken EXIF tolerated), CMYK/YCCK converted, grayscale and
palette images expanded, alpha composited onto a fixed background and 16-bit data scaled (not
clipped). JPEGs go through libjpeg-turbo (``simplejpeg``, which ships the library in its wheel) with
DCT-domain downscaling by powers of two when the source is at least twice the target; every other
format (and CMYK/YCCK JPEGs, which libjpeg-turbo cannot convert to RGB) goes through Pillow.
"""

from __future__ import annotations

import io
import struct
import threading
from dataclasses import dataclass
from typing import Literal

import numpy as np

from .errors import DecodeError

Fit = Literal["crop", "pad", "stretch"]
FITS = ("crop", "pad", "stretch")
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
)


def sniff(head: bytes) -> str | None:
    """Return the image format named by the first bytes of a file, or None if it is not an image."""
    for magic, name in _MAGIC:
        if head.startswith(magic):
            return name
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return "webp"
    return None


@dataclass(frozen=True)
class DecodeSpec:
    """What every sample is turned into. Part of the build configuration (and of its hash)."""

    size: int = 256
    fit: Fit = "crop"
    max_pixels: int = DEFAULT_MAX_PIXELS

    def __post_init__(self) -> None:
        if not isinstance(self.size, int) or not 8 <= self.size <= 8192:
            raise ValueError(f"size must be an integer in [8, 8192], got {self.size!r}")
        if self.fit not in FITS:
            raise ValueError(f"fit must be one of {FITS}, got {self.fit!r}")
        if not isinstance(self.max_pixels, int) or self.max_pixels < 1:
            raise ValueError(f"max_pixels must be a positive integer, got {self.max_pixels!r}")


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


def jpeg_orientation(data: bytes) -> int:
    """Read the EXIF orientation (1–8) from a JPEG's APP1 segment; 1 when absent or broken."""
    try:
        pos, end = 2, min(len(data), 1 << 20)
        while pos + 4 <= end:
            if data[pos] != 0xFF:
                return 1
            marker = data[pos + 1]
            if marker == 0xFF:  # fill byte
                pos += 1
                continue
            if marker in (0xDA, 0xD9):  # start of scan / end of image: no EXIF before pixels
                return 1
            length = struct.unpack(">H", data[pos + 2 : pos + 4])[0]
            if marker == 0xE1 and data[pos + 4 : pos + 10] == b"Exif\x00\x00":
                return _tiff_orientation(data[pos + 10 : pos + 2 + length])
            pos += 2 + length
    except (struct.error, IndexError, ValueError):
        pass
    return 1


def _tiff_orientation(tiff: bytes) -> int:
    order = {b"II": "<", b"MM": ">"}.get(tiff[:2])
    if order is None:
        return 1
    ifd = struct.unpack(order + "I", tiff[4:8])[0]
    count = struct.unpack(order + "H", tiff[ifd : ifd + 2])[0]
    for i in range(count):
        entry = tiff[ifd + 2 + 12 * i : ifd + 14 + 12 * i]
        tag, typ = struct.unpack(order + "HH", entry[:4])
        if tag == 0x0112:
            value = struct.unpack(order + "H", entry[8:10])[0] if typ == 3 else 1
            return value if 1 <= value <= 8 else 1
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


_torch_ready = False


def _resize(img: np.ndarray, height: int, width: int, out: np.ndarray | None = None) -> np.ndarray:
    """Antialiased bilinear resize of a uint8 H×W×3 array: datapipe's compiled kernel
    (:func:`datapipe.native.resize`, ~0.10 ms for 340² -> 256² here) where it is built, else torch's
    AVX2 uint8 kernel (~0.2 ms), which gives the same pixels.

    Input and output stay channels-last (H×W×3 in memory): with an ``out=`` tensor in that layout
    torch skips two transposing copies (0.2 ms instead of 0.5 ms). A cropped view is read in place;
    only views with negative strides (mirrored by EXIF) are copied.
    """
    if out is None:
        out = np.empty((height, width, 3), np.uint8)
    if img.shape[0] == height and img.shape[1] == width:
        out[...] = img
        return out
    from datapipe import native

    if min(img.strides) < 0:  # both kernels need positive strides
        img = np.ascontiguousarray(img)
    if native.resize(img, out):  # the compiled kernel: the same pixels as torch's, ~1.7x faster
        return out
    if not img.flags.writeable:  # torch.from_numpy needs writable memory
        img = img.copy()
    global _torch_ready
    import torch

    if not _torch_ready:  # build workers run one task per core: no intra-op threads
        torch.set_num_threads(1)
        _torch_ready = True
    src = torch.from_numpy(img).permute(2, 0, 1)[None]
    dst = torch.from_numpy(out).permute(2, 0, 1)[None]
    try:
        torch.ops.aten._upsample_bilinear2d_aa.out(src, [height, width], False, None, None, out=dst)
    except (AttributeError, RuntimeError):  # pragma: no cover - older torch without the out= overload
        import torch.nn.functional as F

        res = F.interpolate(src, size=(height, width), mode="bilinear", antialias=True, align_corners=False)
        dst.copy_(res)
    return out


def fit_image(img: np.ndarray, spec: DecodeSpec, out: np.ndarray | None = None) -> np.ndarray:
    """Resize and crop/pad/stretch an oriented H×W×3 uint8 array to spec.size × spec.size (into ``out``)."""
    h, w = img.shape[:2]
    size = spec.size
    if out is None:
        out = np.empty((size, size, 3), np.uint8)
    if spec.fit == "crop":
        side = min(h, w)
        y0, x0 = (h - side) // 2, (w - side) // 2
        return _resize(img[y0 : y0 + side, x0 : x0 + side], size, size, out)
    if spec.fit == "stretch":
        return _resize(img, size, size, out)
    scale = size / max(h, w)
    nh, nw = max(1, round(h * scale)), max(1, round(w * scale))
    out[...] = BACKGROUND
    y0, x0 = (size - nh) // 2, (size - nw) // 2
    out[y0 : y0 + nh, x0 : x0 + nw] = _resize(img, nh, nw)
    return out


def dct_factor(height: int, width: int, spec: DecodeSpec) -> int:
    """The largest power-of-two DCT downscale (1, 2, 4 or 8) that keeps enough pixels for spec."""
    if spec.fit == "crop":
        limit = min(height, width)
    elif spec.fit == "pad":
        limit = max(height, width)
    else:
        limit = min(height, width)
    factor = 1
    while factor < 8 and limit // (factor * 2) >= spec.size:
        factor *= 2
    return factor


# ----------------------------------------------------------------------------- colour


def _to_rgb(img) -> np.ndarray:
    """Turn a loaded Pillow image of any mode into uint8 RGB H×W×3."""

    mode = img.mode
    if mode == "RGB":
        return np.asarray(img)
    if mode in ("I;16", "I;16L", "I;16B", "I;16N", "I", "F"):
        arr = np.asarray(img)
        if mode == "F":
            arr = np.clip(arr * (255.0 if arr.max(initial=0) <= 1.0 else 1.0), 0, 255)
            gray = arr.round().astype(np.uint8)
        else:
            # 16-bit data is scaled to 8 bits (65535 -> 255), never clipped.
            gray = ((np.clip(arr.astype(np.int64), 0, 65535) * 255 + 32767) // 65535).astype(np.uint8)
        return np.repeat(gray[..., None], 3, axis=2)
    if mode == "P" and "transparency" in img.info:
        img = img.convert("RGBA")
        mode = "RGBA"
    if mode in ("RGBA", "LA", "PA", "RGBa", "La"):
        rgba = np.asarray(img.convert("RGBA"), dtype=np.uint16)
        alpha = rgba[..., 3:4]
        bg = np.array(BACKGROUND, np.uint16)
        return ((rgba[..., :3] * alpha + bg * (255 - alpha) + 127) // 255).astype(np.uint8)
    if mode == "L":
        return np.repeat(np.asarray(img)[..., None], 3, axis=2)
    return np.asarray(img.convert("RGB"))


# ----------------------------------------------------------------------------- decode


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


def _decode_simplejpeg(sj, data: bytes, spec: DecodeSpec, reuse: bool = False) -> np.ndarray | None:
    """Decode with libjpeg-turbo; None when the JPEG needs Pillow (CMYK/YCCK).

    With ``reuse`` the pixels land in this thread's scratch buffer (valid until its next decode).
    """
    try:
        height, width, colorspace, _ = sj.decode_jpeg_header(data)
    except ValueError as exc:
        raise DecodeError(f"corrupt JPEG header: {exc}") from None
    _check_pixels(width, height, spec)
    if colorspace in ("CMYK", "YCCK"):
        # Pillow converts the colours (Adobe's inverted CMYK included) but tolerates damaged scan
        # data, so the file is first fully decoded here, strictly, to reject what any backend would.
        try:
            sj.decode_jpeg(data, colorspace="CMYK", strict=True)
        except ValueError as exc:
            raise DecodeError(f"corrupt or truncated JPEG ({colorspace}): {exc}") from None
        return None
    factor = dct_factor(height, width, spec)
    min_h, min_w = -(-height // factor), -(-width // factor)
    try:
        buffer = None
        if reuse:
            out_h, out_w = (height, width) if factor == 1 else sj.decode_jpeg_header(
                data, min_height=min_h, min_width=min_w)[:2]
            buffer = _buffer(out_h * out_w * 3)
        img = sj.decode_jpeg(data, colorspace="RGB", min_height=min_h, min_width=min_w, strict=True,
                             buffer=buffer)
    except ValueError as exc:
        raise DecodeError(f"corrupt or truncated JPEG: {exc}") from None
    return apply_orientation(img, jpeg_orientation(data))


def _check_pixels(width: int, height: int, spec: DecodeSpec) -> None:
    if width * height > spec.max_pixels:
        raise DecodeError(
            f"decompression bomb: header says {width}x{height} = {width * height:,} pixels, "
            f"over max_pixels={spec.max_pixels:,} (raise max_pixels if the image is genuine)", "too-large"
        )
    if width < 1 or height < 1:
        raise DecodeError(f"image header says {width}x{height} pixels")


def _decode_pillow(data: bytes, fmt: str, spec: DecodeSpec) -> np.ndarray:
    import warnings

    from PIL import Image, UnidentifiedImageError

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            warnings.simplefilter("ignore", UserWarning)  # "Corrupt EXIF data": EXIF is optional
            img = Image.open(io.BytesIO(data))
            _check_pixels(img.width, img.height, spec)
            if fmt == "jpeg":
                orientation = jpeg_orientation(data)
                factor = dct_factor(img.height, img.width, spec)
                if factor > 1:
                    img.draft(img.mode, (-(-img.width // factor), -(-img.height // factor)))
            else:
                orientation = _pillow_orientation(img)
            img.seek(0)  # first frame of animations
            img.load()  # a full decode: truncated and corrupt data fail here
            rgb = _to_rgb(img)
    except DecodeError:
        raise
    except Image.DecompressionBombError as exc:
        raise DecodeError(f"decompression bomb: {exc}", "too-large") from None
    except UnidentifiedImageError as exc:
        raise DecodeError(f"not a readable {fmt.upper()} image: {exc}") from None
    except (OSError, ValueError, SyntaxError, struct.error, EOFError, IndexError) as exc:
        raise DecodeError(f"corrupt or truncated {fmt.upper()}: {type(exc).__name__}: {exc}") from None
    return apply_orientation(rgb, orientation)


def _pillow_orientation(img) -> int:
    try:
        value = int(img.getexif().get(0x0112, 1))
    except Exception:  # noqa: BLE001 - broken EXIF is tolerated, the image is not
        return 1
    return value if 1 <= value <= 8 else 1


def decode_rgb(data: bytes, spec: DecodeSpec | None = None, *, _reuse: bool = False) -> np.ndarray:
    """Fully decode one file's bytes to an oriented uint8 RGB array (before resizing).

    DCT downscaling by a power of two is applied when ``spec`` says the output is at most half the
    source size. Raises DecodeError with the quarantine reason for anything that is not a readable
    image.
    """
    spec = spec or DecodeSpec(size=8192)  # no spec: full resolution, no DCT downscaling
    if not data:
        raise DecodeError("empty file (0 bytes)", "empty")
    fmt = sniff(data[:16])
    if fmt is None:
        raise DecodeError(f"not an image: unrecognised content (starts with {data[:8]!r})", "not-an-image")
    if fmt == "jpeg":
        sj = _simplejpeg()
        if sj is not None:
            img = _decode_simplejpeg(sj, data, spec, reuse=_reuse)
            if img is not None:
                return img
    return _decode_pillow(data, fmt, spec)


def decode_sample(data: bytes, spec: DecodeSpec, out: np.ndarray | None = None) -> np.ndarray:
    """Decode one file's bytes into the canonical sample: uint8 [size, size, 3] (into ``out``)."""
    img = decode_rgb(data, spec, _reuse=True)
    if img.ndim != 3 or img.shape[2] != 3:
        raise DecodeError(f"decoder returned shape {img.shape}, expected H×W×3")
    return fit_image(img, spec, out)
