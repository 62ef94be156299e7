"""How close datapipe's training input is to torchvision's standard pipeline on the source files.

torchvision's standard ImageNet training pipeline draws ``RandomResizedCrop(224)`` over each *source*
image. datapipe draws the same distribution (:func:`datapipe.augment.sample_resized_crops`, the
parameters of torchvision's ``get_params``) over each *stored sample*, which is the source resized:

* ``--fit crop``: the centre square of the source, resized to ``size`` x ``size`` — a wide image
  loses its sides for good;
* ``--fit short``: the whole source scaled so that its shorter side is ``size`` (a pure scale), up to
  ``--max-aspect``: a longer side beyond ``max_aspect x size`` keeps only its centre.

For one epoch over the source (one crop per image), this maps every crop box datapipe's train
preset draws on a cache back to source coordinates and compares the boxes, relative to each source
image (top/h, left/w, height/h, width/w), with torchvision's drawn on the source itself:

* ``mean box``: the mean relative (top, left, height, width) and the mean share of the image's area a crop covers;
* ``centre spread``: the standard deviation of the crop centre's relative x and y;
* ``reachable``: the share of the source's pixels any crop can ever reach (torchvision: all);
* ``quantile |Δ|``: per relative coordinate, the mean |Δ| between datapipe's and torchvision's
  sorted values (matched quantiles of the two distributions), averaged over the four;
* ``coverage |Δ|``: how often each point of the image (a 32 x 32 grid over relative coordinates)
  lies inside the crop, over the epoch — mean |Δ| against torchvision's map, and the coverage of
  the outer tenth of the width (the left and right edges);
* ``paired IoU``: both sides draw from the same generator stream (the draws do not depend on the
  image's size), so image i gets the same random numbers on the source and on its sample; the mean
  IoU of the two boxes in source coordinates says how much the storage alone moves a crop
  (1.0: only rounding);
* ``images cut``: the share of images the stored sample does not show whole (crop: every non-square
  image; short: those beyond ``--max-aspect``).

torchvision itself is not needed: ``sample_resized_crops`` with the source's own (h, w) is
torchvision's ``RandomResizedCrop.get_params`` (ten attempts at a uniform area share in ``scale`` and
a log-uniform aspect in ``ratio``, the first that fits placed uniformly; else the centre crop with
the aspect clamped), batched.

    python benchmarks/fidelity_bench.py [--source /tmp/benchdata] [--images 1000] [--size 256] [--crop 224]
                                        [--max-aspect 2 1.25] [--workers 2] [--seed 0] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

GRID = 32  # coverage map resolution over relative image coordinates
EDGE = 0.1  # the outer share of the width whose coverage is reported


# ----------------------------------------------------------------------------- the mapping back to the source


@dataclass(frozen=True)
class Region:
    """The part of the (oriented) source a stored sample shows, in source pixels: a box and the
    scale from sample pixels to source pixels along each axis."""

    top: float
    left: float
    height: float
    width: float
    sy: float  # source pixels per sample pixel, vertically
    sx: float  # horizontally


def sample_region(source_hw: tuple[int, int], fit: str, size: int, max_aspect: float = 2.0) -> Region:
    """Where a sample of ``fit`` built from a ``source_hw`` image lies in that image (as
    :func:`datapipe.codecs.fit_image` resizes it: the centre square for crop; for short the whole
    image, or with a longer side beyond ``max_aspect x size`` its centre in proportion to the cap)."""
    from datapipe.codecs import DecodeSpec, fit_shape

    h, w = source_hw
    if fit == "crop":
        side = min(h, w)
        y0, x0 = (h - side) // 2, (w - side) // 2
        return Region(y0, x0, side, side, side / size, side / size)
    if fit != "short":
        raise ValueError(f"fit must be crop or short, got {fit!r}")
    shape = fit_shape(h, w, DecodeSpec(size=size, fit="short", max_aspect=max_aspect))
    top, left, rh, rw = 0, 0, h, w
    if shape.capped:  # as codecs._short_crop: the longer side's centre, in proportion to the cap
        short = min(h, w)
        if h <= w:
            rw = min(w, max(1, round(shape.width * short / shape.height)))
            left = (w - rw) // 2
        else:
            rh = min(h, max(1, round(shape.height * short / shape.width)))
            top = (h - rh) // 2
    return Region(top, left, rh, rw, rh / shape.height, rw / shape.width)


def to_source(boxes: np.ndarray, regions: list[Region]) -> np.ndarray:
    """Crop boxes (top, left, h, w) in sample pixels, one per sample, as float boxes in source pixels."""
    r = np.array([(g.top, g.left, g.sy, g.sx) for g in regions], np.float64).reshape(-1, 4)
    b = np.asarray(boxes, np.float64).reshape(-1, 4)
    return np.stack([r[:, 0] + b[:, 0] * r[:, 2], r[:, 1] + b[:, 1] * r[:, 3], b[:, 2] * r[:, 2], b[:, 3] * r[:, 3]], axis=1)


# ----------------------------------------------------------------------------- the epoch's crops


def torchvision_boxes(source_hw: np.ndarray, crop: int, seed: int) -> np.ndarray:
    """One RandomResizedCrop box per source image, drawn over the source: float [N, 4] in source pixels."""
    import torch

    from datapipe.augment import sample_resized_crops

    g = torch.Generator().manual_seed(seed)
    hw = torch.from_numpy(np.ascontiguousarray(source_hw, np.int64))
    return sample_resized_crops(len(hw), hw[:, 0].contiguous(), hw[:, 1].contiguous(), generator=g).numpy().astype(np.float64)


def datapipe_boxes(sample_hw: np.ndarray, regions: list[Region], crop: int, seed: int) -> np.ndarray:
    """One box per sample drawn by datapipe's train preset over the stored sample, mapped back to source pixels."""
    import torch

    from datapipe import augment

    hw = torch.from_numpy(np.ascontiguousarray(sample_hw, np.int64))
    params = augment.train(crop).sample(len(hw), hw[:, 0].contiguous(), hw[:, 1].contiguous(), seed)
    return to_source(params["crops"].numpy(), regions)


