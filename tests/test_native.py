"""The optional compiled kernels (datapipe/_native.c) against torch's arithmetic.

The kernels are what make the CPU presets and the build's resize fast, and they must give the
values the torch path gives. The conversion: every layout, mirrored or not, any width (vector
blocks and scalar tail), strided crops, aligned and unaligned destinations. The resize: the same
bytes as torch's uint8 antialiased bilinear kernel for downscales, upscales, one-axis resizes,
crops read in place and strided destinations. Where a C compiler exists on x86-64 the install must
have built them.
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
import threading

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from datapipe import augment, native

MEAN, STD = augment.IMAGENET_MEAN, augment.IMAGENET_STD
needs_kernel = pytest.mark.skipif(not native.available(), reason=f"native kernel: {native.describe()}")


def reference(src: torch.Tensor, flip: bool) -> torch.Tensor:
    """float64 [3, H, W]: (src / 255 - mean) / std, mirrored when ``flip``."""
    x = src.permute(2, 0, 1).to(torch.float64)
    if flip:
        x = x.flip(2)
    mean = torch.tensor(MEAN, dtype=torch.float64).view(3, 1, 1)
    std = torch.tensor(STD, dtype=torch.float64).view(3, 1, 1)
    return (x / 255.0 - mean) / std


def random_image(h: int, w: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (h, w, 3), dtype=torch.uint8, generator=g)


def test_the_kernel_is_built_where_a_compiler_exists():
    if os.environ.get("DATAPIPE_NATIVE") == "0":
        assert not native.available() and "DATAPIPE_NATIVE=0" in native.describe()
        return
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if compiler and platform.machine() in ("x86_64", "AMD64"):
        assert native.available(), native.describe()
        assert "AVX2" in native.describe()
    else:
        assert "torch kernels" in native.describe()


@needs_kernel
@pytest.mark.parametrize("w", [1, 7, 8, 13, 24, 224, 225])
@pytest.mark.parametrize("flip", [False, True])
@pytest.mark.parametrize("layout", ["planar", "channels_last"])
def test_conversion_matches_torch(w, flip, layout):
    h = 5
    src = random_image(h, w, seed=w)
    conv = native.converter(MEAN, STD)
    if layout == "planar":
        dst = torch.full((3, h, w), float("nan"))
    else:
        dst = torch.full((1, 3, h, w), float("nan")).contiguous(memory_format=torch.channels_last)[0]
    conv(src, dst, flip)
    torch.testing.assert_close(dst.to(torch.float64), reference(src, flip), rtol=0, atol=2e-6)


@needs_kernel
@pytest.mark.parametrize("flip", [False, True])
def test_crops_of_a_larger_image_and_unaligned_destinations(flip):
    image = random_image(40, 50, seed=7)
    crop = image[3:35, 5:45]  # rows strided by the full width
    conv = native.converter(MEAN, STD)
    for offset in (0, 1, 3):  # 1 and 3 floats: not 32-byte aligned, so plain stores are used
        storage = torch.full((offset + 3 * 32 * 40,), float("nan"))
        dst = storage[offset:].view(3, 32, 40)
        conv(crop, dst, flip)
        torch.testing.assert_close(dst.to(torch.float64), reference(crop, flip), rtol=0, atol=2e-6)
        assert torch.isnan(storage[:offset]).all(), "nothing written before the destination"


@needs_kernel
def test_bad_arguments_are_refused_not_written():
    conv = native.converter(MEAN, STD)
    src = random_image(4, 8, seed=1)
    with pytest.raises(ValueError, match="packed uint8"):
        conv(src.permute(1, 0, 2), torch.empty(3, 8, 4), False)  # pixels not packed
    with pytest.raises(ValueError, match="packed uint8"):
        conv(src.float(), torch.empty(3, 4, 8), False)
    with pytest.raises(ValueError, match="float32"):
        conv(src, torch.empty(3, 4, 7), False)
    with pytest.raises(ValueError, match="float32"):
        conv(src, torch.empty(3, 4, 8, dtype=torch.float64), False)
    with pytest.raises(ValueError, match="contiguous or channels_last"):
        conv(src, torch.empty(3, 8, 4).transpose(1, 2), False)


@needs_kernel
@pytest.mark.parametrize("channels_last", [False, True])
def test_presets_give_the_torch_values(monkeypatch, channels_last):
    """The presets and normalize_uint8 with the kernel equal their torch fallback."""
    images = torch.stack([random_image(48, 60, seed=s) for s in range(6)])
    crop_sets = [
        (augment.train(24, channels_last=channels_last), dict(seed=11)),
        (augment.eval(24, channels_last=channels_last), {}),
    ]
    # packed samples, samples whose rows are strided (crops), samples whose pixels are not packed
    sample_sets = [list(images), list(images[:, 2:46, 1:39]), list(images[:, :, ::2])]

    def run_all():
        out = [aug(samples, **kw) for aug, kw in crop_sets for samples in sample_sets]
        out.append(augment.normalize_uint8(images, MEAN, STD, channels_last=channels_last))
        out.append(augment.normalize_uint8(images[:, 4:28, 2:30], MEAN, STD))  # strided rows
        return out

    fast = run_all()
    monkeypatch.setattr(native, "converter", lambda mean, std: None)
    monkeypatch.setattr(native, "resizer", lambda: None)
    slow = run_all()
    for a, b in zip(fast, slow, strict=True):
        assert a.shape == b.shape and a.stride() == b.stride()
        torch.testing.assert_close(a, b, rtol=0, atol=2e-6)


@pytest.mark.parametrize("value", ["0", "off", "False", " no "])
def test_the_switch_turns_the_kernel_off(value):
    """DATAPIPE_NATIVE=off, false or no left the kernels on in silence: only "0" was read."""
    code = ("from datapipe import native, samples; print(native.available(), native.describe(), "
            "samples.partial_decoder() is None, samples.describe_decoder())")
    env = {**os.environ, "DATAPIPE_NATIVE": value}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.startswith("False") and f"DATAPIPE_NATIVE={value.strip().lower()}" in out and " True " in out, out


def test_a_switch_value_that_is_neither_on_nor_off_is_said():
    code = "from datapipe import native; print(native.available())"
    plain = {k: v for k, v in os.environ.items() if k != "DATAPIPE_NATIVE"}
    default = subprocess.run([sys.executable, "-c", code], env=plain, capture_output=True, text=True, check=True)
    done = subprocess.run([sys.executable, "-c", code], env={**plain, "DATAPIPE_NATIVE": "maybe"}, capture_output=True,
                          text=True, check=True)
    assert done.stdout == default.stdout, (done.stdout, default.stdout)
    assert done.stderr.count("DATAPIPE_NATIVE='maybe' is neither on") == 1, done.stderr


@needs_kernel
def test_cpu_presets_and_normalisation_go_through_the_kernel(monkeypatch):
    """The presets' per-sample conversion is the kernel's (one call per sample), not torch's."""
    calls = []
    raw = native.Converter.raw
    monkeypatch.setattr(native.Converter, "raw", lambda self, *a: (calls.append(a), raw(self, *a)))
    images = torch.stack([random_image(40, 40, seed=s) for s in range(5)])
    for run in (lambda: augment.train(24)(list(images), seed=1), lambda: augment.eval(24)(list(images)),
                lambda: augment.normalize_uint8(images, MEAN, STD)):
        calls.clear()
        run()
        assert len(calls) == 5


