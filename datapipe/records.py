"""Typed, validated records of every file a cache holds: read once, checked once, trusted after.

Each JSON document of a cache (``manifest.json``, ``build.json``, ``report.json``) and the per-shard
entries of the manifest are parsed here into frozen dataclasses. Whatever is on disk — a list where
an object belongs, a null, a bool where an int belongs, NaN, a negative count, offsets that do not
add up, a shard name that climbs out of the cache — ends in one :class:`~datapipe.errors.CacheError`
whose single line names the file, the field and what to do. Nothing else is raised, and no name
read from a document is ever joined to a path before it has been checked to be a plain name.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

from .errors import PERMISSION_ADVICE, QUARANTINE_KINDS, CacheError, UnreadableFileError, refused
from .files import FileTooLarge, NotRegularFile, read_regular
from .text import one_line, show

FORMAT = "datapipe-cache"
VERSION_FIXED = 1  # square raw samples at i * S*S*3 of each shard's data file
VERSION_INDEXED = 2  # samples of their own shape or size, found through each shard's sample index
VERSIONS = (VERSION_FIXED, VERSION_INDEXED)
VERSION = VERSION_INDEXED  # the newest format this datapipe reads and writes
MANIFEST = "manifest.json"
REPORT = "report.json"
BUILD_LOCK = "build.json"
LABELS = "labels.npy"
PATHS = "paths.json"
LAYOUTS = ("fixed", "indexed")
ENCODINGS = ("raw", "jpeg")  # datapipe.samples.ENCODINGS
CHUNK_BYTES = 65536  # the inner chunk of an indexed shard's data array
INDEX_ROW_BYTES = 32  # one sample index row: offset, nbytes, height, width as little-endian int64

MAX_SIZE = 8192  # the largest sample side DecodeSpec accepts
MAX_COUNT = 1 << 40  # far beyond any cache; keeps arithmetic on counts in int64
MAX_JSON_BYTES = {MANIFEST: 256 << 20, BUILD_LOCK: 16 << 20, REPORT: 1 << 30}

SHARD_NAME = re.compile(r"\d{6,9}\.zarr")  # what shards.shard_name writes
PLAIN_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,254}")  # a file directly inside the cache
HEX8 = re.compile(r"[0-9a-f]{8}")
HEX16 = re.compile(r"[0-9a-f]{16}")
BUILD_ID = re.compile(r"[0-9a-f]{32}")

_REBUILD = "rerun the same `datapipe build` to rewrite it"
_HINTS = {
    # the build cannot tell a damaged manifest from a user's file, and never overwrites one: it must go first
    MANIFEST: "move it away and rerun the same `datapipe build` to rewrite it (finished shards are kept)",
    BUILD_LOCK: "rerun `datapipe build` with --force to rebuild this output, or choose another output folder",
    REPORT: "move it away and rerun the same `datapipe build` to rewrite it (the cache itself is not affected)",
}


# ----------------------------------------------------------------------------- reading JSON safely


def read_json(path: Path, *, hint: str | None = None) -> Any:
    """The JSON document at ``path``; CacheError (one line) if it is not a regular, bounded, valid file.

    Opened non-blocking and checked to be a regular file first, so a FIFO or device under a cache's
    file name cannot hang the reader; the size is bounded; NaN and Infinity are refused.
    """
    hint = hint or _HINTS.get(path.name, _REBUILD)
    limit = MAX_JSON_BYTES.get(path.name, 256 << 20)
    try:
        data = read_regular(path, limit)
    except FileNotFoundError:  # nothing to move away
        raise CacheError(f"{path} is missing; {hint.removeprefix('move it away and ')}") from None
    except NotRegularFile:
        raise CacheError(f"{path} is not a regular file; {hint}") from None
    except FileTooLarge as exc:
        raise CacheError(f"{path} is {exc.size:,} bytes, more than the {limit:,} this file may hold; {hint}") from None
    except OSError as exc:
        if refused(exc):
            hint = PERMISSION_ADVICE
        raise UnreadableFileError(f"{path} cannot be read ({exc.strerror or exc}); {hint}") from None
    return parse_json(data, path, hint=hint)


def _no_constant(name: str) -> NoReturn:
    raise ValueError(f"{name} is not a JSON number")


def parse_json(data: bytes, path: Path | str, *, hint: str | None = None) -> Any:
    """Decode ``data`` (the bytes of ``path``) as strict JSON: UTF-8, no NaN/Infinity, bounded nesting."""
    hint = hint or _HINTS.get(Path(path).name, _REBUILD)
    try:
        return json.loads(data.decode("utf-8"), parse_constant=_no_constant)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        reason = one_line(str(exc)) if not isinstance(exc, RecursionError) else "nested too deeply"
        raise CacheError(f"{path} is not valid JSON ({reason}); {hint}") from None


# ----------------------------------------------------------------------------- field checks


class _Fields:
    """Typed access to one JSON object of a document; every failure is one CacheError line."""

    def __init__(self, doc: Any, path: Path | str, where: str = "", *, hint: str | None = None) -> None:
        self.path = path
        self.where = where
        self.hint = hint or _HINTS.get(Path(path).name, _REBUILD)
        if not isinstance(doc, dict):
            self.fail(f"is {_kind(doc)}, expected a JSON object")
        self.doc = doc

    def name(self, key: str) -> str:
        return f"{self.where}.{key}" if self.where else key

    def fail(self, problem: str, key: str | None = None) -> NoReturn:
        what = f"field {self.name(key)!r}" if key is not None else (f"field {self.where!r}" if self.where else "the document")
        raise CacheError(f"{self.path}: {what} {problem}; {self.hint}")

    def has(self, key: str) -> bool:
        return key in self.doc

    def get(self, key: str) -> Any:
        if key not in self.doc:
            self.fail("is missing", key)
        return self.doc[key]

    def integer(self, key: str, lo: int = 0, hi: int = MAX_COUNT) -> int:
        value = self.get(key)
        if isinstance(value, bool) or not isinstance(value, int):
            self.fail(f"is {_kind(value)}, expected an integer", key)
        if not lo <= value <= hi:
            self.fail(f"is {value}, expected an integer in [{lo}, {hi}]", key)
        return value

    def number(self, key: str, lo: float = 0.0) -> float:
        value = self.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            self.fail(f"is {_kind(value)}, expected a number", key)
        if value < lo:
            self.fail(f"is {value}, expected a number >= {lo}", key)
        return float(value)

    def text(self, key: str, pattern: re.Pattern | None = None, *, expect: str = "") -> str:
        value = self.get(key)
        if not isinstance(value, str):
            self.fail(f"is {_kind(value)}, expected a string", key)
        if pattern is not None and not pattern.fullmatch(value):
            self.fail(f"is {show(value)}, expected {expect or 'a string matching ' + pattern.pattern}", key)
        return value

    def obj(self, key: str) -> _Fields:
        return _Fields(self.get(key), self.path, self.name(key), hint=self.hint)

    def array(self, key: str) -> list:
        value = self.get(key)
        if not isinstance(value, list):
            self.fail(f"is {_kind(value)}, expected a list", key)
        return value


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"a boolean ({str(value).lower()})"
    if isinstance(value, (int, float)):
        return f"a number ({value})"
    if isinstance(value, str):
        return f"a string ({show(value)})"
    kinds: dict[type, str] = {list: "a list", dict: "an object"}
    return kinds.get(type(value), type(value).__name__)


def _check_marker(f: _Fields) -> None:
    """The format name and version, checked before anything else in the document."""
    fmt = f.get("format")
    if fmt != FORMAT:
        raise CacheError(f"{f.path} is not a datapipe {Path(f.path).name} (format={show(fmt) if isinstance(fmt, str) else _kind(fmt)}); "
                         f"{f.hint}")
    version = f.get("version")
    if type(version) is not int or version < 1:  # a float (1.0), a string, a bool, null: damage, not another datapipe
        raise CacheError(f"{f.path}: field 'version' is {_kind(version) if type(version) is not int else version}, "
                         f"not a format version (a whole number from 1); {f.hint}")
    if version not in VERSIONS:
        raise CacheError(f"{f.path}: field 'version' is {version}: written by cache format version {version}; this "
                         f"datapipe reads versions {' and '.join(map(str, VERSIONS))}. Install a datapipe that matches, "
                         "or rebuild the cache with this one.")


def _build_id(f: _Fields) -> str:
    return f.text("build_id", BUILD_ID, expect="32 lowercase hex digits") if f.has("build_id") else ""


def layout_of(config: dict) -> str:
    """The shard layout a build configuration gives: ``indexed`` for ``fit`` short or ``encoding``
    jpeg (samples of their own shape or size), ``fixed`` for square raw samples."""
    return "indexed" if config.get("fit") == "short" or config.get("encoding", "raw") != "raw" else "fixed"


def version_of(config: dict) -> int:
    """The format version of a cache of this configuration: 1 for the fixed layout, 2 for the indexed."""
    return VERSION_INDEXED if layout_of(config) == "indexed" else VERSION_FIXED


def config_hash(config: dict) -> str:
    """A stable hash of the build configuration (what determines the bytes of every shard). The
    version hashed is the configuration's own (1 for every configuration of format 1, so the hashes
    of existing caches are unchanged)."""
    blob = json.dumps({"format": FORMAT, "version": version_of(config), **config}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _config(f: _Fields) -> tuple[dict, str]:
    """The build configuration and its hash, which must be the hash of that configuration; the
    document's version must be the configuration's (see :func:`version_of`)."""
    config = f.obj("config")
    size = config.integer("size", 1, MAX_SIZE)
    if config.has("fit"):
        config.text("fit")
    if config.has("encoding"):
        config.text("encoding", re.compile("|".join(ENCODINGS)), expect=" or ".join(map(repr, ENCODINGS)))
    if config.has("quality"):
        config.integer("quality", 1, 100)
    if config.has("restart_interval"):
        config.integer("restart_interval", 0, 65535)
    if config.has("max_aspect"):
        config.number("max_aspect", 1.0)
        if long_side_cap(size, config.doc["max_aspect"]) > MAX_SIZE:
            config.fail(f"gives samples a longer side over {MAX_SIZE}", "max_aspect")
    chash = f.text("config_hash", HEX16, expect="16 lowercase hex digits")
    if chash != config_hash(config.doc):
        f.fail(f"is {chash}, which is not the hash of the config the file holds", "config_hash")
    expected = version_of(config.doc)
    if f.doc["version"] != expected:
        f.fail(f"is {f.doc['version']}, expected {expected} for a cache of the {layout_of(config.doc)} layout "
               f"(fit {show(str(config.doc.get('fit')))}, encoding {show(str(config.doc.get('encoding', 'raw')))})", "version")
    return config.doc, chash


def long_side_cap(size: int, max_aspect: float) -> int:
    """floor(max_aspect * size): the longest side a ``short`` sample may have (rounded to 9 digits
    first, so that 1.15 * 100 is 115, not 114)."""
    return max(size, math.floor(round(max_aspect * size, 9)))


# ----------------------------------------------------------------------------- the records


@dataclass(frozen=True)
class ShardRecord:
    """One shard as the manifest lists it: its folder name, its samples' global range and its data file."""

    name: str
    count: int
    first: int
    nbytes: int
    crc32c: str
    inputs_hash: str = ""
    index_crc32c: str = ""  # the indexed layout only: the crc32c of the shard's sample index file

    def to_json(self) -> dict:
        doc = {"name": self.name, "count": self.count, "first": self.first, "nbytes": self.nbytes,
               "crc32c": self.crc32c, "inputs_hash": self.inputs_hash}
        if self.index_crc32c:
            doc["index_crc32c"] = self.index_crc32c
        return doc


