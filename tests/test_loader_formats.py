"""The loader over caches of every encoding and fit: raw and JPEG samples, square (``crop``) and of
their own aspect (``short``, samples of varying shapes).

On the CPU the train and eval presets crop each sample over its own extent (JPEG samples decoded per
crop in the reader threads); every sample arrives exactly once per epoch across ranks, batches are
deterministic in the seed and resume exactly; a damaged JPEG sample is an error naming its shard file
and the sample; a cache of varying shapes is a list of tensors on its own and refuses a loader that
cannot crop it to one size.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import datapipe
from datapipe import augment
from datapipe.errors import ArgumentError, CorruptShardError
from datapipe.testing import to_uint8

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")

SIZE, SHARD, N, B = 48, 16, 41, 6  # 41: odd, so the two ranks' shares and the last batch are uneven
OUT = 32  # the presets' output side
# (width, height) of the source images, cycled: 4:3, 3:4, 2:1, 1:1
ASPECTS = ((96, 72), (72, 96), (128, 64), (80, 80))
FORMATS = [(e, f) for e in ("raw", "jpeg") for f in ("crop", "short")]
FORMAT_IDS = [f"{e}-{f}" for e, f in FORMATS]


def _build(src: Path, out: Path, encoding: str, fit: str) -> Path:
    datapipe.build(src, out, size=SIZE, fit=fit, encoding=encoding, shard_size=SHARD,
                   cluster=datapipe.Cluster(scheduler="sync"), progress=False)
    return out


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    """N noisy non-square (and some square) PNG images in two classes."""
    root = tmp_path_factory.mktemp("loader-formats") / "src"
    rng = np.random.default_rng(7)
    for i in range(N):
        w, h = ASPECTS[i % len(ASPECTS)]
        # smooth random content (JPEG-friendly) plus a per-image offset, so samples differ
        base = rng.integers(0, 256, size=(h // 8 + 1, w // 8 + 1, 3), dtype=np.uint8)
        img = np.asarray(Image.fromarray(base).resize((w, h), Image.BILINEAR))
        folder = root / ("a" if i % 2 else "b")
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray(img).save(folder / f"{i:03d}.png")
    return root


@pytest.fixture(scope="module")
def caches(source, tmp_path_factory):
    """One cache per (encoding, fit), built on first use."""
    base = tmp_path_factory.mktemp("loader-format-caches")

    class Caches(dict):
        def __missing__(self, key: tuple[str, str]) -> Path:
            self[key] = _build(source, base / "-".join(key), *key)
            return self[key]

    return Caches()


@pytest.fixture(params=FORMATS, ids=FORMAT_IDS)
def cache_path(request, caches) -> Path:
    return caches[request.param]


def _dataset(path: Path, **kwargs) -> datapipe.StreamingDataset:
    kwargs.setdefault("batch_size", B)
    kwargs.setdefault("seed", 5)
    kwargs.setdefault("return_index", True)
    return datapipe.StreamingDataset(path, **kwargs)


def _run(path: Path, *, aug=None, workers: int = 2, epoch: int = 0, k: int | None = None, state=None,
         ds_kwargs: dict | None = None) -> tuple[list, dict | None, int]:
    """Batches (cloned) of one epoch of a fresh CPU DeviceLoader; with ``k``, also the state after k
    batches. Returns (batches, state or None, len(loader))."""
    ds = _dataset(path, **(ds_kwargs or {}))
    loader = datapipe.DeviceLoader(ds, device="cpu", augment=augment.train(OUT) if aug is None else aug,
                                   num_workers=workers)
    try:
        loader.set_epoch(epoch)
        if state is not None:
            loader.load_state_dict(state)
        out = []
        saved = None
        for batch in loader:
            out.append(tuple(t.clone() for t in batch))
            if k is not None and len(out) == k:
                saved = loader.state_dict()
                break
        return out, saved, len(loader)
    finally:
        loader.close()


def _same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(all(torch.equal(x, y) for x, y in zip(p, q, strict=True))
                                    for p, q in zip(a, b, strict=True))


def test_the_caches_have_the_formats(caches):
    """The fixtures are what the tests below assume: short caches vary in shape, crop caches are square."""
    for (encoding, fit), path in ((key, caches[key]) for key in FORMATS):
        cache = datapipe.open(path)
        assert cache.encoding == encoding and len(cache) == N
        if fit == "short":
            assert cache.fixed_shape is None
            shapes = {tuple(s) for s in cache.shapes.tolist()}
            assert shapes == {(48, 64), (64, 48), (48, 96), (48, 48)}
        else:
            assert cache.fixed_shape == (SIZE, SIZE, 3)


# ----------------------------------------------------------------------------- 1. exactly once


@pytest.mark.parametrize("workers", [0, 2])
def test_every_sample_once_per_epoch_across_ranks(cache_path, workers):
    seen, counts = [], []
    for rank in range(2):
        batches, _, length = _run(cache_path, workers=workers, epoch=1, ds_kwargs={"rank": rank, "world_size": 2})
        assert len(batches) == length
        counts.append(len(batches))
        for images, labels, idx in batches:
            assert images.shape == (len(idx), 3, OUT, OUT) and images.dtype == torch.float32
            assert torch.isfinite(images).all()
            assert labels.shape == idx.shape
        seen += torch.cat([b[2] for b in batches]).tolist()
    assert counts[0] == counts[1] > 0
    assert sorted(seen) == list(range(N))


# ----------------------------------------------------------------------------- 2. determinism


def test_batches_are_deterministic_in_the_seed(cache_path):
    a, _, _ = _run(cache_path, workers=2)
    b, _, _ = _run(cache_path, workers=0)
    assert _same(a, b), "the same seed gives the same batches (with and without reader threads)"
    c, _, _ = _run(cache_path, workers=2, ds_kwargs={"seed": 6})
    assert not _same(a, c)
    # the same order with another augmentation seed: the pixels differ, not only the order
    by_index_a = {int(i): img for images, _, idx in a for img, i in zip(images, idx, strict=True)}
    by_index_c = {int(i): img for images, _, idx in c for img, i in zip(images, idx, strict=True)}
    assert sum(not torch.equal(by_index_a[i], by_index_c[i]) for i in range(N)) > N // 2
    # another epoch draws other crops
    d, _, _ = _run(cache_path, workers=2, epoch=1)
    assert not _same(a, d)


# ----------------------------------------------------------------------------- 3. resume


@pytest.mark.parametrize("workers", [0, 2])
def test_resume_yields_exactly_the_remaining_batches(cache_path, workers):
    full, _, _ = _run(cache_path, workers=workers, epoch=2)
    k = 2
    head, state, _ = _run(cache_path, workers=workers, epoch=2, k=k)
    assert state is not None and _same(head, full[:k])
    rest, _, _ = _run(cache_path, workers=workers, epoch=2, state=state)
    assert len(rest) == len(full) - k > 0
    assert _same(rest, full[k:])


# ----------------------------------------------------------------------------- 4. crops over the full extent


@pytest.fixture(scope="module")
def stripes(tmp_path_factory) -> Path:
    """2:1 wide images: the left quarter pure red, the right quarter pure blue, the middle green."""
    root = tmp_path_factory.mktemp("stripes") / "src"
    (root / "x").mkdir(parents=True)
    img = np.zeros((64, 128, 3), np.uint8)
    img[:, :32] = (255, 0, 0)
    img[:, 32:96] = (0, 255, 0)
    img[:, 96:] = (0, 0, 255)
    for i in range(12):
        Image.fromarray(img).save(root / "x" / f"{i:02d}.png")
    return root


def _dominant(images: torch.Tensor) -> tuple[int, int]:
    """Counts of red-dominant and blue-dominant pixels of a normalised float batch."""
    px = to_uint8(images).astype(np.int32)
    r, g, b = px[..., 0], px[..., 1], px[..., 2]
    red = (r > 160) & (g < 80) & (b < 80)
    blue = (b > 160) & (r < 80) & (g < 80)
    return int(red.sum()), int(blue.sum())


@pytest.mark.parametrize("encoding", ["raw", "jpeg"])
@pytest.mark.parametrize("workers", [0, 2])
def test_train_crops_cover_the_whole_of_wide_samples(stripes, tmp_path_factory, encoding, workers):
    base = tmp_path_factory.mktemp(f"stripes-{encoding}-{workers}")
    totals = {}
    for fit in ("short", "crop"):
        path = _build(stripes, base / fit, encoding, fit)
        red = blue = green = 0
        for epoch in range(4):
            batches, _, _ = _run(path, workers=workers, epoch=epoch, ds_kwargs={"batch_size": 4})
            for images, _, _ in batches:
                r, b = _dominant(images)
                red, blue = red + r, blue + b
                green += int((to_uint8(images)[..., 1] > 160).sum())
        totals[fit] = (red, blue, green)
    assert totals["crop"][0] == totals["crop"][1] == 0, "a centre square holds no red or blue"
    assert totals["crop"][2] > 0
    red, blue, green = totals["short"]
    assert red > 0 and blue > 0, f"the crops of the short cache never reach its edges (red {red}, blue {blue})"
    assert green > 0


# ----------------------------------------------------------------------------- 5. eval preset


@pytest.mark.parametrize("encoding", ["raw", "jpeg"])
@pytest.mark.parametrize("workers", [0, 2])
def test_eval_is_the_centre_crop_of_each_stored_sample(caches, encoding, workers):
    path = caches[(encoding, "short")]
    cache = datapipe.open(path)
    batches, _, _ = _run(path, aug=augment.eval(OUT), workers=workers, ds_kwargs={"shuffle": False})
    seen = []
    for images, _, idx in batches:
        for img, i in zip(images, idx.tolist(), strict=True):
            stored = cache[i][0]
            expected = augment.eval(OUT)([torch.from_numpy(stored)])[0]
            torch.testing.assert_close(img, expected, rtol=0, atol=1e-5)
            # and that is the stored sample's centre OUT square, normalised
            h, w = stored.shape[:2]
            top, left = (h - OUT) // 2, (w - OUT) // 2
            centre = stored[top : top + OUT, left : left + OUT]
            assert np.array_equal(to_uint8(img[None])[0], centre)
            seen.append(i)
    assert seen == list(range(N))


# ----------------------------------------------------------------------------- 6. a damaged JPEG sample


def _damage_a_sample(path: Path, shard: int = 1, sample: int = 3) -> tuple[Path, int]:
    """Overwrite the middle of one stored JPEG sample (the file keeps its size); returns the shard's
    data file and the sample's global index."""
    cache = datapipe.open(path)
    data_file = cache._shard_path(shard)
    index = cache._index(shard)
    offset, nbytes = int(index.offsets[sample]), int(index.nbytes[sample])
    size = data_file.stat().st_size
    with open(data_file, "r+b") as f:
        f.seek(offset + nbytes // 4)
        f.write(b"\xff\x01" * (nbytes // 4))  # invalid markers in the entropy-coded data
    assert data_file.stat().st_size == size
    return data_file, int(cache.starts[shard]) + sample


@pytest.mark.parametrize("fit", ["crop", "short"])
@pytest.mark.parametrize("preset", ["train", "eval"])
@pytest.mark.parametrize("workers", [0, 2])
def test_a_damaged_jpeg_sample_names_the_shard_and_sample(caches, tmp_path, fit, preset, workers):
    path = tmp_path / "cache"
    shutil.copytree(caches[("jpeg", fit)], path)
    data_file, g = _damage_a_sample(path)
    aug = augment.train(OUT) if preset == "train" else augment.eval(OUT)
    with pytest.raises(CorruptShardError) as err:
        _run(path, aug=aug, workers=workers)
    message = str(err.value)
    assert str(data_file) in message and f"sample {g}" in message
    assert "\n" not in message


# ----------------------------------------------------------------------------- 7. varying shapes


@pytest.mark.parametrize("encoding", ["raw", "jpeg"])
@pytest.mark.parametrize("workers", [0, 2])
def test_streaming_dataset_yields_samples_at_their_shapes(caches, encoding, workers):
    path = caches[(encoding, "short")]
    cache = datapipe.open(path)
    seen = []
    loader = torch.utils.data.DataLoader(_dataset(path), batch_size=None, num_workers=workers)
    for images, labels, idx in loader:
        assert isinstance(images, list) and len(images) == len(idx) == len(labels)
        for img, i in zip(images, idx.tolist(), strict=True):
            assert img.dtype == torch.uint8
            assert img.shape == (*cache.shapes[i], 3)
            assert np.array_equal(img.numpy(), cache[i][0])
            seen.append(i)
    assert sorted(seen) == list(range(N))
    assert len({tuple(cache.shapes[i]) for i in seen}) == len(ASPECTS)


@pytest.mark.parametrize("encoding", ["raw", "jpeg"])
def test_a_plain_conversion_of_varying_shapes_is_refused(caches, encoding):
    path = caches[(encoding, "short")]
    for aug in (None, augment.convert()):
        with pytest.raises(ArgumentError, match=r"vary in shape.*augment=datapipe\.augment\.train\(size\) or eval\(size\)") as err:
            datapipe.DeviceLoader(_dataset(path), device="cpu", augment=aug)
        assert str(path) in str(err.value)
    # the square caches take a plain conversion
    loader = datapipe.DeviceLoader(_dataset(caches[(encoding, "crop")]), device="cpu", num_workers=0)
    try:
        images, _, idx = next(iter(loader))
        assert images.shape == (len(idx), 3, SIZE, SIZE)
    finally:
        loader.close()