# ----------------------------------------------------------------------------- the hue turn of the colour jitter


def torchvision_hue(img: torch.Tensor, factors: torch.Tensor) -> torch.Tensor:
    """torchvision's adjust_hue of float [B, 3, H, W] in [0, 1] with a factor per image, written out from its
    _rgb2hsv and _hsv2rgb (torchvision/transforms/_functional_tensor.py), operation for operation."""
    r, g, b = img.unbind(dim=-3)
    maxc, minc = img.max(dim=-3).values, img.min(dim=-3).values
    eqc = maxc == minc
    cr = maxc - minc
    ones = torch.ones_like(maxc)
    s = cr / torch.where(eqc, ones, maxc)
    cr_divisor = torch.where(eqc, ones, cr)
    rc, gc, bc = (maxc - r) / cr_divisor, (maxc - g) / cr_divisor, (maxc - b) / cr_divisor
    hr = (maxc == r) * (bc - gc)
    hg = ((maxc == g) & (maxc != r)) * (2.0 + rc - bc)
    hb = ((maxc != g) & (maxc != r)) * (4.0 + gc - rc)
    h = torch.fmod((hr + hg + hb) / 6.0 + 1.0, 1.0)
    h = (h + factors.view(-1, 1, 1)) % 1.0
    i = torch.floor(h * 6.0)
    f = h * 6.0 - i
    i = i.to(torch.int32) % 6
    v = maxc
    p = torch.clamp(v * (1.0 - s), 0.0, 1.0)
    q = torch.clamp(v * (1.0 - s * f), 0.0, 1.0)
    t = torch.clamp(v * (1.0 - s * (1.0 - f)), 0.0, 1.0)
    mask = i.unsqueeze(dim=-3) == torch.arange(6).view(-1, 1, 1)
    a = torch.stack((torch.stack((v, q, p, p, t, v), dim=-3), torch.stack((t, v, v, q, p, p), dim=-3),
                     torch.stack((p, p, t, v, v, q), dim=-3)), dim=-4)
    return torch.einsum("...ijk, ...xijk -> ...xjk", mask.to(img.dtype), a)


