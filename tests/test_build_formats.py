"""Cache format 2 on the build side: ``--fit short`` (samples of their own aspect, the longer side cut at
``--max-aspect``) and ``--encoding jpeg``, written in the indexed layout (docs/format.md).

Every encoding × fit is built serially from one small source of non-square images (one beyond
max_aspect, one smaller than the size, an EXIF-rotated JPEG, a grayscale file); each shard is then
read back from its files alone — the sample index, the samples' bytes against ``decode_sample`` of
the source, the checksums the records give, zarr-python's view of the same bytes.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
from build_fixtures import build

import datapipe
from datapipe import samples
from datapipe.builder import default_shard_size
from datapipe.cli import main as cli_main
from datapipe.codecs import DecodeSpec, decode_rgb, decode_sample, fit_image, fit_shape
from datapipe.errors import ArgumentError, CacheError, ConfigMismatchError
from datapipe.files import crc32c
from datapipe.records import CHUNK_BYTES, indexed_file_size, read_manifest

SIZE = 32
MAX_ASPECT = 2.0
SHARD = 3
# file -> (height, width) of the pixels it holds (the EXIF-rotated one is shown transposed)
SHAPES = {
    "a/wide.png": (40, 52),
    "a/tall-at-the-cap.png": (60, 30),  # aspect exactly 2: kept whole
    "a/panorama.png": (20, 90),  # aspect 4.5: cut to 2 x SIZE
    "a/tiny.png": (16, 24),  # smaller than SIZE: scaled up
    "b/square.jpg": (32, 32),
    "b/tower.jpg": (100, 45),  # aspect 2.2: cut
    "b/rotated.jpg": (30, 44),  # stored 30x44 with EXIF orientation 6: a 44x30 sample
    "b/gray.jpg": (36, 70),
}
CAPPED = {"a/panorama.png", "b/tower.jpg"}
FITS = ("crop", "pad", "stretch", "short")
ENCODINGS = ("raw", "jpeg")


@pytest.fixture(scope="module")
def source(tmp_path_factory, imaging) -> Path:
    root = tmp_path_factory.mktemp("formats") / "images"
    for k, (rel, (h, w)) in enumerate(SHAPES.items()):
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        arr = imaging.gradient(h, w, seed=100 + k)
        if rel == "b/rotated.jpg":
            data = imaging.jpeg_with_orientation(arr, 6)
        elif rel == "b/gray.jpg":
            data = imaging.jpeg(arr[..., 0])
        elif rel.endswith(".jpg"):
            data = imaging.jpeg(arr)
        else:
            data = imaging.encode(arr, "PNG")
        path.write_bytes(data)
    return root


@pytest.fixture(scope="module")
def builds(source, tmp_path_factory) -> dict[tuple[str, str], tuple[Path, datapipe.BuildReport]]:
    """One serial build per encoding × fit."""
    out = {}
    for encoding in ENCODINGS:
        for fit in FITS:
            folder = tmp_path_factory.mktemp(f"{encoding}-{fit}") / "cache"
            out[encoding, fit] = folder, build(source, folder, size=SIZE, shard_size=SHARD, fit=fit, encoding=encoding)
    return out


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return math.inf if mse == 0 else 10 * math.log10(255.0**2 / mse)


def shard_files(out: Path, name: str) -> tuple[bytes, bytes]:
    """An indexed shard's data file and sample index, as bytes."""
    shard = out / "shards" / name
    return (shard / "images" / "c" / "0").read_bytes(), (shard / "index" / "c" / "0" / "0").read_bytes()


