"""Decoding fidelity on real-world odd files, with Pillow as the oracle.

``tests/corpus/`` holds ~220 odd files from Pillow's own test suite (provenance and licence in its
README.md): every EXIF orientation, CMYK, 1-bit, palette and tRNS variants, 12/16/32-bit and float
TIFFs, gray+alpha, GIF transparency and disposal, BigTIFF, TIFF compressions, JPEGs that
libjpeg-turbo warns about, broken EXIF, WebP, the BMP suite (good, questionable and bad), truncated
and corrupt files. Generated variants cover what the corpus lacks (every Pillow mode, every
transparency form, sniffer variants, JPEG warnings one at a time, orientation × fit × kernel).

The oracle (:func:`pillow_canonical`) is ``Image.open`` → ``ImageOps.exif_transpose`` → alpha over
white → RGB, with one deliberate difference that datapipe documents: integer samples wider than 8
bits are scaled from 0..65535 (Pillow's ``convert`` would clip them at 255), and float samples
follow datapipe's rule (0..1 scaled, else clipped to 0..255).

Tolerance: a kept file must match the oracle with PSNR ≥ 40 dB or a mean absolute difference ≤ 1
level. Lossless formats match exactly (same bytes from the same Pillow); JPEGs are decoded by
simplejpeg's libjpeg-turbo and by Pillow's libjpeg, whose IDCT and chroma upsampling can differ by a
level or two on some pixels (measured: 0 to 0.2 mean here), far inside either bound.
"""

from __future__ import annotations

import io
import json
import os
import signal
import struct
import subprocess
import sys
import tarfile
import time
import zlib
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
from PIL import Image, ImageOps

from datapipe import codecs, native
from datapipe.codecs import DecodeSpec, decode_rgb, decode_sample, fit_image, sniff
from datapipe.errors import QUARANTINE_KINDS, DecodeError

CORPUS = Path(__file__).parent / "corpus"
EXTENSIONS = {".jpg", ".jpeg", ".jpe", ".jfif", ".png", ".gif", ".bmp", ".dib", ".tif", ".tiff", ".webp"}
FILES = sorted(p for p in CORPUS.rglob("*") if p.suffix.lower() in EXTENSIONS)
IDS = [str(p.relative_to(CORPUS)) for p in FILES]
FULL = DecodeSpec(size=8192)  # no DCT downscaling: datapipe's full-size decode
WIDE = ("I;16", "I;16L", "I;16B", "I;16N", "I")
FITS = ("crop", "pad", "stretch")
DECODE_SECONDS = 60  # a decode running this long is a hang (each takes milliseconds here)


# ----------------------------------------------------------------------------- the oracle


def pillow_canonical(data: bytes, factor: int = 1) -> np.ndarray:
    """Pillow's reading of a file as datapipe defines the canonical sample (see the module docstring);
    a JPEG decoded at 1/``factor`` scale by libjpeg's DCT scaling (Pillow's ``draft``) when asked. Pillow's limits
    on PNG metadata, which refuse the whole picture for an ICC profile or a text over 1 MiB, are lifted: datapipe
    decodes such a picture without that metadata (docs/build.md)."""
    from PIL import PngImagePlugin

    limits = PngImagePlugin.MAX_TEXT_CHUNK, PngImagePlugin.MAX_TEXT_MEMORY
    PngImagePlugin.MAX_TEXT_CHUNK, PngImagePlugin.MAX_TEXT_MEMORY = 1 << 26, 1 << 30
    try:
        return _pillow_canonical(data, factor)
    finally:
        PngImagePlugin.MAX_TEXT_CHUNK, PngImagePlugin.MAX_TEXT_MEMORY = limits


