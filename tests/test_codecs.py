"""Decoding one file into the canonical sample: every bad kind is a DecodeError with a reason, every
good kind becomes uint8 RGB with orientation, colour, alpha and bit depth handled, whatever the backend."""

from __future__ import annotations

import io
import time

import numpy as np
import pytest
from PIL import Image, ImageOps

from datapipe import codecs
from datapipe.codecs import DecodeSpec, apply_orientation, decode_rgb, decode_sample, fit_image, jpeg_orientation, sniff
from datapipe.errors import DecodeError

FULL = DecodeSpec(size=8192)  # large enough that no DCT downscaling happens


@pytest.fixture(params=["simplejpeg", "pillow"])
def backend(request, monkeypatch) -> str:
    """Run a test once with libjpeg-turbo via simplejpeg and once with the Pillow fallback."""
    if request.param == "pillow":
        monkeypatch.setattr(codecs, "_simplejpeg", lambda: None)
    else:
        assert codecs._simplejpeg() is not None, "simplejpeg is a hard dependency"
    return request.param


def pillow_rgb(data: bytes) -> np.ndarray:
    return np.asarray(ImageOps.exif_transpose(Image.open(io.BytesIO(data))).convert("RGB"))


def mean_abs(a: np.ndarray, b: np.ndarray) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return float(np.abs(a.astype(np.int32) - b.astype(np.int32)).mean())


def check_rgb(img: np.ndarray, shape=None) -> None:
    assert img.dtype == np.uint8 and img.ndim == 3 and img.shape[2] == 3
    if shape is not None:
        assert img.shape[:2] == tuple(shape)


# ----------------------------------------------------------------------------- bad inputs


def test_zero_byte_file():
    with pytest.raises(DecodeError, match="empty file"):
        decode_rgb(b"", FULL)


@pytest.mark.parametrize("content", [b"hello, I am text with a .jpg name\n" * 10, b"\x00" * 64,
                                     b"<html><body>404</body></html>", b"\xff\xd8"])
def test_non_image_content(content):
    with pytest.raises(DecodeError) as info:
        decode_sample(content, DecodeSpec(size=32))
    reason = str(info.value)
    assert reason and ("not an image" in reason or "JPEG" in reason)


def test_non_image_reason_names_the_content():
    with pytest.raises(DecodeError, match="not an image.*hello"):
        decode_rgb(b"hello world, plain text", FULL)


