"""Property tests over every file a cache holds: whatever is on disk, readers raise only one-line
DatapipeErrors (or read correct data), and never open a file outside the cache folder.

One small valid cache is built per module; each example writes a generated or mutated version of
one file into a private copy of it (manifest.json, build.json, report.json, labels.npy, paths.json)
and reads it back through the public entry points.
"""

from __future__ import annotations

import builtins
import copy
import io
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import datapipe
from datapipe.errors import DatapipeError
from datapipe.files import file_crc32c
from datapipe.records import is_datapipe_output, read_build_record, read_report
from datapipe.testing import build_index_cache, index_map

N, SHARD = 20, 7
FAST = settings(max_examples=300, deadline=None, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

KEYS = ["format", "version", "config", "size", "config_hash", "sample", "shape", "dtype", "num_samples", "classes",
        "source", "root", "kind", "files", "labels", "paths", "name", "crc32c", "shards", "count", "first", "nbytes",
        "build_id", "status", "quarantined", "path", "reason", "error", "images_per_second", "workers"]
SCALARS = (st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=True, allow_infinity=True)
           | st.sampled_from(["", "..", "../../etc/passwd", "/etc/passwd", "000000.zarr", "labels.npy", "deadbeef",
                              "0" * 32, "datapipe-cache", "ü\x00"]) | st.text(max_size=12))
JSON = st.recursive(SCALARS, lambda c: st.lists(c, max_size=4) | st.dictionaries(st.sampled_from(KEYS) | st.text(max_size=6),
                                                                                  c, max_size=5), max_leaves=24)


@pytest.fixture(scope="module")
def original(tmp_path_factory) -> Path:
    return build_index_cache(tmp_path_factory.mktemp("fuzz"), N, shard_size=SHARD)


@pytest.fixture(scope="module")
def work(original, tmp_path_factory) -> Path:
    """A copy of the cache that each example damages one file of (and the test restores)."""
    return Path(shutil.copytree(original, tmp_path_factory.mktemp("fuzz-work") / "cache"))


class _Recorder:
    """The paths opened while a reader runs (see attempt), not while the test writes or restores files."""

    paths: list[str] | None = None
    active = False

    @classmethod
    def note(cls, path) -> None:
        if cls.active and cls.paths is not None and not isinstance(path, int):
            cls.paths.append(os.fspath(path))


@pytest.fixture
def opened(monkeypatch, work):
    """Record every path opened through os.open and builtins.open by the readers; check them after
    the examples: all inside the cache folder."""
    real_os_open, real_open = os.open, builtins.open

    def os_open(path, *args, **kwargs):
        _Recorder.note(path)
        return real_os_open(path, *args, **kwargs)

    def open_(file, *args, **kwargs):
        _Recorder.note(file)
        return real_open(file, *args, **kwargs)

    datapipe.open(work).verify()  # imports and first calls happen before recording
    monkeypatch.setattr(os, "open", os_open)
    monkeypatch.setattr(builtins, "open", open_)
    monkeypatch.setattr(io, "open", open_)
    _Recorder.paths = paths = []
    try:
        yield paths
    finally:
        _Recorder.paths = None
    root = work.resolve()
    outside = [p for p in paths if not Path(p).resolve().is_relative_to(root)]
    assert paths and not outside, outside


def check_error(exc: BaseException) -> None:
    assert isinstance(exc, DatapipeError), repr(exc)
    assert "\n" not in str(exc) and str(exc), repr(exc)


def read_everything(cache_dir: Path) -> None:
    """Open the cache and read every sample, label and path: DatapipeError or correct data."""
    cache = datapipe.open(cache_dir)
    out, labels = np.empty((len(cache), *cache.shape), np.uint8), np.empty(len(cache), np.int64)
    cache.read_batch(np.arange(len(cache)), out, labels)
    [cache.path(i) for i in range(len(cache))]


def attempt(fn, *args):
    """``fn(*args)``, or None when it raised a one-line DatapipeError; opens are recorded meanwhile."""
    _Recorder.active = True
    try:
        return fn(*args)
    except Exception as exc:  # noqa: BLE001 - the property: only one-line DatapipeErrors
        check_error(exc)
        return None
    finally:
        _Recorder.active = False


def restore(work: Path, original: Path, name: str) -> None:
    shutil.copy(original / name, work / name)


@st.composite
def mutated(draw, doc):
    """``doc`` with one value somewhere replaced, deleted, nudged or given a wrong type."""
    doc = copy.deepcopy(doc)
    parent, key, node = None, None, doc
    while isinstance(node, (dict, list)) and node and draw(st.integers(0, 3)) > 0:
        keys = list(node) if isinstance(node, dict) else list(range(len(node)))
        parent, key = node, draw(st.sampled_from(keys))
        node = node[key]
    action = draw(st.sampled_from(["replace", "delete", "nudge", "retype", "whole"]))
    if parent is None or action == "whole":
        return draw(JSON) if action in ("replace", "whole") else [doc]
    if action == "delete":
        del parent[key]
    elif action == "nudge" and isinstance(node, int) and not isinstance(node, bool):
        parent[key] = node + draw(st.sampled_from([-1, 1, -(2**40), 2**63]))
    elif action == "retype":
        parent[key] = draw(st.sampled_from([None, True, 1.5, "1", [node], {"v": node}, float("nan")]))
    else:
        parent[key] = draw(JSON)
    return doc


