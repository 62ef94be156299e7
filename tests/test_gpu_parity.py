"""The device augmentation path gives the training input of the CPU path and of torchvision.

Both paths of ``augment.train``/``eval`` — ``uint8`` (the CPU's) and ``device`` (what the CUDA
DeviceLoader runs: batched :func:`datapipe.augment.crop_and_resize`, jitter and normalisation on
device tensors) — are compared on textured images (photographs and noise, never smooth gradients,
which hide a shifted or aliased resize) against the float reference torchvision's RandomResizedCrop
computes: ``F.interpolate(crop, bilinear, antialias=True, align_corners=False)``, and against each
other. The device path runs here on CPU tensors: the same code, the same calls.

The former device path (Kornia's ``crop_and_resize`` with ``align_corners=True`` and no antialias)
measured, on the 16-sample batches below against the reference, in [0, 1] units: photographs mean
0.0029 / 0.0088 (224² / 112²), noise 0.027 / 0.079, half and half 0.016 / 0.038 with p99 0.15 /
0.27 and max 0.39 / 0.56; the two paths differed by as much; the mixed-box batch gave NaN (its 1×1
box). Every test here that resizes a crop fails it, the loader's too (p99 0.023 between the paths on
photographs); the flip and eval tests pass it (its flip was exact, and eval never resized a crop).

Tests marked ``cuda`` run the DeviceLoader on a GPU (pinned ring, side stream, events, the device
path on CUDA); they are skipped without one.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import datapipe
from datapipe import augment
from datapipe.testing import crop_reference

MEAN = torch.tensor(augment.IMAGENET_MEAN, dtype=torch.float64).view(1, 3, 1, 1)
STD = torch.tensor(augment.IMAGENET_STD, dtype=torch.float64).view(1, 3, 1, 1)
HAS_CUDA = torch.cuda.is_available()

# Tolerances, [0, 1] units. Measured here (16 samples of 256², photographs and noise, 224² and 112²):
# device path vs reference max 2e-5 (float precision); uint8 path vs reference, and the paths against
# each other, mean 0.0011-0.0012, p99 0.0031-0.0033, max 0.0039 (the uint8 rounding).
DEVICE_MAX = 1e-4
MEAN_TOL, P99_TOL = 0.003, 0.01


# ----------------------------------------------------------------------------- images


def photos(n: int, size: int = 256, seed: int = 0) -> torch.Tensor:
    """uint8 [n, size, size, 3]: random windows of scikit-image's photographs (edges, fine texture)."""
    from datapipe.bench.sample import _load_photos

    rng = np.random.default_rng(seed)
    pics = [p for p in _load_photos() if min(p.shape[:2]) >= size]
    out = []
    for i in range(n):
        p = pics[(i + seed) % len(pics)]
        y, x = int(rng.integers(0, p.shape[0] - size + 1)), int(rng.integers(0, p.shape[1] - size + 1))
        out.append(torch.from_numpy(np.ascontiguousarray(p[y : y + size, x : x + size])))
    return torch.stack(out)


def noise(n: int, size: int = 256, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, size, size, 3), generator=g, dtype=torch.uint8)