# ----------------------------------------------------------------------------- figures


def relative(boxes: np.ndarray, source_hw: np.ndarray) -> np.ndarray:
    """Boxes as (top/h, left/w, height/h, width/w) of their source image."""
    h, w = source_hw[:, 0].astype(np.float64), source_hw[:, 1].astype(np.float64)
    return np.stack([boxes[:, 0] / h, boxes[:, 1] / w, boxes[:, 2] / h, boxes[:, 3] / w], axis=1)


def coverage(rel: np.ndarray) -> np.ndarray:
    """[GRID, GRID]: the share of the epoch's crops that contain each grid point (cell centres, relative coordinates)."""
    centres = (np.arange(GRID) + 0.5) / GRID
    inside_y = (centres[None, :] >= rel[:, :1]) & (centres[None, :] < rel[:, :1] + rel[:, 2:3])  # [N, GRID]
    inside_x = (centres[None, :] >= rel[:, 1:2]) & (centres[None, :] < rel[:, 1:2] + rel[:, 3:4])
    return np.einsum("ny,nx->yx", inside_y.astype(np.float64), inside_x.astype(np.float64)) / max(len(rel), 1)


def iou(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Per row, the IoU of two (top, left, h, w) boxes."""
    ih = np.clip(np.minimum(a[:, 0] + a[:, 2], b[:, 0] + b[:, 2]) - np.maximum(a[:, 0], b[:, 0]), 0, None)
    iw = np.clip(np.minimum(a[:, 1] + a[:, 3], b[:, 1] + b[:, 3]) - np.maximum(a[:, 1], b[:, 1]), 0, None)
    inter = ih * iw
    return inter / (a[:, 2] * a[:, 3] + b[:, 2] * b[:, 3] - inter)


def figures(rel: np.ndarray, reference: np.ndarray | None, boxes: np.ndarray, ref_boxes: np.ndarray | None,
            reachable: np.ndarray, cut: np.ndarray) -> dict:
    """The figures of one system's epoch (``reference``: torchvision's relative boxes, None for torchvision itself)."""
    cov = coverage(rel)
    edge = max(1, round(EDGE * GRID))
    out = {
        "mean_box": [float(v) for v in rel.mean(axis=0)],  # top/h, left/w, height/h, width/w
        "mean_area": float((rel[:, 2] * rel[:, 3]).mean()),
        "centre_x_std": float((rel[:, 1] + rel[:, 3] / 2).std()),
        "centre_y_std": float((rel[:, 0] + rel[:, 2] / 2).std()),
        "reachable": float(reachable.mean()),
        "reachable_min": float(reachable.min()),
        "images_cut": float(cut.mean()),
        "edge_coverage": float(np.concatenate([cov[:, :edge], cov[:, -edge:]], axis=1).mean()),
        "centre_coverage": float(cov[GRID // 2 - 1 : GRID // 2 + 1, GRID // 2 - 1 : GRID // 2 + 1].mean()),
    }
    if reference is not None and ref_boxes is not None:
        q = np.abs(np.sort(rel, axis=0) - np.sort(reference, axis=0)).mean(axis=0)
        out["quantile_abs_delta"] = [float(v) for v in q]
        out["quantile_abs_delta_mean"] = float(q.mean())
        out["coverage_abs_delta"] = float(np.abs(cov - coverage(reference)).mean())
        out["paired_iou"] = float(iou(boxes, ref_boxes).mean())
    return out


# ----------------------------------------------------------------------------- data


def subset(source: Path, out: Path, images: int) -> Path:
    from datapipe.bench.sample import subset_folder

    return subset_folder(source, out, images)


def oriented_size(path: Path) -> tuple[int, int]:
    """(height, width) of an image file as the build sees it: EXIF orientations 5-8 swap the sides."""
    from PIL import Image

    with Image.open(path) as im:
        w, h = im.size
        orientation = im.getexif().get(0x0112, 1)
    return (w, h) if orientation in (5, 6, 7, 8) else (h, w)


# ----------------------------------------------------------------------------- run


def measure(src: Path, caches: dict[str, Path], *, crop: int, seed: int) -> dict:
    """torchvision on the source, then datapipe's train preset on each cache, over one epoch of the cache's samples."""
    import datapipe

    first = datapipe.open(next(iter(caches.values())))
    rel_paths = [first.path(i) for i in range(len(first))]
    source_hw = np.array([oriented_size(src / p) for p in rel_paths], np.int64)
    tv = torchvision_boxes(source_hw, crop, seed)
    tv_rel = relative(tv, source_hw)
    results = {"torchvision": figures(tv_rel, None, tv, None, np.ones(len(tv)), np.zeros(len(tv)))}
    for name, path in caches.items():
        cache = datapipe.open(path)
        if [cache.path(i) for i in range(len(cache))] != rel_paths:
            raise SystemExit(f"{path} does not hold the same samples in the same order as {first.root}")
        fit = str(cache.manifest.config["fit"])
        max_aspect = float(cache.manifest.config.get("max_aspect", 2.0))
        regions = [sample_region((int(h), int(w)), fit, cache.size, max_aspect) for h, w in source_hw]
        boxes = datapipe_boxes(cache.shapes, regions, crop, seed)
        reachable = np.array([g.height * g.width for g in regions]) / (source_hw[:, 0] * source_hw[:, 1])
        cut = reachable < 1.0
        results[name] = figures(relative(boxes, source_hw), tv_rel, boxes, tv, reachable, cut)
        results[name].update(fit=fit, encoding=cache.encoding, size=cache.size, samples=len(cache),
                             max_aspect=max_aspect if fit == "short" else None)
    aspect = np.maximum(source_hw[:, 0], source_hw[:, 1]) / np.minimum(source_hw[:, 0], source_hw[:, 1])
    return {"images": len(source_hw), "crop": crop, "seed": seed,
            "source_aspect": {"median": float(np.median(aspect)), "p90": float(np.percentile(aspect, 90)),
                              "max": float(aspect.max()), "square": float((aspect == 1).mean())},
            "systems": results}


def table(result: dict) -> str:
    """The markdown table of a result."""
    rows = ["| pipeline | mean box (top, left, h, w) | mean area | centre x / y std | reachable (min) | images cut "
            "| quantile \\|Δ\\| | edge / centre coverage | coverage \\|Δ\\| | paired IoU |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for name, f in result["systems"].items():
        label = "torchvision on the source" if name == "torchvision" else f"datapipe `--fit {f['fit']}`"
        if f.get("max_aspect"):
            label += f" `--max-aspect {f['max_aspect']:g}`"
        box = ", ".join(f"{v:.3f}" for v in f["mean_box"])
        q = f"{f['quantile_abs_delta_mean']:.4f}" if "quantile_abs_delta_mean" in f else "—"
        cd = f"{f['coverage_abs_delta']:.4f}" if "coverage_abs_delta" in f else "—"
        pi = f"{f['paired_iou']:.3f}" if "paired_iou" in f else "—"
        rows.append(f"| {label} | {box} | {f['mean_area']:.3f} | {f['centre_x_std']:.3f} / {f['centre_y_std']:.3f} "
                    f"| {f['reachable']:.3f} ({f['reachable_min']:.3f}) | {100 * f['images_cut']:.1f}% | {q} "
                    f"| {f['edge_coverage']:.3f} / {f['centre_coverage']:.3f} | {cd} | {pi} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--source", default="/tmp/benchdata", help="the source image folder (default /tmp/benchdata)")
    p.add_argument("--images", type=int, default=1000, help="images of the source used, spread over it (default 1000)")
    p.add_argument("--size", type=int, default=256, help="the caches' --size (default 256)")
    p.add_argument("--crop", type=int, default=224, help="RandomResizedCrop's output size (default 224)")
    p.add_argument("--max-aspect", type=float, nargs="+", default=[2.0, 1.25],
                   help="one fit-short cache per value of --max-aspect (default 2 and 1.25)")
    p.add_argument("--workers", type=int, default=2, help="Dask workers for the builds (default 2)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--work", default=None, help="where the subset and caches go (default: a temporary folder)")
    p.add_argument("--json", default=None, help="write the figures here")
    args = p.parse_args(argv)

    import datapipe

    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="fidelity-"))
    src = subset(Path(args.source), work / "src", args.images)
    caches = {}
    for fit, max_aspect in [*(("short", m) for m in args.max_aspect), ("crop", None)]:
        name = f"short-{max_aspect:g}" if fit == "short" else fit
        extra = {"max_aspect": max_aspect} if fit == "short" else {}
        datapipe.build(src, work / f"cache-{name}", size=args.size, fit=fit, cluster=datapipe.Cluster(workers=args.workers),
                       progress=False, **extra)
        caches[name] = work / f"cache-{name}"
    result = measure(src, caches, crop=args.crop, seed=args.seed)
    a = result["source_aspect"]
    print(f"{result['images']} images of {args.source}; aspect (long/short) median {a['median']:.2f}, 90th percentile "
          f"{a['p90']:.2f}, max {a['max']:.2f}, {100 * a['square']:.0f}% square; RandomResizedCrop({args.crop}), one epoch, "
          f"raw caches of --size {args.size}\n")
    print(table(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
        print(f"\nwrote {args.json}")
    if not args.work:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
