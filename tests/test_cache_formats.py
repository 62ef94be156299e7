"""Reading caches of both layouts: fixed (format 1, square raw samples) and indexed (format 2: samples
of their own shape with --fit short, or JPEG-encoded), for every encoding and fit.

Every read path (``cache[i]``, read_batch, read_samples, sample_views mapped and copied, read_encoded,
positioned reads) gives the stored sample: byte-exact against the build's own decode for raw, close to
it and exactly what zarr-python's bytes decode to for JPEG. A damaged sample, a damaged or truncated
sample index, an index whose checksum differs from the manifest's, and a data file truncated under a
reader are errors naming the shard (and the sample), never a crash or wrong pixels.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

import datapipe
from datapipe import augment, cli, samples
from datapipe.codecs import DecodeSpec, decode_sample
from datapipe.errors import ArgumentError, CorruptShardError

SIZE, SHARD = 64, 5  # 64: at 32 pixels, 4:2:0 on the pad fit's hard edges costs the PSNR most of its margin
ENCODINGS = ("raw", "jpeg")
FITS = ("crop", "pad", "stretch", "short")


@pytest.fixture(scope="module")
def source(tmp_path_factory, imaging) -> Path:
    """Mixed kinds and shapes, plus a very wide and a very tall image (their longer side is capped)."""
    root = tmp_path_factory.mktemp("formats") / "src"
    imaging.write_source(root, {"ant": 6, "bee": 5}, seed=3)
    (root / "ant" / "wide.png").write_bytes(imaging.encode(imaging.gradient(20, 90, seed=5), "PNG"))
    (root / "bee" / "tall.jpg").write_bytes(imaging.jpeg(imaging.gradient(100, 30, seed=6)))
    return root


@pytest.fixture(scope="module")
def builds(source, tmp_path_factory) -> dict[tuple[str, str], Path]:
    """One serial build per (encoding, fit), made on first use."""
    made: dict[tuple[str, str], Path] = {}
    base = tmp_path_factory.mktemp("builds")

    class Builds(dict):
        def __missing__(self, key: tuple[str, str]) -> Path:
            encoding, fit = key
            out = base / f"{encoding}-{fit}"
            datapipe.build(source, out, size=SIZE, shard_size=SHARD, fit=fit, encoding=encoding,
                           cluster=datapipe.Cluster(scheduler="sync"), progress=False)
            self[key] = out
            return out

    return Builds(made)


def reference(cache: datapipe.Cache, source: Path, i: int, fit: str) -> np.ndarray:
    """Sample i as the build decodes its source file (before any encoding)."""
    data = (source / cache.path(i)).read_bytes()
    return decode_sample(data, DecodeSpec(size=SIZE, fit=fit))  # type: ignore[arg-type]


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return 99.0 if mse == 0 else 10 * np.log10(255.0**2 / mse)


def zarr_bytes(cache: datapipe.Cache, i: int) -> bytes:
    """Sample i's stored bytes as zarr-python reads them from the shard group."""
    import zarr

    s = int(np.searchsorted(cache.starts, i, side="right") - 1)
    group = zarr.open_group(cache.root / "shards" / cache.shard_names[s], mode="r")
    off, n, _, _ = (int(v) for v in group["index"][i - int(cache.starts[s])])
    return bytes(group["images"][off : off + n])


def shard_file(cache_dir: Path, shard: int, *parts: str) -> Path:
    return cache_dir / "shards" / f"{shard:06d}.zarr" / Path(*parts)


def data_file(cache_dir: Path, shard: int) -> Path:
    return shard_file(cache_dir, shard, "images", "c", "0")


def index_file(cache_dir: Path, shard: int) -> Path:
    return shard_file(cache_dir, shard, "index", "c", "0", "0")


def index_rows(cache_dir: Path, shard: int) -> np.ndarray:
    return np.frombuffer(index_file(cache_dir, shard).read_bytes(), "<i8").reshape(-1, 4).copy()


def set_manifest_index_crc(cache_dir: Path, shard: int, raw: bytes) -> None:
    """Make the manifest agree with an index file written after the build (to reach the row checks)."""
    import google_crc32c

    path = cache_dir / "manifest.json"
    doc = json.loads(path.read_text())
    doc["shards"][shard]["index_crc32c"] = f"{google_crc32c.value(raw):08x}"
    path.write_text(json.dumps(doc))