@dataclass(frozen=True)
class FileRecord:
    """An index file of the cache (labels, paths): a plain name inside the cache and its crc32c."""

    name: str
    crc32c: str

    def to_json(self) -> dict:
        return {"name": self.name, "crc32c": self.crc32c}


@dataclass(frozen=True)
class SourceRecord:
    """Where a build read from."""

    root: str
    kind: str

    def to_json(self) -> dict:
        return {"root": self.root, "kind": self.kind}


@dataclass(frozen=True)
class Manifest:
    """``manifest.json``: the contract between the build and the loader (see :func:`parse_manifest`)."""

    config: dict
    config_hash: str
    num_samples: int
    classes: tuple[str, ...]
    source: SourceRecord
    files: dict[str, FileRecord]
    shards: tuple[ShardRecord, ...]
    build_id: str = ""
    format: str = FORMAT

    @property
    def version(self) -> int:
        """1 for the fixed layout, 2 for the indexed one (the configuration decides)."""
        return version_of(self.config)

    @property
    def layout(self) -> str:
        """``fixed``: square raw samples at ``i * S*S*3``; ``indexed``: found through each shard's sample index."""
        return layout_of(self.config)

    @property
    def encoding(self) -> str:
        """How a sample's bytes are stored: ``raw`` pixels or ``jpeg``."""
        return str(self.config.get("encoding", "raw"))

    @property
    def size(self) -> int:
        return int(self.config["size"])

    @property
    def shape(self) -> tuple[int, int, int]:
        """(S, S, 3): the shape of a square sample (every sample's unless ``fixed_shape`` is None)."""
        return (self.size, self.size, 3)

    @property
    def fixed_shape(self) -> tuple[int, int, int] | None:
        """The one shape of every sample, (S, S, 3); None when samples keep their aspect (fit short)."""
        return None if self.config.get("fit") == "short" else self.shape

    @property
    def max_side(self) -> int:
        """The longest side any sample may have: S, or floor(max_aspect * S) for fit short."""
        if self.config.get("fit") != "short":
            return self.size
        return long_side_cap(self.size, float(self.config.get("max_aspect", 2.0)))

    @property
    def nbytes(self) -> int:
        """Bytes of all shard data files."""
        return sum(s.nbytes for s in self.shards)

    def to_json(self) -> dict:
        doc = {
            "format": self.format,
            "version": self.version,
            "config": json.loads(json.dumps(self.config)),
            "config_hash": self.config_hash,
            "sample": {"shape": list(self.fixed_shape) if self.fixed_shape else None, "dtype": "uint8",
                       "encoding": self.encoding, "layout": self.layout},
            "num_samples": self.num_samples,
            "classes": list(self.classes),
            "source": self.source.to_json(),
            "files": {k: v.to_json() for k, v in self.files.items()},
            "shards": [s.to_json() for s in self.shards],
        }
        if self.build_id:
            doc["build_id"] = self.build_id
        return doc