def hue_batches(seed: int):
    """Float batches the jitter meets: 8-bit levels (many ties between channels), greys, pure colours,
    continuous noise; every width class of the vector blocks and their scalar tail."""
    g = torch.Generator().manual_seed(seed)
    for h, w in ((1, 1), (3, 7), (5, 8), (9, 13), (16, 24), (31, 57)):
        levels = torch.randint(0, 256, (4, 3, h, w), generator=g).float() / 255
        levels[1] = levels[1, :1].expand(3, h, w)  # grey: maxc == minc
        levels[2] = torch.tensor([1.0, 0.0, 0.0]).view(3, 1, 1).expand(3, h, w)  # a pure red
        levels[3] = levels[3].mul(4).round().div(4)  # few levels: max shared by two channels
        yield levels
        yield torch.rand(4, 3, h, w, generator=g)


@needs_kernel
@pytest.mark.parametrize("layout", ["planar", "channels_last", "crop"])
def test_hue_kernel_is_torchvisions_adjust_hue_bit_for_bit(layout):
    """The compiled hue turn gives torchvision's float32 values exactly, for every factor range (the ends,
    0, values that wrap the hue past 1 and below 0), every layout the jitter hands it, any width."""
    factors = [torch.tensor([0.5, -0.5, 0.0, 1e-7]), torch.tensor([0.1, -0.1, 0.37, -0.2]),
               torch.tensor([0.49999, -0.49999, 0.25, -0.25])]
    checked = 0
    for k, x in enumerate(hue_batches(seed=3)):
        f = factors[k % len(factors)]
        want = torchvision_hue(x, f)
        if layout == "planar":
            y = x.clone()
        elif layout == "channels_last":
            y = x.contiguous(memory_format=torch.channels_last)
        else:  # a window of a larger batch: rows and planes strided
            big = torch.rand(4, 3, x.shape[2] + 3, x.shape[3] + 5)
            y = big[:, :, 1 : 1 + x.shape[2], 2 : 2 + x.shape[3]]
            y.copy_(x)
        assert native.jitter(y, "hue", f.tolist())
        assert torch.equal(y, want), (x.shape, (y - want).abs().max())
        checked += 1
    assert checked == 12


