"""`datapipe.build` and the cache it writes: contents, quarantine, budget, resume, repair.

Every build here uses ``scheduler="sync"`` (serial, in-process) and tiny samples, so the whole file
runs in seconds; the Dask paths are covered by test_build_distributed.py. The sources and builds these
tests share with test_sources, test_output and test_build_cli are fixtures in conftest.py.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import math
import re
import shutil

import numpy as np
import pytest
from build_fixtures import (
    BAD_KINDS,
    BAD_REASONS,
    COUNTS,
    SHARD,
    SIZE,
    build,
    check_cache_matches_source,
    flip_byte,
    images_file,
)

import datapipe
from datapipe import manifest as mf
from datapipe.builder import default_shard_size
from datapipe.codecs import DecodeSpec
from datapipe.errors import (
    QUARANTINE_KINDS,
    ArgumentError,
    CacheError,
    CorruptShardError,
    TooManyBadFilesError,
)

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
    assert report.ignored == 4  # dog/notes.txt, README.md, and the hidden zebra/.hidden.jpg and .git/
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


@pytest.mark.parametrize("name", ["labels.npy", "paths.json", "manifest.json"])
def test_a_rerun_that_rewrites_an_index_file_keeps_the_report_of_the_build_that_did_the_work(built_copy, source, name):
    """It used to replace report.json with its own: 0 workers, 0 img/s, the build's figures lost."""
    report = (built_copy / "report.json").read_bytes()
    original = (built_copy / name).read_bytes()
    (built_copy / name).unlink()
    again = build(source[0], built_copy)
    assert again.shards_built == 0
    assert (built_copy / name).read_bytes() == original
    assert (built_copy / "report.json").read_bytes() == report
    assert json.loads(report)["workers"] >= 1


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


# ----------------------------------------------------------------------------- the typed build API


@pytest.mark.parametrize(("fields", "option"), [
    ({"size": 4}, "--size"), ({"size": 100_000}, "--size"), ({"size": 32.0}, "--size"), ({"size": "32"}, "--size"),
    ({"fit": "zoom"}, "--fit"), ({"max_pixels": 0}, "--max-pixels"), ({"max_pixels": 1.5}, "--max-pixels"),
    ({"shard_size": 0}, "--shard-size"), ({"shard_size": -1}, "--shard-size"), ({"shard_size": 2.5}, "--shard-size"),
])
def test_build_spec_names_the_option_it_refuses(fields, option):
    with pytest.raises(ArgumentError, match=f"^{option} must be .*got {re.escape(repr(next(iter(fields.values()))))}$"):
        datapipe.BuildSpec(**fields)


@pytest.mark.parametrize(("fields", "option"), [
    ({"workers": 0}, "--workers"), ({"workers": -2}, "--workers"), ({"workers": 2.0}, "--workers"),
    ({"scheduler": ""}, "--scheduler"), ({"scheduler": 8786}, "--scheduler"),
])
def test_cluster_names_the_option_it_refuses(fields, option):
    with pytest.raises(ArgumentError, match=f"^{option} must be "):
        datapipe.Cluster(**fields)


def test_build_spec_config_is_the_hashed_configuration(built):
    """The configuration a spec writes is the one caches already carry (their hash must not change):
    the decoding fields, the shard size resolved, the source's kind."""
    spec = datapipe.BuildSpec(size=SIZE, shard_size=SHARD)
    assert spec.config("folder") == {"size": SIZE, "fit": "crop", "max_pixels": 100_000_000, "shard_size": SHARD,
                                     "source_kind": "folder"}
    manifest = datapipe.open(built[0]).manifest
    assert spec.config("folder") == manifest.config and mf.config_hash(spec.config("folder")) == manifest.config_hash
    assert datapipe.BuildSpec(size=64).config("csv")["shard_size"] == default_shard_size(64)
    assert datapipe.BuildSpec(size=64).config("csv") == datapipe.BuildSpec(size=64, shard_size=default_shard_size(64)).config("csv")
    assert datapipe.BuildSpec(size=40, fit="pad", max_pixels=5).decode == DecodeSpec(size=40, fit="pad", max_pixels=5)
    assert type(datapipe.BuildSpec().decode) is DecodeSpec  # what the workers and the probe process get


def test_build_takes_a_spec_or_its_fields_as_keywords_not_both(source, tmp_path):
    by_spec = build(source[0], tmp_path / "a", datapipe.BuildSpec(size=SIZE, fit="pad", shard_size=SHARD))
    by_keywords = build(source[0], tmp_path / "b", size=SIZE, fit="pad", shard_size=SHARD)
    assert by_spec.config == by_keywords.config
    assert datapipe.open(tmp_path / "a").manifest.config_hash == datapipe.open(tmp_path / "b").manifest.config_hash
    with pytest.raises(ArgumentError, match="size given both"):
        datapipe.build(source[0], tmp_path / "c", datapipe.BuildSpec(size=SIZE), size=SIZE)
    with pytest.raises(ArgumentError, match="spec must be a datapipe.BuildSpec"):
        datapipe.build(source[0], tmp_path / "c", DecodeSpec(size=SIZE))  # type: ignore[arg-type]
    with pytest.raises(ArgumentError, match="cluster must be a datapipe.Cluster"):
        datapipe.build(source[0], tmp_path / "c", cluster="sync")  # type: ignore[arg-type]
    assert not (tmp_path / "c").exists()  # refused before anything is written


def test_every_spec_field_is_a_keyword_of_build():
    """build()'s keyword shorthand must follow the spec when a field is added."""
    keywords = inspect.signature(datapipe.build).parameters
    for field in dataclasses.fields(datapipe.BuildSpec):
        assert field.name in keywords and keywords[field.name].kind is inspect.Parameter.KEYWORD_ONLY
        assert keywords[field.name].default is None  # None: the spec's own default


def test_wrong_types_of_source_and_budget_are_argument_errors(tmp_path):
    from datapipe.errors import ArgumentError

    with pytest.raises(ArgumentError, match="max_bad_fraction must be a number"):
        datapipe.build(tmp_path, tmp_path / "out", max_bad_fraction="0.1")
    with pytest.raises(ArgumentError, match="source must be a path or a URL, got None"):
        datapipe.build(None, tmp_path / "out")


def test_a_script_building_with_a_local_cluster_without_the_main_guard_gets_one_line(tmp_path, imaging):
    import subprocess
    import sys

    src = tmp_path / "src"
    imaging.write_source(src, {"a": 2, "b": 2}, variety=False)
    call = f"datapipe.build({str(src)!r}, {str(tmp_path / 'out')!r}, size=32, cluster=datapipe.Cluster(workers=1), progress=False)"
    (tmp_path / "bad.py").write_text(f"import datapipe\n{call}\n")
    proc = subprocess.run([sys.executable, str(tmp_path / "bad.py")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1].startswith("datapipe.errors.ArgumentError: a script that calls "
                                                           "datapipe.build() with a LocalCluster must call it under")
    assert "Nanny" not in proc.stderr and not (tmp_path / "out").exists()


def test_the_sample_refuses_fewer_images_than_classes(tmp_path):
    from datapipe.bench.sample import make_sample_dataset as make_sample
    from datapipe.errors import ArgumentError

    with pytest.raises(ArgumentError, match=r"--images \(3\) must be at least --classes \(10\)"):
        make_sample(tmp_path / "s", images=3, classes=10)