# ----------------------------------------------------------------------------- every encoding x fit


@pytest.mark.parametrize("encoding", ENCODINGS)
@pytest.mark.parametrize("fit", FITS)
def test_samples_are_the_stored_samples(builds, source, encoding, fit):
    cache = datapipe.open(builds[encoding, fit])
    square = fit != "short"
    assert cache.encoding == encoding
    assert cache.layout == ("fixed" if square and encoding == "raw" else "indexed")
    assert cache.manifest.version == (1 if cache.layout == "fixed" else 2)
    assert cache.fixed_shape == ((SIZE, SIZE, 3) if square else None)
    assert cache.shapes.shape == (len(cache), 2) and cache.shapes.dtype == np.int64
    classes = {name: k for k, name in enumerate(cache.classes)}
    errors = []  # JPEG: the squared error of every pixel
    for i in range(len(cache)):
        img, label = cache[i]
        ref = reference(cache, source, i, fit)
        assert img.dtype == np.uint8 and img.shape == ref.shape
        assert tuple(cache.shapes[i]) == img.shape[:2]
        assert label == classes[cache.path(i).split("/")[0]]
        if encoding == "raw":
            np.testing.assert_array_equal(img, ref)
        else:
            assert psnr(img, ref) > 24, (i, psnr(img, ref))  # 32-pixel noisy samples, hard pad edges: 4:2:0 costs most here
            errors.append(((img.astype(np.float64) - ref) ** 2).ravel())
            h, w = img.shape[:2]
            np.testing.assert_array_equal(img, samples.decode_jpeg(zarr_bytes(cache, i), h, w, where="zarr"))
        if cache.layout == "indexed" and encoding == "raw":
            assert zarr_bytes(cache, i) == img.tobytes()
    if errors:
        assert 10 * np.log10(255.0**2 / np.concatenate(errors).mean()) > 30  # the whole cache's PSNR
    if not square:
        assert cache.shapes.min(axis=1).tolist() == [SIZE] * len(cache)
        assert cache.shapes.max() == 2 * SIZE  # the wide and tall images were capped at max_aspect * size
        assert len({tuple(s) for s in cache.shapes.tolist()}) > 2


@pytest.mark.parametrize(("encoding", "fit"), [("raw", "short"), ("jpeg", "short"), ("jpeg", "crop"), ("raw", "crop")])
@pytest.mark.parametrize("mapped", [True, False], ids=["mapped", "pread"])
def test_read_paths_agree(builds, encoding, fit, mapped):
    cache = datapipe.open(builds[encoding, fit])
    if not mapped:
        cache.mapped = False  # positioned reads from the start
    expected = [cache[i][0] for i in range(len(cache))]
    picks = np.array([7, 3, 4, 12, 0, 5, 6, 11, 1])  # unsorted, runs of consecutive samples, across shards
    order = np.sort(picks)
    labels, index = np.empty(len(picks), np.int64), np.empty(len(picks), np.int64)

    got = cache.read_samples(picks, labels, index)
    assert index.tolist() == order.tolist()
    assert labels.tolist() == cache.labels[order].tolist()
    for k, i in enumerate(order.tolist()):
        np.testing.assert_array_equal(got[k], expected[i])

    for view_mapped in (True, False):
        labels[:] = -1
        views = cache.sample_views(picks, labels, index, mapped=view_mapped)
        assert labels.tolist() == cache.labels[order].tolist()
        with cache.mapped_reads(picks):
            for k, i in enumerate(order.tolist()):
                np.testing.assert_array_equal(views[k].clone().numpy(), expected[i])

    out = np.zeros((len(picks) + 2, SIZE, SIZE, 3), np.uint8)
    if cache.fixed_shape is not None:
        assert cache.read_batch(picks, out, labels, index) == len(picks)
        np.testing.assert_array_equal(out[: len(picks)], np.stack([expected[i] for i in order]))
        strided = np.zeros((len(picks), SIZE, SIZE, 6), np.uint8)[..., ::2]  # not contiguous
        cache.read_batch(picks, strided, labels)
        np.testing.assert_array_equal(strided, out[: len(picks)])
    else:
        with pytest.raises(ArgumentError, match="vary in shape.*read_samples"):
            cache.read_batch(picks, out, labels)
        with pytest.raises(ArgumentError, match="vary in shape"):
            _ = cache.shape

    if encoding == "jpeg":
        encoded = cache.read_encoded(picks, labels, index)
        assert index.tolist() == order.tolist()
        for k, i in enumerate(order.tolist()):
            e = encoded[k]
            assert (e.height, e.width) == tuple(cache.shapes[i])
            assert e.data.tobytes() == zarr_bytes(cache, i)
            assert f"sample {i}" in e.where and "000" in e.where
            np.testing.assert_array_equal(samples.decode_jpeg(e.data, e.height, e.width, where=e.where), expected[i])
            crop, box = samples.decode_crop(e.data, e.height, e.width, (0, 0, e.height, e.width), 8, where=e.where)
            assert box[2] <= crop.shape[0] and box[3] <= crop.shape[1]
        assert int(cache.sample_nbytes[order].sum()) == sum(e.data.size for e in encoded)
    else:
        with pytest.raises(ArgumentError, match="raw pixels"):
            cache.read_encoded(picks, labels)
    assert cache.read_samples(np.array([], np.int64), labels) == []
    with pytest.raises(IndexError):
        cache.read_samples(np.array([len(cache)]), labels)