def torchvision_blend(img: torch.Tensor, op: str, factors: torch.Tensor) -> torch.Tensor:
    """torchvision's adjust_brightness / adjust_contrast / adjust_saturation of float [B, 3, H, W] in [0, 1], a
    factor per image: _blend(img, other, f) = (f * img + (1 - f) * other).clamp(0, 1), other black, the mean
    grey or each pixel's grey (rgb_to_grayscale: 0.2989 R + 0.587 G + 0.114 B)."""
    f = factors.view(-1, 1, 1, 1)
    r, g, b = img.unbind(dim=-3)
    grey = (0.2989 * r + 0.587 * g + 0.114 * b).unsqueeze(dim=-3)
    other = {"brightness": torch.zeros_like(img), "contrast": grey.mean(dim=(-3, -2, -1), keepdim=True),
             "saturation": grey}[op]
    return (f * img + (1.0 - f) * other).clamp(0, 1.0)


@needs_kernel
@pytest.mark.parametrize("op", ["brightness", "contrast", "saturation"])
@pytest.mark.parametrize("layout", ["planar", "channels_last", "crop"])
def test_blend_kernels_are_torchvisions_operations(op, layout):
    """Brightness and saturation give torchvision's float32 values bit for bit; the contrast's mean grey is
    summed in double where torch sums in float32, so its values may differ in their last bit."""
    factors = torch.tensor([0.6, 1.4, 0.0, 1.0])
    for x in hue_batches(seed=5):
        want = torchvision_blend(x, op, factors)
        if layout == "planar":
            y = x.clone()
        elif layout == "channels_last":
            y = x.contiguous(memory_format=torch.channels_last)
        else:
            y = torch.rand(4, 3, x.shape[2] + 2, x.shape[3] + 9)[:, :, 1 : 1 + x.shape[2], 4 : 4 + x.shape[3]]
            y.copy_(x)
        assert native.jitter(y, op, factors.tolist())
        if op == "contrast":
            torch.testing.assert_close(y, want, rtol=0, atol=2.5e-7)
        else:
            assert torch.equal(y, want), (op, x.shape, (y - want).abs().max())


@needs_kernel
def test_cpu_jitter_turns_the_hue_with_the_kernel_and_agrees_with_the_device_path():
    """The preset's hue step on the CPU is the kernel's (torchvision's values exactly), and the Kornia step
    that the device path runs is within 2e-6 of it."""
    from kornia.enhance import adjust_hue

    x = torch.randint(0, 256, (6, 3, 40, 52)).float() / 255
    f = torch.tensor([0.1, -0.1, 0.05, -0.02, 0.0, 0.09])
    cpu = augment._hue(x.clone(), f)
    assert torch.equal(cpu, torchvision_hue(x, f))
    kornia = adjust_hue(x, f * (2 * np.pi)).clamp(0, 1)
    torch.testing.assert_close(cpu, kornia, rtol=0, atol=2e-6)


def test_hue_kernel_declines_what_it_does_not_take():
    """Not float32 [B, 3, H, W] on the CPU (or no kernel): False, and the batch untouched."""
    x = torch.rand(2, 3, 4, 4, dtype=torch.float64)
    assert not native.jitter(x, "hue", [0.1, 0.1])
    x32 = torch.rand(2, 4, 4, 4)
    assert not native.jitter(x32.clone(), "hue", [0.1, 0.1])
    if not native.available():
        y = torch.rand(2, 3, 4, 4)
        before = y.clone()
        assert not native.jitter(y, "hue", [0.1, 0.1]) and torch.equal(y, before)


# ----------------------------------------------------------------------------- the resize


