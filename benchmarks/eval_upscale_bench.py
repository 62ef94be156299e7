"""How close an upscaling ``augment.eval(S)`` is to torchvision's ``Resize(S)`` + ``CenterCrop(S)``.

For an ``eval(S)`` larger than the stored samples' shorter side (testing at a higher resolution than the cache was
built for), datapipe crops each stored sample to its centred square (a whole pixel of the stored sample) and resizes
that square up to S; torchvision resizes the whole sample first (its longer side truncated), then crops S x S with
CenterCrop's rounding. Both are applied here to the same stored samples of a ``--fit short`` cache, and compared:

* the mean |difference| per image in uint8 levels (mean over the images, and the worst image);
* where the window starts along the longer side, in stored pixels: torchvision's against datapipe's.

    python benchmarks/eval_upscale_bench.py [--images 1000] [--size 256] [--evals 288 320] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
from PIL import Image

import datapipe
from datapipe import augment

MEAN = torch.tensor([0.485, 0.456, 0.406])[:, None, None] * 255
STD = torch.tensor([0.229, 0.224, 0.225])[:, None, None] * 255


def centre(n: int, s: int) -> int:
    """torchvision CenterCrop's offset (Python's round: halves to even)."""
    return int(round((n - s) / 2.0))


def torchvision_eval(x: np.ndarray, s: int) -> tuple[torch.Tensor, float]:
    """Resize(s) (bilinear, antialiased, on a PIL image) + CenterCrop(s) of uint8 H x W x 3 ``x``, as float [3, s, s]
    in 0..255; and where the window starts along the longer side, in stored pixels."""
    h, w, _ = x.shape
    nh, nw = (s, int(s * w / h)) if h <= w else (int(s * h / w), s)
    resized = np.asarray(Image.fromarray(x).resize((nw, nh), Image.BILINEAR))
    top, left = centre(nh, s), centre(nw, s)
    start = left * w / nw if w > h else top * h / nh
    return torch.from_numpy(resized[top:top + s, left:left + s].copy()).permute(2, 0, 1).float(), start


def measure(cache_dir: Path, s: int) -> dict:
    cache = datapipe.open(cache_dir)
    ds = datapipe.StreamingDataset(cache_dir, batch_size=32, shuffle=False, return_index=True)
    diffs, gaps = [], []
    with datapipe.DeviceLoader(ds, device="cpu", augment=augment.eval(s), num_workers=0) as loader:
        for images, _, indices in loader:
            for k, i in enumerate(indices.tolist()):
                x, _ = cache[i]
                reference, start = torchvision_eval(x, s)
                ours = images[k] * STD + MEAN
                diffs.append(float((ours - reference).abs().mean()))
                h, w, _ = x.shape
                gaps.append(abs(start - centre(max(h, w), min(h, w))))
    return {"eval": s, "images": len(diffs), "mean_levels": round(float(np.mean(diffs)), 2),
            "worst_image_levels": round(float(np.max(diffs)), 2),
            "window_start_gap_max_px": round(float(np.max(gaps)), 2),
            "window_start_gap_mean_px": round(float(np.mean(gaps)), 2)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--images", type=int, default=1000)
    p.add_argument("--size", type=int, default=256)
    p.add_argument("--evals", type=int, nargs="+", default=[288, 320])
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        src, out = Path(tmp) / "src", Path(tmp) / "cache"
        datapipe.make_sample_dataset(src, images=args.images)
        subprocess.run([sys.executable, "-m", "datapipe.cli", "build", str(src), str(out), "--fit", "short",
                        "--size", str(args.size), "--quiet"], check=True)
        results = [measure(out, s) for s in args.evals]
    for r in results:
        print(f"eval({r['eval']}) of a --fit short --size {args.size} cache, {r['images']} images: mean "
              f"{r['mean_levels']} uint8 levels (worst image {r['worst_image_levels']}); window start "
              f"{r['window_start_gap_mean_px']} stored px from torchvision's on average, at most {r['window_start_gap_max_px']}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
