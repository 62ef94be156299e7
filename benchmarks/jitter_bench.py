"""The colour jitter of the CPU train preset: what each of torchvision's four operations costs per image,
and the whole preset with the hue turned by the compiled kernel against Kornia's, side by side.

One thread (``torch.set_num_threads(1)``), as each of the loader's reader threads runs it. Samples
are real photographs (``datapipe.make_sample_dataset``), cut to 256² as a square cache stores them.
Rounds interleave the two sides; figures are medians over rounds, ratios taken per round.

* per operation: ms per 224² image in [0, 1] floats (brightness, contrast, saturation, hue), by the
  compiled kernels and by torch's operations and Kornia's hue (what runs without the kernels, and
  what the device path runs);
* per preset: images/s of ``augment.train(224, color_jitter=0.4)`` on batches of 64, kernels against
  torch, and of ``augment.train(224)`` without jitter for scale;
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
    x = torch.stack(images)[:, 16:240, 16:240].permute(0, 3, 1, 2).float().div(255).contiguous()  # 224², as the preset has each image
    n = len(x)
    f = torch.empty(n).uniform_(-0.1, 0.1, generator=torch.Generator().manual_seed(0))
    g = torch.empty(n).uniform_(0.6, 1.4, generator=torch.Generator().manual_seed(1))
    real_jitter = native.jitter

    def torch_ops(x, op, factors):  # what runs without the kernels: torch's operations, Kornia's hue
        return False

    ops = {"brightness": (augment._brightness, g), "contrast": (augment._contrast, g),
           "saturation": (augment._saturation, g), "hue": (augment._hue, f)}
    presets = {"jitter": augment.train(224, color_jitter=0.4), "plain": augment.train(224)}
    rows: dict[str, list[float]] = {}
    for r in range(args.rounds):
        sides = ["kernel", "torch"] if r % 2 == 0 else ["torch", "kernel"]
        for side in sides:
            native.jitter = real_jitter if side == "kernel" else torch_ops
            clone = timed(lambda: x.clone(), 3)
            for name, (fn, factor) in ops.items():
                ms = (timed(lambda fn=fn, factor=factor: fn(x.clone(), factor), 3) - clone) / n * 1000
                rows.setdefault(f"{name} ms/img, {side}", []).append(ms)
            s = timed(lambda r=r: presets["jitter"](images, seed=r), 2)
            rows.setdefault(f"train(224, color_jitter=0.4) img/s, {side}", []).append(n / s)
        native.jitter = real_jitter
        plain = timed(lambda r=r: presets["plain"](images, seed=r), 2)
        rows.setdefault("train(224) without jitter: img/s", []).append(n / plain)
    result = {name: round(statistics.median(v), 3) for name, v in rows.items()}
    k, t = rows["train(224, color_jitter=0.4) img/s, kernel"], rows["train(224, color_jitter=0.4) img/s, torch"]
    result["jitter preset, kernels / torch (median of per-round ratios)"] = round(
        statistics.median(a / b for a, b in zip(k, t, strict=True)), 2)
    assert not math.isnan(result["hue ms/img, kernel"])
    if args.old:
        result.update(versus(args.old, images, args.rounds))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
