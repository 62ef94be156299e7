"""Self-verifying synthetic data for tests: images whose pixels spell out their own index.

Image ``i`` of :func:`make_index_dataset` is a lossless PNG whose red and green channels are the
constants ``i % 256`` and ``(i // 256) % 256`` over the whole image, so :func:`index_of` reads the
index back from any batch — also after crops, resizes and flips, which keep a constant channel
constant. The blue channel is an asymmetric texture (a horizontal ramp plus seeded noise) so that
crops and flips visibly change a sample. Labels are ``i % classes``.

Example:
    >>> import tempfile, datapipe
    >>> from datapipe.testing import build_index_cache, index_of, index_map
    >>> cache = build_index_cache(tempfile.mkdtemp(), 10)
    >>> image, label = datapipe.open(cache)[4]
    >>> int(index_of(image[None])[0]) == int(index_map(cache)[4])
    True
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch

__all__ = ["build_index_cache", "index_image", "index_map", "index_of", "make_index_dataset", "to_uint8"]

MAX_SAMPLES = 256 * 256  # what the red and green channels can count


def index_image(i: int, *, label: int, size: int = 32, seed: int = 0) -> np.ndarray:
    """The pixels of sample ``i``: uint8 [size, size, 3].

    Args:
        i: the sample's index (0 <= i < 65536).
        label: its class; mixed into the texture's noise only.
        size: side of the square image.
        seed: changes the blue texture, never the encoded index.

    Returns:
        R = i % 256 and G = (i // 256) % 256 everywhere; B a ramp from left to right plus noise.
    """
    if not 0 <= i < MAX_SAMPLES:
        raise ValueError(f"index must be in [0, {MAX_SAMPLES}), got {i}")
    img = np.empty((size, size, 3), np.uint8)
    img[..., 0] = i % 256
    img[..., 1] = (i // 256) % 256
    ramp = np.linspace(0, 200, size, dtype=np.float64)[None, :]  # [1, size]: left dark, right bright
    noise = np.random.default_rng([seed, i, label]).integers(0, 56, (size, size))  # [size, size]
    img[..., 2] = (ramp + noise).astype(np.uint8)
    return img


def make_index_dataset(root: str | os.PathLike, n: int, *, classes: int = 3, size: int = 32, seed: int = 0) -> Path:
    """Write ``n`` index-encoding PNGs into ``root/class_{k:03d}/{i:05d}.png``.

    The images are exactly ``size`` × ``size`` so that a build at the same size stores them
    unchanged. Class folders are zero-padded so that their sorted order is their number.

    Args:
        root: folder to write into (created if missing).
        n: number of images (at most 65536).
        classes: number of class folders; image ``i`` goes to class ``i % classes``.
        size: side of the square images.
        seed: changes the blue texture of every image.

    Returns:
        ``root`` as a Path.

    Raises:
        ValueError: ``n`` or ``classes`` out of range.
    """
    from PIL import Image

    if not 0 <= n <= MAX_SAMPLES or classes < 1:
        raise ValueError(f"need 0 <= n <= {MAX_SAMPLES} and classes >= 1, got n={n}, classes={classes}")
    root = Path(root)
    for k in range(classes):
        (root / f"class_{k:03d}").mkdir(parents=True, exist_ok=True)
    for i in range(n):
        label = i % classes
        pixels = index_image(i, label=label, size=size, seed=seed)
        Image.fromarray(pixels).save(root / f"class_{label:03d}" / f"{i:05d}.png", compress_level=1)
    return root


def index_of(images: np.ndarray) -> np.ndarray:
    """Read the encoded indices back from a batch: int64 [B].

    Args:
        images: uint8 [B, H, W, 3] (a numpy array or a CPU tensor), e.g. a loader's batch.

    Returns:
        ``R + 256 · G`` of each image, taken as the median over its pixels (robust to the odd
        rounded pixel at a crop's border).
    """
    arr = np.asarray(images)
    if arr.ndim != 4 or arr.shape[-1] != 3:
        raise ValueError(f"expected [B, H, W, 3] images, got shape {arr.shape}")
    flat = arr.reshape(arr.shape[0], -1, 3).astype(np.int64)  # [B, H*W, 3]
    red = np.median(flat[:, :, 0], axis=1)
    green = np.median(flat[:, :, 1], axis=1)
    return np.rint(red + 256 * green).astype(np.int64)


def to_uint8(images: torch.Tensor | np.ndarray, mean: Sequence[float] | None = None,
             std: Sequence[float] | None = None) -> np.ndarray:
    """Undo the loader's normalisation: float [B, 3, H, W] -> uint8 [B, H, W, 3] (rounded).

    Args:
        images: a normalised float batch (any float dtype, any device).
        mean, std: what it was normalised with; default ImageNet's, as the loader's default.
    """
    import torch

    from .augment import IMAGENET_MEAN, IMAGENET_STD

    mean = IMAGENET_MEAN if mean is None else mean
    std = IMAGENET_STD if std is None else std

    x = torch.as_tensor(images).detach().to("cpu", torch.float64)
    m = torch.tensor(mean, dtype=torch.float64).view(1, 3, 1, 1)
    s = torch.tensor(std, dtype=torch.float64).view(1, 3, 1, 1)
    pixels = ((x * s + m) * 255.0).round_().clamp_(0, 255)
    return pixels.permute(0, 2, 3, 1).to(torch.uint8).contiguous().numpy()


def index_map(cache: str | os.PathLike) -> np.ndarray:
    """The encoded index of every sample of a cache, in the cache's order: int64 [N].

    The cache numbers samples by their sorted relative paths (class folder first), which is not
    the file number; ``index_map(cache)[g]`` is the file number of global sample ``g``.
    """
    from .cache import Cache

    c = Cache(os.fspath(cache))
    return np.array([int(Path(c.path(g)).stem) for g in range(len(c))], np.int64)


def build_index_cache(tmp: str | os.PathLike, n: int, *, classes: int = 3, size: int = 32, shard_size: int = 7,
                      seed: int = 0) -> Path:
    """Write :func:`make_index_dataset` into ``tmp/source`` and build it into ``tmp/cache``.

    The build runs in this process (``scheduler="sync"``), quietly.

    Args:
        tmp: an empty or new folder.
        n: number of samples (at least 1).
        classes: number of classes.
        size: side of the images and of the cache's samples.
        shard_size: samples per shard; small, so that even a tiny cache has many shards.
        seed: changes the images' texture.

    Returns:
        The cache folder.
    """
    from .builder import Cluster, build

    tmp = Path(tmp)
    source = make_index_dataset(tmp / "source", n, classes=classes, size=size, seed=seed)
    out = tmp / "cache"
    build(source, out, size=size, shard_size=shard_size, cluster=Cluster(scheduler="sync"), progress=False)
    return out


def crop_reference(images: torch.Tensor, crops: torch.Tensor, flip: torch.Tensor, size: int) -> torch.Tensor:
    """torchvision's RandomResizedCrop + flip computed on floats in [0, 1], one sample at a time: the
    reference both augmentation paths are held to. float64 [B, 3, size, size] on the CPU.

    Args:
        images: uint8 [B, H, W, 3] (any device).
        crops: int64 [B, 4] boxes (top, left, height, width).
        flip: bool [B], mirror the sample horizontally.
        size: side of the output.
    """
    import torch
    import torch.nn.functional as F

    out = []
    for x, (top, left, h, w), f in zip(images, crops.tolist(), flip.tolist(), strict=True):
        crop = x[top : top + h, left : left + w].permute(2, 0, 1)[None].to(torch.float32) / 255.0
        r = F.interpolate(crop, size=(size, size), mode="bilinear", antialias=True, align_corners=False)
        out.append(r.flip(-1) if f else r)
    return torch.cat(out).to("cpu", torch.float64)