def test_truncated_jpeg(imaging, backend):
    data = imaging.jpeg(imaging.gradient(96, 128))
    with pytest.raises(DecodeError, match="(?i)truncated"):
        decode_rgb(data[: len(data) // 2], FULL)


@pytest.mark.parametrize("cut", [0.5, 0.9])
def test_truncated_png(imaging, cut):
    data = imaging.encode(imaging.gradient(64, 80), "PNG")
    with pytest.raises(DecodeError, match="PNG"):
        decode_rgb(data[: int(len(data) * cut)], FULL)


@pytest.mark.parametrize("seed", [5, 6, 7, 8])
def test_corrupt_jpeg_rejected_or_deterministic(imaging, backend, seed):
    """Garbage in the scan data: rejected, or (if the decoder recovers) the same pixels every time."""
    bad = imaging.corrupt_jpeg(imaging.jpeg(imaging.gradient(128, 160)), seed=seed, zero_tail=False)
    try:
        first = decode_rgb(bad, FULL)
    except DecodeError as exc:
        assert "corrupt" in str(exc).lower() or "truncated" in str(exc).lower()
        with pytest.raises(DecodeError):  # and rejected again, not only once
            decode_rgb(bad, FULL)
        return
    check_rgb(first, (128, 160))
    np.testing.assert_array_equal(first, decode_rgb(bad, FULL))
    np.testing.assert_array_equal(decode_sample(bad, DecodeSpec(size=32)), decode_sample(bad, DecodeSpec(size=32)))


@pytest.mark.parametrize("shape", [(40, 52), (96, 128), (300, 400)])
@pytest.mark.parametrize("size", [8192, 32])
def test_corrupt_jpeg_rejected_by_libjpeg_turbo(imaging, shape, size):
    """simplejpeg decodes with strict=True: a libjpeg warning about corrupt data is an error,
    with or without DCT downscaling."""
    bad = imaging.corrupt_jpeg(imaging.jpeg(imaging.gradient(*shape)))
    with pytest.raises(DecodeError, match="(?i)corrupt"):
        decode_rgb(bad, DecodeSpec(size=size))
    with pytest.raises(DecodeError, match="(?i)corrupt"):
        decode_sample(bad, DecodeSpec(size=size if size < 8192 else 64))


def test_corrupt_cmyk_jpeg_is_rejected_although_pillow_converts_it(imaging):
    """CMYK/YCCK JPEGs take Pillow's colour conversion, but only after a strict libjpeg-turbo decode."""
    arr = imaging.gradient(128, 160)
    data = imaging.encode(Image.fromarray(arr).convert("CMYK"), "JPEG", quality=90)
    assert decode_rgb(data, FULL).shape == (128, 160, 3)
    with pytest.raises(DecodeError, match="CMYK"):
        decode_rgb(imaging.corrupt_jpeg(data), FULL)


@pytest.mark.parametrize("width,height", [(20000, 20000), (12000, 12000), (100_000, 1)])
def test_decompression_bomb_png_is_refused_from_the_header(imaging, width, height):
    """20000² is past Pillow's own limit; 12000² is past max_pixels but under Pillow's error limit."""
    data = imaging.png_claiming(width, height)
    assert len(data) < 200  # only 4x4 pixels of real data: a decode would fail differently
    start = time.perf_counter()
    with pytest.raises(DecodeError, match="decompression bomb"):
        decode_sample(data, DecodeSpec(size=32, max_pixels=50_000))
    assert time.perf_counter() - start < 1.0


def test_decompression_bomb_default_limit(imaging):
    with pytest.raises(DecodeError, match="decompression bomb"):
        decode_rgb(imaging.png_claiming(12000, 12000), DecodeSpec(size=32))  # 144 M > 100 M


def test_decompression_bomb_jpeg_header(imaging, backend):
    import struct

    data = bytearray(imaging.jpeg(imaging.gradient(40, 56)))
    sof = data.find(b"\xff\xc0")
    assert sof > 0
    struct.pack_into(">HH", data, sof + 5, 30000, 30000)  # height, width in the SOF0 segment
    start = time.perf_counter()
    with pytest.raises(DecodeError, match="decompression bomb"):
        decode_rgb(bytes(data), DecodeSpec(size=32))
    assert time.perf_counter() - start < 1.0


def test_max_pixels_is_configurable(imaging):
    data = imaging.encode(imaging.gradient(40, 50), "PNG")
    with pytest.raises(DecodeError, match="decompression bomb.*50x40"):
        decode_rgb(data, DecodeSpec(size=32, max_pixels=1999))
    check_rgb(decode_rgb(data, DecodeSpec(size=32, max_pixels=2000)), (40, 50))


# ----------------------------------------------------------------------------- EXIF orientation


@pytest.mark.parametrize("orientation", range(1, 9))
def test_exif_orientation_matches_pillow(imaging, backend, orientation):
    arr = imaging.gradient(48, 64, seed=orientation)
    data = imaging.jpeg_with_orientation(arr, orientation)
    assert jpeg_orientation(data) == orientation
    ours = decode_rgb(data, FULL)
    ref = pillow_rgb(data)
    assert ours.shape == ref.shape == ((48, 64, 3) if orientation <= 4 else (64, 48, 3))
    assert mean_abs(ours, ref) < 2
    # the marker block (top-left of the stored image) lands where the orientation says
    plain = decode_rgb(imaging.jpeg(arr, quality=95), FULL)
    np.testing.assert_array_equal(ours, apply_orientation(plain, orientation))


def test_exif_orientation_in_decode_sample(imaging):
    """The canonical sample of a rotated JPEG equals the sample of the upright image."""
    arr = imaging.gradient(60, 100, seed=1)
    upright = np.ascontiguousarray(np.rot90(arr, -1))  # what orientation 6 displays
    spec = DecodeSpec(size=40, fit="stretch")
    ours = decode_sample(imaging.jpeg_with_orientation(arr, 6), spec)
    ref = decode_sample(imaging.encode(upright, "PNG"), spec)
    assert mean_abs(ours, ref) < 3


def test_exif_orientation_of_non_jpeg(imaging):
    exif = Image.Exif()
    exif[0x0112] = 6
    arr = imaging.gradient(40, 56)
    data = imaging.encode(arr, "WEBP", lossless=True, exif=exif.tobytes())
    np.testing.assert_array_equal(decode_rgb(data, FULL), np.rot90(arr, -1))


@pytest.mark.parametrize("payload", [
    b"Exif\x00\x00",  # no TIFF header at all
    b"Exif\x00\x00MM\x00*\xff\xff\xff\xf0garbage-garbage",  # IFD offset far past the end
    b"Exif\x00\x00II*\x00\x08\x00\x00\x00\x01\x00\x12\x01\x03\x00\x01\x00\x00\x00\x09\x00\x00\x00",  # orientation 9
    b"Exif\x00\x00II*\x00\x08\x00\x00\x00\xff\xff",  # 65535 entries, none present
    bytes(range(256)) * 3,  # not even an Exif header
], ids=["empty", "bad-offset", "orientation-9", "bad-count", "random"])
def test_broken_exif_decodes_upright(imaging, backend, payload):
    arr = imaging.gradient(40, 56)
    clean = imaging.jpeg(arr, quality=95)
    broken = imaging.with_app1(clean, payload)
    assert jpeg_orientation(broken) == 1
    ours = decode_rgb(broken, FULL)
    check_rgb(ours, (40, 56))
    np.testing.assert_array_equal(ours, decode_rgb(clean, FULL))


# ----------------------------------------------------------------------------- colour and bit depth


def test_cmyk_jpeg(imaging):
    arr = imaging.gradient(48, 64)
    data = imaging.encode(Image.fromarray(arr).convert("CMYK"), "JPEG", quality=95)
    assert Image.open(io.BytesIO(data)).mode == "CMYK"
    ours = decode_rgb(data, FULL)
    check_rgb(ours, (48, 64))
    assert mean_abs(ours, np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))) < 1.5
    assert mean_abs(ours, arr) < 6  # and it is the picture, not inverted colours


