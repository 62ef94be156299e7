"""Rare but valid images: JPEGs of the rarer frame kinds, EXIF thumbnails (JPEGs inside a JPEG's header),
16-bit WhiteIsZero TIFFs.

Lossless JPEGs (SOF3, ITU T.81 annex H: medical images, some camera raws) have no DCT, so libjpeg-turbo
cannot downscale them in the DCT domain: asked to, it decoded the full image into a buffer sized for the
scaled one (heap corruption, a killed build worker, or garbage samples in a build that said "ok").
12- and 16-bit and hierarchical JPEGs are valid files that no decoder here reads: they are quarantined as
``unsupported``, not called damaged. The zero padding some writers leave before the end marker is judged
at the main image's end, never at an EXIF thumbnail's. A 16-bit TIFF whose stored 0 is white is inverted as
Pillow inverts an 8-bit one.

The lossless files are written by :func:`lossless_jpeg`, a small encoder of the standard's annex H.
"""

from __future__ import annotations

import contextlib
import io
import json
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

import datapipe
from datapipe.codecs import DecodeSpec, decode_rgb, decode_sample, fit_image, jpeg_frame
from datapipe.errors import DecodeError

# A Huffman table of the 17 difference categories: 0-6 with 4-bit codes, 7-16 with 5-bit codes (no code is
# all ones). BITS[L-1] counts the codes of length L; the symbols follow in code order.
_BITS = [0, 0, 0, 7, 10] + [0] * 11
_SYMBOLS = list(range(17))


def _codes() -> dict[int, tuple[int, int]]:
    """symbol -> (code, length), the canonical codes of :data:`_BITS` (T.81 annex C)."""
    codes, code, k = {}, 0, 0
    for length, count in enumerate(_BITS, start=1):
        for _ in range(count):
            codes[_SYMBOLS[k]] = (code, length)
            code, k = code + 1, k + 1
        code <<= 1
    return codes


class _Bits:
    def __init__(self) -> None:
        self.out, self.acc, self.n = bytearray(), 0, 0

    def put(self, value: int, length: int) -> None:
        self.acc, self.n = (self.acc << length) | (value & ((1 << length) - 1)), self.n + length
        while self.n >= 8:
            self.n -= 8
            byte = (self.acc >> self.n) & 0xFF
            self.out.append(byte)
            if byte == 0xFF:
                self.out.append(0)  # byte stuffing
        self.acc &= (1 << self.n) - 1

    def flush(self) -> bytes:
        if self.n:
            self.put((1 << (8 - self.n)) - 1, 8 - self.n)  # pad with one bits
        return bytes(self.out)


def _segment(marker: int, payload: bytes) -> bytes:
    return struct.pack(">BBH", 0xFF, marker, len(payload) + 2) + payload


def lossless_jpeg(pixels: np.ndarray, precision: int = 8, ids: bytes = b"\x01\x02\x03\x04", adobe: bool = False) -> bytes:
    """A lossless JPEG (SOF3, predictor 1, point transform 0) of ``pixels``: H×W (gray) or H×W×C."""
    pixels = np.asarray(pixels, np.int64)
    if pixels.ndim == 2:
        pixels = pixels[..., None]
    height, width, comps = pixels.shape
    frame = struct.pack(">BHHB", precision, height, width, comps)
    frame += b"".join(bytes([ids[c], 0x11, 0]) for c in range(comps))
    table = bytes([0x00]) + bytes(_BITS) + bytes(_SYMBOLS)
    scan = bytes([comps]) + b"".join(bytes([ids[c], 0x00]) for c in range(comps)) + bytes([1, 0, 0])
    codes, bits = _codes(), _Bits()
    for y in range(height):
        for x in range(width):
            for c in range(comps):
                if x == 0 and y == 0:
                    predicted = 1 << (precision - 1)
                elif y == 0 or x > 0:
                    predicted = int(pixels[y, x - 1, c]) if x > 0 else int(pixels[y - 1, x, c])
                else:
                    predicted = int(pixels[y - 1, x, c])
                diff = (int(pixels[y, x, c]) - predicted) % 65536
                diff = diff - 65536 if diff > 32768 else diff
                category = 16 if diff == 32768 else abs(diff).bit_length()
                bits.put(*codes[category])
                if 0 < category < 16:
                    bits.put(diff if diff > 0 else diff - 1, category)
    header = b"\xff\xd8"
    if adobe:
        header += _segment(0xEE, b"Adobe" + struct.pack(">HHHB", 100, 0, 0, 0))
    return (header + _segment(0xC3, frame) + _segment(0xC4, table) + _segment(0xDA, scan) + bits.flush()
            + b"\xff\xd9")


