"""Reading a batch from the cache: zarr-python against the memory map the loader uses.

The same shard files are read three ways per batch of shuffled indices: one zarr ``oindex`` call,
one zarr call per image, and the loader's gather (``Cache.read_batch``: one ``np.take`` per shard
from the memory-mapped data region of the same Zarr shard file). Results are checked equal.

    python benchmarks/zarr_vs_memmap.py CACHE [--batch 256] [--batches 5]
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("cache")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--batches", type=int, default=5)
    args = p.parse_args()

    import zarr

    import datapipe

    cache = datapipe.open(args.cache)
    groups = [zarr.open_group(str(cache.root / "shards" / n), mode="r") for n in cache.shard_names]
    arrays = [g["images"] for g in groups]
    rng = np.random.default_rng(0)
    batches = [np.sort(rng.choice(len(cache), args.batch, replace=False)) for _ in range(args.batches)]
    out = np.empty((args.batch, *cache.shape), np.uint8)
    lab = np.empty(args.batch, np.int64)

    def locate(idx):
        shard = np.searchsorted(cache.starts, idx, side="right") - 1
        return shard, idx - cache.starts[shard]

    def zarr_oindex(idx):
        shard, local = locate(idx)
        parts = [arrays[s].oindex[local[shard == s]] for s in np.unique(shard)]
        return np.concatenate(parts)

    def zarr_per_image(idx):
        shard, local = locate(idx)
        return np.stack([arrays[s][int(i)] for s, i in zip(shard, local, strict=True)])

    def memmap(idx):
        cache.read_batch(idx, out, lab)
        return out

    results = {}
    for name, fn in (("memmap gather (loader)", memmap), ("zarr oindex per shard", zarr_oindex),
                     ("zarr one call per image", zarr_per_image)):
        fn(batches[0])  # warm-up: page cache and metadata
        t = time.perf_counter()
        for idx in batches:
            got = fn(idx)
        dt = time.perf_counter() - t
        assert np.array_equal(got, memmap(batches[-1]).copy()), name
        results[name] = len(batches) * args.batch / dt
    base = results["memmap gather (loader)"]
    for name, rate in results.items():
        print(f"{name:<26} {rate:>10,.0f} img/s   memmap is {base / rate:,.1f}x faster")
    print(json.dumps({"batch": args.batch, "batches": args.batches, "images_per_s": results}))


if __name__ == "__main__":
    main()