def torch_resize(src: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """torch's uint8 antialiased bilinear resize of [H, W, 3] -> [h, w, 3]."""
    x = src.contiguous().permute(2, 0, 1)[None]
    return F.interpolate(x, size=(h, w), mode="bilinear", antialias=True, align_corners=False)[0].permute(1, 2, 0)


@needs_kernel
@pytest.mark.parametrize("shape", [
    (340, 340, 256, 256),  # a build's center crop
    (389, 321, 256, 256),  # both axes down, unequal
    (180, 150, 224, 224),  # a loader crop: up
    (90, 300, 224, 224),  # up in height, down in width
    (256, 256, 256, 200),  # width only
    (256, 256, 100, 256),  # height only
    (1000, 1200, 97, 113),  # ~10x down: many loads per output
    (1, 1, 5, 7), (7, 5, 1, 1), (2, 600, 3, 5), (3, 17, 9, 16),  # tiny
])
def test_resize_gives_torch_bytes(shape):
    in_h, in_w, h, w = shape
    src = random_image(in_h, in_w, seed=in_h * 7 + in_w)
    out = torch.empty(h, w, 3, dtype=torch.uint8)
    assert native.resize(src, out)
    assert torch.equal(out, torch_resize(src, h, w))


@needs_kernel
def test_resize_gives_torch_bytes_for_random_crops_and_sizes():
    """Crops of larger images (strided rows, unaligned starts) to random sizes, into strided rows."""
    rng = np.random.default_rng(0)
    one_axis = [(256, 256, 256, 200), (100, 37, 100, 224), (256, 256, 100, 256), (9, 300, 40, 300)]
    shapes = one_axis + [tuple(int(v) for v in rng.integers(1, 400, 4)) for _ in range(150)]
    for in_h, in_w, h, w in shapes:
        top, left, pad = (int(v) for v in rng.integers(0, 9, 3))
        big = random_image(in_h + top + 3, in_w + left + pad, seed=int(rng.integers(1 << 30)))
        src = big[top:top + in_h, left:left + in_w]
        canvas = torch.full((h + 2, w + 5, 3), 77, dtype=torch.uint8)
        out = canvas[1:1 + h, 2:2 + w]  # rows strided, not at the start of the buffer
        assert native.resize(src, out)
        assert torch.equal(out, torch_resize(src, h, w)), (in_h, in_w, h, w, top, left)
        rest = canvas.clone()
        rest[1:1 + h, 2:2 + w] = 77
        assert bool((rest == 77).all()), "the resize wrote outside its destination"


@needs_kernel
def test_resize_takes_numpy_arrays_and_grows_its_workspace_in_any_thread():
    src = random_image(1500, 1700, seed=3).numpy()  # the intermediate image alone is ~6 MB
    results = {}

    def run():
        out = np.empty((1200, 1300, 3), np.uint8)
        results["ok"] = native.resize(src[10:, 20:], out)
        results["out"] = out

    t = threading.Thread(target=run)
    t.start()
    t.join()
    assert results["ok"]
    assert np.array_equal(results["out"], torch_resize(torch.from_numpy(src[10:, 20:]), 1200, 1300).numpy())


@needs_kernel
def test_resize_refuses_what_it_cannot_read():
    src = random_image(8, 10, seed=1)
    out = torch.empty(4, 5, 3, dtype=torch.uint8)
    for bad_src, bad_out in [(src.permute(1, 0, 2), out), (src[:, ::2], out), (src.float(), out),
                             (src[..., :2], out), (src, out.float()), (src, out[:, ::2]), (src[:0], out)]:
        with pytest.raises(ValueError, match="packed pixels"):
            native.resize(bad_src, bad_out)
    frozen = np.empty((4, 5, 3), np.uint8)
    frozen.flags.writeable = False
    with pytest.raises(ValueError, match="writable"):
        native.resize(src.numpy(), frozen)


@needs_kernel
def test_build_and_train_preset_resize_through_the_kernel(monkeypatch):
    """A decoded image's fit and each training crop are one kernel call, with torch's pixels."""
    from datapipe.codecs import DecodeSpec, fit_image

    calls = []
    raw = native.Resizer.raw
    monkeypatch.setattr(native.Resizer, "raw", lambda self, *a: (calls.append(a), raw(self, *a)))
    image = random_image(300, 410, seed=5).numpy()
    fitted = fit_image(image, DecodeSpec(size=256))
    assert len(calls) == 1
    assert np.array_equal(fitted, torch_resize(torch.from_numpy(image[:, 55:355]), 256, 256).numpy())
    calls.clear()
    images = torch.stack([random_image(40, 40, seed=s) for s in range(5)])
    augment.train(24)(list(images), seed=1)
    assert len(calls) == 5
