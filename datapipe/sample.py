"""Generate a small ImageNet-like image folder from the photographs bundled with scikit-image.

Random noise makes a poor benchmark (it compresses badly and decodes slowly), so every sample is a
real photograph, randomly cropped, scaled, recoloured and re-encoded as a JPEG at quality ~90. The
result has the ImageNet layout (one folder per class) and ImageNet-like statistics: about 430×340
pixels and 60–110 KB per file on average. The output is a pure function of ``seed``.
"""

from __future__ import annotations

import io
import os
from pathlib import Path

import numpy as np

__all__ = ["make_sample_dataset", "PHOTOS"]

# (name, is_colour) — the real photographs shipped inside the scikit-image wheel.
PHOTOS = (
    "astronaut", "coffee", "chelsea", "rocket", "hubble_deep_field", "immunohistochemistry",
    "retina", "stereo_motorcycle", "colorwheel", "camera", "moon", "brick", "grass", "gravel", "coins",
)


def _load_photos() -> list[np.ndarray]:
    import skimage.data as data

    photos = []
    for name in PHOTOS:
        img = getattr(data, name)()
        if isinstance(img, tuple):
            img = img[0]
        img = np.asarray(img)
        if img.ndim == 2:
            img = np.repeat(img[..., None], 3, axis=2)
        photos.append(np.ascontiguousarray(img[..., :3]).astype(np.uint8))
    return photos


def _one_image(photos: list[np.ndarray], grain: np.ndarray, cls: int, rng: np.random.Generator) -> bytes:
    from PIL import Image

    base = photos[(cls + int(rng.integers(0, 3))) % len(photos)]
    h, w = base.shape[:2]
    # A random crop covering 35–100% of the photo's area.
    area = rng.uniform(0.35, 1.0) * h * w
    aspect = np.exp(rng.uniform(np.log(3 / 4), np.log(4 / 3)))
    ch = int(min(h, max(32, round(np.sqrt(area / aspect)))))
    cw = int(min(w, max(32, round(np.sqrt(area * aspect)))))
    y = int(rng.integers(0, h - ch + 1))
    x = int(rng.integers(0, w - cw + 1))
    # ImageNet-like size: about 430×340 on average, landscape and portrait mixed.
    long_side = int(rng.integers(380, 500))
    short_side = int(round(long_side * rng.uniform(0.68, 0.86)))
    size = (long_side, short_side) if rng.random() < 0.85 else (short_side, long_side)
    img = Image.fromarray(base[y : y + ch, x : x + cw]).resize(size, Image.Resampling.BICUBIC)
    # Recolour (per-class tint, per-image gains and gamma) and add sensor-like grain, so classes
    # differ in colour statistics and files compress like camera photographs, not like renders.
    pixels = np.asarray(img, dtype=np.float32)
    tint = np.array([(cls * 37) % 64, (cls * 71) % 64, (cls * 13) % 64], np.float32) - 32
    gains = rng.uniform(0.8, 1.2, size=3).astype(np.float32)
    gamma = float(rng.uniform(0.8, 1.25))
    pixels = 255.0 * (np.clip(pixels * gains + tint, 0, 255) / 255.0) ** gamma
    gy = int(rng.integers(0, grain.shape[0] - pixels.shape[0] + 1))
    gx = int(rng.integers(0, grain.shape[1] - pixels.shape[1] + 1))
    pixels += grain[gy : gy + pixels.shape[0], gx : gx + pixels.shape[1]]
    if rng.random() < 0.5:
        pixels = pixels[:, ::-1]
    img = Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8))
    buf = io.BytesIO()
    img.save(buf, format="JPEG", quality=int(rng.integers(93, 97)))
    return buf.getvalue()


def _write_range(root: Path, start: int, stop: int, classes: int, seed: int) -> None:
    photos = _load_photos()
    grain = np.random.default_rng([seed, 2**31]).normal(0.0, 9.0, size=(640, 640, 3)).astype(np.float32)
    for i in range(start, stop):
        cls = i % classes
        folder = root / f"class_{cls:03d}"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"img_{i:06d}.jpg").write_bytes(_one_image(photos, grain, cls, np.random.default_rng([seed, i])))


def make_sample_dataset(
    root: str | os.PathLike, *, images: int = 2000, classes: int = 10, seed: int = 0, workers: int = 1
) -> Path:
    """Write ``images`` JPEGs into ``root/<class>/<n>.jpg`` (ImageNet layout).

    Args:
        root: output folder; created if missing. Files already there with the same names are
            overwritten, nothing else is touched.
        images: number of images in total, spread evenly over the classes.
        classes: number of class folders.
        seed: the output is a pure function of (images, classes, seed).
        workers: processes to generate with (the output does not depend on it).

    Returns:
        The root folder.
    """
    if images < 1 or classes < 1:
        raise ValueError(f"images and classes must be >= 1, got images={images}, classes={classes}")
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    if workers <= 1:
        _write_range(root, 0, images, classes, seed)
        return root
    from concurrent.futures import ProcessPoolExecutor

    step = -(-images // (workers * 4))
    with ProcessPoolExecutor(workers) as pool:
        jobs = [pool.submit(_write_range, root, a, min(a + step, images), classes, seed)
                for a in range(0, images, step)]
        for job in jobs:
            job.result()
    return root