def document(original: Path, name: str) -> dict:
    return json.loads((original / name).read_text(encoding="utf-8"))


def write(work: Path, name: str, value) -> None:
    (work / name).write_text(json.dumps(value), encoding="utf-8")


# ----------------------------------------------------------------------------- manifest.json


@FAST
@given(data=st.data())
def test_mutated_manifests(original, work, opened, data):
    write(work, "manifest.json", data.draw(mutated(document(original, "manifest.json"))))
    try:
        attempt(read_everything, work)
    finally:
        restore(work, original, "manifest.json")


@FAST
@given(doc=JSON)
def test_generated_manifests(original, work, opened, doc):
    write(work, "manifest.json", doc)
    try:
        attempt(read_everything, work)
    finally:
        restore(work, original, "manifest.json")


@settings(FAST, max_examples=200)
@given(cut=st.integers(0, 4000), junk=st.binary(max_size=8))
def test_manifest_bytes_truncated_or_corrupted(original, work, opened, cut, junk):
    raw = (original / "manifest.json").read_bytes()
    cut = cut % (len(raw) + 1)
    (work / "manifest.json").write_bytes(raw[:cut] + junk + raw[cut + len(junk):] if junk else raw[:cut])
    try:
        attempt(read_everything, work)
    finally:
        restore(work, original, "manifest.json")


# ----------------------------------------------------------------------------- build.json, report.json


@FAST
@given(data=st.data(), generated=st.booleans())
def test_build_records(original, work, opened, data, generated):
    doc = data.draw(JSON if generated else mutated(document(original, "build.json")))
    write(work, "build.json", doc)
    try:
        ours = is_datapipe_output(work)  # never raises; manifest.json still marks the folder
        assert ours is True
        record = attempt(read_build_record, work)
        if record is not None:
            assert record.format == "datapipe-cache" and isinstance(record.config["size"], int)
    finally:
        restore(work, original, "build.json")


@settings(FAST, max_examples=150)
@given(doc=JSON)
def test_marker_of_a_folder_with_only_a_users_files(tmp_path_factory, doc):
    folder = tmp_path_factory.mktemp("user")
    for name in ("build.json", "manifest.json"):
        write(folder, name, doc)
    marked = isinstance(doc, dict) and doc.get("format") == "datapipe-cache"
    if not marked:
        assert is_datapipe_output(folder) is False and read_build_record(folder) is None
    else:
        assert isinstance(is_datapipe_output(folder), bool)
        attempt(read_build_record, folder)
    shutil.rmtree(folder)


@FAST
@given(data=st.data(), generated=st.booleans())
def test_reports(original, work, opened, data, generated):
    doc = data.draw(JSON if generated else mutated(document(original, "report.json")))
    write(work, "report.json", doc)
    try:
        report = attempt(read_report, work)
        if report is not None:
            assert isinstance(report.status, str) and isinstance(report.workers, int)
    finally:
        restore(work, original, "report.json")


# ----------------------------------------------------------------------------- labels.npy, paths.json


def with_checksum(work: Path, key: str, name: str, fix: bool) -> None:
    """Make the manifest's checksum of ``name`` match its new bytes (``fix``), so that the parser
    behind the checksum is exercised too."""
    if fix:
        doc = json.loads((work / "manifest.json").read_text(encoding="utf-8"))
        doc["files"][key]["crc32c"] = file_crc32c(work / name)
        write(work, "manifest.json", doc)


@settings(FAST, max_examples=400)
@given(cut=st.integers(0, 400), flips=st.lists(st.tuples(st.integers(0, 400), st.integers(1, 255)), max_size=3),
       tail=st.binary(max_size=16), fix=st.booleans())
def test_labels_bytes(original, work, opened, cut, flips, tail, fix):
    raw = bytearray((original / "labels.npy").read_bytes())
    for at, x in flips:
        raw[at % len(raw)] ^= x
    raw = raw[: cut % (len(raw) + 1)] + tail if cut < len(raw) else raw + tail
    (work / "labels.npy").write_bytes(bytes(raw))
    with_checksum(work, "labels", "labels.npy", fix)
    try:
        cache = attempt(datapipe.open, work)
        labels = attempt(lambda: np.array(cache.labels)) if cache is not None else None
        if labels is not None:
            assert labels.shape == (N,) and labels.min() >= 0 and labels.max() < 3
            if bytes(raw) == (original / "labels.npy").read_bytes():
                assert np.array_equal(labels, index_map(original) % 3)
    finally:
        restore(work, original, "labels.npy")
        restore(work, original, "manifest.json")


@settings(FAST, max_examples=300)
@given(data=st.data(), fix=st.booleans(), generated=st.booleans())
def test_paths_json(original, work, opened, data, fix, generated):
    if generated:
        doc = data.draw(JSON | st.lists(st.text(max_size=5), min_size=N, max_size=N))
    else:
        doc = data.draw(mutated(json.loads((original / "paths.json").read_text(encoding="utf-8"))))
    write(work, "paths.json", doc)
    with_checksum(work, "paths", "paths.json", fix)
    try:
        cache = attempt(datapipe.open, work)
        if cache is not None:
            path = attempt(cache.path, N - 1)
            assert path is None or isinstance(path, str)
    finally:
        restore(work, original, "paths.json")
        restore(work, original, "manifest.json")
