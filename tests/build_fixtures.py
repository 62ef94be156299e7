"""Helpers of the build tests: the sources' contents, the serial build call, shard paths, and the
cache-against-source check. The shared sources and builds themselves are fixtures in conftest.py.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

import datapipe
from datapipe.codecs import DecodeSpec, decode_sample

SIZE = 32
SHARD = 7
COUNTS = {"café": 9, "dog": 10, "zebra": 8}
BAD_REASONS = {  # file in dog/ -> what its quarantine reason must say
    "zero.jpg": r"empty file",
    "text.jpg": r"not an image",
    "truncated.jpg": r"(?i)truncated",
    "corrupt.jpg": r"(?i)corrupt",
    "bomb.png": r"decompression bomb",
    "x.jpg": r"unreadable.*(FileNotFound|No such file)",
}
BAD_KINDS = {  # file in dog/ -> its quarantine class (datapipe.errors.QUARANTINE_KINDS)
    "zero.jpg": "empty", "text.jpg": "not-an-image", "truncated.jpg": "corrupt", "corrupt.jpg": "corrupt",
    "bomb.png": "too-large", "x.jpg": "unreadable",
}


def build(source, output, spec: datapipe.BuildSpec | None = None, **kwargs) -> datapipe.BuildReport:
    """A serial build, of small samples unless ``spec`` says otherwise; keywords are build()'s."""
    small = {} if spec else {"size": SIZE, "shard_size": SHARD}
    kwargs = {**small, "cluster": datapipe.Cluster(scheduler="sync"), "progress": False, **kwargs}
    return datapipe.build(source, output, spec, **kwargs)


@contextlib.contextmanager
def build_log(callback: Callable[[logging.LogRecord], None]) -> Iterator[None]:
    """Hand every line a build logs to ``datapipe.build`` to ``callback`` as it is logged (in the
    build's thread, while the build runs) until the block ends."""

    class Handler(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            callback(record)

    logger, handler = logging.getLogger("datapipe.build"), Handler()
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def images_file(out: Path, shard: int) -> Path:
    return out / "shards" / f"{shard:06d}.zarr" / "images" / "c" / "0" / "0" / "0" / "0"


def write_good_source(root: Path, imaging) -> dict[str, int]:
    """The good files: three classes (one non-ASCII), a non-ASCII file name, a nested folder."""
    files = imaging.write_source(root, COUNTS, seed=1)
    (root / "café" / "ß-ü.jpg").write_bytes(imaging.jpeg(imaging.gradient(45, 61, seed=77)))
    files["café/ß-ü.jpg"] = 0
    (root / "dog" / "nested" / "deeper").mkdir(parents=True)
    (root / "dog" / "nested" / "deeper" / "inner.png").write_bytes(
        imaging.encode(imaging.gradient(50, 40, seed=78), "PNG"))
    files["dog/nested/deeper/inner.png"] = 1
    (root / "dog" / "notes.txt").write_text("not an image, skipped for its extension")
    (root / "zebra" / ".hidden.jpg").write_bytes(b"hidden files are skipped")
    (root / ".git").mkdir()  # hidden folders are not classes
    (root / "README.md").write_text("top-level files are not classes")
    return files


def check_cache_matches_source(out: Path, root: Path, files: dict[str, int], spec: DecodeSpec) -> None:
    cache = datapipe.open(out)
    assert len(cache) == len(files)
    assert [cache.path(i) for i in range(len(cache))] == sorted(files)
    for i in range(len(cache)):
        image, label = cache[i]
        path = cache.path(i)
        assert label == files[path], path
        assert image.shape == (spec.size, spec.size, 3) and image.dtype == np.uint8
        np.testing.assert_array_equal(image, decode_sample((root / path).read_bytes(), spec), err_msg=path)


# ----------------------------------------------------------------------------- damage and repair


def flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        value = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([value ^ 0x5A]))
