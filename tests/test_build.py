"""`datapipe.build` and the cache it writes: contents, quarantine, budget, resume, repair, errors, CLI.

Every build here uses ``scheduler="sync"`` (serial, in-process) and tiny samples, so the whole file
runs in seconds; the Dask paths are covered by test_build_distributed.py.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import datapipe
from datapipe.cli import main as cli_main
from datapipe.codecs import DecodeSpec, decode_sample
from datapipe.errors import (
    QUARANTINE_KINDS,
    CacheError,
    ConfigMismatchError,
    CorruptShardError,
    OutputError,
    SourceError,
    TooManyBadFilesError,
)

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


def build(source, output, **kwargs) -> datapipe.BuildReport:
    kwargs = {"size": SIZE, "shard_size": SHARD, "scheduler": "sync", "progress": False,
              "log": lambda line: None, **kwargs}
    return datapipe.build(source, output, **kwargs)


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


@pytest.fixture(scope="module")
def source(tmp_path_factory, imaging) -> tuple[Path, dict[str, int]]:
    root = tmp_path_factory.mktemp("src") / "images"
    return root, write_good_source(root, imaging)


@pytest.fixture(scope="module")
def built(source, tmp_path_factory) -> tuple[Path, datapipe.BuildReport]:
    out = tmp_path_factory.mktemp("built") / "cache"
    return out, build(source[0], out)


@pytest.fixture(scope="module")
def bad_source(tmp_path_factory, imaging) -> tuple[Path, dict[str, int]]:
    root = tmp_path_factory.mktemp("badsrc") / "images"
    files = write_good_source(root, imaging)
    imaging.write_bad_files(root / "dog")
    return root, files


@pytest.fixture(scope="module")
def bad_built(bad_source, tmp_path_factory) -> tuple[Path, datapipe.BuildReport]:
    out = tmp_path_factory.mktemp("badbuilt") / "cache"
    return out, build(bad_source[0], out, max_bad_fraction=0.5)


@pytest.fixture
def built_copy(built, tmp_path) -> Path:
    """A private copy of the built cache, to damage or rebuild."""
    dst = tmp_path / "copy"
    shutil.copytree(built[0], dst, symlinks=True)
    return dst


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


# ----------------------------------------------------------------------------- a good build


def test_counts_and_labels(built, source):
    out, report = built
    files = source[1]
    n = len(files)
    assert report.status == "ok"
    assert report.num_samples == n
    assert report.quarantined == []
    assert report.shards_total == report.shards_built == math.ceil(n / SHARD)
    assert report.shards_skipped == 0
    assert report.ignored == 2  # dog/notes.txt and README.md
    cache = datapipe.open(out)
    assert len(cache) == n
    assert cache.classes == sorted(COUNTS) == ["café", "dog", "zebra"]
    for i in range(n):
        assert cache[i][1] == cache.classes.index(cache.path(i).split("/")[0])
    np.testing.assert_array_equal(np.asarray(cache.labels), [files[p] for p in sorted(files)])
    np.testing.assert_array_equal(np.load(out / "labels.npy"), [files[p] for p in sorted(files)])
    assert cache[-1][1] == cache[n - 1][1]
    with pytest.raises(IndexError):
        cache[n]


def test_non_ascii_paths(built):
    cache = datapipe.open(built[0])
    paths = [cache.path(i) for i in range(len(cache))]
    assert "café/ß-ü.jpg" in paths
    assert "dog/nested/deeper/inner.png" in paths
    assert json.loads((built[0] / "paths.json").read_text(encoding="utf-8")) == paths


def test_images_equal_decode_sample(built, source):
    check_cache_matches_source(built[0], source[0], source[1], DecodeSpec(size=SIZE, fit="crop"))


def test_output_layout_and_manifest(built, source):
    out, _ = built
    root, files = source
    n = len(files)
    assert {p.name for p in out.iterdir()} == {"manifest.json", "report.json", "build.json", "labels.npy",
                                                "paths.json", "shards"}
    m = json.loads((out / "manifest.json").read_text(encoding="utf-8"))
    assert m["format"] == "datapipe-cache" and m["version"] == 1
    assert m["config"] == {"size": SIZE, "fit": "crop", "max_pixels": 100_000_000, "shard_size": SHARD,
                           "source_kind": "folder"}
    assert re.fullmatch(r"[0-9a-f]{16}", m["config_hash"])
    assert m["num_samples"] == n
    assert m["classes"] == ["café", "dog", "zebra"]
    assert m["sample"]["shape"] == [SIZE, SIZE, 3] and m["sample"]["dtype"] == "uint8"
    assert m["source"] == {"root": str(root.absolute()), "kind": "folder"}
    shards = m["shards"]
    assert [s["name"] for s in shards] == [f"{i:06d}.zarr" for i in range(math.ceil(n / SHARD))]
    assert sorted(p.name for p in (out / "shards").iterdir()) == [s["name"] for s in shards]
    assert [s["count"] for s in shards] == [min(SHARD, n - i * SHARD) for i in range(len(shards))]
    assert [s["first"] for s in shards] == [i * SHARD for i in range(len(shards))]
    for i, s in enumerate(shards):
        data = images_file(out, i)
        # samples back to back, then the shard index (16 bytes per sample) and its crc32c
        assert data.stat().st_size == s["nbytes"] == s["count"] * SIZE * SIZE * 3 + 16 * s["count"] + 4
        assert re.fullmatch(r"[0-9a-f]{8}", s["crc32c"])
    assert m["files"]["labels"]["name"] == "labels.npy" and m["files"]["paths"]["name"] == "paths.json"
    cache = datapipe.open(out)
    assert cache.manifest.to_json() == m
    report = json.loads((out / "report.json").read_text(encoding="utf-8"))
    assert report["status"] == "ok" and report["num_samples"] == n and report["quarantined"] == []
    lock = json.loads((out / "build.json").read_text())
    assert lock["config_hash"] == m["config_hash"]


def test_verify_clean(built):
    assert datapipe.open(built[0]).verify() == []


def test_shards_readable_by_zarr_python(built):
    import zarr

    out, _ = built
    cache = datapipe.open(out)
    for rec in (s.to_json() for s in cache.manifest.shards):
        group = zarr.open_group(str(out / "shards" / rec["name"]), mode="r")
        images, labels = group["images"], group["labels"]
        assert images.shape == (rec["count"], SIZE, SIZE, 3) and images.dtype == np.uint8
        assert images.chunks == (1, SIZE, SIZE, 3)
        everything = images[:]
        for j in range(rec["count"]):
            expected, label = cache[rec["first"] + j]
            np.testing.assert_array_equal(images[j], expected)
            np.testing.assert_array_equal(everything[j], expected)
            assert labels[j] == label
        attrs = group.attrs.asdict()["datapipe"]
        assert attrs["paths"] == [cache.path(rec["first"] + j) for j in range(rec["count"])]
        assert attrs["crc32c"] == rec["crc32c"]


def test_rerun_is_a_noop(built_copy, source, imaging):
    before = imaging.tree_bytes(built_copy)
    mtimes = {p: p.stat().st_mtime_ns for p in built_copy.rglob("*") if p.is_file()}
    report = build(source[0], built_copy)
    assert report.status == "ok"
    assert report.shards_built == 0 and report.shards_skipped == report.shards_total > 1
    assert imaging.tree_bytes(built_copy) == before  # manifest.json included, byte for byte
    for p in (built_copy / "shards").rglob("*"):
        if p.is_file():
            assert p.stat().st_mtime_ns == mtimes[p], f"{p} was rewritten"


def test_changed_source_rebuilds_only_affected_shards(tmp_path, source, built, imaging):
    root = tmp_path / "src"
    shutil.copytree(source[0], root, symlinks=True)
    files = dict(source[1])
    out = tmp_path / "out"
    build(root, out)
    victim = sorted(files)[SHARD + 2]  # a file in shard 1
    (root / victim).write_bytes(imaging.encode(imaging.gradient(80, 90, seed=999), "PNG"))
    report = build(root, out)
    assert report.shards_built == 1 and report.shards_skipped == report.shards_total - 1
    check_cache_matches_source(out, root, files, DecodeSpec(size=SIZE))
    # fewer files -> fewer shards: the surplus shard folders are removed
    for path in sorted(files)[2 * SHARD:]:
        (root / path).unlink()
        del files[path]
    report = build(root, out)
    assert report.shards_total == 2 and report.shards_built == 0
    assert sorted(p.name for p in (out / "shards").iterdir()) == ["000000.zarr", "000001.zarr"]
    check_cache_matches_source(out, root, files, DecodeSpec(size=SIZE))
    assert datapipe.open(out).verify() == []


def test_a_failed_rebuild_leaves_no_stale_manifest(tmp_path, source, imaging):
    """A rebuild that changes a shard drops the old manifest before touching the shards: stopped
    or failed, it leaves an unfinished cache, not a manifest describing shards that are gone."""
    root = tmp_path / "src"
    shutil.copytree(source[0], root, symlinks=True)
    out = tmp_path / "out"
    build(root, out)
    manifest = (out / "manifest.json").read_bytes()
    assert build(root, out).shards_built == 0  # a rerun that changes nothing keeps it ...
    assert (out / "manifest.json").read_bytes() == manifest
    victim = sorted(source[1])[SHARD + 2]  # a file in shard 1
    (root / victim).write_bytes(b"not an image any more")
    with pytest.raises(TooManyBadFilesError):
        build(root, out, max_bad_fraction=0.0)  # ... one that changes a shard and then fails does not
    assert not (out / "manifest.json").exists()
    with pytest.raises(CacheError, match="did not finish"):
        datapipe.open(out)
    report = build(root, out, max_bad_fraction=0.5)  # finishing it writes the new one
    assert report.shards_built == 0 and [q["path"] for q in report.quarantined] == [victim]
    assert len(datapipe.open(out)) == len(source[1]) - 1


# ----------------------------------------------------------------------------- bad files


def test_bad_files_are_quarantined(bad_built, bad_source):
    out, report = bad_built
    root, files = bad_source
    assert report.status == "ok"
    assert report.num_samples == len(files)
    assert report.scanned == len(files) + len(BAD_REASONS)
    by_path = {q["path"]: q["reason"] for q in report.quarantined}
    assert set(by_path) == {f"dog/{name}" for name in BAD_REASONS}
    for name, pattern in BAD_REASONS.items():
        assert re.search(pattern, by_path[f"dog/{name}"]), (name, by_path[f"dog/{name}"])
    on_disk = json.loads((out / "report.json").read_text(encoding="utf-8"))
    assert on_disk["status"] == "ok"
    assert on_disk["quarantined"] == report.quarantined
    for q in on_disk["quarantined"]:
        assert set(q) == {"path", "error", "reason"} and q["reason"]
        assert q["error"] == BAD_KINDS[q["path"].split("/")[-1]], q
        assert q["error"] in QUARANTINE_KINDS
    assert report.quarantine_counts() == {"corrupt": 2, "empty": 1, "not-an-image": 1, "too-large": 1, "unreadable": 1}
    assert "6 quarantined (2 corrupt, 1 " in report.summary()
    check_cache_matches_source(out, root, files, DecodeSpec(size=SIZE))
    cache = datapipe.open(out)
    assert not any(cache.path(i).endswith(tuple(BAD_REASONS)) for i in range(len(cache)))
    assert cache.verify() == []


def test_too_many_bad_files(bad_source, bad_built, tmp_path, imaging):
    root, files = bad_source
    out = tmp_path / "cache"
    with pytest.raises(TooManyBadFilesError) as info:
        build(root, out, max_bad_fraction=0.05)
    message = str(info.value)
    named = [name for name in BAD_REASONS if f"dog/{name} ({BAD_KINDS[name]})" in message]
    assert len(named) == 3, message  # the first three, each with its class
    assert "report.json" in message
    report = json.loads((out / "report.json").read_text(encoding="utf-8"))
    assert report["status"] == "failed"
    assert {q["path"] for q in report["quarantined"]} == {f"dog/{name}" for name in BAD_REASONS}
    assert not (out / "manifest.json").exists()
    n_shards = math.ceil((len(files) + len(BAD_REASONS)) / SHARD)
    assert sorted(p.name for p in (out / "shards").iterdir()) == [f"{i:06d}.zarr" for i in range(n_shards)]
    with pytest.raises(CacheError, match="did not finish"):
        datapipe.open(out)
    # a larger budget finishes the build without decoding anything again
    report2 = build(root, out, max_bad_fraction=0.5)
    assert report2.status == "ok"
    assert report2.shards_built == 0 and report2.shards_skipped == n_shards
    assert len(report2.quarantined) == len(BAD_REASONS)
    assert imaging.tree_bytes(out) == imaging.tree_bytes(bad_built[0])  # same as an uninterrupted build


def test_zero_budget_fails_on_one_bad_file(tmp_path, imaging):
    root = tmp_path / "src"
    imaging.write_source(root, {"a": 3, "b": 3}, variety=False)
    (root / "a" / "empty.jpg").write_bytes(b"")
    with pytest.raises(TooManyBadFilesError, match="a/empty.jpg"):
        build(root, tmp_path / "out", max_bad_fraction=0.0)
    report = build(root, tmp_path / "out", max_bad_fraction=0.2)
    assert report.num_samples == 6 and [q["path"] for q in report.quarantined] == ["a/empty.jpg"]


def test_shard_with_only_bad_files(tmp_path, imaging):
    root = tmp_path / "src"
    imaging.write_source(root, {"a": 4}, variety=False)
    (root / "b").mkdir()
    (root / "b" / "empty.jpg").write_bytes(b"")  # alone in the second shard
    report = build(root, tmp_path / "out", shard_size=4, max_bad_fraction=0.5)
    assert report.status == "ok" and report.num_samples == 4 and report.shards_total == 2
    cache = datapipe.open(tmp_path / "out")
    assert len(cache) == 4 and [s.count for s in cache.manifest.shards] == [4, 0]
    assert cache.verify() == []


def test_invalid_max_bad_fraction(source, tmp_path):
    with pytest.raises(ValueError, match="max_bad_fraction"):
        build(source[0], tmp_path / "out", max_bad_fraction=1.5)


# ----------------------------------------------------------------------------- CSV sources


def test_csv_source(tmp_path, imaging):
    root = tmp_path / "data"
    good = imaging.write_source(root / "pics", {"x": 4, "y": 4}, variety=True)
    (root / "pics" / "ünï").mkdir()
    (root / "pics" / "ünï" / "café.png").write_bytes(imaging.encode(imaging.gradient(40, 40), "PNG"))
    rows = [("path", "label")]
    labels = {}
    for i, rel in enumerate(sorted(good)):
        name = "cat" if i % 2 else "bird"
        rows.append((f"pics/{rel}", name))
        labels[f"pics/{rel}"] = name
    rows.append(("pics/ünï/café.png", "ant"))
    labels["pics/ünï/café.png"] = "ant"
    rows.append(("pics/missing.jpg", "cat"))  # names a file that does not exist
    twice = f"pics/{min(good)}"
    rows.append((twice, labels[twice]))  # duplicate row
    csv_path = root / "list.csv"
    csv_path.write_text("\n".join(",".join(r) for r in rows) + "\n", encoding="utf-8")
    report = build(csv_path, tmp_path / "out", max_bad_fraction=0.5)
    assert report.status == "ok"
    reasons = {q["path"]: q["reason"] for q in report.quarantined}
    assert set(reasons) == {"pics/missing.jpg", twice}
    assert re.search(r"unreadable.*(FileNotFound|No such file)", reasons["pics/missing.jpg"])
    assert "duplicate" in reasons[twice]
    kinds = {q["path"]: q["error"] for q in report.quarantined}
    assert kinds == {"pics/missing.jpg": "unreadable", twice: "duplicate"}
    cache = datapipe.open(tmp_path / "out")
    assert cache.classes == ["ant", "bird", "cat"]
    assert cache.manifest.config["source_kind"] == "csv"
    assert len(cache) == len(labels)
    assert [cache.path(i) for i in range(len(cache))] == sorted(labels)
    for i in range(len(cache)):
        image, label = cache[i]
        assert cache.classes[label] == labels[cache.path(i)]
        np.testing.assert_array_equal(image, decode_sample((root / cache.path(i)).read_bytes(), DecodeSpec(SIZE)))
    report_json = json.loads((tmp_path / "out" / "report.json").read_text(encoding="utf-8"))
    assert {q["path"] for q in report_json["quarantined"]} == set(reasons)


def test_csv_without_header_numeric_labels(tmp_path, imaging):
    root = tmp_path / "data"
    files = imaging.write_source(root, {"a": 3}, variety=False)
    paths = sorted(files)
    lines = [f"{paths[0]},10", f"{paths[1]},2", f" {paths[2]} , 2 ", "", "# a comment"]
    (root / "list.csv").write_text("\n".join(lines) + "\n")
    build(root / "list.csv", tmp_path / "out")
    cache = datapipe.open(tmp_path / "out")
    assert cache.classes == ["2", "10"]  # numeric labels sort as numbers
    assert [cache.path(i) for i in range(3)] == paths
    assert [cache[i][1] for i in range(3)] == [1, 0, 0]


def test_csv_duplicate_keeps_the_first_row(tmp_path, imaging):
    files = sorted(imaging.write_source(tmp_path, {"a": 2}, variety=False))
    (tmp_path / "list.csv").write_text(f"{files[0]},zebra\n{files[0]},ant\n{files[1]},zebra\n")
    report = build(tmp_path / "list.csv", tmp_path / "out", max_bad_fraction=0.5)
    assert [q["path"] for q in report.quarantined] == [files[0]]
    assert "first row" in report.quarantined[0]["reason"]
    cache = datapipe.open(tmp_path / "out")
    assert [cache.classes[cache[i][1]] for i in range(2)] == ["zebra", "zebra"]


def test_csv_rows_are_decoded_by_content_whatever_their_names(tmp_path, imaging):
    root = tmp_path / "src"
    root.mkdir()
    arr = imaging.gradient(40, 52, seed=1)
    (root / "photo.dat").write_bytes(imaging.jpeg(arr))  # a JPEG without an image extension
    (root / "scan").write_bytes(imaging.encode(arr, "PNG"))  # a PNG without any extension
    (root / "list.csv").write_text("photo.dat,a\nscan,b\n", encoding="utf-8")
    report = build(root / "list.csv", tmp_path / "out")
    assert report.status == "ok" and report.num_samples == 2 and report.quarantined == []
    cache = datapipe.open(tmp_path / "out")
    for i, name in enumerate(["photo.dat", "scan"]):
        assert cache.path(i) == name
        np.testing.assert_array_equal(cache[i][0], decode_sample((root / name).read_bytes(), DecodeSpec(size=SIZE)))


def test_csv_with_boxes_is_refused_not_dropped(tmp_path, imaging):
    root = tmp_path / "src"
    root.mkdir()
    (root / "a.jpg").write_bytes(imaging.jpeg(imaging.gradient(40, 52, seed=1)))
    (root / "list.csv").write_text("path,label,xmin,ymin,xmax,ymax\na.jpg,cat,1,2,30,40\n", encoding="utf-8")
    with pytest.raises(SourceError, match=r"list.csv:1: 6 columns.*boxes, masks"):
        build(root / "list.csv", tmp_path / "out")
    assert not (tmp_path / "out").exists()
    (root / "list.csv").write_text("path,label,\na.jpg,cat,\n", encoding="utf-8")  # a trailing comma is fine
    assert build(root / "list.csv", tmp_path / "out").num_samples == 1


def test_csv_with_bad_row(tmp_path):
    (tmp_path / "list.csv").write_text("path,label\njust-a-path\n")
    with pytest.raises(SourceError, match="list.csv:2"):
        build(tmp_path / "list.csv", tmp_path / "out")


# ----------------------------------------------------------------------------- configuration and output


def test_other_config_refused_then_forced(built_copy, source):
    before = (built_copy / "manifest.json").read_bytes()
    with pytest.raises(ConfigMismatchError, match=r"size: 32 -> 40"):
        build(source[0], built_copy, size=40)
    assert (built_copy / "manifest.json").read_bytes() == before  # nothing touched
    assert len(datapipe.open(built_copy)) == len(source[1])
    with pytest.raises(ConfigMismatchError, match="fit"):
        build(source[0], built_copy, fit="pad")
    report = build(source[0], built_copy, size=40, force=True)
    assert report.status == "ok" and report.shards_built == report.shards_total
    cache = datapipe.open(built_copy)
    assert cache.manifest.size == 40
    assert cache[0][0].shape == (40, 40, 3)
    check_cache_matches_source(built_copy, source[0], source[1], DecodeSpec(size=40))
    assert cache.verify() == []


def test_default_shard_size_makes_shards_of_about_100_mb(tmp_path, imaging):
    from datapipe.builder import default_shard_size

    for size in (64, 224, 256, 512):
        assert 50e6 <= default_shard_size(size) * size * size * 3 <= 200e6, size
    root = tmp_path / "src"
    imaging.write_source(root, {"a": 3, "b": 3}, variety=False)
    report = datapipe.build(root, tmp_path / "out", size=256, scheduler="sync", progress=False, log=lambda line: None)
    assert report.config["shard_size"] == default_shard_size(256) and report.shards_total == 1


def test_missing_source(tmp_path):
    with pytest.raises(SourceError, match="does not exist") as info:
        build(tmp_path / "nope", tmp_path / "out")
    assert isinstance(info.value, FileNotFoundError)
    assert not (tmp_path / "out").exists()


def test_empty_source(tmp_path):
    (tmp_path / "src").mkdir()
    with pytest.raises(SourceError, match="no image files"):
        build(tmp_path / "src", tmp_path / "out")
    (tmp_path / "src" / "cls").mkdir()
    (tmp_path / "src" / "cls" / "readme.txt").write_text("x")
    with pytest.raises(SourceError, match="no image files.*readme.txt"):
        build(tmp_path / "src", tmp_path / "out")
    (tmp_path / "empty.csv").write_text("path,label\n")
    with pytest.raises(SourceError, match="no image files"):
        build(tmp_path / "empty.csv", tmp_path / "out")


def test_output_under_a_regular_file(source, tmp_path):
    blocker = tmp_path / "file.txt"
    blocker.write_text("keep me")
    with pytest.raises(OutputError, match="cannot create output folder"):
        build(source[0], blocker / "cache")
    with pytest.raises(OutputError):
        build(source[0], blocker)
    assert blocker.read_text() == "keep me"


def test_non_empty_foreign_output_refused(source, tmp_path):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "thesis.tex").write_text("precious")
    (out / "shards").mkdir()
    (out / "shards" / "000000.zarr").mkdir()
    with pytest.raises(OutputError, match="not empty and is not a datapipe cache"):
        build(source[0], out)
    with pytest.raises(OutputError, match="not empty and is not a datapipe cache"):
        build(source[0], out, force=True)  # force never deletes what datapipe did not write
    assert (out / "thesis.tex").read_text() == "precious"
    assert sorted(p.name for p in out.rglob("*")) == ["000000.zarr", "shards", "thesis.tex"]


def test_output_inside_the_source(tmp_path, imaging):
    root = tmp_path / "src"
    imaging.write_source(root, {"b": 2, "d": 2}, variety=False)
    first = build(root, root / "c-cache")  # sorts between the two classes
    assert datapipe.open(root / "c-cache").classes == ["b", "d"]
    manifest = (root / "c-cache" / "manifest.json").read_bytes()
    again = build(root, root / "c-cache")
    assert again.shards_built == 0 and first.num_samples == again.num_samples == 4
    assert (root / "c-cache" / "manifest.json").read_bytes() == manifest


def test_invalid_arguments(source, tmp_path):
    with pytest.raises(ValueError, match="fit"):
        build(source[0], tmp_path / "a", fit="zoom")
    with pytest.raises(ValueError, match="size"):
        build(source[0], tmp_path / "b", size=2)
    with pytest.raises(ValueError, match="shard_size"):
        build(source[0], tmp_path / "c", shard_size=-1)


# ----------------------------------------------------------------------------- damage and repair


def test_truncated_shard_detected_on_open_and_rebuilt(built_copy, built, source, imaging):
    original = imaging.tree_bytes(built[0])
    data = images_file(built_copy, 1)
    size = data.stat().st_size
    with open(data, "r+b") as f:
        f.truncate(size - 1000)
    with pytest.raises(CorruptShardError, match="000001.zarr"):
        datapipe.open(built_copy)
    report = build(source[0], built_copy)
    assert report.shards_built == 1 and report.shards_skipped == report.shards_total - 1
    assert imaging.tree_bytes(built_copy) == original  # byte for byte as before the damage
    assert datapipe.open(built_copy).verify() == []


def test_missing_shard_file_detected_and_rebuilt(built_copy, built, source, imaging):
    original = imaging.tree_bytes(built[0])
    shutil.rmtree(built_copy / "shards" / "000002.zarr")
    with pytest.raises(CorruptShardError, match="000002.zarr"):
        datapipe.open(built_copy)
    assert build(source[0], built_copy).shards_built == 1
    assert imaging.tree_bytes(built_copy) == original


def flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        value = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([value ^ 0x5A]))


def test_flipped_byte_reported_by_verify(built_copy):
    flip_byte(images_file(built_copy, 2), 100)
    cache = datapipe.open(built_copy)  # same size: open does not read samples
    problems = cache.verify()
    assert len(problems) == 1
    assert "000002.zarr" in problems[0] and "checksum" in problems[0]


def test_altered_index_files_reported_by_verify(built_copy):
    labels = np.load(built_copy / "labels.npy")
    labels[0] = (labels[0] + 1) % 3
    np.save(built_copy / "labels.npy", labels)
    problems = datapipe.open(built_copy).verify()
    assert len(problems) == 1 and "labels" in problems[0]


def test_rerun_with_verify_repairs_a_flipped_byte(built_copy, source):
    """A plain rerun trusts finished shards by size (it must not read the whole cache); --verify
    checks every checksum and rewrites the damaged shard."""
    flip_byte(images_file(built_copy, 2), 100)
    problems = datapipe.open(built_copy).verify()
    assert problems and "--verify" in problems[0]
    assert build(source[0], built_copy).shards_built == 0
    assert datapipe.open(built_copy).verify()
    report = build(source[0], built_copy, verify=True)
    assert report.shards_built == 1
    assert datapipe.open(built_copy).verify() == []


def test_unknown_manifest_version_refused(built_copy):
    path = built_copy / "manifest.json"
    m = json.loads(path.read_text(encoding="utf-8"))
    m["version"] = 999
    path.write_text(json.dumps(m, ensure_ascii=False), encoding="utf-8")
    with pytest.raises(CacheError, match="999"):
        datapipe.open(built_copy)


def test_not_a_cache(tmp_path, built_copy):
    with pytest.raises(CacheError, match="does not exist"):
        datapipe.open(tmp_path / "nothing-here")
    (built_copy / "manifest.json").unlink()
    with pytest.raises(CacheError, match="no manifest.json.*did not finish"):
        datapipe.open(built_copy)
    (built_copy / "manifest.json").write_text("{not json")
    with pytest.raises(CacheError, match="JSON"):
        datapipe.open(built_copy)


# ----------------------------------------------------------------------------- CLI


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "datapipe.cli", *args], check=False, capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PYTHONIOENCODING": "utf-8"})


def the_error_line(stderr: str) -> str:
    """The one error line of a build that logged progress before failing."""
    assert "Traceback" not in stderr, stderr
    errors = [line for line in stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and errors[0].startswith("datapipe build: error: "), stderr
    return errors[0]


def assert_one_line_error(stderr: str, command: str = "build") -> str:
    assert "Traceback" not in stderr, stderr
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, stderr
    assert lines[0].startswith(f"datapipe {command}: error: "), stderr
    return lines[0]


def test_cli_build_info_verify(source, tmp_path, capsys):
    out = tmp_path / "cache"
    args = ["build", str(source[0]), str(out), "--size", str(SIZE), "--shard-size", str(SHARD),
            "--scheduler", "sync", "--quiet"]
    assert cli_main(args) == 0
    assert len(datapipe.open(out)) == len(source[1])
    capsys.readouterr()
    assert cli_main(["info", str(out)]) == 0
    text = capsys.readouterr().out
    assert f"{len(source[1])} of shape ({SIZE}, {SIZE}, 3)" in text and "café" in text
    assert cli_main(["verify", str(out)]) == 0
    assert "OK" in capsys.readouterr().out
    assert cli_main(args) == 0  # a rerun is a no-op and still succeeds
    flip_byte(images_file(out, 0), 7)
    assert cli_main(["verify", str(out)]) == 1
    assert "000000.zarr" in capsys.readouterr().out


def test_cli_info_env(capsys):
    assert cli_main(["info", "--env"]) == 0
    env = json.loads(capsys.readouterr().out)
    assert "jpeg" in env["decoders"] and env["zarr"].startswith("3")


def test_cli_errors_in_process(source, built_copy, tmp_path, capsys):
    assert cli_main(["build", str(tmp_path / "missing"), str(tmp_path / "o"), "--scheduler", "sync"]) == 2
    line = assert_one_line_error(capsys.readouterr().err)
    assert "does not exist" in line
    args = ["build", str(source[0]), str(built_copy), "--size", "48", "--shard-size", str(SHARD),
            "--scheduler", "sync", "--quiet"]
    assert cli_main(args) == 2
    line = assert_one_line_error(capsys.readouterr().err)
    assert "another configuration" in line and "--force" in line
    m = json.loads((built_copy / "manifest.json").read_text(encoding="utf-8"))
    m["version"] = 999
    (built_copy / "manifest.json").write_text(json.dumps(m))
    assert cli_main(["info", str(built_copy)]) == 2
    assert "999" in assert_one_line_error(capsys.readouterr().err, "info")
    assert cli_main(["verify", str(built_copy)]) == 2
    assert "999" in assert_one_line_error(capsys.readouterr().err, "verify")


def test_cli_too_many_bad_files(bad_source, tmp_path, capsys):
    args = ["build", str(bad_source[0]), str(tmp_path / "o"), "--size", str(SIZE), "--scheduler", "sync",
            "--quiet", "--max-bad-fraction", "0.01"]
    assert cli_main(args) == 2
    assert "dog/" in the_error_line(capsys.readouterr().err)


@pytest.mark.parametrize("option", [["--size", "4"], ["--max-bad-fraction", "2"]], ids=["size", "fraction"])
def test_cli_invalid_values_are_one_line_errors(source, tmp_path, capsys, option):
    code = cli_main(["build", str(source[0]), str(tmp_path / "o"), "--scheduler", "sync", "--quiet", *option])
    assert code == 2
    assert_one_line_error(capsys.readouterr().err)


@pytest.mark.parametrize("fit", ["pad", "stretch"])
def test_cli_fit_pad_and_stretch(tmp_path, imaging, fit):
    """--fit reaches every sample: pad letterboxes on white, stretch fills the square."""
    root = tmp_path / "src"
    files = imaging.write_source(root, {"a": 4, "b": 3})  # landscape and portrait, JPEG and PNG
    out = tmp_path / "out"
    assert cli_main(["build", str(root), str(out), "--size", str(SIZE), "--fit", fit, "--shard-size", "4",
                     "--scheduler", "sync", "--quiet"]) == 0
    spec = DecodeSpec(size=SIZE, fit=fit)
    check_cache_matches_source(out, root, files, spec)
    cache = datapipe.open(out)
    assert cache.manifest.config["fit"] == fit
    corners = np.stack([cache[i][0][0, 0] for i in range(len(cache))])
    assert (corners == 255).all(axis=1).any() == (fit == "pad")  # white borders only when padded
    crop = decode_sample((root / cache.path(0)).read_bytes(), DecodeSpec(size=SIZE))
    assert not np.array_equal(cache[0][0], crop)  # not the default center crop


def test_cli_empty_source_max_pixels_and_force(tmp_path, source, capsys):
    (tmp_path / "empty").mkdir()
    assert cli_main(["build", str(tmp_path / "empty"), str(tmp_path / "o"), "--scheduler", "sync", "--quiet"]) == 2
    assert "no image files" in assert_one_line_error(capsys.readouterr().err)
    out = tmp_path / "cache"
    base = ["build", str(source[0]), str(out), "--size", str(SIZE), "--shard-size", str(SHARD), "--scheduler",
            "sync", "--quiet"]
    assert cli_main([*base, "--max-pixels", "1000", "--max-bad-fraction", "1"]) == 0  # every image is too large
    report = json.loads((out / "report.json").read_text(encoding="utf-8"))
    assert report["num_samples"] == 0 and {q["error"] for q in report["quarantined"]} == {"too-large"}
    assert "max_pixels=1,000" in report["quarantined"][0]["reason"]
    capsys.readouterr()
    assert cli_main(["info", str(out)]) == 0
    n = len(source[1])
    assert f"last build ok: {n} quarantined ({n} too-large)" in capsys.readouterr().out
    assert cli_main(base) == 2  # another configuration: refused ...
    assert "--force" in assert_one_line_error(capsys.readouterr().err)
    assert cli_main([*base, "--force"]) == 0  # ... unless forced
    assert len(datapipe.open(out)) == len(source[1])


def test_cli_os_error_mid_build_is_one_line_and_keeps_finished_shards(tmp_path, source, capsys, monkeypatch):
    """The disk filling up in the third shard: one line naming the file, exit 1, two shards kept."""
    import errno

    from datapipe import storage

    add, calls = storage.ShardWriter.add, []

    def add_until_full(self, image, label, path):
        calls.append(path)
        if len(calls) > 2 * SHARD:
            raise OSError(errno.ENOSPC, "No space left on device", str(storage.images_path(self.tmp_dir)))
        add(self, image, label, path)

    monkeypatch.setattr(storage.ShardWriter, "add", add_until_full)
    out = tmp_path / "out"
    args = ["build", str(source[0]), str(out), "--size", str(SIZE), "--shard-size", str(SHARD), "--scheduler",
            "sync", "--quiet"]
    assert cli_main(args) == 1
    line = the_error_line(capsys.readouterr().err)  # after the build's progress lines
    assert "No space left on device" in line and ".tmp-000002" in line and "rerun to resume" in line
    assert sorted(p.name for p in (out / "shards").iterdir()) == ["000000.zarr", "000001.zarr"]
    monkeypatch.setattr(storage.ShardWriter, "add", add)
    assert cli_main(args) == 0  # the rerun builds only what is missing
    assert json.loads((out / "report.json").read_text(encoding="utf-8"))["shards_skipped"] == 2


def test_probe_reports_the_class_and_reason(tmp_path):
    """The isolated decoder (used after a shard killed its worker) reports like the build does."""
    from dataclasses import asdict

    spec = json.dumps(asdict(DecodeSpec(size=SIZE)))
    (tmp_path / "text.jpg").write_text("no image here")
    for name, error, reason in [("missing.jpg", "unreadable", "FileNotFoundError"),
                                ("text.jpg", "not-an-image", "not an image")]:
        proc = subprocess.run([sys.executable, "-m", "datapipe.probe", str(tmp_path / name), spec],
                              capture_output=True, text=True, timeout=120, check=False)
        assert proc.returncode == 3, proc.stderr
        entry = json.loads(proc.stdout)
        assert entry["error"] == error and reason in entry["reason"], entry


def test_cli_subprocess_errors(tmp_path, source):
    proc = run_cli("build", str(tmp_path / "missing"), str(tmp_path / "out"), "--scheduler", "sync")
    assert proc.returncode == 2
    assert "does not exist" in assert_one_line_error(proc.stderr)
    blocker = tmp_path / "blocker"
    blocker.write_text("x")
    proc = run_cli("build", str(source[0]), str(blocker / "out"), "--scheduler", "sync", "--quiet")
    assert proc.returncode == 2
    assert "cannot create output folder" in assert_one_line_error(proc.stderr)
    proc = run_cli("build", str(source[0]), str(tmp_path / "x"), "--fit", "zoom")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and "zoom" in proc.stderr


# ----------------------------------------------------------------------------- the shard writer


def _write_shard(final: Path, n: int, size: int = 8) -> tuple[dict, list[np.ndarray]]:
    from datapipe.storage import ShardWriter

    rng = np.random.default_rng(n)
    images = [rng.integers(0, 256, (size, size, 3), dtype=np.uint8) for _ in range(n)]
    with ShardWriter(final, size=size) as writer:
        for i, img in enumerate(images):
            writer.add(img, i % 4, f"f{i}.jpg")
        record = writer.commit({"shard": 0})
    return record, images


@pytest.mark.parametrize("n", [0, 1, 5])
def test_shard_metadata_is_what_zarr_itself_writes(tmp_path, n):
    import zarr
    from zarr.storage import LocalStore

    final = tmp_path / "shards" / "000000.zarr"
    final.parent.mkdir()
    _write_shard(final, n)
    ref = tmp_path / "reference"
    group = zarr.create_group(store=LocalStore(str(ref)), zarr_format=3)
    group.create_array("images", shape=(n, 8, 8, 3), dtype="uint8", chunks=(1, 8, 8, 3),
                       shards=(max(n, 1), 8, 8, 3), compressors=None, fill_value=0, write_data=False)
    labels = group.create_array("labels", shape=(n,), dtype="int64", chunks=(max(n, 1),), compressors=None,
                                fill_value=-1)
    if n:
        labels[:] = np.arange(n) % 4
    for key in ("images/zarr.json", "labels/zarr.json", "labels/c/0"):
        assert (final / key).exists() == (ref / key).exists(), key
        if (ref / key).exists():
            assert (final / key).read_bytes() == (ref / key).read_bytes(), key
    ours = json.loads((final / "zarr.json").read_text())
    assert ours.pop("attributes")["datapipe"]["count"] == n
    assert ours == {k: v for k, v in json.loads((ref / "zarr.json").read_text()).items() if k != "attributes"}


def test_large_shard_is_synced_in_background_steps(tmp_path, monkeypatch):
    import datapipe.storage as storage

    started: list[int] = []  # bytes written when a background sync was started
    synced: list[int] = []
    real, start = os.fdatasync, storage.ShardWriter._sync_in_background
    monkeypatch.setattr(storage, "SYNC_EVERY_BYTES", 3 * 8 * 8 * 3)
    monkeypatch.setattr(storage.ShardWriter, "_sync_in_background", lambda w: (started.append(w._file.tell()), start(w)))
    monkeypatch.setattr(storage.os, "fdatasync", lambda fd: (synced.append(fd), real(fd)))
    final = tmp_path / "000000.zarr"
    record, images = _write_shard(final, 10)
    # Started after whole samples, mid-shard; the sync itself runs whenever its thread gets the CPU.
    assert started and all(size % (8 * 8 * 3) == 0 for size in started), started
    assert min(started) < 10 * 8 * 8 * 3 and synced
    data = (final / "images" / "c" / "0" / "0" / "0" / "0").read_bytes()
    assert data[: 10 * 192] == b"".join(img.tobytes() for img in images) and record["count"] == 10


def test_failed_background_sync_fails_the_shard_and_keeps_nothing_half_done(tmp_path, monkeypatch):
    import datapipe.storage as storage

    def broken(fd):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(storage, "SYNC_EVERY_BYTES", 192)
    monkeypatch.setattr(storage.os, "fdatasync", broken)
    final = tmp_path / "000000.zarr"
    with pytest.raises(OSError, match="Input/output error"):
        _write_shard(final, 4)
    assert not final.exists() and list(tmp_path.iterdir()) == []