def textured(n: int = 16, size: int = 256, seed: int = 0) -> torch.Tensor:
    """Half photographs, half noise."""
    return torch.cat([photos(n - n // 2, size, seed), noise(n // 2, size, seed)])


# ----------------------------------------------------------------------------- reference and units


def unit(images: torch.Tensor) -> torch.Tensor:
    """A normalised batch (any float dtype, any device) back in [0, 1] units: float64 on the CPU."""
    return images.detach().to("cpu", torch.float64) * STD + MEAN


def stats(a: torch.Tensor, b: torch.Tensor) -> dict[str, float]:
    d = (a - b).abs().flatten()
    return {"mean": float(d.mean()), "p99": float(torch.quantile(d[:: max(1, d.numel() // 1_000_000)], 0.99)),
            "max": float(d.max())}


def both_paths(images, params, size: int, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    cpu = augment.train(size, path="uint8", **kwargs)(images, params=params)
    dev = augment.train(size, path="device", **kwargs)(images, params=params)
    return cpu, dev


def check_parity(images, params, size: int, *, device_max: float = DEVICE_MAX, **kwargs) -> dict:
    """Each path against the float reference and against each other; returns the figures."""
    ref = crop_reference(images, params["crops"], params["flip"], size)
    cpu, dev = both_paths(images, params, size, **kwargs)
    figures = {"uint8": stats(unit(cpu), ref), "device": stats(unit(dev), ref), "between": stats(unit(cpu), unit(dev))}
    assert figures["device"]["max"] <= device_max, figures
    for key in ("uint8", "between"):
        assert figures[key]["mean"] <= MEAN_TOL and figures[key]["p99"] <= P99_TOL, (key, figures)
    return figures


def mixed_crops(n: int, height: int, width: int) -> torch.Tensor:
    """A batch of very different boxes: full, tiny (upscaled), slivers of extreme aspect, odd offsets."""
    boxes = [[0, 0, height, width], [3, 5, 20, 37], [0, 0, height, 9], [100, 0, 6, width], [17, 29, 1, 1],
             [1, 2, height - 3, width - 5], [50, 60, 113, 111], [7, 200, 240, 31]]
    return torch.tensor([boxes[i % len(boxes)] for i in range(n)], dtype=torch.int64)


# ----------------------------------------------------------------------------- CPU tests of both paths


@pytest.mark.parametrize("size", [224, 112])
@pytest.mark.parametrize("content", ["photos", "noise"])
def test_random_resized_crops_match_torchvision_on_both_paths(size, content):
    images = photos(16) if content == "photos" else noise(16)
    aug = augment.train(size)
    params = aug.sample(16, 256, 256, seed=3)
    check_parity(images, params, size)


@pytest.mark.parametrize("size", [224, 112])
def test_upscales_extreme_aspects_and_mixed_boxes_in_one_batch(size):
    images = textured(16)
    crops = mixed_crops(16, 256, 256)
    flip = torch.arange(16) % 3 == 0
    figures = check_parity(images, {"crops": crops, "flip": flip}, size)
    assert figures["device"]["max"] <= DEVICE_MAX


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("channels_last", [False, True])
def test_half_precision_and_channels_last_keep_parity(dtype, channels_last):
    images = textured(8)
    params = augment.train(112).sample(8, 256, 256, seed=7)
    params["crops"][:2] = mixed_crops(2, 256, 256)
    ref = crop_reference(images, params["crops"], params["flip"], 112)
    cpu, dev = both_paths(images, params, 112, dtype=dtype, channels_last=channels_last)
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    for out in (cpu, dev):
        assert out.dtype == dtype and out.shape == (8, 3, 112, 112) and out.is_contiguous(memory_format=fmt)
    # fp16/bf16 round the normalised values (bf16: up to 0.0078 of a normalised unit, 0.0018 in [0, 1])
    rounding = {torch.float32: 0.0, torch.float16: 0.0005, torch.bfloat16: 0.0025}[dtype]
    d = stats(unit(dev), ref)
    assert d["max"] <= DEVICE_MAX + rounding, d
    for figures in (stats(unit(cpu), ref), stats(unit(cpu), unit(dev))):
        assert figures["mean"] <= MEAN_TOL and figures["p99"] <= P99_TOL + rounding, figures


def test_flip_is_a_mirror_on_the_device_path():
    images = textured(6)
    aug = augment.train(112, path="device")
    params = aug.sample(6, 256, 256, seed=2)
    plain = aug(images, params={**params, "flip": torch.zeros(6, dtype=torch.bool)})
    mirrored = aug(images, params={**params, "flip": torch.ones(6, dtype=torch.bool)})
    torch.testing.assert_close(mirrored, plain.flip(-1), rtol=0, atol=1e-5)
    assert (mirrored - plain).abs().max() > 0.5  # textured: a mirror is not the same picture


def test_colour_jitter_same_on_both_paths():
    images = textured(8)
    aug = augment.train(112, color_jitter=0.4)
    params = aug.sample(8, 256, 256, seed=4)
    cpu, dev = both_paths(images, params, 112, color_jitter=0.4)
    figures = stats(unit(cpu), unit(dev))
    # jitter amplifies the uint8 path's rounding a little (contrast and saturation up to 1.4x)
    assert figures["mean"] <= MEAN_TOL and figures["p99"] <= 2 * P99_TOL, figures
    plain = augment.train(112, path="device")(images, params={k: v for k, v in params.items() if k != "jitter"})
    assert stats(unit(dev), unit(plain))["mean"] > 10 * MEAN_TOL  # the jitter was applied


@pytest.mark.parametrize("sample", [256, 200, 100, 64])
def test_eval_preset_same_on_both_paths(sample):
    """Center crop when the samples are at least ``size`` (a copy), else the antialiased resize."""
    images = textured(6, size=sample)
    cpu = augment.eval(224, path="uint8")(images)
    dev = augment.eval(224, path="device")(images)
    if sample >= 224:
        t = (sample - 224) // 2
        ref = images[:, t : t + 224, t : t + 224].permute(0, 3, 1, 2).to(torch.float64) / 255.0
    else:
        ref = F.interpolate(images.permute(0, 3, 1, 2).float() / 255.0, size=(224, 224), mode="bilinear",
                            antialias=True, align_corners=False).to(torch.float64)
    for out in (cpu, dev):
        assert stats(unit(out), ref)["max"] <= DEVICE_MAX


def test_crop_and_resize_any_output_shape_and_errors():
    images = textured(4, size=64)
    crops = torch.tensor([[0, 0, 64, 64], [5, 6, 30, 50], [0, 0, 2, 64], [10, 3, 40, 3]])
    out = augment.crop_and_resize(images, crops, (48, 20))
    assert out.shape == (4, 3, 48, 20) and out.dtype == torch.float32
    for x, (t, left, h, w), o in zip(images, crops.tolist(), out, strict=True):
        ref = F.interpolate(x[t : t + h, left : left + w].permute(2, 0, 1)[None].float(), size=(48, 20),
                            mode="bilinear", antialias=True, align_corners=False)[0]
        torch.testing.assert_close(o, ref, rtol=0, atol=0.02)  # 0..255 units
    assert augment.crop_and_resize(images[:0], crops[:0], 8).shape == (0, 3, 8, 8)
    for bad in ([0, 0, 65, 64], [-1, 0, 4, 4], [0, 60, 4, 5], [0, 0, 0, 3]):
        with pytest.raises(ValueError, match="outside its image of 64x64"):
            augment.crop_and_resize(images, torch.tensor([bad] * 4), 8)
    with pytest.raises(ValueError, match="crops must be int64"):
        augment.crop_and_resize(images, crops[:3], 8)


def test_resize_weights_are_torchs_filter():
    """Rows sum to one, lie inside the box, and reproduce F.interpolate on a one-hot input."""
    start, length = torch.tensor([0, 7, 100, 3]), torch.tensor([256, 30, 2, 200])
    w = augment.resize_weights(start, length, 256, 112, augment._taps(256, 112))
    torch.testing.assert_close(w.sum(-1), torch.ones(4, 112))
    for b, (s, n) in enumerate(zip(start.tolist(), length.tolist(), strict=True)):
        assert w[b, :, :s].abs().sum() == 0 and w[b, :, s + n :].abs().sum() == 0
        eye = torch.eye(n, dtype=torch.float64)[None, None]  # column j: the response to input pixel j
        ref = F.interpolate(eye, size=(112, n), mode="bilinear", antialias=True, align_corners=False)[0, 0]
        torch.testing.assert_close(w[b, :, s : s + n].double(), ref, rtol=0, atol=1e-7)  # torch's doubles, in fp32


def photo_cache(tmp, images: int, side: int):
    src = datapipe.make_sample_dataset(tmp / "src", images=images, classes=3)
    datapipe.build(src, tmp / "cache", size=side, shard_size=16, cluster=datapipe.Cluster(scheduler="sync"), progress=False)
    return tmp / "cache"


def loader_epoch(cache, device: str, path: str, size: int, *, dtype=torch.float32, jitter=None) -> list:
    """One epoch of augmented batches (on the CPU), from a DeviceLoader with the train preset."""
    ds = datapipe.StreamingDataset(cache, batch_size=32, shuffle=True, seed=11)
    aug = augment.train(size, color_jitter=jitter, dtype=dtype, channels_last=True, path=path)
    loader = datapipe.DeviceLoader(ds, device=device, num_workers=4, prefetch=4, augment=aug)
    try:
        return [tuple(t.cpu() for t in batch) for batch in loader]
    finally:
        loader.close()


def assert_same_batches(a: list, b: list, dtype, jitter) -> None:
    assert len(a) == len(b) == 3
    for (x, lx), (y, ly) in zip(a, b, strict=True):
        assert x.dtype == y.dtype == dtype and torch.equal(lx, ly)
        assert x.is_contiguous(memory_format=torch.channels_last)
        figures = stats(unit(x), unit(y))
        # jitter amplifies the uint8 path's rounding; fp16/bf16 add their own
        assert figures["mean"] <= MEAN_TOL and figures["p99"] <= (2 if jitter else 1) * P99_TOL + 0.0025, figures


@pytest.mark.parametrize(("dtype", "jitter"), [(torch.float32, None), (torch.bfloat16, 0.4)])
def test_device_path_through_the_loader_matches_the_cpu_path(tmp_path, dtype, jitter):
    """DeviceLoader(device="cpu") with ``path="device"`` calls the preset as the CUDA loader does
    (a gathered batch, a per-batch seed); its batches match the default CPU path's."""
    cache = photo_cache(tmp_path, 96, 96)
    device = loader_epoch(cache, "cpu", "device", 64, dtype=dtype, jitter=jitter)
    assert_same_batches(device, loader_epoch(cache, "cpu", "uint8", 64, dtype=dtype, jitter=jitter), dtype, jitter)


# ----------------------------------------------------------------------------- on a GPU


@pytest.fixture(scope="module")
def photo_cache_256(tmp_path_factory):
    return photo_cache(tmp_path_factory.mktemp("photo-cache"), 96, 256)


@pytest.mark.parametrize("name", ["train", "train_jitter", "eval", "eval_varied", "convert"])
def test_device_presets_queue_their_work_without_waiting_for_the_device_once_warm(monkeypatch, name):
    """A tensor made from Python numbers on a CUDA device, or a blocking copy to it, waits for all the work
    queued before it (the training step), so the loader could not run ahead of the device. Once warm, the
    device path's presets do neither: per-channel constants are made once per device and dtype, parameters
    go over without waiting. Run on the meta device, where every transfer from the host is visible.
    (benchmarks/gpu_check.py checks the same on a GPU with torch.cuda.set_sync_debug_mode.)"""
    meta = torch.device("meta")
    images = torch.zeros((4, 96, 96, 3), dtype=torch.uint8, device=meta)
    presets = {"train": augment.train(64, path="device"), "train_jitter": augment.train(64, color_jitter=0.4, path="device"),
               "eval": augment.eval(64, path="device"), "eval_varied": augment.eval(64, path="device"),
               "convert": augment.convert()}
    aug = presets[name]
    params = aug.sample(4, torch.tensor([96, 80, 96, 70]), torch.tensor([96, 96, 60, 90]), 0) if name == "eval_varied" else None
    run = (lambda: aug(images, params=params)) if params is not None else (lambda: aug(images, seed=1))
    assert run().device == meta
    waits: list[str] = []
    for fn in ("tensor", "as_tensor"):
        real = getattr(torch, fn)

        def made(*args, _real=real, _fn=fn, **kwargs):
            if kwargs.get("device") is not None and torch.device(kwargs["device"]).type != "cpu":
                waits.append(f"torch.{_fn}(..., device={kwargs['device']})")
            return _real(*args, **kwargs)

        monkeypatch.setattr(torch, fn, made)
    real_to = torch.Tensor.to

    def to(self, *args, **kwargs):
        target = next((a for a in args if isinstance(a, (str, torch.device))), kwargs.get("device"))
        if (target is not None and self.device.type == "cpu" and torch.device(target).type != "cpu"
                and not kwargs.get("non_blocking", False)):
            waits.append(f"a blocking copy of {tuple(self.shape)} to {target}")
        return real_to(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", to)
    run()
    assert waits == []


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("jitter", [None, 0.4])
def test_cuda_loader_gives_the_cpu_loaders_batches(photo_cache_256, dtype, jitter):
    """Pinned ring, side-stream copy, events, then the device path and Kornia's jitter on the GPU:
    the same batches as the CPU loader's (same seeds, so the same crops, flips and jitter)."""
    if jitter:
        pytest.importorskip("kornia")
    on_gpu = loader_epoch(photo_cache_256, "cuda", "auto", 224, dtype=dtype, jitter=jitter)
    on_cpu = loader_epoch(photo_cache_256, "cpu", "auto", 224, dtype=dtype, jitter=jitter)
    assert_same_batches(on_gpu, on_cpu, dtype, jitter)


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("tf32", [False, True])
def test_cuda_crop_and_resize_matches_the_crop_reference(tf32):
    images = textured(32).cuda()
    crops = torch.cat([augment.train(224).sample(24, 256, 256, seed=1)["crops"], mixed_crops(8, 256, 256)])
    flip = torch.arange(32) % 2 == 0
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = tf32
    try:
        for size in (224, 112):
            out = augment.crop_and_resize(images, crops, size, flip=flip) / 255.0
            ref = crop_reference(images.cpu(), crops, flip, size)
            figures = stats(out.double().cpu(), ref)
            if tf32:  # TF32 rounds the weights and the intermediate to 10 bits (the pixels, integers, stay exact)
                assert figures["mean"] <= 0.001 and figures["max"] <= 0.006, figures
            else:
                assert figures["max"] <= DEVICE_MAX, figures
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_cuda_ring_stream_and_events_deliver_every_batch_intact(tmp_path):
    """Pinned ring, side-stream copies and events: with the GPU kept busy after each batch (so the
    readers run ahead and refill the ring), every batch still holds exactly its own samples."""
    from datapipe.testing import build_index_cache, index_map, index_of, to_uint8

    cache = build_index_cache(tmp_path, 203, size=32, shard_size=9)
    ids = index_map(cache)
    ds = datapipe.StreamingDataset(cache, batch_size=16, shuffle=True, seed=3, return_index=True)
    for output, aug in (("uint8", None), ("float", None), ("float", augment.eval(32))):
        loader = datapipe.DeviceLoader(ds, device="cuda", num_workers=3, prefetch=3, output=output, augment=aug)
        try:
            for epoch in range(2):
                loader.set_epoch(epoch)
                seen = []
                for images, labels, index in loader:
                    assert images.is_cuda and labels.is_cuda
                    torch.cuda._sleep(2_000_000)  # a slow step on the consuming stream
                    pixels = images.cpu().numpy() if output == "uint8" else to_uint8(images)
                    assert np.array_equal(index_of(pixels), ids[index.cpu().numpy()])
                    seen += index.tolist()
                assert sorted(seen) == list(range(203))
            assert loader._slots and all(s.images.is_pinned() and s.labels.is_pinned() for s in loader._slots)
            assert all(s.event is None or isinstance(s.event, torch.cuda.Event) for s in loader._slots)
        finally:
            loader.close()