def test_ycck_jpeg(imaging):
    """libjpeg-turbo encodes CMYK input as YCCK; stored inverted as Adobe applications do."""
    simplejpeg = pytest.importorskip("simplejpeg")
    arr = imaging.gradient(48, 64)
    cmyk = np.asarray(Image.fromarray(arr).convert("CMYK"))
    data = simplejpeg.encode_jpeg(np.ascontiguousarray(255 - cmyk), quality=95, colorspace="CMYK")
    assert simplejpeg.decode_jpeg_header(data)[2] == "YCCK"
    ours = decode_rgb(data, FULL)
    check_rgb(ours, (48, 64))
    assert mean_abs(ours, np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))) < 1.5
    assert mean_abs(ours, arr) < 6


@pytest.mark.parametrize("fmt", ["PNG", "JPEG"])
def test_grayscale(imaging, fmt):
    gray = imaging.gradient(30, 44)[..., 0]
    data = imaging.encode(gray, fmt, **({"quality": 95} if fmt == "JPEG" else {}))
    ours = decode_rgb(data, FULL)
    check_rgb(ours, (30, 44))
    np.testing.assert_array_equal(ours[..., 0], ours[..., 1])
    np.testing.assert_array_equal(ours[..., 0], ours[..., 2])
    if fmt == "PNG":
        np.testing.assert_array_equal(ours[..., 0], gray)
    else:
        assert mean_abs(ours[..., 0], gray) < 2


