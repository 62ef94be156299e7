"""Loader speed, side by side in one run, interleaved rounds, ratios per round.

* ``pillow``: torch DataLoader over the source JPEGs, ImageFolder-style Pillow pipeline
  (decode, RandomResizedCrop 224, flip, to tensor), ``workers`` processes — the baseline;
* ``uint8``: DeviceLoader(device="cpu", output="uint8"): whole uint8 [256, 256, 256, 3] batches
  from the memory-mapped cache, ``workers`` reader threads;
* ``dataloader-uint8``: the same StreamingDataset in a plain torch DataLoader(batch_size=None,
  num_workers=workers) — worker processes, batches handed over through shared memory;
* ``train224``: DeviceLoader(device="cpu", augment=augment.train(224)) (no colour jitter):
  normalised float [256, 3, 224, 224], the same output as the baseline;
* ``memcpy``: one core copying a 256 MB buffer, for the bytes-per-second comparison.

    python benchmarks/loader_bench.py CACHE SOURCE [--workers 2] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch


def timed_epoch(loader, epoch: int) -> tuple[int, float]:
    from datapipe.bench.timing import timed_pass

    if hasattr(loader, "set_epoch"):
        loader.set_epoch(epoch)
    images, seconds, _ = timed_pass(loader)
    return images, seconds


def memcpy_gbps() -> float:
    src = np.ones(256 * 2**20, np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    t = time.perf_counter()
    for _ in range(5):
        np.copyto(dst, src)
    return 5 * src.nbytes / (time.perf_counter() - t) / 1e9


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("cache")
    p.add_argument("source")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()

    import datapipe
    from datapipe.bench.peers import get_peer

    sample_bytes = int(np.prod(datapipe.open(args.cache).shape))

    def ds():
        return datapipe.StreamingDataset(args.cache, batch_size=args.batch, shuffle=True, seed=0)

    loaders = {
        "pillow": get_peer("dataloader").loader(args.source, None, batch_size=args.batch, workers=args.workers),
        "uint8": datapipe.DeviceLoader(ds(), device="cpu", num_workers=args.workers, output="uint8"),
        "dataloader-uint8": torch.utils.data.DataLoader(ds(), batch_size=None, num_workers=args.workers,
                                                        persistent_workers=True),
        "train224": datapipe.DeviceLoader(ds(), device="cpu", num_workers=args.workers,
                                          augment=datapipe.augment.train(224)),
    }
    rates: dict[str, list[float]] = {k: [] for k in loaders}
    copy: list[float] = []
    for rnd in range(args.rounds + 1):  # round 0 warms up workers, page cache and memory maps
        for name, loader in loaders.items():
            if name == "dataloader-uint8":
                loader.dataset.set_epoch(rnd)
            n, dt = timed_epoch(loader, rnd)
            if rnd:
                rates[name].append(n / dt)
        if rnd:
            copy.append(memcpy_gbps())
    med = {k: statistics.median(v) for k, v in rates.items()}
    ratio = {k: statistics.median(a / b for a, b in zip(v, rates["pillow"], strict=True)) for k, v in rates.items()}
    gbps = {k: med[k] * sample_bytes / 1e9 for k in ("uint8", "dataloader-uint8")}
    for k in rates:
        extra = f", {gbps[k]:.2f} GB/s = {gbps[k] / statistics.median(copy):.0%} of one-core memcpy" if k in gbps else ""
        print(f"{k:<17} {med[k]:>9,.0f} img/s  {ratio[k]:>6.1f}x the Pillow DataLoader{extra}")
    print(f"memcpy (one core) {statistics.median(copy):.2f} GB/s")
    print(json.dumps({"images_per_s": rates, "ratio_vs_pillow": ratio, "memcpy_GBps": copy, "GBps": gbps,
                      "workers": args.workers, "batch": args.batch}))


if __name__ == "__main__":
    main()
