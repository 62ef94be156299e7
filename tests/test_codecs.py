"""Decoding one file into the canonical sample: every bad kind is a DecodeError with a reason, every
good kind becomes uint8 RGB with orientation, colour, alpha and bit depth handled, whatever the backend."""

from __future__ import annotations

import io
import struct
import threading
import time
import zlib

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


@pytest.mark.parametrize("fmt", ["PNG", "TIFF", "GIF", "BMP", "WEBP"])
def test_max_pixels_alone_decides_whatever_pillows_limit(imaging, monkeypatch, fmt):
    """Pillow refuses an image over 2 x Image.MAX_IMAGE_PIXELS (178,956,970 pixels by default) when it
    opens it, and TIFF, GIF and WebP again while reading it; in datapipe's decode max_pixels is the
    only rule, in both directions. Pillow's limit is made tiny here rather than decoding 180 M pixels."""
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 100)  # Pillow alone would refuse over 200 pixels
    data = imaging.encode(imaging.gradient(30, 40), fmt, **({"lossless": True} if fmt == "WEBP" else {}))
    check_rgb(decode_rgb(data, DecodeSpec(size=32, max_pixels=1200)), (30, 40))
    for limit in (100, None):  # Pillow's check on or off: datapipe's applies the same
        monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", limit)
        with pytest.raises(DecodeError, match="decompression bomb: header says 40x30 = 1,200 pixels") as info:
            decode_rgb(data, DecodeSpec(size=32, max_pixels=1199))
        assert info.value.kind == "too-large"


def test_max_pixels_above_pillows_default_limit_is_honoured(imaging):
    """A header of 13500 x 13500 = 182 M pixels, over Pillow's default limit of 178,956,970: with
    max_pixels at 200 M it goes on to be decoded, not refused as a bomb. Only 4x4 pixels of data
    follow the header, so the decode fails as truncated at once and the test decodes no 182 M pixels."""
    data = imaging.png_claiming(13500, 13500)
    with pytest.raises(DecodeError) as info:
        decode_rgb(data, DecodeSpec(size=32, max_pixels=200_000_000))
    assert info.value.kind == "corrupt" and "bomb" not in str(info.value), info.value
    with pytest.raises(DecodeError, match="decompression bomb: header says 13500x13500"):
        decode_rgb(data, DecodeSpec(size=32, max_pixels=182_249_999))


def test_pillows_own_limit_still_holds_outside_datapipes_decode(imaging, monkeypatch):
    """datapipe's limit applies to its own decode, in its own thread: code that opens an image with
    Pillow in another thread meanwhile keeps Pillow's limit (no module-wide setting changes)."""
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 100)
    data = imaging.encode(imaging.gradient(30, 40), "PNG")
    inside, release, result = threading.Event(), threading.Event(), {}
    to_rgb = codecs._to_rgb

    def paused(img, **kwargs):  # holds the decode (and its limit) open while the main thread opens the image
        inside.set()
        release.wait(10)
        return to_rgb(img, **kwargs)

    def decode():
        result["rgb"] = decode_rgb(data, DecodeSpec(size=32, max_pixels=10_000))

    monkeypatch.setattr(codecs, "_to_rgb", paused)
    worker = threading.Thread(target=decode)
    worker.start()
    try:
        assert inside.wait(5), "the decode did not get past Pillow's limit"
        with pytest.raises(Image.DecompressionBombError):
            Image.open(io.BytesIO(data))
    finally:
        release.set()
        worker.join(10)
    check_rgb(result["rgb"], (30, 40))


def _flipped(data: bytes, pos: int) -> bytes:
    bad = bytearray(data)
    bad[pos] ^= 0x01
    return bytes(bad)


def _pillow_keeps(data: bytes) -> bool:
    try:
        with Image.open(io.BytesIO(data)) as img:
            img.load()
        return True
    except Exception:  # noqa: BLE001 - any refusal
        return False