def test_la_alpha_composited_on_white(imaging):
    la = np.zeros((10, 12, 2), np.uint8)
    la[..., 0], la[..., 1] = 100, 255
    la[0, 0, 1] = 0  # fully transparent
    la[0, 1, 1] = 128
    ours = decode_rgb(imaging.encode(Image.fromarray(la, "LA"), "PNG"), FULL)
    check_rgb(ours, (10, 12))
    assert tuple(ours[0, 0]) == (255, 255, 255)
    assert tuple(ours[1, 1]) == (100, 100, 100)
    assert 170 <= ours[0, 1, 0] <= 180  # (100*128 + 255*127) / 255 = 177


def test_rgba_alpha_composited_on_white(imaging):
    rgba = np.zeros((10, 12, 4), np.uint8)
    rgba[..., :3] = (200, 10, 50)
    rgba[..., 3] = 255
    rgba[0, 0] = (0, 0, 0, 0)  # transparent black must become white, not black
    rgba[0, 1, 3] = 128
    ours = decode_rgb(imaging.encode(Image.fromarray(rgba, "RGBA"), "PNG"), FULL)
    check_rgb(ours, (10, 12))
    assert tuple(ours[0, 0]) == (255, 255, 255)
    assert tuple(ours[5, 5]) == (200, 10, 50)
    np.testing.assert_allclose(ours[0, 1], [227, 132, 152], atol=2)


def test_palette_with_transparency(imaging):
    colours = [(200, 10, 10), (10, 200, 10), (10, 10, 200), (0, 0, 0)]
    idx = np.zeros((8, 9), np.uint8)
    idx[:, 3:6], idx[:, 6:] = 1, 2
    idx[0, 0] = 3  # the transparent entry
    img = Image.fromarray(idx, "P")
    img.putpalette([c for rgb in colours for c in rgb])
    data = imaging.encode(img, "PNG", transparency=3)
    reopened = Image.open(io.BytesIO(data))
    assert reopened.mode == "P" and "transparency" in reopened.info
    ours = decode_rgb(data, FULL)
    check_rgb(ours, (8, 9))
    assert tuple(ours[0, 0]) == (255, 255, 255)
    assert tuple(ours[1, 0]) == colours[0]
    assert tuple(ours[4, 4]) == colours[1]
    assert tuple(ours[4, 8]) == colours[2]


def test_palette_without_transparency(imaging):
    img = Image.fromarray(imaging.gradient(20, 24)).convert("P", palette=Image.Palette.ADAPTIVE, colors=32)
    data = imaging.encode(img, "PNG")
    np.testing.assert_array_equal(decode_rgb(data, FULL), np.asarray(img.convert("RGB")))


def test_16bit_grayscale_png_is_scaled_not_clipped(imaging):
    values = np.array([0, 257, 32768, 65535, 1000, 257 * 200], np.uint16)
    arr = np.tile(values, (3, 1))
    img = Image.fromarray(arr)
    data = imaging.encode(img, "PNG")
    assert Image.open(io.BytesIO(data)).mode.startswith("I")  # really stored as 16-bit
    ours = decode_rgb(data, FULL)
    check_rgb(ours, (3, 6))
    assert list(ours[0, :, 0]) == [0, 1, 128, 255, 4, 200]
    np.testing.assert_array_equal(ours[..., 0], ours[..., 2])


