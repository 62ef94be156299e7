"""Generate a small ImageNet-like image folder from the photographs bundled with scikit-image.

Random noise makes a poor benchmark (it compresses badly and decodes slowly), so every sample is a
real photograph, randomly cropped, scaled, recoloured and re-encoded as a JPEG at quality ~90. The
result has the ImageNet layout (one folder per class) and ImageNet-like statistics: about 430×340
pixels and 60–110 KB per file on average. The output is a pure function of ``seed``.
"""

from __future__ import annotations

import io
import json
import os
from pathlib import Path

import numpy as np

__all__ = ["make_sample_dataset", "sample_is_complete", "subset_folder", "PHOTOS"]

MARKER = ".datapipe-sample.json"  # the parameters of the sample a folder holds (hidden: not a class)

# The real photographs shipped inside the scikit-image wheel.
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


def _files(images: int, classes: int) -> list[str]:
    return [f"class_{i % classes:03d}/img_{i:06d}.jpg" for i in range(images)]


def _marker(root: Path) -> dict | None:
    try:
        doc = json.loads((root / MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def sample_is_complete(root: str | os.PathLike, *, images: int, classes: int, seed: int) -> bool:
    """Whether ``root`` already holds exactly the sample of these parameters, every file written."""
    root = Path(root)
    params = {"images": images, "classes": classes, "seed": seed}
    marker = _marker(root)
    return (marker is not None and marker.get("params") == params and marker.get("complete") is True
            and all((root / f).is_file() for f in _files(images, classes)))


def _claim(root: Path, params: dict) -> None:
    """Refuse a folder that holds anything but a sample of the same parameters (finished or not)."""
    from ..errors import OutputError

    if root.exists() and not root.is_dir():
        raise OutputError(f"sample output {root} is a file, not a folder; choose a new or empty folder")
    if not root.exists() or not any(root.iterdir()):
        return
    marker = _marker(root)
    if marker is None:
        raise OutputError(f"sample output {root} is not empty; choose a new or empty folder (datapipe sample never "
                          "overwrites or adds to a folder it did not write)")
    if marker.get("params") != params:
        raise OutputError(f"{root} holds another sample ({marker.get('params')}); choose a new or empty folder, "
                          f"or rerun with those parameters")


def make_sample_dataset(
    root: str | os.PathLike, *, images: int = 2000, classes: int = 10, seed: int = 0, workers: int = 1
) -> Path:
    """Write ``images`` JPEGs into ``root/<class>/<n>.jpg`` (ImageNet layout).

    Args:
        root: output folder; created if missing. It must be empty or hold a sample of the same
            parameters (then a finished one is left as it is, an interrupted one completed); the
            parameters are recorded in ``root/.datapipe-sample.json``.
        images: number of images in total, spread evenly over the classes.
        classes: number of class folders.
        seed: the output is a pure function of (images, classes, seed).
        workers: processes to generate with (the output does not depend on it).

    Returns:
        The root folder.

    Raises:
        ArgumentError: a parameter out of range (checked before anything is written).
        OutputError: ``root`` holds anything else (a dataset of the user's, another sample).
        OutputWriteError: writing failed part-way (what was written is kept for the rerun).
    """
    from ..errors import ArgumentError
    from ..text import show

    if not isinstance(root, (str, os.PathLike)) or not os.fspath(root):
        raise ArgumentError(f"the sample's folder must be a path, got {show(root)}")
    from ..codecs import plain_int

    given = [plain_int(v) for v in (images, classes, seed, workers)]
    _check_params(images=given[0], classes=given[1], seed=given[2], workers=given[3])  # before anything is written
    images, classes, seed, workers = (int(v) for v in given)  # type: ignore[call-overload]  # checked: whole numbers
    root = Path(root)
    params = {"images": images, "classes": classes, "seed": seed}
    if sample_is_complete(root, **params):
        return root
    _check_room(root, images - (len(list(root.glob("*/*.jpg"))) if root.is_dir() else 0))  # what is left to write
    _claim(root, params)
    try:
        root.mkdir(parents=True, exist_ok=True)
        (root / MARKER).write_text(json.dumps({"params": params, "complete": False}), encoding="utf-8")
        _generate(root, images, classes, seed, workers)
        (root / MARKER).write_text(json.dumps({"params": params, "complete": True}), encoding="utf-8")
    except OSError as exc:  # the disk filling up, a read-only folder: rerunning completes the sample
        from ..errors import OutputWriteError

        where = exc.filename or root
        raise OutputWriteError(f"cannot write the sample: {exc.strerror or exc}: {where}; fix it and rerun to "
                               "complete it") from exc
    return root


# About what one sample image takes on disk (the photographs are ~416x362 JPEGs of 30-80 KiB), with a margin.
IMAGE_BYTES = 100 * 1024


def _check_room(root: Path, images: int, *, need: int | None = None, what: str = "") -> None:
    """Refuse, before writing, a sample that cannot fit on its disk (``images=10**12`` wrote until the disk was full):
    ``images`` to write, or ``need`` bytes for ``what`` (the demo's sample and cache) of that many."""
    from ..errors import ArgumentError

    folder = root.absolute()
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    try:
        st = os.statvfs(folder)
    except OSError:
        return
    need, free = images * IMAGE_BYTES if need is None else need, st.f_bavail * st.f_frsize
    if need > free:
        unit, scale = ("GiB", 2**30) if free >= 2**30 else ("MiB", 2**20)  # free < need: the smaller shows
        raise ArgumentError(f"--images {images:,} needs about {need / scale:,.1f} {unit}{what}, and the disk of "
                            f"{folder} has {free / scale:,.1f} {unit} free; lower --images or choose another folder")


def _check_params(*, images: object, classes: object, seed: object, workers: object) -> None:
    """Every parameter checked before a folder or a marker is written; the message names the flag."""
    from ..errors import ArgumentError
    from ..text import show

    for flag, value, least in (("--images", images, 1), ("--classes", classes, 1), ("--seed", seed, 0),
                               ("workers", workers, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ArgumentError(f"{flag} must be a whole number >= {least}, got {show(value)}")
    assert isinstance(images, int) and isinstance(classes, int) and isinstance(workers, int)
    most = 4 * (os.cpu_count() or 1)
    if workers > most:  # one process each: a million would fork a million
        raise ArgumentError(f"workers must be at most {most} (4 per core of this machine), got {workers}")
    if images < classes:  # class folders are made by their images: fewer images would make fewer classes
        raise ArgumentError(f"--images ({images}) must be at least --classes ({classes}), so that every class "
                            "gets an image; raise --images or lower --classes")


def _generate(root: Path, images: int, classes: int, seed: int, workers: int) -> None:
    if workers <= 1:
        _write_range(root, 0, images, classes, seed)
        return
    from concurrent.futures import ProcessPoolExecutor

    step = -(-images // (workers * 4))
    with ProcessPoolExecutor(workers) as pool:
        jobs = [pool.submit(_write_range, root, a, min(a + step, images), classes, seed)
                for a in range(0, images, step)]
        for job in jobs:
            job.result()


def subset_folder(source: Path, out: Path, images: int) -> Path:
    """Copy ``images`` files of the class folders in ``source`` (spread evenly over its sorted listing,
    so every class keeps its share) into ``out`` in the same class folders; reused when already there.

    ``out`` must be new, empty or an earlier subset: the files an earlier subset's marker
    (``.subset.json``) lists are replaced, nothing else is deleted.

    Raises:
        OutputError: ``out`` holds files this function did not copy there.
    """
    import shutil

    from datapipe.bench.peers import list_image_folder

    _, files = list_image_folder(source)
    if images < len(files):
        files = [files[i] for i in np.linspace(0, len(files) - 1, images).round().astype(int)]
    marker = out / ".subset.json"
    wanted = {"source": str(source.resolve()), "files": [str(p.relative_to(source)) for p, _ in files]}
    found = _subset_marker(marker)
    if found == wanted:
        return out
    _clear_subset(out, found)
    for path, _ in files:
        dest = out / path.relative_to(source)
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, dest)
    marker.write_text(json.dumps(wanted))
    return out


def _subset_marker(marker: Path) -> dict | None:
    try:
        found = json.loads(marker.read_text())
    except (OSError, ValueError):
        return None
    return found if isinstance(found, dict) else None


def _clear_subset(out: Path, found: dict | None) -> None:
    """Delete the files of an earlier subset in ``out`` (those its marker lists), refusing anything else."""
    from ..errors import OutputError
    from ..files import listed_files, remove_empty_folders

    if not out.exists():
        return
    present = sorted(p for p in out.rglob("*") if not p.is_dir())
    ours = {out / ".subset.json"} | listed_files(out, found.get("files") if found is not None else None)
    foreign = [p for p in present if p not in ours or p.is_symlink()]
    if foreign:
        raise OutputError(f"{out} holds {foreign[0].relative_to(out)}, which no earlier subset wrote; datapipe never "
                          "deletes files it did not write: move it or choose another folder")
    for p in present:
        p.unlink()
    remove_empty_folders(out)