@dataclass(frozen=True)
class BuildRecord:
    """``build.json``: the marker a build writes into its output before anything else."""

    config: dict
    config_hash: str
    build_id: str = ""
    source: dict = field(default_factory=dict)
    format: str = FORMAT

    @property
    def version(self) -> int:
        return version_of(self.config)

    def to_json(self) -> dict:
        doc = {"format": self.format, "version": self.version, "config": json.loads(json.dumps(self.config)),
               "config_hash": self.config_hash}
        if self.build_id:
            doc["build_id"] = self.build_id
        if self.source:
            doc["source"] = dict(self.source)
        return doc


@dataclass(frozen=True)
class ReportRecord:
    """The parts of ``report.json`` that ``datapipe info`` shows."""

    status: str
    quarantined: tuple[dict, ...]
    images_per_second: float
    workers: int
    shards_built: int | None = None  # None: a report written before it said so


# ----------------------------------------------------------------------------- parsers


def expected_file_size(count: int, size: int) -> int:
    """Bytes of a fixed-layout shard's image file: samples, then the shard index and its crc32c."""
    return count * size * size * 3 + 16 * count + 4 if count else 0


def indexed_chunks(total: int) -> int:
    """Inner chunks of an indexed shard's data array of ``total`` sample bytes."""
    return -(-total // CHUNK_BYTES)


def indexed_file_size(total: int) -> int:
    """Bytes of an indexed shard's data file holding ``total`` bytes of samples: the samples padded
    with zeros to whole chunks, then the shard index (16 bytes a chunk) and its crc32c; 0 when empty."""
    chunks = indexed_chunks(total)
    return chunks * CHUNK_BYTES + 16 * chunks + 4 if total else 0


def parse_manifest(doc: Any, path: Path | str) -> Manifest:
    """Check every field of a manifest document and cross-check counts, offsets, sizes and names."""
    f = _Fields(doc, path)
    _check_marker(f)
    config, chash = _config(f)
    size = int(config["size"])
    layout = layout_of(config)
    sample = f.obj("sample")
    shape = sample.get("shape")
    square = config.get("fit") != "short"
    if square and (shape != [size, size, 3] or any(isinstance(v, bool) for v in shape)):
        sample.fail(f"is {one_line(json.dumps(shape), 60)}, expected [{size}, {size}, 3] (config.size {size})", "shape")
    if not square and shape is not None:
        sample.fail(f"is {one_line(json.dumps(shape), 60)}, expected null (fit short: samples keep their aspect)", "shape")
    sample.text("dtype", re.compile("uint8"), expect="'uint8'")
    if f.doc["version"] == VERSION_FIXED:
        # an earlier datapipe's version 1 manifest names no encoding and describes its layout in words
        if sample.has("encoding"):
            sample.text("encoding", re.compile("raw"), expect="'raw' (format version 1)")
        if sample.has("layout"):
            sample.text("layout")
    else:
        encoding = str(config.get("encoding", "raw"))
        sample.text("encoding", re.compile(re.escape(encoding)), expect=f"{encoding!r} (config.encoding)")
        sample.text("layout", re.compile(layout), expect=f"{layout!r} (format version {f.doc['version']})")
    num_samples = f.integer("num_samples")
    classes = _classes(f)
    if "classes" in config and config["classes"] != list(classes):  # a class list given to the build
        f.fail("differs from config.classes, the class list the build was given", "classes")
    src = f.obj("source")
    source = SourceRecord(root=src.text("root"), kind=src.text("kind", _SOURCE_KINDS, expect="'folder' or 'csv'"))
    files = _files(f)
    shards = _shards(f, layout, config)
    total = sum(s.count for s in shards)
    if total != num_samples:
        f.fail(f"is {num_samples}, but the shards' counts add up to {total}", "num_samples")
    return Manifest(config=config, config_hash=chash, num_samples=num_samples, classes=classes, source=source,
                    files=files, shards=shards, build_id=_build_id(f))


def _classes(f: _Fields) -> tuple[str, ...]:
    classes = f.array("classes")
    seen: set[str] = set()
    for i, c in enumerate(classes):
        if not isinstance(c, str):
            f.fail(f"is {_kind(c)}, expected a class name (string)", f"classes[{i}]")
        if c in seen:
            f.fail(f"repeats the class {show(c)}", f"classes[{i}]")
        seen.add(c)
    return tuple(classes)


def _files(f: _Fields) -> dict[str, FileRecord]:
    files = f.obj("files")
    for key in ("labels", "paths"):
        files.get(key)
    out = {}
    for key in files.doc:
        entry = files.obj(key)
        out[key] = FileRecord(name=entry.text("name", PLAIN_NAME, expect="a plain file name inside the cache"),
                              crc32c=entry.text("crc32c", HEX8, expect="8 lowercase hex digits"))
    names = [r.name for r in out.values()]
    if len(set(names)) != len(names):
        files.fail("names one file twice")
    return out


def _nbytes_check(layout: str, config: dict) -> Callable[[int, int], str | None]:
    """What a shard's ``nbytes`` may be for ``count`` samples: None if ``nbytes`` fits, else what was expected.

    Fixed: exactly :func:`expected_file_size`. Indexed: :func:`indexed_file_size` of the samples' total,
    which the sample index holds; square raw samples give it exactly, the rest bound it (each sample
    at least 1 byte, at most max_side² · 3 pixels' bytes for raw).
    """
    size = int(config["size"])
    if layout == "fixed":
        def fixed(count: int, nbytes: int) -> str | None:
            expected = expected_file_size(count, size)
            return None if nbytes == expected else f"{expected} for {count} samples of {size}x{size}"
        return fixed
    raw, square = config.get("encoding", "raw") == "raw", config.get("fit") != "short"
    side = size if square else long_side_cap(size, float(config.get("max_aspect", 2.0)))

    def indexed(count: int, nbytes: int) -> str | None:
        if raw and square:
            expected = indexed_file_size(count * size * size * 3)
            return None if nbytes == expected else f"{expected} for {count} samples of {size}x{size}"
        lo = indexed_file_size(count * size * size * 3 if raw else count)
        hi = indexed_file_size(count * size * side * 3 if raw else count * MAX_SIZE * MAX_SIZE * 3)
        whole = nbytes == 0 if not count else (nbytes - 4) % (CHUNK_BYTES + 16) == 0
        return None if whole and lo <= nbytes <= hi else (
            f"a data file size of whole {CHUNK_BYTES}-byte chunks, shard index and crc32c from {lo} to {hi} "
            f"for {count} samples")
    return indexed


def _shards(f: _Fields, layout: str, config: dict) -> tuple[ShardRecord, ...]:
    check_nbytes = _nbytes_check(layout, config)
    shards = f.array("shards")
    out, first, names = [], 0, set()
    for i, raw in enumerate(shards):
        s = _Fields(raw, f.path, f"shards[{i}]", hint=f.hint)
        name = s.text("name", SHARD_NAME, expect="a shard folder name like '000000.zarr'")
        if name in names:
            s.fail(f"repeats the shard {name}", "name")
        names.add(name)
        count = s.integer("count")
        if s.integer("first") != first:
            s.fail(f"is {s.doc['first']}, expected {first} (the sum of the previous shards' counts)", "first")
        nbytes = s.integer("nbytes", 0, 1 << 62)
        expected = check_nbytes(count, nbytes)
        if expected is not None:
            s.fail(f"is {nbytes}, expected {expected}", "nbytes")
        crc = s.text("crc32c", HEX8, expect="8 lowercase hex digits")
        inputs_hash = s.text("inputs_hash") if s.has("inputs_hash") else ""
        index_crc = s.text("index_crc32c", HEX8, expect="8 lowercase hex digits") if layout == "indexed" else ""
        out.append(ShardRecord(name=name, count=count, first=first, nbytes=nbytes, crc32c=crc, inputs_hash=inputs_hash,
                               index_crc32c=index_crc))
        first += count
        if first > MAX_COUNT:
            s.fail(f"brings the sample count past {MAX_COUNT}", "count")
    return tuple(out)


def parse_build_record(doc: Any, path: Path | str) -> BuildRecord:
    """Check a ``build.json`` document (format, version, config, config_hash; build_id and source if present)."""
    f = _Fields(doc, path)
    _check_marker(f)
    config, chash = _config(f)
    source: dict = {}
    if f.has("source"):
        src = f.obj("source")
        source = {key: src.text(key) for key in src.doc}
    return BuildRecord(config=config, config_hash=chash, build_id=_build_id(f), source=source)


_SOURCE_KINDS = re.compile("folder|csv")
_STATUSES = re.compile("ok|failed")
_QUARANTINE_KINDS = re.compile("|".join(map(re.escape, QUARANTINE_KINDS)))


def parse_report(doc: Any, path: Path | str) -> ReportRecord:
    """Check the fields of ``report.json`` that ``datapipe info`` reads."""
    f = _Fields(doc, path)
    status = f.text("status", _STATUSES, expect="'ok' or 'failed'")
    quarantined = []
    for i, raw in enumerate(f.array("quarantined")):
        q = _Fields(raw, path, f"quarantined[{i}]", hint=f.hint)
        entry = {"path": q.text("path"), "reason": q.text("reason")}
        if q.has("error"):
            entry["error"] = q.text("error", _QUARANTINE_KINDS, expect="a quarantine kind (" + ", ".join(QUARANTINE_KINDS) + ")")
        quarantined.append(entry)
    return ReportRecord(status=status, quarantined=tuple(quarantined),
                        images_per_second=f.number("images_per_second"), workers=f.integer("workers"),
                        shards_built=f.integer("shards_built") if f.has("shards_built") else None)


# ----------------------------------------------------------------------------- files of a folder


def read_manifest(folder: Path) -> Manifest:
    path = Path(folder) / MANIFEST
    return parse_manifest(read_json(path), path)


def read_report(folder: Path) -> ReportRecord | None:
    """The folder's report.json, or None if there is none."""
    path = Path(folder) / REPORT
    if not os.path.lexists(path):
        return None
    return parse_report(read_json(path), path)


def _marker(path: Path) -> Any | None:
    """The parsed document at ``path`` if it carries the datapipe marker, else None (raises only
    UnreadableFileError, for a file there that cannot be read).

    The marker: a JSON object with format == "datapipe-cache", an integer version and, when present,
    a build_id of 32 lowercase hex digits.
    """
    try:
        doc = read_json(path)
    except UnreadableFileError:  # whose it is cannot be told
        raise
    except CacheError:
        return None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        return None
    version = doc.get("version")
    if isinstance(version, bool) or not isinstance(version, int):
        return None
    build_id = doc.get("build_id", "")
    if build_id != "" and not (isinstance(build_id, str) and BUILD_ID.fullmatch(build_id)):
        return None
    return doc


def is_datapipe_output(folder: str | os.PathLike) -> bool:
    """True only when ``folder``'s build.json or manifest.json carries the datapipe marker.

    A user's own ``manifest.json`` or ``build.json`` (anything without format "datapipe-cache", an
    integer version and a well-formed build_id when one is given) gives False.
    """
    folder = Path(folder)
    return any(os.path.lexists(folder / name) and _marker(folder / name) is not None for name in (BUILD_LOCK, MANIFEST))


def read_build_record(folder: str | os.PathLike) -> BuildRecord | None:
    """The folder's build.json as a BuildRecord; None when there is none or it is not datapipe's.

    Raises:
        CacheError: build.json carries the datapipe marker but is damaged or of another version.
    """
    path = Path(folder) / BUILD_LOCK
    if not os.path.lexists(path):
        return None
    doc = _marker(path)
    if doc is None:
        return None
    return parse_build_record(doc, path)