def _picture(height: int, width: int, channels: int = 3, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x * 255 // max(1, width - 1), y * 255 // max(1, height - 1), (x * 3 + y * 5) % 256,
                     (x + y) % 256], -1)[..., :channels]
    return np.clip(base + rng.integers(-12, 13, base.shape), 0, 255).astype(np.uint8)


def _pillow(data: bytes) -> np.ndarray:
    with Image.open(io.BytesIO(data)) as img:
        return np.asarray(img.convert("RGB"))


@pytest.mark.parametrize("ids", [b"\x01\x02\x03", b"RGB"], ids=["ycbcr", "rgb"])
@pytest.mark.parametrize(("size", "fit"), [(16, "crop"), (24, "short"), (16, "pad"), (20, "stretch"), (9, "crop")])
def test_a_lossless_jpeg_is_decoded_whole_whatever_the_output_size(ids, size, fit):
    """A lossless frame is never asked for DCT scaling: its sample is the full decode, fitted, exactly as
    for the same file decoded by Pillow (the same libjpeg-turbo, unscaled)."""
    data = lossless_jpeg(_picture(72, 96), ids=ids)
    frame = jpeg_frame(data)
    assert frame is not None and frame.lossless and frame.precision == 8
    reference = _pillow(data)
    spec = DecodeSpec(size=size, fit=fit)
    np.testing.assert_array_equal(decode_rgb(data, DecodeSpec(size=8192)), reference)
    np.testing.assert_array_equal(decode_rgb(data, spec), reference)  # not a scaled decode, not a scaled shape
    np.testing.assert_array_equal(decode_sample(data, spec), fit_image(reference, spec))


@pytest.mark.parametrize("size", [8, 37])
def test_a_lossless_grayscale_jpeg_is_kept_and_expanded(size):
    """libjpeg-turbo turns no lossless gray into RGB ("Unsupported color conversion request", which read as
    damage): the file is decoded as gray and expanded, as Pillow's convert("RGB") expands it."""
    data = lossless_jpeg(_picture(37, 53, channels=1))
    reference = _pillow(data)
    np.testing.assert_array_equal(decode_rgb(data), reference)
    spec = DecodeSpec(size=size, fit="pad")
    np.testing.assert_array_equal(decode_sample(data, spec), fit_image(reference, spec))


@pytest.mark.parametrize("adobe", [False, True])
@pytest.mark.parametrize("size", [12, 64])
def test_a_lossless_cmyk_jpeg_is_kept_at_every_size(adobe, size):
    """A 4-channel lossless JPEG goes to Pillow (CMYK conversion), which must not draft it down either: the
    file was kept at full size and quarantined as "broken data stream" at a smaller --size."""
    data = lossless_jpeg(_picture(64, 80, channels=4), adobe=adobe)
    reference = _pillow(data)
    spec = DecodeSpec(size=size, fit="crop")
    np.testing.assert_array_equal(decode_rgb(data, spec), reference)
    np.testing.assert_array_equal(decode_sample(data, spec), fit_image(reference, spec))


@pytest.mark.parametrize("precision", [12, 16, 2])
def test_a_jpeg_of_other_precision_is_unsupported_not_corrupt(precision):
    data = lossless_jpeg(_picture(20, 24, channels=1).astype(np.int64) % (1 << precision), precision=precision)
    for spec in (DecodeSpec(size=8192), DecodeSpec(size=8)):
        with pytest.raises(DecodeError, match=f"unsupported JPEG: {precision}-bit samples") as info:
            decode_rgb(data, spec)
        assert info.value.kind == "unsupported"
        assert "damaged" not in str(info.value)


@pytest.mark.parametrize("marker", [0xC5, 0xC6, 0xC7, 0xCD, 0xCE, 0xCF])
def test_a_hierarchical_jpeg_is_unsupported_not_corrupt(marker):
    buf = io.BytesIO()
    Image.fromarray(_picture(16, 16)).save(buf, "JPEG", quality=90)
    data = bytearray(buf.getvalue())
    sof = data.find(b"\xff\xc0")
    data[sof + 1] = marker
    with pytest.raises(DecodeError, match="hierarchical") as info:
        decode_rgb(bytes(data))
    assert info.value.kind == "unsupported"


def _with_thumbnail(main: bytes, thumbnail: bytes) -> bytes:
    """``main`` with an APP1 EXIF segment whose IFD1 carries ``thumbnail`` (as cameras write it)."""
    ifd1_at = 8 + 2 + 4
    thumb_at = ifd1_at + 2 + 24 + 4
    ifd1 = (struct.pack("<H", 2) + struct.pack("<HHII", 0x201, 4, 1, thumb_at)
            + struct.pack("<HHII", 0x202, 4, 1, len(thumbnail)) + struct.pack("<I", 0))
    tiff = b"II*\x00" + struct.pack("<I", 8) + struct.pack("<H", 0) + struct.pack("<I", ifd1_at) + ifd1 + thumbnail
    return main[:2] + _segment(0xE1, b"Exif\x00\x00" + tiff) + main[2:]