def test_mapped_views_of_varying_shapes_share_the_map(builds):
    cache = datapipe.open(builds["raw", "short"])
    if not cache.mapped:
        pytest.skip("the guarded kernel is not built")
    labels = np.empty(3, np.int64)
    views = cache.sample_views(np.array([0, 1, 2]), labels, mapped=True)
    assert [tuple(v.shape[:2]) for v in views] == [tuple(s) for s in cache.shapes[:3].tolist()]
    base = views[0].data_ptr()
    assert views[1].data_ptr() - base == cache.shapes[0].prod() * 3  # back to back in one map: no copies


@pytest.mark.parametrize("encoding", ENCODINGS)
def test_pickled_cache_reads_the_same(builds, encoding):
    cache = datapipe.open(builds[encoding, "short"])
    first = [cache[i][0] for i in range(4)]
    again = pickle.loads(pickle.dumps(cache))
    assert len(pickle.dumps(cache)) < 16384  # the sample indexes do not travel
    for i in range(4):
        np.testing.assert_array_equal(again[i][0], first[i])
    np.testing.assert_array_equal(again.shapes, cache.shapes)


def test_verify_and_info_of_an_indexed_cache(builds, capsys):
    for key in (("jpeg", "short"), ("raw", "short"), ("jpeg", "crop"), ("raw", "crop")):
        cache = datapipe.open(builds[key])
        assert cache.verify() == []
        assert cli.main(["info", str(cache.root)]) == 0
        out = capsys.readouterr().out
        encoding, fit = key
        assert f"encoding   {encoding}" in out
        assert ("quality 90" in out) == (encoding == "jpeg") == ("a restart marker after every MCU" in out)
        assert f"layout     {cache.layout}" in out
        if fit == "short":
            (lo_h, lo_w), (hi_h, hi_w) = cache.shape_range
            assert f"height {lo_h} to {hi_h}, width {lo_w} to {hi_w}" in out and "aspect kept" in out
        else:
            assert f"of shape ({SIZE}, {SIZE}, 3)" in out
        mean = cache.sample_nbytes.mean()
        assert f"{mean:,.0f} bytes/sample" in out


# ----------------------------------------------------------------------------- damage


@pytest.mark.parametrize("fit", ["short", "crop"])
def test_a_batch_of_stored_jpeg_samples_is_a_sequence_of_them_and_decodes_the_same(builds, fit):
    """read_encoded gives an EncodedBatch: one buffer and its arrays (what the compiled decoder takes), and a
    sequence of EncodedSample made on access (indexing, negative indices, slices, iteration), each naming its
    shard file and sample; train.decode gives the same batch from it as from a list of its samples."""
    from datapipe.cache import EncodedBatch, EncodedSample

    cache = datapipe.open(builds["jpeg", fit])
    picks = np.array([9, 0, 4, 4, 7, 2], np.int64)
    labels, index = np.empty(len(picks), np.int64), np.empty(len(picks), np.int64)
    batch = cache.read_encoded(picks, labels, index)
    assert isinstance(batch, EncodedBatch) and len(batch) == len(picks)
    listed = list(batch)
    assert all(isinstance(e, EncodedSample) for e in listed) and len(listed) == len(picks)
    for k, i in enumerate(index.tolist()):
        e = batch[k]
        assert (e.height, e.width) == tuple(cache.shapes[i]) and e.where == batch.where(k)
        assert e.where.endswith(f"sample {i}") and e.data.tobytes() == listed[k].data.tobytes()
    assert batch[-1].where == listed[-1].where
    with pytest.raises(IndexError):
        _ = batch[len(picks)]
    part = batch[1:5:2]
    assert isinstance(part, EncodedBatch) and [e.where for e in part] == [listed[1].where, listed[3].where]
    assert [e.data.tobytes() for e in part] == [listed[1].data.tobytes(), listed[3].data.tobytes()]
    train = augment.train(24)
    assert torch.equal(train.decode(batch, seed=4), train.decode(listed, seed=4))
    assert torch.equal(train.decode(part, seed=4), train.decode(list(part), seed=4))
    empty = cache.read_encoded(np.array([], np.int64), labels)
    assert len(empty) == 0 and list(empty) == [] and train.decode(empty).shape == (0, 3, 24, 24)