def _pillow_canonical(data: bytes, factor: int) -> np.ndarray:
    with Image.open(io.BytesIO(data)) as opened:
        if factor > 1:
            opened.draft(opened.mode, (max(1, opened.width // factor), max(1, opened.height // factor)))
        im = ImageOps.exif_transpose(opened)  # loads the first frame, fully (truncated data raises)
    return canonical_of(im)


def canonical_of(im: Image.Image) -> np.ndarray:
    """uint8 RGB of a loaded Pillow image: alpha (and tRNS) over white, wide integers scaled."""
    mode, trns = im.mode, im.info.get("transparency")
    if mode in WIDE:
        arr = np.asarray(im).astype(np.int64)
        gray = np.repeat(((np.clip(arr, 0, 65535) * 255 + 32767) // 65535).astype(np.uint8)[..., None], 3, 2)
        if isinstance(trns, int):
            alpha = np.where(arr == trns, 0, 255).astype(np.uint8)
            return over_white(np.dstack([gray, alpha]))
        return gray
    if mode == "F":
        arr = np.asarray(im, dtype=np.float64)
        if arr.min() >= 0 and arr.max() <= 1:
            arr = arr * 255
        return np.repeat(np.clip(arr, 0, 255).round().astype(np.uint8)[..., None], 3, 2)
    if mode == "La":  # Pillow has no La -> RGBA conversion
        arr = np.asarray(im).astype(np.float64)
        a = arr[..., 1:2]
        gray = np.where(a > 0, arr[..., :1] * 255 / np.maximum(a, 1), 0)
        return over_white(np.dstack([np.repeat(gray, 3, 2), a]).round().clip(0, 255).astype(np.uint8))
    if mode in ("RGBA", "LA", "PA", "RGBa") or trns is not None:
        return over_white(np.asarray(im.convert("RGBA")))
    return np.asarray(im.convert("RGB"))


def over_white(rgba: np.ndarray) -> np.ndarray:
    white = Image.new("RGBA", (rgba.shape[1], rgba.shape[0]), (255, 255, 255, 255))
    return np.asarray(Image.alpha_composite(white, Image.fromarray(rgba, "RGBA")).convert("RGB"))


def agreement(ours: np.ndarray, ref: np.ndarray) -> tuple[float, float]:
    """(PSNR in dB, mean absolute difference in levels)."""
    assert ours.shape == ref.shape, f"shape {ours.shape} != Pillow's {ref.shape}"
    diff = ours.astype(np.float64) - ref.astype(np.float64)
    mse = float((diff**2).mean())
    return (99.0 if mse == 0 else 10 * np.log10(255**2 / mse)), float(np.abs(diff).mean())


def assert_matches(ours: np.ndarray, ref: np.ndarray, what: str = "") -> None:
    assert ours.dtype == np.uint8 and ours.ndim == 3 and ours.shape[2] == 3, (ours.dtype, ours.shape)
    psnr, mad = agreement(ours, ref)
    assert psnr >= 40 or mad <= 1, f"{what}: PSNR {psnr:.1f} dB, mean abs diff {mad:.2f} against Pillow"


@contextmanager
def bounded(seconds: int = DECODE_SECONDS):
    """Fail instead of hanging: a decode that does not return in ``seconds`` raises TimeoutError."""
    def alarm(*_):
        raise TimeoutError(f"decode did not finish in {seconds} s")

    previous = signal.signal(signal.SIGALRM, alarm)
    started = time.monotonic()
    outer, _ = signal.setitimer(signal.ITIMER_REAL, seconds)  # pytest-timeout's own alarm, if it set one
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if outer:  # put the test's time limit back, less the time spent here
            signal.setitimer(signal.ITIMER_REAL, max(outer - (time.monotonic() - started), 0.001))


def ours_or_reason(data: bytes, spec: DecodeSpec = FULL) -> tuple[np.ndarray | None, DecodeError | None]:
    """datapipe's decode, or the DecodeError that quarantines the file. Any other exception fails."""
    try:
        with bounded():
            return np.ascontiguousarray(decode_rgb(data, spec)), None
    except DecodeError as exc:
        return None, exc


def oracle_or_reason(data: bytes) -> tuple[np.ndarray | None, str | None]:
    try:
        with bounded():
            return pillow_canonical(data), None
    except Exception as exc:  # noqa: BLE001 - Pillow's refusal, whatever its type, is the oracle saying no
        return None, f"{type(exc).__name__}: {exc}"


# ----------------------------------------------------------------------------- the corpus


def test_the_corpus_is_there_and_covers_every_kind():
    folders = {p.parent.name for p in FILES}
    assert {"orientation", "cmyk", "bilevel", "transparency", "deep", "grayalpha", "gif", "tiff", "jpegwarn",
            "brokenexif", "webp", "bmp", "png", "truncated", "notimage"} <= folders
    assert len(FILES) >= 200
    modes, formats, orientations = set(), set(), set()
    for path in FILES:
        data = path.read_bytes()
        formats.add(sniff(data[:16]))
        try:
            with Image.open(io.BytesIO(data)) as im:
                modes.add(im.mode)
                orientations.add(im.getexif().get(0x0112, 1))
        except Exception:  # noqa: BLE001 - the corpus holds files Pillow cannot open, on purpose
            pass
    assert {"1", "L", "LA", "P", "PA", "RGB", "RGBA", "CMYK", "LAB", "I", "I;16", "I;16B", "F"} <= modes
    assert {"jpeg", "png", "gif", "bmp", "dib", "tiff", "webp", None} <= formats
    assert set(range(1, 9)) <= orientations
    assert any(path.read_bytes()[:4] == b"II+\x00" for path in FILES)  # BigTIFF


# Files whose scan data is damaged, which Pillow keeps (it ignores libjpeg's warnings) with garbage
# pixels: hopper_bad_exif.jpg's first restart interval holds 1214 bytes more than its blocks need,
# and its picture is stripes of noise (libjpeg-turbo: "1214 extraneous bytes before marker 0xd0").
DAMAGED_BUT_PILLOW_KEEPS = {"jpegwarn/hopper_bad_exif.jpg"}


@pytest.mark.parametrize("path", FILES, ids=IDS)
def test_corpus_file_matches_pillow(path):
    """A file datapipe keeps decodes to Pillow's pixels; a file it quarantines, Pillow cannot decode
    fully either (but for the damaged files Pillow keeps, named above); nothing raises anything but a
    DecodeError, nothing hangs."""
    data = path.read_bytes()
    ours, reason = ours_or_reason(data)
    ref, refusal = oracle_or_reason(data)
    if str(path.relative_to(CORPUS)) in DAMAGED_BUT_PILLOW_KEEPS:
        assert ours is None and reason.kind == "corrupt" and "damaged scan data" in str(reason), reason
        return
    if ours is None:
        assert reason.kind in QUARANTINE_KINDS and str(reason)
        assert ref is None, f"quarantined ({reason.kind}: {reason}) but Pillow decodes it"
        return
    assert ref is not None, f"kept, but Pillow refuses it: {refusal}"
    assert_matches(ours, ref, str(path.relative_to(CORPUS)))


@pytest.mark.parametrize("fit", FITS)
@pytest.mark.parametrize("path", FILES, ids=IDS)
def test_corpus_sample_matches_pillow_after_the_same_fit(path, fit):
    """The canonical sample (what the build stores) against Pillow's pixels put through the same fit
    (a JPEG at least twice the target decoded at the same DCT scale, as the build does)."""
    data = path.read_bytes()
    spec = DecodeSpec(size=40, fit=fit)
    try:
        with bounded():
            sample = decode_sample(data, spec)
    except DecodeError:
        return  # quarantined: covered by test_corpus_file_matches_pillow
    assert sample.shape == (40, 40, 3) and sample.dtype == np.uint8
    factor = 1
    if sniff(data[:16]) == "jpeg":
        with Image.open(io.BytesIO(data)) as im:
            factor = codecs.dct_factor(im.height, im.width, spec)
    assert_matches(sample, fit_image(pillow_canonical(data, factor), spec), f"{path.name} {fit}")


def test_a_build_of_the_corpus_accounts_for_every_file(tmp_path):
    """Each corpus folder is a class: every image file becomes a sample or is quarantined with a class
    and a reason, and the report's counts add up (README.md is the one file ignored)."""
    import datapipe

    report = datapipe.build(CORPUS, tmp_path / "cache", size=32, cluster=datapipe.Cluster(scheduler="sync"),
                            max_bad_fraction=1.0, progress=False)
    assert report.scanned == len(FILES)
    assert report.num_samples + len(report.quarantined) == len(FILES)
    assert report.ignored == 1
    assert sum(report.quarantine_counts().values()) == len(report.quarantined)
    expected_bad = set()
    for path in FILES:
        if ours_or_reason(path.read_bytes(), DecodeSpec(size=32))[0] is None:
            expected_bad.add(str(path.relative_to(CORPUS)))
    assert {q["path"] for q in report.quarantined} == expected_bad
    for q in report.quarantined:
        assert q["error"] in QUARANTINE_KINDS and q["reason"], q
    on_disk = json.loads((tmp_path / "cache" / "report.json").read_text())
    assert len(on_disk["quarantined"]) == len(report.quarantined)
    cache = datapipe.open(tmp_path / "cache")
    assert len(cache) == report.num_samples
    assert all(cache.path(i) not in expected_bad for i in range(len(cache)))


# ----------------------------------------------------------------------------- orientation × fit × kernel


def exif_bytes(orientation: int) -> bytes:
    exif = Image.Exif()
    exif[0x0112] = orientation
    return exif.tobytes()


def oriented_file(arr: np.ndarray, fmt: str, orientation: int) -> bytes:
    buf = io.BytesIO()
    kwargs = {"JPEG": {"quality": 95}, "WEBP": {"lossless": True}, "PNG": {}, "TIFF": {}}[fmt]
    if fmt == "TIFF":
        Image.fromarray(arr).save(buf, "TIFF", tiffinfo={0x0112: orientation})
    else:
        Image.fromarray(arr).save(buf, fmt, exif=exif_bytes(orientation), **kwargs)
    return buf.getvalue()


@pytest.fixture(params=["native", "torch"])
def kernel(request, monkeypatch) -> str:
    """The compiled resize kernel, and torch's (what DATAPIPE_NATIVE=0 or a build without a compiler use)."""
    if request.param == "torch":
        monkeypatch.setattr(native, "resizer", lambda: None)
    elif not native.available():
        pytest.skip(f"native kernel: {native.describe()}")
    return request.param


@pytest.mark.parametrize("orientation", range(1, 9))
@pytest.mark.parametrize("fit", FITS)
@pytest.mark.parametrize("fmt,backend", [("JPEG", "simplejpeg"), ("JPEG", "pillow"), ("PNG", "pillow"),
                                         ("WEBP", "pillow"), ("TIFF", "pillow")])
def test_every_orientation_every_fit_both_kernels(imaging, monkeypatch, kernel, fmt, backend, orientation, fit):
    """The sample of an EXIF-rotated file is the sample of its upright pixels, with either kernel and
    either JPEG backend (transposed and mirrored views reach the resize)."""
    if backend == "pillow":
        monkeypatch.setattr(codecs, "_simplejpeg", lambda: None)
    arr = imaging.gradient(60, 84, seed=orientation)
    data = oriented_file(arr, fmt, orientation)
    for size in (24, 50, 200):  # downscale (DCT-scaled for JPEG at 24), slight downscale, upscale
        spec = DecodeSpec(size=size, fit=fit)
        sample = decode_sample(data, spec)
        upright = np.ascontiguousarray(decode_rgb(data, spec))  # the same decoder and DCT scale
        assert upright.shape[:2] == ((60, 84) if orientation <= 4 else (84, 60)) or size == 24
        np.testing.assert_array_equal(sample, fit_image(upright, spec))
    assert_matches(decode_rgb(data, FULL), pillow_canonical(data), f"{fmt} orientation {orientation}")


@pytest.mark.parametrize("shape", [(1, 1), (1, 2), (2, 1), (1, 9), (3, 1)])
@pytest.mark.parametrize("fit", FITS)
def test_tiny_images_in_every_orientation(kernel, shape, fit):
    """One-pixel-wide crops of mirrored or transposed views, whose strides numpy calls contiguous."""
    arr = np.random.default_rng(1).integers(0, 256, (*shape, 3)).astype(np.uint8)
    for orientation in range(1, 9):
        view = codecs.apply_orientation(arr, orientation)
        for size in (8, 16):
            spec = DecodeSpec(size=size, fit=fit)
            np.testing.assert_array_equal(fit_image(view, spec), fit_image(view.copy(), spec))


@pytest.mark.parametrize("fit", FITS)
def test_both_kernels_give_the_same_bytes_for_oriented_views(imaging, monkeypatch, fit):
    data = oriented_file(imaging.gradient(70, 50, seed=2), "JPEG", 6)
    spec = DecodeSpec(size=32, fit=fit)
    first = decode_sample(data, spec)
    monkeypatch.setattr(native, "resizer", lambda: None)
    np.testing.assert_array_equal(decode_sample(data, spec), first)


def random_metadata_jpeg(rng: np.random.Generator, clean: bytes) -> bytes:
    """``clean`` with random EXIF and XMP segments: an orientation of any field type and count (some
    stored after the IFD, some pointing past the data), duplicate entries, entries before it whose data
    lies elsewhere or nowhere, IFDs cut short, damaged TIFF headers, two EXIF segments, XMP packets
    with or without an orientation."""
    order = (b"II", b"MM")[rng.integers(2)]
    o = "<" if order == b"II" else ">"
    formats = {1: "B", 2: "B", 3: "H", 4: "I", 5: "II", 6: "b", 7: "B", 8: "h", 9: "i", 10: "ii", 11: "f", 12: "d",
               13: "I", 16: "Q", 14: "I", 0: "I"}  # 14 and 0 are no field type Pillow reads
    entries: list[tuple[int, int, int, bytes, bool]] = []  # tag, type, count, value, stored past the data
    if rng.random() < 0.5:
        entries.append((0x010F, 2, 6, b"Apple\x00", rng.random() < 0.2))
    if rng.random() < 0.3:
        entries.append((0x0112, int(rng.choice([2, 3, 7, 14])), int(rng.integers(2)), b"\x06\x00", False))
    if rng.random() < 0.9:
        typ, count, k = int(rng.choice(list(formats))), int(rng.choice([1, 1, 1, 2, 0, 3])), int(rng.integers(10))
        fmt = formats[typ]
        numbers = [k, *rng.integers(0, 10, 2)][:count]
        if fmt in "fd":
            value = b"".join(struct.pack(o + fmt, v + float(rng.choice([0, 0, 0.5]))) for v in numbers)
        elif len(fmt) == 2:
            value = b"".join(struct.pack(o + fmt, v * 2, int(rng.choice([2, 1, 0]))) for v in numbers)
        else:
            value = b"".join(struct.pack(o + fmt, v) for v in numbers)
        entries.append((0x0112, typ, count, value, rng.random() < 0.1))
    if rng.random() < 0.3:
        entries.append((0x0112, 3, 1, struct.pack(o + "H", int(rng.integers(1, 9))), False))
    heap_at = 8 + 2 + 12 * len(entries) + 4
    ifd, heap = struct.pack(o + "H", len(entries)), b""
    for tag, typ, count, value, past in entries:
        if len(value) > 4:
            ifd += struct.pack(o + "HHII", tag, typ, count, heap_at + len(heap) + (10_000 if past else 0))
            heap += value
        else:
            ifd += struct.pack(o + "HHI", tag, typ, count) + value.ljust(4, b"\x00")
    tiff = order + struct.pack(o + "HI", 42, 8) + ifd + struct.pack(o + "I", 0) + heap
    if rng.random() < 0.1:
        tiff = tiff[: rng.integers(len(tiff) + 1)]
    if rng.random() < 0.05:
        tiff = b"IM" + tiff[2:]
    segments = []
    if rng.random() < 0.85:
        segments.append(b"Exif\x00\x00" + (b"Exif\x00\x00" if rng.random() < 0.05 else b"") + tiff)
    if rng.random() < 0.1:
        segments.append(b"Exif\x00\x00" + tiff)
    if rng.random() < 0.4:
        k = int(rng.integers(10))
        form = rng.choice([f'tiff:Orientation="{k}"', f"<tiff:Orientation>{k}</tiff:Orientation>", "none"])
        segments.insert(rng.integers(len(segments) + 1), b"http://ns.adobe.com/xap/1.0/\x00<x:xmpmeta " + form.encode() + b"/>")
    app1 = b"".join(b"\xff\xe1" + struct.pack(">H", len(s) + 2) + s for s in segments)
    return clean[:2] + app1 + clean[2:]


@pytest.mark.filterwarnings("ignore::UserWarning")  # Pillow's, about the broken EXIF made here
@pytest.mark.parametrize("seed", range(4))
def test_jpeg_orientation_of_random_metadata_is_what_exif_transpose_applies(imaging, seed):
    """Whatever the EXIF and XMP hold, a JPEG is turned as ``ImageOps.exif_transpose`` turns it (upright
    where exif_transpose raises on broken EXIF, which datapipe tolerates)."""
    rng = np.random.default_rng(seed)
    arr = imaging.gradient(24, 36, seed=seed)
    clean = imaging.jpeg(arr, quality=95, dpi=(72, 72)) if seed % 2 else imaging.jpeg(arr, quality=95)
    for i in range(150):
        data = random_metadata_jpeg(rng, clean)
        with Image.open(io.BytesIO(data)) as opened:
            try:
                ref = canonical_of(ImageOps.exif_transpose(opened))
            except Exception:  # noqa: BLE001 - Pillow raised on the EXIF: datapipe keeps the image upright
                ref = canonical_of(opened)
        assert_matches(decode_rgb(data, FULL), ref, f"seed {seed}, case {i}: {data[:160]!r}")


# ----------------------------------------------------------------------------- every Pillow mode


def random_image(mode: str, seed: int = 0, size=(23, 17)) -> Image.Image:
    """A random image of ``mode`` (made from random bytes through Pillow, so every mode is valid)."""
    rng = np.random.default_rng(seed)
    w, h = size
    if mode == "1":
        return Image.fromarray(rng.random((h, w)) > 0.5)
    if mode in ("I;16", "I;16L", "I;16B"):
        dtype = ">u2" if mode == "I;16B" else "<u2"
        return Image.frombuffer(mode, size, rng.integers(0, 65536, (h, w)).astype(dtype).tobytes(), "raw", mode, 0, 1)
    if mode == "I":
        return Image.fromarray(rng.integers(-1000, 70000, (h, w)).astype(np.int32), "I")
    if mode == "F":
        return Image.fromarray((rng.random((h, w)) * 300 - 20).astype(np.float32), "F")
    if mode == "P":
        img = Image.fromarray(rng.integers(0, 64, (h, w)).astype(np.uint8), "P")
        img.putpalette(rng.integers(0, 256, 768).astype(np.uint8).tobytes())
        return img
    bands = len(Image.getmodebands(mode) * "x")
    raw = rng.integers(0, 256, (h, w, bands)).astype(np.uint8)
    if mode == "RGBa":  # premultiplied: colour never above alpha
        raw[..., :-1] = np.minimum(raw[..., :-1], raw[..., -1:])
    if mode == "LA":
        return Image.fromarray(raw, "LA")
    if mode == "La":
        return Image.fromarray(raw, "LA").convert("La")  # Pillow premultiplies
    if mode == "PA":
        img = Image.new("PA", size)
        img.putdata([(int(i) % 64, int(a)) for i, a in zip(raw[..., 0].ravel(), raw[..., 1].ravel(), strict=True)])
        img.putpalette(rng.integers(0, 256, 768).astype(np.uint8).tobytes())
        return img
    return Image.frombuffer(mode, size, raw.tobytes(), "raw", mode, 0, 1)


SAVABLE = {  # mode -> formats that store it as that mode (checked in the test)
    "1": ("TIFF", "PNG", "BMP"), "L": ("TIFF", "PNG", "BMP"), "LA": ("TIFF", "PNG"), "P": ("TIFF", "PNG", "GIF"),
    "PA": ("TIFF",), "RGB": ("TIFF", "PNG", "BMP"), "RGBA": ("TIFF", "PNG"), "CMYK": ("TIFF", "JPEG"),
    "YCbCr": ("TIFF",), "LAB": ("TIFF",), "I": ("TIFF",), "I;16": ("TIFF", "PNG"), "I;16B": ("TIFF",), "F": ("TIFF",),
}


@pytest.mark.parametrize("mode,fmt", [(m, f) for m, fmts in SAVABLE.items() for f in fmts])
def test_every_mode_in_a_file_matches_pillow(mode, fmt):
    img = random_image(mode, seed=len(mode))
    buf = io.BytesIO()
    img.save(buf, fmt, **({"quality": 95} if fmt == "JPEG" else {}))
    data = buf.getvalue()
    with Image.open(io.BytesIO(data)) as reopened:
        assert reopened.mode == mode or fmt == "GIF", reopened.mode
    assert_matches(decode_rgb(data, FULL), pillow_canonical(data), f"{mode} {fmt}")


@pytest.mark.parametrize("mode", ["1", "L", "LA", "La", "P", "PA", "RGB", "RGBA", "RGBa", "CMYK", "YCbCr", "LAB",
                                  "HSV", "I", "I;16", "I;16L", "I;16B", "F"])
def test_every_mode_converts_through_its_own_path(mode):
    """Modes no sniffed format stores (RGBa, La, HSV) are reached here, in memory, like the rest."""
    img = random_image(mode, seed=3)
    img.load()
    assert_matches(codecs._to_rgb(img), canonical_of(img), mode)


def test_one_bit_is_black_and_white_not_near_black(imaging):
    bits = np.zeros((8, 10), bool)
    bits[:, 5:] = True
    for fmt in ("TIFF", "PNG", "BMP"):
        buf = io.BytesIO()
        Image.fromarray(bits).save(buf, fmt, **({"compression": "group4"} if fmt == "TIFF" else {}))
        ours = decode_rgb(buf.getvalue(), FULL)
        assert (ours[:, :5] == 0).all() and (ours[:, 5:] == 255).all(), fmt
        assert decode_sample(buf.getvalue(), DecodeSpec(size=10, fit="stretch")).mean() == pytest.approx(127.5, abs=1)


def test_sixteen_bit_samples_are_scaled_not_clipped():
    img = random_image("I;16", seed=1)
    buf = io.BytesIO()
    img.save(buf, "PNG")
    ours = decode_rgb(buf.getvalue(), FULL)
    assert ours.max() > 250 and ours.min() < 5 and 100 < ours.mean() < 155  # uniform 0..65535 -> 0..255


# ----------------------------------------------------------------------------- transparency variants


def png(width: int, height: int, color_type: int, depth: int, rows: list[bytes], *, plte: bytes = b"",
        trns: bytes | None = None) -> bytes:
    """A PNG written chunk by chunk, for the bit depths and tRNS forms Pillow does not write."""
    def chunk(tag: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + tag + body + struct.pack(">I", zlib.crc32(tag + body))

    out = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, depth, color_type, 0, 0, 0))
    if plte:
        out += chunk(b"PLTE", plte)
    if trns is not None:
        out += chunk(b"tRNS", trns)
    return out + chunk(b"IDAT", zlib.compress(b"".join(b"\x00" + r for r in rows))) + chunk(b"IEND", b"")


def packed_rows(values: np.ndarray, depth: int) -> list[bytes]:
    """Rows of ``depth``-bit samples (1, 2, 4, 8) packed MSB first, or 16-bit big-endian."""
    if depth == 16:
        return [row.astype(">u2").tobytes() for row in values]
    per = 8 // depth
    rows = []
    for row in values:
        padded = np.concatenate([row, np.zeros((-len(row)) % per, row.dtype)]).reshape(-1, per).astype(np.uint16)
        shifts = np.arange(per - 1, -1, -1) * depth
        rows.append((padded << shifts).sum(1).astype(np.uint8).tobytes())
    return rows


PNG_VARIANTS = {}
_rng = np.random.default_rng(7)
for _depth in (1, 2, 4, 8, 16):
    _vals = _rng.integers(0, 2**_depth, (9, 13))
    PNG_VARIANTS[f"gray{_depth}"] = png(13, 9, 0, _depth, packed_rows(_vals, _depth))
    PNG_VARIANTS[f"gray{_depth}-trns"] = png(13, 9, 0, _depth, packed_rows(_vals, _depth),
                                              trns=struct.pack(">H", int(_vals[0, 0])))
    if _depth <= 8:
        _plte = _rng.integers(0, 256, 3 * 2**_depth).astype(np.uint8).tobytes()
        PNG_VARIANTS[f"palette{_depth}"] = png(13, 9, 3, _depth, packed_rows(_vals, _depth), plte=_plte)
        _alphas = _rng.integers(0, 256, min(2**_depth, 5)).astype(np.uint8).tobytes()  # bytes: several entries
        PNG_VARIANTS[f"palette{_depth}-trns"] = png(13, 9, 3, _depth, packed_rows(_vals, _depth), plte=_plte,
                                                     trns=_alphas)
_rgb = _rng.integers(0, 4, (9, 13, 3)).astype(np.uint8) * 60
PNG_VARIANTS["rgb8-trns"] = png(13, 9, 2, 8, [r.tobytes() for r in _rgb], trns=struct.pack(">HHH", *_rgb[0, 0]))
PNG_VARIANTS["rgb16-trns"] = png(13, 9, 2, 16, [(r.astype(">u2") * 257).tobytes() for r in _rgb],
                                 trns=struct.pack(">HHH", *(int(v) * 257 for v in _rgb[0, 0])))


@pytest.mark.parametrize("name", sorted(PNG_VARIANTS))
def test_png_bit_depths_and_trns_forms_match_pillow(name):
    """Every bit depth of gray and palette PNGs, with and without tRNS. One deliberate difference:
    for 2- and 4-bit gray, Pillow scales the samples to 8 bits but not the tRNS value, so it makes
    the wrong level transparent; datapipe scales both (the PNG specification's reading), and the
    oracle here is given the scaled value."""
    data = PNG_VARIANTS[name]
    ours = decode_rgb(data, FULL)
    with Image.open(io.BytesIO(data)) as im:
        im.load()
        depth = data[24]
        if name.startswith("gray") and name.endswith("trns") and depth in (2, 4):
            im.info["transparency"] *= 255 // (2**depth - 1)
        ref = canonical_of(im)
    assert_matches(ours, ref, name)
    if name.endswith("trns") and name.startswith(("gray", "rgb")):
        assert tuple(ours[0, 0]) == (255, 255, 255), name  # the pixel whose value tRNS names


@pytest.mark.parametrize("filtered", [False, True], ids=["unfiltered", "sub-filtered"])
def test_a_16_bit_rgb_png_makes_transparent_exactly_the_pixels_its_16_bit_key_names(filtered):
    """Pillow reads 16-bit RGB at 8 bits (the high bytes) and keeps the tRNS key at 16: matched against the high
    bytes, the key made opaque pixels that share its high bytes transparent and left the keyed ones opaque."""
    key = (0x1234, 0x5678, 0x9ABC)
    rng = np.random.default_rng(3)
    arr = rng.integers(0, 65536, (7, 11, 3)).astype(np.uint16)
    arr[0, :5] = key  # the keyed pixels
    arr[1, :5] = [0x1200, 0x5600, 0x9A00]  # the key's high bytes, other low bytes: opaque
    arr[2, :5] = [k ^ 1 for k in key]  # one bit off the key: opaque
    rows = [r.astype(">u2").tobytes() for r in arr]
    data = png(11, 7, 2, 16, rows, trns=struct.pack(">HHH", *key))
    if filtered:  # the Sub filter (type 1) on every row: the low bytes are decoded through the same unfiltering
        def sub(row: bytes) -> bytes:
            b = np.frombuffer(row, np.uint8).astype(np.int16)
            return bytes([1]) + ((b - np.concatenate([np.zeros(6, np.int16), b[:-6]])) % 256).astype(np.uint8).tobytes()
        body = data[:data.index(b"IDAT") - 4]
        idat = zlib.compress(b"".join(sub(r) for r in rows))
        chunk = struct.pack(">I", len(idat)) + b"IDAT" + idat + struct.pack(">I", zlib.crc32(b"IDAT" + idat))
        end = struct.pack(">I", 0) + b"IEND" + struct.pack(">I", zlib.crc32(b"IEND"))
        data = body + chunk + end
    ours = decode_rgb(data, FULL)
    expected = (arr >> 8).astype(np.uint8)
    expected[(arr == np.array(key, np.uint16)).all(axis=2)] = 255
    np.testing.assert_array_equal(ours, expected)
    assert (ours[0, :5] == 255).all() and (ours[1, :5] == [0x12, 0x56, 0x9A]).all()


@pytest.mark.parametrize("transparency", [0, 3, b"\x00\x80\xff\x10"], ids=["int0", "int3", "bytes"])
def test_palette_transparency_as_int_or_bytes(transparency):
    img = random_image("P", seed=5)
    buf = io.BytesIO()
    img.save(buf, "PNG", transparency=transparency)
    data = buf.getvalue()
    with Image.open(io.BytesIO(data)) as reopened:
        assert "transparency" in reopened.info
    assert_matches(decode_rgb(data, FULL), pillow_canonical(data))


def gif_frames(transparent_first: bool, disposal: int) -> bytes:
    rng = np.random.default_rng(disposal)
    frames = []
    for _ in range(3):
        idx = rng.integers(0, 8, (16, 20)).astype(np.uint8)
        idx[4:10, 5:12] = 7  # the transparent index
        frame = Image.fromarray(idx, "P")
        frame.putpalette(rng.integers(0, 256, 24).astype(np.uint8).tobytes())
        frames.append(frame)
    buf = io.BytesIO()
    frames[0].save(buf, "GIF", save_all=True, append_images=frames[1:], disposal=disposal, duration=40,
                   **({"transparency": 7} if transparent_first else {}))
    return buf.getvalue()


@pytest.mark.parametrize("disposal", [0, 1, 2, 3])
@pytest.mark.parametrize("transparent", [True, False])
def test_gif_first_frame_as_pillow_composes_it(transparent, disposal):
    data = gif_frames(transparent, disposal)
    with Image.open(io.BytesIO(data)) as im:
        ref = over_white(np.asarray(im.convert("RGBA")))  # frame 0 as Pillow composes it, over white
    ours = decode_rgb(data, FULL)
    np.testing.assert_array_equal(ours, ref)
    if transparent:
        assert (ours[5, 6] == 255).all()


# ----------------------------------------------------------------------------- the sniffer and format variants


def bmp_with_header(arr: np.ndarray, header: int) -> bytes:
    """A 24-bit BMP with a BITMAPCOREHEADER (12, OS/2 v1), BITMAPINFOHEADER (40), V4 (108) or V5 (124)."""
    h, w, _ = arr.shape
    stride = (w * 3 + 3) & ~3
    pixels = b"".join(np.ascontiguousarray(row[:, ::-1]).tobytes().ljust(stride, b"\x00") for row in arr[::-1])
    if header == 12:
        info = struct.pack("<IHHHH", 12, w, h, 1, 24)
    else:
        info = struct.pack("<IiiHHIIiiII", header, w, h, 1, 24, 0, len(pixels), 2835, 2835, 0, 0)
        info = info.ljust(header, b"\x00")
    offset = 14 + len(info)
    return b"BM" + struct.pack("<IHHI", offset + len(pixels), 0, 0, offset) + info + pixels


def variants(imaging) -> dict[str, tuple[bytes, str]]:
    """name -> (file bytes, the format sniff must name)."""
    arr = imaging.gradient(30, 44, seed=4)
    rgba = np.dstack([arr, imaging.gradient(30, 44, seed=5)[..., 0]])
    out = {}
    for header in (12, 40, 108, 124):
        out[f"bmp-header-{header}"] = (bmp_with_header(arr, header), "bmp")
    out["dib"] = (bmp_with_header(arr, 40)[14:], "dib")
    out["webp-lossy"] = (imaging.encode(arr, "WEBP", quality=90), "webp")
    out["webp-lossless"] = (imaging.encode(arr, "WEBP", lossless=True), "webp")
    out["webp-alpha"] = (imaging.encode(Image.fromarray(rgba, "RGBA"), "WEBP", quality=90), "webp")
    out["webp-alpha-lossless"] = (imaging.encode(Image.fromarray(rgba, "RGBA"), "WEBP", lossless=True), "webp")
    frames = [Image.fromarray(rgba, "RGBA"), Image.fromarray(255 - rgba, "RGBA")]
    buf = io.BytesIO()
    frames[0].save(buf, "WEBP", save_all=True, append_images=frames[1:], lossless=True, duration=40)
    out["webp-animated"] = (buf.getvalue(), "webp")
    out["tiff-le"] = (imaging.encode(arr, "TIFF"), "tiff")
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, "TIFF", big_tiff=True)
    out["tiff-big-le"] = (buf.getvalue(), "tiff")
    for comp in ("tiff_lzw", "tiff_deflate", "packbits", "jpeg", "tiff_adobe_deflate"):
        out[f"tiff-{comp}"] = (imaging.encode(arr, "TIFF", compression=comp), "tiff")
    plain = imaging.jpeg(arr, quality=95)
    out["jpeg-jfif"] = (plain, "jpeg")
    out["jpeg-exif"] = (imaging.encode(arr, "JPEG", quality=95, exif=exif_bytes(1)), "jpeg")
    app0 = plain.find(b"\xff\xe0")
    no_app0 = plain[:2] + plain[app0 + 2 + struct.unpack(">H", plain[app0 + 2:app0 + 4])[0]:]
    out["jpeg-no-app0"] = (no_app0, "jpeg")
    out["jpeg-progressive"] = (imaging.jpeg(arr, quality=95, progressive=True), "jpeg")
    out["jpeg-gray"] = (imaging.jpeg(arr[..., 0], quality=95), "jpeg")
    out["jpeg-444"] = (imaging.jpeg(arr, quality=95, subsampling=0), "jpeg")
    out["jpeg-cmyk"] = (imaging.encode(Image.fromarray(arr).convert("CMYK"), "JPEG", quality=95), "jpeg")
    return out


VARIANT_NAMES = ["bmp-header-12", "bmp-header-40", "bmp-header-108", "bmp-header-124", "dib", "webp-lossy",
                 "webp-lossless", "webp-alpha", "webp-alpha-lossless", "webp-animated", "tiff-le", "tiff-big-le",
                 "tiff-tiff_lzw", "tiff-tiff_deflate", "tiff-packbits", "tiff-jpeg", "tiff-tiff_adobe_deflate",
                 "jpeg-jfif", "jpeg-exif", "jpeg-no-app0", "jpeg-progressive", "jpeg-gray", "jpeg-444", "jpeg-cmyk"]


@pytest.mark.parametrize("name", VARIANT_NAMES)
def test_format_variants_are_sniffed_and_match_pillow(imaging, name):
    data, fmt = variants(imaging)[name]
    assert sniff(data[:16]) == fmt
    assert_matches(decode_rgb(data, FULL), pillow_canonical(data), name)


def test_sniff_names_every_magic_pillow_accepts():
    for head, fmt in [(b"II*\x00", "tiff"), (b"MM\x00*", "tiff"), (b"II+\x00\x08\x00\x00\x00", "tiff"),
                      (b"MM\x00+\x00\x08\x00\x00", "tiff"), (b"\xff\xd8\xff\xdb", "jpeg"), (b"\xff\xd8\xff\xe1", "jpeg"),
                      (b"GIF87a", "gif"), (b"BM", "bmp"), (b"RIFF\x00\x00\x00\x00WEBPVP8L", "webp"),
                      (b"RIFF\x00\x00\x00\x00WEBPVP8X", "webp")]:
        assert sniff(head.ljust(16, b"\x00")) == fmt, head
    # a bare DIB header needs a plane count of 1 and a real bit depth, not just its size field
    assert sniff(struct.pack("<IiiHH", 40, 4, 4, 1, 24).ljust(16, b"\x00")) == "dib"
    assert sniff(struct.pack("<IiiHH", 40, 4, 4, 7, 24).ljust(16, b"\x00")) is None
    assert sniff(b"(\x00\x00\x00 is how this text file starts") is None


def test_arithmetic_coded_and_12_bit_jpegs_are_decoded_or_refused_like_pillow():
    """No encoder here writes them (Pillow and simplejpeg write 8-bit Huffman JPEGs only); a JPEG that
    libjpeg-turbo here refuses is handed to Pillow, and kept only if Pillow decodes it fully."""
    data = bytearray(variants_jpeg())
    sof = data.find(b"\xff\xc0")
    data[sof + 4] = 12  # claim 12-bit samples
    ours, reason = ours_or_reason(bytes(data))
    ref, refusal = oracle_or_reason(bytes(data))
    assert (ours is None) == (ref is None), (reason, refusal)


def variants_jpeg() -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.full((16, 16, 3), 90, np.uint8)).save(buf, "JPEG")
    return buf.getvalue()


# ----------------------------------------------------------------------------- JPEG warnings


def insert_before(data: bytes, marker: bytes, junk: bytes) -> bytes:
    at = data.find(marker)
    assert at > 0
    return data[:at] + junk + data[at:]


def bad_icc(data: bytes) -> bytes:
    """An ICC profile chunk whose sequence numbers are wrong (libjpeg-turbo: "bad ICC marker")."""
    payload = b"ICC_PROFILE\x00" + bytes([3, 2]) + b"x" * 40
    return data[:2] + b"\xff\xe2" + struct.pack(">H", len(payload) + 2) + payload + data[2:]


WARNINGS = {
    "junk-before-dqt": lambda d: insert_before(d, b"\xff\xdb", b"\x00\x13\x37\x00\x42"),
    "ff00-in-header": lambda d: insert_before(d, b"\xff\xdb", b"\xff\x00\x00\x00"),
    "junk-before-sof": lambda d: insert_before(d, b"\xff\xc0", b"junk"),
    "junk-before-eoi": lambda d: d[:-2] + b"\x00" * 11 + d[-2:],
    "bad-icc": bad_icc,
    "bad-icc-and-junk": lambda d: insert_before(bad_icc(d), b"\xff\xc4", b"\x01\x02\x03"),
}


@pytest.mark.parametrize("kind", ["rgb", "gray", "cmyk"])
@pytest.mark.parametrize("name", sorted(WARNINGS))
def test_recoverable_jpeg_warnings_keep_the_file(imaging, name, kind):
    """A warning that leaves the pixels intact is not corruption: the file gives the clean file's
    pixels (and Pillow's)."""
    arr = imaging.gradient(40, 56, seed=8)
    if kind == "cmyk":
        clean = imaging.encode(Image.fromarray(arr).convert("CMYK"), "JPEG", quality=95)
    else:
        clean = imaging.jpeg(arr[..., 0] if kind == "gray" else arr, quality=95)
    warned = WARNINGS[name](clean)
    sj = codecs._simplejpeg()
    with pytest.raises(ValueError):
        sj.decode_jpeg(warned, colorspace="CMYK" if kind == "cmyk" else "RGB", strict=True)  # it does warn
    ours = decode_rgb(warned, FULL)
    np.testing.assert_array_equal(ours, decode_rgb(clean, FULL))
    assert_matches(ours, pillow_canonical(warned), name)
    assert decode_sample(warned, DecodeSpec(size=16)).shape == (16, 16, 3)


def test_truncated_jpeg_is_refused_like_pillow(imaging):
    """Truncated means "data missing": refused, as Pillow refuses it (LOAD_TRUNCATED_IMAGES off) —
    even a file that lacks only its end-of-image marker."""
    data = imaging.jpeg(imaging.gradient(64, 80), quality=90)
    for cut in (len(data) // 3, len(data) - 40, len(data) - 2):
        with pytest.raises(DecodeError, match="truncated") as info:
            decode_rgb(data[:cut], FULL)
        assert info.value.kind == "corrupt"
        assert oracle_or_reason(data[:cut])[0] is None


def test_damaged_scan_data_is_refused_although_pillow_keeps_it(imaging):
    """Where the entropy-coded data ends early or does not decode, libjpeg-turbo fills the rest of the
    image with grey: Pillow ignores that warning and keeps the file; datapipe quarantines it, since
    the pixels are not the picture's."""
    data = imaging.corrupt_jpeg(imaging.jpeg(imaging.gradient(96, 128)))  # zeroed tail: premature end of segment
    with pytest.raises(DecodeError, match="damaged scan data"):
        decode_rgb(data, FULL)
    assert oracle_or_reason(data)[0] is not None


def test_damaged_png_and_deflate_tiff_are_refused_although_pillow_keeps_them(imaging):
    """A flipped bit in a PNG's image data or a TIFF's deflate strip: Pillow (and libtiff) stop
    inflating once they have every row, never reach the zlib stream's Adler-32 nor check the PNG
    chunk's CRC-32, and keep many such files with wrong pixels; datapipe checks them and quarantines
    every one."""
    y, x = np.mgrid[0:64, 0:96]
    arr = np.stack([x * 2, y * 3, (x * y) % 256], -1).astype(np.uint8)  # a pattern whose damage Pillow often keeps
    for fmt, kwargs, reason in [("PNG", {}, "corrupt PNG: chunk IDAT at byte"),
                                ("TIFF", {"compression": "tiff_adobe_deflate"}, "corrupt TIFF: the deflate data of strip 0")]:
        data = imaging.encode(arr, fmt, **kwargs)
        kept_by_pillow = 0
        for pos in range(len(data) // 4, len(data) * 3 // 4, 3):
            bad = bytearray(data)
            bad[pos] ^= 0x01
            ref, _ = oracle_or_reason(bytes(bad))
            if ref is None or agreement(ref, arr)[1] < 1:
                continue  # refused by Pillow too, or the bit changed no pixel
            kept_by_pillow += 1
            ours, exc = ours_or_reason(bytes(bad))
            assert ours is None and exc.kind == "corrupt" and str(exc).startswith(reason), (fmt, pos, exc)
        assert kept_by_pillow > 5, fmt


def test_truncated_png_and_gif_are_refused_like_pillow(imaging):
    arr = imaging.gradient(40, 50)
    for fmt in ("PNG", "GIF", "TIFF", "WEBP", "BMP"):
        data = imaging.encode(arr, fmt)
        cut = data[: len(data) * 2 // 3]
        ours, reason = ours_or_reason(cut)
        ref, _ = oracle_or_reason(cut)
        assert ours is None and ref is None, (fmt, reason)


# ----------------------------------------------------------------------------- the whole of Pillow's test images


@pytest.mark.skipif(not os.environ.get("DATAPIPE_WILD_SDIST"), reason="set DATAPIPE_WILD_SDIST=1 to fetch Pillow's "
                    "sdist (~47 MB) from PyPI and check all of its Tests/images")
def test_every_image_in_pillows_sdist_matches_pillow(tmp_path):
    """The committed corpus is a subset; this checks every file of the installed Pillow version's
    Tests/images with a README-listed extension the same way (kept: matches; quarantined: Pillow refuses)."""
    import PIL

    subprocess.run([sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps", "--quiet",
                    f"pillow=={PIL.__version__}", "-d", str(tmp_path)], check=True, timeout=600)
    with tarfile.open(next(tmp_path.glob("pillow-*.tar.gz"))) as tar:
        members = [m for m in tar.getmembers() if m.isfile() and "/Tests/images/" in m.name
                   and Path(m.name).suffix.lower() in EXTENSIONS]
        problems = []
        for member in members:
            data = tar.extractfile(member).read()
            ours, reason = ours_or_reason(data)
            ref, refusal = oracle_or_reason(data)
            if ours is None and ref is not None:
                problems.append(f"{member.name}: quarantined ({reason}) but Pillow decodes it")
            elif ours is not None and ref is None:
                problems.append(f"{member.name}: kept, but Pillow refuses it ({refusal})")
            elif ours is not None:
                psnr, mad = agreement(ours, ref) if ours.shape == ref.shape else (0.0, 255.0)
                if psnr < 40 and mad > 1:
                    problems.append(f"{member.name}: PSNR {psnr:.1f} dB, mean abs diff {mad:.2f}")
    assert len(members) > 500
    assert not problems, "\n".join(problems)