def _jpeg(pixels: np.ndarray, quality: int = 90) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "JPEG", quality=quality)
    return buf.getvalue()


def _padded(data: bytes, zeros: int) -> bytes:
    return data[:-2] + b"\x00" * zeros + data[-2:]


@pytest.mark.parametrize("thumbnail_padding", [0, 256])
def test_zero_padding_is_judged_at_the_main_images_end_not_the_thumbnails(thumbnail_padding):
    """A camera JPEG (EXIF thumbnail) with zero padding before its end marker is kept, as the same file
    without a thumbnail is; and the main image's damage is quarantined whatever padding the thumbnail has."""
    pixels = _picture(96, 128, seed=5)
    main = _jpeg(pixels)
    thumbnail = _padded(_jpeg(pixels[:8, :8], 50), thumbnail_padding)
    clean = decode_rgb(main)
    padded = _with_thumbnail(_padded(main, 11), thumbnail)
    np.testing.assert_array_equal(decode_rgb(padded), clean)
    # one byte of the main scan changed so that libjpeg-turbo finishes early ("extraneous bytes before 0xd9")
    shift = len(_with_thumbnail(main, thumbnail)) - len(main)
    sos = main.find(b"\xff\xda")
    rng = np.random.default_rng(3)
    for _ in range(5000):
        pos, value = int(rng.integers(sos + 20, len(main) - 2)), int(rng.integers(0, 255))
        damaged = bytearray(main)
        damaged[pos] = value
        try:
            decode_rgb(bytes(damaged))
        except DecodeError as exc:
            if "extraneous bytes before marker 0xd9" in str(exc):
                break
    else:
        pytest.fail("no one-byte change gave the extraneous-bytes message")
    with_thumbnail = bytearray(_with_thumbnail(main, thumbnail))
    with_thumbnail[pos + shift] = value
    with pytest.raises(DecodeError, match="damaged scan data"):
        decode_rgb(bytes(with_thumbnail))


def test_a_build_keeps_lossless_jpegs_and_quarantines_12_bit_ones_as_unsupported(tmp_path: Path):
    src = tmp_path / "src"
    (src / "a").mkdir(parents=True)
    (src / "b").mkdir()
    rgb, gray = lossless_jpeg(_picture(80, 100)), lossless_jpeg(_picture(40, 60, channels=1))
    (src / "a" / "rgb.jpg").write_bytes(rgb)
    (src / "a" / "gray.jpg").write_bytes(gray)
    (src / "b" / "deep.jpg").write_bytes(lossless_jpeg(_picture(10, 10, channels=1), precision=12))
    (src / "b" / "plain.jpg").write_bytes(_jpeg(_picture(50, 50)))
    out = tmp_path / "cache"
    result = datapipe.build(src, out, size=16, cluster=datapipe.Cluster(scheduler="sync"), max_bad_fraction=0.5,
                            progress=False)
    assert result.num_samples == 3
    report = json.loads((out / "report.json").read_text())
    assert [(q["path"], q["error"]) for q in report["quarantined"]] == [("b/deep.jpg", "unsupported")]
    cache = datapipe.open(out)
    spec = DecodeSpec(size=16)
    for i in range(len(cache)):
        if cache.path(i) in ("a/rgb.jpg", "a/gray.jpg"):
            data = rgb if cache.path(i) == "a/rgb.jpg" else gray
            np.testing.assert_array_equal(cache[i][0], fit_image(_pillow(data), spec))


def _tiff(tags: list[tuple[int, int, int | list[int]]], payload: bytes, order: str = "<") -> bytes:
    """A TIFF of one IFD in byte ``order``: ``tags`` (tag, type 3 or 4, value or values), with ``payload`` after it;
    a value of -1 - n stands for the payload's offset plus n."""
    ifd_at = 8
    extra_at = ifd_at + 2 + 12 * len(tags) + 4
    extra, entries = b"", b""
    payload_at = extra_at + sum(4 * len(v) for _, _, v in tags if isinstance(v, list) and len(v) > 1)
    for tag, kind, value in tags:
        values = value if isinstance(value, list) else [value]
        values = [payload_at - 1 - v if v < 0 else v for v in values]
        if len(values) == 1:
            packed = struct.pack(order + "H", values[0]) + b"\x00\x00" if kind == 3 else struct.pack(order + "I", values[0])
        else:
            packed = struct.pack(order + "I", extra_at + len(extra))
            extra += b"".join(struct.pack(order + "I", v) for v in values)
            kind = 4
        entries += struct.pack(order + "HHI", tag, kind, len(values)) + packed
    magic = b"II*\x00" if order == "<" else b"MM\x00*"
    return magic + struct.pack(order + "IH", ifd_at, len(tags)) + entries + struct.pack(order + "I", 0) + extra + payload