def test_png_whose_image_data_fails_its_crc_is_quarantined(imaging):
    """One flipped bit anywhere in IDAT: the chunk's CRC-32 fails. Pillow checks no CRC from IDAT on,
    and keeps many such files with wrong pixels (it stops inflating once it has every row, before
    zlib's Adler-32)."""
    y, x = np.mgrid[0:64, 0:96]
    arr = np.stack([x * 2, y * 3, (x * y) % 256], -1).astype(np.uint8)
    data = imaging.encode(arr, "PNG")
    start = data.index(b"IDAT") + 4
    length = struct.unpack(">I", data[start - 8 : start - 4])[0]
    wrong_but_kept_by_pillow = 0
    for pos in range(start, start + length, 3):
        bad = _flipped(data, pos)
        with pytest.raises(DecodeError, match=rf"^corrupt PNG: chunk IDAT at byte {start - 8} fails its CRC") as info:
            decode_rgb(bad, FULL)
        assert info.value.kind == "corrupt"
        if _pillow_keeps(bad):
            wrong_but_kept_by_pillow += mean_abs(pillow_rgb(bad), arr) > 5
    assert wrong_but_kept_by_pillow > 5


@pytest.mark.parametrize("kind", ["P6", "P5", "P5-16-bit", "P4", "P3-plain", "P1-plain"])
def test_netpbm_pictures_decode_as_pillow_reads_them(kind):
    """GTSRB's .ppm (and .pgm, .pbm) pictures, which torchvision's ImageFolder lists, were left out of a folder source
    without a word and called 'not an image' in a CSV."""
    rng = np.random.default_rng(3)
    rgb = rng.integers(0, 256, (5, 7, 3), dtype=np.uint8)
    gray = rgb[..., 0]
    data = {"P6": b"P6\n7 5\n255\n" + rgb.tobytes(), "P5": b"P5 7 5 255\n" + gray.tobytes(),
            "P5-16-bit": b"P5\n7 5\n1023\n" + (gray.astype(np.uint16) * 4).astype(">u2").tobytes(),
            "P4": b"P4\n8 2\n" + bytes([0b10110000, 0b00001111]),
            "P3-plain": b"P3\n# a comment\n2 1\n255\n255 0 0  0 0 255\n",
            "P1-plain": b"P1\n3 1\n1 0 1\n"}[kind]
    assert sniff(data[:16]) == "ppm"
    assert sniff(b"P1 is a text, no picture"[:16]) is None and sniff(b"P5\nhello"[:16]) is None
    with Image.open(io.BytesIO(data)) as img:
        img.load()
        mode = img.mode
        wide = np.asarray(img).astype(np.int64) if mode == "I" else None  # 0..1023 scaled by Pillow to 0..65535
        reference = np.asarray(img.convert("RGB")) if wide is None else None
    decoded = decode_rgb(data, FULL)
    if wide is None:
        np.testing.assert_array_equal(decoded, reference)
    else:
        np.testing.assert_array_equal(decoded[..., 0], (wide * 255 + 32767) // 65535)
        assert abs(decoded[..., 0].astype(int) - gray.astype(int) * 4 * 255 // 1023).max() <= 1
    with pytest.raises(DecodeError) as cut:
        decode_rgb(data[: len(data) // 2] if kind[:2] in ("P6", "P5", "P4") else data[:6], FULL)
    assert cut.value.kind in ("corrupt", "not-an-image")


def _png_chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def test_png_chunk_after_the_image_data_is_checked_too(imaging):
    """An eXIf chunk after IDAT: Pillow reads the orientation from it but never checks its CRC."""
    arr = imaging.gradient(40, 56)
    exif = Image.Exif()
    exif[0x0112] = 6
    png = imaging.encode(arr, "PNG")
    data = png[:-12] + _png_chunk(b"eXIf", exif.tobytes()[6:]) + png[-12:]  # before IEND
    np.testing.assert_array_equal(decode_rgb(data, FULL), np.rot90(arr, -1))
    value = data.index(b"eXIf") + 4 + 8 + 2 + 8  # the orientation SHORT of the one IFD entry
    bad = bytearray(data)
    bad[value] = 3  # 6 -> 3: rotated 180 degrees instead
    assert _pillow_keeps(bytes(bad))
    with pytest.raises(DecodeError, match="^corrupt PNG: chunk eXIf at byte .* fails its CRC"):
        decode_rgb(bytes(bad), FULL)


_BIG = bytes(1_200_000)  # inflates past Pillow's 1 MiB per chunk; deflates to about 1 KB


@pytest.mark.parametrize(("where", "kind", "body"), [
    ("before", b"iCCP", b"big profile\0\0" + zlib.compress(_BIG)),
    ("before", b"zTXt", b"Raw profile type icc\0\0" + zlib.compress(_BIG)),
    ("after", b"zTXt", b"Comment\0\0" + zlib.compress(_BIG)),
    ("before", b"iTXt", b"XML:com.adobe.xmp\0\1\0\0\0" + zlib.compress(_BIG)),
], ids=["icc-profile", "imagemagick-icc-text", "text-after-the-image", "compressed-xmp"])
def test_a_png_whose_metadata_inflates_past_pillows_limit_decodes_as_without_it(imaging, where, kind, body):
    """Pillow refuses the whole image for a metadata chunk over 1 MiB inflated: valid pictures were quarantined as
    corrupt (never read again until they change). The decode uses no such chunk; the orientation still applies."""
    arr = imaging.gradient(40, 56)
    exif = Image.Exif()
    exif[0x0112] = 6
    png = imaging.encode(arr, "PNG")
    plain = png[:33] + _png_chunk(b"eXIf", exif.tobytes()[6:]) + png[33:]  # after IHDR
    extra = _png_chunk(kind, body)
    data = plain[:33] + extra + plain[33:] if where == "before" else plain[:-12] + extra + plain[-12:]
    with pytest.raises(ValueError, match="MAX_TEXT_CHUNK"):  # Pillow's own refusal
        Image.open(io.BytesIO(data)).load()
    np.testing.assert_array_equal(decode_rgb(data, FULL), np.rot90(arr, -1))
    np.testing.assert_array_equal(decode_rgb(data, FULL), decode_rgb(plain, FULL))


def _xmp_orientation(value: int, padding: int = 0) -> bytes:
    return (b'<x:xmpmeta xmlns:x="adobe:ns:meta/"><rdf:RDF xmlns:rdf="http://www.w3.org/1999/02/22-rdf-syntax-ns#">'
            b'<rdf:Description xmlns:tiff="http://ns.adobe.com/tiff/1.0/" tiff:Orientation="%d"/></rdf:RDF>'
            b'</x:xmpmeta>' % value) + b" " * padding


@pytest.mark.parametrize("kind", ["iTXt", "tEXt"])
def test_an_uncompressed_text_over_a_mib_is_kept_with_the_orientation_it_holds(imaging, kind):
    """Pillow limits compressed chunks only: a Photoshop XMP of 1.2 MB, uncompressed, was dropped with its
    orientation (the picture cached unrotated), though Pillow reads and applies it."""
    arr = imaging.gradient(24, 32)
    png = imaging.encode(arr, "PNG")
    if kind == "iTXt":
        body = b"XML:com.adobe.xmp\0\0\0\0\0" + _xmp_orientation(6, 1_200_000)
    else:  # ImageMagick's "Raw profile type exif": the EXIF in hex, after a name line and a length line
        exif = Image.Exif()
        exif[0x0112] = 6
        raw = exif.tobytes()
        body = b"Raw profile type exif\0\nexif\n%8d\n" % len(raw) + raw.hex().encode() + b" " * 1_200_000
    data = png[:33] + _png_chunk(kind.encode(), body) + png[33:]
    with Image.open(io.BytesIO(data)) as img:
        assert ImageOps.exif_transpose(img).size == (24, 32)  # Pillow rotates it
    np.testing.assert_array_equal(decode_rgb(data, FULL), np.rot90(arr, -1))


@pytest.mark.parametrize("flag", [1, 2, 255])
def test_a_compressed_itxt_of_any_flag_past_the_limit_is_left_out(imaging, flag):
    """Pillow inflates an iTXt whose compression flag is anything but 0; only flag 1 was measured."""
    arr = imaging.gradient(24, 32)
    png = imaging.encode(arr, "PNG")
    body = b"Note\0" + bytes([flag, 0]) + b"\0\0" + zlib.compress(_BIG)
    data = png[:33] + _png_chunk(b"iTXt", body) + png[33:]
    np.testing.assert_array_equal(decode_rgb(data, FULL), arr)


def test_png_text_chunks_past_pillows_total_are_left_out_and_the_rest_kept(imaging):
    """70 uncompressed text chunks of 1 MB: past Pillow's 64 MiB of text in all ("Too much memory used in text
    chunks"); the image decodes, and a small chunk holding the orientation (XMP) still counts."""
    arr = imaging.gradient(24, 32)
    png = imaging.encode(arr, "PNG")
    xmp = (b'<x:xmpmeta xmlns:x="adobe:ns:meta/"><rdf:RDF xmlns:rdf="http://www.w3.org/1999/02/22-rdf-syntax-ns#">'
           b'<rdf:Description xmlns:tiff="http://ns.adobe.com/tiff/1.0/" tiff:Orientation="3"/></rdf:RDF></x:xmpmeta>')
    texts = b"".join(_png_chunk(b"tEXt", b"note%d\0" % i + bytes(1_000_000)) for i in range(70))
    data = png[:33] + _png_chunk(b"iTXt", b"XML:com.adobe.xmp\0\0\0\0\0" + xmp) + texts + png[33:]
    with pytest.raises(ValueError, match="Too much memory used in text chunks"):
        Image.open(io.BytesIO(data)).load()
    np.testing.assert_array_equal(decode_rgb(data, FULL), np.rot90(arr, 2))


@pytest.mark.parametrize("compression", ["tiff_adobe_deflate", "tiff_deflate"])
def test_deflate_tiff_whose_data_fails_its_check_is_quarantined(imaging, compression):
    """A damaged byte in a deflate strip: libtiff stops inflating once it has the strip's pixels and says
    nothing, Pillow keeps the file with wrong pixels; the zlib stream's Adler-32 (or its structure)
    tells. Damage that changes no pixel (the unused bits after the final block) may be kept."""
    arr = imaging.gradient(200, 120)  # 72 KB of pixels: two strips
    data = imaging.encode(arr, "TIFF", compression=compression)
    with Image.open(io.BytesIO(data)) as img:
        offsets, counts = img.tag_v2[273], img.tag_v2[279]
    assert len(offsets) >= 2
    np.testing.assert_array_equal(decode_rgb(data, FULL), arr)
    wrong_but_kept_by_pillow = 0
    for strip, (offset, count) in enumerate(zip(offsets, counts, strict=True)):
        for pos in range(offset, offset + count, max(1, count // 250)):
            bad = _flipped(data, pos)
            try:
                np.testing.assert_array_equal(decode_rgb(bad, FULL), arr)
            except DecodeError as exc:
                assert str(exc).startswith(f"corrupt TIFF: the deflate data of strip {strip} is damaged"), exc
                assert exc.kind == "corrupt"
                if _pillow_keeps(bad):
                    wrong_but_kept_by_pillow += mean_abs(pillow_rgb(bad), arr) > 5
    assert wrong_but_kept_by_pillow > 5


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


def _exif(order: bytes, entries: list[tuple[int, int, int, bytes]]) -> bytes:
    """A TIFF header and one IFD of ``entries`` (tag, type, count, value bytes in ``order``); values
    longer than 4 bytes are stored after the IFD."""
    o = "<" if order == b"II" else ">"
    after = 8 + 2 + 12 * len(entries) + 4
    ifd, heap = struct.pack(o + "H", len(entries)), b""
    for tag, typ, count, value in entries:
        if len(value) > 4:
            ifd += struct.pack(o + "HHII", tag, typ, count, after + len(heap))
            heap += value
        else:
            ifd += struct.pack(o + "HHI", tag, typ, count) + value.ljust(4, b"\x00")
    return order + struct.pack(o + "HI", 42, 8) + ifd + struct.pack(o + "I", 0) + heap


# Every field type Pillow reads, as (type, count, value bytes for orientation k): Pillow's
# exif_transpose turns the image for some (a LONG 6, a float 6.0, a rational 12/2, the first of two
# SHORTs) and not for others (BYTE and UNDEFINED come back as bytes, ASCII as text).
STORAGE_FORMS = {
    "SHORT": (3, 1, "H", lambda k: (k,)), "LONG": (4, 1, "I", lambda k: (k,)),
    "SSHORT": (8, 1, "h", lambda k: (k,)), "SLONG": (9, 1, "i", lambda k: (k,)),
    "BYTE": (1, 1, "B", lambda k: (k,)), "SBYTE": (6, 1, "b", lambda k: (k,)),
    "UNDEFINED": (7, 1, "B", lambda k: (k,)), "ASCII": (2, 2, "Bx", lambda k: (48 + k,)),
    "RATIONAL": (5, 1, "II", lambda k: (2 * k, 2)), "SRATIONAL": (10, 1, "ii", lambda k: (k, 1)),
    "FLOAT": (11, 1, "f", lambda k: (k,)), "DOUBLE": (12, 1, "d", lambda k: (k,)),
    "IFD": (13, 1, "I", lambda k: (k,)), "LONG8": (16, 1, "Q", lambda k: (k,)),
    "2 SHORTs": (3, 2, "HH", lambda k: (k, 1)), "2 LONGs": (4, 2, "II", lambda k: (k, 1)),
    "0 SHORTs": (3, 0, "", lambda k: ()),
}


@pytest.mark.filterwarnings("ignore:Metadata Warning:UserWarning")  # Pillow's, about the 2-value forms
@pytest.mark.parametrize("order", [b"II", b"MM"], ids=["little-endian", "big-endian"])
def test_jpeg_orientation_in_every_storage_form_is_what_exif_transpose_applies(imaging, backend, order):
    arr = imaging.gradient(24, 36)
    clean = imaging.jpeg(arr, quality=95)
    plain = decode_rgb(clean, FULL)
    wrong = []
    for name, (typ, count, fmt, values) in STORAGE_FORMS.items():
        for k in range(1, 9):
            value = struct.pack(("<" if order == b"II" else ">") + fmt, *values(k))
            data = imaging.with_app1(clean, b"Exif\x00\x00" + _exif(order, [(0x0112, typ, count, value)]))
            ref = pillow_rgb(data)
            ours = decode_rgb(data, FULL)
            if ours.shape != ref.shape or mean_abs(ours, ref) > 2:
                wrong.append(f"{name} {k}")
            elif name == "LONG":  # the form phone cameras write: turned exactly as a SHORT is
                np.testing.assert_array_equal(ours, apply_orientation(plain, k))
    assert not wrong, f"not as exif_transpose: {wrong}"


XMP_FORMS = {"attribute": 'tiff:Orientation="{k}"', "element": "<tiff:Orientation>{k}</tiff:Orientation>"}


@pytest.mark.parametrize("form", sorted(XMP_FORMS))
def test_jpeg_xmp_orientation_applies_when_exif_has_none(imaging, backend, form):
    """Pillow reads ``tiff:Orientation`` from the (last) XMP packet when the EXIF holds no orientation,
    as datapipe's PNG path does through Pillow: a JPEG follows the same rule."""
    arr = imaging.gradient(24, 36)
    clean = imaging.jpeg(arr, quality=95)
    plain = decode_rgb(clean, FULL)

    def xmp(k: int) -> bytes:
        return (b"http://ns.adobe.com/xap/1.0/\x00<x:xmpmeta xmlns:x=\"adobe:ns:meta/\"><rdf:Description "
                b"xmlns:tiff=\"http://ns.adobe.com/tiff/1.0/\" " + XMP_FORMS[form].format(k=k).encode() + b"/></x:xmpmeta>")

    no_orientation = b"Exif\x00\x00" + _exif(b"II", [(0x0131, 2, 4, b"gimp")])
    with_orientation = b"Exif\x00\x00" + _exif(b"MM", [(0x0112, 3, 1, struct.pack(">H", 3))])
    for k in range(1, 9):
        for data, expected in [
            (imaging.with_app1(clean, xmp(k)), k),  # XMP alone
            (imaging.with_app1(imaging.with_app1(clean, xmp(k)), no_orientation), k),  # EXIF without one
            (imaging.with_app1(imaging.with_app1(clean, xmp(9 - k)), xmp(k)), 9 - k),  # the last packet
            (imaging.with_app1(imaging.with_app1(clean, xmp(k)), with_orientation), 3),  # EXIF first
        ]:
            ours = decode_rgb(data, FULL)
            np.testing.assert_array_equal(ours, apply_orientation(plain, expected))
            assert ours.shape == pillow_rgb(data).shape and mean_abs(ours, pillow_rgb(data)) < 2


def test_orientation_of_other_formats_is_what_exif_transpose_applies(imaging):
    """exif_transpose turns the image for a value equal to 2..8 (6, 6.0, 12/2), not for 6.5 or 13/2."""
    arr = imaging.gradient(24, 36)
    png = imaging.encode(arr, "PNG")
    for typ, fmt, values, expected in [(5, "II", (13, 2), 1), (11, "f", (6.5,), 1), (5, "II", (12, 2), 6),
                                       (11, "f", (6.0,), 6), (4, "I", (6,), 6)]:
        exif = _exif(b"II", [(0x0112, typ, 1, struct.pack("<" + fmt, *values))])
        data = png[:33] + _png_chunk(b"eXIf", exif) + png[33:]  # after IHDR
        ours = decode_rgb(data, FULL)
        np.testing.assert_array_equal(ours, apply_orientation(arr, expected))
        np.testing.assert_array_equal(ours, pillow_rgb(data))


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


def _padded_extent(sample: np.ndarray) -> tuple[int, int]:
    """Rows and columns of a padded sample that are not all background."""
    inside = (sample != codecs.BACKGROUND).any(axis=2)
    return int(inside.any(axis=1).sum()), int(inside.any(axis=0).sum())


@pytest.mark.parametrize("fit", ["short", "pad", "crop", "stretch"])
@pytest.mark.parametrize(("height", "width", "orientation"), [(1003, 600, 1), (600, 1003, 1), (1003, 600, 6),
                                                               (409, 811, 8), (1999, 517, 1)])
@pytest.mark.parametrize("mode", ["RGB", "CMYK"])  # libjpeg-turbo's DCT scaling; Pillow's draft (CMYK)
def test_a_jpeg_downscaled_in_the_dct_gets_the_shape_of_its_full_size(fit, height, width, orientation, mode):
    """The sample's shape (and a padded sample's picture) is worked out from the image's own size, not
    from the DCT-downscaled decode: a JPEG and a PNG of the same picture give the same shape."""
    rng = np.random.default_rng(height + width + orientation)
    pixels = rng.integers(30, 220, (height, width, 3), dtype=np.uint8)
    exif = Image.Exif()
    exif[0x0112] = orientation
    buf = io.BytesIO()
    Image.fromarray(pixels).convert(mode).save(buf, "JPEG", quality=95, exif=exif.tobytes())
    shown = apply_orientation(pixels, orientation)
    png = io.BytesIO()
    Image.fromarray(np.ascontiguousarray(shown)).save(png, "PNG")
    for size in (64, 100):
        spec = DecodeSpec(size=size, fit=fit, max_aspect=4.0)
        from_jpeg, from_png = decode_sample(buf.getvalue(), spec), decode_sample(png.getvalue(), spec)
        assert codecs.dct_factor(*shown.shape[:2], spec) > 1  # the case: a downscaled decode
        expected = codecs.fit_shape(*shown.shape[:2], spec)
        assert from_jpeg.shape == from_png.shape == (expected.height, expected.width, 3)
        if fit == "pad":
            assert _padded_extent(from_jpeg) == _padded_extent(from_png)