def test_16bit_rgb_png(imaging):
    arr = np.zeros((2, 4, 3), np.uint16)
    arr[0, 0] = 65535
    arr[0, 1] = 32768
    arr[0, 2] = (65535, 0, 32768)
    arr[1, :] = (257 * 10, 257 * 100, 257 * 250)
    data = imaging.png16_rgb(arr)
    assert data[24:26] == b"\x10\x02"  # IHDR: bit depth 16, colour type 2 (RGB)
    ours = decode_rgb(data, FULL)
    check_rgb(ours, (2, 4))
    assert tuple(ours[0, 0]) == (255, 255, 255)  # max stays max
    assert tuple(ours[0, 1]) == (128, 128, 128)
    assert tuple(ours[0, 2]) == (255, 0, 128)
    assert tuple(ours[1, 3]) == (10, 100, 250)


# ----------------------------------------------------------------------------- formats


def test_progressive_jpeg(imaging, backend):
    arr = imaging.gradient(64, 80)
    data = imaging.jpeg(arr, quality=95, progressive=True)
    assert b"\xff\xc2" in data  # SOF2: progressive
    ours = decode_rgb(data, FULL)
    check_rgb(ours, (64, 80))
    assert mean_abs(ours, pillow_rgb(data)) < 1.5
    assert mean_abs(ours, arr) < 4


def test_gif_first_frame(imaging):
    frames = [Image.fromarray(np.full((20, 30, 3), c, np.uint8)) for c in ((200, 30, 30), (30, 30, 200))]
    buf = io.BytesIO()
    frames[0].save(buf, "GIF", save_all=True, append_images=frames[1:], duration=50)
    data = buf.getvalue()
    assert getattr(Image.open(io.BytesIO(data)), "n_frames", 1) == 2
    ours = decode_rgb(data, FULL)
    check_rgb(ours, (20, 30))
    assert np.abs(ours.astype(int) - (200, 30, 30)).max() <= 8


@pytest.mark.parametrize("fmt,kwargs,name", [
    ("WEBP", {"lossless": True}, "webp"), ("BMP", {}, "bmp"), ("TIFF", {}, "tiff"), ("PNG", {}, "png"),
    ("GIF", {}, "gif"), ("JPEG", {"quality": 95}, "jpeg"),
])
def test_formats(imaging, fmt, kwargs, name):
    arr = imaging.gradient(33, 47)
    data = imaging.encode(arr, fmt, **kwargs)
    assert sniff(data[:16]) == name
    ours = decode_rgb(data, FULL)
    check_rgb(ours, (33, 47))
    assert mean_abs(ours, pillow_rgb(data)) < 1.5
    if fmt in ("WEBP", "BMP", "TIFF", "PNG"):
        np.testing.assert_array_equal(ours, arr)  # lossless formats round-trip exactly


def test_lossy_webp(imaging):
    arr = imaging.gradient(48, 64)
    data = imaging.encode(arr, "WEBP", quality=90)
    assert mean_abs(decode_rgb(data, FULL), pillow_rgb(data)) < 1.5


def test_png_named_jpg_is_sniffed_by_content(imaging, tmp_path):
    arr = imaging.gradient(30, 40)
    path = tmp_path / "really-a-png.jpg"
    path.write_bytes(imaging.encode(arr, "PNG"))
    data = path.read_bytes()
    assert sniff(data[:16]) == "png"
    np.testing.assert_array_equal(decode_rgb(data, FULL), arr)


def test_sniff():
    assert sniff(b"\xff\xd8\xff\xe0") == "jpeg"
    assert sniff(b"\x89PNG\r\n\x1a\n") == "png"
    assert sniff(b"RIFF\x00\x00\x00\x00WEBPVP8 ") == "webp"
    assert sniff(b"GIF89a") == "gif"
    assert sniff(b"<html>") is None
    assert sniff(b"") is None


# ----------------------------------------------------------------------------- backends agree


