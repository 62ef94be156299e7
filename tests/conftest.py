"""Shared fixtures: image bytes of every kind (good and bad), small class-folder sources and their serial builds.

Everything is generated in memory or under tmp_path with Pillow and numpy; no binary data is
committed. Helpers are reached through the session fixture ``imaging`` (a namespace of functions).
"""

from __future__ import annotations

import io
import os
import re
import shutil
import struct
import types
import zlib
from pathlib import Path

import numpy as np
import pytest
from build_fixtures import build, write_good_source
from s3_server import s3, s3_server  # noqa: F401 - fixtures: a moto S3 server on loopback

import datapipe

# A build into object storage reads its lock back this long after writing it (one second by default, to see another
# build that wrote it at the same moment): the tests' builds run one at a time, but for the test of builds started
# together, which sets its own.
os.environ.setdefault("DATAPIPE_REMOTE_LOCK_SETTLE", "0.2")

# ----------------------------------------------------------------------------- the machine's limits


def file_size_limit(size: int):
    """A preexec_fn: this process may write no file past ``size`` bytes (EFBIG, as a full disk gives ENOSPC)."""
    import resource

    return lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (size, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))


def _mounts_allowed() -> bool:
    import subprocess

    return shutil.which("unshare") is not None and subprocess.run(
        ["unshare", "-rm", "true"], capture_output=True, timeout=60).returncode == 0


# A test that mounts (a small tmpfs, a bind mount) in a user and mount namespace of its own, where an ordinary user
# may: skipped where the machine allows no such namespace.
needs_mounts = pytest.mark.skipif(not _mounts_allowed(), reason="needs unshare -rm (a user and mount namespace) to "
                                  "mount")

# ----------------------------------------------------------------------------- pixels and bytes


def gradient(height: int, width: int, seed: int = 0) -> np.ndarray:
    """An asymmetric, JPEG-friendly uint8 RGB image: gradients, a bright corner block and mild noise.

    Every flip and rotation of it differs from every other, so orientation mistakes show.
    """
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    img = np.empty((height, width, 3), np.float32)
    img[..., 0] = 255 * x / max(width - 1, 1)
    img[..., 1] = 255 * y / max(height - 1, 1)
    img[..., 2] = 128 + 60 * np.sin((x + 2 * y) / 7 + seed)
    img[: max(1, height // 5), : max(1, width // 6)] = (250, 250, 40)  # top-left marker
    img += rng.normal(0, 4, img.shape)
    return np.clip(img, 0, 255).round().astype(np.uint8)


def encode(image, fmt: str, **kwargs) -> bytes:
    """Encode a numpy array or a PIL image with Pillow."""
    from PIL import Image

    if isinstance(image, np.ndarray):
        image = Image.fromarray(image)
    buf = io.BytesIO()
    image.save(buf, fmt, **kwargs)
    return buf.getvalue()


def jpeg(arr: np.ndarray, quality: int = 92, **kwargs) -> bytes:
    return encode(arr, "JPEG", quality=quality, **kwargs)


def jpeg_with_orientation(arr: np.ndarray, orientation: int) -> bytes:
    from PIL import Image

    exif = Image.Exif()
    exif[0x0112] = orientation
    return encode(arr, "JPEG", exif=exif.tobytes(), quality=95)


def _png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def png_claiming(width: int, height: int) -> bytes:
    """A tiny PNG whose IHDR claims width×height (CRC fixed up): a decompression bomb header."""
    data = bytearray(encode(np.zeros((4, 4), np.uint8), "PNG"))
    assert data[12:16] == b"IHDR"
    struct.pack_into(">II", data, 16, width, height)
    struct.pack_into(">I", data, 29, zlib.crc32(bytes(data[12:29])))
    return bytes(data)


def png16_rgb(arr16: np.ndarray) -> bytes:
    """A 16-bit-per-channel RGB PNG written by hand (Pillow cannot write one)."""
    h, w, _ = arr16.shape
    raw = b"".join(b"\x00" + np.ascontiguousarray(arr16[r]).astype(">u2").tobytes() for r in range(h))
    return (b"\x89PNG\r\n\x1a\n" + _png_chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 16, 2, 0, 0, 0))
            + _png_chunk(b"IDAT", zlib.compress(raw)) + _png_chunk(b"IEND", b""))


