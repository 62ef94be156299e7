"""Batch augmentation on the device, with per-sample random parameters drawn from a given seed.

``augment.train(size)`` — RandomResizedCrop (torchvision's parameter sampling), horizontal flip and
optional colour jitter — and ``augment.eval(size)`` — center crop — take a whole uint8 NHWC batch
and return a normalised float NCHW batch; ``augment.convert()`` is the plain conversion, with no
randomness, that the DeviceLoader uses without augmentation. Each transform holds the output's form:
``dtype``, normalisation (``mean``, ``std``) and memory layout (``channels_last``); the loader has
none of these options. Parameters are drawn first, from a ``torch.Generator``
seeded by the caller (the DeviceLoader derives it from (seed, epoch, batch position)), so a
resumed run augments identically and no two batches share random numbers.

Two ways to apply the same parameters, which give the same pixels as torchvision's
RandomResizedCrop (half-pixel centres, antialiased bilinear resize):

* ``device`` (the default on CUDA; ``kornia`` is its former name): the whole batch is cropped and
  resized in two batched matrix products (:func:`crop_and_resize`: per-sample weight matrices of
  torch's antialiased bilinear filter, built on the device for the whole batch at once), the flip
  folded into the weights; colour jitter (torchvision's ColorJitter, each image's operations in its own
  order) and normalisation run batched in float32, and the result is cast to the output dtype at the end.
* ``uint8`` (the default on CPU): each crop is resized on uint8 with an antialiased bilinear kernel,
  then mirrored, converted and normalised into its slot of the batch in one pass (both the compiled
  kernels of :mod:`datapipe.native`, or torch's kernels, which give the same values, where they are
  not built) — converting a full 256² batch to float first costs more than the whole augmentation
  on a CPU.

Both equal ``F.interpolate(crop, mode="bilinear", antialias=True, align_corners=False)`` of each
crop: the device path to float precision, the uint8 path to its rounding (mean ~0.001 in [0, 1]
units on photographs and noise).

Shape:
    input: uint8 [B, H, W, 3] (on any device); output: float [B, 3, size, size], normalised.

Example:
    >>> import torch, datapipe
    >>> aug = datapipe.augment.train(32)
    >>> aug(torch.zeros(4, 48, 48, 3, dtype=torch.uint8), seed=0).shape
    torch.Size([4, 3, 32, 32])
"""

from __future__ import annotations

import functools
import math
import numbers
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import torch
from torch import nn

from . import native, samples
from .dataset import check_int, is_int
from .errors import ArgumentError, check_bool
from .samples import decode_crop, decode_jpeg
from .text import show

if TYPE_CHECKING:
    from .cache import EncodedSample

Box = tuple[int, int, int, int]  # a crop: top, left, height, width

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
Path_ = Literal["auto", "uint8", "device", "kornia"]
# A batch: uint8 [B, H, W, 3], or a list of uint8 [H, W, 3] samples (views into the cache's shard
# files, which the CPU loader hands over so that only the cropped pixels are ever read).
Batch = torch.Tensor | list[torch.Tensor]
# A third-party augmentation on float [B, 3, H, W] batches in [0, 1] (an nn.Module or any callable).
BatchFn = Callable[[torch.Tensor], torch.Tensor]


def _stack(images: Batch) -> torch.Tensor:
    """One uint8 [B, H, W, 3] tensor of the batch; samples of different shapes are padded with zeros
    at the bottom and right to the largest (a crop inside each sample's own extent never reads the padding)."""
    if isinstance(images, torch.Tensor):
        return images
    if not images:  # an empty batch: no sample says its size
        return torch.empty((0, 0, 0, 3), dtype=torch.uint8)
    if all(x.shape == images[0].shape for x in images):
        return torch.stack(images)
    h, w = max(x.shape[0] for x in images), max(x.shape[1] for x in images)
    out = images[0].new_zeros((len(images), h, w, 3))
    for i, x in enumerate(images):
        out[i, : x.shape[0], : x.shape[1]] = x
    return out


def sample_sizes(images: Batch) -> tuple[int | torch.Tensor, int | torch.Tensor]:
    """(heights, widths) of a batch's samples: ints when they share one shape, else int64 [B] tensors."""
    if isinstance(images, torch.Tensor) or not images or all(x.shape == images[0].shape for x in images):
        first = images[0] if len(images) else torch.empty((0, 0, 3))
        return int(first.shape[0]), int(first.shape[1])
    return (torch.tensor([x.shape[0] for x in images], dtype=torch.int64),
            torch.tensor([x.shape[1] for x in images], dtype=torch.int64))


def normalize_uint8(images: torch.Tensor, mean: Sequence[float], std: Sequence[float], *, dtype: torch.dtype = torch.float32,
                    channels_last: bool = False, out: torch.Tensor | None = None) -> torch.Tensor:
    """uint8 NHWC -> normalised float NCHW: on the CPU one pass per sample through the compiled
    kernel (:mod:`datapipe.native`) where it is built, else a converting copy and an in-place scale and shift.

    ``out`` (float [>=B, 3, H, W]) is filled when given: on the CPU, writing into memory that is
    already mapped is several times faster than allocating a fresh 150 MB tensor per batch.
    """
    b, h, w, _ = images.shape
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    out = torch.empty((b, 3, h, w), dtype=torch.float32, device=images.device, memory_format=fmt) if out is None else out[:b]
    if images.device.type == "cpu":
        _normalize_into(images, out, mean, std)
    else:
        scale, shift = _scale_shift(mean, std, images.device)
        out.copy_(images.permute(0, 3, 1, 2)).mul_(scale).add_(shift)
    return out if out.dtype == dtype else out.to(dtype)


def _normalize_into(samples: Batch, out: torch.Tensor, mean: Sequence[float], std: Sequence[float], top: int = 0, left: int = 0) -> None:
    """CPU: out[i] = the normalised [h, w] window at (top, left) of uint8 sample i, sample by sample
    while it is in cache. ``out``: float32 [B, 3, h, w], contiguous or channels_last. One pass per
    sample through the compiled kernel (datapipe/native.py) where it is built and a sample's pixels
    are packed; torch's ops otherwise."""
    h, w = out.shape[2:]
    conv = native.converter(tuple(mean), tuple(std))
    if conv is not None:
        base, step, planar = conv.destination(out, h, w)
    scale, shift = _scale_shift(mean, std, out.device)
    for i in range(len(samples)):
        x = samples[i]
        if conv is not None and x.stride()[1:] == (3, 1):
            rs = x.stride(0)
            conv.raw(x.data_ptr() + top * rs + left * 3, h, w, rs, False, planar, base + i * step)
        else:
            window = x[top : top + h, left : left + w].permute(2, 0, 1)
            torch.addcmul(shift, window.float(), scale, out=out[i])


def _check_crop(x: torch.Tensor, top: int, left: int, h: int, w: int) -> None:
    if top < 0 or left < 0 or h < 1 or w < 1 or top + h > x.shape[0] or left + w > x.shape[1]:
        raise ValueError(f"crop (top {top}, left {left}, {h}x{w}) outside a sample of {tuple(x.shape)}")


