"""The colour jitter of the CPU train preset: what each of torchvision's four operations costs per image,
and the whole preset with the hue turned by the compiled kernel against Kornia's, side by side.

One thread (``torch.set_num_threads(1)``), as each of the loader's reader threads runs it. Samples
are real photographs (``datapipe.make_sample_dataset``), cut to 256² as a square cache stores them.
Rounds interleave the two sides; figures are medians over rounds, ratios taken per round.

* per operation: ms per 224² image in [0, 1] floats (brightness, contrast, saturation, the hue by
  the kernel, the hue by Kornia — what the CPU path ran before the kernel, and what the device path runs);
* per preset: images/s of ``augment.train(224, color_jitter=0.4)`` on batches of 64, kernel against
  Kornia, and of ``augment.train(224)`` without jitter for scale;
* with ``--old CHECKOUT``: the jitter preset of another datapipe checkout against this one, each
  measured in its own process (``PYTHONPATH`` picks the datapipe it imports), the sides alternating
  round by round, on the same samples and parameters.

    python benchmarks/jitter_bench.py [--rounds 7] [--batch 64] [--old CHECKOUT]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from datapipe import augment, make_sample_dataset, native


def samples(n: int) -> list[torch.Tensor]:
    with tempfile.TemporaryDirectory() as tmp:
        make_sample_dataset(tmp, images=n, classes=4, seed=0)
        files = sorted(p for p in Path(tmp).rglob("*") if p.suffix.lower() in (".jpg", ".jpeg"))[:n]
        out = []
        for p in files:
            img = Image.open(p).convert("RGB")
            s = min(img.size)
            img = img.crop(((img.width - s) // 2, (img.height - s) // 2, (img.width + s) // 2, (img.height + s) // 2))
            out.append(torch.from_numpy(np.asarray(img.resize((256, 256), Image.BILINEAR)).copy()))
    return out


def timed(fn, repeat: int) -> float:
    fn()
    t = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - t) / repeat


def child(path: str) -> None:
    """Print the jitter preset's images/s on the samples saved at ``path`` (one thread)."""
    torch.set_num_threads(1)
    images = list(torch.load(path))
    preset = augment.train(224, color_jitter=0.4)
    print(len(images) / timed(lambda: preset(images, seed=0), 3))


def versus(old: str, images: list[torch.Tensor], rounds: int) -> dict[str, float]:
    """The jitter preset of checkout ``old`` against this checkout's, alternating in fresh processes."""
    here = Path(__file__).resolve().parent.parent
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "samples.pt")
        torch.save(torch.stack(images), path)
        rates: dict[str, list[float]] = {"old": [], "new": []}
        for r in range(rounds):
            for side in (("old", "new") if r % 2 == 0 else ("new", "old")):
                env = {**os.environ, "PYTHONPATH": str(old if side == "old" else here)}
                out = subprocess.run([sys.executable, __file__, "--child", path], env=env, check=True,
                                     capture_output=True, text=True, cwd=tmp).stdout
                rates[side].append(float(out.split()[-1]))
    return {"old checkout, jitter preset img/s": round(statistics.median(rates["old"]), 1),
            "this checkout, jitter preset img/s": round(statistics.median(rates["new"]), 1),
            "new / old (median of per-round ratios)": round(statistics.median(
                n / o for n, o in zip(rates["new"], rates["old"], strict=True)), 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--old", help="another datapipe checkout to measure the jitter preset of, side by side")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args.child)
    if not native.available():
        raise SystemExit(f"the compiled kernels are needed for the comparison: {native.describe()}")
    torch.set_num_threads(1)
    images = samples(args.batch)
    x = torch.stack(images)[:, 16:240, 16:240].permute(0, 3, 1, 2).float().div(255)  # 224², channels_last
    n = len(x)
    f = torch.empty(n).uniform_(-0.1, 0.1, generator=torch.Generator().manual_seed(0))
    g = torch.empty(n).uniform_(0.6, 1.4, generator=torch.Generator().manual_seed(1))
    real_hue = native.hue

    def kornia_hue(*a, **k):
        return False

    def op(name):
        fn = {"brightness": augment._brightness, "contrast": augment._contrast, "saturation": augment._saturation,
              "hue": augment._hue, "hue_kornia": augment._hue}[name]
        factor = f if name.startswith("hue") else g
        return lambda: fn(x.clone(), factor)

    presets = {"jitter_kernel": augment.train(224, color_jitter=0.4), "plain": augment.train(224)}
    rows: dict[str, list[float]] = {}
    for r in range(args.rounds):
        for name in ("brightness", "contrast", "saturation", "hue", "hue_kornia"):
            native.hue = kornia_hue if name == "hue_kornia" else real_hue
            clone = timed(lambda: x.clone(), 3)
            rows.setdefault(f"{name} ms/img", []).append((timed(op(name), 3) - clone) / n * 1000)
        sides = ["kernel", "kornia"] if r % 2 == 0 else ["kornia", "kernel"]
        for side in sides:
            native.hue = real_hue if side == "kernel" else kornia_hue
            s = timed(lambda r=r: presets["jitter_kernel"](images, seed=r), 2)
            rows.setdefault(f"train(224, color_jitter=0.4), hue by {side}: img/s", []).append(n / s)
        native.hue = real_hue
        plain = timed(lambda r=r: presets["plain"](images, seed=r), 2)
        rows.setdefault("train(224) without jitter: img/s", []).append(n / plain)
    k = rows["train(224, color_jitter=0.4), hue by kernel: img/s"]
    o = rows["train(224, color_jitter=0.4), hue by kornia: img/s"]
    result = {name: round(statistics.median(v), 3) for name, v in rows.items()}
    result["jitter preset, kernel / kornia (median of per-round ratios)"] = round(
        statistics.median(a / b for a, b in zip(k, o, strict=True)), 2)
    result["hue, kornia / kernel"] = round(statistics.median(
        a / b for a, b in zip(rows["hue_kornia ms/img"], rows["hue ms/img"], strict=True) if b > 0), 1)
    assert not math.isnan(result["hue ms/img"])
    if args.old:
        result.update(versus(args.old, images, args.rounds))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