@pytest.mark.parametrize("order", ["<"])  # Pillow opens no big-endian 16-bit WhiteIsZero TIFF: quarantined
@pytest.mark.parametrize("deflate", [False, True], ids=["raw", "deflate"])
def test_a_16_bit_white_is_zero_tiff_is_inverted_as_an_8_bit_one_is(order, deflate):
    """PhotometricInterpretation 0 (WhiteIsZero): stored 0 is white, at every bit depth. Pillow inverts the
    8-bit file and reads the 16-bit one as stored; the sample of either is the same picture (and a 16-bit
    BlackIsZero file, big-endian too, is not inverted)."""
    ramp = np.tile(np.arange(0, 256, 4, dtype=np.int64), (8, 1))
    eight = decode_rgb(_wide_tiff(ramp, "u1", photometric=0, order=order, deflate=deflate))
    sixteen = decode_rgb(_wide_tiff(ramp * 257, "u2", photometric=0, order=order, deflate=deflate))
    np.testing.assert_array_equal(eight[..., 0], 255 - ramp)
    np.testing.assert_array_equal(sixteen, eight)
    for endian in "<>":
        black_is_zero = decode_rgb(_wide_tiff(ramp * 257, "u2", photometric=1, order=endian, deflate=deflate))
        np.testing.assert_array_equal(black_is_zero[..., 0], ramp)


@pytest.mark.parametrize("case", ["one stream named 300 times", "a tile of 65536x65536 on a 16x16 image"])
def test_a_tiff_whose_blocks_name_more_data_than_the_image_has_is_refused_before_inflating_it(case):
    """A few hundred bytes of TIFF made the integrity check inflate hundreds of GB (a 212 KB file ended a build after
    its 300 s file timeout): the blocks a header names are checked against the image's own size first."""
    bomb = zlib.compress(b"\x00" * (8 << 20), 9)  # 8 MiB of zeros in about 8 KB
    if case.startswith("one stream"):
        data = _tiff([(256, 3, 16), (257, 3, 16), (258, 3, 8), (259, 3, 8), (262, 3, 1), (273, 4, [-1] * 300),
                      (277, 3, 1), (278, 3, 16), (279, 4, [len(bomb)] * 300)], bomb)
        reason = "corrupt TIFF: 300 strip offsets for an image of 1 strips (16x16)"
    else:
        data = _tiff([(256, 3, 16), (257, 3, 16), (258, 3, 8), (259, 3, 8), (262, 3, 1), (277, 3, 1), (322, 4, 65536),
                      (323, 4, 65536), (324, 4, -1), (325, 4, len(bomb))], bomb)
        reason = "corrupt TIFF: a tile of 65536x65536 pixels, over max_pixels for any image"
    with pytest.raises(DecodeError) as info:
        decode_sample(data, DecodeSpec(size=8))
    assert str(info.value) == reason


def test_the_integrity_check_of_a_tiff_strip_never_holds_more_than_the_strip(monkeypatch):
    """Its cap was checked after each 64 KiB of input, which can inflate to 64 MiB: each call is capped now."""
    import datapipe.codecs as codecs_module

    bomb = zlib.compress(b"\x00" * (64 << 20), 9)
    data = _tiff([(256, 3, 16), (257, 3, 16), (258, 3, 8), (259, 3, 8), (262, 3, 1), (273, 4, -1), (277, 3, 1),
                  (278, 3, 16), (279, 4, len(bomb))], bomb)
    largest = []
    real = zlib.decompressobj

    class Watched:
        def __init__(self):
            self.inner = real()

        def decompress(self, chunk, max_length=0):
            out = self.inner.decompress(chunk, max_length)
            largest.append(len(out))
            return out

        def __getattr__(self, name):
            return getattr(self.inner, name)

    monkeypatch.setattr(codecs_module.zlib, "decompressobj", Watched)
    with contextlib.suppress(DecodeError):  # libtiff's verdict on the rest is not the point here
        decode_rgb(data)
    assert largest and max(largest) <= 2 * 16 * (16 + 1) + (1 << 16) + 1


_OUT_OF_MEMORY = """
import io, resource, sys
import numpy as np
from PIL import Image
from datapipe.codecs import DecodeSpec, decode_sample
from datapipe.errors import DecodeError

buf = io.BytesIO()
Image.fromarray(np.zeros((4000, 4000, 4), np.uint8)).save(buf, "PNG")  # 64 MB of pixels from a small file
data = buf.getvalue()
with open("/proc/self/status") as status:
    size = next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmSize:"))
resource.setrlimit(resource.RLIMIT_AS, (size + (40 << 20), resource.RLIM_INFINITY))
try:
    decode_sample(data, DecodeSpec(size=32))
    print("decoded")
except DecodeError as exc:
    print(exc.kind, exc)
"""


