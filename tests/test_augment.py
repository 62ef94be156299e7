"""The batched augmentation (datapipe.augment): crop sampling, the uint8 and Kornia paths, flips,
seeding, lists of samples.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from datapipe import augment
from datapipe.errors import ArgumentError

# ----------------------------------------------------------------------------- DeviceLoader


def test_augment_takes_a_list_of_samples():
    images = smooth_batch(4)
    for aug in (augment.train(24), augment.train(24, color_jitter=0.4), augment.eval(24),
                augment.train(24, path="kornia")):
        assert torch.equal(aug(list(images), seed=3), aug(images, seed=3))
    with pytest.raises(ValueError, match="one shape"):
        augment.convert()([images[0], images[1, :30]], seed=0)
    assert augment.eval(24)([], seed=0).shape == (0, 3, 24, 24)


@pytest.mark.parametrize("jitter", [None, 0.4])
def test_train_crops_samples_of_varying_shapes_over_their_own_extent(jitter):
    """A list of samples of different shapes (an aspect-preserving cache): each sample's crop lies in its
    own extent, and the CPU result equals the device path on the zero-padded batch with the same crops."""
    torch.manual_seed(0)
    shapes = [(40, 90), (90, 40), (50, 50), (30, 70)]
    images = [torch.randint(0, 256, (h, w, 3), dtype=torch.uint8) for h, w in shapes]
    aug = augment.train(24, color_jitter=jitter)
    heights, widths = augment.sample_sizes(images)
    assert heights.tolist() == [h for h, _ in shapes] and widths.tolist() == [w for _, w in shapes]
    params = aug.sample(len(images), heights, widths, seed=5)
    for (top, left, h, w), (sh, sw) in zip(params["crops"].tolist(), shapes, strict=True):
        assert 0 <= top and top + h <= sh and 0 <= left and left + w <= sw
    cpu = aug(images, seed=5)
    device = augment.train(24, color_jitter=jitter, path="device")(augment._stack(images), params=params)
    assert cpu.shape == (4, 3, 24, 24)
    assert (cpu - device).abs().max() < 0.05  # one uint8 level of rounding, normalised


def test_eval_centre_crops_each_sample_of_a_varied_batch_on_its_own():
    torch.manual_seed(1)
    images = [torch.randint(0, 256, (h, w, 3), dtype=torch.uint8) for h, w in [(30, 60), (60, 30), (20, 40)]]
    aug = augment.eval(24)
    out = aug(images)
    for i, x in enumerate(images):
        assert torch.allclose(out[i], aug([x])[0])
    params = aug.sample(3, *augment.sample_sizes(images))
    assert params["crops"].tolist() == [[3, 18, 24, 24], [18, 3, 24, 24], [0, 10, 20, 20]]
    device = augment.eval(24, path="device")(augment._stack(images), params=params)
    assert (out - device).abs().max() < 1e-3


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


def crops_of(batch, height, width, seed=0, **kwargs) -> torch.Tensor:
    return augment.sample_resized_crops(batch, height, width, generator=torch.Generator().manual_seed(seed), **kwargs)


SETTINGS = [{}, {"scale": (0.5, 1.0), "ratio": (1.0, 1.0)}, {"scale": (0.9, 1.0), "ratio": (0.2, 5.0)},
            {"scale": (2.0, 3.0)}]  # the last never fits: every sample falls back


@pytest.mark.parametrize("kwargs", SETTINGS)
def test_per_sample_sizes_keep_each_sample_inside_its_own_image(kwargs):
    """Mixed shapes: every crop lies inside its own sample's image, and each row is exactly the crop
    the int form gives that row (the draws do not depend on the sizes)."""
    g = torch.Generator().manual_seed(5)
    heights = torch.randint(1, 400, (500,), generator=g)
    widths = torch.randint(1, 400, (500,), generator=g)
    heights[:4], widths[:4] = torch.tensor([4, 300, 1, 4000]), torch.tensor([300, 4, 1, 3000])  # fallbacks, a big one
    crops = crops_of(500, heights, widths, seed=9, **kwargs)
    assert crops.shape == (500, 4) and crops.dtype == torch.int64
    top, left, h, w = crops.T
    assert (top >= 0).all() and (left >= 0).all() and (h >= 1).all() and (w >= 1).all()
    assert (top + h <= heights).all() and (left + w <= widths).all()
    for i in range(0, 500, 7):
        assert torch.equal(crops[i], crops_of(500, int(heights[i]), int(widths[i]), seed=9, **kwargs)[i]), i


@pytest.mark.parametrize("kwargs", SETTINGS)
@pytest.mark.parametrize(("height", "width"), [(32, 32), (256, 256), (20, 50), (4, 300), (300, 4), (1, 1), (5000, 5000)])
def test_a_tensor_of_equal_sizes_gives_the_int_forms_crops(height, width, kwargs):
    for seed in range(3):
        ints = crops_of(64, height, width, seed, **kwargs)
        assert torch.equal(crops_of(64, torch.full((64,), height), torch.full((64,), width), seed, **kwargs), ints)
        assert torch.equal(crops_of(64, height, torch.full((64,), width), seed, **kwargs), ints)  # one of each form


def test_the_fallback_is_per_sample():
    """Each sample that cannot hold a crop gets its own image's centred, clamped crop."""
    heights, widths = torch.tensor([4, 300, 32, 4, 10, 10]), torch.tensor([300, 4, 32, 300, 12, 40])
    crops = crops_of(6, heights, widths, seed=1)
    assert crops[0].tolist() == crops[3].tolist() == [0, (300 - 5) // 2, 4, 5]  # too wide: width round(4 · 4/3)
    assert crops[1].tolist() == [(300 - 5) // 2, 0, 5, 4]  # too tall: height round(4 / (3/4))
    assert torch.equal(crops[2], crops_of(6, 32, 32, seed=1)[2])  # one that fits: sampled as usual
    everyone = crops_of(6, heights, widths, seed=1, scale=(2.0, 3.0))  # no crop fits anyone
    assert everyone.tolist() == [[0, 147, 4, 5], [147, 0, 5, 4], [0, 0, 32, 32], [0, 147, 4, 5], [0, 0, 10, 12],
                                 [0, (40 - 13) // 2, 10, 13]]  # 10x12: in range, whole; 10x40: width round(10 · 4/3)


@pytest.mark.parametrize("bad", [torch.full((3,), 8), torch.full((4, 1), 8), torch.full((4,), 8.0), torch.full((4,), 8, dtype=torch.int32)])
def test_per_sample_sizes_of_the_wrong_shape_or_type_are_refused(bad):
    with pytest.raises(ValueError, match="height"):
        crops_of(4, bad, 8)


@pytest.mark.parametrize(("height", "width"), [(0, 10), (-5, 10), (10, 0), (torch.tensor([4, 0]), 8)])
def test_image_sizes_below_one_pixel_are_refused_not_cropped(height, width):
    """They gave boxes of no pixels or outside the image ([0, 5, 0, 0], [-9, 0, 13, 10])."""
    with pytest.raises(ArgumentError, match="at least 1 pixel"):
        crops_of(2, height, width)


def test_convert_is_the_plain_conversion():
    """augment.convert: the cache's own size, normalised or in [0, 1], in its dtype and layout."""
    images = smooth_batch(3, 20)
    mean = torch.tensor(augment.IMAGENET_MEAN).view(1, 3, 1, 1)
    std = torch.tensor(augment.IMAGENET_STD).view(1, 3, 1, 1)
    unit = images.permute(0, 3, 1, 2).float() / 255
    torch.testing.assert_close(augment.convert()(images), (unit - mean) / std, rtol=0, atol=1e-5)
    torch.testing.assert_close(augment.convert(normalize=False)(images), unit, rtol=0, atol=0)
    torch.testing.assert_close(augment.convert(mean=(0.5, 0.5, 0.5), std=(0.25, 0.5, 1.0))(list(images)),
                               (unit - 0.5) / torch.tensor([0.25, 0.5, 1.0]).view(1, 3, 1, 1), rtol=0, atol=1e-5)
    for kwargs in ({}, {"normalize": False}, {"module": torch.nn.Identity()}):
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            for channels_last in (False, True):
                out = augment.convert(dtype=dtype, channels_last=channels_last, **kwargs)(images, seed=0)
                assert out.shape == (3, 3, 20, 20) and out.dtype == dtype
                assert out.is_contiguous(memory_format=torch.channels_last if channels_last else torch.contiguous_format)
    buf = torch.empty(5, 3, 20, 20)
    assert augment.convert()(images, out=buf).data_ptr() == buf.data_ptr(), "the normalised output fills ``out``"


def test_convert_seeds_a_generic_module_and_leaves_the_global_generator_alone():
    class Noise(torch.nn.Module):
        def forward(self, x):
            return x + torch.rand(x.shape[0], 1, 1, 1)

    images, conv = smooth_batch(4, 8), augment.convert(module=Noise(), normalize=False)
    torch.manual_seed(123)
    before = torch.rand(1)
    torch.manual_seed(123)
    a, b, c = conv(images, seed=7), conv(images, seed=7), conv(images, seed=8)
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert torch.equal(torch.rand(1), before), "the module's draws do not move the caller's generator"
    unit = images.permute(0, 3, 1, 2).float() / 255
    assert ((a - unit) >= 0).all() and ((a - unit) < 1).all(), "the module sees [0, 1] floats, before normalisation"


@pytest.mark.parametrize("kwargs", [
    {"dtype": torch.int8}, {"dtype": "float32"}, {"mean": (0.5, 0.5)}, {"mean": "abc"}, {"std": (0.2, 0.0, 0.2)},
    {"std": (0.2, float("nan"), 0.2)}, {"channels_last": "yes"}, {"channels_last": 1},
    # finite in Python, not in float32, where the normalisation runs: every output would be inf or NaN
    {"std": (1e-300, 1.0, 1.0)}, {"std": (1e-40, 1.0, 1.0)}, {"mean": (1e300, 0.0, 0.0)}, {"mean": (-1e39, 0.0, 0.0)},
    {"mean": (1e30, 0.0, 0.0), "std": (1e-9, 1.0, 1.0)},
])
@pytest.mark.parametrize("make", [augment.convert, augment.train, augment.eval])
def test_the_output_form_is_checked_by_every_transform(make, kwargs):
    with pytest.raises(ArgumentError, match=next(iter(kwargs))) as excinfo:
        make(**kwargs)
    assert "\n" not in str(excinfo.value)


@pytest.mark.parametrize(("make", "kwargs"), [
    (augment.convert, {"normalize": "no"}), (augment.convert, {"module": "flip"}), (augment.train, {"size": 0}),
    (augment.eval, {"size": 2.5}), (augment.train, {"path": "gpu"}), (augment.train, {"size": None}),
    (augment.eval, {"size": None}), (augment.TrainAugment, {"size": None}), (augment.EvalAugment, {"size": None}),
    (augment.convert, {"module": augment.TrainAugment}), (augment.convert, {"module": torch.nn.Identity}),
])
def test_transform_arguments_are_checked(make, kwargs):
    with pytest.raises(ArgumentError, match=next(iter(kwargs))):
        make(**kwargs)


@pytest.mark.parametrize("kwargs", [
    {"color_jitter": "0.4"}, {"color_jitter": (0.4, 0.4, 0.4)}, {"color_jitter": -1}, {"color_jitter": float("nan")},
    {"color_jitter": (0.4, 0.4, 0.4, 0.9)}, {"color_jitter": (0.4, -0.1, 0.4, 0.1)}, {"color_jitter": (0.4, "a", 0.4, 0.1)},
    {"scale": (1.0, 0.08)}, {"scale": (-1, 0.5)}, {"scale": (0.08,)}, {"scale": "0.08"}, {"scale": (0.08, float("inf"))},
    {"ratio": (0, 0)}, {"ratio": (1.0,)}, {"ratio": (4 / 3, 3 / 4)}, {"flip": 2}, {"flip": -0.1}, {"flip": True},
    {"flip": "0.5"},
])
def test_train_preset_parameters_are_checked_when_it_is_made(kwargs):
    """Every parameter of augment.train is refused at once with a line naming it (torchvision's rules: scale and ratio
    (min, max) with 0 < min <= max, a flip probability, four jitter ranges >= 0 with the hue at most 0.5), never at the
    first batch with an error from inside the preset."""
    with pytest.raises(ArgumentError, match=next(iter(kwargs))) as excinfo:
        augment.train(32, **kwargs)
    assert "\n" not in str(excinfo.value)


def test_train_preset_parameters_that_torchvision_takes_are_taken():
    aug = augment.train(32, scale=[0.5, 0.5], ratio=(1, 1), flip=0, color_jitter=(0, 0.2, 0, 0.5))
    assert (aug.scale, aug.ratio, aug.flip, aug.color_jitter) == ((0.5, 0.5), (1.0, 1.0), 0.0, (0.0, 0.2, 0.0, 0.5))
    assert augment.train(32, color_jitter=0.4).color_jitter == (0.4, 0.4, 0.4, 0.1)
    assert augment.train(32, color_jitter=0).color_jitter is None


@pytest.mark.parametrize("name", ["train", "eval", "convert"])
def test_a_preset_function_given_for_the_preset_says_to_call_it(tmp_path, name):
    """augment=augment.train (the function, not the preset it makes) is refused by the loader at once, saying
    to pass augment.train(224)."""
    fn = getattr(augment, name)
    with pytest.raises(ArgumentError, match=rf"pass its result, e\.g\. augment={name}\(") as excinfo:
        augment.convert(module=fn)
    assert "\n" not in str(excinfo.value)
    if name != "convert":
        with pytest.raises(ArgumentError, match=rf"augment={name}\(224\)"):
            fn(torch.zeros(2, 8, 8, 3, dtype=torch.uint8))


@pytest.mark.parametrize("name", ["train", "eval"])
@pytest.mark.parametrize("size", [(20, 30), [224, 224], (224,)])
def test_a_height_and_width_pair_is_refused_as_such(name, size):
    """torchvision's presets take (h, w); datapipe's make squares and say so, not "you passed a batch"."""
    with pytest.raises(ArgumentError, match=r"makes square outputs and takes one int \(224\)") as excinfo:
        getattr(augment, name)(size)
    assert "\n" not in str(excinfo.value) and "not augment=" not in str(excinfo.value)


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


@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("make", [
    lambda **kw: augment.train(24, **kw), lambda **kw: augment.train(24, color_jitter=0.4, **kw),
    lambda **kw: augment.train(24, path="device", **kw), lambda **kw: augment.eval(24, **kw),
    lambda **kw: augment.eval(64, **kw), lambda **kw: augment.convert(**kw),
    lambda **kw: augment.convert(normalize=False, **kw), lambda **kw: augment.convert(module=torch.nn.Identity(), **kw),
], ids=["train", "train-jitter", "train-device", "eval", "eval-upscale", "convert", "convert-unnormalised", "module"])
def test_an_empty_batch_has_the_form_of_a_full_one(make, channels_last):
    """A rank's empty last batch: the dtype and memory layout of a full batch, from a tensor, a list or JPEG samples."""
    aug = make(dtype=torch.bfloat16, channels_last=channels_last)
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    full = aug(smooth_batch(2), seed=0)
    empties = [aug(smooth_batch(2)[:0], seed=0), aug([], seed=0)]
    if hasattr(aug, "decode"):
        empties.append(aug.decode([], seed=0))
    assert full.dtype == torch.bfloat16 and full.is_contiguous(memory_format=fmt)
    for empty in empties:
        assert len(empty) == 0 and empty.dtype == full.dtype and empty.is_contiguous(memory_format=fmt)
        if all(empty.shape[1:]):  # a conversion of an empty list knows no size: [0, 3, 0, 0]
            assert empty.stride() == torch.empty(empty.shape, memory_format=fmt).stride()
    assert empties[0].shape[1:] == full.shape[1:]


# ----------------------------------------------------------------------------- colour jitter: torchvision's ColorJitter


def _reference_jitter(image: np.ndarray, factors: list[float], order: list[int]) -> np.ndarray:
    """torchvision's ColorJitter on one float [3, h, w] image in [0, 1], written out from its definitions:
    brightness multiplies, contrast blends with the image's mean grey, saturation with each pixel's grey
    (grey = 0.2989 R + 0.587 G + 0.114 B), hue turns HSV's hue (colorsys); each result clamped to [0, 1],
    the four in the image's own order."""
    import colorsys

    x = image.astype(np.float64)
    for op in order:
        f = factors[op]
        gray = 0.2989 * x[0] + 0.587 * x[1] + 0.114 * x[2]
        if op == 0:
            x = np.clip(x * f, 0, 1)
        elif op == 1:
            x = np.clip(f * x + (1 - f) * gray.mean(), 0, 1)
        elif op == 2:
            x = np.clip(f * x + (1 - f) * gray[None], 0, 1)
        else:
            out = np.empty_like(x)
            for i in range(x.shape[1]):
                for j in range(x.shape[2]):
                    h, s, v = colorsys.rgb_to_hsv(*x[:, i, j])
                    out[:, i, j] = colorsys.hsv_to_rgb((h + f) % 1.0, s, v)
            x = out
    return x


@pytest.mark.parametrize("path", ["device", "uint8"])
def test_colour_jitter_is_torchvisions_color_jitter_in_each_images_own_order(path):
    """augment.train(size, color_jitter=0.4) is torchvision's ColorJitter(0.4, 0.4, 0.4, 0.1) after the crop:
    each image's factors and order applied as torchvision defines the four operations (the former jitter
    added the brightness factor and scaled for contrast: up to +0.4 on a dark image)."""
    g = torch.Generator().manual_seed(3)
    images = torch.randint(0, 256, (12, 20, 20, 3), dtype=torch.uint8, generator=g)
    images[0] = 20  # dark and flat: brightness must scale it, contrast leave it
    aug = augment.train(12, color_jitter=0.4, path=path, mean=(0.0, 0.0, 0.0), std=(1.0, 1.0, 1.0))
    params = aug.sample(12, 20, 20, seed=5)
    assert sorted(map(tuple, params["jitter_order"].sort(dim=1).values.tolist())) == [(0, 1, 2, 3)] * 12
    assert len({tuple(o) for o in params["jitter_order"].tolist()}) > 1  # orders differ between images
    got = aug(images, params=params).double()
    plain = augment.train(12, path=path, mean=(0.0, 0.0, 0.0), std=(1.0, 1.0, 1.0))(
        images, params={k: v for k, v in params.items() if not k.startswith("jitter")}).double()
    tol = 1e-5 if path == "device" else 3 / 255  # the uint8 path rounds its crop first: the same crop is the input
    for i in range(12):
        want = _reference_jitter(plain[i].numpy(), params["jitter"][i].tolist(), params["jitter_order"][i].tolist())
        assert np.abs(got[i].numpy() - want).max() <= tol + 1e-6, (i, np.abs(got[i].numpy() - want).max())


def test_colour_jitter_draws_torchvisions_ranges_and_every_order():
    params = augment.train(32, color_jitter=(0.4, 0.3, 0.2, 0.1)).sample(20_000, 64, 64, seed=0)
    f = params["jitter"]
    for k, (lo, hi) in enumerate([(0.6, 1.4), (0.7, 1.3), (0.8, 1.2), (-0.1, 0.1)]):
        assert lo <= float(f[:, k].min()) and float(f[:, k].max()) <= hi and abs(float(f[:, k].mean()) - (lo + hi) / 2) < 0.01
    order = params["jitter_order"]
    for step in range(4):  # each operation at each step about a quarter of the time
        counts = torch.bincount(order[:, step], minlength=4).double() / len(order)
        assert float((counts - 0.25).abs().max()) < 0.02, counts


@pytest.mark.parametrize("path", ["device", "uint8"])
@pytest.mark.parametrize(("h", "w"), [(227, 230), (231, 224), (229, 227), (234, 233)])
def test_eval_centre_crop_offsets_are_torchvisions(path, h, w):
    """augment.eval(224) of a sample at least 224 on each side is torchvision's CenterCrop(224): the window at
    round((n - 224) / 2), half to even (a margin of 3 puts 2 before it, 7 puts 4), for whole batches, for
    samples of varying shapes, and for the crops the loader draws for a padded batch."""
    g = torch.Generator().manual_seed(h * w)
    image = torch.randint(0, 256, (h, w, 3), dtype=torch.uint8, generator=g)
    top, left = int(round((h - 224) / 2.0)), int(round((w - 224) / 2.0))
    unit = dict(mean=(0.0, 0.0, 0.0), std=(1.0, 1.0, 1.0))
    want = image[top : top + 224, left : left + 224].permute(2, 0, 1).float() / 255
    aug = augment.eval(224, path=path, **unit)
    other = torch.randint(0, 256, (h + 1, w + 2, 3), dtype=torch.uint8, generator=g)
    for got in (aug(image[None])[0], aug([image, other])[0]):
        assert torch.allclose(got, want, atol=1e-6)
    assert aug.sample(1, torch.tensor([h]), torch.tensor([w]))["crops"].tolist() == [[top, left, 224, 224]]


@pytest.mark.parametrize("path", ["device", "uint8"])
@pytest.mark.parametrize(("h", "w"), [(32, 64), (64, 32), (100, 40), (33, 47), (40, 40)])
def test_eval_larger_than_a_sample_keeps_its_aspect(path, h, w):
    """augment.eval(S) of a sample smaller than S on a side (testing at a higher resolution than the cache's
    --size) resized the whole sample to S x S: a 32x64 sample came out squashed 2:1. It is torchvision's
    Resize(S) + CenterCrop(S) on the stored sample: its centred square, resized to S, for whole batches, samples
    of varying shapes, and the crops the loader draws for a padded batch."""
    s = 48
    g = torch.Generator().manual_seed(h * w)
    image = torch.randint(0, 256, (h, w, 3), dtype=torch.uint8, generator=g)
    image[h // 2 - 4 : h // 2 + 4, w // 2 - 4 : w // 2 + 4] = 255  # an 8x8 square at the centre
    m = min(h, w)
    top, left = int(round((h - m) / 2.0)), int(round((w - m) / 2.0))
    unit = dict(mean=(0.0, 0.0, 0.0), std=(1.0, 1.0, 1.0))
    square = image[top : top + m, left : left + m].permute(2, 0, 1)[None].float() / 255
    want = torch.nn.functional.interpolate(square, size=(s, s), mode="bilinear", antialias=True, align_corners=False)[0]
    aug = augment.eval(s, path=path, **unit)
    other = torch.randint(0, 256, (h + 1, w + 2, 3), dtype=torch.uint8, generator=g)
    crops = aug.sample(1, torch.tensor([h]), torch.tensor([w]))
    assert crops["crops"].tolist() == [[top, left, m, m]]
    padded = augment.eval(s, path="device", **unit)(image[None], params=crops)[0]
    for got in (aug(image[None])[0], aug([image, other])[0], padded):
        assert got.shape == (3, s, s) and (got - want).abs().max() < 2e-3
        white = (got[0] > 0.99).nonzero()  # the square stays square
        height, width = (white.max(0).values - white.min(0).values + 1).tolist()
        assert abs(height - width) <= 1, (height, width)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_module_gets_float32_whatever_the_output_dtype_and_the_output_is_rounded_once(dtype):
    """convert(module=m, dtype=bf16/fp16): m gets float32 in [0, 1] (a float32 conv ran on bf16 input and failed),
    and the output is the float32 result rounded once (it was rounded before the module and the normalisation)."""
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(3, 3, 1, bias=False)
    with torch.no_grad():
        conv.weight.copy_(torch.eye(3).view(3, 3, 1, 1))  # the identity, in float32 weights
    images = torch.randint(0, 256, (4, 8, 8, 3), dtype=torch.uint8)
    with torch.no_grad():
        got = augment.convert(module=conv, dtype=dtype)(images, seed=1)
        want = augment.convert(module=conv)(images, seed=1).to(dtype)
    assert got.dtype == dtype and torch.equal(got, want)


class _Returns(torch.nn.Module):
    def __init__(self, make):
        super().__init__()
        self.make = make

    def forward(self, x):
        return self.make(x)


@pytest.mark.parametrize(("make", "says"), [
    (lambda x: (x * 255).to(torch.uint8), "torch.uint8"), (lambda x: x[1:], f"({3}, 3, 8, 8)"),
    (lambda x: x[:, :1], "(4, 1, 8, 8)"), (lambda x: (x, torch.zeros(4)), "a tuple (a batch transform that also changes"),
    (lambda x: x[0], "(3, 8, 8)"),
])
def test_a_modules_output_that_is_no_batch_of_the_same_samples_is_refused(make, says):
    """A module that drops a sample, returns uint8, one channel or (images, labels) is refused in one line naming it
    (a dropped sample unpaired images and labels; uint8 gave inf and NaN; one channel was broadcast to three)."""
    images = torch.randint(0, 256, (4, 8, 8, 3), dtype=torch.uint8)
    with pytest.raises(ArgumentError, match="augment module _Returns must return a float") as excinfo:
        augment.convert(module=_Returns(make))(images, seed=1)
    assert says in str(excinfo.value) and "\n" not in str(excinfo.value)