def _resize_crop(x: torch.Tensor, top: int, left: int, h: int, w: int, dst: torch.Tensor,
                 resizer: native.Resizer | None, resize: Callable[..., object]) -> None:
    """Resize the (top, left, h, w) crop of uint8 sample ``x`` [H, W, 3] into the packed uint8 [s, s, 3]
    tensor ``dst``: the compiled kernel (``resizer``, datapipe/native.py) where it is built and x's
    pixels are packed, read in place; torch's kernel (``resize``) otherwise. Both give the same pixels."""
    if resizer is not None and x.stride()[1:] == (3, 1) and x.device.type == "cpu":
        _check_crop(x, top, left, h, w)
        row = x.stride(0)
        resizer.raw(x.data_ptr() + top * row + left * 3, h, w, row, dst.data_ptr(), dst.shape[0], dst.shape[1],
                    dst.stride(0))
    else:
        resize(_crop_chw(x, top, left, h, w), list(dst.shape[:2]), False, None, None, out=dst.permute(2, 0, 1)[None])


def _crop_chw(x: torch.Tensor, top: int, left: int, h: int, w: int) -> torch.Tensor:
    """The crop of a uint8 [H, W, 3] sample as the [1, 3, h, w] channels-last view the resize takes."""
    _check_crop(x, top, left, h, w)
    if x.is_contiguous():  # one view instead of four: this runs once per sample
        rs = x.stride(0)
        return x.as_strided((1, 3, h, w), (3 * h * w, 1, rs, 3), x.storage_offset() + top * rs + left * 3)
    return x[top : top + h, left : left + w].permute(2, 0, 1)[None]


def _resize_aa() -> Callable[..., object]:
    """torch's antialiased bilinear resize with ``out=``: the direct binding where torch has it
    (~2 µs less per call than the boxed ``torch.ops`` path; this runs once per sample)."""
    return getattr(torch._C._nn, "_upsample_bilinear2d_aa", None) or torch.ops.aten._upsample_bilinear2d_aa.out