def test_an_image_the_decode_has_no_memory_for_is_read_again_not_called_corrupt():
    """A valid image that met a memory limit was quarantined as corrupt ("MemoryError: Unable to allocate"), a
    verdict that stands until the file changes: the image was lost for good. Memory is the machine's state."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", _OUT_OF_MEMORY], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("decoder-crash out of memory while decoding"), proc.stdout + proc.stderr


@pytest.mark.parametrize(("height", "width", "kind", "words"), [
    (1, 65535, "unsupported", "65535x1 pixels, over the 65,500 a side libjpeg-turbo decodes"),
    (65501, 65501, "too-large", "header says 65501x65501 = 4,290,381,001 pixels"),
    (16, 0, "corrupt", "image header says 0x16 pixels"),
    (0, 16, "unsupported", "its height is given after the first scan (a DNL marker)"),
])
def test_a_jpeg_frame_of_a_size_no_decoder_here_takes_says_why(height, width, kind, words):
    """All four were "corrupt ... Could not determine subsampling level" (libjpeg-turbo's header read fails first),
    the 4.3 G-pixel one too, whatever max_pixels said."""
    data = bytearray(_jpeg(_picture(16, 16)))
    sof = data.find(b"\xff\xc0")
    data[sof + 5 : sof + 9] = struct.pack(">HH", height, width)
    for max_pixels in (1000, 100_000_000):
        with pytest.raises(DecodeError) as info:
            decode_rgb(bytes(data), DecodeSpec(size=8192, max_pixels=max_pixels))
        expected = "too-large" if kind == "too-large" or width * max(height, 1) > max_pixels else kind
        assert info.value.kind == expected, str(info.value)
        if expected == kind:
            assert words in str(info.value)


def test_a_progressive_jpeg_of_more_scans_than_any_encoder_writes_is_refused_before_decoding():
    """Each scan is a pass over the whole image: 883 scans in 350 KB took 32 s at 100 M pixels."""
    buf = io.BytesIO()
    Image.fromarray(_picture(64, 64)).save(buf, "JPEG", quality=90, progressive=True)
    ordinary = buf.getvalue()
    np.testing.assert_array_equal(decode_rgb(ordinary), _pillow(ordinary))  # about 10 scans: decoded
    sos = ordinary.find(b"\xff\xda")
    first_scan = ordinary[sos : ordinary.find(b"\xff\xc4", sos + 2) if b"\xff\xc4" in ordinary[sos + 2:] else -2]
    many = ordinary[:-2] + first_scan * 600 + b"\xff\xd9"
    with pytest.raises(DecodeError, match=r"a progressive JPEG of \d{3,} scans, over 500") as info:
        decode_rgb(many)
    assert info.value.kind == "too-large"


def _exif_segment(tiff_part: bytes) -> bytes:
    return _segment(0xE1, b"Exif\x00\x00" + tiff_part)


def test_many_exif_segments_after_a_whole_first_ifd_are_not_handed_to_pillow(monkeypatch):
    """Pillow joins every EXIF segment in quadratic time (19 s for a thousand): when the first IFD ends in the first
    segment, the later ones cannot give it an orientation, and Pillow is not asked."""
    import datapipe.codecs as codecs_module
    from datapipe.codecs import jpeg_orientation

    main = _jpeg(_picture(16, 24))
    header = b"II*\x00" + struct.pack("<I", 8)
    whole = header + struct.pack("<H", 1) + struct.pack("<HHI4s", 0x010F, 2, 4, b"OOO\x00") + struct.pack("<I", 0)
    data = main[:2] + _exif_segment(whole) + _exif_segment(b"\x00" * 4000) * 200 + main[2:]
    asked = []
    monkeypatch.setattr(codecs_module, "_pillow_jpeg_orientation", lambda d: asked.append(1) or 1)
    assert jpeg_orientation(data) == 1 and asked == []
    with Image.open(io.BytesIO(data)) as img:
        assert img.getexif().get(0x0112) is None  # Pillow's own reading agrees


def test_a_first_ifd_continued_in_the_next_exif_segment_is_read_as_pillow_reads_it():
    """The first segment ends inside the IFD: its second entry, the orientation, is in the next segment, which
    Pillow appends; the fast path must not call it absent."""
    from datapipe.codecs import jpeg_orientation

    main = _jpeg(_picture(16, 24))
    header = b"II*\x00" + struct.pack("<I", 8)
    first = header + struct.pack("<H", 2) + struct.pack("<HHI4s", 0x010F, 2, 4, b"OOO\x00")
    rest = struct.pack("<HHIHH", 0x0112, 3, 1, 6, 0) + struct.pack("<I", 0)
    data = main[:2] + _exif_segment(first) + _exif_segment(rest) + main[2:]
    with Image.open(io.BytesIO(data)) as img:
        pillows = img.getexif().get(0x0112)
    assert pillows == 6 and jpeg_orientation(data) == 6
    np.testing.assert_array_equal(decode_rgb(data), np.rot90(decode_rgb(main), -1))


@pytest.mark.parametrize(("rest", "xmp", "expected"), [
    (struct.pack("<HHIHH", 0x0112, 3, 1, 6, 0) + struct.pack("<I", 0), None, 6),  # the orientation in the second
    (struct.pack("<HHII", 0x0112, 4, 1, 8) + struct.pack("<I", 0), None, 8),  # as a LONG
    (struct.pack("<HHI4s", 0x0131, 2, 2, b"A\x00\x00\x00") + struct.pack("<I", 0), b'tiff:Orientation="3"', 3),  # XMP's
    (b"\xff" * 7, None, 1),  # the IFD broken: none
], ids=["short", "long", "xmp", "broken"])
def test_a_first_ifd_cut_short_among_many_exif_segments_is_read_as_pillow_reads_it_without_pillows_join(monkeypatch,
                                                                                                      rest, xmp,
                                                                                                      expected):
    """Pillow joins every EXIF segment in quadratic time (60,000 small ones: 20 s a file) and was asked whenever the
    first IFD did not end in the first segment; the segments are joined here as Pillow joins them, in linear time."""
    import datapipe.codecs as codecs_module
    from datapipe.codecs import jpeg_orientation

    main = _jpeg(_picture(16, 24))
    header = b"II*\x00" + struct.pack("<I", 8)
    first = header + struct.pack("<H", 2) + struct.pack("<HHI4s", 0x010F, 2, 4, b"OOO\x00")
    extra = _segment(0xE1, b"http://ns.adobe.com/xap/1.0/\x00<x " + xmp + b"/>") if xmp else b""
    data = main[:2] + _exif_segment(first) + _exif_segment(rest) + _exif_segment(b"\x00" * 64) * 300 + extra + main[2:]
    with Image.open(io.BytesIO(data)) as img:
        assert img.getexif().get(0x0112, 1) == expected  # Pillow's own reading
    monkeypatch.setattr(codecs_module, "_pillow_jpeg_orientation", lambda d: pytest.fail("Pillow asked"))
    assert jpeg_orientation(data) == expected


def test_an_empty_first_exif_segment_leaves_the_next_ones_orientation_to_apply():
    """A first APP1 holding only its 'Exif' header: Pillow joins the next segment's data to it and reads its
    orientation; it was taken for no EXIF at all."""
    from datapipe.codecs import jpeg_orientation

    main = _jpeg(_picture(16, 24))
    whole = b"II*\x00" + struct.pack("<I", 8) + struct.pack("<H", 1) + struct.pack("<HHIHH", 0x0112, 3, 1, 6, 0) \
        + struct.pack("<I", 0)
    data = main[:2] + _exif_segment(b"") + _exif_segment(whole) + main[2:]
    with Image.open(io.BytesIO(data)) as img:
        assert img.getexif().get(0x0112) == 6
    assert jpeg_orientation(data) == 6
    np.testing.assert_array_equal(decode_rgb(data), np.rot90(decode_rgb(main), -1))
    alone = main[:2] + _exif_segment(b"") + main[2:]
    assert jpeg_orientation(alone) == 1


def _wide_tiff(values: np.ndarray, dtype: str, *, order: str = "<", deflate: bool = False, planar: bool = False,
               photometric: int | None = None, extra: int | None = None) -> bytes:
    """A one-strip (one per plane with ``planar``) TIFF of ``values`` (H×W or H×W×C) as ``dtype`` samples ('u2', 'i2',
    'i4', 'f4', 'f8'), written field by field: the layouts Pillow writes none of."""
    values = values if values.ndim == 3 else values[..., None]
    height, width, channels = values.shape
    typed = values.astype(np.dtype(order + dtype))
    planes = [typed[..., c].tobytes() for c in range(channels)] if planar else [typed.tobytes()]
    planes = [zlib.compress(p) if deflate else p for p in planes]
    offsets = [-1 - sum(len(p) for p in planes[:k]) for k in range(len(planes))]
    size = typed.dtype.itemsize * 8
    sample_format = {"u": 1, "i": 2, "f": 3}[dtype[0]]
    tags = [(256, 3, width), (257, 3, height), (258, 3, [size] * channels if channels > 1 else size),
            (259, 3, 8 if deflate else 1), (262, 3, photometric if photometric is not None else (2 if channels >= 3 else 1)),
            (273, 4, offsets if planar else offsets[0]), (277, 3, channels), (278, 3, height),
            (279, 4, [len(p) for p in planes] if planar else len(planes[0])), (284, 3, 2 if planar else 1),
            (339, 3, [sample_format] * channels if channels > 1 else sample_format)]
    if extra is not None:
        tags.append((338, 3, extra))
    return _tiff(sorted(tags), b"".join(planes), order)


@pytest.mark.parametrize("order", ["<", ">"])
@pytest.mark.parametrize("channels", [3, 4], ids=["RGB", "RGBA"])
def test_a_tiff_of_16_bit_samples_in_separate_planes_reads_as_its_contiguous_twin(order, channels):
    """Pillow read each uncompressed 16-bit plane with an 8-bit raw mode: every sample became two pixels."""
    rng = np.random.default_rng(channels)
    values = rng.integers(0, 65536, (6, 9, channels))
    extra = 2 if channels == 4 else None  # unassociated alpha
    contiguous = decode_rgb(_wide_tiff(values, "u2", order=order, extra=extra))
    planar = decode_rgb(_wide_tiff(values, "u2", order=order, planar=True, extra=extra))
    np.testing.assert_array_equal(planar, contiguous)
    if channels == 3:  # 16-bit colour comes out as its high bytes
        np.testing.assert_array_equal(contiguous, values >> 8)


@pytest.mark.parametrize("dtype", ["f4", "i4", "i2"])
def test_a_big_endian_compressed_tiff_of_wide_samples_reads_as_its_little_endian_twin(dtype):
    """Pillow's libtiff path gets these samples in the machine's byte order and swapped them once more (noise)."""
    ramp = np.tile(np.linspace(0, 1, 32), (4, 1))
    values = ramp if dtype == "f4" else np.round(ramp * (32767 if dtype == "i2" else 65535))
    expected = np.round(ramp * 255) if dtype == "f4" else (values.astype(np.int64) * 255 + 32767) // 65535
    for order in "<>":
        for deflate in (False, True):
            decoded = decode_rgb(_wide_tiff(values, dtype, order=order, deflate=deflate))
            np.testing.assert_array_equal(decoded[..., 0], expected, err_msg=f"{order} deflate={deflate}")


def test_a_float_white_is_zero_tiff_is_inverted_as_its_16_bit_twin_is():
    ramp = np.tile(np.linspace(0, 1, 16), (3, 1))
    floats = decode_rgb(_wide_tiff(ramp, "f4", photometric=0))
    sixteen = decode_rgb(_wide_tiff(np.round(ramp * 65535), "u2", photometric=0))
    np.testing.assert_array_equal(floats[..., 0], 255 - np.round(ramp * 255))
    np.testing.assert_array_equal(floats, sixteen)


@pytest.mark.parametrize("case", ["float64 gray", "16-bit gray with alpha", "float32 RGB"])
def test_a_valid_tiff_of_a_layout_pillow_has_no_mode_for_is_unsupported_not_corrupt(case):
    """Pillow refuses these for their pixel layout ("unknown pixel mode"): valid files, which a conversion saves,
    not damaged ones (a corrupt file is never read again until it changes)."""
    rng = np.random.default_rng(1)
    data = {"float64 gray": lambda: _wide_tiff(rng.random((4, 5)), "f8"),
            "16-bit gray with alpha": lambda: _wide_tiff(rng.integers(0, 65536, (4, 5, 2)), "u2", photometric=1, extra=2),
            "float32 RGB": lambda: _wide_tiff(rng.random((4, 5, 3)), "f4")}[case]()
    with pytest.raises(DecodeError) as info:
        decode_rgb(data)
    assert info.value.kind == "unsupported" and str(info.value).startswith("unsupported TIFF: a valid header")
    with pytest.raises(DecodeError) as damaged:  # the same file with its header cut short is damaged
        decode_rgb(data[:20])
    assert damaged.value.kind == "corrupt"


def test_separate_planes_of_wide_samples_with_no_raw_mode_here_are_unsupported():
    values = np.random.default_rng(2).integers(0, 65536, (4, 5, 4))
    with pytest.raises(DecodeError) as info:
        decode_rgb(_wide_tiff(values, "u2", planar=True, photometric=5))  # CMYK
    assert info.value.kind == "unsupported" and "separate planes" in str(info.value)


@pytest.mark.parametrize(("dtype", "order", "photometric"), [
    ("u2", "<", 1), ("u2", ">", 1), ("f4", "<", 1), ("u1", "<", 0), ("u2", "<", 0)],
    ids=["16-bit", "16-bit-big-endian", "float32", "8-bit-white-is-zero", "16-bit-white-is-zero"])
def test_one_sample_per_pixel_in_separate_planes_reads_as_its_contiguous_twin(dtype, order, photometric):
    """PlanarConfiguration 2 of one sample is the contiguous layout; Pillow gave its tile the first letter of the raw
    mode (`I` for `I;16`, `L` for `L;I`): 16-bit samples were refused, 8-bit WhiteIsZero left uninverted."""
    ramp = np.tile(np.linspace(0, 1, 24), (5, 1))
    values = ramp if dtype == "f4" else np.round(ramp * (255 if dtype == "u1" else 65535))
    contiguous = decode_rgb(_wide_tiff(values, dtype, order=order, photometric=photometric))
    planar = decode_rgb(_wide_tiff(values, dtype, order=order, photometric=photometric, planar=True))
    np.testing.assert_array_equal(planar, contiguous)
    expected = np.round(ramp * 255)
    np.testing.assert_array_equal(contiguous[..., 0], 255 - expected if photometric == 0 else expected)


@pytest.mark.parametrize(("channels", "extra", "deflate"), [(4, 1, False), (4, 0, False), (2, 2, False), (2, 2, True)],
                         ids=["associated-alpha", "unspecified-extra", "gray-alpha", "gray-alpha-deflate"])
def test_separate_planes_with_an_extra_sample_pillow_misreads_are_unsupported(channels, extra, deflate):
    """Valid files: uncompressed ones were called corrupt (Pillow has no raw mode for their planes), and a compressed
    gray+alpha one came out white (Pillow's libtiff path reads its alpha as 0). Their contiguous twins decode."""
    values = np.random.default_rng(channels + extra).integers(0, 256, (4, 5, channels))
    photometric = 2 if channels == 4 else 1
    decode_rgb(_wide_tiff(values, "u1", extra=extra, deflate=deflate, photometric=photometric))
    with pytest.raises(DecodeError) as info:
        decode_rgb(_wide_tiff(values, "u1", extra=extra, deflate=deflate, photometric=photometric, planar=True))
    assert info.value.kind == "unsupported", str(info.value)


def test_unsigned_32_bit_gray_is_scaled_from_its_whole_range():
    """Pillow reads unsigned 32-bit samples as signed: above 65,535 all white, from 2**31 black."""
    ramp = np.linspace(0, 1, 9)[None, :]
    decoded = decode_rgb(_wide_tiff(np.round(ramp * (2**32 - 1)), "u4"))
    np.testing.assert_array_equal(decoded[0, :, 0], np.round(ramp[0] * 255))


def _packed_gray_tiff(values: np.ndarray, bits: int) -> bytes:
    """A one-strip gray TIFF of ``bits``-bit samples (not a whole byte), packed most significant bit first,
    each row padded to a byte, as TIFF stores them."""
    height, width = values.shape
    rows = b""
    for row in values:
        text = "".join(format(int(v), f"0{bits}b") for v in row)
        text += "0" * (-len(text) % 8)
        rows += int(text, 2).to_bytes(len(text) // 8, "big")
    tags = [(256, 3, width), (257, 3, height), (258, 3, bits), (259, 3, 1), (262, 3, 1), (273, 4, -1),
            (277, 3, 1), (278, 3, height), (279, 4, len(rows))]
    return _tiff(tags, rows)


def test_12_bit_gray_is_scaled_from_its_own_range():
    """Pillow reads 12-bit samples (0..4095) into its 16-bit mode: scaled from 0..65535 they came out 16 times
    too dark (white as 16)."""
    ramp = np.tile(np.linspace(0, 1, 16), (3, 1))
    decoded = decode_rgb(_packed_gray_tiff(np.round(ramp * 4095), 12))
    np.testing.assert_array_equal(decoded[..., 0], np.round(ramp * 255))
    np.testing.assert_array_equal(decoded, decode_rgb(_wide_tiff(np.round(ramp * 65535), "u2")))


def _big_endian_bigtiff(values: np.ndarray) -> bytes:
    """An uncompressed 8-bit gray BigTIFF (version 43: 8-byte offsets, 20-byte entries) in big-endian order."""
    height, width = values.shape
    tags = [(256, width), (257, height), (258, 8), (259, 1), (262, 1), (273, None), (277, 1), (278, height),
            (279, values.size)]
    ifd_at = 16
    pixels_at = ifd_at + 8 + 20 * len(tags) + 8
    entries = b"".join(struct.pack(">HHQQ", tag, 16, 1, pixels_at if value is None else value) for tag, value in tags)
    header = b"MM\x00\x2b" + struct.pack(">HHQ", 8, 0, ifd_at)
    return header + struct.pack(">Q", len(tags)) + entries + struct.pack(">Q", 0) + values.astype(np.uint8).tobytes()


def test_a_big_endian_bigtiff_is_unsupported_not_corrupt():
    """Pillow reads no big-endian BigTIFF (its little-endian twin decodes): a valid file, called damaged before."""
    with pytest.raises(DecodeError) as info:
        decode_rgb(_big_endian_bigtiff(np.arange(48).reshape(6, 8)))
    assert info.value.kind == "unsupported" and "big-endian BigTIFF" in str(info.value)