def corrupt_jpeg(data: bytes, seed: int = 5, span: int = 48, *, zero_tail: bool = True) -> bytes:
    """Overwrite ``span`` bytes in the middle of the entropy-coded scan data with random garbage.

    Random garbage alone is not always detectable (it can be valid Huffman data); with
    ``zero_tail`` the rest of the scan is zeroed too, which libjpeg always reports as corrupt.
    """
    sos = data.find(b"\xff\xda")
    assert sos > 0
    start = sos + (len(data) - sos) // 2
    rng = np.random.default_rng(seed)
    bad = bytearray(data)
    for i in range(start, min(start + span, len(data) - 2)):
        value = int(rng.integers(0, 255))
        bad[i] = value if value != 0xFF else 0x00  # no accidental markers
    if zero_tail:
        for i in range(start + span, len(data) - 2):
            if bad[i] != 0xFF:
                bad[i] = 0
    assert bytes(bad) != data
    return bytes(bad)


def with_app1(data: bytes, payload: bytes) -> bytes:
    """Insert an APP1 segment with ``payload`` right after a JPEG's SOI marker."""
    assert data[:2] == b"\xff\xd8"
    return data[:2] + b"\xff\xe1" + struct.pack(">H", len(payload) + 2) + payload + data[2:]


def bad_inputs() -> dict[str, bytes]:
    """One file of every bad kind a build must quarantine, keyed by file name."""
    good = jpeg(gradient(96, 128, seed=3), quality=90)
    return {
        "zero.jpg": b"",
        "text.jpg": b"this is not an image, just some text with a .jpg name\n" * 4,
        "truncated.jpg": good[: len(good) // 2],
        "corrupt.jpg": corrupt_jpeg(good),
        "bomb.png": png_claiming(20000, 20000),
    }


# ----------------------------------------------------------------------------- sources


def write_source(root: Path, counts: dict[str, int], *, seed: int = 0, shape=(40, 52),
                 variety: bool = True) -> dict[str, int]:
    """Write a class-folder source; return {relative path: class name index in sorted order}.

    With ``variety`` the files mix JPEG, PNG, a PNG named .jpg, grayscale, RGBA and EXIF-rotated
    JPEGs of varying sizes; without it every file is a plain JPEG of ``shape``.
    """
    root.mkdir(parents=True, exist_ok=True)
    classes = sorted(counts)
    files: dict[str, int] = {}
    k = 0
    for name in classes:
        (root / name).mkdir(exist_ok=True)
        for j in range(counts[name]):
            h, w = shape
            if variety:
                h, w = h + 7 * (k % 5), w + 5 * (k % 3)
            arr = gradient(h, w, seed=seed * 1000 + k)
            kind = k % 6 if variety else 0
            if kind == 1:
                fname, data = f"img{j:03d}.png", encode(arr, "PNG")
            elif kind == 2:
                fname, data = f"png-named{j:03d}.jpg", encode(arr, "PNG")
            elif kind == 3:
                fname, data = f"gray{j:03d}.jpeg", jpeg(arr[..., 1])
            elif kind == 4:
                rgba = np.dstack([arr, np.full(arr.shape[:2], 200, np.uint8)])
                fname, data = f"rgba{j:03d}.png", encode(rgba, "PNG")
            elif kind == 5:
                fname, data = f"rot{j:03d}.jpg", jpeg_with_orientation(arr, 6)
            else:
                fname, data = f"img{j:03d}.jpg", jpeg(arr)
            (root / name / fname).write_bytes(data)
            files[f"{name}/{fname}"] = classes.index(name)
            k += 1
    return files


def write_bad_files(folder: Path) -> list[str]:
    """Write every bad kind into ``folder`` plus a dangling symlink; return the file names."""
    folder.mkdir(parents=True, exist_ok=True)
    names = []
    for name, data in bad_inputs().items():
        (folder / name).write_bytes(data)
        names.append(name)
    os.symlink(folder / "does-not-exist.jpg", folder / "x.jpg")
    names.append("x.jpg")
    return names


BUILD_ID = re.compile(rb'"build_id": "[0-9a-f]{32}"')


def tree_bytes(folder: Path, *, skip=("report.json",)) -> dict[str, bytes]:
    """Every file under ``folder`` (relative posix path -> bytes), except names in ``skip``.

    Build ids (a fresh uuid4 per build, in build.json, the manifest and every shard's zarr.json) are
    replaced by one placeholder, so two builds of the same inputs compare equal byte for byte otherwise.
    """
    out = {}
    for path in sorted(Path(folder).rglob("*")):
        if path.is_file() and path.name not in skip:
            data = path.read_bytes()
            if path.suffix == ".json":
                data = BUILD_ID.sub(b'"build_id": "<build id>"', data)
            out[path.relative_to(folder).as_posix()] = data
    return out


@pytest.fixture(scope="session")
def imaging() -> types.SimpleNamespace:
    """The helpers above, as one namespace."""
    return types.SimpleNamespace(
        gradient=gradient, encode=encode, jpeg=jpeg, jpeg_with_orientation=jpeg_with_orientation,
        png_claiming=png_claiming, png16_rgb=png16_rgb, corrupt_jpeg=corrupt_jpeg, with_app1=with_app1,
        bad_inputs=bad_inputs, write_source=write_source, write_bad_files=write_bad_files,
        tree_bytes=tree_bytes,
    )


# ----------------------------------------------------------------------------- builds shared by the build tests
# A class-folder source and its serial build, good and with bad files: built once for test_builder,
# test_sources, test_output and test_build_cli (helpers in build_fixtures.py).


@pytest.fixture(scope="session")
def source(tmp_path_factory, imaging) -> tuple[Path, dict[str, int]]:
    root = tmp_path_factory.mktemp("src") / "images"
    return root, write_good_source(root, imaging)


@pytest.fixture(scope="session")
def built(source, tmp_path_factory) -> tuple[Path, datapipe.BuildReport]:
    out = tmp_path_factory.mktemp("built") / "cache"
    return out, build(source[0], out)


@pytest.fixture(scope="session")
def bad_source(tmp_path_factory, imaging) -> tuple[Path, dict[str, int]]:
    root = tmp_path_factory.mktemp("badsrc") / "images"
    files = write_good_source(root, imaging)
    imaging.write_bad_files(root / "dog")
    return root, files


@pytest.fixture(scope="session")
def bad_built(bad_source, tmp_path_factory) -> tuple[Path, datapipe.BuildReport]:
    out = tmp_path_factory.mktemp("badbuilt") / "cache"
    return out, build(bad_source[0], out, max_bad_fraction=0.5)


@pytest.fixture
def built_copy(built, tmp_path) -> Path:
    """A private copy of the built cache, to damage or rebuild."""
    dst = tmp_path / "copy"
    shutil.copytree(built[0], dst, symlinks=True)
    return dst


@pytest.fixture
def synced_paths(monkeypatch) -> list[str]:
    """The files and folders flushed to disk during the test (os.fsync and os.fdatasync, by the path of the fd)."""
    synced: list[str] = []
    for name in ("fsync", "fdatasync"):
        real = getattr(os, name)
        monkeypatch.setattr(os, name, lambda fd, real=real: (synced.append(os.readlink(f"/proc/self/fd/{fd}")), real(fd))[1])
    return synced