@pytest.fixture
def jpeg_copy(builds, tmp_path) -> Path:
    return Path(shutil.copytree(builds["jpeg", "short"], tmp_path / "cache"))


def test_a_damaged_sample_is_found_by_verify_and_named_by_the_reader(jpeg_copy):
    cache = datapipe.open(jpeg_copy)
    i = int(cache.starts[1]) + 2  # shard 1, its third sample
    off, n, _, _ = index_rows(jpeg_copy, 1)[2]
    path = data_file(jpeg_copy, 1)
    with open(path, "r+b") as f:  # its JPEG header is gone: no decoder reads it (the file keeps its size)
        f.seek(int(off))
        f.write(bytes(16))
    problems = datapipe.open(jpeg_copy).verify()
    assert len(problems) == 1 and "000001.zarr" in problems[0] and "checksum" in problems[0]
    fresh = datapipe.open(jpeg_copy)  # the manifest's checksums are not read on each sample
    labels = np.empty(1, np.int64)
    for read in (lambda: fresh[i], lambda: fresh.read_samples(np.array([i]), labels),
                 lambda: fresh.sample_views(np.array([i]), labels)):
        with pytest.raises(CorruptShardError, match=rf"000001\.zarr.*sample {i}\b.*does not decode.*datapipe build"):
            read()
    e = fresh.read_encoded(np.array([i]), labels)[0]
    with pytest.raises(CorruptShardError, match=rf"sample {i}\b"):
        samples.decode_crop(e.data, e.height, e.width, (0, 0, e.height, e.width), 8, where=e.where)
    assert fresh[i - 1][0].shape[:2] == tuple(fresh.shapes[i - 1])  # its neighbours read


def test_a_sample_whose_header_disagrees_with_the_index_is_named(jpeg_copy):
    rows = index_rows(jpeg_copy, 0)
    rows[1, 2], rows[1, 3] = rows[1, 3], rows[1, 2]  # height and width swapped: still a valid index
    raw = rows.astype("<i8").tobytes()
    index_file(jpeg_copy, 0).write_bytes(raw)
    with pytest.raises(CorruptShardError, match=r"000000\.zarr.*sample index checksum .* differs from the manifest"):
        datapipe.open(jpeg_copy)[1]
    set_manifest_index_crc(jpeg_copy, 0, raw)
    cache = datapipe.open(jpeg_copy)
    if rows[1, 2] == rows[1, 3]:
        pytest.skip("sample 1 is square")
    with pytest.raises(CorruptShardError, match=r"000000\.zarr.*sample 1\b.*header says"):
        cache[1]


@pytest.mark.parametrize("damage", ["truncated", "longer", "missing", "folder", "bad crc"])
def test_a_damaged_sample_index_is_named(jpeg_copy, damage):
    path = index_file(jpeg_copy, 1)
    raw = path.read_bytes()
    if damage == "truncated":
        path.write_bytes(raw[:-8])
    elif damage == "longer":
        path.write_bytes(raw + bytes(32))
    elif damage == "missing":
        path.unlink()
    elif damage == "folder":
        path.unlink()
        path.mkdir()
    else:
        path.write_bytes(raw[:-1] + bytes([raw[-1] ^ 1]))
    cache = datapipe.open(jpeg_copy)  # opening reads no index
    first = int(cache.starts[1])
    np.testing.assert_array_equal(cache[0][0], datapipe.open(jpeg_copy)[0][0])  # other shards read
    message = r"shard 000001\.zarr \(.*index.*\).*sample index.*datapipe build"
    with pytest.raises(CorruptShardError, match=message):
        cache[first]
    with pytest.raises(CorruptShardError, match=message):
        _ = cache.shapes
    problems = cache.verify()
    assert any("000001.zarr" in p and "sample index" in p for p in problems), problems