def _scale_shift(mean: Sequence[float], std: Sequence[float], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`datapipe.native.scale_shift` as tensors of shape [3, 1, 1] on ``device`` (made once per device)."""
    scale, shift = native.scale_shift(mean, std)
    return _channels(tuple(scale), device, torch.float32), _channels(tuple(shift), device, torch.float32)


@functools.lru_cache(maxsize=64)
def _channels(values: tuple[float, ...], device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """Per-channel constants as a [3, 1, 1] tensor on ``device``, made once: a tensor made from Python numbers
    on a CUDA device is a blocking copy, which waits for all the work queued on the stream (the training
    step before) and would stop the host from running ahead of the device at every batch."""
    return torch.tensor(values, dtype=dtype).view(3, 1, 1).to(device)


def _scale_shift_(x: torch.Tensor, mean: Sequence[float], std: Sequence[float]) -> torch.Tensor:
    """In place: float [B, 3, h, w] in 0..255 units -> normalised, with the scale and shift the CPU kernel uses."""
    scale, shift = _scale_shift(mean, std, x.device)
    return x.mul_(scale).add_(shift)


def _channel_triple(values: Iterable[float], what: str, *, nonzero: bool = False) -> tuple[float, float, float]:
    """Three finite per-channel numbers (RGB), for ``mean`` and ``std``: a sequence in channel order (a set has
    none: {0.485, 0.456, 0.406} iterates as (0.485, 0.406, 0.456); a string's characters are no numbers)."""
    try:
        given = values.tolist() if hasattr(values, "tolist") and not isinstance(values, (list, tuple)) else values
        ordered = not isinstance(given, (set, frozenset, dict, str, bytes))
        items = tuple(given) if ordered else ()
        triple = tuple(float(v) for v in items) if all(_number(v) is not None for v in items) else ()
    except (TypeError, ValueError):
        triple = ()
    if len(triple) != 3 or not all(math.isfinite(v) and (v != 0 or not nonzero) for v in triple):
        need = "three finite, non-zero numbers" if nonzero else "three finite numbers"
        raise ArgumentError(f"{what} must be {need} (R, G, B), got {show(values)}")
    return triple


def _check_float32(mean: tuple[float, float, float], std: tuple[float, float, float]) -> None:
    """The normalisation is applied in float32 (as a scale and a shift, see :func:`datapipe.native.scale_shift`):
    a ``mean`` or ``std`` that is finite in Python but not there (1e-300 is 0, 1e300 infinite) would turn every
    output into inf or NaN."""
    f32 = torch.finfo(torch.float32)
    for name, values in (("mean", mean), ("std", std)):
        for v in values:
            if abs(v) > f32.max or (name == "std" and abs(v) < f32.tiny):
                held = f"{f32.tiny:.3g} to {f32.max:.3g}" if name == "std" else f"at most {f32.max:.3g}"
                raise ArgumentError(f"{name} must be numbers float32 holds ({held} in size), got {show(values)}")
    scale, shift = native.scale_shift(mean, std)
    if not all(math.isfinite(v) and abs(v) <= f32.max for v in (*scale, *shift)):
        raise ArgumentError(f"mean {show(mean)} and std {show(std)} give a normalisation (x / 255 - mean) / std that "
                            "float32 cannot hold; use values of ordinary size (ImageNet's are about 0.45 and 0.22)")


def _normalize_float(x: torch.Tensor, mean: Sequence[float], std: Sequence[float]) -> torch.Tensor:
    m, s = _channels(tuple(mean), x.device, x.dtype), _channels(tuple(std), x.device, x.dtype)
    return (x - m) / s


def _generator(seed: int | None) -> torch.Generator:
    g = torch.Generator(device="cpu")
    if seed is None:
        g.seed()
    else:
        g.manual_seed(int(seed) & 0xFFFF_FFFF_FFFF)
    return g


def sample_resized_crops(batch: int, height: int | torch.Tensor, width: int | torch.Tensor, *,
                         scale: Sequence[float] = (0.08, 1.0), ratio: Sequence[float] = (3 / 4, 4 / 3),
                         generator: torch.Generator) -> torch.Tensor:
    """torchvision's RandomResizedCrop parameters for ``batch`` samples: int64 [B, 4] (top, left, h, w).

    Ten attempts per sample at a random area and log-uniform aspect ratio; the first that fits
    wins; otherwise a center crop with the aspect ratio clamped to ``ratio``.

    ``height`` and ``width`` are one image size for the whole batch (ints) or each sample's own
    (int64 [B]). The random draws are the same either way, so a tensor of equal sizes gives the
    crops of the int form: one generator stream, whatever the samples' shapes.
    """
    batch = check_int(batch, "batch", 0)
    scale, ratio = _range_pair(scale, "scale"), _range_pair(ratio, "ratio")
    if not isinstance(generator, torch.Generator):
        raise ArgumentError(f"generator must be a torch.Generator, got {type(generator).__name__}")
    if batch == 0:
        return torch.empty((0, 4), dtype=torch.int64)
    per_sample = isinstance(height, torch.Tensor) or isinstance(width, torch.Tensor)
    hs, ws = _sizes(height, batch, "height"), _sizes(width, batch, "width")  # int64 [B]
    if int(hs.min()) < 1 or int(ws.min()) < 1:
        raise ArgumentError(f"image sizes must be at least 1 pixel, got height {show(height)}, width {show(width)}")
    tries = 10
    # the ints stay Python ints: a scalar times the draws, exactly as before per-sample sizes
    area = (hs * ws)[:, None] if per_sample else int(height) * int(width)
    target = area * torch.empty(batch, tries).uniform_(scale[0], scale[1], generator=generator)  # [B, 10]
    log_r = torch.empty(batch, tries).uniform_(math.log(ratio[0]), math.log(ratio[1]), generator=generator)
    aspect = torch.exp(log_r)
    w = torch.round(torch.sqrt(target * aspect)).to(torch.int64)  # [B, 10]
    h = torch.round(torch.sqrt(target / aspect)).to(torch.int64)
    ok = (w > 0) & (w <= ws[:, None]) & (h > 0) & (h <= hs[:, None])  # [B, 10]
    first = torch.argmax(ok.to(torch.int8), dim=1)  # [B]: first attempt that fits
    found = ok.any(dim=1)
    rows = torch.arange(batch)
    h_sel, w_sel = h[rows, first], w[rows, first]  # [B]
    u = torch.rand(batch, 2, generator=generator)
    top = torch.floor(u[:, 0] * (hs - h_sel + 1).to(torch.float32)).to(torch.int64)
    left = torch.floor(u[:, 1] * (ws - w_sel + 1).to(torch.float32)).to(torch.int64)
    params = torch.stack([top, left, h_sel, w_sel], dim=1)  # [B, 4]
    return torch.where(found[:, None], params, _fallback_crops(hs, ws, ratio))


def _sizes(size: int | torch.Tensor, batch: int, what: str) -> torch.Tensor:
    """An image side as int64 [batch]: an int for every sample, or each sample's own."""
    if not isinstance(size, torch.Tensor):
        if not is_int(size):  # never truncated (2.7 as 2) nor parsed ("10")
            raise ArgumentError(f"{what} must be an integer or an int64 tensor [{batch}], got {show(size)}")
        if size > MAX_SIDE:  # its area's arithmetic would pass int64
            raise ArgumentError(f"{what} must be at most {MAX_SIDE:,} pixels, got {show(size)}")
        return torch.full((batch,), int(size), dtype=torch.int64)
    if size.shape != (batch,) or size.dtype != torch.int64:
        raise ValueError(f"{what} must be an int or an int64 tensor [{batch}], got {tuple(size.shape)} {size.dtype}")
    if batch and int(size.max()) > MAX_SIDE:
        raise ArgumentError(f"{what} must be at most {MAX_SIDE:,} pixels, got {int(size.max()):,}")
    return size.cpu()


MAX_SIDE = 2**31 - 1  # an image side sample_resized_crops takes: height × width within int64


def _fallback_crops(hs: torch.Tensor, ws: torch.Tensor, ratio: Sequence[float]) -> torch.Tensor:
    """Per sample: the whole image with its aspect ratio clamped into ``ratio``, centered: int64 [B, 4].

    float64 and round-half-to-even, as Python's ``round`` of the same quotients."""
    hf, wf = hs.to(torch.float64), ws.to(torch.float64)
    in_ratio = wf / hf
    narrow, wide = in_ratio < ratio[0], in_ratio > ratio[1]
    # at least a pixel: a ratio far from the image's would round a side to none (torchvision's crop then fails)
    fh = torch.where(narrow, torch.round(wf / ratio[0]).clamp(min=1).to(torch.int64), hs)
    fw = torch.where(wide & ~narrow, torch.round(hf * ratio[1]).clamp(min=1).to(torch.int64), ws)
    return torch.stack([(hs - fh) // 2, (ws - fw) // 2, fh, fw], dim=1)


def _taps(longest: int, out: int) -> int:
    """Taps per output of torch's antialiased bilinear filter for the longest crop side of a batch:
    ``2 * ceil(support) + 1`` with support = max(in / out, 1) (aten's ``_compute_weights_aa`` bound)."""
    return 2 * math.ceil(max(longest / out, 1.0)) + 1


def resize_weights(start: torch.Tensor, length: torch.Tensor, size: int, out: int, taps: int) -> torch.Tensor:
    """Dense per-sample weights of torch's antialiased bilinear resize along one axis.

    Row ``i`` of sample ``b`` holds the weights that output ``i`` gives the input indices
    ``start[b] .. start[b] + length[b] - 1`` of an axis of ``size`` pixels — the triangle filter
    centred on ``(i + 0.5) * length / out`` (half-pixel centres), its support widened by the scale
    when downscaling (antialiasing), normalised to sum 1: the same doubles as aten's
    ``_compute_indices_min_size_weights_aa`` (and datapipe/_native.c). They are computed as a band
    of ``taps`` per output (vectorised over the batch, in float64) and scattered into zeros.

    Shape:
        start, length: int64 [B] on the device; returns float32 [B, out, size] there.
    """
    dev = start.device
    n = length.to(torch.float64)[:, None]  # [B, 1]
    scale = n / out
    inv = 1.0 / scale.clamp(min=1.0)  # 1 / support (support = 1 when upscaling)
    center = scale * (torch.arange(out, device=dev, dtype=torch.float64) + 0.5)  # [B, out]
    first = torch.floor(center - scale.clamp(min=1.0) + 0.5).clamp_(min=0.0)  # [B, out]
    stop = torch.minimum(torch.floor(center + scale.clamp(min=1.0) + 0.5), n)  # [B, out]
    j = first[..., None] + torch.arange(taps, device=dev, dtype=torch.float64)  # [B, out, taps]
    w = (1.0 - ((j - center[..., None] + 0.5) * inv[..., None]).abs_()).clamp_(min=0.0)
    w = torch.where(j < stop[..., None], w, 0.0)  # taps past the crop's edge
    w = w / w.sum(-1, keepdim=True)
    index = (j.to(torch.int64) + start[:, None, None]).clamp_(max=size - 1)  # unused taps (weight 0) stay inside
    dense = torch.zeros((start.shape[0], out, size), dtype=torch.float32, device=dev)
    return dense.scatter_add_(2, index, w.to(torch.float32))  # add: the clamped taps may repeat an index


def crop_and_resize(images: torch.Tensor, crops: torch.Tensor, size: int | tuple[int, int], *,
                    flip: torch.Tensor | None = None) -> torch.Tensor:
    """Crop every sample of a batch at its own box and resize it, antialiased, in two batched matmuls.

    The result equals ``F.interpolate(crop, size, mode="bilinear", antialias=True,
    align_corners=False)`` of each sample's crop (torchvision's RandomResizedCrop), to float
    precision, for downscales and upscales alike. The filter is separable and linear, so with
    per-sample weight matrices Wy [B, h, H] and Wx [B, w, W] (:func:`resize_weights`) the batch is
    ``Wy @ image @ Wxᵀ`` per channel: one batched matrix product per axis, no loop over samples. A
    flip is the same product with Wx's rows reversed. The products run in float32 (with TF32 where
    the caller allows it: ``torch.backends.cuda.matmul.allow_tf32``).

    Args:
        images: uint8 [B, H, W, 3], on any device.
        crops: int64 [B, 4] (top, left, height, width), best on the CPU (its largest box sets the
            filter's band width; a device tensor costs a synchronisation to read it).
        size: output side, or (height, width).
        flip: bool [B], mirror these samples horizontally.

    Returns:
        float32 [B, 3, h, w] on the images' device, in 0..255 units (not divided by 255).

    Raises:
        ValueError: a box outside the image, or shapes that do not match.
    """
    out_h, out_w = (size, size) if isinstance(size, int) else size
    b, height, width, _ = images.shape
    boxes = crops.to("cpu", torch.int64)
    if boxes.shape != (b, 4):
        raise ValueError(f"crops must be int64 [{b}, 4] (top, left, height, width), got {tuple(crops.shape)}")
    top, left, h, w = boxes.unbind(1)
    bad = (top < 0) | (left < 0) | (h < 1) | (w < 1) | (top + h > height) | (left + w > width)
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        raise ValueError(f"crop {boxes[i].tolist()} (top, left, height, width) of sample {i} is outside "
                         f"its image of {height}x{width}")
    dev = images.device
    c = boxes.to(dev, non_blocking=True)
    wy = resize_weights(c[:, 0], c[:, 2], height, out_h, _taps(int(h.max()) if b else 1, out_h))  # [B, h, H]
    wx = resize_weights(c[:, 1], c[:, 3], width, out_w, _taps(int(w.max()) if b else 1, out_w))  # [B, w, W]
    if flip is not None:
        wx = torch.where(flip.to(dev, non_blocking=True)[:, None, None], wx.flip(1), wx)
    x = images.reshape(b, height, width * 3).to(torch.float32)  # [B, H, W*3]
    t = torch.bmm(x.transpose(1, 2), wy.transpose(1, 2))  # [B, W*3, h]: rows resized, laid out (x, c, y)
    t = t.view(b, width, 3 * out_h).transpose(1, 2)  # [B, 3h, W] (a view)
    return torch.bmm(t, wx.transpose(1, 2)).view(b, 3, out_h, out_w)  # [B, 3, h, w]


class BatchAugment(nn.Module):
    """Base of the batch transforms: uint8 NHWC in, float NCHW out, parameters from a seed.

    It holds the output's form — ``dtype``, normalisation (``mean``, ``std``) and memory layout
    (``channels_last``) — so the loader that calls it needs none of them.
    """

    #: forward takes a list of [H, W, 3] sample views, so the CPU loader hands over views of the
    #: shard files instead of gathering the batch (the presets crop each sample straight out of them)
    takes_views = True

    def __init__(self, size: int | None, *, mean: Sequence[float] = IMAGENET_MEAN, std: Sequence[float] = IMAGENET_STD,
                 dtype: torch.dtype = torch.float32,
                 channels_last: bool = False, path: Path_ = "auto") -> None:
        super().__init__()
        if path not in ("auto", "uint8", "device", "kornia"):
            raise ArgumentError(f"path must be 'auto', 'uint8' or 'device', got {show(path)}")
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise ArgumentError(f"dtype must be a floating torch dtype (torch.float32, bfloat16, float16), got {show(dtype)}")
        # 0: each sample's own size (a plain conversion, the one transform made without a size)
        if size is None and not isinstance(self, Convert):
            raise ArgumentError(f"size must be an integer of at least 1 (the side of the square output), got None for "
                                f"{type(self).__name__}")
        self.size = 0 if size is None else check_int(size, "size", 1)
        self.mean, self.std = _channel_triple(mean, "mean"), _channel_triple(std, "std", nonzero=True)
        _check_float32(self.mean, self.std)
        self.dtype, self.channels_last, self.path = dtype, check_bool(channels_last, "channels_last"), path

    def output_size(self, height: int, width: int) -> tuple[int, int]:
        """(height, width) of the output for samples of ``height`` x ``width``."""
        return (self.size, self.size) if self.size else (height, width)

    def _use_uint8(self, device: torch.device) -> bool:
        return self.path == "uint8" or (self.path == "auto" and device.type == "cpu")

    def reads_in_place(self, height: int, width: int) -> bool:
        """True when this preset reads CPU samples of ``height`` x ``width`` only through the guarded
        kernels of :mod:`datapipe.native` (so they may be views of memory-mapped shard files, see
        ``Cache.sample_views``). Exactly the library's presets, on their uint8 path."""
        if not self._use_uint8(torch.device("cpu")) or not native.guard_available():
            return False
        if type(self) is TrainAugment:  # every sample goes through _resize_crop: the resize kernel
            return native.resizer() is not None
        if type(self) is EvalAugment:  # a center crop through the conversion kernel (smaller samples are stacked)
            return height >= self.size and width >= self.size and native.converter(self.mean, self.std) is not None
        return False

    def _float_out(self, batch: int, out: torch.Tensor | None) -> torch.Tensor:
        """The float32 [batch, 3, size, size] tensor the CPU paths write into: ``out`` or a new one."""
        if out is not None:
            return out[:batch]
        fmt = torch.channels_last if self.channels_last else torch.contiguous_format
        return torch.empty((batch, 3, self.size, self.size), dtype=torch.float32, memory_format=fmt)

    def _empty(self, device: torch.device) -> torch.Tensor:
        """A rank's empty last batch, in the form of a full one: [0, 3, size, size], dtype and memory layout."""
        fmt = torch.channels_last if self.channels_last else torch.contiguous_format
        return torch.empty((0, 3, self.size, self.size), dtype=self.dtype, device=device, memory_format=fmt)

    def _as_dtype(self, out: torch.Tensor) -> torch.Tensor:
        return out if out.dtype == self.dtype else out.to(self.dtype)

    def _finish(self, x: torch.Tensor) -> torch.Tensor:
        fmt = torch.channels_last if self.channels_last else torch.contiguous_format
        if not x.numel():  # torch calls any strides of an empty tensor contiguous: lay it out as a full one
            return torch.empty(x.shape, dtype=self.dtype, device=x.device, memory_format=fmt)
        return x.to(self.dtype).contiguous(memory_format=fmt)

    @staticmethod
    def _check(images: Batch, *, varied: bool = False) -> tuple[int, int, int, torch.device]:
        """(batch, height, width, device) of a uint8 [B, H, W, 3] tensor or a list of [H, W, 3] samples
        (of one shape, or with ``varied`` of any shapes: then height and width are the first sample's)."""
        if isinstance(images, torch.Tensor):
            if images.dim() != 4 or images.shape[-1] != 3 or images.dtype != torch.uint8:
                raise ValueError(f"expected a uint8 batch [B, H, W, 3], got {tuple(images.shape)} {images.dtype}")
            b, h, w, _ = images.shape
            return b, h, w, images.device
        if not images:
            return 0, 0, 0, torch.device("cpu")
        first = images[0]
        for x in images:
            if x.dim() != 3 or x.shape[-1] != 3 or x.dtype != torch.uint8 or (x.shape != first.shape and not varied):
                raise ValueError(f"expected uint8 samples [H, W, 3]{'' if varied else ' of one shape'}, got "
                                 f"{tuple(x.shape)} {x.dtype} beside {tuple(first.shape)}")
        h, w, _ = first.shape
        return len(images), h, w, first.device


def _number(value: object) -> float | None:
    """A finite real number given as an int or float, numpy's too (not a bool, not a string), or None."""
    if isinstance(value, (np.ndarray, torch.Tensor)) and value.ndim == 0 and value.dtype not in (np.bool_, torch.bool):
        value = value.item()  # a 0-d array or tensor is the number it holds
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        return None
    return float(value)


def _numbers(values: object, count: int) -> list[float] | None:
    """``values`` as ``count`` finite numbers (a tuple or list of ints and floats, or a 1-D array or tensor of them),
    or None."""
    if isinstance(values, (np.ndarray, torch.Tensor)) and values.ndim == 1:
        values = list(values)
    if not isinstance(values, (tuple, list)) or len(values) != count:
        return None
    numbers = [_number(v) for v in values]
    return None if None in numbers else numbers  # type: ignore[return-value]


_FLOAT32_MAX = float(torch.finfo(torch.float32).max)  # the draws are float32: a larger bound is none there
_FLOAT32_TINY = float(torch.finfo(torch.float32).tiny)  # nor is a smaller positive one (it is 0 there)


def _range_pair(values: object, what: str) -> tuple[float, float]:
    """RandomResizedCrop's ``scale`` or ``ratio``: (min, max), two finite numbers with 0 < min <= max."""
    pair = _numbers(values, 2)
    if pair is None or not _FLOAT32_TINY <= pair[0] <= pair[1] <= _FLOAT32_MAX:
        raise ArgumentError(f"{what} must be (min, max): two numbers with 0 < min <= max (float32's {_FLOAT32_TINY:.3g} "
                            f"to {_FLOAT32_MAX:.3g}), got {show(values)}")
    return pair[0], pair[1]


def _probability(value: object, what: str) -> float:
    p = _number(value)
    if p is None or not 0.0 <= p <= 1.0:
        raise ArgumentError(f"{what} must be a probability between 0 and 1, got {show(value)}")
    return p


def _jitter_ranges(values: object) -> tuple[float, float, float, float]:
    """ColorJitter's (brightness, contrast, saturation, hue): numbers >= 0, the hue at most 0.5 (torchvision's rule)."""
    four = _numbers(values, 4)
    if four is None or min(four) < 0 or four[3] > 0.5 or max(four) > _FLOAT32_MAX / 2:  # 1 + a factor: in float32
        raise ArgumentError("color_jitter must be a number >= 0 or four numbers >= 0 (brightness, contrast, saturation, "
                            f"hue; the hue at most 0.5, the others {_FLOAT32_MAX / 2:.3g} at most), got {show(values)}")
    return four[0], four[1], four[2], four[3]


class TrainAugment(BatchAugment):
    """RandomResizedCrop(size) + horizontal flip (+ colour jitter), normalised. See module docs."""

    def __init__(self, size: int, *, scale: Sequence[float] = (0.08, 1.0), ratio: Sequence[float] = (3 / 4, 4 / 3),
                 flip: float = 0.5, color_jitter: tuple[float, float, float, float] | None = None, **kwargs: Any) -> None:
        super().__init__(size, **kwargs)
        self.scale, self.ratio = _range_pair(scale, "scale"), _range_pair(ratio, "ratio")
        self.flip = _probability(flip, "flip")
        self.color_jitter = _jitter_ranges(color_jitter) if color_jitter else None

    def sample(self, batch: int, height: int | torch.Tensor, width: int | torch.Tensor,
               seed: int | None) -> dict[str, torch.Tensor]:
        """Draw every random parameter of a batch (on the CPU, from ``seed``); ``height`` and ``width``
        are the samples' common size or int64 [B] tensors of each sample's own (crops cover its full extent)."""
        g = _generator(seed)
        params = {
            "crops": sample_resized_crops(batch, height, width, scale=self.scale, ratio=self.ratio, generator=g),
            "flip": torch.rand(batch, generator=g) < self.flip,
        }
        if self.color_jitter:
            b, c, s, h = self.color_jitter
            params["jitter"] = torch.stack([
                torch.empty(batch).uniform_(max(0.0, 1 - b), 1 + b, generator=g),
                torch.empty(batch).uniform_(max(0.0, 1 - c), 1 + c, generator=g),
                torch.empty(batch).uniform_(max(0.0, 1 - s), 1 + s, generator=g),
                torch.empty(batch).uniform_(-h, h, generator=g),
            ], dim=1)  # [B, 4]: brightness, contrast, saturation, hue
            params["jitter_order"] = torch.argsort(torch.rand(batch, 4, generator=g), dim=1)  # randperm(4) per sample
        return params

    def _jitter(self, x: torch.Tensor, params: dict[str, torch.Tensor]) -> torch.Tensor:
        assert self.color_jitter is not None
        enabled = [v > 0 for v in self.color_jitter]  # torchvision skips a range of 0
        return _jitter(x, params["jitter"], params.get("jitter_order"), enabled)

    def forward(self, images: Batch, seed: int | None = None,
                params: dict[str, torch.Tensor] | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        """Augment a uint8 [B, H, W, 3] batch (or list of [H, W, 3] samples); ``out`` optionally
        receives the result (CPU reuse)."""
        batch, _, _, device = self._check(images, varied=True)
        if batch == 0:  # a rank's empty last batch (a dataset smaller than the ranks' batches)
            return self._empty(device)
        params = params or self.sample(batch, *sample_sizes(images), seed)
        if self._use_uint8(device):
            pairs = zip(images, params["crops"].tolist(), strict=True)
            if "jitter" not in params:
                return self._crop_normalize_uint8(pairs, params["flip"], out, batch)
            return self._crop_jitter_normalize(pairs, params, out, batch)
        x = crop_and_resize(_stack(images), params["crops"], self.size, flip=params["flip"])  # 0..255
        if "jitter" not in params:
            return self._finish(_scale_shift_(x, self.mean, self.std))
        x = self._jitter(x.mul_(1.0 / 255.0).clamp_(0.0, 1.0), params)
        return self._finish(_normalize_float(x, self.mean, self.std))

    def decode(self, encoded: Sequence[EncodedSample], seed: int | None = None,
               out: torch.Tensor | None = None) -> torch.Tensor:
        """Augment stored JPEG samples (a JPEG cache, on the CPU): each is decoded for its own crop
        only — scaled down in the DCT domain when the crop is at least twice the output
        (:func:`datapipe.samples.decode_crop`) — then resized, mirrored and normalised into its row
        of ``out``, one sample at a time: no decoded batch is ever assembled."""
        n = len(encoded)
        if n == 0:
            return self._empty(torch.device("cpu"))
        shapes = torch.from_numpy(samples.encoded_shapes(encoded))
        params = self.sample(n, shapes[:, 0], shapes[:, 1], seed)

        def crops() -> Iterator[tuple[torch.Tensor, tuple[int, int, int, int]]]:
            for e, box in zip(encoded, params["crops"].tolist(), strict=True):
                img, mapped = decode_crop(e.data, e.height, e.width, tuple(box), self.size, where=e.where)
                yield torch.from_numpy(img), mapped  # valid until the next decode of this thread

        if "jitter" not in params:
            batch = self._decode_batch(encoded, params, out, n)
            return batch if batch is not None else self._crop_normalize_uint8(crops(), params["flip"], out, n)
        return self._crop_jitter_normalize(crops(), params, out, n)

    def _decode_batch(self, encoded: Sequence[EncodedSample], params: dict[str, torch.Tensor], out: torch.Tensor | None,
                      n: int) -> torch.Tensor | None:
        """:meth:`decode` in one compiled call for the whole batch (decode, resize, mirror, normalise:
        the same values as sample by sample), where the partial decoder and the kernels are built;
        None otherwise."""
        decoder, kernels = samples.partial_decoder(), native.kernel_addresses()
        conv = native.converter(self.mean, self.std)
        if decoder is None or kernels is None or conv is None:
            return None
        out = self._float_out(n, out)
        base, step, planar = conv.destination(out, self.size, self.size)
        decoder.train_batch(encoded, params["crops"].tolist(), params["flip"].tolist(), self.size, kernels,
                            conv.scale_shift_addresses, base, step // 4, planar)
        return self._as_dtype(out)

    def _crop_normalize_uint8(self, crops: Iterable[tuple[torch.Tensor, Box]], flip: torch.Tensor,
                              out: torch.Tensor | None, n: int) -> torch.Tensor:
        """Per sample: resize the crop on uint8, then mirror, convert and normalise it straight into
        its slot of ``out`` while it is still in cache (1.7x a batch-wide second pass here).
        ``crops`` yields (sample, (top, left, h, w)) pairs, possibly decoded one at a time."""
        s = self.size
        out = self._float_out(n, out)
        conv = native.converter(self.mean, self.std)
        tmp = torch.empty((s, s, 3), dtype=torch.uint8)
        tmp_chw = tmp.permute(2, 0, 1)
        resizer, resize = native.resizer(), _resize_aa()
        if conv is not None:  # mirror, convert and normalise in one pass (datapipe/native.py)
            (base, step, planar), src = conv.destination(out, s, s), tmp.data_ptr()
        else:
            scale, shift = _scale_shift(self.mean, self.std, out.device)
        for i, ((x, (top, left, h, w)), f) in enumerate(zip(crops, flip.tolist(), strict=True)):
            _resize_crop(x, top, left, h, w, tmp, resizer, resize)
            if conv is not None:
                conv.raw(src, s, s, 3 * s, f, planar, base + i * step)
            else:
                torch.addcmul(shift, (tmp_chw.flip(2) if f else tmp_chw).float(), scale, out=out[i])
        return self._as_dtype(out)

    def _crop_jitter_normalize(self, crops: Iterable[tuple[torch.Tensor, Box]], params: dict[str, torch.Tensor],
                               out: torch.Tensor | None, n: int) -> torch.Tensor:
        """:meth:`_crop_normalize_uint8` with the colour jitter: per sample, the crop resized on uint8, mirrored,
        made [0, 1] floats, jittered in place in its own order, normalised into its slot of ``out``; the
        image stays in cache from the resize to the normalisation, and no batch-wide pass or gather runs
        (6.6 against 0.6 ms per 224² image for the jitter alone, with the batch's gathers, here)."""
        assert self.color_jitter is not None
        s = self.size
        out = self._float_out(n, out)
        tmp = torch.empty((s, s, 3), dtype=torch.uint8)
        tmp_chw = tmp.permute(2, 0, 1)
        img = torch.empty((1, 3, s, s), dtype=torch.float32)
        mean, std = _channels(tuple(self.mean), img.device, img.dtype), _channels(tuple(self.std), img.device, img.dtype)
        resizer, resize = native.resizer(), _resize_aa()
        factors, order = params["jitter"], params.get("jitter_order")
        enabled = [v > 0 for v in self.color_jitter]
        flips = params["flip"].tolist()
        for i, (x, (top, left, h, w)) in enumerate(crops):
            _resize_crop(x, top, left, h, w, tmp, resizer, resize)
            img[0].copy_(tmp_chw.flip(2) if flips[i] else tmp_chw).mul_(1.0 / 255.0)
            _jitter(img, factors[i : i + 1], None if order is None else order[i : i + 1], enabled)
            out[i].copy_(img[0].sub_(mean).div_(std))
        return self._as_dtype(out)


GRAY = (0.2989, 0.587, 0.114)  # torchvision's rgb_to_grayscale weights (R, G, B)


def _gray(x: torch.Tensor) -> torch.Tensor:
    """[n, 3, h, w] -> [n, 1, h, w]: torchvision's grayscale of float RGB."""
    return x[:, 0:1] * GRAY[0] + x[:, 1:2] * GRAY[1] + x[:, 2:3] * GRAY[2]


def _blend(x: torch.Tensor, other: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    """torchvision's ``_blend``: factor * x + (1 - factor) * other, clamped to [0, 1] (per-sample factors [n]);
    in place (``x`` is always the preset's own batch, or a gathered copy of its rows)."""
    f = factor.view(-1, 1, 1, 1)
    return x.mul_(f).add_(other * (1.0 - f)).clamp_(0.0, 1.0)


def _compiled(x: torch.Tensor, op: str, f: torch.Tensor) -> bool:
    """``op`` run by the compiled kernel in place (CPU batches; torchvision's values, see native.jitter)."""
    return x.device.type == "cpu" and native.jitter(x, op, f.tolist())


def _brightness(x: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
    if _compiled(x, "brightness", f):
        return x
    return x.mul_(f.view(-1, 1, 1, 1)).clamp_(0.0, 1.0)  # _blend with black: x * f, clamped


def _contrast(x: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
    if _compiled(x, "contrast", f):
        return x
    return _blend(x, _gray(x).mean(dim=(1, 2, 3), keepdim=True), f)  # towards the image's mean grey (taken first)


def _saturation(x: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
    if _compiled(x, "saturation", f):
        return x
    return _blend(x, _gray(x), f)  # towards each pixel's grey (taken first)


def _hue(x: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
    """HSV's hue turned by f (of a full turn), as torchvision's: on the CPU by the compiled kernel, in place and
    bit-identical to torchvision's float operations (0.3 against Kornia's 4.4 ms per 224² image on one core
    here); elsewhere by Kornia (within 2e-6 of it)."""
    if _compiled(x, "hue", f):
        return x
    from kornia.enhance import adjust_hue

    return adjust_hue(x, f * (2 * math.pi)).clamp_(0.0, 1.0)


JITTER_OPS = (_brightness, _contrast, _saturation, _hue)  # the order of the factors in params["jitter"]


def _jitter(x: torch.Tensor, factors: torch.Tensor, order: torch.Tensor | None = None,
            enabled: Sequence[bool] = (True, True, True, True)) -> torch.Tensor:
    """torchvision's ColorJitter with per-sample factors [B, 4] (brightness, contrast, saturation, hue) on
    [0, 1] floats, each sample's operations in its own order (``order``: int64 [B, 4], a permutation of
    0..3 per sample, as torchvision draws one per image; None: that order). ``factors`` and ``order`` are
    read on the host (no wait for the device). ``x`` is changed in place (it is always the preset's own batch):
    on the CPU image by image, each in its own order; on a device each operation runs once per step, on the
    samples that take it at that step, gathered by index and put back. ``enabled``: the operations the
    preset draws at all."""
    if order is None:
        order = torch.arange(4).expand(len(x), 4)
    if x.device.type == "cpu":  # each image in place, in its own order: no gathers (a row of x is one image's memory)
        for i, ops in enumerate(order.tolist()):
            row = x[i : i + 1]
            for op in ops:
                if enabled[op]:
                    y = JITTER_OPS[op](row, factors[i : i + 1, op])
                    if y.data_ptr() != row.data_ptr():  # an operation that is not in place (Kornia's hue)
                        row.copy_(y)
        return x
    on_device = factors.to(x.device, non_blocking=True)
    for step in range(4):
        for op, run in enumerate(JITTER_OPS):
            if not enabled[op]:
                continue
            rows = (order[:, step] == op).nonzero().flatten()
            if rows.numel() == len(x):
                x = run(x, on_device[:, op])
            elif rows.numel():  # the samples that take this operation at this step, gathered and put back in place
                idx = rows.to(x.device, non_blocking=True)
                x.index_copy_(0, idx, run(x.index_select(0, idx), on_device.index_select(0, idx)[:, op]))
    return x


def _centre(n: int, s: int) -> int:
    """The offset of a centred window of ``s`` in ``n``, as torchvision's CenterCrop: round((n - s) / 2), half to
    even (so an odd margin of 3 puts 2 before the window, not 1)."""
    return int(round((n - s) / 2.0))


class EvalAugment(BatchAugment):
    """Center crop to ``size``, normalised. A sample smaller than ``size`` on a side is cropped to its centred
    square (its shorter side) and that square resized to ``size``, never stretched to a square: torchvision's
    ``Resize(size)`` then ``CenterCrop(size)`` but for where the window starts (on a whole stored pixel here,
    up to half a pixel from it there; docs/loader.md gives the difference).

    The same values on both paths: a crop is copied, a resize is the antialiased bilinear one.
    """

    def forward(self, images: Batch, seed: int | None = None, params: dict[str, torch.Tensor] | None = None,
                out: torch.Tensor | None = None) -> torch.Tensor:
        b, h, w, device = self._check(images, varied=True)
        s = self.size
        if b == 0:
            return self._empty(device)
        if params is not None:  # per-sample crops (samples of varying shapes, padded into one batch)
            x = crop_and_resize(_stack(images), params["crops"], s)  # the boxes are read on the host
            return self._finish(_scale_shift_(x, self.mean, self.std))
        if not isinstance(images, torch.Tensor) and any(x.shape != images[0].shape for x in images):
            return self._each(images, out)
        if not self._use_uint8(device):  # the batched device path (CUDA), also runnable on CPU tensors
            x = _stack(images)
            if h >= s and w >= s:
                top, left = _centre(h, s), _centre(w, s)
                x = x[:, top : top + s, left : left + s].permute(0, 3, 1, 2).to(torch.float32)
            else:
                m = min(h, w)
                x = crop_and_resize(x, torch.tensor([[_centre(h, m), _centre(w, m), m, m]], dtype=torch.int64).expand(b, 4),
                                    s)
            return self._finish(_scale_shift_(x, self.mean, self.std))
        if h >= s and w >= s:
            # On the CPU, sample by sample while each crop is in cache (as in TrainAugment).
            top, left = _centre(h, s), _centre(w, s)
            out = self._float_out(b, out)
            _normalize_into(images, out, self.mean, self.std, top, left)
            return self._as_dtype(out)
        m = min(h, w)  # smaller than size on a side: its centred square, resized to size
        top, left = _centre(h, m), _centre(w, m)
        x = _stack(images)[:, top : top + m, left : left + m].permute(0, 3, 1, 2).to(torch.float32).mul_(1.0 / 255.0)
        x = torch.nn.functional.interpolate(x, size=(s, s), mode="bilinear", antialias=True, align_corners=False)
        return self._finish(_normalize_float(x, self.mean, self.std))


    def sample(self, batch: int, height: int | torch.Tensor, width: int | torch.Tensor,
               seed: int | None = None) -> dict[str, torch.Tensor]:
        """The crop of each sample, as :meth:`TrainAugment.sample` gives them (no randomness): the
        centred ``size`` square, or the centred square of the sample's shorter side when it is smaller than ``size``
        on a side (then resized)."""
        h = torch.as_tensor(height, dtype=torch.int64).expand(batch)
        w = torch.as_tensor(width, dtype=torch.int64).expand(batch)
        s = self.size
        inside = (h >= s) & (w >= s)
        side = torch.full((batch,), s, dtype=torch.int64)
        # torchvision's CenterCrop offsets: round((n - s) / 2), half to even (torch.round, as Python's round)
        crops = torch.stack([torch.round((h - s) / 2.0).to(torch.int64), torch.round((w - s) / 2.0).to(torch.int64),
                             side, side], dim=1)
        m = torch.minimum(h, w)
        square = torch.stack([torch.round((h - m) / 2.0).to(torch.int64), torch.round((w - m) / 2.0).to(torch.int64),
                              m, m], dim=1)
        return {"crops": torch.where(inside[:, None], crops, square)}

    def decode(self, encoded: Sequence[EncodedSample], seed: int | None = None,
               out: torch.Tensor | None = None) -> torch.Tensor:
        """Stored JPEG samples (a JPEG cache, on the CPU): each decoded, then centre-cropped into its row of ``out``."""
        images = [torch.from_numpy(decode_jpeg(e.data, e.height, e.width, where=e.where)) for e in encoded]
        return self.forward(images, seed, out=out)

    def _each(self, images: list[torch.Tensor], out: torch.Tensor | None) -> torch.Tensor:
        """Samples of different shapes (an aspect-preserving cache): each centre-cropped on its own,
        into its row of ``out`` on the CPU."""
        target = self._float_out(len(images), out) if self._use_uint8(images[0].device) else None
        rows = [self.forward([x], out=None if target is None else target[i : i + 1]) for i, x in enumerate(images)]
        if target is None or self.dtype != torch.float32:
            return torch.cat(rows)
        for i, row in enumerate(rows):
            if row.data_ptr() != target[i].data_ptr():  # a sample smaller than size was resized apart
                target[i].copy_(row[0])
        return target


class Convert(BatchAugment):
    """uint8 NHWC -> float NCHW at the samples' own size, with no randomness of its own: the
    batch transform of a loader without augmentation (``augment.convert``).

    Normalised (``normalize=True``): on the CPU one pass per sample through the conversion kernel
    into the loader's reused output buffer (:func:`normalize_uint8`). Otherwise divided by 255.
    ``module``, any callable taking float [B, 3, H, W] in [0, 1] (a third-party augmentation),
    runs between the division and the normalisation, with torch's global generator seeded from the
    batch's seed (so it runs in the loop's thread, one batch at a time).
    """

    takes_views = False  # it converts a gathered batch

    def __init__(self, *, dtype: torch.dtype = torch.float32, normalize: bool = True, mean: Sequence[float] = IMAGENET_MEAN,
                 std: Sequence[float] = IMAGENET_STD, channels_last: bool = False, module: BatchFn | None = None) -> None:
        super().__init__(None, mean=mean, std=std, dtype=dtype, channels_last=channels_last)
        self.normalize = check_bool(normalize, "normalize")
        if module is train or module is eval or module is convert:
            name = module.__name__  # type: ignore[union-attr]
            raise ArgumentError(f"datapipe.augment.{name} is the function that makes the preset: pass its result, "
                                f"e.g. augment={name}({'' if name == 'convert' else '224'}), not augment={name}")
        if isinstance(module, type):  # a class is callable too: it would be "called" on the first batch
            raise ArgumentError(f"the module (augment=) {module.__name__} is a class: pass an instance of it (for the presets, "
                                "augment=datapipe.augment.train(224) or eval(224)), not the class")
        if module is not None and not callable(module):
            raise ArgumentError(f"module must be an nn.Module or a callable on float [B, 3, H, W] batches, "
                                f"got {show(module)} ({type(module).__name__})")
        self.module = module

    def forward(self, images: Batch, seed: int | None = None, params: dict[str, torch.Tensor] | None = None,
                out: torch.Tensor | None = None) -> torch.Tensor:
        """Convert a uint8 [B, H, W, 3] batch; ``out`` (float32 [>=B, 3, H, W]) optionally receives
        a normalised result (CPU reuse)."""
        b = self._check(images)[0]  # samples of one shape: a conversion does not crop them to one
        x = _stack(images)
        if self.module is None and self.normalize and b:
            return normalize_uint8(x, self.mean, self.std, dtype=self.dtype, channels_last=self.channels_last, out=out)
        # float32 until the end, as the presets: the module takes what any float32 model takes, and the
        # output is rounded to a lower precision once
        x = x.permute(0, 3, 1, 2).to(torch.float32).div_(255.0)
        if self.module is not None:
            x = self._run_module(self.module, x, seed)
        return self._finish(_normalize_float(x, self.mean, self.std) if self.normalize else x)

    @staticmethod
    def _run_module(module: BatchFn, x: torch.Tensor, seed: int | None) -> torch.Tensor:
        """The module, its random state (torch's global generator) seeded from ``seed`` and then restored; its
        result checked to be a float [B, 3, h, w] batch of the same B (made float32)."""
        if seed is None:
            y = module(x)
        else:
            with torch.random.fork_rng(devices=[x.device] if x.device.type == "cuda" else []):
                torch.manual_seed(seed)
                y = module(x)
        if not isinstance(y, torch.Tensor) or not y.is_floating_point() or y.dim() != 4 or y.shape[:2] != x.shape[:2]:
            got = (f"{tuple(y.shape)} {y.dtype}" if isinstance(y, torch.Tensor) else
                   f"a {type(y).__name__}" + (" (a batch transform that also changes the labels, such as MixUp, "
                                                "belongs in the training step)" if isinstance(y, (tuple, list)) else ""))
            raise ArgumentError(f"augment module {type(module).__name__} must return a float [B, 3, H, W] tensor of "
                                f"the batch's {len(x)} samples, got {got}")
        return y if y.dtype == torch.float32 else y.float()


def convert(*, dtype: torch.dtype = torch.float32, normalize: bool = True, mean: Sequence[float] = IMAGENET_MEAN,
            std: Sequence[float] = IMAGENET_STD, channels_last: bool = False, module: BatchFn | None = None) -> Convert:
    """A plain conversion, no augmentation: float [B, 3, H, W] batches at the cache's own size,
    normalised with ``mean``/``std`` (unless ``normalize=False``: [0, 1]), in ``dtype``, NCHW or
    ``channels_last``. The loader's transform when it is given ``augment=None``; ``module`` applies
    a third-party augmentation on [0, 1] floats first (see :class:`Convert`)."""
    return Convert(dtype=dtype, normalize=normalize, mean=mean, std=std, channels_last=channels_last, module=module)


def _not_a_batch(size: object, name: str) -> None:
    """The preset functions called as if they were the preset (on a batch): say how to make the preset."""
    if isinstance(size, (list, tuple)) and size and all(isinstance(v, int) and not isinstance(v, bool) for v in size):
        raise ArgumentError(f"datapipe.augment.{name}(size) makes square outputs and takes one int (224), got "
                            f"{show(size)}: a (height, width) pair is not supported")
    if isinstance(size, (torch.Tensor, list, tuple)):
        raise ArgumentError(f"datapipe.augment.{name}(size) makes the preset and takes its output size: pass "
                            f"augment={name}(224) to the loader, not augment={name}")


def train(size: int = 224, *, scale: Sequence[float] = (0.08, 1.0), ratio: Sequence[float] = (3 / 4, 4 / 3), flip: float = 0.5,
          color_jitter: tuple[float, float, float, float] | float | None = None, dtype: torch.dtype = torch.float32,
          channels_last: bool = False, mean: Sequence[float] = IMAGENET_MEAN, std: Sequence[float] = IMAGENET_STD,
          path: Path_ = "auto") -> TrainAugment:
    """The ImageNet training preset. ``color_jitter=0.4`` means (0.4, 0.4, 0.4, 0.1).

    ``dtype``, ``channels_last``, ``mean`` and ``std`` set the output's form (see :class:`BatchAugment`);
    ``path`` the implementation ("auto": "uint8" on the CPU, "device" elsewhere)."""
    _not_a_batch(size, "train")
    jitter: Any  # a number made four, or what was given (TrainAugment checks it)
    if hasattr(color_jitter, "tolist") and not isinstance(color_jitter, (list, tuple)):
        color_jitter = color_jitter.tolist()  # type: ignore[union-attr]  # an array or tensor: its number, or its four
    amount = _number(color_jitter)
    if amount is not None:
        if amount < 0:
            raise ArgumentError(f"color_jitter must be a number >= 0 or four numbers, got {show(color_jitter)}")
        jitter = (amount, amount, amount, min(0.1, amount)) if amount else None
    elif color_jitter is None:
        jitter = None
    else:  # four numbers: a tuple or list
        values = color_jitter
        if not isinstance(values, (list, tuple)):
            raise ArgumentError(f"color_jitter must be a number >= 0 or four numbers, got {show(color_jitter)}")
        jitter = tuple(values) or None  # checked by TrainAugment: four numbers in their ranges
    return TrainAugment(size, scale=scale, ratio=ratio, flip=flip, color_jitter=jitter, dtype=dtype,
                        channels_last=channels_last, mean=mean, std=std, path=path)


def eval(size: int = 224, *, dtype: torch.dtype = torch.float32, channels_last: bool = False,  # noqa: A001 - mirrors train()
         mean: Sequence[float] = IMAGENET_MEAN, std: Sequence[float] = IMAGENET_STD, path: Path_ = "auto") -> EvalAugment:
    """The ImageNet evaluation preset: center crop (a 256 cache + eval(224) is the usual 0.875 crop).
    The output's form as in :func:`train`."""
    _not_a_batch(size, "eval")
    return EvalAugment(size, dtype=dtype, channels_last=channels_last, mean=mean, std=std, path=path)
