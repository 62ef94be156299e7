"""The batched augmentation (datapipe.augment): crop sampling, the uint8 and Kornia paths, flips,
seeding, lists of samples.
"""

from __future__ import annotations

import pytest
import torch

from datapipe import augment

# ----------------------------------------------------------------------------- DeviceLoader


def test_augment_takes_a_list_of_samples():
    images = smooth_batch(4)
    for aug in (augment.train(24), augment.train(24, color_jitter=0.4), augment.eval(24),
                augment.train(24, path="kornia")):
        assert torch.equal(aug(list(images), seed=3), aug(images, seed=3))
    with pytest.raises(ValueError, match="one shape"):
        augment.train(24)([images[0], images[1, :30]], seed=0)
    assert augment.eval(24)([], seed=0).shape == (0, 3, 24, 24)


# ----------------------------------------------------------------------------- augment units


@pytest.mark.parametrize(("height", "width"), [(32, 32), (20, 50), (50, 20), (4, 300)])
def test_sample_resized_crops_respects_bounds(height, width):
    scale, ratio = (0.08, 1.0), (3 / 4, 4 / 3)
    g = torch.Generator().manual_seed(0)
    crops = augment.sample_resized_crops(4000, height, width, scale=scale, ratio=ratio, generator=g)
    assert crops.shape == (4000, 4) and crops.dtype == torch.int64
    top, left, h, w = crops.T
    assert (top >= 0).all() and (left >= 0).all() and (h >= 1).all() and (w >= 1).all()
    assert (top + h <= height).all() and (left + w <= width).all()
    # Crops found by sampling: some real (h', w') within rounding of (h, w) meets the area and ratio.
    area = height * width
    fallback = (h == h[0]) & (w == w[0]) & (top == top[0]) & (left == left[0]) if height == 4 else torch.zeros_like(h, dtype=bool)
    hf, wf = h.double(), w.double()
    found = ~fallback
    assert ((hf + 0.5) * (wf + 0.5) >= scale[0] * area)[found].all()
    assert ((hf - 0.5) * (wf - 0.5) <= scale[1] * area)[found].all()
    assert ((wf + 0.5) / (hf - 0.5).clamp(min=1e-9) >= ratio[0])[found].all()
    assert ((wf - 0.5) / (hf + 0.5) <= ratio[1])[found].all()
    # Reproducible from the generator's seed, different for another seed.
    again = augment.sample_resized_crops(4000, height, width, scale=scale, ratio=ratio,
                                         generator=torch.Generator().manual_seed(0))
    assert torch.equal(crops, again)
    other = augment.sample_resized_crops(4000, height, width, scale=scale, ratio=ratio,
                                         generator=torch.Generator().manual_seed(1))
    if height != 4:
        assert not torch.equal(crops, other)
        assert len({tuple(c) for c in crops.tolist()}) > 100, "every sample has its own crop"


def test_sample_resized_crops_fallback_is_a_centered_clamped_crop():
    # A 4×300 image cannot hold any crop with aspect ratio ≤ 4/3 and area ≥ 8 %: the fallback
    # is the whole height and a width of round(4 · 4/3) = 5, centered.
    crops = augment.sample_resized_crops(16, 4, 300, generator=torch.Generator().manual_seed(0))
    assert crops.tolist() == [[0, (300 - 5) // 2, 4, 5]] * 16


def smooth_batch(n: int = 6, size: int = 40) -> torch.Tensor:
    y, x = torch.meshgrid(torch.arange(size, dtype=torch.float32), torch.arange(size, dtype=torch.float32),
                          indexing="ij")
    images = torch.stack([128 + 100 * torch.sin(x / 9), 128 + 100 * torch.cos(y / 11),
                          (x + y) * 255 / (2 * size)], dim=-1)  # [size, size, 3]
    return images.round().to(torch.uint8)[None].repeat(n, 1, 1, 1)


def test_uint8_and_kornia_paths_agree():
    pytest.importorskip("kornia")
    images = smooth_batch()
    fast = augment.train(24, path="uint8")
    params = fast.sample(images.shape[0], 40, 40, seed=5)
    a = fast(images, params=params)
    b = augment.train(24, path="kornia")(images, params=params)
    assert a.shape == b.shape == (6, 3, 24, 24)
    diff = (a - b).abs()
    assert diff.mean() < 0.05 and diff.max() < 0.5, (float(diff.mean()), float(diff.max()))


@pytest.mark.parametrize("path", ["uint8", "kornia"])
def test_flip_flag_mirrors(path):
    if path == "kornia":
        pytest.importorskip("kornia")
    images = smooth_batch(4)
    aug = augment.train(24, path=path)
    params = aug.sample(4, 40, 40, seed=9)
    plain = aug(images, params={**params, "flip": torch.zeros(4, dtype=torch.bool)})
    mirrored = aug(images, params={**params, "flip": torch.ones(4, dtype=torch.bool)})
    assert torch.equal(mirrored, plain.flip(-1))
    assert not torch.equal(mirrored, plain)


def test_presets_are_seeded():
    images = smooth_batch(5)
    aug = augment.train(24, color_jitter=0.4)
    assert torch.equal(aug(images, seed=1), aug(images, seed=1))
    assert not torch.equal(aug(images, seed=1), aug(images, seed=2))
    out = augment.eval(24)(images)
    assert out.shape == (5, 3, 24, 24) and out.dtype == torch.float32