def old_config_hash(config: dict) -> str:
    """The configuration hash as every format-1 datapipe computed it."""
    blob = json.dumps({"format": "datapipe-cache", "version": 1, **config}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


# ----------------------------------------------------------------------------- the manifest


@pytest.mark.parametrize("encoding", ENCODINGS)
@pytest.mark.parametrize("fit", FITS)
def test_manifest_names_version_layout_encoding_and_config(builds, encoding, fit):
    out, report = builds[encoding, fit]
    m = json.loads((out / "manifest.json").read_text())
    indexed = fit == "short" or encoding == "jpeg"
    assert m["version"] == (2 if indexed else 1)
    square = fit != "short"
    assert m["sample"] == {"shape": [SIZE, SIZE, 3] if square else None, "dtype": "uint8", "encoding": encoding,
                           "layout": "indexed" if indexed else "fixed"}
    expected = {"size": SIZE, "fit": fit, "max_pixels": 100_000_000, "shard_size": SHARD, "source_kind": "folder"}
    if fit == "short":
        expected["max_aspect"] = MAX_ASPECT
    if encoding == "jpeg":
        expected.update(encoding="jpeg", quality=samples.DEFAULT_QUALITY, restart_interval=samples.RESTART_INTERVAL)
    assert m["config"] == expected == report.config
    for s in m["shards"]:
        assert ("index_crc32c" in s) == indexed
        if indexed:
            assert re.fullmatch(r"[0-9a-f]{8}", s["index_crc32c"])
    manifest = read_manifest(out)
    assert manifest.to_json() == m
    assert (manifest.version, manifest.layout, manifest.encoding) == (m["version"], m["sample"]["layout"], encoding)
    assert manifest.fixed_shape == ((SIZE, SIZE, 3) if square else None)
    assert manifest.max_side == (SIZE if square else 2 * SIZE)
    lock = json.loads((out / "build.json").read_text())
    assert lock["version"] == m["version"] and lock["config_hash"] == m["config_hash"]


def test_existing_configurations_keep_their_dict_and_hash(builds):
    """Caches of format 1 must not look like another configuration to this datapipe: the crop/pad/
    stretch raw configuration is the very dict it was, and its hash the one format 1 computed."""
    for fit in ("crop", "pad", "stretch"):
        config = datapipe.BuildSpec(size=SIZE, fit=fit, shard_size=SHARD).config("folder")
        assert config == {"size": SIZE, "fit": fit, "max_pixels": 100_000_000, "shard_size": SHARD,
                          "source_kind": "folder"}
        assert datapipe.manifest.config_hash(config) == old_config_hash(config)
        manifest = read_manifest(builds["raw", fit][0])
        assert manifest.config == config and manifest.config_hash == old_config_hash(config)
    # max_aspect is no part of a square configuration, quality no part of a raw one: another value of either
    # there is refused, naming the mode it belongs to, rather than dropped
    with pytest.raises(ArgumentError, match="--max-aspect 3 applies to --fit short only"):
        datapipe.BuildSpec(max_aspect=3.0)
    with pytest.raises(ArgumentError, match="--quality 50 applies to --encoding jpeg only"):
        datapipe.BuildSpec(quality=50)
    assert datapipe.BuildSpec(fit="short", max_aspect=3.0).config("csv")["max_aspect"] == 3.0
    assert datapipe.BuildSpec(encoding="jpeg", quality=50).config("csv")["quality"] == 50


# ----------------------------------------------------------------------------- the shards


@pytest.mark.parametrize("encoding", ENCODINGS)
@pytest.mark.parametrize("fit", FITS)
def test_shards_hold_the_samples_of_the_source(builds, source, encoding, fit):
    import zarr

    out, _ = builds[encoding, fit]
    m = json.loads((out / "manifest.json").read_text())
    paths = json.loads((out / "paths.json").read_text())
    labels = np.load(out / "labels.npy")
    assert sorted(paths) == paths == sorted(SHAPES)
    spec = DecodeSpec(size=SIZE, fit=fit, max_aspect=MAX_ASPECT)
    errors: list[np.ndarray] = []  # JPEG: decoded minus expected, every sample
    if m["version"] == 1:  # the fixed layout: test_builder covers it; here only that nothing of format 2 is there
        for s in m["shards"]:
            assert not (out / "shards" / s["name"] / "index").exists()
        return
    for s in m["shards"]:
        data, raw_index = shard_files(out, s["name"])
        assert crc32c(data) == int(s["crc32c"], 16) and crc32c(raw_index) == int(s["index_crc32c"], 16)
        index = samples.SampleIndex.parse(raw_index, count=s["count"], encoding=encoding, max_side=2 * SIZE,
                                          where=s["name"])
        total = index.data_size
        assert len(data) == s["nbytes"] == indexed_file_size(total)
        chunks = -(-total // CHUNK_BYTES)
        assert data[total:chunks * CHUNK_BYTES] == bytes(chunks * CHUNK_BYTES - total)  # zero padding
        group = zarr.open_group(str(out / "shards" / s["name"]), mode="r")
        assert group["images"].shape == (total,) and group["images"].dtype == np.uint8
        np.testing.assert_array_equal(group["index"][:], np.frombuffer(raw_index, "<i8").reshape(-1, 4))
        np.testing.assert_array_equal(group["labels"][:], labels[s["first"]:s["first"] + s["count"]])
        attrs = group.attrs.asdict()["datapipe"]
        assert attrs["index_crc32c"] == s["index_crc32c"] and attrs["crc32c"] == s["crc32c"]
        for j in range(s["count"]):
            path = paths[s["first"] + j]
            off, n, h, w = (int(v[j]) for v in (index.offsets, index.nbytes, index.heights, index.widths))
            stored = data[off:off + n]
            assert group["images"][off:off + n].tobytes() == stored, path  # zarr-python reads the same bytes
            expected = decode_sample((source / path).read_bytes(), spec)
            assert (h, w) == expected.shape[:2], path
            if fit == "short":
                assert min(h, w) == SIZE and max(h, w) <= math.floor(MAX_ASPECT * SIZE), path
            else:
                assert (h, w) == (SIZE, SIZE)
            if encoding == "raw":
                assert stored == expected.tobytes(), path
            else:
                decoded = samples.decode_jpeg(stored, h, w, where=path)
                assert psnr(decoded, expected) > 25, path
                errors.append((decoded.astype(np.float64) - expected).ravel())
    if encoding == "jpeg":
        # the cache as a whole: > 30 dB; pad's hard edges between coloured pixels and the white bars
        # bleed in 4:2:0 chroma (~28 dB at this size), so pad gets > 25 dB
        mse = float(np.mean(np.concatenate(errors) ** 2))
        assert 10 * math.log10(255.0**2 / mse) > (25 if fit == "pad" else 30)


def test_short_keeps_the_aspect_and_cuts_past_max_aspect(builds, source):
    """The sample shapes of fit short follow the source's: the shorter side is SIZE exactly, the longer
    the rounded aspect, cut to floor(max_aspect × SIZE) for the two images beyond it."""
    out, report = builds["raw", "short"]
    m = json.loads((out / "manifest.json").read_text())
    paths = json.loads((out / "paths.json").read_text())
    shapes = {}
    for s in m["shards"]:
        rows = np.frombuffer(shard_files(out, s["name"])[1], "<i8").reshape(-1, 4)
        for j, row in enumerate(rows):
            shapes[paths[s["first"] + j]] = (int(row[2]), int(row[3]))
    for path, (h, w) in SHAPES.items():
        if path == "b/rotated.jpg":
            h, w = w, h
        natural = round(max(h, w) * SIZE / min(h, w))
        long = min(natural, 2 * SIZE)
        assert shapes[path] == ((SIZE, long) if h <= w else (long, SIZE)), path
    assert report.aspect_capped == len(CAPPED) == 2
    assert "2 images cut to --max-aspect" in report.summary()
    per_shard = [json.loads((out / "shards" / s["name"] / "zarr.json").read_text())["attributes"]["datapipe"]
                 ["aspect_capped"] for s in m["shards"]]
    assert sum(per_shard) == 2
    assert json.loads((out / "report.json").read_text())["aspect_capped"] == 2
    for encoding, fit in (("raw", "crop"), ("jpeg", "pad")):
        other = builds[encoding, fit][1]
        assert other.aspect_capped == 0 and "max-aspect" not in other.summary()


@pytest.mark.parametrize(("h", "w", "max_aspect", "shape", "capped"), [
    (100, 100, 2.0, (32, 32), False), (50, 100, 2.0, (32, 64), False), (49, 100, 2.0, (32, 64), True),
    (100, 30, 2.0, (64, 32), True), (10, 15, 2.0, (32, 48), False), (1, 500, 8.0, (32, 256), True),
    (40, 52, 1.0, (32, 32), True), (100, 230, 1.15, (32, 36), True),
])
def test_fit_shape_and_fit_image_of_short(h, w, max_aspect, shape, capped, imaging):
    spec = DecodeSpec(size=32, fit="short", max_aspect=max_aspect)
    assert fit_shape(h, w, spec) == type(fit_shape(h, w, spec))(*shape, capped=capped)
    img = imaging.gradient(h, w, seed=3)
    out = fit_image(img, spec)
    assert out.shape == (*shape, 3) and out.dtype == np.uint8
    # a wrong-shaped out= is not written; a flat buffer large enough lends a view of its start
    wrong = np.zeros((32, 32, 3), np.uint8)
    if shape != (32, 32):
        assert fit_image(img, spec, wrong) is not wrong and not wrong.any()
    flat = np.zeros(32 * 256 * 3, np.uint8)
    viewed = fit_image(img, spec, flat)
    np.testing.assert_array_equal(viewed, out)
    assert np.shares_memory(viewed, flat)


def test_dct_factor_of_short_keeps_the_shorter_side(imaging):
    from datapipe.codecs import dct_factor

    spec = DecodeSpec(size=32, fit="short")
    assert dct_factor(64, 400, spec) == 2 and dct_factor(63, 400, spec) == 1 and dct_factor(400, 256, spec) == 8
    data = imaging.jpeg(imaging.gradient(130, 300, seed=1))  # decoded at 1/4: 33x75, then short side to 32
    assert decode_rgb(data, spec).shape[:2] == (33, 75)
    assert decode_sample(data, spec).shape == (32, 64, 3)


# ----------------------------------------------------------------------------- reruns and configurations


@pytest.mark.parametrize(("encoding", "fit"), [("jpeg", "short"), ("raw", "short"), ("jpeg", "crop")])
def test_rerun_is_a_noop_and_verify_keeps_whole_shards(builds, source, imaging, encoding, fit):
    out, _ = builds[encoding, fit]
    before = imaging.tree_bytes(out)
    again = build(source, out, size=SIZE, shard_size=SHARD, fit=fit, encoding=encoding)
    assert again.shards_built == 0 and again.shards_skipped == again.shards_total
    assert again.aspect_capped == (2 if fit == "short" else 0)  # counted from the kept shards' records
    verified = build(source, out, size=SIZE, shard_size=SHARD, fit=fit, encoding=encoding, verify=True)
    assert verified.shards_built == 0
    assert imaging.tree_bytes(out) == before


def test_verify_rebuilds_a_shard_whose_index_was_damaged(source, tmp_path, imaging):
    out = tmp_path / "cache"
    build(source, out, size=SIZE, shard_size=SHARD, fit="short", encoding="jpeg")
    before = imaging.tree_bytes(out)
    index = out / "shards" / "000001.zarr" / "index" / "c" / "0" / "0"
    raw = bytearray(index.read_bytes())
    raw[20] ^= 0x01  # a height, same size: only the checksum tells
    index.write_bytes(bytes(raw))
    assert build(source, out, size=SIZE, shard_size=SHARD, fit="short", encoding="jpeg").shards_built == 0
    assert build(source, out, size=SIZE, shard_size=SHARD, fit="short", encoding="jpeg", verify=True).shards_built == 1
    assert imaging.tree_bytes(out) == before


def _edit_json(path: Path, edit) -> None:
    doc = json.loads(path.read_text())
    edit(doc)
    path.write_text(json.dumps(doc, indent=1, ensure_ascii=False))


def _set_shape(doc: dict) -> None:
    doc["shape"][0] += 1


# What `datapipe verify` checks in a shard beyond its data file and sample index: each damage keeps every
# file's size (or the record's own checks), so a plain rerun sees nothing; only --verify finds it.
SHARD_DAMAGE = {
    "labels chunk values": lambda d: (d / "labels/c/0").write_bytes(
        np.full(SHARD, 7, "<i8").tobytes()),
    "labels chunk cut short": lambda d: (d / "labels/c/0").write_bytes((d / "labels/c/0").read_bytes()[:-8]),
    "labels array document": lambda d: _edit_json(d / "labels/zarr.json", lambda doc: doc.update(fill_value=3)),
    "images array document": lambda d: _edit_json(d / "images/zarr.json", _set_shape),
    "group document": lambda d: _edit_json(d / "zarr.json", lambda doc: doc.update(node_type="array")),
    "paths in the record": lambda d: _edit_json(
        d / "zarr.json", lambda doc: doc["attributes"]["datapipe"]["paths"].reverse()),
}


@pytest.mark.parametrize(("encoding", "fit"), [("raw", "crop"), ("jpeg", "short")])
@pytest.mark.parametrize("damage", sorted(SHARD_DAMAGE))
def test_build_verify_rewrites_every_shard_that_verify_finds_damaged(source, tmp_path, imaging, encoding, fit, damage):
    """`datapipe verify` says "`datapipe build ... --verify` rewrites it" of every problem in a shard; that
    build finds each of them too (not only a checksum of the data file or sample index) and rewrites the
    shard as it was, byte for byte, with zarr-python reading its labels again."""
    import zarr

    out = tmp_path / "cache"
    options = {"size": SIZE, "shard_size": SHARD, "fit": fit, "encoding": encoding}
    build(source, out, **options)
    before = imaging.tree_bytes(out)
    shard = out / "shards" / "000001.zarr"
    SHARD_DAMAGE[damage](shard)
    problems = datapipe.open(out).verify()
    assert problems and all("000001.zarr" in p for p in problems) and any("--verify" in p for p in problems), problems
    assert build(source, out, **options, verify=True).shards_built == 1
    assert imaging.tree_bytes(out) == before
    assert datapipe.open(out).verify() == []
    cache = datapipe.open(out)
    assert zarr.open_group(shard, mode="r")["labels"][:].tolist() == cache.labels[SHARD : 2 * SHARD].tolist()


def _as_another_zarr_writes(doc: dict) -> dict:
    """The same metadata as another zarr-python 3.x release writes it: optional fields null or left out, keys
    in another order (3.1.0 writes the group's ``"consolidated_metadata": null``, later releases omit it)."""
    if doc["node_type"] == "group":
        doc["consolidated_metadata"] = None
    else:
        doc.pop("storage_transformers", None)
        doc["dimension_names"] = None
    return dict(reversed(list(doc.items())))


@pytest.mark.parametrize(("encoding", "fit"), [("raw", "crop"), ("jpeg", "short")])
def test_a_shard_whose_zarr_documents_another_zarr_release_wrote_is_whole(source, tmp_path, encoding, fit):
    """A cache written under another zarr-python the package allows is whole: verify finds nothing and
    ``--verify`` rewrites nothing (each shard was reported damaged by a byte-for-byte comparison)."""
    import zarr

    out = tmp_path / "cache"
    options = {"size": SIZE, "shard_size": SHARD, "fit": fit, "encoding": encoding}
    build(source, out, **options)
    for doc in (out / "shards").glob("*.zarr/**/zarr.json"):
        edited = _as_another_zarr_writes(json.loads(doc.read_text()))
        doc.write_text(json.dumps(edited, indent=2, ensure_ascii=False))
    assert datapipe.open(out).verify() == []
    assert build(source, out, **options, verify=True).shards_built == 0
    shard = out / "shards" / "000001.zarr"
    assert zarr.open_group(shard, mode="r")["labels"][:].tolist() == datapipe.open(out).labels[SHARD : 2 * SHARD].tolist()
    SHARD_DAMAGE["labels array document"](shard)  # still a document of other meaning
    assert any("labels/zarr.json" in p for p in datapipe.open(out).verify())


@pytest.mark.parametrize(("encoding", "fit"), [("raw", "crop"), ("jpeg", "short")])
def test_a_shard_zarr_python_appended_to_names_the_files_it_added_and_what_to_do(source, tmp_path, imaging, encoding,
                                                                                   fit):
    """verify named only the changed documents and advised `build --verify`, which then refused the chunk files
    zarr wrote (verify had not named them): every file no build writes is named, with "move it out"."""
    import zarr

    out = tmp_path / "cache"
    options = {"size": SIZE, "shard_size": SHARD, "fit": fit, "encoding": encoding}
    build(source, out, **options)
    before = imaging.tree_bytes(out)
    shard = out / "shards" / "000001.zarr"
    group = zarr.open_group(shard, mode="a")
    group["labels"].append(np.array([0]))
    added = sorted(p for p in shard.rglob("*") if p.is_file() and str(p.relative_to(out)) not in before)
    assert added
    problems = datapipe.open(out).verify()
    for path in added:
        assert any(p.startswith(f"shard 000001.zarr: {path} is no file a build writes") and "move it out" in p
                   for p in problems), (path, problems)
    for path in added:  # as told: moved out, then build --verify
        path.rename(tmp_path / path.name)
    assert build(source, out, **options, verify=True).shards_built == 1
    assert imaging.tree_bytes(out) == before and datapipe.open(out).verify() == []


def test_a_shard_whose_group_zarr_python_recreated_says_to_move_it_away(source, tmp_path, imaging):
    """`zarr.open_group(shard, mode="w")` leaves a group of no datapipe record, without the data file: the readers
    said "rerun the same datapipe build", which refuses the folder as not its own; they say to move it away."""
    import zarr

    out = tmp_path / "cache"
    build(source, out, size=SIZE, shard_size=SHARD)
    before = imaging.tree_bytes(out)
    shard = out / "shards" / "000001.zarr"
    zarr.open_group(shard, mode="w")
    for attempt in (lambda: datapipe.open(out), lambda: datapipe.StreamingDataset(out, batch_size=2)):
        with pytest.raises(CacheError, match=r"000001.zarr .* is missing: .*; move the shard's folder away and rerun "
                                             r"the same `datapipe build`"):
            attempt()
    shard.rename(tmp_path / "moved")
    assert build(source, out, size=SIZE, shard_size=SHARD).shards_built == 1
    assert imaging.tree_bytes(out) == before


@pytest.mark.parametrize("change", [{"encoding": "raw"}, {"quality": 80}, {"fit": "crop"}, {"max_aspect": 3.0}])
def test_another_encoding_or_quality_is_another_configuration(source, tmp_path, change):
    out = tmp_path / "cache"
    first = {"size": SIZE, "shard_size": SHARD, "fit": "short", "encoding": "jpeg"}
    build(source, out, **first)
    with pytest.raises(ConfigMismatchError):
        build(source, out, **{**first, **change})
    report = build(source, out, **{**first, **change}, force=True)
    assert report.shards_built == report.shards_total
    m = read_manifest(out)
    assert m.config == {**report.config}
    spec = datapipe.BuildSpec(**{k: v for k, v in {**first, **change}.items()})
    assert m.config == spec.config("folder")


def test_a_local_cluster_writes_the_same_bytes(builds, source, tmp_path, imaging):
    out = tmp_path / "cache"
    report = build(source, out, size=SIZE, shard_size=SHARD, fit="short", encoding="jpeg",
                   cluster=datapipe.Cluster(workers=1))
    assert report.workers == 1 and report.aspect_capped == 2
    ours, serial = imaging.tree_bytes(out), imaging.tree_bytes(builds["jpeg", "short"][0])
    assert ours.keys() == serial.keys()
    shards = [k for k in ours if k.startswith("shards/")]
    assert shards and all(ours[k] == serial[k] for k in shards)
    assert json.loads(ours["manifest.json"])["shards"] == json.loads(serial["manifest.json"])["shards"]


# ----------------------------------------------------------------------------- options


@pytest.mark.parametrize(("fields", "option"), [
    ({"encoding": "png"}, "--encoding"), ({"encoding": None}, "--encoding"),
    ({"quality": 0}, "--quality"), ({"quality": 101}, "--quality"), ({"quality": 9.5}, "--quality"),
    ({"quality": True}, "--quality"), ({"max_aspect": 0.5}, "--max-aspect"), ({"max_aspect": 9}, "--max-aspect"),
    ({"max_aspect": float("nan")}, "--max-aspect"), ({"max_aspect": "2"}, "--max-aspect"),
    ({"fit": "shorter"}, "--fit"),
])
def test_build_spec_names_the_option_it_refuses(fields, option):
    with pytest.raises(ArgumentError, match=f"^{option} must be .*got {re.escape(repr(next(iter(fields.values()))))}$"):
        datapipe.BuildSpec(**fields)


def test_default_shard_size_of_jpeg_counts_an_eighth_of_the_raw_bytes():
    assert default_shard_size(256) == 100 * 2**20 // (256 * 256 * 3) == 533
    assert default_shard_size(256, "jpeg") == 4096  # ~4266 at 24 KiB a sample, capped
    assert default_shard_size(512, "jpeg") == 100 * 2**20 // (512 * 512 * 3 // 8) == 1066
    assert datapipe.BuildSpec(size=512, encoding="jpeg").samples_per_shard == 1066


def test_cli_build_takes_the_format_options(source, tmp_path, capsys):
    out = tmp_path / "cache"
    assert cli_main(["build", str(source), str(out), "--size", str(SIZE), "--fit", "short", "--max-aspect", "1.5",
                     "--encoding", "jpeg", "--quality", "75", "--shard-size", "4", "--scheduler", "sync", "--quiet"]) == 0
    m = json.loads((out / "manifest.json").read_text())
    assert m["version"] == 2
    assert {k: m["config"][k] for k in ("fit", "max_aspect", "encoding", "quality")} == {
        "fit": "short", "max_aspect": 1.5, "encoding": "jpeg", "quality": 75}
    assert "cut to --max-aspect" in capsys.readouterr().err
    assert cli_main(["build", str(source), str(tmp_path / "x"), "--quality", "0", "--encoding", "jpeg"]) == 2
    assert "--quality must be an integer from 1 to 100, got 0" in capsys.readouterr().err
    assert cli_main(["build", str(source), str(tmp_path / "x"), "--fit", "short", "--max-aspect", "10"]) == 2
    assert "--max-aspect must be a number from 1 to 8" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli_main(["build", "--help"])
    text = capsys.readouterr().out
    assert all(flag in text for flag in ("--encoding", "--quality", "--max-aspect", "short"))


# ----------------------------------------------------------------------------- the manifest's checks


def _rewrite(out: Path, edit) -> Path:
    path = out / "manifest.json"
    doc = json.loads(path.read_text())
    edit(doc)
    path.write_text(json.dumps(doc))
    return path


@pytest.mark.parametrize(("edit", "field"), [
    (lambda m: m.update(version=3), "'version' is 3"),
    (lambda m: m.update(version=1), "'version' is 1, expected 2"),
    (lambda m: m.update(version="2"), "'version' is a string"),
    (lambda m: m["sample"].update(shape=[SIZE, SIZE, 3]), "'sample.shape'"),
    (lambda m: m["sample"].update(encoding="raw"), "'sample.encoding'"),
    (lambda m: m["sample"].update(layout="fixed"), "'sample.layout'"),
    (lambda m: m["sample"].pop("layout"), "'sample.layout' is missing"),
    (lambda m: m["shards"][0].pop("index_crc32c"), "'shards[0].index_crc32c' is missing"),
    (lambda m: m["shards"][0].update(index_crc32c="xyz"), "'shards[0].index_crc32c'"),
    (lambda m: m["shards"][0].update(nbytes=m["shards"][0]["nbytes"] + 1), "'shards[0].nbytes'"),
    (lambda m: m["shards"][0].update(nbytes=0), "'shards[0].nbytes'"),
])
def test_a_damaged_version_2_manifest_is_one_line_naming_the_field(builds, tmp_path, edit, field):
    import shutil

    out = tmp_path / "cache"
    shutil.copytree(builds["jpeg", "short"][0], out)
    path = _rewrite(out, edit)
    with pytest.raises(CacheError) as info:
        read_manifest(out)
    message = str(info.value)
    assert "\n" not in message and str(path) in message and field in message, message


def test_version_1_manifests_of_earlier_datapipes_still_read(builds, tmp_path):
    """A format-1 manifest as earlier datapipes wrote it: its layout in words, no encoding."""
    import shutil

    out = tmp_path / "cache"
    shutil.copytree(builds["raw", "crop"][0], out)
    old = "zarr-v3-sharded, chunk = one sample, uncompressed (memory-mappable)"
    _rewrite(out, lambda m: m.update(sample={"shape": [SIZE, SIZE, 3], "dtype": "uint8", "layout": old}))
    m = read_manifest(out)
    assert (m.version, m.layout, m.encoding, m.fixed_shape) == (1, "fixed", "raw", (SIZE, SIZE, 3))
    _rewrite(out, lambda m: m["sample"].update(encoding="jpeg"))
    with pytest.raises(CacheError, match="'sample.encoding'"):
        read_manifest(out)