@pytest.mark.parametrize("subsampling,size", [(2, 8192), (0, 8192), (2, 100), (2, 40)])
def test_simplejpeg_and_pillow_agree(imaging, monkeypatch, subsampling, size):
    """Same JPEG, same spec (including DCT downscaling at the smaller sizes): nearly the same pixels."""
    arr = imaging.gradient(240, 320, seed=9)
    data = imaging.jpeg(arr, quality=90, subsampling=subsampling)
    spec = DecodeSpec(size=size)
    fast = decode_rgb(data, spec)
    fast_sample = decode_sample(data, DecodeSpec(size=min(size, 64)))
    monkeypatch.setattr(codecs, "_simplejpeg", lambda: None)
    slow = decode_rgb(data, spec)
    slow_sample = decode_sample(data, DecodeSpec(size=min(size, 64)))
    assert fast.shape == slow.shape
    if size == 8192:
        assert fast.shape == (240, 320, 3)
    assert mean_abs(fast, slow) < 1.5
    assert mean_abs(fast_sample, slow_sample) < 1.5


@pytest.mark.parametrize("backend", ["simplejpeg", "pillow"])
@pytest.mark.parametrize("size,fit,expected", [
    (100, "crop", (120, 160)),  # short side 480 >= 4 x 100, < 8 x 100: 1/4
    (240, "crop", (240, 320)),  # exactly 2x: 1/2
    (241, "crop", (480, 640)),  # under 2x: full size
    (130, "crop", (240, 320)),  # short side 480 < 4 x 130: 1/2 ...
    (130, "pad", (120, 160)),  # ... but pad keeps the long side, 640 >= 4 x 130: 1/4
    (60, "stretch", (60, 80)),  # stretch follows the short side, like crop: 1/8
])
def test_dct_downscaling_decodes_fewer_pixels(imaging, monkeypatch, backend, size, fit, expected):
    """A JPEG much larger than the target is decoded at 1/2, 1/4 or 1/8 scale, with either backend."""
    data = imaging.jpeg(imaging.gradient(480, 640, seed=5), quality=90)
    if backend == "pillow":
        monkeypatch.setattr(codecs, "_simplejpeg", lambda: None)
    img = decode_rgb(data, DecodeSpec(size=size, fit=fit))
    assert img.shape == (*expected, 3)
    assert decode_sample(data, DecodeSpec(size=size, fit=fit)).shape == (size, size, 3)


# ----------------------------------------------------------------------------- geometry


@pytest.mark.parametrize("kernel", ["native", "torch"])
def test_fit_takes_read_only_and_mirrored_views(imaging, monkeypatch, kernel):
    """EXIF-mirrored views (negative strides) and read-only arrays resize like a contiguous copy."""
    from datapipe import native

    if kernel == "torch":
        monkeypatch.setattr(native, "resizer", lambda: None)
    arr = imaging.gradient(90, 120, seed=3)
    frozen = arr.copy()
    frozen.flags.writeable = False
    spec = DecodeSpec(size=48)
    for view in (frozen, arr[::-1, ::-1], frozen[:, ::-1]):
        assert np.array_equal(fit_image(view, spec), fit_image(np.ascontiguousarray(view), spec))


