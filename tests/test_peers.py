"""The reference loaders of ``datapipe.bench.peers``: same data, same output, each sample once an epoch."""

from __future__ import annotations

import collections
import importlib
import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from datapipe.bench import peers
from datapipe.bench.peers import ImageFolderTransform, get_peer, list_image_folder
from datapipe.bench.sample import make_sample_dataset

IMAGES = 40
CLASSES = 4


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    return make_sample_dataset(tmp_path_factory.mktemp("src"), images=IMAGES, classes=CLASSES)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("work")


def _source_label_counts(source: Path) -> collections.Counter:
    # Independent of peers.list_image_folder: class = position of the folder in sorted order.
    counts = collections.Counter()
    for index, folder in enumerate(sorted(p for p in source.iterdir() if p.is_dir())):
        counts[index] = sum(1 for f in folder.iterdir() if f.suffix.lower() == ".jpg")
    return counts


def test_import_is_lazy():
    code = (
        "import sys, datapipe.bench.peers\n"
        "bad = [m for m in ('torch', 'webdataset', 'litdata', 'streaming') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_list_image_folder_matches_imagefolder_order(source):
    classes, samples = list_image_folder(source)
    assert classes == [f"class_{c:03d}" for c in range(CLASSES)]
    assert len(samples) == IMAGES
    assert [label for _, label in samples] == sorted(label for _, label in samples)
    for path, label in samples:
        assert path.parent.name == classes[label]
    assert [p for p, _ in samples] == sorted(p for p, _ in samples)


def test_list_image_folder_rejects_empty(tmp_path):
    with pytest.raises(FileNotFoundError):
        list_image_folder(tmp_path)


def test_transform_shape_range_and_determinism(source):
    path = min((source / "class_001").iterdir())
    transform = ImageFolderTransform()
    torch.manual_seed(123)
    a = transform(path)
    torch.manual_seed(123)
    b = transform(path.read_bytes())  # bytes and paths decode the same
    assert a.shape == (3, 224, 224)
    assert a.dtype == torch.float32
    assert 0.0 <= float(a.min()) and float(a.max()) <= 1.0
    assert float(a.max()) > 0.2  # a photograph, not a black frame
    assert torch.equal(a, b)
    # Explicit generators give the same result too, and another seed gives another crop.
    c = transform(path, generator=torch.Generator().manual_seed(7))
    d = transform(path, generator=torch.Generator().manual_seed(7))
    e = transform(path, generator=torch.Generator().manual_seed(8))
    assert torch.equal(c, d)
    assert not torch.equal(c, e)
    # Pixel values are multiples of 1/255 like ToTensor's.
    assert torch.allclose(a * 255, (a * 255).round(), atol=1e-3)


def test_transform_flip_and_full_crop(source):
    from PIL import Image

    path = min((source / "class_000").iterdir())
    with Image.open(path) as img:
        rgb = img.convert("RGB")
    # scale=(1,1) with an aspect-ratio range containing the image's makes the crop the whole
    # image (or the centre crop fallback), so flip_p=0 and flip_p=1 must mirror each other.
    ratio = (rgb.width / rgb.height,) * 2
    plain = ImageFolderTransform(scale=(1.0, 1.0), ratio=ratio, flip_p=0.0)(rgb)
    flipped = ImageFolderTransform(scale=(1.0, 1.0), ratio=ratio, flip_p=1.0)(rgb)
    assert torch.equal(plain.flip(-1), flipped)
    expected = rgb.resize((224, 224), Image.Resampling.BILINEAR)
    want = torch.from_numpy(__import__("numpy").array(expected)).permute(2, 0, 1).float() / 255
    assert torch.allclose(plain, want, atol=1e-6)


def _torchvision_get_params(height: int, width: int, gen: torch.Generator) -> tuple[int, int, int, int]:
    """torchvision's RandomResizedCrop.get_params (scale (0.08, 1), ratio (3/4, 4/3)), as its source draws it."""
    import math

    area, log_ratio = height * width, torch.log(torch.tensor((3 / 4, 4 / 3)))
    for _ in range(10):
        target_area = area * torch.empty(1).uniform_(0.08, 1.0, generator=gen).item()
        aspect_ratio = math.exp(torch.empty(1).uniform_(log_ratio[0], log_ratio[1], generator=gen).item())
        w, h = int(round(math.sqrt(target_area * aspect_ratio))), int(round(math.sqrt(target_area / aspect_ratio)))
        if 0 < w <= width and 0 < h <= height:
            i = torch.randint(0, height - h + 1, size=(1,), generator=gen).item()
            j = torch.randint(0, width - w + 1, size=(1,), generator=gen).item()
            return i, j, h, w
    in_ratio = width / height
    if in_ratio < 3 / 4:
        w, h = width, int(round(width / (3 / 4)))
    elif in_ratio > 4 / 3:
        h, w = height, int(round(height * (4 / 3)))
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w


def _expected(image, seed: int, size: int = 224):
    """The transform's output for ``seed``, replayed: torchvision's per-image crop draw, then one draw for the flip."""
    import numpy as np
    from PIL import Image

    gen = torch.Generator().manual_seed(seed)
    top, left, h, w = _torchvision_get_params(image.height, image.width, gen)
    flip = torch.rand(1, generator=gen).item() < 0.5
    out = image.crop((left, top, left + w, top + h)).resize((size, size), Image.Resampling.BILINEAR)
    if flip:
        out = out.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    return (top, left, h, w), flip, torch.from_numpy(np.array(out)).permute(2, 0, 1).float() / 255


def _photo_and_strip(source):
    from PIL import Image

    paths = sorted(source.glob("*/*.jpg"))[:6]
    with Image.open(paths[0]) as img:
        strip = img.convert("RGB").resize((900, 60))  # no try fits: the centre-crop fallback
    images = []
    for path in paths:
        with Image.open(path) as img:
            images.append(img.convert("RGB"))
    return [*images, strip]


def test_the_transform_crops_with_torchvisions_per_image_sampler(source):
    # The peers draw each image's crop as torchvision's RandomResizedCrop.get_params does (a batched sampler
    # called once per image cost them 128 µs an image against its 19), then one draw for the flip.
    flips = set()
    for seed, image in enumerate(_photo_and_strip(source)):
        box, flip, want = _expected(image, seed)
        assert ImageFolderTransform().crop_params(image.width, image.height, torch.Generator().manual_seed(seed)) == box
        assert torch.equal(ImageFolderTransform()(image, generator=torch.Generator().manual_seed(seed)), want)
        torch.manual_seed(seed)  # torch's global generator, as in a DataLoader worker
        assert torch.equal(ImageFolderTransform()(image), want)
        flips.add(flip)
    assert flips == {False, True}


def test_transform_matches_torchvision_for_the_same_crop(source):
    # Where torchvision imports (the peers venv), the pixels must be bit-identical to its
    # resized_crop + hflip + to_tensor for the same crop and flip, the centre-crop fallback included.
    try:
        from torchvision.transforms import functional as F
    except Exception as exc:  # noqa: BLE001 - not installed, or built for another torch
        pytest.skip(f"torchvision does not import here: {type(exc).__name__}")

    for seed, image in enumerate(_photo_and_strip(source)):
        (top, left, h, w), flip, _ = _expected(image, seed)
        want = F.resized_crop(image, top, left, h, w, [224, 224], antialias=True)
        want = F.to_tensor(F.hflip(want) if flip else want)
        assert torch.equal(ImageFolderTransform()(image, generator=torch.Generator().manual_seed(seed)), want)


def test_resize_box_variant_differs_only_at_the_border(source):
    path = sorted(source.glob("*/*.jpg"))[3]
    torch.manual_seed(5)
    cropped = ImageFolderTransform()(path)
    torch.manual_seed(5)
    boxed = ImageFolderTransform(resize_box=True)(path)
    assert (cropped - boxed)[:, 3:-3, 3:-3].abs().max() <= 1.5 / 255


def test_transform_is_picklable():
    import pickle

    t = ImageFolderTransform(size=128, scale=(0.5, 1.0))
    u = pickle.loads(pickle.dumps(t))
    assert (u.size, u.scale, u.ratio, u.flip_p) == (t.size, t.scale, t.ratio, t.flip_p)


@pytest.mark.parametrize("width,height", [(423, 354), (354, 423), (1000, 200), (200, 1000), (64, 64)])
def test_crop_params_respect_bounds(width, height):
    scale, ratio = (0.08, 1.0), (3 / 4, 4 / 3)
    gen = torch.Generator().manual_seed(0)
    area = width * height
    fallbacks = 0
    transform = ImageFolderTransform(scale=scale, ratio=ratio)
    for _ in range(500):
        i, j, h, w = transform.crop_params(width, height, gen)
        assert 0 <= i and 0 <= j and 0 < h and 0 < w
        assert i + h <= height and j + w <= width
        # The rounding of w and h to integers bends the bounds by up to half a pixel per side.
        fits = scale[0] * area - 0.5 * (h + w) - 1 <= h * w <= scale[1] * area
        ratio_ok = (w - 0.5) / (h + 0.5) <= ratio[1] + 1e-9 and (w + 0.5) / (h - 0.5) >= ratio[0] - 1e-9
        if fits and ratio_ok:
            continue
        # Otherwise it must be torchvision's centre-crop fallback.
        fallbacks += 1
        assert i == (height - h) // 2 and j == (width - w) // 2
        assert h == height or w == width
    if 0.75 <= width / height <= 4 / 3:
        assert fallbacks == 0


def test_crop_params_fallback_is_centre_crop():
    # A 1000x10 strip: no 3/4..4/3 crop of 8..100% of the area fits, so all 10 tries fail.
    gen = torch.Generator().manual_seed(0)
    transform = ImageFolderTransform(scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3))
    i, j, h, w = transform.crop_params(1000, 10, gen)
    assert (h, w) == (10, round(10 * 4 / 3))
    assert (i, j) == (0, (1000 - w) // 2)
    # Tall strip: clamp to the minimum ratio.
    i, j, h, w = transform.crop_params(10, 1000, gen)
    assert (h, w) == (round(10 / (3 / 4)), 10)
    assert (i, j) == ((1000 - h) // 2, 0)


def test_crop_params_cover_the_scale_range():
    gen = torch.Generator().manual_seed(1)
    crops = [ImageFolderTransform().crop_params(400, 400, gen) for _ in range(400)]
    fractions = [h * w / (400 * 400) for _, _, h, w in crops]
    assert min(fractions) < 0.15 and max(fractions) > 0.85
    # The transform's own scale and ratio are the sampler's.
    narrow = ImageFolderTransform(scale=(0.5, 0.6), ratio=(1.0, 1.0))
    crops = [narrow.crop_params(400, 400, gen) for _ in range(200)]
    assert all(h == w and 0.5 * 400 * 400 - 400 <= h * w <= 0.6 * 400 * 400 + 400 for _, _, h, w in crops)


def test_get_peer_and_registry():
    assert list(peers.PEERS) == ["dataloader", "webdataset", "litdata", "streaming"]
    for name, peer in peers.PEERS.items():
        assert get_peer(name) is peer
        assert peer.name == name
        assert peer.install.startswith("pip install")
    with pytest.raises(ValueError) as err:
        get_peer("nope")
    message = str(err.value)
    assert "nope" in message
    for name in peers.PEERS:
        assert name in message


def _imports(module: str) -> bool:
    if importlib.util.find_spec(module) is None:
        return False
    try:
        importlib.import_module(module)
    except Exception:  # noqa: BLE001
        return False
    return True


@pytest.mark.parametrize(
    "name,module", [("webdataset", "webdataset"), ("litdata", "litdata"), ("streaming", "streaming")]
)
def test_unavailable_iff_library_missing(name, module):
    reason = get_peer(name).unavailable()
    if _imports(module):
        assert reason is None
    else:
        assert isinstance(reason, str) and reason
        assert "Error" in reason  # e.g. "ModuleNotFoundError: No module named 'litdata'"
        if importlib.util.find_spec(module) is None:
            assert reason == f"ModuleNotFoundError: No module named '{module}'"


def test_unavailable_reports_a_missing_module_and_never_raises():
    class Ghost(peers.Peer):
        name = "ghost"
        install = "pip install ghost"
        modules = ("torch", "datapipe_no_such_module_xyz")

    assert Ghost().unavailable() == "ModuleNotFoundError: No module named 'datapipe_no_such_module_xyz'"
    assert get_peer("dataloader").unavailable() is None


def _one_epoch(loader, batch_size):
    counts = collections.Counter()
    sizes = []
    for images, labels in loader:
        assert isinstance(images, torch.Tensor) and isinstance(labels, torch.Tensor)
        assert images.dtype == torch.float32 and labels.dtype == torch.int64
        assert images.shape[1:] == (3, 224, 224)
        assert labels.shape == (images.shape[0],)
        assert 0 < images.shape[0] <= batch_size
        assert 0.0 <= float(images.min()) and float(images.max()) <= 1.0
        sizes.append(images.shape[0])
        counts.update(labels.tolist())
    return counts, sizes


def _check_peer(name, source, workdir, *, batch_size, workers, epochs=2):
    peer = get_peer(name)
    reason = peer.unavailable()
    if reason is not None:
        pytest.skip(reason)
    first = peer.prepare(source, workdir)
    assert first >= 0.0
    assert peer.prepare(source, workdir) == 0.0  # complete shards are not written again
    want = _source_label_counts(source)
    loader = peer.loader(source, workdir, batch_size=batch_size, workers=workers, seed=0)
    for _ in range(epochs):  # re-iterable: each pass is one full epoch
        counts, sizes = _one_epoch(loader, batch_size)
        assert sum(sizes) == IMAGES
        assert counts == want
        # At most one partial batch per worker.
        assert sum(1 for s in sizes if s != batch_size) <= max(1, workers)
    return loader


@pytest.mark.parametrize("workers", [0, 2])
def test_dataloader_peer_one_epoch(source, workdir, workers):
    loader = _check_peer("dataloader", source, workdir, batch_size=16, workers=workers)
    assert [len(b[1]) for b in loader] == [16, 16, 8]
    assert not (workdir / "dataloader").exists()  # nothing to write for plain files


def test_dataloader_peer_shuffles(source, workdir):
    loader = get_peer("dataloader").loader(source, workdir, batch_size=IMAGES, workers=0, seed=0)
    labels = next(iter(loader))[1].tolist()
    assert labels != sorted(labels)


@pytest.mark.parametrize("workers", [0, 2])
def test_webdataset_peer_one_epoch(source, workdir, workers):
    _check_peer("webdataset", source, workdir, batch_size=16, workers=workers)
    shards = sorted((workdir / "webdataset").glob("shard-*.tar"))
    assert len(shards) == math.ceil(IMAGES / math.ceil(IMAGES / 16))


def test_webdataset_peer_more_workers_than_needed(source, workdir):
    # Every worker reads a disjoint subset of shards: no duplicates even with many workers.
    _check_peer("webdataset", source, workdir, batch_size=8, workers=3, epochs=1)


def _webdataset():
    peer = get_peer("webdataset")
    if peer.unavailable():
        pytest.skip(peer.unavailable())
    return peer


def test_prepare_rewrites_incomplete_shards(source, tmp_path):
    peer = _webdataset()
    assert peer.prepare(source, tmp_path) > 0.0
    marker = tmp_path / "webdataset" / "_datapipe_peer.json"
    marker.write_text(json.dumps({"format": "datapipe-peer-shards", "peer": "webdataset", "state": "writing"}))
    (tmp_path / "webdataset" / "shard-000000.tar").write_bytes(b"cut short")  # as if writing was interrupted
    assert peer.prepare(source, tmp_path) > 0.0
    assert peer.prepare(source, tmp_path) == 0.0
    assert json.loads(marker.read_text())["state"] == "complete"


def test_a_peer_folder_datapipe_did_not_write_is_refused_and_kept(source, tmp_path):
    from datapipe.errors import OutputError

    peer = _webdataset()
    mine = tmp_path / "webdataset"
    mine.mkdir()
    (mine / "IMPORTANT.txt").write_text("my notes")
    (mine / "shard-000000.tar").write_text("my own tar, whatever its name")
    with pytest.raises(OutputError, match=r"is not datapipe's .*_datapipe_peer.json"):
        peer.prepare(source, tmp_path)
    (mine / "_datapipe_peer.json").write_text(json.dumps({"peer": "someone else"}))  # not datapipe's marker of this peer
    with pytest.raises(OutputError, match="is not datapipe's"):
        peer.prepare(source, tmp_path)
    assert (mine / "IMPORTANT.txt").read_text() == "my notes"
    assert (mine / "shard-000000.tar").read_text() == "my own tar, whatever its name"


def test_shards_of_other_samples_are_replaced_file_by_file(source, tmp_path):
    """A complete folder of datapipe's for other samples: exactly the files its marker lists are
    replaced; a file added there since is the user's, and the folder is refused, nothing deleted."""
    from datapipe.errors import OutputError

    peer = _webdataset()
    listing = peers._as_samples(source)
    fewer = peers.SampleList(listing.root, listing.samples[:20])
    assert peer.prepare(fewer, tmp_path) > 0.0
    folder = tmp_path / "webdataset"
    written = json.loads((folder / "_datapipe_peer.json").read_text())
    assert written["state"] == "complete" and sorted(written["files"]) == sorted(p.name for p in folder.glob("shard-*.tar"))
    (folder / "notes.txt").write_text("added by the user")
    before = sorted(p.name for p in folder.iterdir())
    with pytest.raises(OutputError, match="notes.txt, which datapipe did not write"):
        peer.prepare(source, tmp_path)
    assert sorted(p.name for p in folder.iterdir()) == before  # nothing deleted
    (folder / "notes.txt").unlink()
    assert peer.prepare(source, tmp_path) > 0.0
    assert json.loads((folder / "_datapipe_peer.json").read_text())["samples"] == IMAGES
    _one_epoch(peer.loader(source, tmp_path, batch_size=8, workers=0), 8)


def test_shards_under_an_earlier_marker_are_replaced_by_their_names(source, tmp_path):
    """A marker of an earlier datapipe (written last, without the list of files): the files named as
    the library names its shards are datapipe's; anything else is refused."""
    from datapipe.errors import OutputError

    peer = _webdataset()
    folder = tmp_path / "webdataset"
    folder.mkdir()
    (folder / "shard-000000.tar").write_bytes(b"old")
    (folder / "_datapipe_peer.json").write_text(json.dumps({"peer": "webdataset", "source": "/elsewhere", "samples": 3,
                                                            "fingerprint": "0" * 40, "write_s": 1.0}))
    (folder / "mine.bin").write_bytes(b"x")
    with pytest.raises(OutputError, match="mine.bin"):
        peer.prepare(source, tmp_path)
    (folder / "mine.bin").unlink()
    assert peer.prepare(source, tmp_path) > 0.0
    assert sum(1 for _ in folder.glob("shard-*.tar")) > 1


def test_loader_without_prepare_fails_clearly(source, tmp_path):
    peer = get_peer("webdataset")
    if peer.unavailable():
        pytest.skip(peer.unavailable())
    with pytest.raises(FileNotFoundError, match="prepare"):
        peer.loader(source, tmp_path, batch_size=4, workers=0)


@pytest.mark.parametrize("name", ["litdata", "streaming"])
def test_streaming_library_peers_one_epoch(name, source, workdir):
    # Runs where the library imports (the peers venv); skipped with the import error elsewhere.
    import multiprocessing

    start_method = multiprocessing.get_start_method()
    _check_peer(name, source, workdir, batch_size=16, workers=2, epochs=2)
    # Writing shards must not change how later DataLoaders in this process start their workers.
    assert multiprocessing.get_start_method() == start_method
    # A second loader over the same shards in the same process works too.
    loader = get_peer(name).loader(source, workdir, batch_size=16, workers=0, seed=1)
    counts, sizes = _one_epoch(loader, 16)
    assert counts == _source_label_counts(source) and sum(sizes) == IMAGES


def test_measure_reports_one_epoch(source, workdir):
    result = peers.measure("dataloader", source, workdir, batch_size=16, workers=0, warmup_epochs=0)
    assert result.name == "dataloader" and result.images == IMAGES
    assert len(result.epoch_s) == 1 and result.images_per_s > 0


def test_incomplete_index_is_an_error(tmp_path):
    # The litdata and streaming writers are checked against the number of source samples.
    (tmp_path / "index.json").write_text('{"shards": [{"samples": 30}, {"samples": 9}]}')
    with pytest.raises(RuntimeError, match="39 samples, expected 40"):
        peers._check_index(tmp_path, "shards", "samples", 40)
    peers._check_index(tmp_path, "shards", "samples", 39)
    (tmp_path / "index.json").write_text('{"chunks": [], "config": null}')
    with pytest.raises(RuntimeError):
        peers._check_index(tmp_path, "chunks", "chunk_size", 40)
    (tmp_path / "index.json").unlink()
    with pytest.raises(RuntimeError, match="index.json"):
        peers._check_index(tmp_path, "chunks", "chunk_size", 40)


def _collated_in_shared_memory(samples) -> bool:
    images, labels = peers.collate_pairs(samples)
    return bool(images.is_shared()) and labels.dtype == torch.int64 and images.shape[0] == len(samples)


def test_the_peers_collate_into_shared_memory_in_a_worker_as_torchs_default_collate():
    """The peers stacked each batch into private memory, which the worker's queue then copied into shared
    memory: one copy of every batch more than a DataLoader user pays with torch's default collate."""
    from torch.utils.data import DataLoader

    samples = [(torch.rand(3, 8, 8), i % 2) for i in range(4)]
    loader = DataLoader(samples, batch_size=2, num_workers=1, collate_fn=_collated_in_shared_memory)
    assert list(loader) == [True, True]