@pytest.mark.parametrize(("row", "column", "value", "message"), [
    (2, 0, 7, r"puts sample 2 at byte 7"),
    (2, 2, 0, r"gives sample 2 the shape 0x"),
    (2, 3, 4 * SIZE, rf"gives sample 2 the shape .*outside 1\.\.{2 * SIZE}"),
    (2, 1, 0, r"gives sample 2 0 bytes"),
    (-1, 1, 1 << 17, r"covers .* bytes of samples, which do not fill"),  # past the data file's end
])
def test_an_impossible_index_with_a_matching_checksum_is_refused(jpeg_copy, row, column, value, message):
    rows = index_rows(jpeg_copy, 1)
    rows[row, column] = value
    raw = rows.astype("<i8").tobytes()
    index_file(jpeg_copy, 1).write_bytes(raw)
    set_manifest_index_crc(jpeg_copy, 1, raw)
    cache = datapipe.open(jpeg_copy)
    with pytest.raises(CorruptShardError, match=r"000001\.zarr.*" + message):
        cache[int(cache.starts[1])]


def test_an_index_of_the_wrong_shapes_for_the_cache_is_refused(builds, tmp_path):
    """An index whose samples all parse but are not of the cache's fit (square samples, or the size's shorter side)."""
    out = Path(shutil.copytree(builds["jpeg", "crop"], tmp_path / "cache"))
    rows = index_rows(out, 0)
    rows[0, 2] = SIZE - 1
    raw = rows.astype("<i8").tobytes()
    index_file(out, 0).write_bytes(raw)
    set_manifest_index_crc(out, 0, raw)
    with pytest.raises(CorruptShardError, match=rf"000000\.zarr.*sample 0 the shape {SIZE - 1}x{SIZE}.*{SIZE}x{SIZE}"):
        datapipe.open(out)[0]


@pytest.mark.parametrize("encoding", ENCODINGS)
@pytest.mark.parametrize("mapped", [True, False], ids=["mapped", "pread"])
def test_a_data_file_truncated_under_a_reader_is_named(builds, tmp_path, encoding, mapped):
    out = Path(shutil.copytree(builds[encoding, "short"], tmp_path / "cache"))
    cache = datapipe.open(out)
    if not mapped:
        cache.mapped = False
    labels = np.empty(len(cache), np.int64)
    last = int(cache.starts[1] + cache.counts[1] - 1)
    cache.read_samples(np.arange(len(cache)), labels)  # every shard opened (and mapped)
    os.truncate(data_file(out, 1), 100)
    reads = [lambda: cache[last], lambda: cache.read_samples(np.array([last]), labels)]
    if encoding == "jpeg":
        reads.append(lambda: cache.read_encoded(np.array([last]), labels))
    else:
        reads.append(lambda: cache.sample_views(np.array([last]), labels))
    for read in reads:
        with pytest.raises(CorruptShardError, match=r"000001\.zarr"):
            read()
    with pytest.raises(CorruptShardError, match=r"000001\.zarr.*100 bytes"):
        datapipe.open(out)


def test_a_fixed_cache_reads_as_before(builds):
    """Format 1: every path gives the same bytes, shapes are all square, and nothing reads an index."""
    cache = datapipe.open(builds["raw", "crop"])
    assert cache.layout == "fixed" and not cache.indexed and cache.shape == (SIZE, SIZE, 3)
    assert not any((cache.root / "shards" / n / "index").exists() for n in cache.shard_names)
    n = len(cache)
    out, labels = np.empty((n, SIZE, SIZE, 3), np.uint8), np.empty(n, np.int64)
    cache.read_batch(np.arange(n), out, labels)
    got = cache.read_samples(np.arange(n), labels)
    np.testing.assert_array_equal(np.stack(got), out)
    np.testing.assert_array_equal(np.stack([cache[i][0] for i in range(n)]), out)
    assert cache.shapes.tolist() == [[SIZE, SIZE]] * n
    assert cache.sample_nbytes.tolist() == [SIZE * SIZE * 3] * n
    assert cache.verify() == []