def _three_bands(height: int, width: int, axis: int) -> np.ndarray:
    """Red, green and blue thirds along ``axis`` (1: left to right, 0: top to bottom)."""
    arr = np.zeros((height, width, 3), np.uint8)
    n = arr.shape[axis]
    for i, colour in enumerate(((255, 0, 0), (0, 255, 0), (0, 0, 255))):
        sl = [slice(None), slice(None)]
        sl[axis] = slice(i * n // 3, (i + 1) * n // 3)
        arr[tuple(sl)] = colour
    return arr


@pytest.mark.parametrize("fit", ["crop", "pad", "stretch"])
@pytest.mark.parametrize("shape", [(30, 90), (90, 30), (50, 50), (600, 800), (10, 12)])
def test_fit_shapes(imaging, fit, shape):
    spec = DecodeSpec(size=48, fit=fit)
    out = decode_sample(imaging.jpeg(imaging.gradient(*shape)), spec)
    assert out.shape == (48, 48, 3) and out.dtype == np.uint8 and out.flags.c_contiguous


def test_fit_pad_wide_image_has_white_borders(imaging):
    wide = _three_bands(30, 90, axis=1)
    out = decode_sample(imaging.encode(wide, "PNG"), DecodeSpec(size=48, fit="pad"))
    # 90x30 scaled to 48x16, centred: rows 0..15 and 32..47 are background
    assert (out[:15] == 255).all() and (out[33:] == 255).all()
    middle = out[24]
    assert tuple(middle[2]) == (255, 0, 0) and tuple(middle[24]) == (0, 255, 0) and tuple(middle[45]) == (0, 0, 255)


def test_fit_pad_tall_image_has_white_borders(imaging):
    tall = _three_bands(90, 30, axis=0)
    out = decode_sample(imaging.encode(tall, "PNG"), DecodeSpec(size=48, fit="pad"))
    assert (out[:, :15] == 255).all() and (out[:, 33:] == 255).all()
    assert tuple(out[2, 24]) == (255, 0, 0) and tuple(out[45, 24]) == (0, 0, 255)


def test_fit_crop_keeps_the_centre(imaging):
    out = decode_sample(imaging.encode(_three_bands(30, 90, axis=1), "PNG"), DecodeSpec(size=24, fit="crop"))
    np.testing.assert_array_equal(out, np.broadcast_to(np.array([0, 255, 0], np.uint8), out.shape))


def test_fit_stretch_keeps_everything(imaging):
    out = decode_sample(imaging.encode(_three_bands(30, 90, axis=1), "PNG"), DecodeSpec(size=30, fit="stretch"))
    assert tuple(out[15, 2]) == (255, 0, 0) and tuple(out[15, 15]) == (0, 255, 0)
    assert tuple(out[15, 28]) == (0, 0, 255)
    assert (out[0] == out[29]).all()  # only the width was squeezed


def test_decode_sample_is_deterministic(imaging):
    data = imaging.jpeg(imaging.gradient(300, 400))
    spec = DecodeSpec(size=64)
    np.testing.assert_array_equal(decode_sample(data, spec), decode_sample(data, spec))


@pytest.mark.parametrize("kwargs", [{"size": 4}, {"size": 100_000}, {"size": 32.0}, {"fit": "zoom"},
                                    {"max_pixels": 0}])
def test_decode_spec_validation(kwargs):
    with pytest.raises(ValueError):
        DecodeSpec(**kwargs)


# ----------------------------------------------------------------------------- damaged JPEGs, fuzzed


def _textured_jpeg(progressive: bool = False) -> bytes:
    rng = np.random.default_rng(7)
    y, x = np.mgrid[0:128, 0:160]
    arr = np.stack([x, y, (x + y) // 2], -1) + rng.integers(-20, 20, (128, 160, 3))
    buf = io.BytesIO()
    Image.fromarray(np.clip(arr, 0, 255).astype(np.uint8)).save(buf, "JPEG", quality=90, progressive=progressive)
    return buf.getvalue()


def _fuzzed(data: bytes, seed: int) -> list[bytes]:
    """Seeded damage: byte overwrites inside the scan data, truncations, bit flips in the header."""
    rng = np.random.default_rng(seed)
    sos = data.find(b"\xff\xda")
    out = []
    for _ in range(12):
        bad = bytearray(data)
        at = int(rng.integers(sos + 20, len(data) - 66))
        for k in range(at, at + int(rng.choice([1, 4, 16, 40]))):
            bad[k] = int(rng.integers(0, 256))
        out.append(bytes(bad))
    for _ in range(4):
        out.append(data[: int(rng.integers(sos + 20, len(data) - 1))])
    for _ in range(8):
        bad = bytearray(data)
        bad[int(rng.integers(2, sos))] ^= 1 << int(rng.integers(0, 8))
        out.append(bytes(bad))
    return out


def _libjpeg_message(data: bytes) -> str | None:
    """What libjpeg-turbo says about ``data`` with its header's harmless warnings taken away, or None."""
    import simplejpeg

    try:
        simplejpeg.decode_jpeg(codecs._clean_jpeg_header(data, neutral=True), strict=True)
    except ValueError as exc:
        return str(exc)
    return None


@pytest.mark.parametrize("progressive", [False, True])
@pytest.mark.parametrize("seed", range(4))
def test_fuzzed_jpegs_with_any_damage_message_are_quarantined(progressive, seed):
    """Every damage libjpeg-turbo reports quarantines the file (not only a few known messages), and a
    kept file is one libjpeg-turbo decodes without a word: what a decoder can see, it refuses."""
    clean = _textured_jpeg(progressive)
    reference = decode_rgb(clean).astype(np.int16)
    kept = refused = 0
    for data in _fuzzed(clean, seed):
        try:
            ours = decode_rgb(data)
        except DecodeError as exc:
            assert exc.kind in ("corrupt", "too-large") and str(exc), exc
            refused += 1
            continue
        kept += 1
        message = _libjpeg_message(data)
        assert message is None or codecs._jpeg_verdict(message, data) == "harmless", message
        if message is not None and ours.shape == reference.shape:
            assert np.abs(ours.astype(np.int16) - reference).mean() <= 1
    assert refused >= 8 and kept + refused == 24


def test_the_damage_of_the_extraneous_bytes_kind_is_quarantined():
    """A byte changed in the scan data makes the decoder finish early ("N extraneous bytes before
    marker 0xd9"): garbage pixels, which were kept when only a few messages counted as damage."""
    clean = _textured_jpeg()
    bad = bytearray(clean)
    sos = clean.find(b"\xff\xda")
    for seed in range(40):
        candidate = bytearray(clean)
        candidate[sos + 40 + seed * 13] ^= 0x5A
        message = _libjpeg_message(bytes(candidate)) or ""
        if "extraneous" in message:
            bad = candidate
            break
    assert bad != bytearray(clean), "no byte change gave the extraneous-bytes message"
    with pytest.raises(DecodeError, match="damaged scan data") as info:
        decode_rgb(bytes(bad))
    assert info.value.kind == "corrupt"


def test_a_harmless_header_warning_does_not_hide_damage_in_the_scan(imaging):
    """An unknown JFIF revision (harmless) stops a strict decode before the scan: the scan is still
    checked, so damage behind such a header is quarantined, and without damage the file is kept."""
    clean = _textured_jpeg()
    jfif = bytearray(clean)
    app0 = clean.find(b"JFIF\x00")
    jfif[app0 + 5] = 7  # JFIF 7.01: libjpeg-turbo warns and decodes on
    kept = decode_rgb(bytes(jfif))
    np.testing.assert_array_equal(kept, decode_rgb(clean))
    damaged = imaging.corrupt_jpeg(bytes(jfif), zero_tail=False, span=40)
    assert _libjpeg_message(damaged) is not None
    with pytest.raises(DecodeError, match="damaged scan data"):
        decode_rgb(damaged)


def test_zero_padding_before_the_end_marker_and_bytes_after_it_are_kept():
    clean = _textured_jpeg()
    reference = decode_rgb(clean)
    for data in (clean[:-2] + b"\x00" * 11 + clean[-2:], clean + b"trailing\xff\xd9bytes"):
        np.testing.assert_array_equal(decode_rgb(data), reference)


def test_quarantine_reasons_say_what_is_wrong_with_the_file():
    for data in (b"\xff\xd8\xff", b"GIF89a" + b"\x00" * 4, b"RIFF\x00\x00\x00\x00WEBPVP8 "):
        with pytest.raises(DecodeError) as info:
            decode_rgb(data)
        reason = str(info.value)
        assert "KeyError" not in reason and "BytesIO" not in reason and "0x" not in reason, reason
        assert info.value.kind == "corrupt"
